//! A metadata node with a state directory, killed (SIGKILL) while clients write and create
//! files, and started again: the namespace comes back with every change it had answered, the
//! data nodes join it again with their data, and the mounts carry on without a remount (open
//! files included, one of them unlinked while open).

use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfs_e2e::{client, MemServer, Mount};
use rfs_proto::message::GetStatFs;
use rfs_proto::MetadataChannel;

fn content(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u64).wrapping_mul(31).wrapping_add(seed * 7) as u8)
        .collect()
}

/// File `name` at `m`, with `bytes` written and left open: nothing committed yet.
fn written_and_open(m: &Mount, name: &str, bytes: &[u8]) -> fs::File {
    let f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path(name))
        .unwrap();
    f.write_all_at(bytes, 0).unwrap();
    f
}

/// What the creator did: files it was told were made (with their content), and those whose
/// creation failed (made or not: the answer was lost with the node).
struct Created {
    made: Vec<(String, Vec<u8>)>,
    unsure: Vec<String>,
}

/// Creates files one after another until `stop`: only those under way while the metadata node
/// was down (`down` at either end, or an outage counted in `outages` meanwhile) may fail.
fn creator(m: &Mount, stop: &AtomicBool, down: &AtomicBool, outages: &AtomicUsize) -> Created {
    let mut out = Created {
        made: Vec::new(),
        unsure: Vec::new(),
    };
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("d/c{i}");
        let data = content(i, 20_000 + (i as usize % 7) * 100_000);
        // An outage may begin and end while one create is under way (a slow VM).
        let (outage, outages_before) = (
            down.load(Ordering::Relaxed),
            outages.load(Ordering::Relaxed),
        );
        // Made once fsync says so: close(2) does not report a size left uncommitted.
        let made = fs::File::create(m.path(&name))
            .and_then(|mut f| std::io::Write::write_all(&mut f, &data).and_then(|()| f.sync_all()));
        match made {
            Ok(()) => out.made.push((name, data)),
            Err(e)
                if !outage
                    && !down.load(Ordering::Relaxed)
                    && outages.load(Ordering::Relaxed) == outages_before =>
            {
                panic!("creating {name}: {e}")
            }
            Err(e) => {
                println!("creating {name}: {e}");
                out.unsure.push(name);
            }
        }
        i += 1;
    }
    out
}

const BLOCK: usize = 64 << 10;

/// Overwrites blocks of an open file until `stop`, keeping a model of it. No write may fail,
/// not even while the metadata node is down: the data nodes took back every grant with it,
/// and a transfer they refuse goes again with a fresh map once the node is back.
fn overwriter(f: &fs::File, len: usize, stop: &AtomicBool) -> Vec<u8> {
    let mut model = vec![0u8; len];
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let at = ((n * 7919) as usize % (len / BLOCK)) * BLOCK;
        let data = content(1000 + n, BLOCK);
        if let Err(e) = f.write_all_at(&data, at as u64) {
            panic!("write {n} at {at}: {e}");
        }
        model[at..at + BLOCK].copy_from_slice(&data);
        n += 1;
    }
    println!("{n} overwrites through the open handle");
    model
}

