//! Space: a file costs the pages of its bytes, not a whole chunk. Small files share chunks of
//! the pool, spans grow as files do (in place, or by moving when a neighbour is in the way),
//! and what a closed file allocated ahead goes back; the bytes stay right through all of it.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::time::{Duration, Instant};

use rfs_e2e::{client, direct_read, direct_write, open_direct, within, MemServer, Mount};
use rfs_proto::message::GetStatFs;
use rfs_proto::MetadataChannel;

fn content(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u8).wrapping_mul(31).wrapping_add(i as u8 ^ 0x5a))
        .collect()
}

/// Bytes in use, as the metadata node counts them, once what was freed has come back (within
/// a few seconds: freed space is recalled, zeroed, then free).
fn used_settled(meta: &MemServer) -> u64 {
    let c = client(meta);
    let used = || {
        let s = c.call(GetStatFs {}).unwrap();
        s.bytes_total - s.bytes_free
    };
    let start = Instant::now();
    let mut last = used();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = used();
        if now == last || start.elapsed() > Duration::from_secs(10) {
            return now;
        }
        last = now;
    }
}

/// The finding: 16 files of 100 bytes filled a pool of 16 chunks. Now 2,000 fit, each
/// at the cost of a page, and every one reads back.
#[test]
fn small_files_cost_pages_not_chunks() {
    let meta = MemServer::start(&["--memory", "16M", "--chunk-size", "1M"]);
    let m = Mount::new(&meta, &[]);
    let empty = used_settled(&meta);
    let files = 2000;
    for i in 0..files {
        fs::write(m.path(&format!("f{i}")), content(i, 100)).unwrap();
    }
    for i in 0..files {
        assert_eq!(
            fs::read(m.path(&format!("f{i}"))).unwrap(),
            content(i, 100),
            "f{i}"
        );
    }
    let used = used_settled(&meta) - empty;
    assert!(
        used <= files as u64 * 4096 + (1 << 20),
        "{used} bytes used by {files} files of 100 bytes"
    );
}

/// Three 4 KiB writes far apart in a sparse file take pages around each, not runs of chunks.
#[test]
fn sparse_writes_take_pages_around_them() {
    let meta = MemServer::start(&["--memory", "16M", "--chunk-size", "1M"]);
    let m = Mount::new(&meta, &[]);
    let empty = used_settled(&meta);
    let f = fs::File::create(m.path("sparse")).unwrap();
    for (i, at) in [0u64, 100 << 20, 200 << 20].into_iter().enumerate() {
        f.write_all_at(&content(i, 4096), at).unwrap();
    }
    drop(f);
    let used = used_settled(&meta) - empty;
    assert!(used <= 3 * 64 * 1024, "{used} bytes for three 4 KiB writes");
    // st_blocks (and du) say what the file holds, not its size.
    let held = fs::metadata(m.path("sparse")).unwrap().blocks() * 512;
    assert!(
        (3 * 4096..=used).contains(&held),
        "{held} bytes said held, {used} used"
    );
    // A small file, once closed, holds a page (as on tmpfs): what was allocated ahead of its
    // writer goes back at the last close (the kernel may keep what it was told before).
    let small = m.path("small");
    fs::write(&small, b"a hundred bytes or so").unwrap();
    within(
        Duration::from_secs(5),
        "a closed small file holds a page",
        || {
            fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
            fs::metadata(&small).unwrap().blocks() == 8
        },
    );
    let f = fs::File::open(m.path("sparse")).unwrap();
    let mut buf = vec![0u8; 8192];
    f.read_exact_at(&mut buf, (100 << 20) - 4096).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0), "a hole before it");
    assert_eq!(&buf[4096..], &content(1, 4096)[..]);
    f.read_exact_at(&mut buf[..4096], 200 << 20).unwrap();
    assert_eq!(&buf[..4096], &content(2, 4096)[..]);
    assert_eq!(f.metadata().unwrap().len(), (200 << 20) + 4096);
}

