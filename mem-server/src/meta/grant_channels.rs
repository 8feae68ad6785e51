//! How the metadata service reaches each data node to grant and revoke: a channel per live node
//! (this node's own pool in process, the others over their join connection). Grants are asked
//! for every node at once and waited for a bounded time; revocations are told in order behind
//! what was asked before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfs_proto::grant::{GrantChunks, GrantRequest, RevokeChunks, RevokeFreed};
use rfs_proto::message::Opened;
use rfs_proto::types::{ChunkRef, FileMap};
use rfs_proto::wire::MAX_LIST;

use super::effects::{by_node, Granting};
use super::ops::Reply;
use super::MetaService;
use crate::grant_channel::{Asked, GrantChannel};
use crate::grants::Grants;

/// How long a chunk map waits for a data node's grant: a live node answers in microseconds; a
/// stopped one must not hold the caller past its I/O deadline (1 s at the least). The map then
/// goes out ungranted for that node, and the client fails the transfer (or asks again).
pub(super) const GRANT_WAIT: Duration = Duration::from_millis(800);

/// The channel to each live data node, by id, with the node's epoch (when it last came back:
/// a map read before that must not be granted there, see [`GrantChannels::grant`]).
pub(crate) struct GrantChannels {
    channels: Mutex<HashMap<u32, (u64, Arc<GrantChannel>)>>,
}

impl GrantChannels {
    /// Links with only this node's own pool (data node `local`), granted in process.
    pub(super) fn new(local: u32, grants: Arc<Grants>) -> GrantChannels {
        GrantChannels {
            channels: Mutex::new(HashMap::from([(
                local,
                (0, Arc::new(GrantChannel::Local(grants))),
            )])),
        }
    }

    /// Grants at data node `node`, back at `epoch`, go over `channel` from now on.
    pub(crate) fn add(&self, node: u32, epoch: u64, channel: GrantChannel) {
        self.channels
            .lock()
            .unwrap()
            .insert(node, (epoch, Arc::new(channel)));
    }

    /// The channel of `node`'s `epoch` goes (not one of a later return).
    pub(crate) fn remove(&self, node: u32, epoch: u64) {
        let mut channels = self.channels.lock().unwrap();
        if channels.get(&node).is_some_and(|(e, _)| *e == epoch) {
            channels.remove(&node);
        }
    }

    /// Whether node `node` has a channel (it has not left).
    pub(super) fn has(&self, node: u32) -> bool {
        self.get(node).is_some()
    }

    fn get(&self, node: u32) -> Option<Arc<GrantChannel>> {
        self.channels
            .lock()
            .unwrap()
            .get(&node)
            .map(|(_, c)| c.clone())
    }

    /// `node`'s channel if the node has not come back since `stamp`.
    fn get_since(&self, node: u32, stamp: u64) -> Option<Arc<GrantChannel>> {
        let channels = self.channels.lock().unwrap();
        let (epoch, channel) = channels.get(&node)?;
        (*epoch <= stamp).then(|| channel.clone())
    }

    /// Asks `node` for `req`, waiting at most `wait` (if given) for the answer; None when the
    /// node is gone, refused or did not answer (logged).
    fn ask_within(&self, node: u32, req: GrantRequest, wait: Option<Duration>) -> Option<Vec<u32>> {
        let channel = self.get(node)?;
        match channel.call(&req, wait) {
            Ok(Ok(keys)) => Some(keys),
            Ok(Err(e)) => {
                log::warn!("data node {node} refused a {:?}: {e}", req.op());
                None
            }
            Err(e) => {
                log::warn!("data node {node}: {e}");
                None
            }
        }
    }

    /// Tells `node` `req` without waiting: it reaches the node after what was asked of it
    /// before and before what is asked after (a failure is logged; the node is then gone).
    pub(super) fn tell(&self, node: u32, req: GrantRequest) {
        if let Some(channel) = self.get(node) {
            let op = req.op();
            if let Err(e) = channel.tell(req) {
                log::warn!("data node {node}: {op:?}: {e}");
            }
        }
    }

