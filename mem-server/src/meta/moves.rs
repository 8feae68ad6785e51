//! Moving copies between data nodes, for draining and rebalancing.
//!
//! Draining a data node (`rfs drain`): it takes no new chunks, and the repair thread moves
//! every copy it holds to other nodes. Rebalancing (`rfs rebalance`): copies move from the
//! fullest live node to emptier ones until every node's fill (copies over pool) is within a
//! tenth of the mean. Either way a few chunks of one file move per freeze, as re-replication
//! copies them (every holder lets go of the file's map first). Each copy that moves is copied
//! from itself to a new node (it has every write that reached it, even one that missed another
//! copy), then dropped from the map and freed like any other (revoked, zeroed). A write that
//! reached the old copy and missed another may still ask for the others to be dropped: the copy
//! made from it stands for it ([`MetaState::moved`]). Once a draining node holds no copy a map
//! names it can be stopped losing nothing.

use std::time::{Duration, Instant};

use rfs_proto::types::{ChunkRef, Ino};

use super::effects::Effects;
use super::repair::{per_freeze, Copied};
use super::{MetaService, MetaState};

/// Chunks looked at per pass, and moved per freeze of one file.
const PASS: usize = 1024;
const PER_FREEZE: usize = 16;
/// The least pause between two freezes (clients asking again wait up to 50 ms between tries).
const THAWED: Duration = Duration::from_millis(60);

/// Which copies a pass moves, and where they may not go.
#[derive(Clone)]
struct Moves {
    /// Copies on these nodes move.
    from: Vec<u32>,
    /// No new copy goes to these.
    avoid: Vec<u32>,
}

/// How far above the mean fill a node may be before a rebalance moves copies off it.
const BALANCED_WITHIN: f64 = 0.1;

impl MetaService {
    /// Moves copies off the draining nodes, a pass's worth; (moved, chunks still there).
    pub(super) fn drain_pass(&self) -> (usize, usize) {
        let (work, left) = {
            let st = self.state.lock();
            // A draining node that went down has nothing to copy from: not looked for.
            let draining: Vec<u32> = st
                .alloc
                .draining()
                .into_iter()
                .filter(|&n| st.alloc.is_alive(n))
                .collect();
            if draining.is_empty() {
                return (0, 0);
            }
            st.ns.chunks_held_on(|n| draining.contains(&n), PASS)
        };
        // Asked again at every chunk: a drain ended meanwhile (--stop) moves no more.
        let draining = |st: &MetaState| Moves {
            from: st.alloc.draining(),
            avoid: st.alloc.draining(),
        };
        let moved = self.move_pass(&work, &draining, usize::MAX);
        (moved, left.saturating_sub(moved))
    }

    /// While a rebalance is asked for, moves copies off the fullest live node, a pass's worth;
    /// it ends once every live node is within [`BALANCED_WITHIN`] of the mean fill, or when a
    /// pass can move nothing (the nodes below the mean hold copies of every chunk tried, or
    /// have no room). How many moved.
    pub(super) fn rebalance_pass(&self) -> usize {
        let (work, moves, excess) = {
            let mut st = self.state.lock();
            if !st.rebalancing {
                return 0;
            }
            match unbalanced(&st) {
                Some((moves, excess)) => {
                    let over = moves.from[0];
                    let (work, _) = st.ns.chunks_held_on(|n| n == over, PASS);
                    (work, moves, excess)
                }
                None => {
                    st.rebalancing = false;
                    log::info!(
                        "rebalancing: every live data node is within a tenth of the mean fill"
                    );
                    return 0;
                }
            }
        };
        let moved = self.move_pass(&work, &|_: &MetaState| moves.clone(), excess);
        if moved == 0 {
            self.state.lock().rebalancing = false;
            log::warn!(
                "rebalancing: no copy could move off data node {} (the nodes below the mean \
                 fill hold copies of its chunks, or have no room): ended",
                moves.from[0]
            );
        }
        moved
    }

    /// Moves what `moves` says of the chunks `work` lists (sorted by file), a few chunks of
    /// one file per freeze, until `most` moved; how many moved.
    fn move_pass(
        &self,
        work: &[(Ino, u64)],
        moves: &dyn Fn(&MetaState) -> Moves,
        most: usize,
    ) -> usize {
        let mut moved = 0;
        for (ino, mut indices) in per_freeze(work, PER_FREEZE) {
            if moved >= most {
                break;
            }
            indices.truncate(most - moved);
            if !self.can_move(ino, &indices, moves) {
                continue;
            }
            let started = Instant::now();
            let indices = self.freeze(ino, &indices);
            let (mut here, mut dropped, mut since) = (0, Vec::new(), None);
            for &index in &indices {
                let (done, gone) = self.move_off(ino, index, moves);
                here += usize::from(done);
                if let Some((first, copies)) = gone {
                    since.get_or_insert(first);
                    dropped.extend(copies);
                }
            }
            if let Some(since) = since {
                self.settle(
                    self.state.lock(),
                    None,
                    Effects::moved_off(ino, dropped, since),
                );
            }
            self.thaw(ino, &indices);
            moved += here;
            // Within the repair rate, and a pause between freezes in which maps go out.
            let bytes = here as u64 * self.state.lock().ns.chunk_size();
            let budget = Duration::from_secs_f64(bytes as f64 / self.repair.rate() as f64);
            std::thread::sleep(budget.saturating_sub(started.elapsed()).max(THAWED));
        }
        moved
    }