/// Small files appended to again and again, closed between appends, while other files take
/// the pool next to them: their spans cannot grow in place and move, and no byte is lost or
/// mixed with a neighbour's. A second mount reads each file whole after its writer closed it.
#[test]
fn files_that_grow_past_their_neighbours_keep_their_bytes() {
    let meta = MemServer::start(&["--memory", "32M", "--chunk-size", "1M"]);
    let writer = Mount::new(&meta, &[]);
    let reader = Mount::new(&meta, &[]);
    let logs = 4;
    let mut expected = vec![Vec::new(); logs];
    for round in 0..24 {
        for (i, want) in expected.iter_mut().enumerate() {
            let piece = content(round * logs + i, 3000 + 977 * round);
            let mut f = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(writer.path(&format!("log{i}")))
                .unwrap();
            f.write_all(&piece).unwrap();
            drop(f);
            want.extend_from_slice(&piece);
            // A neighbour right after it in the pool.
            fs::write(
                writer.path(&format!("n{round}-{i}")),
                content(1000 + i, 100),
            )
            .unwrap();
        }
        for (i, want) in expected.iter().enumerate() {
            let got = fs::read(reader.path(&format!("log{i}"))).unwrap();
            assert_eq!(got.len(), want.len(), "log{i} after round {round}");
            assert!(got == *want, "log{i} after round {round}: bytes differ");
        }
    }
    for round in 0..24 {
        for i in 0..logs {
            let got = fs::read(reader.path(&format!("n{round}-{i}"))).unwrap();
            assert_eq!(got, content(1000 + i, 100), "n{round}-{i}");
        }
    }
}

/// A file kept open by its writer grows past the span another mount mapped (in place, the
/// pool past it being free): the other mount, reading without its page cache, sees every byte
/// committed, never zeros from the span it mapped before.
#[test]
fn a_reader_sees_what_a_writer_adds_past_the_span_it_mapped() {
    let meta = MemServer::start(&["--memory", "16M", "--chunk-size", "1M"]);
    let writer = Mount::new(&meta, &[]);
    let reader = Mount::new(&meta, &[]);
    let f = fs::File::create(writer.path("grows")).unwrap();
    let mut want = content(0, 100);
    f.write_all_at(&want, 0).unwrap();
    f.sync_all().unwrap();
    let r = open_direct(reader.path("grows"), false);
    for round in 1..10 {
        let mut got = Vec::new();
        while got.len() < want.len() {
            let (page, _) = direct_read(&r, got.len() as u64);
            let page = page.unwrap();
            assert!(!page.is_empty(), "round {round}: short at {}", got.len());
            got.extend_from_slice(&page);
        }
        assert!(got == want, "round {round}: the reader's bytes differ");
        let piece = content(round, 7000 * round);
        f.write_all_at(&piece, want.len() as u64).unwrap();
        f.sync_all().unwrap();
        want.extend_from_slice(&piece);
    }
}

