//! Replicas: a storage node killed or stopped under a file system that keeps two copies of
//! every chunk loses nothing and fails nothing; the copies a dead node held are made again.

use std::fs;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rfs_e2e::{direct_read, open_direct, wait_until_whole, MemServer, Mount};

/// A metadata node keeping `replicas` copies, lending `memory`, with 1 MiB chunks.
fn meta(memory: &str, replicas: &str) -> MemServer {
    MemServer::start(&[
        "--memory",
        memory,
        "--chunk-size",
        "1M",
        "--replicas",
        replicas,
    ])
}

fn content(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u8).wrapping_mul(13).wrapping_add(i as u8))
        .collect()
}

/// The availability issue's finding: a storage node's death lost its chunks for good. With
/// two replicas, killing one (SIGKILL, mid-use) fails no read and no write, and its copies are
/// made again on the others: once that is done, killing a second node still loses nothing.
#[test]
fn with_two_replicas_a_killed_node_loses_nothing_and_its_copies_are_made_again() {
    let meta = meta("48M", "2");
    let mut first = MemServer::data(&meta, "48M", "1M");
    let mut second = MemServer::data(&meta, "48M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let len = 3 << 20;
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), content(i, len)).unwrap();
    }
    let held = open_direct(m.path("f0"), false);
    assert_eq!(direct_read(&held, 0).0.unwrap(), content(0, len)[..4096]);

    first.kill();
    let killed = Instant::now();
    // The file held open reads on, from the other replica.
    let (r, took) = direct_read(&held, 1 << 20);
    assert_eq!(r.unwrap(), content(0, len)[(1 << 20)..(1 << 20) + 4096]);
    println!("first read after the kill: {took:?}");
    for i in 0..6 {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == content(i, len),
            "f{i}"
        );
    }
    // Writes go on: to what is left of old files, and to new ones.
    let changed = content(7, len);
    fs::write(m.path("f1"), &changed).unwrap();
    fs::write(m.path("new"), content(8, len)).unwrap();
    println!("reads and writes through the death: {:?}", killed.elapsed());
    assert_eq!(m.stat("io_errors"), 0);

    let took = wait_until_whole(&meta, 1, Duration::from_secs(60));
    println!("copies made again {took:?} after the kill was seen");
    // Every chunk has two copies again, on the two nodes left: the second kill loses nothing.
    second.kill();
    let expect = |i: usize| match i {
        1 => changed.clone(),
        _ => content(i, len),
    };
    for i in 0..6 {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == expect(i),
            "f{i}"
        );
    }
    assert!(fs::read(m.path("new")).unwrap() == content(8, len));
    assert_eq!(m.stat("io_errors"), 0);
}

/// A stopped node (SIGSTOP: it keeps its connections and answers nothing) costs a read or a
/// write at most the I/O deadline: reads fail over, writes drop the copies they cannot reach;
/// once the node resumes, everything reads back as written.
#[test]
fn with_two_replicas_a_stopped_node_costs_reads_and_writes_at_most_the_deadline() {
    let meta = meta("32M", "2");
    let data = MemServer::data(&meta, "32M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let len = 1 << 20;
    let files: Vec<fs::File> = (0..4)
        .map(|i| {
            fs::write(m.path(&format!("f{i}")), content(i, len)).unwrap();
            open_direct(m.path(&format!("f{i}")), true)
        })
        .collect();
    for (i, f) in files.iter().enumerate() {
        assert_eq!(direct_read(f, 0).0.unwrap(), content(i, len)[..4096]);
    }

    rfs_e2e::stop(data.pid());
    let mut block = vec![0u8; 8192];
    let at = block.as_ptr().align_offset(4096);
    block[at..at + 4096].fill(0xab);
    for pass in 0..2 {
        for (i, f) in files.iter().enumerate() {
            let (r, took) = direct_read(f, 8192);
            println!("pass {pass} read f{i}: {took:?}");
            assert_eq!(r.unwrap(), content(i, len)[8192..8192 + 4096], "f{i}");
            assert!(
                took < Duration::from_millis(2500),
                "read f{i} took {took:?}"
            );
            let start = Instant::now();
            f.write_all_at(&block[at..at + 4096], 4096 * (3 + pass))
                .unwrap();
            let took = start.elapsed();
            println!("pass {pass} write f{i}: {took:?}");
            assert!(
                took < Duration::from_millis(2500),
                "write f{i} took {took:?}"
            );
        }
    }
    assert_eq!(m.stat("io_errors"), 0);
    assert!(
        m.stat("failovers") > 0,
        "reads passed the stopped copies over"
    );
    assert!(
        m.stat("replicas_dropped") > 0,
        "writes dropped the stopped copies"
    );
    rfs_e2e::resume(data.pid());
    drop(files);
    for i in 0..4 {
        let mut expect = content(i, len);
        expect[3 * 4096..5 * 4096].fill(0xab);
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == expect,
            "f{i} after the node resumed"
        );
    }
}
