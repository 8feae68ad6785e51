//! Several mounts of one namespace, large files over two nodes, and a storage node dying.

use std::fs;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rfs_e2e::{direct_read, errno, open_direct, rfs, MemServer, Mount};

#[test]
fn two_mounts_see_each_others_closed_files() {
    let server = MemServer::meta("64M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &["attr_timeout=0", "entry_timeout=0"]);
    fs::write(a.path("shared"), b"from a").unwrap();
    assert_eq!(fs::read(b.path("shared")).unwrap(), b"from a");
    let mut data = fs::read(b.path("shared")).unwrap();
    data.extend_from_slice(&vec![1u8; 3 << 20]);
    fs::write(b.path("shared"), &data).unwrap();
    // Close-to-open: a fresh open on `a` sees b's closed file.
    let f = fs::File::open(a.path("shared")).unwrap();
    assert_eq!(f.metadata().unwrap().len(), data.len() as u64);
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data);
    fs::create_dir(a.path("dir")).unwrap();
    assert!(b.path("dir").is_dir());
}

#[test]
fn large_files_span_many_chunks_on_two_nodes() {
    let meta = MemServer::meta("96M", "1M");
    let _data = MemServer::data(&meta, "96M", "1M");
    let m = Mount::new(&meta, &[]);
    let data: Vec<u8> = (0..(150u32 << 20) / 4)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    fs::write(m.path("big"), &data).unwrap();
    assert!(fs::read(m.path("big")).unwrap() == data);
    let stats = fs::read_to_string(m.path(".rfs-stats")).unwrap();
    assert!(stats
        .lines()
        .any(|l| l.starts_with("bytes_written ") && l[14..].parse::<u64>().unwrap() >= 150 << 20));
}

#[test]
fn a_dead_storage_node_fails_io_with_eio_and_nothing_hangs() {
    let meta = MemServer::meta("16M", "1M");
    let mut data = MemServer::data(&meta, "16M", "1M");
    let mut m = Mount::new(&meta, &["io_timeout=2"]);
    // One-chunk files alternate between the nodes.
    for i in 0..8 {
        fs::write(m.path(&format!("f{i}")), vec![i as u8; 1 << 20]).unwrap();
    }
    data.kill();
    let start = Instant::now();
    let (mut ok, mut eio) = (0, 0);
    for i in 0..8 {
        // Around the page cache: the pages our writes went through are still good (nobody
        // changed the files), and where the kernel cached them (before Linux 6.6 write-only
        // handles go through it) they would answer without asking the node.
        let f = open_direct(m.path(&format!("f{i}")), false);
        match direct_read(&f, 512 << 10).0 {
            Ok(d) => {
                assert_eq!(d, vec![i as u8; 4096]);
                ok += 1;
            }
            Err(e) => {
                assert_eq!(errno(&e), libc::EIO, "{e}");
                eio += 1;
            }
        }
    }
    let took = start.elapsed();
    assert!(ok > 0, "files on the live node still work");
    assert!(eio > 0, "files on the dead node fail");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    // New files still work (allocated on the live node), and unmount is clean.
    fs::write(m.path("after"), b"still here").unwrap();
    assert_eq!(fs::read(m.path("after")).unwrap(), b"still here");
    assert!(m.unmount());
}

