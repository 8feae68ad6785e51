//! Draining a data node (`rfs drain`): it takes no new chunks, and the repair thread moves
//! every copy it holds to other nodes, a few chunks of one file per freeze as re-replication
//! copies them: a new copy is made elsewhere (unless the chunk has enough copies on nodes that
//! stay), then the draining node's copy is dropped from the map and freed like any other
//! (recalled from its holders, revoked, zeroed). Once it holds nothing it can be stopped losing
//! nothing.

use std::time::{Duration, Instant};

use rfs_proto::types::{ChunkRef, Ino};

use super::effects::Effects;
use super::repair::Copied;
use super::MetaService;
use crate::runtime::Runtime;

/// Chunks looked at per pass, and moved per freeze of one file.
const PASS: usize = 1024;
const PER_FREEZE: usize = 16;
/// The least pause between two freezes (clients asking again wait up to 50 ms between tries).
const THAWED: Duration = Duration::from_millis(60);

impl MetaService {
    /// Moves copies off the draining nodes, a pass's worth; (moved, chunks still there).
    pub(super) fn drain_pass(&self, local: &Runtime) -> (usize, usize) {
        let (work, left, draining) = {
            let st = self.state.lock();
            let draining = st.alloc.draining();
            if draining.is_empty() {
                return (0, 0);
            }
            let (work, left) = st.ns.chunks_held_on(|n| draining.contains(&n), PASS);
            (work, left, draining)
        };
        let mut moved = 0;
        let mut rest = &work[..];
        while let Some(&(ino, _)) = rest.first() {
            let n = rest
                .iter()
                .take(PER_FREEZE)
                .take_while(|&&(i, _)| i == ino)
                .count();
            let indices: Vec<u64> = rest[..n].iter().map(|&(_, i)| i).collect();
            rest = &rest[n..];
            let started = Instant::now();
            let indices = self.freeze(ino, &indices);
            let mut here = 0;
            for &index in &indices {
                if self.move_off(local, ino, index, &draining) {
                    here += 1;
                }
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

    /// Moves chunk `index` of `ino` (frozen) off the `draining` nodes: a copy on another node
    /// if those that stay hold fewer than the file system keeps, then the draining copies go.
    /// Whether it holds no copy on them any more.
    fn move_off(&self, local: &Runtime, ino: Ino, index: u64, draining: &[u32]) -> bool {
        let leaving = |c: &ChunkRef| draining.contains(&c.node);
        let copy = {
            let mut st = self.state.lock();
            let Some(replicas) = st.ns.replicas(ino, index) else {
                return true; // freed meanwhile
            };
            if !replicas.iter().any(leaving) {
                return true;
            }
            let staying = replicas
                .iter()
                .filter(|c| !leaving(c) && st.alloc.is_alive(c.node))
                .count();
            if staying >= self.replicas {
                None
            } else {
                let mut avoid = self.repair.avoided();
                avoid.extend_from_slice(draining);
                let Some(target) = st.alloc.alloc_replica(&replicas, &avoid) else {
                    return false; // no room elsewhere now: the next pass tries again
                };
                // Live copies that stay are read first, the draining ones after.
                let mut sources: Vec<ChunkRef> = replicas
                    .iter()
                    .copied()
                    .filter(|c| st.alloc.is_alive(c.node))
                    .collect();
                sources.sort_by_key(|c| leaving(c));
                if sources.is_empty() {
                    st.alloc.release([target]);
                    return false;
                }
                Some((sources, target, st.ns.chunk_size() as usize))
            }
        };
        if let Some((sources, target, len)) = copy {
            if !matches!(
                self.copy_into(local, ino, index, &sources, target, len),
                Copied::Done(_)
            ) {
                return false;
            }
        }
        let mut st = self.state.lock();
        let Some(replicas) = st.ns.replicas(ino, index) else {
            return true;
        };
        let kept: Vec<ChunkRef> = replicas.iter().copied().filter(|c| !leaving(c)).collect();
        if kept.is_empty() {
            return false;
        }
        match st.ns.drop_replicas(ino, index, &kept) {
            Ok(dropped) if !dropped.is_empty() => {
                let mut effects = Effects {
                    freed: dropped,
                    quick: true,
                    ..Effects::default()
                };
                effects.change.remaps.push(ino);
                self.settle(st, None, effects);
                true
            }
            Ok(_) => true,
            Err(_) => false,
        }
    }
}
