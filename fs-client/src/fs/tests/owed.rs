//! Commits a fault kept from the node, made again; cuts learned meanwhile.

use super::*;

/// A close whose commit a fault kept from the metadata node (unreachable, or silent past the
/// call's deadline) reports EIO and loses nothing: the handle is kept, so that the node takes
/// the commit, and the commit goes through once the node answers again; only then does the
/// handle go back. Before, the handle went back at once and the node, holding no handle,
/// refused every later commit: other clients saw the file short of its bytes for good.
#[test]
fn a_commit_a_fault_kept_from_the_node_is_made_again_before_the_handle_goes_back() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(5000, 3)).unwrap();

    cluster.unreachable(true);
    let e = fs.release(fh).unwrap_err();
    assert_eq!(e.errno(), Errno::EIO);
    assert!(e.is_fault(), "{e}");
    assert_eq!(cluster.size(ino), 0, "the node has not heard");
    assert!(
        fs.open_handles().contains(&(ino, RW)),
        "kept, and listed for a restarted node"
    );
    assert!(fs.stats_text().contains("commits_owed 1\n"));
    // Retried while the node stays away: still owed, nothing given back.
    std::thread::sleep(std::time::Duration::from_millis(400));
    fs.closes_sent();
    assert!(cluster.released().is_empty());

    cluster.unreachable(false);
    fs.retry_owed_now(); // as when the metadata connection comes back
                         // The commit is made again, then the handle joins the closes (moments after the owed
                         // count drops): waited for until it reached the node.
    let t = std::time::Instant::now();
    loop {
        fs.closes_sent();
        if !cluster.released().is_empty() {
            break;
        }
        assert!(
            t.elapsed().as_secs() < 10,
            "the commit was not made again, or the handle not given back"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(fs.stats_text().contains("commits_owed 0\n"));
    assert_eq!(cluster.size(ino), 5000);
    assert_eq!(
        cluster.released(),
        vec![(ino, RW)],
        "given back once, after"
    );
    assert!(fs.stats_text().contains("commits_resent 1\n"));
    assert!(!fs.open_handles().contains(&(ino, RW)));
}

/// Without a connection event, the owed commit is retried on a timer; a file the node answers
/// for with an error of the file system's (it is gone) is given up, its handle given back.
#[test]
fn owed_commits_are_retried_on_a_timer_and_given_up_for_a_file_that_is_gone() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let kept = create(&fs, "kept");
    let gone = create(&fs, "gone");
    let (a, _) = fs.open(kept, RW, &ROOT_CALLER).unwrap();
    let (b, _) = fs.open(gone, RW, &ROOT_CALLER).unwrap();
    write(&fs, kept, 0, &pattern(100, 1)).unwrap();
    write(&fs, gone, 0, &pattern(200, 2)).unwrap();
    cluster.unreachable(true);
    assert!(fs.release(a).is_err());
    assert!(fs.release(b).is_err());
    cluster.forget_file(gone);
    cluster.unreachable(false);
    let t = std::time::Instant::now();
    while !fs.stats_text().contains("commits_owed 0\n") {
        assert!(t.elapsed().as_secs() < 10, "not retried");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    fs.closes_sent();
    assert_eq!(cluster.size(kept), 100);
    let mut released = cluster.released();
    released.sort_by_key(|&(ino, _)| ino);
    assert_eq!(released, vec![(kept, RW), (gone, RW)]);
    assert!(fs.stats_text().contains("commits_resent 1\n"));
}

/// The node answers EIO itself to a commit that reached it too late to be applied (it stayed
/// stopped while the call waited): that commit is owed too, not lost.
#[test]
fn a_commit_the_node_answered_too_late_to_apply_is_owed_too() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(3000, 4)).unwrap();
    cluster.commits_late(true);
    assert_eq!(fs.release(fh).unwrap_err().errno(), Errno::EIO);
    assert!(fs.open_handles().contains(&(ino, RW)));
    cluster.commits_late(false);
    fs.retry_owed_now();
    let t = std::time::Instant::now();
    while !fs.stats_text().contains("commits_owed 0\n") {
        assert!(t.elapsed().as_secs() < 10, "not made again");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(cluster.size(ino), 3000);
}