/// The availability issue's finding: a storage node stopped with SIGSTOP blocked O_DIRECT
/// reads for as long as it stayed stopped. Now every read ends within io_timeout (EIO for the
/// stopped node's files, data for the others), later ones fail at once while the node is down
/// and within io_timeout when it is dialled again, and the files are served again once it resumes, with nothing remounted.
#[test]
fn a_stopped_storage_node_fails_reads_within_io_timeout_and_serves_again_once_resumed() {
    let meta = MemServer::meta("16M", "1M");
    let data = MemServer::data(&meta, "16M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let content = |i: usize| vec![i as u8 + 1; 1 << 20];
    // One-chunk files alternate between the nodes; kept open, so that no grant or revocation
    // needs the stopped node.
    let files: Vec<fs::File> = (0..6)
        .map(|i| {
            fs::write(m.path(&format!("f{i}")), content(i)).unwrap();
            let f = open_direct(m.path(&format!("f{i}")), false);
            assert_eq!(direct_read(&f, 4096).0.unwrap(), content(i)[..4096]);
            f
        })
        .collect();

    rfs_e2e::stop(data.pid());
    let stop = Instant::now();
    let mut failed = Vec::new();
    for pass in 0..3 {
        for (i, f) in files.iter().enumerate() {
            let (r, took) = direct_read(f, 8192);
            println!("pass {pass} f{i}: {took:?} {:?}", r.as_ref().err());
            assert!(took < Duration::from_millis(2500), "f{i} took {took:?}");
            match r {
                Ok(d) => assert_eq!(d, content(i)[..4096]),
                Err(e) => {
                    assert_eq!(errno(&e), libc::EIO, "{e}");
                    failed.push(i);
                }
            }
        }
        // Past the client's back-off: the next pass dials the stopped node again.
        std::thread::sleep(Duration::from_millis(1100));
    }
    failed.sort_unstable();
    failed.dedup();
    assert!(
        !failed.is_empty() && failed.len() < files.len(),
        "the stopped node's files fail, the others do not: {failed:?}"
    );
    rfs_e2e::resume(data.pid());
    println!("stopped for {:?}", stop.elapsed());

    let resumed = Instant::now();
    for &i in &failed {
        loop {
            match direct_read(&files[i], 12288).0 {
                Ok(d) => {
                    assert_eq!(d, content(i)[..4096]);
                    break;
                }
                Err(e) => assert!(
                    resumed.elapsed() < Duration::from_secs(10),
                    "f{i} still failing after the node resumed: {e}"
                ),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    println!("served again {:?} after resuming", resumed.elapsed());
    drop(files);
    assert_eq!(
        fs::read(m.path("f0")).unwrap(),
        content(0),
        "closing reaches the resumed node"
    );
}

/// Write-behind on a stopped node: a write is answered before its bytes land, so the failure
/// (the node stays silent past io_timeout) comes back from close, as NFS reports it, within
/// the deadline; an O_DSYNC write waits and fails itself. Nothing hangs, and the other node's
/// files lose nothing.
#[test]
fn a_write_that_fails_after_it_was_answered_is_reported_by_close_and_o_dsync_waits() {
    use std::os::fd::IntoRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let meta = MemServer::meta("16M", "1M");
    let data = MemServer::data(&meta, "16M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    // One-chunk files alternate between the nodes; opened and written before the stop, so
    // that no grant needs the stopped node.
    let open = |i: usize, flags: i32| {
        fs::OpenOptions::new()
            .write(true)
            .custom_flags(flags)
            .open(m.path(&format!("f{i}")))
            .unwrap()
    };
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), vec![1u8; 1 << 20]).unwrap();
    }
    let plain: Vec<fs::File> = (0..6).map(|i| open(i, 0)).collect();
    let dsync: Vec<fs::File> = (0..6).map(|i| open(i, libc::O_DSYNC)).collect();
    for f in &plain {
        f.write_all_at(&[1u8], 0).unwrap();
    }

    rfs_e2e::stop(data.pid());
    let stopped = Instant::now();
    let (mut answered, mut closes_failed, mut dsync_failed) = (0, Vec::new(), Vec::new());
    // Under load this loop may outlast io_timeout: the stopped node is then known to have
    // failed, and a write to one of its files fails at once (as a failure at close would).
    let mut writes_failed = Vec::new();
    for (i, f) in plain.iter().enumerate() {
        match f.write_all_at(&[2u8; 4096], 0) {
            // With the node stopped, no write can have landed: an answer came before.
            Ok(()) => answered += 1,
            Err(e) if errno(&e) == libc::EIO && stopped.elapsed() > Duration::from_secs(1) => {
                writes_failed.push(i)
            }
            Err(e) => panic!("f{i}: {e} {:?} after the stop", stopped.elapsed()),
        }
    }
    for (i, f) in plain.into_iter().enumerate() {
        let fd = f.into_raw_fd();
        let start = Instant::now();
        // SAFETY: `fd` was just taken from the File, which no longer owns it.
        let closed = unsafe { libc::close(fd) };
        let took = start.elapsed();
        assert!(
            took < Duration::from_millis(3500),
            "close of f{i} took {took:?}"
        );
        if closed != 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(errno(&e), libc::EIO, "f{i}: {e}");
            closes_failed.push(i);
        }
    }
    for (i, f) in dsync.iter().enumerate() {
        let start = Instant::now();
        let r = f.write_all_at(&[3u8; 4096], 8192);
        let took = start.elapsed();
        assert!(
            took < Duration::from_millis(3500),
            "O_DSYNC write to f{i} took {took:?}"
        );
        if let Err(e) = r {
            assert_eq!(errno(&e), libc::EIO, "f{i}: {e}");
            dsync_failed.push(i);
        }
    }
    rfs_e2e::resume(data.pid());
    drop(dsync);
    assert_eq!(
        answered + writes_failed.len(),
        6,
        "plain writes are answered before they land"
    );
    assert!(
        answered > 0,
        "at least the first write, before io_timeout passed"
    );
    // A file whose write failed fails at its close too.
    let mut failed = [closes_failed.clone(), writes_failed].concat();
    failed.sort_unstable();
    failed.dedup();
    assert!(
        !failed.is_empty() && failed.len() < 6,
        "the stopped node's files fail (at close), the others do not: {failed:?}"
    );
    assert_eq!(
        failed, dsync_failed,
        "O_DSYNC writes fail on the same files"
    );
    for i in (0..6).filter(|i| !failed.contains(i)) {
        let back = fs::read(m.path(&format!("f{i}"))).unwrap();
        assert_eq!(back[..4096], [2u8; 4096], "f{i}");
        assert_eq!(back[8192..12288], [3u8; 4096], "f{i}");
        assert_eq!(back.len(), 1 << 20);
    }
}

/// A client stopped (SIGSTOP; a paused VM, a frozen cgroup, heavy swapping) for longer than
/// its io_timeout, with writes in flight to a node that answered them meanwhile: once it runs
/// again, the answers waiting in its sockets count, and nothing fails. Before, its pollers,
/// running before the transport had read those answers, judged the node late and failed
/// every write in flight and the fsync after (EIO), with the node healthy throughout.
#[test]
fn a_client_stopped_past_its_io_timeout_fails_nothing_a_healthy_node_answered() {
    let node = MemServer::meta("96M", "1M");
    let m = Mount::new(&node, &["io_timeout=1"]);
    let f = fs::File::create(m.path("f")).unwrap();
    let block: Vec<u8> = (0..256 << 10).map(|i| (i % 251) as u8).collect();
    let blocks = 128u64; // 32 MiB, written over and over
    let done = std::sync::atomic::AtomicBool::new(false);
    let written = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut i = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) || i < blocks {
                f.write_all_at(&block, (i % blocks) * block.len() as u64)?;
                i += 1;
            }
            f.sync_all()
        });
        // Which thread runs first after a stop is luck: a few stops.
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(300));
            rfs_e2e::stop(m.pid() as u32);
            std::thread::sleep(Duration::from_millis(1500));
            rfs_e2e::resume(m.pid() as u32);
        }
        std::thread::sleep(Duration::from_millis(300));
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap()
    });
    written.expect("writes and fsync across the stop");
    let back = fs::read(m.path("f")).unwrap();
    assert_eq!(back.len() as u64, blocks * block.len() as u64);
    assert!(back.chunks(block.len()).all(|b| b == block));
}

