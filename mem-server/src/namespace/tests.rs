//! The namespace on its own: names, links, renames, sizes, chunk maps and replicas.

use super::*;

const OWNER: Owner = Owner {
    perm: 0o755,
    uid: 0,
    gid: 0,
    umask: 0,
};

fn ns() -> Namespace {
    Namespace::new(1 << 20)
}

fn file(ns: &mut Namespace, parent: Ino, name: impl AsRef<[u8]>) -> Ino {
    ns.mknod(parent, name, FileKind::RegularFile, 0, OWNER)
        .unwrap()
        .ino
}

/// Records as a journal on disk gives them back (encoded and read again).
fn through_disk(records: &[Record]) -> Vec<Record> {
    let mut w = rfs_proto::wire::Writer::default();
    for r in records {
        r.put(&mut w);
    }
    Record::decode_all(&w.0).unwrap()
}

fn chunk(n: u64) -> Replicas {
    vec![ChunkRef {
        node: 0,
        addr: n << 20,
        rkey: 1,
        lo: 0,
        len: 1 << 20,
    }]
}

/// A map page answers at most what it is asked for over any span; the whole map (what a
/// last close revokes the grants of) has every chunk, past a page's worth too.
#[test]
fn a_map_page_is_bounded_and_the_whole_map_is_whole() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "f");
    let far = 1u64 << 40;
    let chunks: Vec<_> = (0..5000u64).map(|i| (i * far / 5000, chunk(i))).collect();
    n.add_chunks(f, &chunks).unwrap();
    assert_eq!(n.chunk_map(f, 0, u64::MAX).unwrap().len(), 5000);
    let page = n.chunk_map_page(f, 0, u64::MAX, 4096).unwrap();
    assert_eq!(page.len(), 4096);
    assert_eq!(page[4095].0, chunks[4095].0, "the first ones");
    let rest = n
        .chunk_map_page(f, page[4095].0 + 1, u64::MAX, 4096)
        .unwrap();
    assert_eq!(rest.len(), 904);
}

#[test]
fn create_lookup_and_errors() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    assert_eq!(n.lookup(ROOT, "a").unwrap().ino, f);
    assert_eq!(
        n.mknod(ROOT, "a", FileKind::RegularFile, 0, OWNER),
        Err(Errno::EEXIST)
    );
    assert_eq!(n.lookup(ROOT, "b"), Err(Errno::ENOENT));
    assert_eq!(n.lookup(f, "x"), Err(Errno::ENOTDIR));
    let long = "x".repeat(256);
    assert_eq!(n.mkdir(ROOT, &long, OWNER), Err(Errno::ENAMETOOLONG));
    assert_eq!(n.lookup(ROOT, &long), Err(Errno::ENAMETOOLONG));
    assert_eq!(n.mkdir(ROOT, "a/b", OWNER), Err(Errno::EINVAL));
    assert_eq!(n.lookup(ROOT, "..").unwrap().ino, ROOT);
}

#[test]
fn a_set_group_id_directory_gives_its_group_and_its_bit_to_what_is_made_in_it() {
    let mut n = ns();
    let shared = Owner {
        perm: 0o2777,
        uid: 0,
        gid: 100,
        umask: 0,
    };
    let d = n.mkdir(ROOT, "d", shared).unwrap().ino;
    let maker = |perm| Owner {
        perm,
        uid: 1000,
        gid: 1000,
        umask: 0,
    };
    let f = n
        .mknod(d, "f", FileKind::RegularFile, 0, maker(0o644))
        .unwrap();
    assert_eq!((f.gid, f.perm), (100, 0o644));
    let sub = n.mkdir(d, "sub", maker(0o755)).unwrap();
    assert_eq!((sub.gid, sub.perm), (100, 0o2755));
    let deeper = n
        .mknod(sub.ino, "g", FileKind::RegularFile, 0, maker(0o600))
        .unwrap();
    assert_eq!(deeper.gid, 100, "the subdirectory passes it on");
    let link = n.symlink(d, "l", "f", 1000, 1000).unwrap();
    assert_eq!(link.gid, 100);
    // Elsewhere the maker's group.
    let plain = n
        .mknod(ROOT, "r", FileKind::RegularFile, 0, maker(0o644))
        .unwrap();
    assert_eq!(plain.gid, 1000);
}

