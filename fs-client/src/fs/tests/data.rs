//! Reads and writes: split at chunk boundaries, gathered, holes, replicas, stale keys and the retry window, copies, fallocate, the stats file.

use super::*;

#[test]
fn writes_and_reads_split_at_chunk_boundaries_round_trip() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let data = pattern(3 * CHUNK as usize - 100, 7);
    assert_eq!(write(&fs, ino, 1000, &data).unwrap(), data.len() as u32);
    assert_eq!(read(&fs, ino, 1000, data.len()).unwrap(), data);
    // A read across the write's edges: zeros before it, short at the end of the file.
    let all = read(&fs, ino, 0, 10 * CHUNK as usize).unwrap();
    assert_eq!(all.len(), 1000 + data.len());
    assert!(all[..1000].iter().all(|&b| b == 0));
    assert_eq!(&all[1000..], &data[..]);
    assert_eq!(read(&fs, ino, 1 << 30, 10).unwrap(), Vec::<u8>::new());
    fs.release(fh).unwrap();
    fs.closes_sent();
    let ops = format!("metadata_ops {}\n", cluster.total_calls());
    assert!(fs.stats_text().contains(&ops), "every call counted: {ops}");
}

/// A read of chunks on one node, one copy each, is gathered into one run of bytes (rdmabox lands
/// it in one staging slot); holes, chunks on several nodes and replicated chunks are read piece
/// by piece. The bytes are the same either way.
#[test]
fn reads_across_chunks_of_one_node_are_gathered() {
    let read_whole = |cluster: &Arc<FakeCluster>| {
        let fs = client(cluster);
        let ino = create(&fs, "f");
        let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
        let data = pattern(3 * CHUNK as usize, 3);
        write(&fs, ino, 0, &data).unwrap();
        let before = cluster.gathered_reads();
        let from = CHUNK / 2;
        let got = read(&fs, ino, from, 2 * CHUNK as usize).unwrap();
        assert!(got == data[from as usize..from as usize + 2 * CHUNK as usize]);
        fs.release(fh).unwrap();
        cluster.gathered_reads() - before
    };
    assert_eq!(
        read_whole(&FakeCluster::on_one_node()),
        1,
        "one node: gathered"
    );
    assert_eq!(
        read_whole(&Arc::default()),
        0,
        "chunks on two nodes: piece by piece"
    );
    assert_eq!(read_whole(&FakeCluster::with_replicas(2)), 0, "replicated");
    // A hole among the chunks: piece by piece, zeros where nothing was written.
    let cluster = FakeCluster::on_one_node();
    let fs = client(&cluster);
    let ino = create(&fs, "sparse");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 5 * CHUNK, b"tail").unwrap();
    let before = cluster.gathered_reads();
    let got = read(&fs, ino, 4 * CHUNK - 4, (CHUNK + 8) as usize).unwrap();
    assert_eq!(got.len(), (CHUNK + 8) as usize);
    assert!(got[..got.len() - 4].iter().all(|&b| b == 0));
    assert_eq!(&got[got.len() - 4..], b"tail");
    assert_eq!(cluster.gathered_reads(), before, "a hole: piece by piece");
    fs.release(fh).unwrap();
}

#[test]
fn holes_read_as_zeros_without_allocating() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "sparse");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    // A write into a hole of a sparse file allocates its own chunk: a run ahead is for a
    // writer that filled the chunk before.
    write(&fs, ino, 5 * CHUNK, b"tail").unwrap();
    let allocated = cluster.chunk_count(ino);
    assert_eq!(allocated, 1, "no run ahead of a sparse write");
    write(&fs, ino, 6 * CHUNK - 4, b"more").unwrap();
    write(&fs, ino, 6 * CHUNK, b"next").unwrap();
    assert!(
        cluster.chunk_count(ino) >= 16,
        "a writer past a chunk it filled: a run ahead"
    );
    let allocated = cluster.chunk_count(ino);
    let all = read(&fs, ino, 0, (5 * CHUNK + 4) as usize).unwrap();
    assert!(all[..5 * CHUNK as usize].iter().all(|&b| b == 0));
    assert_eq!(&all[5 * CHUNK as usize..], b"tail");
    assert_eq!(
        cluster.chunk_count(ino),
        allocated,
        "reading allocates nothing"
    );
    fs.release(fh).unwrap();
}

