//! Seeking data and holes, set-id bits, reconnections.

use super::*;

/// lseek's SEEK_DATA and SEEK_HOLE follow the chunks allocated, at chunk granularity: data in
/// chunks 0 and 2 of one file; data in chunk 0 of another, grown to 3 chunks by truncate.
#[test]
fn seek_data_and_hole_follow_the_allocated_chunks() {
    let (_, fs, ino, fh) = open_file("sparse");
    write(&fs, ino, 0, b"head").unwrap();
    write(&fs, ino, 2 * CHUNK + 10, b"middle").unwrap();
    let size = 2 * CHUNK + 16;
    let data = |ino, at| fs.seek(ino, at, true).map_err(|e| e.errno());
    let hole = |ino, at| fs.seek(ino, at, false).map_err(|e| e.errno());
    assert_eq!(data(ino, 0), Ok(0));
    assert_eq!(data(ino, 7), Ok(7), "inside data: where it is");
    assert_eq!(hole(ino, 0), Ok(CHUNK));
    assert_eq!(
        hole(ino, CHUNK + 5),
        Ok(CHUNK + 5),
        "inside a hole: where it is"
    );
    assert_eq!(data(ino, CHUNK + 1), Ok(2 * CHUNK));
    assert_eq!(hole(ino, 2 * CHUNK), Ok(size), "the end is a hole");
    assert_eq!(data(ino, size), Err(Errno::ENXIO), "at the end");
    assert_eq!(hole(ino, u64::MAX), Err(Errno::ENXIO));
    fs.release(fh).unwrap();

    let (_, fs2, grown, fh) = open_file("grown");
    write(&fs2, grown, 0, b"head").unwrap();
    resize(&fs2, grown, 3 * CHUNK).unwrap();
    let data = |at| fs2.seek(grown, at, true).map_err(|e| e.errno());
    assert_eq!(data(CHUNK), Err(Errno::ENXIO), "only a hole follows");
    assert_eq!(fs2.seek(grown, 5, false).unwrap(), CHUNK);
    fs2.release(fh).unwrap();
}

/// A file dense over more chunks than one chunk-map answer lists: its hole is its end.
#[test]
fn seek_hole_of_a_file_denser_than_one_map_answer_is_its_end() {
    let (_, fs, ino, fh) = open_file("dense");
    let chunks = MAX_LIST as u64 + 3;
    for i in 0..chunks {
        write(&fs, ino, i * CHUNK, b"x").unwrap();
    }
    let size = (chunks - 1) * CHUNK + 1;
    assert_eq!(fs.seek(ino, 0, false).unwrap(), size);
    assert_eq!(fs.seek(ino, size - 1, true).unwrap(), size - 1);
    fs.release(fh).unwrap();
}

#[test]
fn a_write_clears_set_user_id_and_group_executable_set_group_id() {
    use crate::fs::setid_cleared_by_write;
    assert_eq!(setid_cleared_by_write(0o4755), 0o4000);
    assert_eq!(setid_cleared_by_write(0o6755), 0o6000);
    assert_eq!(
        setid_cleared_by_write(0o2745),
        0,
        "mandatory-locking mark stays"
    );
    assert_eq!(setid_cleared_by_write(0o1777), 0, "sticky stays");
    assert_eq!(setid_cleared_by_write(0o0777), 0);
}