    /// The chunk map `g`, each chunk granted to the caller's data session at its node (key 0
    /// where the session has none there yet, or the node refused or did not answer by
    /// `deadline`: every node is asked at once, so slow ones cost that once). Nor is a chunk
    /// granted on a node that `left` since the map was read, or came back since `now`: a copy
    /// the map names there may have been dropped when it left, and its place be another
    /// file's now (the client asks again, for the map as it is). A map read while a node was
    /// away names only what its leave kept, and is granted once it is back.
    fn grant(
        &self,
        data: &HashMap<u32, u64>,
        g: Granting,
        deadline: Instant,
        left: &[u32],
        now: u64,
    ) -> Reply {
        let Granting {
            op,
            writable,
            seq,
            cuts,
            mut chunks,
            opened,
            ..
        } = g;
        let nodes = by_node(chunks.iter().flat_map(|(_, r)| r));
        let asked: Vec<(u32, Asked)> = nodes
            .into_iter()
            .filter_map(|(node, extents)| {
                let session = *data.get(&node)?;
                let req = GrantChunks {
                    session,
                    seq,
                    writable,
                    extents,
                };
                if left.contains(&node) {
                    return None;
                }
                Some((node, self.get_since(node, now)?.ask(&req.into())))
            })
            .collect();
        for (node, asked) in asked {
            let keys = match asked.wait_until(Some(deadline)) {
                Ok(Ok(keys)) => keys,
                Ok(Err(e)) => {
                    log::warn!("data node {node} refused a grant: {e}");
                    continue;
                }
                Err(e) => {
                    log::warn!("data node {node}: {e}");
                    continue;
                }
            };
            let mut keys = keys.into_iter();
            let on_node = chunks
                .iter_mut()
                .flat_map(|(_, r)| r.iter_mut())
                .filter(|c| c.node == node);
            for c in on_node {
                c.rkey = keys.next().unwrap_or(0);
            }
        }
        let map = FileMap { cuts, chunks };
        match opened {
            Some(attr) => Reply::new(op as u8, &Ok(Opened { attr, map })),
            None => Reply::new(op as u8, &Ok(map)),
        }
    }

    /// Takes back what the session was granted on `chunks` (only for writing if
    /// `writable_only`), without waiting: the grants are the session's own, so nobody else
    /// depends on when they go, and a data node that stopped answering must not hold up a
    /// close. Anything asked of the node later comes after.
    pub(super) fn revoke(
        &self,
        data: &HashMap<u32, u64>,
        chunks: &[ChunkRef],
        writable_only: bool,
    ) {
        for (node, extents) in by_node(chunks) {
            let Some(&session) = data.get(&node) else {
                continue;
            };
            for part in extents.chunks(MAX_LIST as usize) {
                let req = RevokeChunks {
                    session,
                    writable_only,
                    addrs: part.iter().map(|&(addr, _)| addr).collect(),
                };
                self.tell(node, req.into());
            }
        }
    }

    /// Has `node` revoke every session's reach to `extents` (freed with free number `seq`),
    /// waiting at most `wait` for each part if given; whether it confirmed.
    pub(super) fn revoke_freed(
        &self,
        node: u32,
        seq: u64,
        extents: &[(u64, u32)],
        wait: Option<Duration>,
    ) -> bool {
        extents.chunks(MAX_LIST as usize).all(|part| {
            let req = RevokeFreed {
                seq,
                extents: part.to_vec(),
            };
            self.ask_within(node, req.into(), wait).is_some()
        })
    }
}

impl MetaService {
    /// Hands out a chunk map granted to the caller's data sessions, within [`GRANT_WAIT`]
    /// (right after a restart, first waiting that long at most for its nodes to be back).
    pub(super) fn grant(&self, data: &HashMap<u32, u64>, g: Granting) -> Reply {
        let deadline = Instant::now() + GRANT_WAIT;
        let nodes = by_node(g.chunks.iter().flat_map(|(_, r)| r));
        self.await_nodes(nodes.keys().copied(), deadline);
        // Nodes that left since the map was read are passed over (their leave may have dropped
        // copies it names), and so are those that come back after this look.
        let (left, now) = {
            let st = self.state.lock();
            (st.alloc.left_since(g.stamp), st.alloc.stamp())
        };
        self.grant_channels.grant(data, g, deadline, &left, now)
    }

    /// Right after a restart, waits (until `deadline` at the latest) for those of `nodes`
    /// that the journal knows and that are not back yet: they join again within moments, and
    /// a map granted without them would fail its reads.
    fn await_nodes(&self, nodes: impl Iterator<Item = u32> + Clone, deadline: Instant) {
        let Some(until) = self.recovery.nodes_until() else {
            return;
        };
        let deadline = deadline.min(until);
        while Instant::now() < deadline {
            let st = self.state.lock();
            if !nodes.clone().any(|n| st.alloc.is_away(n)) {
                return;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_back_since_a_map_was_read_is_not_asked_for_it_and_an_old_life_leaves_the_new() {
        use rdmabox::transport::{Access, Context, TransportConfig};
        let ctx = Context::open(&TransportConfig::default()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let pool = Arc::new(pd.alloc_region(16384, Access::ALL).unwrap());
        let grants = Arc::new(Grants::new(pool, 4096, 16));
        let channels = GrantChannels::new(0, grants.clone());
        channels.add(1, 3, GrantChannel::Local(grants));
        assert!(channels.get_since(1, 3).is_some());
        assert!(
            channels.get_since(1, 2).is_none(),
            "back at 3, after the map"
        );
        channels.remove(1, 2);
        assert!(channels.has(1), "an earlier life's end leaves this one");
        channels.remove(1, 3);
        assert!(!channels.has(1));
    }
}