#[test]
fn close_to_open_sizes_are_committed_on_release_and_seen_at_open() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    let ino = create(&a, "shared");
    let (fh, _) = a.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&a, ino, 0, &pattern(6000, 1)).unwrap();
    assert_eq!(
        a.getattr(ino).unwrap().size,
        6000,
        "the writer sees its own writes"
    );
    assert_eq!(cluster.size(ino), 0, "not committed yet");
    assert_eq!(
        b.getattr(ino).unwrap().size,
        0,
        "another client does not, before close"
    );
    a.release(fh).unwrap();
    assert_eq!(cluster.size(ino), 6000);
    let (fh_b, attr) = b.open(ino, RW, &ROOT_CALLER).unwrap();
    assert_eq!(attr.size, 6000, "open revalidates");
    assert_eq!(read(&b, ino, 0, 6000).unwrap(), pattern(6000, 1));
    b.release(fh_b).unwrap();
}

#[test]
fn flush_commits_and_a_failed_commit_stays_dirty() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, b"hello").unwrap();
    let commits = cluster.calls(RequestOp::Commit);
    fs.commit(ino).unwrap();
    fs.commit(ino).unwrap();
    assert_eq!(
        cluster.calls(RequestOp::Commit),
        commits + 1,
        "clean files commit nothing"
    );
    assert_eq!(cluster.size(ino), 5);
    fs.release(fh).unwrap();
}

#[test]
fn chunk_maps_are_cached_until_open_or_truncate() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    let ino = create(&a, "f");
    let (fh, _) = a.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&a, ino, 0, &pattern(100, 1)).unwrap();
    a.release(fh).unwrap();

    let (fh, _) = a.open(ino, RW, &ROOT_CALLER).unwrap();
    let maps = cluster.calls(RequestOp::ChunkMap);
    read(&a, ino, 0, 100).unwrap();
    read(&a, ino, 0, 100).unwrap();
    assert_eq!(cluster.calls(RequestOp::ChunkMap), maps + 1, "fetched once");
    a.release(fh).unwrap();

    // Another client truncates the file away and writes it anew: new chunks.
    let (fh_b, _) = b.open(ino, RW, &ROOT_CALLER).unwrap();
    b.setattr(
        ino,
        AttrChanges {
            size: Some(0),
            ..AttrChanges::default()
        },
        &ROOT_CALLER,
    )
    .unwrap();
    write(&b, ino, 0, &pattern(100, 2)).unwrap();
    b.release(fh_b).unwrap();

    // Opening again drops the cached map: the new bytes, through the new chunks.
    let (fh, _) = a.open(ino, RW, &ROOT_CALLER).unwrap();
    assert_eq!(read(&a, ino, 0, 100).unwrap(), pattern(100, 2));
    assert_eq!(cluster.calls(RequestOp::ChunkMap), maps + 2);
    a.release(fh).unwrap();
}

#[test]
fn truncation_zeroes_the_tail_of_the_last_chunk_kept() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &vec![0xaa; 2 * CHUNK as usize]).unwrap();
    let shrink = AttrChanges {
        size: Some(100),
        ..AttrChanges::default()
    };
    assert_eq!(fs.setattr(ino, shrink, &ROOT_CALLER).unwrap().size, 100);
    assert_eq!(
        cluster.chunk_count(ino),
        1,
        "whole chunks past the size are freed"
    );
    let grow = AttrChanges {
        size: Some(CHUNK),
        ..AttrChanges::default()
    };
    fs.setattr(ino, grow, &ROOT_CALLER).unwrap();
    let back = read(&fs, ino, 0, CHUNK as usize).unwrap();
    assert!(back[..100].iter().all(|&b| b == 0xaa));
    assert!(
        back[100..].iter().all(|&b| b == 0),
        "no old bytes past a truncation"
    );
    fs.release(fh).unwrap();
}

#[test]
fn a_failed_piece_fails_the_request_with_eio_and_commits_nothing() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(2 * CHUNK as usize, 3)).unwrap();
    cluster.fail_node(Some(1));
    let e = write(&fs, ino, 0, &pattern(3 * CHUNK as usize, 4)).unwrap_err();
    assert_eq!(e.errno(), Errno::EIO);
    assert_eq!(
        fs.getattr(ino).unwrap().size,
        2 * CHUNK,
        "a failed write does not grow the file"
    );
    let e = read(&fs, ino, 0, 2 * CHUNK as usize).unwrap_err();
    assert_eq!(e.errno(), Errno::EIO);
    assert!(
        fs.stats_text().contains("io_errors 2"),
        "{}",
        fs.stats_text()
    );
    cluster.fail_node(None);
    // The failed write may have landed in part (as on any file system): only the length is sure.
    assert_eq!(
        read(&fs, ino, 0, 4 * CHUNK as usize).unwrap().len(),
        2 * CHUNK as usize
    );
    fs.release(fh).unwrap();
}

