//! Write-behind: answered before landing, failures reported by flush, sync writes.

use super::*;

#[test]
fn write_behind_answers_before_the_bytes_land_and_flush_waits_for_them() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (fs, other) = (client_with(&cluster, BEHIND), client(&cluster));
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    cluster.hold_writes();
    let data = pattern(3 * CHUNK as usize, 9);
    assert_eq!(
        write_behind(&fs, ino, 0, &data, false).recv().unwrap(),
        Ok(data.len() as u32)
    );
    assert_eq!(
        cluster.writes_held(),
        3,
        "answered with every piece still in flight"
    );
    assert_eq!(
        fs.getattr(ino).unwrap().size,
        data.len() as u64,
        "our size has it"
    );
    // A read of those bytes, and a flush, wait for them; the size is committed after.
    let reader = {
        let fs = fs.clone();
        in_background(move || read(&fs, ino, CHUNK, 10))
    };
    let flush = {
        let fs = fs.clone();
        in_background(move || fs.commit(ino))
    };
    assert!(reader.recv_timeout(MOMENT).is_err() && flush.recv_timeout(MOMENT).is_err());
    assert_eq!(cluster.size(ino), 0, "no size committed before its bytes");
    cluster.let_writes_go();
    assert_eq!(
        reader.recv_timeout(LONG).unwrap().unwrap(),
        data[CHUNK as usize..][..10]
    );
    flush.recv_timeout(LONG).unwrap().unwrap();
    assert_eq!(cluster.size(ino), data.len() as u64);
    let (ofh, _) = other.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
    assert_eq!(read(&other, ino, 0, data.len()).unwrap(), data);
    other.release(ofh).unwrap();
    fs.release(fh).unwrap();
}

#[test]
fn write_behind_answers_once_mapped_before_its_transfers_go_and_a_mapping_failure_on_the_write() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    cluster.hold_writes();
    let data = pattern(2 * CHUNK as usize, 3);
    let (tx, rx) = mpsc::channel();
    let seen = cluster.clone();
    fs.write_behind(
        ino,
        0,
        &data,
        false,
        Box::new(move |r| tx.send((r, seen.writes_held())).unwrap()),
    );
    assert_eq!(
        rx.recv().unwrap(),
        (Ok(data.len() as u32), 0),
        "answered before its transfers were posted (the writer's next bytes overlap them)"
    );
    assert_eq!(cluster.writes_held(), 2, "and posted right after");
    // A chunk that cannot be allocated fails the write itself, not a later flush.
    cluster.pool_full(true);
    let far = 100_000 * CHUNK;
    assert_eq!(
        write_behind(&fs, ino, far, b"x", false)
            .recv()
            .unwrap()
            .map_err(|e| e.errno()),
        Err(Errno::ENOSPC)
    );
    cluster.pool_full(false);
    cluster.let_writes_go();
    fs.commit(ino).unwrap();
    assert_eq!(read(&fs, ino, 0, data.len()).unwrap(), data);
    fs.release(fh).unwrap();
}

#[test]
fn chunks_recalled_past_the_size_cut_nothing_and_a_size_cut_cuts_our_size() {
    use rfs_proto::callback::{Callback, Invalidation};
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, committed) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let data = pattern(3 * CHUNK as usize, 4);
    write(&fs, ino, 0, &data).unwrap();
    assert_eq!(cluster.size(ino), 0, "nothing committed yet");
    let recall = |data, attr| Callback {
        inodes: vec![Invalidation {
            ino,
            chunks_from: Some(5),
            attr: Some(attr),
            data,
            remapped: false,
        }],
        ..Callback::default()
    };
    // Chunks past the size given back (a trim at another mount's last close): our writes stay.
    fs.on_callback(recall(false, committed));
    assert_eq!(fs.getattr(ino).unwrap().size, data.len() as u64);
    // A truncate elsewhere (one more cut) holds for our size too.
    let cut = Attr {
        cuts: committed.cuts + 1,
        ..committed
    };
    cluster.cut(ino, 0);
    fs.on_callback(recall(true, cut));
    assert_eq!(fs.getattr(ino).unwrap().size, 0);
    fs.release(fh).unwrap();
}