#[test]
fn a_restarted_metadata_node_comes_back_with_everything_it_answered() {
    let mut meta = MemServer::durable_meta("restart", &[]);
    // Room for every file the creator makes: each takes a chunk, and a quick machine makes
    // 150 before the restart is over (192 MiB ran out once, failing a create with ENOSPC).
    let _first = MemServer::data(&meta, "320M", "1M");
    let _second = MemServer::data(&meta, "320M", "1M");
    let m = Mount::new(&meta, &["io_timeout=2"]);
    let other = Mount::new(&meta, &["io_timeout=2"]);
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("before"), content(1, 3 << 20)).unwrap();
    let len = 4 << 20;
    let held = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("held"))
        .unwrap();
    held.set_len(len as u64).unwrap();
    // Unlinked while open: it lives on through the handle, across the restart.
    let orphan = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("orphan"))
        .unwrap();
    orphan.write_all_at(&content(2, 2 << 20), 0).unwrap();
    fs::remove_file(m.path("orphan")).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let down = AtomicBool::new(false);
    let outages = AtomicUsize::new(0);
    let (created, model) = std::thread::scope(|s| {
        let creating = s.spawn(|| creator(&other, &stop, &down, &outages));
        let writing = s.spawn(|| overwriter(&held, len, &stop));
        std::thread::sleep(Duration::from_millis(800));
        outages.fetch_add(1, Ordering::Relaxed);
        down.store(true, Ordering::Relaxed);
        let killed = Instant::now();
        meta.restart_after(Duration::from_millis(300));
        let up = Instant::now();
        println!(
            "metadata node killed, up again {:?} later",
            killed.elapsed()
        );
        // The mounts carry on: the first stat through each that answers.
        for (name, mount) in [("writer", &m), ("creator", &other)] {
            let waited = Instant::now();
            while fs::metadata(mount.path("before")).is_err() {
                assert!(
                    waited.elapsed() < Duration::from_secs(20),
                    "{name}: no answer"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            println!(
                "metadata node up -> {name}'s mount working: {:?}",
                up.elapsed()
            );
        }
        down.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(800));
        stop.store(true, Ordering::Relaxed);
        (creating.join().unwrap(), writing.join().unwrap())
    });

    // Everything answered before or after the kill is there, and reads back as written.
    assert_eq!(fs::read(m.path("before")).unwrap(), content(1, 3 << 20));
    let mut back = vec![0u8; len];
    held.read_exact_at(&mut back, 0).unwrap();
    for at in (0..len).step_by(BLOCK) {
        let block = at..at + BLOCK;
        assert!(
            back[block.clone()] == model[block],
            "held file, block at {at}"
        );
    }
    let mut orphaned = vec![0u8; 2 << 20];
    orphan.read_exact_at(&mut orphaned, 0).unwrap();
    assert!(
        orphaned == content(2, 2 << 20),
        "the unlinked file lost its data"
    );
    orphan.write_all_at(b"still writable", 0).unwrap();
    println!(
        "{} files created, {} unsure",
        created.made.len(),
        created.unsure.len()
    );
    for (name, data) in &created.made {
        assert!(fs::read(m.path(name)).unwrap() == *data, "{name}");
    }
    let listed = fs::read_dir(m.path("d")).unwrap().count();
    assert!(
        listed >= created.made.len() && listed <= created.made.len() + created.unsure.len(),
        "{listed} names in d/"
    );
    drop((held, orphan));

    // Once more, with nothing under way: a clean restart loses nothing either.
    meta.restart();
    assert_eq!(fs::read(m.path("before")).unwrap(), content(1, 3 << 20));
    let (name, data) = created.made.last().unwrap();
    assert!(fs::read(other.path(name)).unwrap() == *data);
    drop((m, other));
}

/// A metadata node started again without its state knows none of the pools: each data node
/// wipes its own and joins as a new one, so no new file reads what the lost namespace's files
/// left there.
#[test]
fn data_nodes_a_restarted_node_does_not_know_wipe_their_pools() {
    let mut meta = MemServer::start_restartable(&["--memory", "0", "--chunk-size", "1M"]);
    let _data = MemServer::data(&meta, "32M", "1M");
    let m = Mount::new(&meta, &["io_timeout=2"]);
    let len = 4 << 20;
    fs::write(m.path("old"), vec![0xa5u8; len]).unwrap();
    drop(m);
    meta.restart();
    let c = client(&meta);
    let waited = Instant::now();
    while c.call(GetStatFs {}).map_or(0, |s| s.bytes_total) == 0 {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "the data node never joined again"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("data node joined again as new after {:?}", waited.elapsed());
    let m = Mount::new(&meta, &["io_timeout=2"]);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("new"))
        .unwrap();
    f.set_len(len as u64).unwrap();
    // One byte in each chunk allocates it: the same chunks of the pool the old file had.
    for chunk in 0..4u64 {
        f.write_all_at(b"x", chunk << 20).unwrap();
    }
    let mut back = vec![0u8; len];
    f.read_exact_at(&mut back, 0).unwrap();
    let leaked = back
        .iter()
        .enumerate()
        .filter(|&(i, &b)| i % (1 << 20) != 0 && b != 0)
        .count();
    assert_eq!(
        leaked, 0,
        "bytes of the lost namespace's file read through a new one"
    );
}

