//! Answers overtaken by commits and cuts, space that comes back, creates whose answers were lost.

use super::*;

/// An open of a file while a commit of it is on its way (another process's close of an
/// inherited descriptor commits in the middle of our writes) keeps our size, though the node
/// answers the open with its size from before the commit: found by the copy_file_range test
/// under load, where the copy then stopped at the first megabyte of a 6 MiB source.
#[test]
fn an_open_answered_before_a_commit_does_not_take_the_size_back() {
    let (cluster, fs, ino, fh) = written_not_committed();
    let seen = Arc::new(Mutex::new(None));
    {
        let (fs, seen) = (fs.clone(), seen.clone());
        cluster.before_next_commit(Box::new(move || {
            let (reader, attr) = fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
            *seen.lock().unwrap() = Some((reader, attr.size, fs.getattr(ino).unwrap().size));
        }));
    }
    fs.flush(ino, fh).unwrap();
    let (reader, opened, got) = seen.lock().unwrap().take().unwrap();
    assert_eq!((opened, got), (1000, 1000), "answered while committing");
    assert_eq!(fs.getattr(ino).unwrap().size, 1000);
    assert_eq!(read(&fs, ino, 0, 4000).unwrap().len(), 1000);
    fs.release(reader).unwrap();
    fs.release(fh).unwrap();
}

/// A close returns only once the file's size is on the metadata node, even when another
/// thread's close (another process's, of an inherited descriptor) took the commit on its way:
/// close-to-open, for whoever opens the file next.
#[test]
fn a_flush_waits_for_a_commit_another_flush_has_on_its_way() {
    let (cluster, fs, ino, fh) = written_not_committed();
    let second = Arc::new(Mutex::new(None));
    {
        let (fs, second, cluster2) = (fs.clone(), second.clone(), cluster.clone());
        cluster.before_next_commit(Box::new(move || {
            let (tx, rx) = std::sync::mpsc::channel();
            let fs = fs.clone();
            std::thread::spawn(move || {
                let r = fs.flush(ino, fh);
                let _ = tx.send((r.is_ok(), cluster2.size(ino)));
            });
            let early = rx.recv_timeout(std::time::Duration::from_millis(300)).ok();
            *second.lock().unwrap() = Some((early, rx));
        }));
    }
    fs.flush(ino, fh).unwrap();
    let (early, rx) = second.lock().unwrap().take().unwrap();
    assert_eq!(
        early, None,
        "the second close returned before the size was committed"
    );
    let (ok, size) = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    assert!(ok);
    assert_eq!(
        size, 1000,
        "the node has the size once the second close returns"
    );
    fs.release(fh).unwrap();
}

/// A getattr or an open that the metadata node answered before a commit, and whose answer
/// comes back after the commit's (another process's close committed meanwhile), keeps our
/// size: the node's sizes only grow but for cuts, which its count of cuts tells. Found by the
/// fallocate test under load: fstat showed 0 after a 5 MiB fallocate.
#[test]
fn answers_overtaken_by_a_commit_do_not_take_the_size_back() {
    for op in [RequestOp::GetAttr, RequestOp::Open] {
        let (cluster, fs, ino, fh) = written_not_committed();
        {
            let fs = fs.clone();
            cluster.after_next_answer(op, Box::new(move || fs.flush(ino, fh).unwrap()));
        }
        let (size, reader) = match op {
            RequestOp::GetAttr => (fs.getattr(ino).unwrap().size, None),
            _ => {
                let (reader, attr) = fs.open(ino, FileAccess::READ, &ROOT_CALLER).unwrap();
                (attr.size, Some(reader))
            }
        };
        assert_eq!(cluster.size(ino), 1000, "{op:?}: committed meanwhile");
        assert_eq!(size, 1000, "{op:?}: answered before the commit");
        assert_eq!(fs.getattr(ino).unwrap().size, 1000, "{op:?}");
        assert_eq!(read(&fs, ino, 0, 4000).unwrap().len(), 1000, "{op:?}");
        if let Some(reader) = reader {
            fs.release(reader).unwrap();
        }
        fs.release(fh).unwrap();
    }
}