#[test]
fn directory_link_counts_and_rmdir() {
    let mut n = ns();
    let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
    assert_eq!(n.getattr(ROOT).unwrap().nlink, 3);
    n.mkdir(d, "e", OWNER).unwrap();
    file(&mut n, d, "f");
    assert_eq!(n.getattr(d).unwrap().nlink, 3);
    assert_eq!(n.rmdir(ROOT, "d"), Err(Errno::ENOTEMPTY));
    assert_eq!(n.rmdir(d, "f"), Err(Errno::ENOTDIR));
    assert_eq!(n.unlink(d, "e"), Err(Errno::EISDIR));
    n.rmdir(d, "e").unwrap();
    n.unlink(d, "f").unwrap();
    n.rmdir(ROOT, "d").unwrap();
    assert_eq!(n.getattr(ROOT).unwrap().nlink, 2);
    assert_eq!(n.getattr(d), Err(Errno::ENOENT));
}

#[test]
fn hard_links_count_and_free_on_last_unlink() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    n.add_chunks(f, &[(0, chunk(0)), (1, chunk(1))]).unwrap();
    assert_eq!(n.link(f, ROOT, "b").unwrap().nlink, 2);
    assert!(n.unlink(ROOT, "a").unwrap().is_empty(), "still linked");
    assert_eq!(n.getattr(f).unwrap().nlink, 1);
    assert_eq!(n.unlink(ROOT, "b").unwrap().len(), 2, "chunks freed");
    assert_eq!(n.getattr(f), Err(Errno::ENOENT));
    let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
    assert_eq!(n.link(d, ROOT, "d2"), Err(Errno::EPERM));
}

#[test]
fn unlink_while_open_keeps_data_until_release() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    n.add_chunks(f, &[(0, chunk(0))]).unwrap();
    n.open(f).unwrap();
    n.open(f).unwrap();
    assert!(n.unlink(ROOT, "a").unwrap().is_empty());
    assert_eq!(n.chunk_map(f, 0, 10).unwrap().len(), 1, "data still there");
    assert!(n.release(f).is_empty(), "one handle left");
    assert_eq!(n.release(f).len(), 1, "freed at the last release");
    assert_eq!(n.getattr(f), Err(Errno::ENOENT));
}

#[test]
fn rename_over_existing_and_its_errors() {
    let mut n = ns();
    let a = file(&mut n, ROOT, "a");
    let b = file(&mut n, ROOT, "b");
    n.add_chunks(b, &[(0, chunk(7))]).unwrap();
    assert_eq!(n.rename(ROOT, "a", ROOT, "b", 0).unwrap(), chunk(7));
    assert_eq!(n.lookup(ROOT, "b").unwrap().ino, a);
    assert_eq!(n.lookup(ROOT, "a"), Err(Errno::ENOENT));
    let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
    let e = n.mkdir(ROOT, "e", OWNER).unwrap().ino;
    file(&mut n, e, "x");
    assert_eq!(n.rename(ROOT, "b", ROOT, "d", 0), Err(Errno::EISDIR));
    assert_eq!(n.rename(ROOT, "d", ROOT, "b", 0), Err(Errno::ENOTDIR));
    assert_eq!(n.rename(ROOT, "d", ROOT, "e", 0), Err(Errno::ENOTEMPTY));
    assert_eq!(n.rename(ROOT, "d", d, "inside", 0), Err(Errno::EINVAL));
    assert_eq!(
        n.rename(ROOT, "b", ROOT, "d", RENAME_NOREPLACE),
        Err(Errno::EEXIST)
    );
    // Move a directory into another: link counts follow.
    n.rename(ROOT, "d", e, "d", 0).unwrap();
    assert_eq!(n.getattr(e).unwrap().nlink, 3);
    assert_eq!(n.getattr(ROOT).unwrap().nlink, 3);
    assert_eq!(n.lookup(d, "..").unwrap().ino, e);
    // Replace an empty directory.
    let f = n.mkdir(ROOT, "f", OWNER).unwrap().ino;
    n.rename(e, "d", ROOT, "f", 0).unwrap();
    assert_eq!(n.getattr(f), Err(Errno::ENOENT));
    assert_eq!(n.lookup(ROOT, "f").unwrap().ino, d);
}

