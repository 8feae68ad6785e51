//! Names: looking up, making, linking, removing and renaming entries, attributes, listing
//! directories. Every call that looks in or changes a directory is checked against its mode
//! bits for the caller; what the caller is told, it may cache, and is told again when that
//! changes (see [`Ctx::told`]).

use rfs_proto::message::{
    GetAttr, Link, Lookup, Mkdir, Mknod, ReadDir, Readlink, Rename, Rmdir, SetAttr, Symlink, Unlink,
};
use rfs_proto::types::{Attr, Owner};
use rfs_proto::wire::MAX_LIST;

use super::{answer, Answer, Ctx};
use crate::access::{
    as_applied, check_change, check_list, check_rename, check_search, check_setattr, check_sticky,
    made_in,
};
use crate::meta::coherence::Recall;
use crate::meta::effects::Tail;
use crate::meta::state::MetaState;
use rfs_proto::types::Ino;
use rfs_proto::Errno;

pub(super) fn lookup(cx: &mut Ctx<'_>, m: &Lookup) -> Answer {
    let r = cx
        .in_dir(&m.caller, m.parent, check_search)
        .and_then(|_| cx.st.ns.lookup(m.parent, &m.name));
    answer(m, cx.told(r, Some(m.parent)))
}

pub(super) fn getattr(cx: &mut Ctx<'_>, m: &GetAttr) -> Answer {
    let r = cx.st.ns.getattr(m.ino);
    answer(m, cx.told(r, None))
}

pub(super) fn setattr(cx: &mut Ctx<'_>, m: &SetAttr) -> Answer {
    let writing = cx.writable(m.ino);
    let chunk_size = cx.st.ns.chunk_size();
    let Ctx { svc, st, fx, .. } = cx;
    let r = svc
        .policy
        .caller(&m.caller)
        .and_then(|c| {
            let before = st.ns.perms(m.ino)?;
            check_setattr(&before, &c, &m.changes, writing)?;
            let tail = match m.changes.size {
                Some(size) => cut_tail(st, m.ino, size)?,
                None => None,
            };
            let changes = as_applied(&before.attr, &c, &m.changes);
            let (a, freed) = st.ns.setattr(m.ino, &changes)?;
            Ok((a, freed, tail))
        })
        .map(|(a, freed, tail)| {
            fx.change.inodes.push((m.ino, m.changes.size.is_some()));
            if let Some(size) = m.changes.size {
                // Every size cut is told, freed chunks or not: holders cut their sizes. The
                // chunk the cut splits is recalled too: its tail is zeroed once nobody can
                // write there (see [`crate::meta::tails`]).
                let from = match &tail {
                    Some(t) => t.index,
                    None => size.div_ceil(chunk_size),
                };
                fx.change.recalls.push(Recall {
                    ino: m.ino,
                    from,
                    cut: true,
                });
                fx.freed.extend(freed);
            }
            if let Some(t) = tail {
                st.frozen.insert((m.ino, t.index));
                st.tails_zeroing
                    .extend(t.replicas.iter().map(|c| (c.node, c.addr)));
                fx.tails.push(t);
            }
            a
        });
    answer(m, cx.told(r, None))
}

/// The tail of the chunk that a cut of `ino` to `size` bytes splits, if there is one to
/// zero (a cut at a chunk's edge or into a hole zeroes nothing). Growing the file zeroes it
/// too: past the size the node knows may lie writes another client has not committed, which
/// the cut holds over. EIO if no copy of that chunk is on a live node: its tail could not be
/// zeroed, and the bytes cut off would come back when the file grew again.
fn cut_tail(st: &MetaState, ino: Ino, size: u64) -> Result<Option<Tail>, Errno> {
    let chunk_size = st.ns.chunk_size();
    if size.is_multiple_of(chunk_size) {
        return Ok(None);
    }
    let index = size / chunk_size;
    if st.frozen.contains(&(ino, index)) {
        log::warn!(
            "inode {ino}: chunk {index} stayed frozen through a whole call: a cut in it fails"
        );
        return Err(Errno::EIO);
    }
    let Some(replicas) = st.ns.replicas(ino, index) else {
        return Ok(None);
    };
    if !replicas.iter().any(|c| st.alloc.is_alive(c.node)) {
        return Err(Errno::EIO);
    }
    Ok(Some(Tail {
        ino,
        index,
        from: size % chunk_size,
        replicas,
    }))
}

/// Whether a cut by `m` must wait: the chunk it splits is frozen (being copied to a new
/// replica, or another cut's tail is being zeroed).
pub(in crate::meta) fn cut_must_wait(st: &MetaState, m: &SetAttr) -> bool {
    let Some(size) = m.changes.size else {
        return false;
    };
    let chunk_size = st.ns.chunk_size();
    !size.is_multiple_of(chunk_size) && st.frozen.contains(&(m.ino, size / chunk_size))
}

pub(super) fn mknod(cx: &mut Ctx<'_>, m: &Mknod) -> Answer {
    let r = cx
        .in_dir(&m.caller, m.parent, check_change)
        .and_then(|(c, dir)| {
            let owner = made_in(cx.svc.policy.owner(m.owner), &dir, &c);
            cx.st.ns.mknod(m.parent, &m.name, m.kind, m.rdev, owner)
        });
    r.is_ok()
        .then(|| cx.fx.change.inodes.push((m.parent, false)));
    answer(m, cx.made(r, m.parent))
}

