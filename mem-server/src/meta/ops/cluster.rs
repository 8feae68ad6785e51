//! The cluster as its operators see it (`rfs status`): nodes, client sessions, copies short.

use rfs_proto::message::{Drain, Rebalance, RemoveNode, Status};
use rfs_proto::types::{ClientStatus, ClusterStatus, NodeStatus, ShortChunk, SHORT_LISTED};
use rfs_proto::Errno;

use super::{answer, Answer, Ctx};

/// Whether `caller` is root as the node treats it (a squashed root is not).
fn root_only(cx: &Ctx<'_>, caller: &rfs_proto::types::Caller) -> Result<(), Errno> {
    match cx.svc.policy.caller(caller) {
        Ok(c) if c.uid == 0 => Ok(()),
        Ok(_) => Err(Errno::EPERM),
        Err(e) => Err(e),
    }
}

/// Starts or ends draining a data node: the repair thread moves its copies (see
/// [`crate::meta::moves`]).
pub(super) fn drain(cx: &mut Ctx<'_>, m: &Drain) -> Answer {
    let r = root_only(cx, &m.caller).and_then(|()| cx.st.alloc.set_draining(m.node, m.on));
    if r.is_ok() {
        log::warn!(
            "data node {}: draining {}",
            m.node,
            if m.on { "started" } else { "ended" }
        );
        cx.svc.repair.kick();
    }
    answer(m, r)
}

/// Has the repair thread even the nodes' fill out (see [`crate::meta::moves`]).
pub(super) fn rebalance(cx: &mut Ctx<'_>, m: &Rebalance) -> Answer {
    let r = root_only(cx, &m.caller);
    if r.is_ok() && !cx.st.rebalancing {
        log::warn!("rebalancing the data nodes' fill");
        cx.st.rebalancing = true;
        cx.svc.repair.kick();
    }
    answer(m, r)
}

/// Forgets a data node that is not up. Refused while chunks have their only copies there, as
/// those are lost with it, unless forced; its copies of other chunks go from the maps.
pub(super) fn remove_node(cx: &mut Ctx<'_>, m: &RemoveNode) -> Answer {
    let r = root_only(cx, &m.caller).and_then(|()| {
        let only = cx.st.ns.held_only_on(m.node);
        if only > 0 && !m.force && !cx.st.alloc.is_alive(m.node) {
            return Err(Errno::ENOTEMPTY);
        }
        cx.st.alloc.remove(m.node)?;
        let lost = cx.st.ns.drop_node(m.node);
        if lost > 0 {
            cx.svc.repair.lost(lost);
        }
        match only {
            0 => log::warn!("data node {}: removed", m.node),
            _ => log::warn!(
                "data node {}: removed by force with the only copies of {only} chunks: they \
                 stay unreadable",
                m.node
            ),
        }
        Ok(())
    });
    answer(m, r)
}

pub(super) fn status(cx: &mut Ctx<'_>, m: &Status) -> Answer {
    // Client addresses and what each holds are for root only.
    if let Err(e) = root_only(cx, &m.caller) {
        return answer(m, Err(e));
    }
    let held = cx.st.ns.holdings_per_node();
    let nodes = cx
        .st
        .alloc
        .usage()
        .into_iter()
        .map(
            |(id, addr, state, pool_bytes, free_bytes, free_chunks)| NodeStatus {
                id,
                addr,
                state: state.into(),
                meta: id == cx.svc.local,
                pool_bytes,
                free_bytes,
                free_chunks,
                copies: held.get(&id).map_or(0, |h| h.0),
                only_copies: held.get(&id).map_or(0, |h| h.1),
            },
        )
        .collect();
    let clients = cx
        .svc
        .sessions
        .list()
        .into_iter()
        .map(|s| {
            // Never wait for another session's lock under the state lock (its holder may be
            // waiting for that): a session busy just now says nothing of its files.
            let open_files = if s.id == cx.cs.id {
                Some(cx.cs.open.len() as u32)
            } else {
                s.session.try_lock().ok().map(|x| x.open.len() as u32)
            };
            ClientStatus {
                client: s.client,
                addr: s.peer,
                connected: s.connected,
                age_secs: s.age.as_secs(),
                open_files,
                locks: cx.st.locks.held_by(s.id) as u32,
            }
        })
        .collect();
    let chunks_short = cx.svc.repair.short();
    // A scan of every file: only when the repair thread last counted some. The repair's own
    // test of what is short (a copy left to copy from, fewer than asked for).
    let short = match chunks_short {
        0 => Vec::new(),
        _ => {
            let (svc, st) = (cx.svc, &cx.st);
            let counts = |n| svc.counts_as_copy(&st.alloc, n);
            let (found, _) = st.ns.under_replicated(svc.replicas, counts, SHORT_LISTED);
            found
                .into_iter()
                .map(|(ino, index)| ShortChunk {
                    ino,
                    index,
                    copies: st
                        .ns
                        .replicas(ino, index)
                        .map_or(0, |r| r.iter().filter(|c| counts(c.node)).count() as u32),
                })
                .collect()
        }
    };
    let (repaired_chunks, repaired_bytes) = cx.svc.repair.copied();
    answer(
        m,
        Ok(ClusterStatus {
            nodes,
            clients,
            replicas: cx.svc.replicas as u32,
            chunks_short,
            short,
            repaired_chunks,
            repaired_bytes,
            chunk_size: cx.st.ns.chunk_size(),
            inodes: cx.st.ns.inode_count(),
            inodes_max: cx.st.ns.max_inodes(),
            rebalancing: cx.st.rebalancing,
        }),
    )
}