#[test]
fn rename_exchange_swaps() {
    let mut n = ns();
    let a = file(&mut n, ROOT, "a");
    let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
    n.rename(ROOT, "a", ROOT, "d", RENAME_EXCHANGE).unwrap();
    assert_eq!(n.lookup(ROOT, "a").unwrap().ino, d);
    assert_eq!(n.lookup(ROOT, "d").unwrap().ino, a);
    assert_eq!(
        n.rename(ROOT, "a", ROOT, "zz", RENAME_EXCHANGE),
        Err(Errno::ENOENT)
    );
    assert_eq!(n.rename(ROOT, "a", ROOT, "d", 3), Err(Errno::EINVAL));
}

#[test]
fn truncate_frees_whole_chunks_past_the_size() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    n.add_chunks(f, &[(0, chunk(0)), (1, chunk(1)), (2, chunk(2))])
        .unwrap();
    let set = AttrChanges {
        size: Some((1 << 20) + 1),
        ..AttrChanges::default()
    };
    let (attr, freed) = n.setattr(f, &set).unwrap();
    assert_eq!(attr.size, (1 << 20) + 1);
    assert_eq!(freed, chunk(2));
    assert_eq!(n.missing_chunks(f, 0, 3).unwrap(), vec![2]);
    assert_eq!(
        n.commit(f, 10, None, 0),
        Err(Errno::ESTALE),
        "made before the cut"
    );
    n.commit(f, 10, None, 1).unwrap();
    assert_eq!(
        n.getattr(f).unwrap().size,
        (1 << 20) + 1,
        "commit never shrinks"
    );
}

#[test]
fn every_closed_file_gives_back_chunks_past_its_size_at_once() {
    let mut n = ns();
    let (open, closed) = (file(&mut n, ROOT, "a"), file(&mut n, ROOT, "b"));
    for f in [open, closed] {
        n.add_chunks(f, &[(0, chunk(0)), (1, chunk(1))]).unwrap();
    }
    n.open(open).unwrap();
    let trimmed = n.trim_closed();
    assert_eq!(trimmed.len(), 1, "{trimmed:?}");
    assert_eq!((trimmed[0].0, trimmed[0].1), (closed, 0));
    assert_eq!(n.chunk_map(open, 0, 2).unwrap().len(), 2);
}

#[test]
fn a_commit_answers_the_attributes_before_and_after_it() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    let first = n.getattr(f).unwrap();
    let m = Timestamp { secs: 7, nsecs: 8 };
    let c = n.commit(f, 4096, Some(m), 0).unwrap();
    assert_eq!(c.before, first);
    assert_eq!((c.after.size, c.after.mtime), (4096, m));
    assert_eq!(n.getattr(f).unwrap(), c.after);
    let again = n.commit(f, 10, None, 0).unwrap();
    assert_eq!(
        again.before, c.after,
        "the one before is the last commit's after"
    );
    assert_eq!(again.after, c.after, "a commit never shrinks the file");
}

#[test]
fn closed_files_give_back_chunks_past_their_size() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    let ahead: Vec<_> = (0..16).map(|i| (i, chunk(i))).collect();
    n.add_chunks(f, &ahead).unwrap();
    n.open(f).unwrap();
    n.commit(f, (1 << 20) + 512 * 1024, None, 0).unwrap();
    assert_eq!(n.trim(f), None, "open: a writer may not have committed yet");
    n.release(f);
    let (from, freed) = n.trim(f).unwrap();
    assert_eq!(
        n.getattr(f).unwrap().cuts,
        1,
        "counted: chunks past the size went"
    );
    assert_eq!(from, 1, "the chunk the file ends in keeps a shorter span");
    assert_eq!(freed.len(), 15);
    // The pages up to the end, and a tenth of the size (in pages) for appends.
    let kept = 512 * 1024 + 38 * 4096;
    assert!(freed.contains(&ChunkRef {
        addr: (1 << 20) + kept,
        lo: kept as u32,
        len: (1 << 20) - kept as u32,
        ..chunk(1)[0]
    }));
    let map = n.chunk_map(f, 0, 16).unwrap();
    assert_eq!(map.len(), 2);
    assert_eq!((map[1].1[0].lo, map[1].1[0].len), (0, kept as u32));
    assert_eq!(n.trim(f), None, "nothing left past the size");
}

