//! Re-replication, on the metadata node: chunks with fewer copies than the file system keeps
//! (their node died, a write could not reach a copy, or they were allocated while too few nodes
//! were up) get new copies on other live nodes, copied one-sidedly from a survivor through the
//! metadata node's own data sessions (the data nodes' CPUs do nothing), at a bounded rate.
//!
//! Copies are made a few chunks of a file at a time, while those chunks are frozen: every holder
//! of the file's map is told to drop it (a holder answers once its transfers through it are
//! done), and no map of those chunks is handed out until the copies are in it (clients ask
//! again). So no write can reach a survivor after the copy read it and miss the new copy (and
//! a write that missed a replica drops every replica it did not reach, copies made meanwhile
//! too); a holder that cannot be asked is waited out for its lease, as for freed chunks. The
//! rate limit's pauses fall between freezes. Nodes that just failed a write or a read (a
//! client's, or a copy's) get no new copies and are read last for a while, so that a stopped
//! node does not keep chunks frozen or hold the other copies up.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rfs_proto::types::{ChunkRef, Ino};

use crate::admission::RateLimitedLog;
use crate::meta::callbacks::Countdown;
use crate::meta::coherence::Change;
use crate::meta::{MetaService, MetaState};

/// Chunks looked at per pass, and copied per freeze of one file.
const PASS: usize = 1024;
const PER_FREEZE: usize = 16;
/// How often the whole namespace is checked without a kick (a kick comes with every node that
/// joins or leaves and every replica dropped).
const SWEEP: Duration = Duration::from_secs(30);
/// How long one copy's READ or WRITE may take before the copy is given up (and tried again).
const COPY_LIMIT: Duration = Duration::from_secs(2);
/// How long after a pass that copied nothing the next is tried.
const RETRY: Duration = Duration::from_secs(1);
/// The least pause between two freezes (clients asking again wait up to 50 ms between tries).
const THAWED: Duration = Duration::from_millis(60);
/// How long a node that failed a write gets no new copies.
const AVOID: Duration = Duration::from_secs(30);

pub(crate) struct Repair {
    kick: Sender<()>,
    wake: Receiver<()>,
    /// Bytes per second copies may take.
    rate: u64,
    /// Chunks short of copies, as last counted.
    short: AtomicU64,
    copied_chunks: AtomicU64,
    copied_bytes: AtomicU64,
    /// Nodes that failed a write, and until when they get no new copies.
    avoid: Mutex<HashMap<u32, Instant>>,
    degraded: Mutex<RateLimitedLog>,
    stuck: Mutex<RateLimitedLog>,
}

impl Repair {
    pub(crate) fn new(rate: u64) -> Repair {
        let (kick, wake) = crossbeam_channel::bounded(1);
        Repair {
            kick,
            wake,
            rate,
            short: AtomicU64::new(0),
            copied_chunks: AtomicU64::new(0),
            copied_bytes: AtomicU64::new(0),
            avoid: Mutex::new(HashMap::new()),
            degraded: Mutex::new(RateLimitedLog::new(Duration::from_secs(10))),
            stuck: Mutex::new(RateLimitedLog::new(Duration::from_secs(60))),
        }
    }

    /// Says there may be chunks to copy.
    pub(crate) fn kick(&self) {
        let _ = self.kick.try_send(());
    }

    /// Bytes per second copies may take.
    pub(crate) fn rate(&self) -> u64 {
        self.rate
    }

    /// Chunks short of copies, as last counted.
    pub(crate) fn short(&self) -> u64 {
        self.short.load(Ordering::Relaxed)
    }

    /// Copies made since the node started, and their bytes.
    pub(crate) fn copied(&self) -> (u64, u64) {
        (
            self.copied_chunks.load(Ordering::Relaxed),
            self.copied_bytes.load(Ordering::Relaxed),
        )
    }

    /// `n` more chunks are short of a copy (counted under the state lock, before a kick).
    pub(crate) fn lost(&self, n: usize) {
        self.short.fetch_add(n as u64, Ordering::Relaxed);
        self.kick();
    }

    /// Writes to `nodes` failed: no new copies there for a while.
    pub(crate) fn avoid(&self, nodes: impl IntoIterator<Item = u32>) {
        let until = Instant::now() + AVOID;
        let mut avoid = self.avoid.lock().unwrap();
        for n in nodes {
            avoid.insert(n, until);
        }
    }

    /// Nodes to give no new copies now.
    pub(super) fn avoided(&self) -> Vec<u32> {
        let now = Instant::now();
        let mut avoid = self.avoid.lock().unwrap();
        avoid.retain(|_, until| *until > now);
        avoid.keys().copied().collect()
    }

    /// `n` chunks were allocated with fewer copies than asked for (too few live nodes).
    pub(crate) fn degraded(&self, n: usize) {
        self.kick();
        self.degraded.lock().unwrap().warn(format_args!(
            "{n} chunks allocated with fewer copies than asked for: too few live data nodes \
             with space; they get the rest once nodes join"
        ));
    }
}

