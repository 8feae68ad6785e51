//! File locks: unlocks commit first, waits, the grace after a restart.

use super::*;

/// A lock let go commits the writes made under it first (whoever takes it next sees them),
/// and a close drops locks at the metadata node only for an owner that holds some here.
#[test]
fn an_unlock_commits_first_and_a_close_calls_only_for_an_owner_with_locks() {
    let (cluster, fs, ino, fh) = open_file("locked");
    assert_eq!(
        fs.set_lock(ino, fh, 7, whole_file(LockKind::Write), false)
            .unwrap(),
        None
    );
    write(&fs, ino, 0, b"under the lock").unwrap();
    let commits = cluster.calls(RequestOp::Commit);
    assert_eq!(
        fs.set_lock(ino, fh, 7, whole_file(LockKind::Unlock), false)
            .unwrap(),
        None
    );
    assert_eq!(cluster.calls(RequestOp::Commit), commits + 1);
    assert_eq!(cluster.size(ino), 14, "committed before the lock went");
    assert!(!cluster.holds_lock(ino, 7));

    fs.drop_locks(ino, 7).unwrap();
    let range = FileLock {
        start: 5,
        end: 9,
        kind: LockKind::Read,
        pid: 1,
    };
    assert_eq!(fs.set_lock(ino, fh, 7, range, false).unwrap(), None);
    fs.drop_locks(ino, 8).unwrap();
    assert_eq!(cluster.calls(RequestOp::DropLocks), 0, "no locks, no call");
    fs.drop_locks(ino, 7).unwrap();
    assert_eq!(cluster.calls(RequestOp::DropLocks), 1);
    assert!(!cluster.holds_lock(ino, 7));
    fs.release(fh).unwrap();
}

/// F_SETLKW: the lock is asked again until the other owner lets go, off the caller's thread,
/// and the wait ends with EINTR once the process no longer wants it (a signal, or gone).
#[test]
fn a_waiting_lock_is_taken_once_the_other_owner_lets_go_or_ends_when_not_wanted() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    let (cluster, fs, ino, fh) = open_file("contended");
    cluster.lock_elsewhere(ino, 1, whole_file(LockKind::Write));
    assert_eq!(
        fs.set_lock(ino, fh, 2, whole_file(LockKind::Read), false)
            .unwrap(),
        Some(whole_file(LockKind::Write))
    );
    let waited = |wanted: Box<dyn Fn() -> bool + Send>, owner, kind| {
        let (tx, rx) = mpsc::channel();
        fs.wait_lock(
            ino,
            fh,
            owner,
            whole_file(kind),
            wanted,
            Box::new(move |r| tx.send(r.map_err(|e| e.errno())).unwrap()),
        );
        rx
    };
    let rx = waited(Box::new(|| true), 2, LockKind::Read);
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "waits"
    );
    cluster.lock_elsewhere(ino, 1, whole_file(LockKind::Unlock));
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
    assert!(cluster.holds_lock(ino, 2));

    let wanted = Arc::new(AtomicBool::new(true));
    let still = wanted.clone();
    let rx = waited(
        Box::new(move || still.load(Ordering::SeqCst)),
        3,
        LockKind::Write,
    );
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "waits"
    );
    wanted.store(false, Ordering::SeqCst);
    let ended = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(ended, Err(Errno::EINTR));
    assert!(!cluster.holds_lock(ino, 3));
    assert_eq!(
        cluster.calls(RequestOp::CancelWait),
        1,
        "its place in the queue goes"
    );
    fs.release(fh).unwrap();
}

/// A restarted metadata node keeps new locks back while clients take theirs again (EAGAIN):
/// the lock is asked again. Locks it did not take back are forgotten here.
#[test]
fn a_lock_is_asked_again_through_a_restarts_grace_and_lost_ones_are_forgotten() {
    let (cluster, fs, ino, fh) = open_file("graced");
    cluster.refuse_next(RequestOp::SetLock, Errno::EAGAIN);
    assert_eq!(
        fs.set_lock(ino, fh, 1, whole_file(LockKind::Write), false)
            .unwrap(),
        None
    );
    assert_eq!(cluster.calls(RequestOp::SetLock), 2, "asked again");
    assert_eq!(fs.held_locks(), vec![(ino, 1, whole_file(LockKind::Write))]);
    fs.locks_lost(&fs.held_locks());
    assert!(fs.held_locks().is_empty());
    fs.drop_locks(ino, 1).unwrap();
    assert_eq!(
        cluster.calls(RequestOp::DropLocks),
        0,
        "nothing held to drop"
    );
    fs.release(fh).unwrap();
}

/// A commit that fails before an unlock leaves the failure to the writer's close and lets the
/// lock go anyway (it stayed held at the node, keeping every other mount out).
#[test]
fn an_unlock_whose_commit_fails_still_lets_the_lock_go_and_keeps_the_failure() {
    let (cluster, fs, ino, fh) = open_file("failing");
    assert_eq!(
        fs.set_lock(ino, fh, 7, whole_file(LockKind::Write), false)
            .unwrap(),
        None
    );
    write(&fs, ino, 0, b"dirty").unwrap();
    cluster.commits_late(true);
    assert_eq!(
        fs.set_lock(ino, fh, 7, whole_file(LockKind::Unlock), false)
            .unwrap(),
        None
    );
    assert!(!cluster.holds_lock(ino, 7), "the unlock went");
    cluster.commits_late(false);
    fs.flush(ino, fh).unwrap();
    assert_eq!(
        cluster.size(ino),
        5,
        "the writes are committed at the close"
    );
    fs.release(fh).unwrap();
}

/// A lock whose answer was lost may be held at the node: the close drops it there. Locks
/// taken through a handle (an open file's own: flock, F_OFD) go at its last close, and the
/// mount forgets the file's locks with its last handle, as the node does.
#[test]
fn a_lock_whose_answer_was_lost_and_a_handles_own_locks_are_dropped_at_the_close() {
    let (cluster, fs, ino, fh) = open_file("unsure");
    cluster.lose_next_answer(RequestOp::SetLock);
    assert!(fs
        .set_lock(ino, fh, 7, whole_file(LockKind::Write), false)
        .is_err());
    assert!(cluster.holds_lock(ino, 7), "applied, its answer lost");
    fs.drop_locks(ino, 7).unwrap();
    assert!(!cluster.holds_lock(ino, 7), "the close dropped it anyway");

    let (fh2, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let open_file = 0xf11e;
    assert_eq!(
        fs.set_lock(ino, fh2, open_file, whole_file(LockKind::Read), false)
            .unwrap(),
        None
    );
    fs.drop_handle_locks(ino, fh, None).unwrap();
    assert!(cluster.holds_lock(ino, open_file), "another handle's");
    fs.drop_handle_locks(ino, fh2, None).unwrap();
    assert!(!cluster.holds_lock(ino, open_file));

    assert_eq!(
        fs.set_lock(ino, fh2, 9, whole_file(LockKind::Read), false)
            .unwrap(),
        None
    );
    assert_eq!(fs.held_locks().len(), 1);
    fs.release(fh2).unwrap();
    assert_eq!(fs.held_locks().len(), 1, "a handle is still open");
    fs.release(fh).unwrap();
    assert!(fs.held_locks().is_empty(), "the last handle took them");
}