#[test]
fn readdir_pages_through_a_large_directory() {
    let mut n = ns();
    for i in 0..1000 {
        file(&mut n, ROOT, format!("f{i:04}"));
    }
    let mut names = Vec::new();
    let mut cookie = 0;
    loop {
        let page = n.readdir(ROOT, cookie, 64, usize::MAX).unwrap();
        if page.is_empty() {
            break;
        }
        cookie = page.last().unwrap().cookie;
        names.extend(page.into_iter().map(|e| e.name));
    }
    assert_eq!(names.len(), 1002);
    assert_eq!(names[..3], [".".into(), "..".into(), "f0000".into()]);
}

#[test]
fn readdir_pages_are_cut_to_fit_a_message() {
    let mut n = ns();
    for i in 0..260 {
        file(&mut n, ROOT, format!("{i:03}{}", "x".repeat(177)));
    }
    let budget = 16 << 10;
    let (mut cookie, mut listed, mut pages) = (0, 0, 0);
    loop {
        let page = n.readdir(ROOT, cookie, 256, budget).unwrap();
        if page.is_empty() {
            break;
        }
        let bytes: usize = page.iter().map(DirEntry::wire_len).sum();
        assert!(bytes <= budget, "page of {bytes} bytes");
        cookie = page.last().unwrap().cookie;
        listed += page.len();
        pages += 1;
    }
    assert_eq!(listed, 262);
    assert!(pages > 4, "{pages} pages");
    // An entry larger than the budget still goes out, alone: a listing always moves on.
    assert_eq!(n.readdir(ROOT, 2, 256, 1).unwrap().len(), 1);
}

#[test]
fn names_are_bytes() {
    let mut n = ns();
    let latin1 = b"caf\xe9";
    let f = file(&mut n, ROOT, latin1);
    assert_eq!(n.lookup(ROOT, latin1).unwrap().ino, f);
    assert_eq!(
        n.lookup(ROOT, "caf\u{e9}"),
        Err(Errno::ENOENT),
        "UTF-8 é is another name"
    );
    let page = n.readdir(ROOT, 0, 10, usize::MAX).unwrap();
    assert_eq!(page[2].name.as_bytes(), latin1);
    n.symlink(ROOT, b"l\xff", b"/t\xfe", 0, 0).unwrap();
    let l = n.lookup(ROOT, b"l\xff").unwrap().ino;
    assert_eq!(n.readlink(l).unwrap().as_bytes(), b"/t\xfe");
    n.rename(ROOT, latin1, ROOT, b"\x80", 0).unwrap();
    n.unlink(ROOT, b"\x80").unwrap();
    for bad in [&b""[..], b".", b"..", b"a/b", b"a\0b"] {
        assert_eq!(n.mkdir(ROOT, bad, OWNER), Err(Errno::EINVAL), "{bad:?}");
    }
    assert_eq!(n.mkdir(ROOT, [b'x'; 256], OWNER), Err(Errno::ENAMETOOLONG));
}

fn on(node: u32, addr: u64) -> ChunkRef {
    ChunkRef {
        node,
        addr,
        rkey: 9,
        lo: 0,
        len: 1 << 20,
    }
}