#[test]
fn a_write_behind_that_fails_is_reported_by_flush_once_and_fails_the_next_write() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(2 * CHUNK as usize, 1)).unwrap(); // both chunks allocated
    cluster.hold_writes();
    assert!(
        write_behind(&fs, ino, 0, &pattern(2 * CHUNK as usize, 2), false)
            .recv()
            .unwrap()
            .is_ok()
    );
    cluster.fail_node(Some(cluster.replicas(ino, 1)[0].node));
    cluster.let_writes_go();
    let e = write_behind(&fs, ino, 0, b"next", false)
        .recv()
        .unwrap()
        .unwrap_err();
    assert_eq!(e.errno(), Errno::EIO, "the next write hears of it");
    assert_eq!(
        fs.commit(ino).unwrap_err().errno(),
        Errno::EIO,
        "flush reports it"
    );
    cluster.fail_node(None);
    fs.commit(ino).unwrap();
    assert!(write_behind(&fs, ino, 0, b"again", false)
        .recv()
        .unwrap()
        .is_ok());
    fs.release(fh).unwrap();
}

#[test]
fn a_write_behind_that_fails_drops_the_pages_that_hold_it() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let (fh, made) = fs.create(ROOT, b"f", OWNER, RW, &ROOT_CALLER).unwrap();
    let ino = made.ino;
    write(&fs, ino, 0, &pattern(2 * CHUNK as usize, 1)).unwrap();
    cluster.hold_writes();
    assert!(
        write_behind(&fs, ino, 0, &pattern(2 * CHUNK as usize, 2), false)
            .recv()
            .unwrap()
            .is_ok()
    );
    cluster.fail_node(Some(cluster.replicas(ino, 1)[0].node));
    cluster.let_writes_go();
    assert_eq!(fs.release(fh).unwrap_err().errno(), Errno::EIO);
    cluster.fail_node(None);
    let (fh, _, keep) = fs.open_keeping_cache(ino, RW, &ROOT_CALLER).unwrap();
    assert!(!keep, "the kernel's pages hold bytes that never landed");
    fs.release(fh).unwrap();
}

/// A commit made while an overwrite below the committed size is still in flight (another
/// thread's write, admitted after the committing thread's drain) is followed by another once
/// it landed: another mount may cache the old bytes under the version the first one made.
#[test]
fn a_commit_over_an_overwrite_in_flight_leaves_another_to_follow_it() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(100, 1)).unwrap();
    fs.commit(ino).unwrap();
    cluster.hold_writes();
    assert!(write_behind(&fs, ino, 0, b"new", false)
        .recv()
        .unwrap()
        .is_ok());
    let commits = cluster.calls(RequestOp::Commit);
    fs.commit_size(ino).unwrap(); // no drain: as if the write came after it
    assert_eq!(cluster.calls(RequestOp::Commit), commits + 1);
    cluster.let_writes_go();
    fs.commit(ino).unwrap();
    assert_eq!(
        cluster.calls(RequestOp::Commit),
        commits + 2,
        "no commit followed the overwrite's landing"
    );
    fs.release(fh).unwrap();
}

