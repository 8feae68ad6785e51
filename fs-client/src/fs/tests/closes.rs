//! Kept directories, and closes that go back together.

use super::*;

/// What is kept of a directory made here (its names, its attributes) answers lookups and
/// getattrs without a call, but not while the metadata connection is down: callbacks may be
/// missed meanwhile.
#[test]
fn kept_directories_answer_without_calls_only_while_connected() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let d = fs.mkdir(ROOT, b"d", OWNER, &ROOT_CALLER).unwrap().ino;
    fs.mknod(d, b"f", FileKind::RegularFile, 0, OWNER, &ROOT_CALLER)
        .unwrap();
    let calls = cluster.total_calls();
    let e = fs.lookup(d, b"missing", &ROOT_CALLER).unwrap_err();
    assert_eq!(e.errno(), Errno::ENOENT);
    fs.getattr(d).unwrap();
    assert_eq!(cluster.total_calls(), calls, "from what is kept");

    cluster.metadata_down(true);
    assert_eq!(
        fs.lookup(d, b"missing", &ROOT_CALLER).unwrap_err().errno(),
        Errno::ENOENT
    );
    fs.getattr(d).unwrap();
    assert_eq!(
        cluster.total_calls(),
        calls + 2,
        "asked, while disconnected"
    );
    assert_eq!(cluster.calls(RequestOp::Lookup), 1);
}

/// A close returns before its handle is given back, and the closes made meanwhile go back
/// together, in order, in one call.
#[test]
fn closes_go_back_together_off_the_path_of_the_close() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let files: Vec<_> = (0..20)
        .map(|i| {
            let ino = create(&fs, &format!("f{i}"));
            (ino, fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap().0)
        })
        .collect();
    // The first close goes alone and is held up on its way; the rest wait for it.
    let gate = cluster.closes_gate.lock().unwrap();
    fs.release(files[0].1).unwrap();
    let start = std::time::Instant::now();
    while cluster
        .closes_sent
        .load(std::sync::atomic::Ordering::SeqCst)
        == 0
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "no close sent"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    for &(_, fh) in &files[1..] {
        fs.release(fh).unwrap();
    }
    assert!(
        cluster.released().is_empty(),
        "closes returned before any went back"
    );
    drop(gate);
    fs.closes_sent();
    let want: Vec<_> = files
        .iter()
        .map(|&(ino, _)| (ino, FileAccess::READ))
        .collect();
    assert_eq!(cluster.released(), want);
    assert_eq!(
        cluster.calls(RequestOp::ReleaseMany),
        2,
        "the 19 went together"
    );
    assert_eq!(cluster.calls(RequestOp::Release), 0);

    // Alone, a close still goes back soon, with no flush.
    let ino = create(&fs, "late");
    let (fh, _) = fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
    fs.release(fh).unwrap();
    let start = std::time::Instant::now();
    while cluster.released().len() < 21 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "close never sent"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A file we had chunks allocated for while it was open here is closed before the close
/// returns, after the closes made before it: its last close may give back chunks allocated
/// ahead, which we and the other holders of its map must hear of before the next open.
#[test]
fn a_file_written_here_is_closed_at_once_after_the_closes_before_it() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (read_only, written) = (create(&fs, "r"), create(&fs, "w"));
    let (r, _) = fs.open(read_only, FileAccess::READ, &ROOT_CALLER).unwrap();
    let (w, _) = fs.open(written, RW, &ROOT_CALLER).unwrap();
    let (w2, _) = fs.open(written, FileAccess::READ, &ROOT_CALLER).unwrap();
    write(&fs, written, 0, &[1; 100]).unwrap();
    fs.release(r).unwrap();
    fs.release(w2).unwrap();
    fs.release(w).unwrap();
    assert_eq!(
        cluster.released(),
        vec![
            (read_only, FileAccess::READ),
            (written, FileAccess::READ),
            (written, RW)
        ],
        "all of them, in order, before the close returned"
    );
}

/// A handle closed and not yet given back is still listed for a metadata node that restarts:
/// it takes it again, and the close, resent, closes that one.
#[test]
fn a_close_not_yet_answered_is_reclaimed_with_the_open_handles() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (a, _) = fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
    let (b, _) = fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
    let gate = cluster.closes_gate.lock().unwrap();
    fs.release(a).unwrap();
    assert_eq!(
        fs.open_handles(),
        vec![(ino, FileAccess::READ), (ino, FileAccess::READ)]
    );
    drop(gate);
    fs.closes_sent();
    assert_eq!(
        fs.open_handles(),
        vec![(ino, FileAccess::READ)],
        "answered: only b"
    );
    fs.release(b).unwrap();
    fs.closes_sent();
    assert!(fs.open_handles().is_empty());
}