#[test]
fn a_write_keeps_only_the_replicas_it_reached() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    n.add_chunks(f, &[(0, vec![on(1, 0), on(2, 0)]), (1, vec![on(2, 64)])])
        .unwrap();
    // Keys do not matter: a reference names a chunk by node and address.
    let reached = ChunkRef {
        rkey: 0,
        ..on(1, 0)
    };
    assert_eq!(n.drop_replicas(f, 0, &[reached]), Ok(vec![on(2, 0)]));
    assert_eq!(n.replicas(f, 0), Some(vec![on(1, 0)]));
    assert_eq!(
        n.drop_replicas(f, 0, &[on(1, 0)]),
        Ok(vec![]),
        "all it has reached"
    );
    assert_eq!(
        n.drop_replicas(f, 0, &[on(2, 0)]),
        Err(Errno::EIO),
        "reached none left"
    );
    assert_eq!(n.drop_replicas(f, 0, &[]), Err(Errno::EIO));
    assert_eq!(
        n.drop_replicas(f, 7, &[on(1, 0)]),
        Ok(vec![]),
        "no such chunk"
    );
    // A copy made from a replica that missed the write goes too.
    assert!(n.add_replica(f, 0, &on(1, 0), on(3, 0)));
    assert_eq!(n.drop_replicas(f, 0, &[on(1, 0)]), Ok(vec![on(3, 0)]));
    // A dead node's replicas go where another is left; an only replica stays.
    n.add_chunks(f, &[(2, vec![on(1, 128), on(2, 128)])])
        .unwrap();
    assert_eq!(n.drop_node(2), 1);
    assert_eq!(n.replicas(f, 1), Some(vec![on(2, 64)]), "its only copy");
    assert_eq!(n.replicas(f, 2), Some(vec![on(1, 128)]));
}

#[test]
fn holdings_count_each_nodes_copies_and_the_chunks_only_there() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    n.add_chunks(
        f,
        &[
            (0, vec![on(1, 0), on(2, 0)]),
            (1, vec![on(1, 64)]),
            (2, vec![on(2, 64)]),
        ],
    )
    .unwrap();
    let held = n.holdings_per_node();
    assert_eq!(
        held.get(&1),
        Some(&(2, 1)),
        "a shared chunk is nobody's only copy"
    );
    assert_eq!(held.get(&2), Some(&(2, 1)));
    assert_eq!(held.get(&3), None);
    assert_eq!(n.copies_per_node().get(&1), Some(&2));
    assert_eq!(held[&1].1, n.held_only_on(1));
}

#[test]
fn under_replicated_chunks_are_found_and_copies_land_only_on_what_is_still_there() {
    let mut n = ns();
    let f = file(&mut n, ROOT, "a");
    let g = file(&mut n, ROOT, "b");
    n.add_chunks(f, &[(0, vec![on(1, 0), on(2, 0)]), (1, vec![on(1, 64)])])
        .unwrap();
    n.add_chunks(g, &[(0, vec![on(3, 0)]), (5, vec![on(2, 64), on(3, 64)])])
        .unwrap();
    let alive = |node| node != 3;
    // g's chunk 0 is only on a dead node: nothing to copy from.
    assert_eq!(n.under_replicated(2, alive, 10), (vec![(f, 1), (g, 5)], 2));
    let (some, all) = n.under_replicated(2, alive, 1);
    assert_eq!((some.len(), all), (1, 2), "a limit, and the count of all");
    assert_eq!(n.under_replicated(1, alive, 10).1, 0);
    assert!(n.add_replica(f, 1, &on(1, 64), on(2, 192)));
    assert_eq!(n.replicas(f, 1), Some(vec![on(1, 64), on(2, 192)]));
    assert!(
        !n.add_replica(f, 0, &on(3, 0), on(2, 256)),
        "source not in it"
    );
    n.setattr(
        f,
        &AttrChanges {
            size: Some(0),
            ..AttrChanges::default()
        },
    )
    .unwrap();
    assert!(
        !n.add_replica(f, 1, &on(1, 64), on(2, 256)),
        "truncated meanwhile"
    );
}