/// A small file that must grow when the pool is full fails with ENOSPC, at once and keeping its
/// bytes; once space is back, it grows.
#[test]
fn a_span_that_cannot_grow_in_a_full_pool_fails_with_enospc_and_keeps_its_bytes() {
    let meta = MemServer::start(&["--memory", "4M", "--chunk-size", "1M"]);
    let m = Mount::new(&meta, &[]);
    let small = content(1, 3000);
    fs::write(m.path("small"), &small).unwrap();
    let fill = vec![7u8; 64 << 10];
    let mut filled = 0;
    let full = loop {
        match fs::write(m.path(&format!("fill{filled}")), &fill) {
            Ok(()) => filled += 1,
            Err(e) => break e,
        }
    };
    assert_eq!(full.raw_os_error(), Some(libc::ENOSPC), "{full}");
    assert!(filled >= 50, "{filled} files of 64 KiB in 4 MiB");
    let start = Instant::now();
    let grow = fs::OpenOptions::new()
        .append(true)
        .open(m.path("small"))
        .and_then(|mut f| f.write_all(&content(2, 60_000)).and_then(|()| f.sync_all()));
    assert_eq!(grow.map_err(|e| e.raw_os_error()), Err(Some(libc::ENOSPC)));
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(&fs::read(m.path("small")).unwrap()[..3000], &small[..]);
    for i in 0..filled.min(4) {
        fs::remove_file(m.path(&format!("fill{i}"))).unwrap();
    }
    let more = content(3, 60_000);
    let mut want = fs::read(m.path("small")).unwrap();
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(m.path("small"))
        .unwrap();
    // Freed space comes back once zeroed: a write may wait for it (space_retries).
    f.write_all(&more).unwrap();
    f.sync_all().unwrap();
    want.extend_from_slice(&more);
    drop(f);
    assert!(fs::read(m.path("small")).unwrap() == want);
    for i in 4..filled {
        assert_eq!(
            fs::read(m.path(&format!("fill{i}"))).unwrap(),
            fill,
            "fill{i}"
        );
    }
}

/// A pool fragmented by small files (every other one deleted: half of it free, and no whole
/// chunk) still takes a large file: windows are emptied into the holes of others, and every
/// byte of every file stays right. (Before, the large file got ENOSPC.)
#[test]
fn a_large_file_fits_in_a_pool_that_small_files_fragmented() {
    let meta = MemServer::start(&["--memory", "8M", "--chunk-size", "1M", "--lease", "1"]);
    fragment_then_write_large(&meta);
}

/// The same at two replicas: both nodes fragmented alike, each copy of a chunk moves out of
/// its own node's window.
#[test]
fn a_large_file_at_two_replicas_fits_in_pools_that_small_files_fragmented() {
    let meta = MemServer::start(&[
        "--memory",
        "8M",
        "--chunk-size",
        "1M",
        "--lease",
        "1",
        "--replicas",
        "2",
    ]);
    let _data = MemServer::data(&meta, "8M", "1M");
    fragment_then_write_large(&meta);
}

/// Fills the pool with files of 4 KiB, removes every other one, writes a 3 MiB file, and
/// reads everything back.
fn fragment_then_write_large(meta: &MemServer) {
    let m = Mount::new(meta, &[]);
    let mut made = 0;
    let mut full = false;
    while made < 2048 {
        match fs::write(m.path(&format!("f{made}")), content(made, 4096)) {
            Ok(()) => made += 1,
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                if std::mem::replace(&mut full, true) {
                    break;
                }
                // What closes trimmed comes back after a lease, zeroed: once more then.
                std::thread::sleep(Duration::from_secs(3));
            }
        }
    }
    assert!(made >= 1800, "{made} files of 4 KiB in 8 MiB");
    for i in (0..made).step_by(2) {
        fs::remove_file(m.path(&format!("f{i}"))).unwrap();
    }
    let big: Vec<u8> = (0..3usize << 20).map(|k| (k % 251) as u8).collect();
    let start = Instant::now();
    fs::write(m.path("big"), &big).unwrap();
    eprintln!(
        "3 MiB written into the fragmented pool in {:?}",
        start.elapsed()
    );
    assert!(fs::read(m.path("big")).unwrap() == big, "the large file");
    for i in (1..made).step_by(2) {
        assert_eq!(
            fs::read(m.path(&format!("f{i}"))).unwrap(),
            content(i, 4096),
            "f{i}, moved or not"
        );
    }
}

