//! Freed chunks on their way back to the allocator. A change that freed chunks tells every
//! cache holding them and waits (lock released) for their answers, up to the lease; then the
//! chunks are quarantined until they are due (at once, or the end of the lease of a holder
//! that could not be asked), revoked from every session at their nodes, zeroed and only then
//! allocatable again: a stale chunk map can never reach another file's bytes.

use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rfs_proto::types::ChunkRef;

use super::callbacks::Countdown;
use super::coherence::SessionId;
use super::effects::{by_node, Effects, Freed};
use super::grant_channels::GRANT_WAIT;
use super::state::MetaState;
use super::MetaService;
use crate::journal::Guard;

/// How long dropping a failed replica waits for the other holders of the file's map to let it
/// go before the writer is answered: they answer in microseconds unless their own transfers
/// are under way, and two writers each dropping a replica wait on each other's transfers.
pub(super) const REMAP_WAIT: Duration = Duration::from_millis(200);

/// How soon freed chunks whose tail a cut is zeroing are looked at again.
const TAIL_ZEROING_RECHECK: Duration = Duration::from_millis(10);

/// Freed chunks waiting to be reused, each batch with when it is due and whether that is the
/// end of a lease.
#[derive(Default)]
pub(crate) struct Quarantine {
    batches: Mutex<Vec<(Instant, Freed, bool)>>,
    added: Condvar,
}

impl Quarantine {
    fn push(&self, due: Instant, freed: Freed, lease: bool) {
        self.batches.lock().unwrap().push((due, freed, lease));
        self.added.notify_one();
    }

    /// Waits until some batches are due, and takes them.
    fn wait_due(&self) -> Vec<(Freed, bool)> {
        let mut q = self.batches.lock().unwrap();
        loop {
            let now = Instant::now();
            let (due, waiting): (Vec<_>, Vec<_>) = q.drain(..).partition(|(at, _, _)| *at <= now);
            *q = waiting;
            if !due.is_empty() {
                return due.into_iter().map(|(_, f, lease)| (f, lease)).collect();
            }
            let next = q.iter().map(|(at, _, _)| *at).min();
            q = match next {
                Some(at) => self.added.wait_timeout(q, at - now).unwrap().0,
                None => self.added.wait(q).unwrap(),
            };
        }
    }
}

impl MetaService {
    /// Tells the caches what `effects` changed, waits (lock released) for their answers up to
    /// the lease, and only then hands the freed chunks to the zeroer.
    pub(super) fn settle(
        &self,
        mut st: Guard<'_, MetaState>,
        caller: Option<SessionId>,
        effects: Effects,
    ) {
        let Effects {
            freed,
            change,
            quick,
            woken,
            tails,
            linger,
            freed_since,
            ..
        } = effects;
        // Waiters for locks are told, not waited for: one that is slow must not hold up the
        // unlock (it asks again within a second anyway).
        let waiters = st.holders.lock_freed(&woken);
        let tell_waiters = move || {
            for (callbacks, inos) in waiters {
                callbacks.tell_locks_freed(inos);
            }
        };
        if change.is_empty() && freed.is_empty() {
            drop(st);
            tell_waiters();
            return;
        }
        if !freed.is_empty() {
            st.frees += 1;
        }
        let freed = Freed {
            seq: st.frees,
            chunks: freed,
            stamp: freed_since.unwrap_or(st.alloc.stamp()),
        };
        let MetaState { ns, holders, .. } = &mut *st;
        let plan = holders.plan(caller, &change, |ino| ns.getattr(ino).ok());
        drop(st);
        tell_waiters();
        let answered = Countdown::new();
        for (callbacks, cb) in plan {
            callbacks.send(cb, &answered);
        }
        let start = Instant::now();
        let deadline = start + self.lease;
        let wait_until = if quick { start + REMAP_WAIT } else { deadline };
        // Live holders answer in microseconds. One that is slow (stopped, descheduled) is
        // waited for up to the lease, as NFS waits out a delegation: once its answer or its
        // lease is in, a write it makes through an old descriptor goes to the file as it is
        // now. One that cannot be asked (its connection is down) is not waited for; the
        // chunks wait out its lease instead.
        let mut all_answered = answered.wait(wait_until);
        // Those that did not answer in time are fenced off the split chunks by revocation.
        self.zero_cut_tails(tails);
        if freed.chunks.is_empty() {
            return;
        }
        if quick && !all_answered && !self.unreachable_now(&freed) {
            // A holder that did not answer may still read the dropped copies, and their
            // node did not confirm them out of reach: the writer waits, as for a free.
            all_answered = answered.wait(deadline);
        }
        // Reused by the quarantine thread: making them unreachable takes a call to each node
        // they are on, and a stopped node must not hold the caller up for the channel deadline.
        let lease = !(all_answered || Instant::now() >= deadline);
        let due = if lease || linger {
            // A holder could not be asked: its references die with its lease.
            start + self.lease
        } else {
            log::debug!(
                "{} chunks freed after {:?} of recalls",
                freed.chunks.len(),
                start.elapsed()
            );
            Instant::now()
        };
        self.state.lock().alloc.expect_freed(freed.bytes());
        self.quarantine.push(due, freed, lease);
    }