/// Extended attributes live with their inode (a hard link shares them, a rename keeps them,
/// the last link takes them), keep Linux's flags and bounds, and come back whole from the
/// journal and from a snapshot.
#[test]
fn extended_attributes_live_with_their_inode_and_survive_a_replay() {
    use rfs_proto::xattr::{XATTR_CREATE, XATTR_REPLACE};
    let mut n = ns();
    n.journal_changes();
    // What a state directory starts with, then the changes after it.
    let mut journal = n.records();
    let f = file(&mut n, ROOT, "f");
    let before = n.getattr(f).unwrap().ctime;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let after = n.set_xattr(f, b"user.a", b"1", XATTR_CREATE).unwrap();
    assert_ne!(after.ctime, before, "the change time moves");
    assert_eq!(
        n.set_xattr(f, b"user.a", b"2", XATTR_CREATE),
        Err(Errno::EEXIST)
    );
    assert_eq!(
        n.set_xattr(f, b"user.b", b"2", XATTR_REPLACE),
        Err(Errno::ENODATA)
    );
    n.set_xattr(f, b"user.a", b"22", XATTR_REPLACE).unwrap();
    n.set_xattr(f, b"user.big", &[7; 65536], 0).unwrap();
    assert_eq!(n.set_xattr(f, b"user.c", &[7; 65537], 0), Err(Errno::E2BIG));
    n.set_xattr(f, b"security.x", b"", 0).unwrap();
    assert_eq!(
        n.get_xattr(f, b"security.x"),
        Ok(Vec::new()),
        "empty, not absent"
    );
    // 256 KiB of names and values at most.
    for i in 0..2 {
        n.set_xattr(f, format!("user.fill{i}").as_bytes(), &[1; 65536], 0)
            .unwrap();
    }
    assert_eq!(
        n.set_xattr(f, b"user.over", &[1; 65536], 0),
        Err(Errno::ENOSPC)
    );
    n.remove_xattr(f, b"user.fill1").unwrap();
    assert_eq!(n.remove_xattr(f, b"user.fill1"), Err(Errno::ENODATA));
    n.link(f, ROOT, b"g").unwrap();
    n.rename(ROOT, b"f", ROOT, b"h", 0).unwrap();
    assert_eq!(n.get_xattr(f, b"user.a"), Ok(b"22".to_vec()));
    let want = vec![
        b"security.x".to_vec(),
        b"user.a".to_vec(),
        b"user.big".to_vec(),
        b"user.fill0".to_vec(),
    ];
    assert_eq!(n.xattr_names(f).unwrap(), want);
    n.take_records(&mut journal);
    let snapshot = n.records();
    for records in [&journal, &snapshot] {
        let (back, skipped) = Namespace::replay(1 << 20, records).unwrap();
        assert_eq!(skipped, 0);
        assert_eq!(back.xattr_names(f).unwrap(), want);
        assert_eq!(back.get_xattr(f, b"user.big"), Ok(vec![7; 65536]));
        assert_eq!(back.get_xattr(f, b"user.fill1"), Err(Errno::ENODATA));
    }
    n.unlink(ROOT, b"g").unwrap();
    n.unlink(ROOT, b"h").unwrap();
    assert_eq!(
        n.get_xattr(f, b"user.a"),
        Err(Errno::ENOENT),
        "gone with the inode"
    );
}

/// The node's extended attributes together are held to a budget (each costing its name, value
/// and a fixed overhead, so that many tiny ones count too): a set past it fails with ENOSPC,
/// and a removal, an inode's end and a replay all keep the count right.
#[test]
fn extended_attributes_are_held_to_the_nodes_budget() {
    let mut n = ns();
    n.journal_changes();
    let mut journal = n.records();
    let (f, g) = (file(&mut n, ROOT, "f"), file(&mut n, ROOT, "g"));
    let each = 6 + 10 + xattrs::ENTRY_COST;
    n.set_max_xattr_bytes(3 * each);
    n.set_xattr(f, b"user.a", &[0; 10], 0).unwrap();
    n.set_xattr(f, b"user.b", &[0; 10], 0).unwrap();
    n.set_xattr(g, b"user.c", &[0; 10], 0).unwrap();
    assert_eq!(n.xattr_bytes().0, 3 * each);
    assert_eq!(n.set_xattr(g, b"user.d", &[0; 10], 0), Err(Errno::ENOSPC));
    assert_eq!(
        n.set_xattr(g, b"user.c", &[0; 11], 0),
        Err(Errno::ENOSPC),
        "growing one"
    );
    n.set_xattr(g, b"user.c", &[1; 10], 0).unwrap();
    n.remove_xattr(f, b"user.a").unwrap();
    n.set_xattr(g, b"user.d", &[0; 10], 0).unwrap();
    n.unlink(ROOT, b"f").unwrap();
    assert_eq!(n.xattr_bytes().0, 2 * each, "the file took its own along");
    n.take_records(&mut journal);
    let (back, _) = Namespace::replay(1 << 20, &journal).unwrap();
    assert_eq!(back.xattr_bytes().0, 2 * each);
    let (back, _) = Namespace::replay(1 << 20, &n.records()).unwrap();
    assert_eq!(back.xattr_bytes().0, 2 * each);
}

