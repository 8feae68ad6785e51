//! Draining a data node (`rfs drain`): it takes no new chunks, and the repair thread moves
//! every copy it holds to other nodes, a few chunks of one file per freeze as re-replication
//! copies them (every holder lets go of the file's map first). Each copy on a draining node is
//! copied from itself to a new node (it has every write that reached it, even one that missed
//! another copy), then dropped from the map and freed like any other (revoked, zeroed). A write
//! that reached the old copy and missed another may still ask for the others to be dropped: the
//! copy made from it stands for it ([`MetaState::moved`]). Once a node holds no copy a map
//! names it can be stopped losing nothing.

use std::time::{Duration, Instant};

use rfs_proto::types::{ChunkRef, Ino};

use super::effects::Effects;
use super::repair::{per_freeze, Copied};
use super::{MetaService, MetaState};
use crate::runtime::Runtime;

/// Chunks looked at per pass, and moved per freeze of one file.
const PASS: usize = 1024;
const PER_FREEZE: usize = 16;
/// The least pause between two freezes (clients asking again wait up to 50 ms between tries).
const THAWED: Duration = Duration::from_millis(60);

impl MetaService {
    /// Moves copies off the draining nodes, a pass's worth; (moved, chunks still there).
    pub(super) fn drain_pass(&self, local: &Runtime) -> (usize, usize) {
        let (work, left) = {
            let st = self.state.lock();
            let draining = st.alloc.draining();
            if draining.is_empty() {
                return (0, 0);
            }
            st.ns.chunks_held_on(|n| draining.contains(&n), PASS)
        };
        let mut moved = 0;
        for (ino, indices) in per_freeze(&work, PER_FREEZE) {
            if !self.can_move(ino, &indices) {
                continue;
            }
            let started = Instant::now();
            let indices = self.freeze(ino, &indices);
            let (mut here, mut dropped) = (0, Vec::new());
            for &index in &indices {
                let (done, gone) = self.move_off(local, ino, index);
                here += usize::from(done);
                dropped.extend(gone);
            }
            if !dropped.is_empty() {
                let mut effects = Effects {
                    freed: dropped,
                    quick: true,
                    ..Effects::default()
                };
                effects.change.remaps.push(ino);
                self.settle(self.state.lock(), None, effects);
            }
            self.thaw(ino, &indices);
            moved += here;
            // Within the repair rate, and a pause between freezes in which maps go out.
            let bytes = here as u64 * self.state.lock().ns.chunk_size();
            let budget = Duration::from_secs_f64(bytes as f64 / self.repair.rate() as f64);
            std::thread::sleep(budget.saturating_sub(started.elapsed()).max(THAWED));
        }
        (moved, left.saturating_sub(moved))
    }

    /// Whether some chunk among `indices` of `ino` has a copy on a live draining node and a
    /// place for a new one (else the file is not frozen for nothing).
    fn can_move(&self, ino: Ino, indices: &[u64]) -> bool {
        let st = self.state.lock();
        let mut avoid = self.repair.avoided();
        avoid.extend(st.alloc.draining());
        indices.iter().any(|&index| {
            st.ns.replicas(ino, index).is_some_and(|r| {
                r.iter()
                    .any(|c| avoid.contains(&c.node) && st.alloc.is_alive(c.node))
                    && st.alloc.can_place(&r, &avoid)
            })
        })
    }

    /// Moves every copy of chunk `index` of `ino` (frozen) off the draining nodes: whether
    /// none is left there, and the copies dropped from the map (to be freed).
    fn move_off(&self, local: &Runtime, ino: Ino, index: u64) -> (bool, Vec<ChunkRef>) {
        let mut dropped = Vec::new();
        loop {
            let (leaving, target, len) = {
                let mut st = self.state.lock();
                let Some(replicas) = st.ns.replicas(ino, index) else {
                    return (true, dropped); // freed meanwhile
                };
                let draining = st.alloc.draining();
                let Some(leaving) = replicas
                    .iter()
                    .copied()
                    .find(|c| draining.contains(&c.node))
                else {
                    return (true, dropped);
                };
                if !st.alloc.is_alive(leaving.node) {
                    return (false, dropped); // its copy cannot be read
                }
                let mut avoid = self.repair.avoided();
                avoid.extend(draining);
                let Some(target) = st.alloc.alloc_replica(&replicas, &avoid) else {
                    return (false, dropped); // no room elsewhere now: the next pass tries again
                };
                (leaving, target, st.ns.chunk_size() as usize)
            };
            if !matches!(
                self.copy_into(local, ino, index, &[leaving], target, len),
                Copied::Done(_)
            ) {
                return (false, dropped);
            }
            let mut st = self.state.lock();
            let Some(replicas) = st.ns.replicas(ino, index) else {
                return (true, dropped);
            };
            let kept: Vec<ChunkRef> = replicas
                .iter()
                .copied()
                .filter(|c| (c.node, c.addr) != (leaving.node, leaving.addr))
                .collect();
            match st.ns.drop_replicas(ino, index, &kept) {
                Ok(gone) => {
                    remember_moved(&mut st, leaving, target, self.lease);
                    dropped.extend(gone);
                }
                Err(_) => return (false, dropped),
            }
        }
    }
}

/// Records that `from` was moved to `to`, forgetting moves older than two leases (a write's
/// drop of the copies it missed comes within its call's deadline).
fn remember_moved(st: &mut MetaState, from: ChunkRef, to: ChunkRef, lease: Duration) {
    let now = Instant::now();
    st.moved
        .retain(|_, &mut (_, at)| now.duration_since(at) < 2 * lease);
    st.moved.insert((from.node, from.addr), (to, now));
}