/// A getattr the node answered before our truncate, and whose answer comes back after it,
/// does not undo the truncate: it carries fewer cuts than we heard of, so it tells nothing of
/// the size (else our size would grow back, and the next commit would grow the node's file
/// back over the cut). Found by a reviewer of the answers-only-grow rule.
#[test]
fn an_answer_from_before_our_truncate_does_not_undo_it() {
    let (cluster, fs, ino, fh) = written_not_committed();
    fs.flush(ino, fh).unwrap();
    assert_eq!(cluster.size(ino), 1000);
    {
        let fs = fs.clone();
        cluster.after_next_answer(
            RequestOp::GetAttr,
            Box::new(move || {
                let cut = AttrChanges {
                    size: Some(10),
                    ..AttrChanges::default()
                };
                fs.setattr(ino, cut, &ROOT_CALLER).unwrap();
            }),
        );
    }
    fs.getattr(ino).unwrap(); // answered before the truncate, back after it
    assert_eq!(cluster.size(ino), 10, "truncated meanwhile");
    let later = fs.getattr(ino).unwrap().size;
    let readable = read(&fs, ino, 0, 4000).unwrap().len();
    // A one-byte write and a close: must not grow the file back over the truncate.
    write(&fs, ino, 0, b"x").unwrap();
    fs.release(fh).unwrap();
    let node = cluster.size(ino);
    assert_eq!(
        (later, readable, node),
        (10, 10, 10),
        "(getattr after the truncate, bytes readable, node's size after a 1-byte write + close)"
    );
}

/// The same with another client's truncate, told by callback while our getattr's answer (from
/// before the truncate) is on its way back.
#[test]
fn an_answer_from_before_a_cut_told_by_callback_does_not_undo_it() {
    use rfs_proto::callback::{Callback, Invalidation};
    let (cluster, fs, ino, fh) = written_not_committed();
    fs.flush(ino, fh).unwrap();
    {
        let (fs, cluster2) = (fs.clone(), cluster.clone());
        cluster.after_next_answer(
            RequestOp::GetAttr,
            Box::new(move || {
                cluster2.cut(ino, 10);
                let a = client(&cluster2).getattr(ino).unwrap();
                fs.on_callback(Callback {
                    inodes: vec![Invalidation {
                        ino,
                        chunks_from: Some(1),
                        attr: Some(a),
                        data: true,
                        remapped: false,
                    }],
                    ..Callback::default()
                });
            }),
        );
    }
    fs.getattr(ino).unwrap();
    let later = fs.getattr(ino).unwrap().size;
    write(&fs, ino, 0, b"x").unwrap();
    fs.release(fh).unwrap();
    assert_eq!(
        (later, cluster.size(ino)),
        (10, 10),
        "(getattr after the cut, node's size after a 1-byte write + close)"
    );
}

/// A getattr answered before a commit and back after it shows our mtime with our size, not
/// the node's mtime from before the commit (a pair that never existed, and an mtime going
/// back from what an earlier stat showed).
#[test]
fn an_answer_overtaken_by_a_commit_shows_our_mtime_with_our_size() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let fh = fs.open(ino, RW, &ROOT_CALLER).unwrap().0;
    std::thread::sleep(std::time::Duration::from_millis(20));
    write(&fs, ino, 0, &pattern(1000, 1)).unwrap();
    let before = fs.getattr(ino).unwrap(); // ours: size 1000 and the write's mtime
    {
        let fs = fs.clone();
        cluster.after_next_answer(
            RequestOp::GetAttr,
            Box::new(move || fs.flush(ino, fh).unwrap()),
        );
    }
    let stale = fs.getattr(ino).unwrap();
    let after = fs.getattr(ino).unwrap();
    fs.release(fh).unwrap();
    assert_eq!(stale.size, 1000);
    assert_eq!(
        (stale.mtime.secs, stale.mtime.nsecs),
        (after.mtime.secs, after.mtime.nsecs),
        "mtime of the overtaken answer (before: {:?})",
        (before.mtime.secs, before.mtime.nsecs)
    );
}