/// A file this mount made has no extended attributes: a user's write that clears set-ID bits
/// and capabilities asks the metadata node nothing about it (one made elsewhere, it asks).
#[test]
fn a_users_write_asks_for_capabilities_only_of_files_made_elsewhere() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (fs, other) = (client(&cluster), client(&cluster));
    let calls = |fs: &Rfs<Fake>| {
        let stats = fs.stats_text();
        let line = stats
            .lines()
            .find(|l| l.starts_with("metadata_ops "))
            .unwrap();
        line[13..].parse::<u64>().unwrap()
    };
    let nobody = Caller {
        uid: 65534,
        gid: 65534,
        groups: Vec::new(),
    };
    let (fh, made) = fs.create(ROOT, b"here", OWNER, RW, &ROOT_CALLER).unwrap();
    let before = calls(&fs);
    fs.write_clears_setid(made.ino, &nobody).unwrap();
    assert_eq!(calls(&fs), before, "made here: nothing to ask");
    let (ofh, elsewhere) = other
        .create(ROOT, b"there", OWNER, RW, &ROOT_CALLER)
        .unwrap();
    let (fh2, _) = fs.open(elsewhere.ino, RW, &ROOT_CALLER).unwrap();
    let before = calls(&fs);
    fs.write_clears_setid(elsewhere.ino, &nobody).unwrap();
    assert!(calls(&fs) > before, "made elsewhere: asked");
    for (fs, fh) in [(&fs, fh), (&fs, fh2), (&other, ofh)] {
        fs.release(fh).unwrap();
    }
}

/// Attributes say whether a file has an access ACL: the kernel's question for one, before it
/// lets anyone but the owner in, costs no call for a file without (made here, or its attributes
/// fetched), until a callback says the file changed.
#[test]
fn the_attributes_answer_the_kernels_acl_question() {
    use rfs_proto::message::RequestOp;
    let cluster: Arc<FakeCluster> = Arc::default();
    let (fs, other) = (client(&cluster), client(&cluster));
    let user = Caller {
        uid: 2000,
        gid: 2000,
        groups: Vec::new(),
    };
    let acl = |fs: &Rfs<Fake>, ino| fs.getxattr(ino, b"system.posix_acl_access", &user);
    let asked = || cluster.calls(RequestOp::GetXattr);
    let here = create(&fs, "here");
    let elsewhere = create(&other, "there");
    assert_eq!(acl(&fs, here).unwrap_err().errno(), Errno::ENODATA);
    fs.getattr(elsewhere).unwrap();
    assert_eq!(acl(&fs, elsewhere).unwrap_err().errno(), Errno::ENODATA);
    assert_eq!(asked(), 0, "the attributes said");
    fs.xattrs.changed(elsewhere);
    let _ = acl(&fs, elsewhere);
    assert_eq!(asked(), 1, "changed since: asked");
    fs.getattr(elsewhere).unwrap();
    let _ = acl(&fs, elsewhere);
    assert_eq!(asked(), 1, "fetched again");
}

/// Callbacks missed while the connection was down: the sizes of files open here are asked for
/// again when it is back, a growth and a cut alike, and what the kernel was given is dropped.
#[test]
fn a_reconnection_refreshes_the_sizes_of_open_files() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (grows, cut) = (create(&fs, "grows"), create(&fs, "cut"));
    let (g, _) = fs.open(grows, RW, &ROOT_CALLER).unwrap();
    let (c, _) = fs.open(cut, RW, &ROOT_CALLER).unwrap();
    write(&fs, cut, 0, &pattern(3000, 1)).unwrap();
    fs.flush(cut, c).unwrap();
    cluster.grow(grows, 7000);
    cluster.cut(cut, 10);
    assert_eq!(fs.open_end(grows), Some(0), "no callback came");
    assert_eq!(fs.open_end(cut), Some(3000));
    let (kernel, invals) = crossbeam_channel::unbounded();
    fs.notify_kernel(kernel);
    fs.kernel_looked_up(grows);
    fs.reconnected();
    assert_eq!(fs.open_end(grows), Some(7000));
    assert_eq!(fs.open_end(cut), Some(10));
    let sent: Vec<String> = invals.try_iter().map(|i| format!("{i:?}")).collect();
    assert!(sent.iter().any(|i| i == "Names"), "{sent:?}");
    for ino in [grows, cut, rfs_proto::types::ROOT] {
        let inval = format!("Inode {{ ino: {ino}, data: true }}");
        assert!(sent.contains(&inval), "{inval} in {sent:?}");
    }
    fs.release(g).unwrap();
    fs.release(c).unwrap();
}