/// The copies node `node` holds, as `rfs status --json` printed in `json` says.
fn copies_on(json: &str, node: &str) -> u64 {
    let at = json
        .find(&format!("\"address\":\"{node}\""))
        .expect("the node is listed");
    json_number(&json[at..], "copies")
}

/// `rfs status` lists every data node and every client session with what it holds, as text
/// and as JSON, within a second; a user who is not root is refused.
#[test]
fn rfs_status_lists_nodes_and_clients() {
    let meta = MemServer::meta("32M", "1M");
    let data = MemServer::data(&meta, "16M", "1M");
    let m = Mount::new(&meta, &[]);
    let held = fs::File::create(m.path("held")).unwrap();
    held.write_at(b"x", 0).unwrap();
    let addr = meta.addr.to_string();
    let start = Instant::now();
    let out = rfs(&["status", &addr, "--json"]);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = String::from_utf8(out.stdout).unwrap();
    assert!(json.starts_with("{\"nodes\":[{\"id\":0,"), "{json}");
    assert_eq!(json.matches("\"state\":\"up\"").count(), 2, "{json}");
    assert!(
        json.contains(&format!("\"address\":\"{}\"", data.addr)),
        "{json}"
    );
    assert!(
        json.contains("\"open_files\":1,"),
        "the mount's open file: {json}"
    );
    assert!(json.contains("\"chunks_short\":0,"), "{json}");
    let text = rfs(&["status", &addr]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("2 data nodes (2 up)"), "{text}");
    assert!(text.contains("(the metadata node)"), "{text}");
    drop(held);

    // A user who is not root, holding the secret, is refused by the node.
    let theirs = std::env::temp_dir().join(format!("rfs-status-secret-{}", std::process::id()));
    std::fs::write(&theirs, rfs_e2e::secret().unwrap()).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&theirs, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let as_user = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(rfs_e2e::bin("rfs"))
        .args(["status", &addr, "--transport", &rfs_e2e::transport()])
        .arg("--secret-file")
        .arg(&theirs)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&theirs);
    let said = String::from_utf8_lossy(&as_user.stderr);
    assert!(!as_user.status.success());
    assert!(said.contains("it is for root"), "{said}");
}

