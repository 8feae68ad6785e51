//! Chunks: a file's chunk map (granted to the caller's data sessions before it is answered),
//! allocation, replicas that missed a write, the space and the data nodes there are, and which
//! data session of the client a node's grants go to.

use rfs_proto::message::RequestOp;
use rfs_proto::message::{Allocate, AttachData, ChunkMap, DropReplicas, GetStatFs, ListNodes};
use rfs_proto::types::{ChunkRef, NodeInfo, StatFs};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::Errno;

use super::{answer, Answer, Ctx};
use crate::meta::effects::is_frozen;
use crate::spans::Room;

pub(super) fn chunk_map(cx: &mut Ctx<'_>, m: &ChunkMap) -> Answer {
    // Only through a handle: the open is where permission was checked.
    let r = match cx.cs.open.get(&m.ino) {
        Some(_) if is_frozen(&cx.st.frozen, m.ino, m.first, m.count) => Err(Errno::EAGAIN),
        Some(_) => cx
            .st
            .ns
            .chunk_map_page(m.ino, m.first, m.count as u64, MAX_LIST as usize),
        None => Err(Errno::EBADF),
    };
    match r {
        Ok(chunks) => {
            cx.st.holders.fetched(cx.cs.id, m.ino);
            let writable = cx.writable(m.ino);
            cx.granting(RequestOp::ChunkMap, m.ino, writable, chunks)
        }
        Err(e) => answer(m, Err(e)),
    }
}

pub(super) fn allocate(cx: &mut Ctx<'_>, m: &Allocate) -> Answer {
    let writable = cx.writable(m.ino);
    let cs = cx.st.ns.chunk_size();
    let first = m.offset / cs;
    let count = match m.end > m.offset {
        true => ((m.end - 1) / cs - first + 1).min(MAX_LIST as u64),
        false => 0,
    };
    let short = pool_short(&cx.st.alloc, cs);
    let Ctx { svc, st, fx, .. } = cx;
    let mut attempt = |room| {
        if !writable {
            return Err(Errno::EBADF);
        }
        if count == 0 {
            return Err(Errno::EINVAL);
        }
        if is_frozen(&st.frozen, m.ino, first, count as u32) {
            return Err(Errno::EAGAIN);
        }
        let needed = st.ns.spans_needed(m.ino, m.offset, m.end, count, room)?;
        let (holes, grow): (Vec<_>, Vec<_>) = needed.into_iter().partition(|n| n.1.is_none());
        let spans: Vec<(u32, u32)> = holes.iter().map(|&(_, _, span)| span).collect();
        let chunks = match st.alloc.alloc_spans(&spans, svc.replicas) {
            Err(Errno::ENOSPC) if whole_wanted(&spans, cs) > 0 && st.alloc.compactable() => {
                svc.compaction.ask(whole_wanted(&spans, cs) * svc.replicas);
                return Err(Errno::EAGAIN); // asked again once whole chunks were made
            }
            // Space held by windows being emptied comes back within a lease or two: once
            // not even the pages of the write fit.
            Err(Errno::ENOSPC) if room == Room::Tight && st.alloc.compacting() => {
                return Err(Errno::EAGAIN)
            }
            r => r?,
        };
        if chunks.iter().any(|c| c.len() < svc.replicas) {
            svc.repair.degraded(chunks.len());
        }
        let new: Vec<_> = holes.into_iter().map(|(i, ..)| i).zip(chunks).collect();
        if let Err(e) = st.ns.add_chunks(m.ino, &new) {
            fx.freed.extend(new.into_iter().flat_map(|(_, c)| c));
            return Err(e);
        }
        let mut moving = false;
        for (index, copies, (lo, len)) in grow {
            let copies = copies.unwrap_or_default();
            match st.alloc.grow_in_place(&copies, lo, len) {
                Some(grown) => {
                    st.ns.replace_copies(m.ino, index, &copies, grown);
                    // Other holders' references stay good (the addresses do not change), but
                    // would read zeros past the old span: they let go of the map (the caller
                    // gets the new one in the answer).
                    if !fx.change.remaps.contains(&m.ino) {
                        fx.change.remaps.push(m.ino);
                    }
                    fx.quick = true;
                }
                None if st.alloc.can_move(&copies, len) => {
                    svc.growth.ask(m.ino, index, (lo, len));
                    moving = true;
                }
                None if len as u64 >= cs && st.alloc.compactable() => {
                    svc.compaction.ask(copies.len().max(1));
                    moving = true;
                }
                None if room == Room::Tight && st.alloc.compacting() => moving = true,
                None => return Err(Errno::ENOSPC),
            }
        }
        if moving {
            return Err(Errno::EAGAIN); // asked again once the chunk moved
        }
        st.ns.chunk_map(m.ino, first, count)
    };
    // A nearly full pool may have the pages of the write where room to grow does not fit
    // (holes that trimmed spans left): those rather than ENOSPC. Where it is short, they come
    // first: room to grow taken for one chunk could leave another's growth no pages.
    let result = match short {
        true => attempt(Room::Tight),
        false => match attempt(Room::ToGrow) {
            Err(Errno::ENOSPC) => attempt(Room::Tight),
            r => r,
        },
    };
    match result {
        Ok(chunks) => {
            cx.st.holders.fetched(cx.cs.id, m.ino);
            cx.granting(RequestOp::Allocate, m.ino, true, chunks)
        }
        Err(e) => answer(m, Err(e)),
    }
}