/// A close while the metadata node is stopped past the call's deadline reports EIO (as NFS
/// does), and loses nothing: the bytes are on a data node, and the file's size reaches the
/// metadata node once it runs again, so another mount reads the whole file. Before, the close
/// gave its handle back regardless, and the node refused every later commit through no handle:
/// the file stayed empty for everybody else.
#[test]
fn a_close_that_missed_a_stopped_metadata_node_commits_once_it_runs_again() {
    let meta = MemServer::start(&["--memory", "0", "--chunk-size", "1M", "--lease", "1"]);
    let _data = MemServer::data(&meta, "16M", "1M");
    let a = Mount::new(&meta, &["io_timeout=1"]);
    let bytes = content(7, 3 << 20);
    let f = written_and_open(&a, "f", &bytes);

    rfs_e2e::stop(meta.pid());
    let start = Instant::now();
    let closed = {
        use std::os::fd::IntoRawFd;
        let fd = f.into_raw_fd();
        // SAFETY: `fd` was just taken from the File, which no longer owns it.
        match unsafe { libc::close(fd) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    let took = start.elapsed();
    // The kernel's release goes after the close; its commit fails too, later, on its own
    // (2 s after it starts): the node resumes well after that.
    std::thread::sleep(Duration::from_secs(4));
    rfs_e2e::resume(meta.pid());
    let e = closed.expect_err("the commit cannot reach a stopped node");
    assert_eq!(rfs_e2e::errno(&e), libc::EIO, "{e}");
    assert!(took < Duration::from_secs(10), "close took {took:?}");

    let b = Mount::new(&meta, &["attr_timeout=0", "entry_timeout=0"]);
    let start = Instant::now();
    let size = || fs::metadata(b.path("f")).unwrap().len();
    while size() < bytes.len() as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the size never reached the metadata node: {} of {}",
            size(),
            bytes.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(fs::read(b.path("f")).unwrap() == bytes);
    assert_eq!(a.stat("commits_owed"), 0);
    assert!(a.stat("commits_resent") >= 1);
}

/// A file written at one mount and not closed yet (nothing committed) when the metadata node
/// restarts, then opened and closed at another mount before the first (stopped meanwhile) took
/// its handle again:
/// that close is the file's last as far as the restarted node knows, but it does not give back
/// the chunks past the size (the first mount wrote into them), and the first mount's close then
/// commits the whole file.
#[test]
fn a_close_in_a_restarts_grace_keeps_what_a_mount_not_back_yet_wrote_past_the_size() {
    let mut meta = MemServer::durable_meta("grace-trim", &["--lease", "2"]);
    let _data = MemServer::data(&meta, "32M", "1M");
    let a = Mount::new(&meta, &["io_timeout=2"]);
    let b = Mount::new(
        &meta,
        &["io_timeout=2", "attr_timeout=0", "entry_timeout=0"],
    );
    let bytes = content(9, 3 << 20);
    let f = written_and_open(&a, "f", &bytes);
    // a would reconnect and take its handle again at once: it is stopped until b's close.
    rfs_e2e::stop(a.pid() as u32);
    meta.restart();
    drop(fs::File::open(b.path("f")).unwrap());
    std::thread::sleep(Duration::from_millis(500)); // b's close reaches the node
    rfs_e2e::resume(a.pid() as u32);
    drop(f);
    let start = Instant::now();
    while fs::metadata(b.path("f")).unwrap().len() < bytes.len() as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "a's size never reached the node: {} bytes",
            fs::metadata(b.path("f")).unwrap().len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(fs::read(b.path("f")).unwrap() == bytes, "a's bytes");
    assert_eq!(a.stat("commits_over_cuts"), 0);
}

#[test]
fn an_idle_mount_takes_its_open_files_back_from_a_restarted_metadata_node() {
    // A short lease: the node's grace period (twice the lease) passes while the mount makes
    // no call, as a daemon's log file open and quiet for a while does.
    let mut meta = MemServer::durable_meta("idle", &["--lease", "2"]);
    let _data = MemServer::data(&meta, "64M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let mut log = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("log"))
        .unwrap();
    log.write_all(b"line 1\n").unwrap();
    log.sync_all().unwrap();
    meta.restart_after(Duration::from_millis(300));
    std::thread::sleep(Duration::from_secs(6));
    log.write_all(b"line 2\n")
        .expect("the handle was taken back while the mount was idle");
    log.sync_all().unwrap();
    drop(log);
    assert_eq!(fs::read(m.path("log")).unwrap(), b"line 1\nline 2\n");
}

/// Restarts of a metadata node that lends nothing leave no data node behind (each one added
/// its own empty pool as a new node before: 330 after 330 restarts, warned of at every start),
/// and a file written while a data node is still coming back waits for it, and gets every
/// copy, rather than fewer copies than the file system keeps.
#[test]
fn restarts_leave_no_node_behind_and_writes_wait_for_returning_copies() {
    use rfs_proto::message::ListNodes;
    let mut meta = MemServer::durable_meta(
        "phantom",
        // Copies are made again so slowly that one missing at allocation stays missing.
        &["--replicas", "2", "--repair-rate", "1M"],
    );
    let _a = MemServer::data(&meta, "64M", "1M");
    let b = MemServer::data(&meta, "64M", "1M");
    for _ in 0..3 {
        meta.restart();
    }
    let nodes = client(&meta).call(ListNodes {}).unwrap();
    assert_eq!(
        nodes.len(),
        3,
        "two data nodes and the metadata node's own: {nodes:?}"
    );
    // Mounted before: the restart's wait for the data nodes (5 s) covers only the write.
    let m = Mount::new(&meta, &[]);
    rfs_e2e::stop(b.pid());
    meta.restart();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            rfs_e2e::resume(b.pid());
        });
        fs::write(m.path("f"), content(5, 3 << 20)).unwrap();
    });
    let fs_now = client(&meta).call(GetStatFs {}).unwrap();
    assert_eq!(fs_now.chunks_short, 0, "every chunk got both copies");
    assert_eq!(fs::read(m.path("f")).unwrap(), content(5, 3 << 20));
}