#[test]
fn the_stats_file_reads_and_refuses_writes() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let attr = fs
        .lookup(ROOT, crate::fs::STATS_NAME.as_bytes(), &ROOT_CALLER)
        .unwrap();
    assert_eq!(attr.ino, crate::fs::STATS_INO);
    let text = String::from_utf8(read(&fs, attr.ino, 0, 1 << 16).unwrap()).unwrap();
    assert!(text.starts_with("transport fake\n"), "{text}");
    let e = write(&fs, attr.ino, 0, b"x").unwrap_err();
    assert_eq!(e.errno(), Errno::EACCES);
}

/// A rename onto the stats file's name went to the node, and the mount then showed the
/// renamed file in place of its counters. Nothing made, moved, linked or removed under that
/// name reaches the node.
#[test]
fn the_stats_files_name_takes_no_rename_link_or_new_file() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "x");
    let stats = crate::fs::STATS_NAME.as_bytes();
    let before = cluster.total_calls();
    let refused = |r: Result<()>| assert_eq!(r.unwrap_err().errno(), Errno::EACCES);
    refused(fs.rename(ROOT, b"x", ROOT, stats, 0, &ROOT_CALLER));
    refused(fs.rename(ROOT, stats, ROOT, b"y", 0, &ROOT_CALLER));
    refused(fs.link(ino, ROOT, stats, &ROOT_CALLER).map(drop));
    refused(fs.mkdir(ROOT, stats, OWNER, &ROOT_CALLER).map(drop));
    refused(fs.create(ROOT, stats, OWNER, RW, &ROOT_CALLER).map(drop));
    refused(
        fs.mknod(ROOT, stats, FileKind::RegularFile, 0, OWNER, &ROOT_CALLER)
            .map(drop),
    );
    refused(fs.unlink(ROOT, stats, &ROOT_CALLER));
    refused(fs.rmdir(ROOT, stats, &ROOT_CALLER));
    assert_eq!(cluster.total_calls(), before, "nothing reached the node");
    assert_eq!(
        fs.lookup(ROOT, stats, &ROOT_CALLER).unwrap().ino,
        crate::fs::STATS_INO
    );
    // Elsewhere the name is a name like any other.
    let d = fs.mkdir(ROOT, b"d", OWNER, &ROOT_CALLER).unwrap().ino;
    fs.mknod(d, stats, FileKind::RegularFile, 0, OWNER, &ROOT_CALLER)
        .unwrap();
}

/// A replicated file whose chunks all have a copy on one node is gathered from there too,
/// the nodes that hold them all taking turns. When the chosen node fails to answer, each piece
/// is read again from its other copies, and the read is answered whole.
#[test]
fn replicated_reads_are_gathered_from_a_node_with_every_chunk_and_fail_over_piece_by_piece() {
    let cluster = FakeCluster::mirrored();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let data = pattern(3 * CHUNK as usize, 5);
    write(&fs, ino, 0, &data).unwrap();
    for i in 0..3 {
        assert_eq!(cluster.replicas(ino, i).len(), 2, "chunk {i}");
    }
    let (from, len) = (CHUNK as usize / 2, 2 * CHUNK as usize);
    let before = cluster.gathered_reads();
    for _ in 0..4 {
        assert!(read(&fs, ino, from as u64, len).unwrap() == data[from..from + len]);
    }
    assert_eq!(cluster.gathered_reads() - before, 4, "every read gathered");

    cluster.fail_node(Some(1));
    for _ in 0..4 {
        assert!(read(&fs, ino, from as u64, len).unwrap() == data[from..from + len]);
    }
    let stats = fs.stats_text();
    assert!(stats.contains("io_errors 0\n"), "{stats}");
    assert!(
        !stats.contains("failovers 0\n"),
        "node 1 was chosen: {stats}"
    );
    fs.release(fh).unwrap();
}