    /// Revokes every session's reach to `freed` at their nodes, waiting [`GRANT_WAIT`] for
    /// each; whether each node confirmed it.
    fn unreachable_now(&self, freed: &Freed) -> bool {
        by_node(&freed.chunks).into_iter().all(|(node, addrs)| {
            self.grant_channels
                .revoke_freed(node, freed.seq, &addrs, Some(GRANT_WAIT))
        })
    }

    /// Freed chunks whose every holder let go: out of every session's reach, zeroed, then
    /// allocatable again. Chunks a live node did not confirm revoked are never reused.
    fn reuse(&self, freed: Freed) {
        let zeroing = {
            let st = self.state.lock();
            freed
                .chunks
                .iter()
                .any(|c| st.tails_zeroing.contains(&(c.node, c.addr)))
        };
        if zeroing {
            // A cut is zeroing the tail of one of them (freed by a cut below it, the last
            // close of the unlinked file, a dropped replica): after it is done.
            self.quarantine
                .push(Instant::now() + TAIL_ZEROING_RECHECK, freed, false);
            return;
        }
        let mut reusable = Vec::with_capacity(freed.chunks.len());
        let mut relisted = Vec::new();
        for (node, extents) in by_node(&freed.chunks) {
            if self.state.lock().alloc.rejoined_since(node, freed.stamp) {
                // Its return listed them for zeroing (no map named them), and they may be
                // another file's by now: neither revoked nor released again.
                relisted.extend(extents.into_iter().map(|(addr, _)| (node, addr)));
                continue;
            }
            let revoked = self
                .grant_channels
                .revoke_freed(node, freed.seq, &extents, None);
            // A node without a channel has left: nobody reaches its pool through us any more.
            if revoked || !self.grant_channels.has(node) {
                reusable.extend(extents.into_iter().map(|(addr, len)| ChunkRef {
                    node,
                    addr,
                    rkey: 0,
                    lo: 0,
                    len,
                }));
            } else {
                log::error!(
                    "data node {node} did not confirm that {} freed extents are out of reach: \
                     they are not reused",
                    extents.len()
                );
            }
        }
        let mut st = self.state.lock();
        for place in reusable.iter().map(|c| (c.node, c.addr)).chain(relisted) {
            st.moved.remove(&place);
        }
        st.alloc.release_freed(reusable, freed.stamp);
        st.alloc.freed_now(freed.bytes());
        drop(st);
        self.zeroer.kick();
    }

    /// Reuses freed chunks as they fall due.
    pub(crate) fn start_quarantine(self: &Arc<Self>) -> io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("quarantine".into())
            .spawn(move || loop {
                for (freed, lease) in me.quarantine.wait_due() {
                    if lease {
                        log::info!(
                            "{} quarantined chunks released (lease over)",
                            freed.chunks.len()
                        );
                    }
                    me.reuse(freed);
                }
            })?;
        Ok(())
    }
}