pub(super) fn mkdir(cx: &mut Ctx<'_>, m: &Mkdir) -> Answer {
    let r = cx.in_dir(&m.caller, m.parent, check_change).and_then(|_| {
        let owner = cx.svc.policy.owner(m.owner);
        cx.st.ns.mkdir(m.parent, &m.name, owner)
    });
    r.is_ok()
        .then(|| cx.fx.change.inodes.push((m.parent, false)));
    answer(m, cx.made(r, m.parent))
}

pub(super) fn symlink(cx: &mut Ctx<'_>, m: &Symlink) -> Answer {
    let o = cx.svc.policy.owner(Owner {
        perm: 0o777,
        uid: m.uid,
        gid: m.gid,
        umask: 0,
    });
    let r = cx
        .in_dir(&m.caller, m.parent, check_change)
        .and_then(|_| cx.st.ns.symlink(m.parent, &m.name, &m.target, o.uid, o.gid));
    r.is_ok()
        .then(|| cx.fx.change.inodes.push((m.parent, false)));
    answer(m, cx.made(r, m.parent))
}

pub(super) fn readlink(cx: &mut Ctx<'_>, m: &Readlink) -> Answer {
    answer(m, cx.st.ns.readlink(m.ino))
}

pub(super) fn link(cx: &mut Ctx<'_>, m: &Link) -> Answer {
    let r = cx
        .in_dir(&m.caller, m.newparent, check_change)
        .and_then(|_| cx.st.ns.link(m.ino, m.newparent, &m.newname));
    if r.is_ok() {
        cx.fx
            .change
            .inodes
            .extend([(m.ino, false), (m.newparent, false)]);
    }
    answer(m, cx.made(r, m.newparent))
}

pub(super) fn unlink(cx: &mut Ctx<'_>, m: &Unlink) -> Answer {
    let victim = cx.target(m.parent, &m.name);
    let r = cx
        .in_dir(&m.caller, m.parent, check_change)
        .and_then(|(c, dir)| victim.map_or(Ok(()), |v| check_sticky(&dir, &v, &c)));
    let r = r
        .and_then(|()| cx.st.ns.unlink(m.parent, &m.name))
        .map(|freed| {
            let ino = victim.map_or(0, |a| a.ino);
            cx.fx
                .change
                .inodes
                .extend([(m.parent, false), (ino, false)]);
            cx.fx.change.entries.push((m.parent, m.name.clone()));
            cx.fx.freed(ino, 0, freed);
        });
    answer(m, r.and_then(|()| cx.dir_after(m.parent)))
}

pub(super) fn rmdir(cx: &mut Ctx<'_>, m: &Rmdir) -> Answer {
    let victim = cx.target(m.parent, &m.name);
    let r = cx
        .in_dir(&m.caller, m.parent, check_change)
        .and_then(|(c, dir)| victim.map_or(Ok(()), |v| check_sticky(&dir, &v, &c)));
    let r = r
        .and_then(|()| cx.st.ns.rmdir(m.parent, &m.name))
        .inspect(|_| {
            cx.fx.change.inodes.push((m.parent, false));
            cx.fx.change.inodes.extend(victim.map(|a| (a.ino, false)));
            cx.fx.change.entries.push((m.parent, m.name.clone()));
        });
    answer(m, r.and_then(|()| cx.dir_after(m.parent)))
}

pub(super) fn rename(cx: &mut Ctx<'_>, m: &Rename) -> Answer {
    let src = cx.target(m.parent, &m.name);
    let dst = cx.target(m.newparent, &m.newname);
    let Ctx { svc, st, fx, .. } = cx;
    let r = svc
        .policy
        .caller(&m.caller)
        .and_then(|c| {
            let (from, to) = (st.ns.perms(m.parent)?, st.ns.perms(m.newparent)?);
            let perms = |a: &Option<Attr>| a.map(|a| st.ns.perms(a.ino)).transpose();
            let (src, dst) = (perms(&src)?, perms(&dst)?);
            check_rename((&from, src.as_ref()), (&to, dst.as_ref()), m.flags, &c)
        })
        .and_then(|()| {
            st.ns
                .rename(m.parent, &m.name, m.newparent, &m.newname, m.flags)
        })
        .map(|freed| {
            let c = &mut fx.change;
            c.inodes.extend([(m.parent, false), (m.newparent, false)]);
            c.inodes
                .extend(src.iter().chain(&dst).map(|a| (a.ino, false)));
            c.entries.push((m.parent, m.name.clone()));
            c.entries.push((m.newparent, m.newname.clone()));
            fx.freed(dst.map_or(0, |a| a.ino), 0, freed);
        });
    let dirs = r.and_then(|()| {
        // The caller's kernel now holds the new name: it is told when it changes.
        cx.st.holders.looked_in(cx.cs.id, m.parent);
        cx.st.holders.looked_in(cx.cs.id, m.newparent);
        let old = cx.dir_after(m.parent)?;
        Ok((old, cx.dir_after(m.newparent)?))
    });
    answer(m, dirs)
}

pub(super) fn readdir(cx: &mut Ctx<'_>, m: &ReadDir) -> Answer {
    let max = m.max.min(MAX_LIST) as usize;
    let r = cx
        .in_dir(&m.caller, m.ino, check_list)
        .and_then(|_| cx.st.ns.readdir(m.ino, m.cookie, max, cx.svc.page_bytes));
    if let Ok(page) = &r {
        cx.st.holders.looked_in(cx.cs.id, m.ino);
        for e in page {
            cx.st.holders.saw(cx.cs.id, e.attr.ino);
        }
    }
    answer(m, r)
}