/// A node whose session with us is gone answers a gather with a stale reference: the pieces
/// are read from their other copies at once (not the whole read again after a pause, with a
/// fresh map that lists the same node), and once the loss is known, that node is not chosen.
#[test]
fn a_replicated_gather_from_a_node_whose_session_is_gone_reads_the_other_copies() {
    let cluster = FakeCluster::mirrored();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let data = pattern(3 * CHUNK as usize, 6);
    write(&fs, ino, 0, &data).unwrap();
    let (from, len) = (CHUNK as usize / 2, 2 * CHUNK as usize);
    for noticed in [false, true] {
        cluster.lose_session(Some((1, noticed)));
        let before = cluster.gathered_reads();
        for _ in 0..4 {
            assert!(read(&fs, ino, from as u64, len).unwrap() == data[from..from + len]);
        }
        let stats = fs.stats_text();
        assert!(stats.contains("\nretries 0\n"), "{stats}");
        assert!(stats.contains("io_errors 0\n"), "{stats}");
        if noticed {
            assert_eq!(cluster.gathered_reads() - before, 4, "all from node 0");
        }
    }
    let failovers = |fs: &Rfs<Fake>| {
        let stats = fs.stats_text();
        let line = stats.lines().find(|l| l.starts_with("failovers ")).unwrap();
        line[10..].parse::<u64>().unwrap()
    };
    let seen = failovers(&fs);
    assert!(seen > 0, "node 1 was chosen while its loss was not known");
    read(&fs, ino, from as u64, len).unwrap();
    assert_eq!(failovers(&fs), seen, "not chosen once known");
    fs.release(fh).unwrap();
}

#[test]
fn reads_fail_over_between_replicas_and_writes_drop_the_ones_they_miss() {
    let cluster = FakeCluster::with_replicas(2);
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let first = pattern(3 * CHUNK as usize, 1);
    write(&fs, ino, 0, &first).unwrap();
    for i in 0..3 {
        assert_eq!(cluster.replicas(ino, i).len(), 2, "chunk {i}");
    }
    cluster.fail_node(Some(1));
    // Every read is answered, from whichever replica is left, turn after turn.
    for _ in 0..4 {
        assert_eq!(read(&fs, ino, 0, first.len()).unwrap(), first);
    }
    let stats = fs.stats_text();
    assert!(stats.contains("io_errors 0"), "{stats}");
    assert!(!stats.contains("failovers 0\n"), "{stats}");
    // A write reaches the replicas that are left; those it missed leave the map first, so no
    // read can find the old bytes there later.
    let second = pattern(3 * CHUNK as usize, 2);
    write(&fs, ino, 0, &second).unwrap();
    let on_failed = (0..3)
        .flat_map(|i| cluster.replicas(ino, i))
        .filter(|c| c.node == 1)
        .count();
    assert_eq!(on_failed, 0, "dropped from every chunk it held");
    assert!(
        fs.stats_text().contains("replicas_dropped 2"),
        "{}",
        fs.stats_text()
    );
    cluster.fail_node(None);
    for _ in 0..4 {
        assert_eq!(read(&fs, ino, 0, second.len()).unwrap(), second);
    }
    // A chunk whose only replica left fails, as it must.
    let lone = (0..3)
        .find(|&i| cluster.replicas(ino, i).len() == 1)
        .expect("a chunk that lost a replica");
    cluster.fail_node(Some(cluster.replicas(ino, lone)[0].node));
    let at = lone * CHUNK;
    assert_eq!(
        read(&fs, ino, at, 100).unwrap_err().errno(),
        Errno::EIO,
        "no replica left to read"
    );
    assert_eq!(
        write(&fs, ino, at, b"x").unwrap_err().errno(),
        Errno::EIO,
        "no replica left to write"
    );
    fs.release(fh).unwrap();
}