/// A metadata node and a data node (48M and 32M pools, 1M chunks), a mount, and `n` files of
/// 1.5 MiB and more written through it (spread over both nodes, one copy per chunk).
fn files_on_two_nodes(n: u8) -> (MemServer, MemServer, Mount, Vec<(String, Vec<u8>)>) {
    let meta = MemServer::meta("48M", "1M");
    let data = MemServer::data(&meta, "32M", "1M");
    let m = Mount::new(&meta, &[]);
    let files: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| (format!("f{i}"), vec![i + 1; (3 << 19) + i as usize * 4099]))
        .collect();
    for (name, bytes) in &files {
        fs::write(m.path(name), bytes).unwrap();
    }
    (meta, data, m, files)
}

/// Every one of `files` reads back the same on a new mount of `meta`.
fn every_file_whole_on_a_fresh_mount(meta: &MemServer, files: &[(String, Vec<u8>)]) {
    let fresh = Mount::new(meta, &[]);
    for (name, bytes) in files {
        assert!(fs::read(fresh.path(name)).unwrap() == *bytes, "{name}");
    }
}

/// `rfs drain` moves every copy off a data node (one copy per chunk, the default): it waits
/// until the node holds nothing, the node shows as draining meanwhile and takes no new
/// chunks, and once it is killed every file reads back whole, old and new, on a fresh mount.
/// Killed undrained, its files were unreadable (EIO).
#[test]
fn a_drained_node_can_be_killed_losing_nothing() {
    let (meta, mut data, m, files) = files_on_two_nodes(8);
    let (addr, node) = (meta.addr.to_string(), data.addr.to_string());
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert!(
        copies_on(&status, &node) > 0,
        "the data node holds copies: {status}"
    );
    let start = Instant::now();
    let out = rfs(&["drain", &addr, &node]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("holds nothing"), "{said}");
    println!("drained in {:?}: {said}", start.elapsed());
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert!(status.contains("\"state\":\"draining\""), "{status}");
    fs::write(m.path("new"), vec![9u8; 3 << 20]).unwrap();
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert_eq!(
        copies_on(&status, &node),
        0,
        "a draining node took new chunks: {status}"
    );
    // Undrained it is up again and takes new chunks; drained with --no-wait, rfs returns at
    // once, the node draining, and the copies move meanwhile.
    assert!(rfs(&["undrain", &addr, &node]).status.success());
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert!(!status.contains("\"state\":\"draining\""), "{status}");
    fs::write(m.path("after"), vec![5u8; 4 << 20]).unwrap();
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert!(copies_on(&status, &node) > 0, "{status}");
    assert!(rfs(&["drain", &addr, &node, "--no-wait"]).status.success());
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert!(status.contains("\"state\":\"draining\""), "{status}");
    rfs_e2e::within(Duration::from_secs(60), "the node drained", || {
        std::thread::sleep(Duration::from_millis(100));
        let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
        copies_on(&status, &node) == 0
    });
    data.kill();
    let mut all = files;
    all.push(("new".into(), vec![9u8; 3 << 20]));
    all.push(("after".into(), vec![5u8; 4 << 20]));
    every_file_whole_on_a_fresh_mount(&meta, &all);
    // An unknown node is a usage error.
    let out = rfs(&["drain", &addr, "127.0.0.1:1"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `rfs rebalance` after a node joined an existing cluster whose metadata node moves copies
/// only when asked (`--manual-rebalance`): copies move until both nodes hold the same share of
/// their pools within a tenth, and every file reads back whole on a fresh mount. Before it,
/// the new node held nothing and all of them stayed where they were.
#[test]
fn a_rebalance_evens_the_fill_out_after_a_node_joins() {
    let meta = MemServer::start(&[
        "--memory",
        "32M",
        "--chunk-size",
        "1M",
        "--manual-rebalance",
    ]);
    let m = Mount::new(&meta, &[]);
    let files: Vec<(String, Vec<u8>)> = (0..6u8)
        .map(|i| (format!("f{i}"), vec![i + 1; (2 << 20) + i as usize * 7919]))
        .collect();
    for (name, bytes) in &files {
        fs::write(m.path(name), bytes).unwrap();
    }
    let data = MemServer::data(&meta, "32M", "1M");
    let addr = meta.addr.to_string();
    let copies = |json: &str, node: &str| copies_on(json, node) as f64;
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert_eq!(copies(&status, &data.addr.to_string()), 0.0, "{status}");
    let out = rfs(&["rebalance", &addr]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("balanced"), "{said}");
    println!("{said}");
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    let (a, b) = (
        copies(&status, &addr),
        copies(&status, &data.addr.to_string()),
    );
    let mean = (a + b) / 2.0;
    assert!(
        a <= mean * 1.1 + 1.0 && b <= mean * 1.1 + 1.0 && b > 0.0,
        "copies {a} and {b} on equal pools: {said}"
    );
    assert!(status.contains("\"rebalancing\":false"), "{status}");
    every_file_whole_on_a_fresh_mount(&meta, &files);

    // With --no-wait it returns at once and the copies move meanwhile.
    let third = MemServer::data(&meta, "32M", "1M");
    let out = rfs(&["rebalance", &addr, "--no-wait"]);
    assert!(out.status.success(), "{out:?}");
    rfs_e2e::within(
        Duration::from_secs(60),
        "a share for the third node",
        || {
            std::thread::sleep(Duration::from_millis(100));
            let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
            status.contains("\"rebalancing\":false")
                && copies(&status, &third.addr.to_string()) > 0.0
        },
    );
    every_file_whole_on_a_fresh_mount(&meta, &files);
}

/// By default a node that joins gets its share by itself: copies move to it until both nodes'
/// fill is within a tenth of the mean, while a reader checks every file all along (O_DIRECT:
/// from the nodes, not the page cache).
#[test]
fn a_node_that_joins_gets_its_share_of_the_copies_by_itself() {
    let meta = MemServer::meta("32M", "1M");
    let m = Mount::new(&meta, &[]);
    let files: Vec<(String, Vec<u8>)> = (0..6u8)
        .map(|i| (format!("f{i}"), vec![i + 1; (2 << 20) + i as usize * 7919]))
        .collect();
    for (name, bytes) in &files {
        fs::write(m.path(name), bytes).unwrap();
    }
    let data = MemServer::data(&meta, "32M", "1M");
    let (addr, node) = (meta.addr.to_string(), data.addr.to_string());
    let start = Instant::now();
    let status = loop {
        for (name, bytes) in &files {
            let f = open_direct(m.path(name), false);
            // A page of each chunk, from the nodes.
            for at in (0..bytes.len() as u64 - 4096).step_by(1 << 20) {
                let (read, _) = direct_read(&f, at);
                let at = at as usize;
                assert!(
                    read.unwrap() == bytes[at..at + 4096],
                    "{name} at {at} while copies move"
                );
            }
        }
        let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
        let (a, b) = (
            copies_on(&status, &addr) as f64,
            copies_on(&status, &node) as f64,
        );
        let mean = (a + b) / 2.0;
        if b > 0.0 && a <= mean * 1.1 + 1.0 && b <= mean * 1.1 + 1.0 {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not even after a minute: {status}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    println!("even after {:?}: {status}", start.elapsed());
    every_file_whole_on_a_fresh_mount(&meta, &files);
}

/// A data node asked to stop while the metadata node is paused (SIGSTOP, 8 s) waits for it
/// and then drains: it exits once its copies moved, and every file reads back whole. Before,
/// it gave up at its first try to reach the metadata node and took the files with it.
#[test]
fn a_data_node_stopping_while_the_metadata_node_is_paused_drains_once_it_answers() {
    let (meta, mut data, _m, files) = files_on_two_nodes(6);
    // SAFETY: signals to our own child processes.
    unsafe {
        libc::kill(meta.pid() as i32, libc::SIGSTOP);
        libc::kill(data.pid() as i32, libc::SIGTERM);
    }
    std::thread::sleep(Duration::from_secs(8));
    // SAFETY: as above.
    unsafe { libc::kill(meta.pid() as i32, libc::SIGCONT) };
    let exit = data
        .wait_exit(Duration::from_secs(60))
        .expect("the node stops once its copies moved");
    assert!(exit.success(), "it stopped holding copies: {exit:?}");
    every_file_whole_on_a_fresh_mount(&meta, &files);
}

/// A data node stopped by SIGTERM while it holds the only copy of files (one copy per chunk,
/// the default) moves them to the other nodes first, then exits: every file reads back whole.
/// Before, SIGTERM made them unreadable (EIO).
#[test]
fn a_data_node_stopped_by_sigterm_moves_its_copies_off_first() {
    let (meta, mut data, _m, files) = files_on_two_nodes(8);
    let (addr, node) = (meta.addr.to_string(), data.addr.to_string());
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert!(
        copies_on(&status, &node) > 0,
        "the data node holds copies: {status}"
    );
    let start = Instant::now();
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(data.pid() as i32, libc::SIGTERM) };
    let exit = data
        .wait_exit(Duration::from_secs(60))
        .expect("the node stops once its copies moved");
    assert!(exit.success(), "it stopped holding copies: {exit:?}");
    println!("stopped in {:?}", start.elapsed());
    let status = String::from_utf8(rfs(&["status", &addr, "--json"]).stdout).unwrap();
    assert_eq!(copies_on(&status, &node), 0, "{status}");
    every_file_whole_on_a_fresh_mount(&meta, &files);

    // With --drain-on-stop 0 a data node stops at once, as before.
    let m = meta.addr.to_string();
    let mut quick = MemServer::start(&["--memory", "8M", "--join", &m, "--drain-on-stop", "0"]);
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(quick.pid() as i32, libc::SIGTERM) };
    assert!(
        quick.wait_exit(Duration::from_secs(5)).is_some(),
        "--drain-on-stop 0 stops at once"
    );
}

/// A hard mount rides out stopped nodes: a read from a stopped data node and a lookup at a
/// stopped metadata node wait, however long, and are answered right once the node runs again.
/// The same on a soft mount (the default) fail with EIO.
#[test]
fn a_hard_mount_waits_for_stopped_nodes_where_a_soft_one_fails() {
    let meta = MemServer::start(&["--memory", "16M", "--lease", "1"]);
    let data = MemServer::data(&meta, "16M", "1M");
    let hard = Mount::new(&meta, &["io_timeout=1", "hard"]);
    let soft = Mount::new(&meta, &["io_timeout=1"]);
    let content = |i: usize| vec![i as u8 + 1; 1 << 20];
    let open = |m: &Mount, i: usize| open_direct(m.path(&format!("f{i}")), false);
    // One-chunk files alternate between the nodes.
    for i in 0..4 {
        fs::write(hard.path(&format!("f{i}")), content(i)).unwrap();
    }
    let (hard_files, soft_files): (Vec<_>, Vec<_>) =
        (0..4).map(|i| (open(&hard, i), open(&soft, i))).unzip();
    for (i, f) in hard_files.iter().chain(&soft_files).enumerate() {
        assert_eq!(direct_read(f, 0).0.unwrap(), content(i % 4)[..4096]);
    }

    rfs_e2e::stop(data.pid());
    // The files on the stopped node.
    let stopped: Vec<usize> = (0..4)
        .filter(|&i| {
            direct_read(&soft_files[i], 4096)
                .0
                .is_err_and(|e| errno(&e) == libc::EIO)
        })
        .collect();
    assert!(
        !stopped.is_empty(),
        "no soft read failed with the data node stopped"
    );
    let readers = std::thread::spawn(move || {
        for (i, f) in hard_files.iter().enumerate() {
            assert_eq!(direct_read(f, 8192).0.unwrap(), content(i)[..4096], "f{i}");
        }
    });
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        !readers.is_finished(),
        "a hard read of the stopped node did not wait"
    );
    // A process waiting on the hard mount still dies of a fatal signal.
    let mut dd = std::process::Command::new("dd")
        .arg(format!(
            "if={}",
            hard.path(&format!("f{}", stopped[0])).display()
        ))
        .args([
            "of=/dev/null",
            "bs=4096",
            "count=1",
            "skip=5",
            "iflag=direct",
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert!(dd.try_wait().unwrap().is_none(), "dd waits for the node");
    dd.kill().unwrap();
    rfs_e2e::within(Duration::from_secs(5), "dd killed", || {
        dd.try_wait().unwrap().is_some()
    });
    rfs_e2e::resume(data.pid());
    readers.join().expect("every hard read answered right");

    rfs_e2e::stop(meta.pid());
    let soft_lookup = fs::metadata(soft.path("never-there"));
    assert_eq!(soft_lookup.map_err(|e| errno(&e)).err(), Some(libc::EIO));
    let path = hard.path("never-there-either");
    let lookup = std::thread::spawn(move || fs::metadata(path).map_err(|e| errno(&e)).err());
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        !lookup.is_finished(),
        "a hard lookup at the stopped node did not wait"
    );
    rfs_e2e::resume(meta.pid());
    assert_eq!(
        lookup.join().unwrap(),
        Some(libc::ENOENT),
        "answered, once it ran"
    );
}

/// `rfs status --json` of the metadata node `meta`.
fn status_json(meta: &MemServer) -> String {
    let out = rfs(&["status", &meta.addr.to_string(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The number after `"key":` in `json`.
fn json_number(json: &str, key: &str) -> u64 {
    let at = json.find(&format!("\"{key}\":")).expect("the key is there") + key.len() + 3;
    let digits: String = json[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

/// At two copies a data node killed leaves chunks short of a copy with nowhere to make one:
/// `rfs status` names them, file by file, with the copies each has; once a node joins, the
/// repair's progress shows the copies made and the list empties.
#[test]
fn rfs_status_lists_chunks_short_of_copies_and_the_repairs_progress() {
    let meta = MemServer::start(&["--memory", "16M", "--chunk-size", "1M", "--replicas", "2"]);
    let mut a = MemServer::data(&meta, "16M", "1M");
    let m = Mount::new(&meta, &[]);
    fs::write(m.path("three"), vec![7u8; 3 << 20]).unwrap();
    let ino = fs::metadata(m.path("three")).map(|s| std::os::unix::fs::MetadataExt::ino(&s));
    let ino = ino.unwrap();
    a.kill();
    let mut json = String::new();
    rfs_e2e::within(Duration::from_secs(20), "the chunks counted short", || {
        std::thread::sleep(Duration::from_millis(100));
        json = status_json(&meta);
        json_number(&json, "chunks_short") == 3
    });
    for index in 0..3 {
        let entry = format!("{{\"ino\":{ino},\"index\":{index},\"copies\":1}}");
        assert!(json.contains(&entry), "{entry} in {json}");
    }
    let text = String::from_utf8(rfs(&["status", &meta.addr.to_string()]).stdout).unwrap();
    assert!(text.contains("CHUNKS SHORT OF COPIES"), "{text}");
    let _b = MemServer::data(&meta, "16M", "1M");
    rfs_e2e::within(Duration::from_secs(60), "the copies made again", || {
        std::thread::sleep(Duration::from_millis(100));
        json = status_json(&meta);
        json_number(&json, "chunks_short") == 0
    });
    assert!(json.contains("\"short\":[],"), "{json}");
    assert!(json_number(&json, "repaired_chunks") >= 3, "{json}");
    assert!(json_number(&json, "repaired_bytes") >= 3 << 20, "{json}");
    assert!(fs::read(m.path("three")).unwrap() == vec![7u8; 3 << 20]);
}
