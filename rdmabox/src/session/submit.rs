//! Submission: from a caller's read or write to work requests on the wire.
//!
//! A request is checked, queued on its direction's merge queue, and posted by whichever thread
//! drains the queue (see [`crate::merge_queue`]). One drain pass admits what the window allows,
//! registers the large buffers (dynMR), plans merging and chaining ([`crate::batching`]), and
//! posts chain by chain: each group of a chain is staged into a preMR slot and becomes one work
//! request, and the chain goes out with one doorbell. Whatever cannot go out now (no slot, no room
//! in a send queue) goes back to the head of the queue for whoever frees the resource.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::batching::{self, Chain, Desc};
use crate::counters::Counters;
use crate::merge_queue::MergeQueue;
use crate::mr_pool::{MrPool, Slot};
use crate::transport::{
    Access, MemoryRegion, PostError, RemoteAddr, SendOp, SendWr, Sge, WcStatus,
};
use crate::window::{admits, charge};

use super::request::{Buffer, Dir, Done, InFlight, InflightWr, Request, Staging};
use super::{Inner, IoError, SessionQp};

/// Up to this many payload bytes in flight, a queue pair served by threads takes more work before
/// another queue pair is woken (see `Inner::qp_room`). 4K random reads with 4 jobs on 2 cores
/// (tcp, through the mount, 3 runs): 43.6-47.5k IOPS at 31-33 us of CPU per read, against
/// 35.4-45.4k at 37-47 spread round-robin over 4 queue pairs; 1 MiB transfers never join.
const JOIN_BUSY_BYTES: u64 = 64 << 10;

/// The requests of a chain that could not be posted, by batch index.
struct Unposted(Vec<usize>);