/// Another client cut the file short while our commit was owed, and the callback saying so
/// was lost with the connection: the cut holds, and the owed commit does not grow the file
/// back over it. A getattr after the reconnection tells of the cut (the file's count of cuts
/// grew), and so would the node's refusal of the commit.
#[test]
fn an_owed_commit_does_not_undo_a_cut_made_elsewhere_meanwhile() {
    let (cluster, fs, ino) = owing_a_commit();
    cluster.cut(ino, 100);
    cluster.unreachable(false);
    assert_eq!(fs.getattr(ino).unwrap().size, 100, "told of the cut");
    fs.retry_owed_now();
    owed_commits_made(&fs);
    fs.closes_sent();
    assert_eq!(cluster.size(ino), 100, "the cut holds");
    assert_eq!(fs.getattr(ino).unwrap().size, 100);
    assert_eq!(cluster.released(), vec![(ino, RW)]);
}

/// The same, without a getattr between: the node refuses the owed commit (made with the
/// count of cuts from before the cut), and the client learns the cut from it.
#[test]
fn the_node_refuses_an_owed_commit_made_before_a_cut_it_missed() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(9000, 4)).unwrap();
    cluster.unreachable(true);
    assert!(fs.release(fh).is_err());
    cluster.cut(ino, 100);
    cluster.unreachable(false);
    fs.retry_owed_now();
    owed_commits_made(&fs);
    assert_eq!(cluster.size(ino), 100, "the cut holds");
    assert!(fs.stats_text().contains("commits_over_cuts 1\n"));
    assert_eq!(fs.getattr(ino).unwrap().size, 100);
}

/// The other client cut the file and wrote it again, larger than the size we last knew, while
/// our commit was owed: no comparison of sizes tells that from no cut at all; the count of
/// cuts does, and the owed commit does not grow the file to our size.
#[test]
fn an_owed_commit_does_not_grow_a_file_cut_and_written_again_elsewhere() {
    let (cluster, fs, ino) = owing_a_commit();
    cluster.cut(ino, 0);
    cluster.grow(ino, 6000);
    cluster.unreachable(false);
    fs.retry_owed_now();
    owed_commits_made(&fs);
    assert_eq!(
        cluster.size(ino),
        6000,
        "the other client's file, as it wrote it"
    );
    assert_eq!(fs.getattr(ino).unwrap().size, 6000);
}