/// POSIX ACLs: an access ACL sets the mode's classes (and one the mode says all of is not
/// kept), a chmod moves the mask, what is made under a default ACL inherits it with its mode
/// masked (the umask does not apply; a directory passes the default on), the umask applies
/// without one, and all of it comes back from the journal.
#[test]
fn acls_follow_the_mode_are_inherited_and_survive_a_replay() {
    use crate::acl::from_text;
    use rfs_proto::xattr::{POSIX_ACL_ACCESS, POSIX_ACL_DEFAULT};
    let mut n = ns();
    n.journal_changes();
    let mut journal = n.records();
    let f = file(&mut n, ROOT, "f");
    let named = from_text("u::rw-,u:2000:rwx,g::r--,m::r--,o::---");
    let a = n.set_access_acl(f, &named, false).unwrap();
    assert_eq!(a.perm, 0o640, "the mask is the group's class");
    assert!(a.acl, "the attributes say it has one");
    assert_eq!(n.perms(f).unwrap().acl, Some(named.clone()));
    let a = n
        .setattr(
            f,
            &AttrChanges {
                mode: Some(0o4770),
                ..Default::default()
            },
        )
        .unwrap()
        .0;
    assert_eq!(a.perm, 0o4770);
    let moved = from_text("u::rwx,u:2000:rwx,g::r--,m::rwx,o::---");
    assert_eq!(n.perms(f).unwrap().acl, Some(moved.clone()));
    let a = n
        .set_access_acl(f, &from_text("u::rw-,g::r--,o::r--"), true)
        .unwrap();
    assert_eq!(a.perm, 0o4644, "minimal: the mode says it all");
    assert!(!a.acl);
    assert_eq!(n.get_xattr(f, POSIX_ACL_ACCESS), Err(Errno::ENODATA));
    let sgid = file(&mut n, ROOT, "sgid");
    n.setattr(
        sgid,
        &AttrChanges {
            mode: Some(0o2770),
            ..Default::default()
        },
    )
    .unwrap();
    let a = n.set_access_acl(sgid, &named, true).unwrap();
    assert_eq!(a.perm, 0o640, "the set-group-ID bit went");

    let umasked = Owner {
        perm: 0o666,
        umask: 0o027,
        ..OWNER
    };
    let plain = n.mknod(ROOT, "plain", FileKind::RegularFile, 0, umasked);
    assert_eq!(plain.unwrap().perm, 0o640, "no default ACL: the umask");
    let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
    let default = from_text("u::rwx,u:2000:rwx,g::r-x,m::rwx,o::---");
    n.set_xattr(d, POSIX_ACL_DEFAULT, &default.to_bytes(), 0)
        .unwrap();
    let g = n.mknod(d, "g", FileKind::RegularFile, 0, umasked).unwrap();
    assert_eq!(g.perm, 0o660, "the default ACL, not the umask");
    let inherited = from_text("u::rw-,u:2000:rwx,g::r-x,m::rw-,o::---");
    assert_eq!(n.perms(g.ino).unwrap().acl, Some(inherited.clone()));
    assert!(g.acl, "made with one");
    // A change of its attributes after: journaled without the flag, which the replay keeps.
    let touch = AttrChanges {
        uid: Some(7),
        ..Default::default()
    };
    n.setattr(g.ino, &touch).unwrap();
    assert_eq!(n.get_xattr(g.ino, POSIX_ACL_DEFAULT), Err(Errno::ENODATA));
    let sub = n.mkdir(d, "sub", umasked).unwrap();
    assert_eq!(sub.perm, 0o660);
    assert_eq!(
        n.get_xattr(sub.ino, POSIX_ACL_DEFAULT),
        Ok(default.to_bytes()),
        "a directory passes the default on"
    );
    let link = n.symlink(d, "l", "g", 0, 0).unwrap();
    assert_eq!(link.perm, 0o777);
    assert_eq!(n.xattr_names(link.ino).unwrap(), Vec::<Vec<u8>>::new());

    n.take_records(&mut journal);
    for records in [through_disk(&journal), through_disk(&n.records())] {
        let (back, _) = Namespace::replay(1 << 20, &records).unwrap();
        assert_eq!(back.perms(f).unwrap(), n.perms(f).unwrap());
        assert_eq!(back.perms(g.ino).unwrap().acl, Some(inherited.clone()));
        assert_eq!(back.perms(g.ino).unwrap().attr, n.getattr(g.ino).unwrap());
        assert!(back.getattr(g.ino).unwrap().acl);
        assert_eq!(back.perms(sgid).unwrap().attr.perm, 0o640);
        assert_eq!(
            back.get_xattr(sub.ino, POSIX_ACL_DEFAULT),
            Ok(default.to_bytes())
        );
    }
}