/// The kernel sends a file's RELEASE after close(2) has returned, and the release gives back
/// the chunks allocated ahead of its writer: a write that finds no space meanwhile waits for
/// them rather than failing with ENOSPC (a full-pool test failed so under load).
#[test]
fn a_write_short_of_space_waits_for_the_chunks_another_files_release_gives_back() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let a = create(&fs, "a");
    let (fh_a, _) = fs.open(a, RW, &ROOT_CALLER).unwrap();
    write(&fs, a, 0, &pattern(2 * CHUNK as usize, 1)).unwrap();
    fs.flush(a, fh_a).unwrap();
    let b = create(&fs, "b");
    let (fh_b, _) = fs.open(b, RW, &ROOT_CALLER).unwrap();
    cluster.pool_full(true);
    let data = pattern(CHUNK as usize, 2);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            // What a's release gives back makes room.
            cluster.pool_full(false);
            fs.release(fh_a).unwrap();
        });
        assert_eq!(write(&fs, b, 0, &data), Ok(data.len() as u32));
    });
    assert_eq!(read(&fs, b, 0, data.len()).unwrap(), data);
    assert_eq!(
        fs.stats
            .space_retries
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // With nothing of ours left to give back, no space is an ENOSPC at once.
    cluster.pool_full(true);
    let started = std::time::Instant::now();
    let e = write(&fs, b, 4 * CHUNK, b"x").unwrap_err();
    assert_eq!(e.errno(), Errno::ENOSPC);
    assert!(
        started.elapsed() < crate::fs::space::SPACE_WAIT,
        "it waited for nothing"
    );
    // Another file we wrote is merely held open: nothing is on its way back, no wait.
    let c = create(&fs, "c");
    let (fh_c, _) = fs.open(c, RW, &ROOT_CALLER).unwrap();
    cluster.pool_full(false);
    write(&fs, c, 0, b"c").unwrap();
    cluster.pool_full(true);
    let started = std::time::Instant::now();
    let e = write(&fs, b, 4 * CHUNK, b"x").unwrap_err();
    assert_eq!(e.errno(), Errno::ENOSPC);
    assert!(
        started.elapsed() < crate::fs::space::SPACE_WAIT,
        "it waited for c"
    );
    // A descriptor of it closed (another stays open: no release comes): the wait ends at its
    // bound, with ENOSPC.
    fs.flush(c, fh_c).unwrap();
    let e = write(&fs, b, 4 * CHUNK, b"x").unwrap_err();
    assert_eq!(e.errno(), Errno::ENOSPC);
    fs.release(fh_c).unwrap();
    fs.release(fh_b).unwrap();
    assert!(
        fs.stats_text().contains("io_errors 0\n"),
        "a full pool is no I/O error: {}",
        fs.stats_text()
    );
}

/// A create without O_EXCL whose answer a lost session took (the metadata node restarted
/// under it) is made again: it makes the file, or answers EEXIST if the first one did (the
/// FUSE layer then has the kernel look the name up and open it). With O_EXCL whether it was
/// made is not known: EIO.
#[test]
fn a_create_whose_answer_a_lost_session_took_is_made_again() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let creates = cluster.calls(RequestOp::Create);
    cluster.lose_next_answer(RequestOp::Create);
    let e = fs
        .create_unchecked(ROOT, b"lost", OWNER, RW, &ROOT_CALLER)
        .unwrap_err();
    assert_eq!(e.errno(), Errno::EEXIST, "the first one made it");
    assert_eq!(cluster.calls(RequestOp::Create), creates + 2, "made again");
    fs.lookup(ROOT, b"lost", &ROOT_CALLER).unwrap();
    let (fh, _) = fs
        .create_unchecked(ROOT, b"new", OWNER, RW, &ROOT_CALLER)
        .unwrap();
    fs.release(fh).unwrap();
    cluster.lose_next_answer(RequestOp::Create);
    let e = fs
        .create(ROOT, b"lost-excl", OWNER, RW, &ROOT_CALLER)
        .unwrap_err();
    assert_eq!(e.errno(), Errno::EIO);
}