impl Inner {
    /// Checks a request, queues it and drains its queue.
    pub(super) fn submit(&self, dir: Dir, remote: RemoteAddr, len: usize, buf: Buffer, done: Done) {
        Counters::add(&self.counters.requests, 1);
        if self.closed.load(Ordering::Acquire) {
            Counters::add(&self.counters.requests_failed, 1);
            return done.fail(IoError::Closed, buf);
        }
        if len == 0 {
            return done.ok(buf);
        }
        // Only the range: keys are the peer's to check (one region may be reached by many
        // keys, each granting part of it).
        let inside = self.remote.iter().any(|r| {
            remote.addr >= r.addr
                && remote
                    .addr
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= r.addr + r.len)
        });
        if !inside || len > i32::MAX as usize {
            Counters::add(&self.counters.requests_failed, 1);
            let e = IoError::OutOfBounds {
                addr: remote.addr,
                len,
            };
            return done.fail(e, buf);
        }
        self.queues[dir as usize].push(Request {
            remote,
            len,
            buf,
            done,
        });
        self.drain(dir);
    }

    /// Posts what `dir`'s queue holds, unless another thread is already at it. A pass that
    /// could post nothing ends the turn unless a completion freed something meanwhile: the
    /// head of the queue may be postable while the planner's first group (in address order)
    /// waits for a staging slot, and the drainer may be the poller that would free one.
    pub(super) fn drain(&self, dir: Dir) {
        self.queues[dir as usize].drain_with(
            |q| self.drain_pass(dir, q),
            |q| self.can_progress(q),
            || self.freed.load(Ordering::SeqCst),
        );
    }

    /// Whether the request goes out from memory of its own (a registered buffer, or its
    /// gathered read's slot) rather than a pool slot of its work request.
    fn is_dynamic(&self, r: &Request) -> bool {
        !matches!(r.buf, Buffer::Plain(_)) || self.is_dynamic_len(r.len)
    }

    /// Whether a request of `len` bytes goes out from its own registered buffer.
    pub(super) fn is_dynamic_len(&self, len: usize) -> bool {
        len >= self.cfg.dyn_threshold || len > self.cfg.slot_size
    }

    /// A queue pair with room for `n` more work requests carrying `bytes`, and whether it was busy.
    /// Where threads serve the queue pairs (tcp), work joins a queue pair that has some in flight
    /// already while the two together stay within [`JOIN_BUSY_BYTES`]: that queue pair's threads
    /// are awake, and another would cost a wake-up on each side for parallel work not worth
    /// it (small transfers; large ones still spread). Otherwise an idle queue pair whose poller
    /// spins (where few pollers may spin, a lone request goes where one does), else
    /// round-robin: the queue pairs a NIC serves are spread over, to engage its processing
    /// units.
    fn qp_room(&self, n: usize, bytes: u64) -> Option<(usize, bool)> {
        let fits = |l: &SessionQp, inflight: &InFlight| {
            !l.refused.load(Ordering::Acquire)
                && inflight.len() + n <= l.qp.caps().max_send_wr as usize
        };
        let busy = self.qps.iter().position(|l| {
            l.qp.served_by_threads() && {
                let inflight = l.inflight.lock().unwrap();
                !inflight.is_empty()
                    && inflight.bytes() + bytes <= JOIN_BUSY_BYTES
                    && fits(l, &inflight)
            }
        });
        if let Some(i) = busy {
            return Some((i, true));
        }
        let hot = self.qps.iter().position(|l| {
            l.spinning.load(Ordering::Relaxed)
                && !l.refused.load(Ordering::Acquire)
                && l.inflight.lock().unwrap().is_empty()
        });
        if let Some(i) = hot {
            return Some((i, false));
        }
        let qps = self.qps.len();
        let start = self.next_qp.fetch_add(1, Ordering::Relaxed);
        (0..qps)
            .map(|k| (start + k) % qps)
            .find(|&i| fits(&self.qps[i], &self.qps[i].inflight.lock().unwrap()))
            .map(|i| (i, false))
    }

    /// Whether the head of the queue could be posted now.
    fn can_progress(&self, q: &MergeQueue<Request>) -> bool {
        let pending = q.pending();
        let Some(front) = pending.front() else {
            return false;
        };
        if self.closed.load(Ordering::Acquire) {
            return true;
        }
        let inflight = self.counters.inflight_bytes.load(Ordering::Relaxed);
        admits(inflight, charge(front.len), self.policy.limit())
            && (self.is_dynamic(front) || self.pool.available() > 0)
            && self.qps.iter().any(|l| {
                !l.refused.load(Ordering::Acquire)
                    && l.inflight.lock().unwrap().len() < l.qp.caps().max_send_wr as usize
            })
    }

    /// One drain pass: admit, register, plan, post; requeue what could not be posted.
    /// False if it took requests and could neither post nor answer any of them (`can_progress`
    /// judges the other cases: an empty queue, a full window).
    fn drain_pass(&self, dir: Dir, q: &MergeQueue<Request>) -> bool {
        if self.closed.load(Ordering::Acquire) {
            let all: Vec<_> = q.pending().drain(..).collect();
            for r in all {
                self.fail(r, IoError::Closed);
            }
            return true;
        }
        let batch = self.admit_batch(dir, q);
        let taken = batch.len();
        if taken == 0 {
            return true;
        }
        let mut ready = self.register_dynamic(batch);
        let stalled = self.post_batch(dir, &mut ready);
        let moved = stalled.len() < taken;
        if !stalled.is_empty() {
            // Back to the head of the queue in submission order, where they may still merge.
            self.requeue_stalled(q, stalled, &mut ready);
        }
        moved
    }

    /// Takes requests from the head of the queue while the window admits them (and at most
    /// `max_drain`), and charges them to the in-flight count; fails those that carry a key the
    /// peer refused.
    fn admit_batch(&self, dir: Dir, q: &MergeQueue<Request>) -> Vec<Request> {
        let limit = self.policy.limit();
        let inflight = self.counters.inflight_bytes.load(Ordering::Relaxed);
        let mut batch = Vec::new();
        // Those carrying a key the peer refused: answered once the queue is let go (their
        // callbacks may submit more).
        let mut stale = Vec::new();
        let mut cost = 0;
        {
            let mut pending = q.pending();
            while batch.len() < self.cfg.max_drain {
                let Some(front) = pending.front() else { break };
                if self.is_refused(front.remote.rkey, dir) {
                    stale.push(pending.pop_front().expect("front exists"));
                    continue;
                }
                let c = charge(front.len);
                if !admits(inflight + cost, c, limit) {
                    Counters::add(&self.counters.window_stalls, 1);
                    break;
                }
                cost += c;
                batch.push(pending.pop_front().expect("front exists"));
            }
        }
        if !batch.is_empty() {
            self.counters.admit(cost);
        }
        for r in stale {
            self.fail(r, IoError::Transport(WcStatus::RemoteAccessError));
        }
        batch
    }

    /// Registers the buffers of the requests that go out dynMR; a request whose registration
    /// fails is answered (and uncharged) here. The rest come back as planner input, each `Some`
    /// until it is posted or requeued.
    fn register_dynamic(&self, batch: Vec<Request>) -> Vec<Option<Request>> {
        let mut ready: Vec<Option<Request>> = Vec::with_capacity(batch.len());
        for mut r in batch {
            // Only a plain buffer: one put back by an earlier pass is registered already.
            if let Buffer::Plain(v) = &mut r.buf {
                if self.is_dynamic_len(r.len) {
                    match self.pd.register_vec(std::mem::take(v), Access::LOCAL_WRITE) {
                        Ok(mr) => {
                            Counters::add(&self.counters.dynmr_registrations, 1);
                            r.buf = Buffer::Registered(Arc::new(mr));
                        }
                        Err((e, v)) => {
                            r.buf = Buffer::Plain(v);
                            self.counters.retire(charge(r.len));
                            self.fail(r, IoError::Registration(e.to_string()));
                            continue;
                        }
                    }
                }
            }
            ready.push(Some(r));
        }
        ready
    }

    /// Plans the batch into chains and posts them in order. After the first chain that cannot
    /// be posted in full, the later ones are not tried: returns the batch indices left over.
    fn post_batch(&self, dir: Dir, ready: &mut [Option<Request>]) -> Vec<usize> {
        let descs: Vec<Desc> = ready
            .iter()
            .map(|r| {
                let r = r.as_ref().expect("all present before planning");
                Desc {
                    rkey: r.remote.rkey,
                    addr: r.remote.addr,
                    len: r.len,
                    dynamic: !matches!(r.buf, Buffer::Plain(_)),
                }
            })
            .collect();
        let chains = batching::plan(&descs, &self.plan);
        let mut stalled: Vec<usize> = Vec::new();
        for chain in chains {
            if !stalled.is_empty() {
                stalled.extend(chain.into_iter().flatten());
                continue;
            }
            if let Err(Unposted(rest)) = self.post_chain(dir, chain, ready) {
                stalled = rest;
            }
        }
        stalled
    }

    /// Puts the stalled requests back at the head of the queue in submission order, and
    /// uncharges them.
    fn requeue_stalled(
        &self,
        q: &MergeQueue<Request>,
        mut stalled: Vec<usize>,
        ready: &mut [Option<Request>],
    ) {
        stalled.sort_unstable();
        let back: Vec<Request> = stalled
            .into_iter()
            .map(|i| ready[i].take().expect("unposted requests are still here"))
            .collect();
        self.counters
            .retire(back.iter().map(|r| charge(r.len)).sum());
        q.requeue_front(back.into_iter());
    }

    /// Stages and posts one chain on one queue pair. Groups are staged in order until the pool
    /// runs dry; those staged go out, the rest are returned.
    fn post_chain(
        &self,
        dir: Dir,
        chain: Chain,
        ready: &mut [Option<Request>],
    ) -> Result<(), Unposted> {
        let bytes = chain
            .iter()
            .flatten()
            .map(|&i| ready[i].as_ref().map_or(0, |r| r.len as u64))
            .sum();
        let Some((li, joined)) = self.qp_room(chain.len(), bytes) else {
            return Err(Unposted(chain.concat()));
        };
        let chained = chain.len() > 1;
        let mut wrs: Vec<InflightWr> = Vec::with_capacity(chain.len());
        let mut groups = chain.into_iter();
        let mut unposted = Vec::new();
        for group in groups.by_ref() {
            match self.stage_group(dir, &group, chained, ready) {
                Some(w) => wrs.push(w),
                None => {
                    unposted.extend(group);
                    break;
                }
            }
        }
        unposted.extend(groups.flatten());
        if wrs.is_empty() {
            return Err(Unposted(unposted));
        }
        if joined {
            Counters::add(&self.counters.joined_busy, wrs.len() as u64);
        }
        self.post_wrs(&self.qps[li], dir, wrs);
        if unposted.is_empty() {
            Ok(())
        } else {
            Err(Unposted(unposted))
        }
    }

    /// Turns one planned group into a work request: takes its requests out of `ready` and, if
    /// any is staged, copies them into a pool slot (writes only; reads are copied out on
    /// completion). `None`, with `ready` untouched, if a slot is needed and the pool is empty.
    fn stage_group(
        &self,
        dir: Dir,
        group: &[usize],
        chained: bool,
        ready: &mut [Option<Request>],
    ) -> Option<InflightWr> {
        let staged = group
            .iter()
            .any(|&i| matches!(ready[i].as_ref().map(|r| &r.buf), Some(Buffer::Plain(_))));
        let slot = if staged {
            match self.pool.try_get() {
                Some(s) => Some(s),
                None => {
                    Counters::add(&self.counters.pool_stalls, 1);
                    return None;
                }
            }
        } else {
            None
        };
        let mut members = Vec::with_capacity(group.len());
        let mut offset = 0;
        let mut bytes = 0u64;
        let mut cost = 0u64;
        for &i in group {
            let r = ready[i].take().expect("each request is planned once");
            bytes += r.len as u64;
            cost += charge(r.len);
            let staging = match &r.buf {
                Buffer::Registered(_) | Buffer::Gathered { .. } => Staging::Dynamic,
                Buffer::Plain(data) => {
                    let slot = slot.as_ref().expect("staged groups have a slot");
                    if dir == Dir::Write {
                        slot.write_at(offset, data);
                        Counters::add(&self.counters.premr_copies, 1);
                    }
                    offset += r.len;
                    Staging::Pool(offset - r.len)
                }
            };
            members.push((r, staging));
        }
        self.count_shape(members.len(), chained);
        Some(InflightWr {
            dir,
            members,
            slot,
            cost,
            bytes,
            posted: Instant::now(),
        })
    }

    /// Counts how a work request's members went out: merged, chained or alone.
    fn count_shape(&self, members: usize, chained: bool) {
        let c = &self.counters;
        if members > 1 {
            Counters::add(&c.requests_merged, members as u64);
        } else if chained {
            Counters::add(&c.requests_chained, 1);
        } else {
            Counters::add(&c.requests_single, 1);
        }
    }

    /// Enters the work requests in the queue pair's in-flight table and posts them with one
    /// doorbell; those a failed post left behind are taken back.
    fn post_wrs(&self, qp: &SessionQp, dir: Dir, wrs: Vec<InflightWr>) {
        // Scatter/gather lists, built from Arc clones so that the completion may arrive (and the
        // in-flight entry go) before the post returns.
        let keep: Vec<Vec<SgeSource>> = wrs.iter().map(sge_sources).collect();
        let remotes: Vec<RemoteAddr> = wrs.iter().map(|w| w.members[0].0.remote).collect();
        let keys: Vec<usize> = {
            let mut inflight = qp.inflight.lock().unwrap();
            wrs.into_iter().map(|w| inflight.insert(w)).collect()
        };
        let result = self.ring_doorbell(qp, dir, &keys, &keep, &remotes);
        drop(keep);
        let posted = match &result {
            Ok(()) => keys.len(),
            Err(e) => e.posted(),
        };
        Counters::add(&self.counters.work_requests, posted as u64);
        if posted > 0 {
            Counters::add(&self.counters.doorbells, 1);
        }
        if let Err(e) = result {
            self.take_back(qp, dir, &keys[posted..], &e);
        }
    }

    /// Builds the SGE and work request lists (wr_id: the in-flight key) and posts them in one
    /// call.
    fn ring_doorbell(
        &self,
        qp: &SessionQp,
        dir: Dir,
        keys: &[usize],
        keep: &[Vec<SgeSource>],
        remotes: &[RemoteAddr],
    ) -> Result<(), PostError> {
        let sges: Vec<Vec<Sge<'_>>> = keep
            .iter()
            .map(|srcs| srcs.iter().map(|s| s.sge(&self.pool)).collect())
            .collect();
        let send: Vec<SendWr<'_>> = keys
            .iter()
            .zip(&sges)
            .zip(remotes)
            .map(|((&k, sg), &remote)| {
                let op = match dir {
                    Dir::Read => SendOp::Read(remote),
                    Dir::Write => SendOp::Write(remote),
                };
                SendWr::new(k as u64, op, sg)
            })
            .collect();
        qp.qp.post_send(&send)
    }

    /// Removes the work requests a failed post did not take (`keys`) from the in-flight table
    /// and uncharges them: requeued if the send queue was full, failed otherwise.
    fn take_back(&self, qp: &SessionQp, dir: Dir, keys: &[usize], e: &PostError) {
        let mut inflight = qp.inflight.lock().unwrap();
        let back: Vec<InflightWr> = keys
            .iter()
            .map(|&k| inflight.try_remove(k).expect("entered by this post"))
            .collect();
        drop(inflight);
        for w in back {
            self.counters.retire(w.cost);
            match e {
                PostError::QueueFull { .. } => {
                    // Cannot happen while we keep within max_send_wr; requeue if it does.
                    self.queues[dir as usize].requeue_front(w.members.into_iter().map(|(r, _)| r));
                }
                _ => {
                    log::error!("post failed: {e}");
                    for (r, _) in w.members {
                        self.fail(r, IoError::Transport(WcStatus::LocalQpOperationError));
                    }
                }
            }
        }
    }
}