/// `work` (chunks sorted by file) a few chunks of one file at a time, at most `most`.
pub(super) fn per_freeze(
    work: &[(Ino, u64)],
    most: usize,
) -> impl Iterator<Item = (Ino, Vec<u64>)> + '_ {
    let mut rest = work;
    std::iter::from_fn(move || {
        let &(ino, _) = rest.first()?;
        let n = rest
            .iter()
            .take(most)
            .take_while(|&&(i, _)| i == ino)
            .count();
        let indices = rest[..n].iter().map(|&(_, i)| i).collect();
        rest = &rest[n..];
        Some((ino, indices))
    })
}

/// How copying one chunk went.
pub(super) enum Copied {
    /// This many bytes.
    Done(usize),
    /// Nothing to do (any more): whole, freed, or no node to put a copy on.
    Nothing,
    Failed,
}

impl MetaService {
    /// Starts the re-replication thread, which also moves copies off draining nodes.
    pub(crate) fn start_repair(self: &Arc<Self>) -> std::io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("repair".into())
            .spawn(move || me.run_repair())?;
        Ok(())
    }

    fn run_repair(&self) {
        let mut wait = SWEEP;
        loop {
            let _ = self.repair.wake.recv_timeout(wait);
            wait = SWEEP;
            let started = Instant::now();
            let (mut copied, mut failed) = (0, 0);
            loop {
                if self.replicas < 2 {
                    break; // with one copy per chunk nothing is ever short: no scan
                }
                let (work, left) = {
                    let st = self.state.lock();
                    let found = st.ns.under_replicated(
                        self.replicas,
                        |n| self.counts_as_copy(&st.alloc, n),
                        PASS,
                    );
                    self.repair.short.store(found.1 as u64, Ordering::Relaxed);
                    found
                };
                if work.is_empty() {
                    break;
                }
                log::debug!(
                    "re-replication: {left} chunks have fewer than {} copies",
                    self.replicas
                );
                let (c, f) = self.repair_pass(&work);
                copied += c;
                failed += f;
                if c == 0 {
                    // Nothing could be copied now (no node to take copies, or failures).
                    self.repair.stuck.lock().unwrap().warn(format_args!(
                        "re-replication: {left} chunks have fewer than {} copies and none could \
                         be copied now (too few live data nodes with space, or they fail)",
                        self.replicas
                    ));
                    wait = RETRY;
                    break;
                }
            }
            if copied + failed > 0 {
                let secs = started.elapsed().as_secs_f64();
                let mib = (copied as u64 * self.state.lock().ns.chunk_size()) >> 20;
                log::info!(
                    "re-replication: {copied} chunks copied ({mib} MiB in {secs:.2} s, {:.0} MiB/s), \
                     {failed} failed, {} still short; {} chunks ({} MiB) copied since start",
                    mib as f64 / secs.max(1e-6),
                    self.repair.short(),
                    self.repair.copied_chunks.load(Ordering::Relaxed),
                    self.repair.copied_bytes.load(Ordering::Relaxed) >> 20,
                );
            }
            let rebalanced = self.rebalance_pass();
            if rebalanced > 0 {
                log::info!("rebalancing: {rebalanced} chunks moved");
                wait = Duration::ZERO;
            } else if self.state.lock().rebalancing {
                wait = RETRY; // nothing could move now
            }
            let (moved, left) = self.drain_pass();
            if moved > 0 {
                log::info!("draining: {moved} chunks moved off draining nodes, {left} left there");
            } else if left > 0 {
                self.repair.stuck.lock().unwrap().warn(format_args!(
                    "draining: {left} chunks left on draining nodes and none could be moved now \
                     (no other live node with space, or copies fail)"
                ));
            }
            if left > 0 {
                // Until they hold nothing (or a move failed: tried again shortly).
                wait = if moved > 0 { Duration::ZERO } else { RETRY };
            }
        }
    }

    /// Copies what `work` lists (sorted by file), a few chunks of one file per freeze; a file
    /// whose copy fails is left for the next pass; (copied, failed).
    fn repair_pass(&self, work: &[(Ino, u64)]) -> (usize, usize) {
        let (mut copied, mut failed) = (0, 0);
        for (ino, indices) in per_freeze(work, PER_FREEZE) {
            if !self.can_copy(ino, &indices) {
                continue;
            }
            let started = Instant::now();
            let indices = self.freeze(ino, &indices);
            let mut bytes = 0;
            for &index in &indices {
                match self.copy_one(ino, index) {
                    Copied::Done(len) => {
                        copied += 1;
                        bytes += len;
                    }
                    Copied::Nothing => {}
                    Copied::Failed => {
                        failed += 1;
                        break;
                    }
                }
            }
            self.thaw(ino, &indices);
            // Within the rate, and a pause between freezes in which maps go out.
            let budget = Duration::from_secs_f64(bytes as f64 / self.repair.rate as f64);
            std::thread::sleep(budget.saturating_sub(started.elapsed()).max(THAWED));
        }
        (copied, failed)
    }

    /// Whether some chunk among `indices` of `ino` can get a copy now (else the file is not
    /// frozen for nothing).
    fn can_copy(&self, ino: Ino, indices: &[u64]) -> bool {
        let avoided = self.repair.avoided();
        let st = self.state.lock();
        indices.iter().any(|&index| {
            st.ns
                .replicas(ino, index)
                .is_some_and(|r| st.alloc.can_place(&r, &avoided))
        })
    }

    /// Takes `ino`'s map back from every holder and hands out none of `indices` until
    /// [`Self::thaw`]; those it froze (not those frozen already: a cut's tail being zeroed,
    /// copied at the next pass).
    pub(super) fn freeze(&self, ino: Ino, indices: &[u64]) -> Vec<u64> {
        let mut st = self.state.lock();
        let indices: Vec<u64> = indices
            .iter()
            .copied()
            .filter(|&i| st.frozen.insert((ino, i)))
            .collect();
        if indices.is_empty() {
            return indices;
        }
        let change = Change {
            remaps: vec![ino],
            ..Change::default()
        };
        let MetaState { ns, holders, .. } = &mut *st;
        let plan = holders.plan(None, &change, |i| ns.getattr(i).ok());
        drop(st);
        let answered = Countdown::new();
        for (callbacks, cb) in plan {
            callbacks.send(cb, &answered);
        }
        let deadline = Instant::now() + self.lease;
        if !answered.wait(deadline) {
            // A holder that could not be asked stops using its map with its lease.
            log::info!(
                "re-replication: inode {ino}: a holder of its map did not answer; waiting out its lease"
            );
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        }
        indices
    }

    pub(super) fn thaw(&self, ino: Ino, indices: &[u64]) {
        let mut st = self.state.lock();
        for &i in indices {
            st.frozen.remove(&(ino, i));
        }
    }

    /// Gives chunk `index` of `ino` one more copy, if it still needs one and a node can take
    /// it: read from a live replica (the next one if it fails), written to a new chunk.
    fn copy_one(&self, ino: Ino, index: u64) -> Copied {
        let avoided = self.repair.avoided();
        let (sources, target, len, stamp) = {
            let mut st = self.state.lock();
            let Some(replicas) = st.ns.replicas(ino, index) else {
                return Copied::Nothing;
            };
            let mut live: Vec<ChunkRef> = replicas
                .iter()
                .copied()
                .filter(|c| st.alloc.is_alive(c.node))
                .collect();
            if live.len() >= self.replicas || live.is_empty() {
                return Copied::Nothing;
            }
            let Some(target) = st.alloc.alloc_replica(&replicas, &avoided) else {
                return Copied::Nothing;
            };
            // The sources take turns (copies do not all read one node); avoided ones last.
            let turn = index as usize % live.len();
            live.rotate_left(turn);
            live.sort_by_key(|c| avoided.contains(&c.node));
            (live, target, replicas[0].len as usize, st.alloc.stamp())
        };
        self.copy_into(ino, index, &sources, target, len, stamp)
    }

    /// Copies chunk `index` of `ino` from the first of `sources` that reads to `target`
    /// (allocated for it when [`crate::alloc::Allocator::stamp`] was `stamp`) and adds it to
    /// the chunk's replicas; `target` goes back if the copy fails or the chunk went meanwhile.
    /// A target whose node left and came back meanwhile is not ours any more: its return
    /// listed it for zeroing.
    pub(super) fn copy_into(
        &self,
        ino: Ino,
        index: u64,
        sources: &[ChunkRef],
        target: ChunkRef,
        len: usize,
        stamp: u64,
    ) -> Copied {
        let mut result = Err(std::io::Error::other("no source"));
        let mut source = sources[0];
        for &s in sources {
            source = s;
            result = self.zeroer.read_chunk(&s, len, COPY_LIMIT, stamp);
            match &result {
                Ok(_) => break,
                Err(e) => {
                    log::warn!("re-replication: inode {ino} chunk {index}: {e}");
                    self.repair.avoid([s.node]);
                }
            }
        }
        // The journal must say the target was handed out before data lands in it: a restart
        // takes chunks past what it says for zeros.
        let copied = result.and_then(|data| {
            self.state.sync()?;
            self.zeroer
                .write_chunk(&target, 0, data, COPY_LIMIT, stamp)
                .inspect_err(|_| self.repair.avoid([target.node]))
        });
        let mut st = self.state.lock();
        let ours = st.alloc.none_back_since(&[target], stamp);
        if copied.is_ok() && ours && st.ns.add_replica(ino, index, &source, target) {
            drop(st);
            self.repair.copied_chunks.fetch_add(1, Ordering::Relaxed);
            self.repair
                .copied_bytes
                .fetch_add(len as u64, Ordering::Relaxed);
            return Copied::Done(len);
        }
        // Never in a map: zeroed and reused like any freed chunk.
        st.alloc.release_freed([target], stamp);
        drop(st);
        self.zeroer.kick();
        match copied {
            Err(e) => {
                log::warn!("re-replication: inode {ino} chunk {index}: {e}");
                Copied::Failed
            }
            Ok(()) => Copied::Nothing, // freed, or its source dropped, meanwhile
        }
    }
}
