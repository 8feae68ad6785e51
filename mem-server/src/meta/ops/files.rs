//! Files: handles (open, create, release, and taking them back after a restart) and sizes
//! (commit). A session's last handle of a file takes its grants on the file with it; an
//! unlinked file goes with the last handle of every session, and a closed file gives back
//! what was allocated ahead past its size.

use rfs_proto::message::{
    Commit, Create, Open, Opened, Reclaim, Release, ReleaseMany, RequestOp, OPEN_MAP_CHUNKS,
};
use rfs_proto::types::{FileAccess, FileKind, FileMap, Ino};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::Errno;

use super::{answer, Answer, Ctx};
use crate::access::{check_access_bits, check_change, check_open, made_in};
use crate::meta::effects::{is_frozen, Effects};
use crate::namespace::Namespace;

pub(super) fn open(cx: &mut Ctx<'_>, m: &Open) -> Answer {
    let r = cx
        .svc
        .policy
        .caller(&m.caller)
        .and_then(|c| check_open(&cx.st.ns.perms(m.ino)?, &c, m.access))
        .and_then(|()| cx.st.ns.open(m.ino));
    if r.is_ok() {
        cx.opened(m.ino, m.access);
    }
    let attr = match cx.told(r, None) {
        Ok(a) => a,
        Err(e) => return answer(m, Err(e)),
    };
    // The first chunks of the map go with it, granted as a map fetch's are (a file being
    // copied just then answers none: the client fetches them when it needs them, and waits).
    let count = OPEN_MAP_CHUNKS;
    let map = match is_frozen(&cx.st.frozen, m.ino, 0, count) {
        true => Ok(Vec::new()),
        false => cx
            .st
            .ns
            .chunk_map_page(m.ino, 0, count as u64, MAX_LIST as usize),
    };
    match map {
        Ok(chunks) if !chunks.is_empty() => {
            cx.st.holders.fetched(cx.cs.id, m.ino);
            let writable = cx.writable(m.ino);
            let mut granting = cx.granting(RequestOp::Open, m.ino, writable, chunks);
            if let Answer::Grant(g) = &mut granting {
                g.opened = Some(attr);
            }
            granting
        }
        _ => {
            let map = FileMap {
                cuts: attr.cuts,
                chunks: Vec::new(),
            };
            answer(m, Ok(Opened { attr, map }))
        }
    }
}

pub(super) fn create(cx: &mut Ctx<'_>, m: &Create) -> Answer {
    let r = check_access_bits(m.access)
        .and_then(|()| cx.in_dir(&m.caller, m.parent, check_change))
        .and_then(|(c, dir)| {
            let owner = made_in(cx.svc.policy.owner(m.owner), &dir, &c);
            let a = cx
                .st
                .ns
                .mknod(m.parent, &m.name, FileKind::RegularFile, 0, owner)?;
            cx.st.ns.open(a.ino)
        });
    if let Ok(a) = &r {
        cx.opened(a.ino, m.access);
        cx.fx.change.inodes.push((m.parent, false));
    }
    answer(m, cx.made(r, m.parent))
}

pub(super) fn release_one(cx: &mut Ctx<'_>, m: &Release) -> Answer {
    let r = close_handle(cx, m.ino, m.access);
    unlock_if_closed(cx, m.ino);
    answer(m, r)
}

pub(super) fn release_many(cx: &mut Ctx<'_>, m: &ReleaseMany) -> Answer {
    let mut closed = 0;
    for &(ino, access) in &m.handles {
        if close_handle(cx, ino, access).is_ok() {
            closed += 1;
        }
        unlock_if_closed(cx, ino);
    }
    answer(m, Ok(closed))
}

pub(super) fn commit(cx: &mut Ctx<'_>, m: &Commit) -> Answer {
    // Through any handle: close(2) of a read-only descriptor flushes what the client's
    // writers left uncommitted, and may come after their release.
    let r = match cx.cs.open.get(&m.ino) {
        Some(_) => cx.st.ns.commit(m.ino, m.size, m.mtime, m.cuts),
        None => Err(Errno::EBADF),
    };
    if r.is_ok() {
        cx.fx.change.inodes.push((m.ino, true));
        cx.st.holders.saw(cx.cs.id, m.ino);
    }
    answer(m, r)
}

/// After a restart, within the grace period: the handles the client had, taken again without
/// a permission check (it was made when they were opened).
pub(super) fn reclaim(cx: &mut Ctx<'_>, m: &Reclaim) -> Answer {
    let r = match cx.svc.recovery.reclaiming() {
        true => {
            let mut taken = 0;
            for &(ino, access) in &m.handles {
                let file = cx
                    .st
                    .ns
                    .getattr(ino)
                    .is_ok_and(|a| a.kind == FileKind::RegularFile);
                if file && check_access_bits(access).is_ok() && cx.st.ns.open(ino).is_ok() {
                    cx.opened(ino, access);
                    taken += 1;
                }
            }
            Ok(taken)
        }
        // Handles are taken with a permission check outside the grace period.
        false => Err(Errno::EPERM),
    };
    answer(m, r)
}

/// Closes one of the session's handles of `ino`, taken for `access` (EBADF: it holds none
/// such).
fn close_handle(cx: &mut Ctx<'_>, ino: Ino, access: FileAccess) -> Result<(), Errno> {
    let Ctx { st, cs, fx, .. } = cx;
    let h = match cs.open.get_mut(&ino) {
        Some(h) if h.all > 0 && (!access.contains(FileAccess::WRITE) || h.writable > 0) => h,
        _ => return Err(Errno::EBADF),
    };
    let was_writable = h.writable > 0;
    h.all -= 1;
    h.writable -= (access.contains(FileAccess::WRITE)) as u32;
    // A client that closes a writable handle as read-only keeps no more writable handles
    // than handles.
    h.writable = h.writable.min(h.all);
    // Its last handle, or its last writable one: the session's grants on the file go, or
    // those for writing.
    let last = h.all == 0;
    if last || (was_writable && h.writable == 0) {
        let all = st.ns.chunk_map(ino, 0, u64::MAX).unwrap_or_default();
        let chunks = all.into_iter().flat_map(|(_, c)| c);
        if last {
            fx.closed.extend(chunks);
        } else {
            fx.closed_for_writing.extend(chunks);
        }
    }
    if last {
        cs.open.remove(&ino);
    }
    st.holders.closed(cs.id, ino);
    release(&mut st.ns, ino, fx);
    Ok(())
}

/// A session that closed its last handle of `ino` holds no lock on it any more (its client
/// drops them before; this covers one that did not).
fn unlock_if_closed(cx: &mut Ctx<'_>, ino: Ino) {
    if !cx.cs.open.contains_key(&ino) {
        let woken = cx.st.locks.drop_on(ino, cx.cs.id, None);
        cx.fx.woken.extend(woken);
    }
}

/// One handle of `ino` closed: an unlinked file goes with its last handle, a closed file gives
/// back the chunks allocated ahead past its size (see [`Effects::keep_past_size`]).
pub(in crate::meta) fn release(ns: &mut Namespace, ino: Ino, effects: &mut Effects) {
    let reaped = ns.release(ino);
    if !reaped.is_empty() {
        effects.change.inodes.push((ino, true));
        effects.freed(ino, 0, reaped);
    } else if effects.keep_past_size {
        // Given back at the file's next last close.
    } else if let Some((from, trimmed)) = ns.trim(ino) {
        effects.trimmed(ino, from, trimmed);
    }
}