    /// Whether some chunk among `indices` of `ino` has a copy to move on a live node and a
    /// place for a new one (else the file is not frozen for nothing).
    fn can_move(&self, ino: Ino, indices: &[u64], moves: &dyn Fn(&MetaState) -> Moves) -> bool {
        let st = self.state.lock();
        let Moves { from, mut avoid } = moves(&st);
        avoid.extend(self.repair.avoided());
        indices.iter().any(|&index| {
            st.ns.replicas(ino, index).is_some_and(|r| {
                r.iter()
                    .any(|c| from.contains(&c.node) && st.alloc.is_alive(c.node))
                    && st.alloc.can_place(&r, &avoid)
            })
        })
    }

    /// Moves every copy of chunk `index` of `ino` (frozen) that `moves` says: whether none is
    /// left to move, and the copies dropped from the map (to be freed) with the state's stamp
    /// when the first left it.
    fn move_off(
        &self,
        ino: Ino,
        index: u64,
        moves: &dyn Fn(&MetaState) -> Moves,
    ) -> (bool, Option<(u64, Vec<ChunkRef>)>) {
        let mut dropped = Vec::new();
        let mut first = None;
        let out = |done, first: Option<u64>, dropped| (done, first.map(|f| (f, dropped)));
        loop {
            let (leaving, target, len, stamp) = {
                let mut st = self.state.lock();
                let Some(replicas) = st.ns.replicas(ino, index) else {
                    return out(true, first, dropped); // freed meanwhile
                };
                let Moves { from, mut avoid } = moves(&st);
                let Some(leaving) = replicas.iter().copied().find(|c| from.contains(&c.node))
                else {
                    return out(true, first, dropped);
                };
                if !st.alloc.is_alive(leaving.node) {
                    return out(false, first, dropped); // its copy cannot be read
                }
                avoid.extend(self.repair.avoided());
                let Some(target) = st.alloc.alloc_replica(&replicas, &avoid) else {
                    return out(false, first, dropped); // no room elsewhere now: the next pass tries again
                };
                (leaving, target, leaving.len as usize, st.alloc.stamp())
            };
            if !matches!(
                self.copy_into(ino, index, &[leaving], target, len, stamp),
                Copied::Done(_)
            ) {
                return out(false, first, dropped);
            }
            let mut st = self.state.lock();
            let Some(replicas) = st.ns.replicas(ino, index) else {
                return out(true, first, dropped);
            };
            let kept: Vec<ChunkRef> = replicas
                .iter()
                .copied()
                .filter(|c| (c.node, c.addr) != (leaving.node, leaving.addr))
                .collect();
            match st.ns.drop_replicas(ino, index, &kept) {
                Ok(gone) => {
                    // Until `leaving` is reused, a lease at least from now.
                    st.moved.insert((leaving.node, leaving.addr), target);
                    first.get_or_insert(st.alloc.stamp());
                    dropped.extend(gone);
                }
                Err(_) => return out(false, first, dropped),
            }
        }
    }
}

/// The live nodes' fill now: if one is above the mean by more than [`BALANCED_WITHIN`] and
/// another below it, the moves off the fullest (none of its copies goes to a node at or above
/// the mean) and how many copies it holds above the mean.
fn unbalanced(st: &MetaState) -> Option<(Moves, usize)> {
    let copies = st.ns.copies_per_node();
    let draining = st.alloc.draining();
    let nodes: Vec<(u32, u64, u64)> = st
        .alloc
        .usage()
        .into_iter()
        .filter(|&(id, _, state, ..)| state == "up" && !draining.contains(&id))
        .map(|(id, _, _, pool, ..)| (id, copies.get(&id).copied().unwrap_or(0), pool))
        .collect();
    let chunk = st.ns.chunk_size();
    let held: u64 = nodes.iter().map(|&(_, c, _)| c).sum();
    let room: u64 = nodes.iter().map(|&(_, _, pool)| pool / chunk).sum();
    if nodes.len() < 2 || room == 0 {
        return None;
    }
    let mean = held as f64 / room as f64;
    let fill = |&(_, c, pool): &(u32, u64, u64)| c as f64 / (pool / chunk).max(1) as f64;
    let &(over, held_there, pool) = nodes.iter().max_by(|a, b| fill(a).total_cmp(&fill(b)))?;
    let fair = (mean * (pool / chunk) as f64) as u64;
    let excess = held_there.saturating_sub(fair) as usize;
    let someone_below = nodes.iter().any(|n| fill(n) < mean);
    if fill(&(over, held_there, pool)) <= mean * (1.0 + BALANCED_WITHIN)
        || excess == 0
        || !someone_below
    {
        return None;
    }
    let mut avoid: Vec<u32> = nodes
        .iter()
        .filter(|n| fill(n) >= mean)
        .map(|n| n.0)
        .collect();
    avoid.extend(draining);
    Some((
        Moves {
            from: vec![over],
            avoid,
        },
        excess,
    ))
}
