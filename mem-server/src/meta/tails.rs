//! The tail a cut leaves: a truncate inside a chunk keeps that chunk, and the bytes past the new
//! end must read as zeros when the file grows again. Any client holding the file's map may be
//! writing there when the cut is made, unaware of it (its callback is on its way, or its
//! connection is down and its map still within its lease). So the chunk is frozen (no map of
//! it is handed out) and recalled from every holder with the cut; once the holders answered
//! (each only after its transfers through the chunk are done) or could not be asked, every
//! session's grant of the chunk is revoked at its nodes (a write through an old map now fails,
//! and its client asks again, hearing of the cut), and only then is the tail zeroed, on every
//! copy, and the chunk thawed. A write either landed before the zeros or never lands.

use std::time::Duration;

use rfs_proto::types::ChunkRef;

use super::effects::{Effects, Tail};
use super::grant_channels::GRANT_WAIT;
use super::MetaService;

/// How long zeroing a tail on another node may take before that copy is given up (and
/// dropped from the map, to be copied again from one that was zeroed).
const ZERO_LIMIT: Duration = Duration::from_secs(2);

impl MetaService {
    /// Zeroes the tails cut by a change whose holders have answered (or could not be asked),
    /// and thaws their chunks. A copy that could not be revoked or zeroed is dropped from the
    /// map, as a copy a write missed is, when another copy was zeroed.
    pub(super) fn zero_cut_tails(&self, tails: Vec<Tail>) {
        for tail in tails {
            let zeroed = self.zero_tail(&tail);
            let mut st = self.state.lock();
            st.frozen.remove(&(tail.ino, tail.index));
            for c in &tail.replicas {
                st.tails_zeroing.remove(&(c.node, c.addr));
            }
            if zeroed.len() == tail.replicas.len() {
                continue;
            }
            if zeroed.is_empty() {
                log::error!(
                    "inode {}: chunk {}: no copy's tail could be zeroed after a cut: the bytes \
                     cut off may show if the file grows again",
                    tail.ino,
                    tail.index
                );
                continue;
            }
            let dropped = match st.ns.drop_replicas(tail.ino, tail.index, &zeroed) {
                Ok(dropped) if !dropped.is_empty() => dropped,
                _ => continue,
            };
            log::warn!(
                "inode {}: chunk {}: the tail of its copies on nodes {:?} could not be zeroed \
                 after a cut: dropped, to be copied again",
                tail.ino,
                tail.index,
                dropped.iter().map(|c| c.node).collect::<Vec<_>>()
            );
            self.repair.avoid(dropped.iter().map(|c| c.node));
            self.repair.lost(1);
            let mut effects = Effects {
                freed: dropped,
                quick: true,
                ..Effects::default()
            };
            effects.change.remaps.push(tail.ino);
            self.settle(st, None, effects);
        }
    }

    /// Revokes every session's grant of `tail`'s chunk on each copy, then zeroes the tail
    /// there; the copies done (a copy zeroed whose node did not confirm the revocation is not:
    /// a write through an old grant may still land there). A copy the map no longer names is
    /// passed over: its node left meanwhile, and its place may be another file's once the
    /// node is back (and a return after this look cannot be reached with what it stamps).
    fn zero_tail(&self, tail: &Tail) -> Vec<ChunkRef> {
        // A grant decided before this number is refused by the node: none of this chunk is
        // decided while it is frozen, and one decided before must not come back after.
        let (seq, stamp, named) = {
            let mut st = self.state.lock();
            st.frees += 1;
            let named = st.ns.replicas(tail.ino, tail.index).unwrap_or_default();
            (st.frees, st.alloc.stamp(), named)
        };
        let mut zeroed = Vec::with_capacity(tail.replicas.len());
        for c in &tail.replicas {
            if !named.iter().any(|n| n.place() == c.place()) {
                continue;
            }
            let revoked =
                self.grant_channels
                    .revoke_freed(c.node, seq, &[(c.addr, c.len)], Some(GRANT_WAIT));
            if !revoked {
                log::warn!(
                    "inode {}: chunk {}: data node {} did not confirm the revocation of its \
                     grants before its tail is zeroed",
                    tail.ino,
                    tail.index,
                    c.node
                );
            }
            // The part of the copy's span past the cut.
            let from = tail.from.max(c.lo as u64);
            let len = c.hi().saturating_sub(from) as usize;
            let zeroing = match len {
                0 => Ok(()),
                _ => self
                    .zeroer
                    .zero_range(c, from - c.lo as u64, len, ZERO_LIMIT, stamp),
            };
            match zeroing {
                Ok(()) if revoked => zeroed.push(*c),
                Ok(()) => {}
                Err(e) => log::warn!(
                    "inode {}: chunk {}: zeroing its tail on data node {}: {e}",
                    tail.ino,
                    tail.index,
                    c.node
                ),
            }
        }
        zeroed
    }
}