/// Opening and reading a small file costs one metadata call (the open, whose answer brings the
/// chunk map), not two: counted over 100 files already looked up, read with O_DIRECT so that
/// every read goes to the node. (Before, 2.2 a file: the open, the map, some releases.)
#[test]
fn opening_and_reading_a_small_file_costs_one_metadata_call() {
    let meta = MemServer::start(&["--memory", "16M"]);
    let m = Mount::new(&meta, &[]);
    let n = 100;
    for i in 0..n {
        fs::write(m.path(&format!("f{i}")), content(i, 4096)).unwrap();
    }
    for i in 0..n {
        fs::metadata(m.path(&format!("f{i}"))).unwrap();
    }
    std::thread::sleep(Duration::from_secs(1)); // the writers' closes go back first
    let before = m.stat("metadata_ops");
    for i in 0..n {
        let f = open_direct(m.path(&format!("f{i}")), false);
        assert!(direct_read(&f, 0).0.unwrap() == content(i, 4096), "f{i}");
    }
    std::thread::sleep(Duration::from_secs(1)); // and the readers'
    let calls = (m.stat("metadata_ops") - before) as f64 / n as f64;
    println!("{calls:.2} metadata calls a file");
    assert!(
        calls < 1.5,
        "{calls:.2} metadata calls to open and read a small file"
    );
}

/// Small files rewritten on another mount while compaction moves them (frozen, copied, their
/// maps switched under the writer) keep every write: each rewrite reads back at once on its own
/// mount, and in the end every file reads, on the other mount, what was written last.
#[test]
fn small_files_rewritten_on_another_mount_while_they_move_keep_every_write() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let meta = MemServer::start(&["--memory", "8M", "--chunk-size", "1M", "--lease", "1"]);
    let a = Mount::new(&meta, &[]);
    let b = Mount::new(&meta, &[]);
    let mut made = 0;
    while made < 2048 && fs::write(a.path(&format!("f{made}")), content(made, 4096)).is_ok() {
        made += 1;
    }
    assert!(made >= 1500, "{made} files of 4 KiB in 8 MiB");
    for i in (0..made).step_by(2) {
        fs::remove_file(a.path(&format!("f{i}"))).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let rewriter = {
        let (stop, dir) = (stop.clone(), b.path(""));
        std::thread::spawn(move || {
            let mut last = std::collections::HashMap::new();
            let mut round = 0;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                for i in (1..made).step_by(16) {
                    let want = content(i + round * 7, 4096);
                    let f = open_direct(dir.join(format!("f{i}")), true);
                    direct_write(&f, 0, &want).unwrap();
                    f.sync_all().unwrap();
                    assert!(direct_read(&f, 0).0.unwrap() == want, "f{i}, round {round}");
                    last.insert(i, want);
                }
            }
            (round, last)
        })
    };
    let big: Vec<u8> = (0..3usize << 20).map(|k| (k % 251) as u8).collect();
    fs::write(a.path("big"), &big).unwrap();
    stop.store(true, Ordering::Relaxed);
    let (rounds, last) = rewriter.join().expect("every rewrite read back");
    println!("{rounds} rounds of rewrites while the large file was written");
    assert!(fs::read(a.path("big")).unwrap() == big, "the large file");
    for i in (1..made).step_by(2) {
        let f = open_direct(a.path(&format!("f{i}")), false);
        let want = last.get(&i).cloned().unwrap_or_else(|| content(i, 4096));
        assert!(
            direct_read(&f, 0).0.unwrap() == want,
            "f{i} on the other mount"
        );
    }
}

