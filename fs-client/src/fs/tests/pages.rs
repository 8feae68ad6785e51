//! The page cache across opens, and commits in turn.

use super::*;

#[test]
fn cached_pages_are_kept_across_opens_of_an_unchanged_file_only() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    let ino = create(&a, "f");
    let open = |fs: &Arc<Rfs<Fake>>| {
        let (fh, _, keep) = fs.open_keeping_cache(ino, RW, &ROOT_CALLER).unwrap();
        fs.release(fh).unwrap();
        keep
    };
    assert!(!open(&a), "nothing cached at the first open");
    assert!(open(&a), "unchanged since");
    // Another client writes and closes: the version moved.
    let (fh, _) = b.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&b, ino, 0, b"new").unwrap();
    b.release(fh).unwrap();
    assert!(!open(&a), "changed elsewhere");
    assert!(open(&a));
    // A callback about the data, or a lost connection (callbacks missed), drops the version.
    a.pages_changed(ino);
    assert!(!open(&a), "a callback said the pages changed");
    a.pages_unknown();
    assert!(!open(&a), "callbacks may have been missed");
    assert!(open(&a));
    a.kernel_looked_up(ino);
    a.kernel_looked_up(ino);
    a.forget(ino, 1);
    assert!(
        open(&a),
        "the kernel still holds the inode: one lookup of two forgotten"
    );
    a.forget(ino, 1);
    assert!(!open(&a), "the kernel forgot the inode, and its pages");
    assert!(open(&a));
}

#[test]
fn our_own_commit_keeps_the_pages_another_clients_commit_drops() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    let ino = create(&a, "f");
    let open = |fs: &Arc<Rfs<Fake>>| fs.open_keeping_cache(ino, RW, &ROOT_CALLER).unwrap();
    let (fh, _, keep) = open(&a);
    assert!(!keep, "nothing cached at the first open");
    write(&a, ino, 0, b"ours").unwrap();
    a.release(fh).unwrap();
    let (fh, _, keep) = open(&a);
    assert!(
        keep,
        "the pages hold our write: the version after our commit"
    );
    // Another client commits between our open and our commit, and its callback has not
    // come (the fake sends none): our commit's answer shows the file changed before it.
    write(&a, ino, 100, b"more").unwrap();
    let (bh, _) = b.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&b, ino, 0, b"THEIRS").unwrap();
    b.release(bh).unwrap();
    a.release(fh).unwrap();
    let (fh, _, keep) = open(&a);
    assert!(!keep, "our pages do not hold the other client's write");
    a.release(fh).unwrap();
    let (fh, _, keep) = open(&a);
    assert!(keep);
    // A callback while our commit is on its way: the pages go, whatever the answer says.
    write(&a, ino, 0, b"again").unwrap();
    let told = a.clone();
    cluster.after_next_answer(RequestOp::Commit, Box::new(move || told.pages_changed(ino)));
    a.release(fh).unwrap();
    let (fh, _, keep) = open(&a);
    assert!(!keep, "a callback said the pages changed");
    a.release(fh).unwrap();
    // A file made by create has no pages of another version either.
    let (fh, made) = a.create(ROOT, b"g", OWNER, RW, &ROOT_CALLER).unwrap();
    write(&a, made.ino, 0, b"new").unwrap();
    a.release(fh).unwrap();
    let (fh, _, keep) = a.open_keeping_cache(made.ino, RW, &ROOT_CALLER).unwrap();
    assert!(keep, "the pages of a file we made hold what we wrote");
    a.release(fh).unwrap();
}

/// Two commits of one file at once (a close here while a child process's exec closes its
/// inherited copy of the descriptor) go one after the other: answered out of order, the
/// later one's answer was taken first, the earlier one's "before" then matched nothing, and
/// the next open dropped pages that held our writes (found under load).
#[test]
fn overlapping_commits_of_one_file_go_in_turn_and_keep_our_pages() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _, _) = fs.open_keeping_cache(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(2 * CHUNK as usize, 1)).unwrap();
    // While the first commit's answer is on its way: more bytes, and another commit.
    let (second, hook) = SideCommit::hook(&fs, ino, move |fs| {
        write(fs, ino, 2 * CHUNK, &pattern(2 * CHUNK as usize, 2)).unwrap();
    });
    cluster.after_next_answer(RequestOp::Commit, hook);
    fs.commit(ino).unwrap();
    second.result().unwrap();
    assert_eq!(cluster.size(ino), 4 * CHUNK);
    fs.release(fh).unwrap();
    let (fh, _, keep) = fs.open_keeping_cache(ino, RW, &ROOT_CALLER).unwrap();
    assert!(
        keep,
        "the pages hold our writes, and nobody else changed the file"
    );
    fs.release(fh).unwrap();
}

/// A commit that waited for another of the same file takes that one's failure instead of
/// sending its own: closes piling up behind a node out of reach wait one call's deadline, not
/// one each in turn.
#[test]
fn a_commit_that_waited_for_a_failed_one_fails_with_it() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, b"bytes").unwrap();
    let (second, hook) = SideCommit::hook(&fs, ino, |_| {});
    cluster.before_next_commit(hook);
    cluster.refuse_next(RequestOp::Commit, Errno::EIO);
    let commits = cluster.calls(RequestOp::Commit);
    assert_eq!(fs.commit(ino).unwrap_err().errno(), Errno::EIO);
    assert_eq!(second.result().unwrap_err().errno(), Errno::EIO);
    assert_eq!(
        cluster.calls(RequestOp::Commit),
        commits + 1,
        "one commit sent"
    );
    // The writes stay to commit: the next one goes.
    fs.commit(ino).unwrap();
    assert_eq!(cluster.size(ino), 5);
    fs.release(fh).unwrap();
}