#[test]
fn sync_writes_and_writes_without_write_behind_are_answered_once_landed() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (without, fs) = (client(&cluster), client_with(&cluster, BEHIND));
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let (fh_without, _) = without.open(ino, RW, &ROOT_CALLER).unwrap();
    cluster.hold_writes();
    let off = write_behind(&without, ino, 200, b"off", false);
    assert!(off.recv_timeout(MOMENT).is_err(), "write-behind is off");
    let sync = write_behind(&fs, ino, 100, b"two", true);
    assert!(sync.recv_timeout(MOMENT).is_err(), "O_SYNC waits");
    let early = write_behind(&fs, ino, 0, b"one", false);
    assert_eq!(
        early.recv_timeout(LONG).unwrap(),
        Ok(3),
        "answered before it lands"
    );
    // An overlapping write waits for the one in flight, so the bytes land in order.
    let overlapping = {
        let fs = fs.clone();
        in_background(move || write_behind(&fs, ino, 1, b"XY", false).recv().unwrap())
    };
    assert!(overlapping.recv_timeout(MOMENT).is_err());
    cluster.let_writes_go();
    assert_eq!(off.recv_timeout(LONG).unwrap(), Ok(3));
    assert_eq!(sync.recv_timeout(LONG).unwrap(), Ok(3));
    assert_eq!(overlapping.recv_timeout(LONG).unwrap(), Ok(2));
    fs.commit(ino).unwrap();
    assert_eq!(read(&fs, ino, 0, 3).unwrap(), b"oXY");
    fs.release(fh).unwrap();
    without.release(fh_without).unwrap();
}

#[test]
fn a_flush_commits_no_size_over_bytes_still_in_flight_and_a_readers_close_hides_no_failure() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let (reader, _) = fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
    let chunk = CHUNK as usize;
    write(&fs, ino, 0, &pattern(chunk, 1)).unwrap();
    cluster.hold_writes();
    assert!(write_behind(&fs, ino, CHUNK, &pattern(chunk, 2), false)
        .recv()
        .unwrap()
        .is_ok());
    let flush = {
        let fs = fs.clone();
        in_background(move || fs.flush(ino, fh))
    };
    assert!(
        flush.recv_timeout(MOMENT).is_err(),
        "waits for the write before it"
    );
    // Another writer's bytes, answered after the flush began: not waited for, not committed.
    assert!(write_behind(&fs, ino, 2 * CHUNK, &pattern(chunk, 3), false)
        .recv()
        .unwrap()
        .is_ok());
    cluster.let_first_writes_go(1);
    flush.recv_timeout(LONG).unwrap().unwrap();
    assert_eq!(
        cluster.size(ino),
        2 * CHUNK,
        "the size stops where bytes in flight start"
    );
    cluster.let_writes_go();
    fs.flush(ino, fh).unwrap();
    assert_eq!(cluster.size(ino), 3 * CHUNK);

    // A write that fails after its answer: a reader's close neither reports nor hides it.
    cluster.hold_writes();
    assert!(write_behind(&fs, ino, 0, b"lost", false)
        .recv()
        .unwrap()
        .is_ok());
    cluster.fail_node(Some(cluster.replicas(ino, 0)[0].node));
    cluster.let_writes_go();
    cluster.fail_node(None);
    fs.flush(ino, reader).unwrap();
    assert_eq!(fs.flush(ino, fh).unwrap_err().errno(), Errno::EIO);
    fs.release(reader).unwrap();
    fs.release(fh).unwrap();
}

/// A getattr that the metadata node answered before a commit, and that comes back while the
/// commit is on its way (another thread's close of the file), keeps our size: found by the
/// fallocate test under load, where fstat showed 0 after a 5 MiB fallocate, and reads then
/// ended there.
#[test]
fn a_getattr_answered_before_a_commit_does_not_take_the_size_back() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(1000, 1)).unwrap();
    let seen = Arc::new(Mutex::new(None));
    {
        let (fs, seen) = (fs.clone(), seen.clone());
        cluster.before_next_commit(Box::new(move || {
            *seen.lock().unwrap() = Some(fs.getattr(ino).unwrap().size);
        }));
    }
    fs.commit(ino).unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        Some(1000),
        "answered while committing"
    );
    assert_eq!(fs.getattr(ino).unwrap().size, 1000);
    assert_eq!(read(&fs, ino, 0, 4000).unwrap().len(), 1000);
}