/// Whether the pool is short enough that writes get the pages of their bytes alone: less than
/// a chunk's worth allocatable per node, or space held for compaction.
fn pool_short(alloc: &crate::alloc::Allocator, chunk_size: u64) -> bool {
    let (alive, _) = alloc.node_counts();
    alloc.compacting() || alloc.allocatable_bytes() < chunk_size * alive.max(1) as u64
}

/// How many of `spans` are whole chunks (of `chunk_size`): what only compaction can make
/// room for in a pool that has free space but no free chunk.
fn whole_wanted(spans: &[(u32, u32)], chunk_size: u64) -> usize {
    spans.iter().filter(|s| s.1 as u64 >= chunk_size).count()
}

pub(super) fn drop_replicas(cx: &mut Ctx<'_>, m: &DropReplicas) -> Answer {
    let writable = cx.writable(m.ino);
    let Ctx { svc, st, fx, .. } = cx;
    let r = writable
        .then_some(())
        .ok_or(Errno::EBADF)
        .and_then(|()| {
            // A copy a drain moved meanwhile has the write in the copy made from it.
            let reached: Vec<ChunkRef> = m
                .reached
                .iter()
                .map(|c| st.moved.get(&(c.node, c.addr)).copied().unwrap_or(*c))
                .collect();
            st.ns.drop_replicas(m.ino, m.index, &reached)
        })
        .map(|dropped| {
            let n = dropped.len() as u32;
            if !dropped.is_empty() {
                log::warn!(
                    "inode {}: chunk {}: a write missed its replicas on nodes {:?}: dropped, to \
                     be copied again",
                    m.ino,
                    m.index,
                    dropped.iter().map(|c| c.node).collect::<Vec<_>>()
                );
                // Other holders must not read the copies that missed the write; the chunks
                // themselves are freed once they let go.
                fx.change.remaps.push(m.ino);
                svc.repair.avoid(dropped.iter().map(|c| c.node));
                fx.freed.extend(dropped);
                fx.quick = true;
                svc.repair.lost(1);
            }
            n
        });
    answer(m, r)
}

pub(super) fn statfs(cx: &mut Ctx<'_>, m: &GetStatFs) -> Answer {
    // Space as files see it: each byte takes a byte on every replica's node.
    let (total, free) = cx.st.alloc.totals();
    let copies = cx.svc.replicas as u64;
    answer(
        m,
        Ok(StatFs {
            chunk_size: cx.st.ns.chunk_size(),
            bytes_total: total / copies,
            bytes_free: free / copies,
            inodes: cx.st.ns.inode_count(),
            inodes_max: cx.st.ns.max_inodes(),
            lease_ms: cx.svc.lease.as_millis() as u64,
            replicas: cx.svc.replicas as u32,
            chunks_short: cx.svc.repair.short(),
        }),
    )
}

pub(super) fn list_nodes(cx: &mut Ctx<'_>, m: &ListNodes) -> Answer {
    // A node known from the journal and not back yet still counts: clients wait for it
    // rather than give up on it.
    let alloc = &cx.st.alloc;
    let nodes = alloc
        .nodes(cx.svc.local)
        .into_iter()
        .map(|n| NodeInfo {
            alive: cx.svc.counts_as_copy(alloc, n.id),
            ..n
        })
        .collect();
    answer(m, Ok(nodes))
}

/// The name only says where this session's grants go: a client naming another's session gives
/// that one more reach, never itself. What the session granted before goes with the old name:
/// revocations follow the new one.
pub(super) fn attach_data(cx: &mut Ctx<'_>, m: &AttachData) -> Answer {
    let r = if (m.node as usize) < cx.st.alloc.node_counts().1 {
        if let Some(old) = cx.cs.data.insert(m.node, m.session) {
            (old != m.session).then(|| cx.fx.detached.push((m.node, old)));
        }
        Ok(())
    } else {
        Err(Errno::EINVAL)
    };
    answer(m, r)
}