/// What a default ACL hands down is held to the attributes' budget: a create that would take
/// it past fails with ENOSPC and makes nothing.
#[test]
fn an_inherited_acl_past_the_budget_fails_the_create_whole() {
    use crate::acl::from_text;
    use rfs_proto::xattr::POSIX_ACL_DEFAULT;
    let mut n = ns();
    let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
    let default = from_text("u::rwx,u:2000:rwx,g::r-x,m::rwx,o::---").to_bytes();
    n.set_xattr(d, POSIX_ACL_DEFAULT, &default, 0).unwrap();
    n.set_max_xattr_bytes(n.xattr_bytes().0 + 10);
    assert_eq!(
        n.mknod(d, "f", FileKind::RegularFile, 0, OWNER),
        Err(Errno::ENOSPC)
    );
    assert_eq!(n.lookup(d, b"f"), Err(Errno::ENOENT));
    // A chmod rewrites an ACL at its own size: a budget lowered below what is kept (a node
    // restarted with fewer files) does not keep the old one.
    n.set_max_xattr_bytes(u64::MAX);
    let f = file(&mut n, ROOT, "g");
    n.set_access_acl(
        f,
        &from_text("u::rw-,u:2000:rw-,g::r--,m::rw-,o::r--"),
        false,
    )
    .unwrap();
    n.set_max_xattr_bytes(0);
    let chmod = AttrChanges {
        mode: Some(0o600),
        ..Default::default()
    };
    n.setattr(f, &chmod).unwrap();
    let moved = from_text("u::rw-,u:2000:rw-,g::r--,m::---,o::---");
    assert_eq!(n.perms(f).unwrap().acl, Some(moved));
}

/// What a file's chunks hold is in its attributes (what `st_blocks` counts): each chunk's span
/// once, not once per copy, through growth, a cut and a replay.
#[test]
fn attributes_count_what_the_chunks_hold() {
    let mut n = ns();
    n.journal_changes();
    let mut journal = n.records();
    let f = file(&mut n, ROOT, "f");
    assert_eq!(n.getattr(f).unwrap().held, 0);
    let span = |node, len| ChunkRef {
        node,
        addr: 0,
        rkey: 1,
        lo: 0,
        len,
    };
    let copies = vec![span(0, 4096), span(1, 4096)];
    n.add_chunks(f, &[(0, copies.clone()), (3, chunk(3))])
        .unwrap();
    assert_eq!(n.getattr(f).unwrap().held, 4096 + (1 << 20));
    n.add_chunks(f, &[(0, chunk(0))]).unwrap();
    assert_eq!(
        n.getattr(f).unwrap().held,
        4096 + (1 << 20),
        "already there"
    );
    let grown = vec![span(0, 8192), span(1, 8192)];
    assert!(n.replace_copies(f, 0, &copies, grown.clone()));
    assert_eq!(
        n.getattr(f).unwrap().held,
        8192 + (1 << 20),
        "a span that grew"
    );
    assert!(n.replace_copies(f, 0, &grown, copies));
    let cut = AttrChanges {
        size: Some(100),
        ..Default::default()
    };
    assert_eq!(n.setattr(f, &cut).unwrap().0.held, 4096);
    n.take_records(&mut journal);
    for records in [through_disk(&journal), through_disk(&n.records())] {
        let (back, _) = Namespace::replay(1 << 20, &records).unwrap();
        assert_eq!(back.getattr(f).unwrap().held, 4096);
    }
}