/// Where one SGE of a work request points.
enum SgeSource {
    Pool { slot_offset: usize, len: usize },
    Own(Arc<MemoryRegion>),
}

impl SgeSource {
    fn sge<'a>(&'a self, pool: &'a MrPool) -> Sge<'a> {
        match self {
            SgeSource::Pool { slot_offset, len } => pool.sge_at(*slot_offset, *len),
            SgeSource::Own(mr) => mr.sge(),
        }
    }
}

/// One SGE per dynamic member, one per run of members staged next to each other.
fn sge_sources(w: &InflightWr) -> Vec<SgeSource> {
    let mut out: Vec<SgeSource> = Vec::new();
    let base = w.slot.as_ref().map_or(0, Slot::offset);
    for (r, staging) in &w.members {
        match (staging, &r.buf) {
            (Staging::Pool(off), _) => {
                if let Some(SgeSource::Pool { slot_offset, len }) = out.last_mut() {
                    if *slot_offset + *len == base + off {
                        *len += r.len;
                        continue;
                    }
                }
                out.push(SgeSource::Pool {
                    slot_offset: base + off,
                    len: r.len,
                });
            }
            (Staging::Dynamic, Buffer::Registered(mr)) => out.push(SgeSource::Own(mr.clone())),
            (Staging::Dynamic, Buffer::Gathered { pool_offset }) => out.push(SgeSource::Pool {
                slot_offset: *pool_offset,
                len: r.len,
            }),
            (Staging::Dynamic, Buffer::Plain(_)) => unreachable!("dynamic members are registered"),
        }
    }
    out
}