/// Once every mount that held files open before a restart is back, the restart's grace is
/// over: what a close made during it kept past the file's size (chunks allocated ahead) goes
/// back then, and a file unlinked while open goes with its last close, rather than at the end
/// of twice the lease, which restarts in quick succession put off for good (the pool filled up
/// at half its real use in a crash run).
#[test]
fn a_restart_whose_mounts_are_all_back_ends_its_grace_at_once() {
    let mut meta = MemServer::durable_meta("grace-end", &["--lease", "10"]);
    let _data = MemServer::data(&meta, "64M", "1M");
    let m = Mount::new(&meta, &[]);
    let c = client(&meta);
    let free = || c.call(GetStatFs {}).unwrap().bytes_free >> 20;
    let empty = free();
    let kept = written_and_open(&m, "kept", &content(3, 4 << 20));
    let gone = written_and_open(&m, "gone", &content(4, 1 << 20));
    fs::remove_file(m.path("gone")).unwrap();
    assert!(
        free() < empty - 5,
        "chunks allocated ahead of the writes: {} of {empty} free",
        free()
    );
    meta.restart();
    let c = client(&meta);
    let free = || c.call(GetStatFs {}).unwrap().bytes_free >> 20;
    // The mount comes back (its redial takes the handles again), and closes both.
    drop(kept);
    drop(gone);
    let start = Instant::now();
    while free() < empty - 4 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} chunks free, {empty} before (the grace lasts 20 s)",
            free()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(fs::read(m.path("kept")).unwrap(), content(3, 4 << 20));
    assert!(!m.path("gone").exists());
}