/// An application that opens the file again (after its close said EIO) and closes it before
/// the retry: the open tells of the cut, and neither close commits over it.
#[test]
fn a_close_of_a_handle_opened_again_before_the_retry_does_not_undo_the_cut() {
    let (cluster, fs, ino) = owing_a_commit();
    cluster.cut(ino, 100);
    cluster.unreachable(false);
    let (again, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    fs.release(again).unwrap();
    assert_eq!(cluster.size(ino), 100, "the cut holds");
    fs.retry_owed_now();
    owed_commits_made(&fs);
    assert_eq!(cluster.size(ino), 100);
}

/// A cut found by an owed commit's retry holds over every write made here before we heard of
/// it, a handle still open included (they are ordered before it); what that handle writes
/// after is committed at its close, over the cut size and not over our size from before it.
#[test]
fn after_a_cut_found_by_an_owed_commit_a_handle_still_open_commits_what_it_writes_next() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (a, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let (b, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(5000, 4)).unwrap();
    fs.commit(ino).unwrap();
    write(&fs, ino, 5000, &pattern(1000, 4)).unwrap();
    cluster.unreachable(true);
    assert!(fs.release(a).is_err());
    cluster.cut(ino, 100);
    cluster.unreachable(false);
    fs.retry_owed_now();
    owed_commits_made(&fs);
    assert_eq!(
        cluster.size(ino),
        100,
        "the retry committed nothing over the cut"
    );
    write(&fs, ino, 100, &pattern(900, 5)).unwrap();
    fs.release(b).unwrap();
    assert_eq!(
        cluster.size(ino),
        1000,
        "b's write after the cut, and no more"
    );
}

/// An application that truncates the file (after its close said EIO) while the owed commit's
/// retry is on its way: the truncate waits for that commit, so the commit cannot land after
/// the cut and grow the file back over it.
#[test]
fn a_truncate_waits_for_an_owed_commit_on_its_way() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(9000, 4)).unwrap();
    cluster.unreachable(true);
    assert!(fs.release(fh).is_err());
    let truncating = Arc::new(Mutex::new(None));
    {
        let (fs, truncating) = (fs.clone(), truncating.clone());
        cluster.before_next_commit(Box::new(move || {
            let t = std::thread::spawn(move || {
                let cut = AttrChanges {
                    size: Some(0),
                    ..AttrChanges::default()
                };
                fs.setattr(ino, cut, &ROOT_CALLER).map(|a| a.size)
            });
            *truncating.lock().unwrap() = Some(t);
            // The truncate's SetAttr would reach the node first without the wait.
            std::thread::sleep(std::time::Duration::from_millis(200));
        }));
    }
    cluster.unreachable(false);
    fs.retry_owed_now();
    owed_commits_made(&fs);
    let t = std::time::Instant::now();
    let truncate = loop {
        if let Some(t) = truncating.lock().unwrap().take() {
            break t;
        }
        assert!(t.elapsed().as_secs() < 10, "no commit was retried");
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!(truncate.join().unwrap().unwrap(), 0);
    assert_eq!(cluster.size(ino), 0, "the truncate came after the commit");
}

/// A commit made before a cut whose callback we applied before the refusal came back: what we
/// wrote after hearing of the cut is committed again, not dropped.
#[test]
fn writes_made_after_hearing_of_a_cut_survive_the_refusal_of_a_commit_made_before_it() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(9000, 1)).unwrap();
    {
        let (fs, cluster) = (fs.clone(), cluster.clone());
        cluster.clone().before_next_commit(Box::new(move || {
            cluster.cut(ino, 0);
            told_of_cut(&fs, fs.getattr(ino).unwrap());
            write(&fs, ino, 0, &pattern(3000, 2)).unwrap();
        }));
    }
    fs.commit(ino).unwrap();
    assert_eq!(cluster.size(ino), 3000, "the write after the cut");
    fs.release(fh).unwrap();
    assert_eq!(read(&fs, ino, 0, 3000).unwrap(), pattern(3000, 2));
}

/// A node that counts fewer cuts than we were told of (it lost one in a crash before making it
/// durable) has the last word: the commit is made again with its count, not dropped.
#[test]
fn a_node_that_counts_fewer_cuts_than_we_heard_of_has_the_last_word() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, attr) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    told_of_cut(
        &fs,
        Attr {
            cuts: attr.cuts + 1,
            ..attr
        },
    );
    write(&fs, ino, 0, &pattern(4000, 1)).unwrap();
    fs.release(fh).unwrap();
    assert_eq!(cluster.size(ino), 4000);
}

/// A refused commit whose file the node cannot be asked about stays to be made: the close
/// reports the fault and owes the commit, which the retry makes once the node answers.
#[test]
fn a_refused_commit_that_cannot_learn_the_cut_stays_owed() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(9000, 1)).unwrap();
    {
        let c = cluster.clone();
        cluster.before_next_commit(Box::new(move || {
            c.cut(ino, 10);
            c.unreachable(true); // after this call: the getattr that follows fails
        }));
    }
    assert!(fs.release(fh).is_err());
    assert!(fs.stats_text().contains("commits_owed 1\n"));
    cluster.unreachable(false);
    fs.retry_owed_now();
    owed_commits_made(&fs);
    assert_eq!(cluster.size(ino), 10, "the cut holds");
}