/// The metadata node killed while it empties windows (spans half moved, windows held, maps
/// switched or not) and started again from its state directory loses no byte of any file: every
/// small file kept reads back the same, and a large file whose write was answered reads back
/// whole.
#[test]
fn a_metadata_node_killed_while_it_compacts_loses_nothing() {
    let mut meta = MemServer::durable_meta("compaction-kill", &["--lease", "1"]);
    let _data = MemServer::data(&meta, "8M", "1M");
    let m = Mount::new(&meta, &["io_timeout=2"]);
    let mut made = 0;
    while made < 2048 {
        match fs::write(m.path(&format!("f{made}")), content(made, 4096)) {
            Ok(()) => made += 1,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("f{made}: {e}"),
        }
    }
    assert!(made >= 1500, "{made} files of 4 KiB in 8 MiB");
    for i in (0..made).step_by(2) {
        fs::remove_file(m.path(&format!("f{i}"))).unwrap();
    }
    std::thread::sleep(Duration::from_secs(2)); // what was freed comes back, zeroed
    let big: Vec<u8> = (0..2usize << 20).map(|k| (k % 253) as u8).collect();
    let path = m.path("big");
    let writer = {
        let big = big.clone();
        std::thread::spawn(move || {
            let mut f = fs::File::create(&path)?;
            f.write_all(&big)?;
            f.sync_all()
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    meta.restart_after(Duration::from_millis(300));
    let written = writer.join().unwrap();
    println!("the large file's write: {written:?}");
    drop(m);
    let m = Mount::new(&meta, &["io_timeout=2"]);
    for i in (1..made).step_by(2) {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == content(i, 4096),
            "f{i} after the kill"
        );
    }
    if written.is_ok() {
        assert!(fs::read(m.path("big")).unwrap() == big, "the large file");
    }
}

/// A mount holding more small files open than its data session may hold grants reads and
/// writes every one right: the node keeps to its bound, dropping the oldest grants, and grants
/// them again when their files are used again.
#[test]
fn more_files_open_than_a_session_holds_grants_all_read_and_write_right() {
    let metrics = format!("127.0.0.1:{}", rfs_e2e::free_port());
    let meta = MemServer::start(&[
        "--memory",
        "16M",
        "--max-grants",
        "256",
        "--metrics",
        &metrics,
    ]);
    let m = Mount::new(&meta, &[]);
    let n = 400;
    for i in 0..n {
        fs::write(m.path(&format!("f{i}")), content(i, 4096)).unwrap();
    }
    let open = |i: usize| open_direct(m.path(&format!("f{i}")), true);
    let files: Vec<fs::File> = (0..n).map(open).collect();
    for round in 0..2 {
        for (i, f) in files.iter().enumerate() {
            let (got, _) = direct_read(f, 0);
            assert!(
                got.unwrap() == content(i + round, 4096),
                "f{i}, round {round}"
            );
            direct_write(f, 0, &content(i + round + 1, 4096)).unwrap();
        }
    }
    let scraped = rfs_e2e::scrape(&metrics);
    let held = rfs_e2e::metric(&scraped, "rfs_node_grants").unwrap();
    let evicted = rfs_e2e::metric(&scraped, "rfs_node_grants_evicted_total").unwrap();
    assert!(held <= 256, "{held} grants held");
    assert!(evicted > 0, "none evicted");
    assert_eq!(m.stat("io_errors"), 0);
    drop(files);
    for i in 0..n {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == content(i + 2, 4096),
            "f{i}"
        );
    }
}

/// Small files at two replicas: a data node killed loses none of them, their spans are copied
/// again to the node left, and a second kill loses nothing either.
#[test]
fn small_files_at_two_replicas_survive_a_killed_node_and_are_copied_again() {
    let meta = MemServer::start(&["--memory", "16M", "--chunk-size", "1M", "--replicas", "2"]);
    let mut first = MemServer::data(&meta, "16M", "1M");
    let mut second = MemServer::data(&meta, "16M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let len = |i: usize| 100 + i * 997 % 60_000;
    for i in 0..200 {
        fs::write(m.path(&format!("f{i}")), content(i, len(i))).unwrap();
    }
    first.kill();
    for i in 0..200 {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == content(i, len(i)),
            "f{i}"
        );
    }
    rfs_e2e::wait_until_whole(&meta, 1, Duration::from_secs(60));
    second.kill();
    for i in 0..200 {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == content(i, len(i)),
            "f{i}"
        );
    }
    assert_eq!(m.stat("io_errors"), 0);
}
