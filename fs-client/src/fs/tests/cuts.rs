//! Truncates and punched holes: a cut is never undone.

use super::*;

/// A truncate inside a chunk zeroes the rest of the chunk before the node cuts the file; if
/// the node refuses the cut, the zeroed bytes are in the file still, and go back (they were
/// lost before).
#[test]
fn a_truncate_the_node_refuses_loses_no_byte() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (ino, fh, data) = committed_file(&fs, 2 * CHUNK);
    let half = CHUNK / 2;
    cluster.refuse_next(RequestOp::SetAttr, Errno::EIO);
    assert_eq!(resize(&fs, ino, half).unwrap_err().errno(), Errno::EIO);
    assert_eq!(fs.getattr(ino).unwrap().size, 2 * CHUNK);
    assert!(
        read(&fs, ino, 0, data.len()).unwrap() == data,
        "the bytes zeroed ahead of the cut stayed zeros"
    );
    // The cut made after all.
    assert_eq!(resize(&fs, ino, half).unwrap().size, half);
    assert_grows_with_zeros_past(&fs, ino, half, &data);
    fs.release(fh).unwrap();
}

/// A cut applied whose answer is lost (modelled as a refusal while the node's state is cut, as
/// an applied cut leaves it), and the node out of reach for the question after it: the zeroed
/// tail is not put back, past the new end of the file, where growing the file would show the
/// old bytes again (a first version of the fix put it back; found by a review).
#[test]
fn a_cut_whose_answer_is_lost_does_not_bring_old_bytes_back() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (ino, fh, data) = committed_file(&fs, CHUNK);
    let half = CHUNK / 2;
    cluster.refuse_next(RequestOp::SetAttr, Errno::EIO);
    let c = cluster.clone();
    cluster.after_next_answer(
        RequestOp::SetAttr,
        Box::new(move || {
            c.cut(ino, half); // what an applied cut leaves on the node
            c.unreachable(true); // its answer, and the GetAttr after it, lost
        }),
    );
    assert!(resize(&fs, ino, half).is_err());
    cluster.unreachable(false);
    assert_eq!(cluster.size(ino), half, "the node cut the file");
    assert_grows_with_zeros_past(&fs, ino, half, &data);
    fs.release(fh).unwrap();
}

/// A cut applied whose answer is lost, and the node answers the question after it: the
/// truncate happened, and says so.
#[test]
fn a_cut_whose_answer_is_lost_is_learned_from_the_node() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (ino, fh, _) = committed_file(&fs, CHUNK);
    let half = CHUNK / 2;
    cluster.refuse_next(RequestOp::SetAttr, Errno::EIO);
    let c = cluster.clone();
    cluster.after_next_answer(RequestOp::SetAttr, Box::new(move || c.cut(ino, half)));
    assert_eq!(resize(&fs, ino, half).unwrap().size, half);
    assert_eq!(fs.getattr(ino).unwrap().size, half);
    fs.release(fh).unwrap();
}

/// Another mount writes into the tail while our truncate's SetAttr is on its way, and the node
/// refuses the cut: the tail read before it is not put back over the other mount's write (a
/// first version of the fix did; found by a review).
#[test]
fn a_refused_cut_does_not_put_old_bytes_over_a_newer_write() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    let (ino, fa, _) = committed_file(&a, CHUNK);
    let (fb, _) = b.open(ino, RW, &ROOT_CALLER).unwrap();
    let half = CHUNK / 2;
    let newer = pattern(16, 77);
    cluster.refuse_next(RequestOp::SetAttr, Errno::EIO);
    let (b2, newer2) = (b.clone(), newer.clone());
    cluster.after_next_answer(
        RequestOp::SetAttr,
        Box::new(move || {
            write(&b2, ino, half + 100, &newer2).unwrap();
            b2.commit(ino).unwrap();
        }),
    );
    assert!(resize(&a, ino, half).is_err());
    assert_eq!(cluster.size(ino), CHUNK, "not cut");
    let got = read(&b, ino, half + 100, newer.len()).unwrap();
    assert!(
        got == newer,
        "the other mount's write was overwritten with old bytes"
    );
    a.release(fa).unwrap();
    b.release(fb).unwrap();
}

#[test]
fn punching_a_hole_leaves_holes_unallocated() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "sparse");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 10 * CHUNK, b"end").unwrap();
    let allocated = cluster.chunk_count(ino);
    fs.fallocate(
        ino,
        0,
        5 * CHUNK,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
    )
    .unwrap();
    assert_eq!(cluster.chunk_count(ino), allocated);
    assert_eq!(read(&fs, ino, 10 * CHUNK, 3).unwrap(), b"end");
    fs.release(fh).unwrap();
}

/// A write admitted before a cut made elsewhere that this mount had not heard of (its callback
/// lost), and refused for the key the cut revoked, is not sent again through a map read after
/// the cut: its bytes would land past the cut's zeros and show when the file grows. It fails,
/// reported by the flush, and the cut holds. (Sent again, it did land there: found end to end
/// with a severed mount.)
#[test]
fn a_write_a_cut_fenced_off_is_not_sent_again_past_the_cut() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let (ino, fh, data) = committed_file(&fs, CHUNK);
    let half = CHUNK / 2;
    cluster.hold_writes();
    let answered = write_behind(&fs, ino, half + 100, &[0xbb; 100], false);
    assert_eq!(
        answered.recv().unwrap().unwrap(),
        100,
        "answered once mapped"
    );
    // Another client cuts the file; its callback never reaches us; the cut revokes our keys.
    cluster.cut(ino, half);
    cluster.revoke_keys();
    cluster.let_writes_go();
    assert_eq!(fs.flush(ino, fh).unwrap_err().errno(), Errno::EIO);
    assert_eq!(cluster.size(ino), half);
    assert_eq!(fs.getattr(ino).unwrap().size, half, "the cut is heard of");
    assert_grows_with_zeros_past(&fs, ino, half, &data);
    fs.release(fh).unwrap();
}

/// A write whose fresh map shows a cut made elsewhere that this mount has not heard of yet
/// (its callback on its way; here our cached map was dropped, as a reconnection drops it)
/// hears of the cut first and goes after it: the file grows over the write's bytes. Without
/// that, its size counted from before the cut was refused, and its bytes past the cut, landed
/// after the cut's zeros, showed when the file grew.
#[test]
fn a_write_mapped_after_a_cut_it_had_not_heard_of_goes_after_the_cut() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client_with(&cluster, BEHIND);
    let (ino, fh, data) = committed_file(&fs, CHUNK);
    let half = CHUNK / 2;
    fs.chunks.forget(ino, 0);
    cluster.cut(ino, half);
    let bytes = [0xbb; 100];
    let answered = write_behind(&fs, ino, half + 100, &bytes, false);
    assert_eq!(answered.recv().unwrap().unwrap(), 100);
    fs.flush(ino, fh).unwrap();
    assert_eq!(cluster.size(ino), half + 200, "the write grew the cut file");
    let back = read(&fs, ino, 0, (half + 200) as usize).unwrap();
    assert!(back[..half as usize] == data[..half as usize]);
    assert!(back[half as usize..(half + 100) as usize]
        .iter()
        .all(|&b| b == 0));
    assert!(back[(half + 100) as usize..] == bytes);
    fs.release(fh).unwrap();
}