#[test]
fn transfers_a_node_refused_for_a_stale_key_go_again_with_a_fresh_map() {
    // One node: reads across chunks are gathered, and sent again whole.
    let clusters = [
        ("two nodes", FakeCluster::with_replicas(0)),
        ("2 replicas", FakeCluster::with_replicas(2)),
        ("one node", FakeCluster::on_one_node()),
    ];
    for (replicas, cluster) in clusters {
        let fs = client(&cluster);
        let ino = create(&fs, "f");
        let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
        let first = pattern(3 * CHUNK as usize, 1);
        write(&fs, ino, 0, &first).unwrap();
        // The metadata node restarted: the data nodes took back every key our map holds.
        cluster.revoke_keys();
        assert_eq!(read(&fs, ino, 0, first.len()).unwrap(), first);
        cluster.revoke_keys();
        let second = pattern(3 * CHUNK as usize + 10, 2);
        write(&fs, ino, 5, &second).unwrap();
        cluster.revoke_keys();
        assert_eq!(read(&fs, ino, 5, second.len()).unwrap(), second);
        let stats = fs.stats_text();
        assert!(
            stats.contains("\nretries 3\n"),
            "{replicas} replicas: {stats}"
        );
        assert!(stats.contains("io_errors 0\n"), "{stats}");
        assert!(
            stats.contains("replicas_dropped 0\n"),
            "a refused key is no missed replica: {stats}"
        );
        assert_eq!(cluster.gathered_reads() > 0, replicas == "one node");
        fs.release(fh).unwrap();
    }
}

#[test]
fn a_node_that_keeps_refusing_fails_the_transfer_once_the_retry_window_is_spent() {
    let cluster: Arc<FakeCluster> = Arc::default();
    // Calls, and transfers refused for a stale reference, are given the lease: 300 ms.
    cluster.set_lease_ms(300);
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(2 * CHUNK as usize, 1)).unwrap();
    cluster.refuse_every_key(true);
    let refused = |start: std::time::Instant, outcome: Result<()>| {
        let e = outcome.unwrap_err();
        assert_eq!(e.errno(), Errno::EIO);
        assert!(e.to_string().contains("RemoteAccessError"), "{e}");
        let took = start.elapsed();
        assert!(took < std::time::Duration::from_secs(2), "{took:?}");
    };
    let start = std::time::Instant::now();
    refused(
        start,
        write(&fs, ino, 0, &pattern(2 * CHUNK as usize, 2)).map(drop),
    );
    let start = std::time::Instant::now();
    refused(start, read(&fs, ino, 0, 2 * CHUNK as usize).map(drop));
    let stats = fs.stats_text();
    assert!(stats.contains("io_errors 2\n"), "{stats}");
    assert!(!stats.contains("\nretries 0\n"), "{stats}");
    cluster.refuse_every_key(false);
    write(&fs, ino, 0, b"fine again").unwrap();
    fs.release(fh).unwrap();
}

#[test]
fn copy_range_copies_across_chunks_and_stops_at_the_end_of_the_source() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (src, dst) = (create(&fs, "src"), create(&fs, "dst"));
    let (a, _) = fs.open(src, RW, &ROOT_CALLER).unwrap();
    let (b, _) = fs.open(dst, RW, &ROOT_CALLER).unwrap();
    let data = pattern(3 * CHUNK as usize + 123, 9);
    write(&fs, src, 0, &data).unwrap();
    // Into the middle of the destination, across its chunk edges, asking for more than there is.
    let n = fs.copy_range(src, 100, dst, CHUNK - 7, 10 * CHUNK).unwrap();
    assert_eq!(n, data.len() as u64 - 100);
    assert!(read(&fs, dst, CHUNK - 7, n as usize).unwrap() == data[100..]);
    let before = read(&fs, dst, 0, (CHUNK - 7) as usize).unwrap();
    assert!(before.iter().all(|&x| x == 0));
    assert_eq!(fs.size_for_read(dst).unwrap(), CHUNK - 7 + n);
    assert_eq!(
        fs.copy_range(src, data.len() as u64 + 5, dst, 0, 100)
            .unwrap(),
        0
    );
    assert!(fs.stats_text().contains(&format!("bytes_copied {n}\n")));
    fs.release(a).unwrap();
    fs.release(b).unwrap();
}

#[test]
fn fallocate_allocates_extends_punches_and_zeroes() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let (keep, punch, zero) = (
        libc::FALLOC_FL_KEEP_SIZE,
        libc::FALLOC_FL_PUNCH_HOLE,
        libc::FALLOC_FL_ZERO_RANGE,
    );
    // Mode 0: allocated, extended, zeros.
    fs.fallocate(ino, 0, 2 * CHUNK + 10, 0).unwrap();
    assert!(cluster.chunk_count(ino) >= 3);
    assert_eq!(fs.size_for_read(ino).unwrap(), 2 * CHUNK + 10);
    let all = read(&fs, ino, 0, 4 * CHUNK as usize).unwrap();
    assert_eq!(all.len() as u64, 2 * CHUNK + 10);
    assert!(all.iter().all(|&x| x == 0));
    // KEEP_SIZE past the end: allocated, the size kept.
    let before = cluster.chunk_count(ino);
    fs.fallocate(ino, 40 * CHUNK, CHUNK, keep).unwrap();
    assert!(cluster.chunk_count(ino) > before);
    assert_eq!(fs.size_for_read(ino).unwrap(), 2 * CHUNK + 10);
    // A punched hole reads zeros inside the range only, and keeps the size.
    let mut model = pattern(2 * CHUNK as usize + 10, 3);
    write(&fs, ino, 0, &model).unwrap();
    fs.fallocate(ino, 100, CHUNK, punch | keep).unwrap();
    model[100..(CHUNK + 100) as usize].fill(0);
    assert!(read(&fs, ino, 0, 4 * CHUNK as usize).unwrap() == model);
    // ZERO_RANGE across the end extends; with KEEP_SIZE it does not.
    fs.fallocate(ino, 2 * CHUNK, CHUNK, zero).unwrap();
    model.truncate(2 * CHUNK as usize);
    model.resize(3 * CHUNK as usize, 0);
    assert_eq!(fs.size_for_read(ino).unwrap(), 3 * CHUNK);
    assert!(read(&fs, ino, 0, 4 * CHUNK as usize).unwrap() == model);
    fs.fallocate(ino, 3 * CHUNK - 5, 10 * CHUNK, zero | keep)
        .unwrap();
    assert_eq!(fs.size_for_read(ino).unwrap(), 3 * CHUNK);
    // What is not supported says so.
    let err = |off, len, mode| fs.fallocate(ino, off, len, mode).unwrap_err().errno();
    assert_eq!(
        err(0, CHUNK, punch),
        Errno::EINVAL,
        "a punch must keep the size"
    );
    assert_eq!(err(0, 0, 0), Errno::EINVAL);
    assert_eq!(
        err(0, CHUNK, libc::FALLOC_FL_COLLAPSE_RANGE),
        Errno::ENOTSUP
    );
    assert_eq!(err(u64::MAX - 5, 10, 0), Errno::EFBIG);
    fs.release(fh).unwrap();
}

/// A punch went chunk by chunk, a metadata call for each hole: over a sparse exabyte
/// (truncate -s 4E, any user) it kept the client and the node busy for years, its caller
/// unkillable. Holes now cost nothing: the node's map answers only allocated chunks.
#[test]
fn a_punch_over_a_vast_sparse_range_asks_for_the_chunks_it_finds_not_for_each_hole() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let far = 1u64 << 50; // 2^38 chunks of the fake's 4 KiB away
    let (head, tail) = (pattern(100, 1), pattern(100, 2));
    write(&fs, ino, 0, &head).unwrap();
    write(&fs, ino, far, &tail).unwrap();
    let maps = cluster.calls(RequestOp::ChunkMap);
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fs.fallocate(ino, 50, far, punch).unwrap();
    assert!(
        cluster.calls(RequestOp::ChunkMap) - maps < 200,
        "{} map calls",
        cluster.calls(RequestOp::ChunkMap) - maps
    );
    let mut want = head.clone();
    want[50..].fill(0);
    assert!(read(&fs, ino, 0, 100).unwrap() == want);
    let mut want = tail.clone();
    want[..50].fill(0);
    assert!(read(&fs, ino, far, 100).unwrap() == want);
    assert_eq!(fs.size_for_read(ino).unwrap(), far + 100, "the size kept");
    fs.release(fh).unwrap();
}

/// ZERO_RANGE over a vast sparse range fills its holes chunk by chunk until the space runs
/// out: an ENOSPC, not a list of every chunk index in memory (which aborted the client).
#[test]
fn a_zero_range_over_a_vast_sparse_range_runs_out_of_space_and_nothing_else() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let far = 1u64 << 62;
    write(&fs, ino, far, b"end").unwrap();
    let zero = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
    let filled = cluster.chunk_count(ino);
    // The fake allocates without end: let it run out after a few chunks.
    std::thread::scope(|s| {
        s.spawn(|| {
            while cluster.chunk_count(ino) < filled + 8 {
                std::thread::yield_now();
            }
            cluster.pool_full(true);
        });
        let e = fs.fallocate(ino, 0, far, zero).unwrap_err();
        assert_eq!(e.errno(), Errno::ENOSPC);
    });
    assert!(read(&fs, ino, far, 3).unwrap() == b"end");
    fs.release(fh).unwrap();
}
