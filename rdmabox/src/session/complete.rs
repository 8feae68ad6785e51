//! Completion: one poller thread per queue pair reaps its CQ, answers each work request's member
//! requests (copying staged reads out of their pool slot, or lending it to the callback), and
//! then drains both merge queues, since a completion frees exactly what a stalled drainer was
//! waiting for (window room, a pool slot, a send-queue entry).
//!
//! With event polling, a poller sleeps after each completion, and waking it costs more than
//! the work it wakes for. Where the transport has a thread of its own that produced the
//! completion (the tcp provider's engine), that thread does the work instead while the poller
//! sleeps; the poller still wakes at its bounded sleep to hold the deadline.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::counters::Counters;
use crate::poller::{self, PollTarget};
use crate::transport::{Completion, WcStatus};

use super::request::{Buffer, Dir, Done, InflightWr, Staging};
use super::{Inner, IoError, SessionQp};

/// Completions taken per poll on a transport thread (see [`Inner::complete_inline`]).
const INLINE_BATCH: usize = 16;

/// A gap this long between two rounds of a poller, whose sleeps are bounded at a tenth of it
/// ([`poller::MAX_SLEEP`]), means this process was held up (stopped, a paused VM, a frozen
/// cgroup, starved): answers that came meanwhile wait in the transport, whose threads were
/// held up too. Nobody is judged late until the transport has had this long to deliver them.
const HELD_UP: Duration = Duration::from_secs(1);

/// One queue pair's side of [`poller::drive`]: its CQ, the session's counters and its shutdown
/// rule.
struct QpPoller<'a> {
    inner: &'a Inner,
    qp: &'a SessionQp,
    wc: Vec<Completion>,
    stop_deadline: Option<Instant>,
    /// When the in-flight work requests are next checked against the session's deadline.
    next_deadline_check: Instant,
    /// When the last round began.
    last_round: Instant,
}

impl PollTarget for QpPoller<'_> {
    /// Ends the loop once the session is stopping and the queue pair has nothing in flight, or 5 s
    /// after stopping began; otherwise polls and finishes what it found, and then, if it found
    /// nothing, holds the queue pair's work requests to the session's deadline.
    fn poll_round(&mut self) -> ControlFlow<(), usize> {
        if self.inner.stopping.load(Ordering::Acquire) {
            let deadline = *self
                .stop_deadline
                .get_or_insert_with(|| Instant::now() + Duration::from_secs(5));
            if self.qp.inflight.lock().unwrap().is_empty() || Instant::now() > deadline {
                return ControlFlow::Break(());
            }
        }
        let now = Instant::now();
        let gap = now.duration_since(self.last_round);
        if gap > HELD_UP {
            self.next_deadline_check = self.next_deadline_check.max(now + HELD_UP);
            log::info!("poller held up for {gap:?}: work in flight is judged {HELD_UP:?} later");
        }
        self.last_round = now;
        let found = self.inner.poll_once(self.qp, &mut self.wc);
        // Only once the CQ is empty: a poller that was itself held up (descheduled, stopped)
        // finds the answers that came meanwhile before it judges anyone late.
        if let (0, Some(limit)) = (found, self.inner.cfg.io_timeout) {
            if now >= self.next_deadline_check {
                // A tenth of the deadline between checks: it holds to within 10%, and a busy
                // poller scans its in-flight table rarely.
                self.next_deadline_check = now + (limit / 10).max(Duration::from_millis(1));
                self.inner.check_deadline(self.qp, limit);
            }
        }
        ControlFlow::Continue(found)
    }

    /// A failed arm is logged; the poller sleeps anyway, since the sleep is bounded.
    fn arm(&mut self) -> ControlFlow<()> {
        if let Err(e) = self.qp.cq.arm() {
            log::error!("arming CQ failed: {e}");
        }
        ControlFlow::Continue(())
    }

    /// Counts the wake-ups that an event (not the timeout) caused.
    fn sleep(&mut self, timeout: Duration) {
        match self.qp.cq.wait_event(Some(timeout)) {
            Ok(true) => Counters::add(&self.inner.counters.event_wakeups, 1),
            Ok(false) => {}
            Err(e) => log::error!("waiting for a CQ event failed: {e}"),
        }
    }

    fn gave_way(&mut self) {
        Counters::add(&self.inner.counters.spins_given_way, 1);
    }

    fn spinning(&mut self, on: bool) {
        self.qp.spinning.store(on, Ordering::Relaxed);
    }
}

impl Inner {
    /// The poller thread of queue pair `li`: polls as the session's [`crate::PollMode`] says until
    /// the session stops and the queue pair has nothing in flight (or 5 s have passed).
    pub(super) fn poll_loop(&self, li: usize) {
        let mode = self.cfg.polling;
        poller::drive(
            mode,
            &mut QpPoller {
                inner: self,
                qp: &self.qps[li],
                wc: vec![Completion::EMPTY; mode.batch()],
                stop_deadline: None,
                next_deadline_check: Instant::now(),
                last_round: Instant::now(),
            },
        );
    }

    /// Has each queue pair's transport thread finish the completions it produces while the
    /// queue pair's poller sleeps (where the transport can). Holds the session weakly: the CQs
    /// belong to it.
    pub(super) fn complete_inline(self: &Arc<Self>) {
        for (li, qp) in self.qps.iter().enumerate() {
            let session = Arc::downgrade(self);
            qp.cq.complete_inline(Arc::new(move || {
                if let Some(inner) = session.upgrade() {
                    // Counted, so that dropping the session waits for it; once stopping, the
                    // pollers finish what is left.
                    inner.inline_running.fetch_add(1, Ordering::SeqCst);
                    if !inner.stopping.load(Ordering::SeqCst) {
                        inner.poll_inline(li);
                    }
                    inner.inline_running.fetch_sub(1, Ordering::SeqCst);
                }
            }));
        }
    }

    /// Finishes everything on queue pair `li`'s CQ, on the transport thread that completed it.
    fn poll_inline(&self, li: usize) {
        let mut wc = [Completion::EMPTY; INLINE_BATCH];
        loop {
            let n = self.poll_once(&self.qps[li], &mut wc);
            Counters::add(&self.counters.completed_inline, n as u64);
            if n < wc.len() {
                return;
            }
        }
    }

    /// Polls the queue pair's CQ once and finishes what it found, then drains both queues.
    fn poll_once(&self, qp: &SessionQp, wc: &mut [Completion]) -> usize {
        let n = match qp.cq.poll(wc) {
            Ok(n) => n,
            Err(e) => {
                log::error!("polling CQ failed: {e}");
                0
            }
        };
        if n == 0 {
            Counters::add(&self.counters.polls_empty, 1);
            return 0;
        }
        Counters::add(&self.counters.polls_nonempty, 1);
        for c in &wc[..n] {
            let w = qp.inflight.lock().unwrap().try_remove(c.wr_id as usize);
            match w {
                Some(w) => self.finish_on(qp, w, c.status),
                None => log::error!("completion for unknown work request {}", c.wr_id),
            }
        }
        // Their slots, window room and send-queue entries are free now: a drainer that found
        // none keeps going (see `drain`).
        self.freed.fetch_add(1, Ordering::SeqCst);
        self.drain(Dir::Read);
        self.drain(Dir::Write);
        n
    }

    /// Breaks the session if a work request of `qp` has waited longer than `limit` for its
    /// answer: a peer that stopped answering (stopped process, dead host, a NIC retrying
    /// forever) gets no more time than that.
    fn check_deadline(&self, qp: &SessionQp, limit: Duration) {
        let oldest = qp.inflight.lock().unwrap().oldest();
        if oldest.is_some_and(|t| t.elapsed() > limit) {
            Counters::add(&self.counters.deadline_expiries, 1);
            self.break_with(IoError::TimedOut(limit));
        }
    }

    /// Answers a work request completed on `qp`. A request the peer refused (a stale or
    /// revoked key: the caller refetches and retries) fails alone while another queue pair is
    /// left to carry on: its own queue pair is out of service from then on, and what that
    /// flushed is sent again over the others. Any other failure breaks the session.
    fn finish_on(&self, qp: &SessionQp, w: InflightWr, status: WcStatus) {
        let going_on = !self.closed.load(Ordering::Acquire) && self.cause.get().is_none();
        let refusal = matches!(
            status,
            WcStatus::RemoteAccessError
                | WcStatus::RemoteInvalidRequest
                | WcStatus::RemoteOperationError
        );
        if going_on && refusal {
            // One count, so that the last two queue pairs refused at once cannot both think the
            // other is left.
            let first = !qp.refused.swap(true, Ordering::AcqRel);
            let left = match first {
                true => self.live_qps.fetch_sub(1, Ordering::AcqRel) - 1,
                false => self.live_qps.load(Ordering::Acquire),
            };
            if left > 0 {
                if first {
                    log::info!(
                        "the peer refused a transfer ({status:?}); its queue pair is out of \
                         service, the session goes on over the other {left}"
                    );
                }
                if let Some((r, _)) = w.members.first() {
                    self.key_refused(r.remote.rkey, w.dir);
                }
                Counters::add(&self.counters.transfers_refused, 1);
                self.counters.retire(w.cost);
                Counters::add(&self.counters.completions, 1);
                for (r, _) in w.members {
                    self.fail(r, IoError::Transport(status));
                }
                return;
            }
        }
        if going_on && status == WcStatus::WrFlushError && qp.refused.load(Ordering::Acquire) {
            self.counters.retire(w.cost);
            Counters::add(&self.counters.completions, 1);
            // Those with a key the peer refused would only be refused again, elsewhere.
            let (stale, again): (Vec<_>, Vec<_>) = w
                .members
                .into_iter()
                .map(|(r, _)| r)
                .partition(|r| self.is_refused(r.remote.rkey, w.dir));
            for r in stale {
                self.fail(r, IoError::Transport(WcStatus::RemoteAccessError));
            }
            Counters::add(&self.counters.requests_resent, again.len() as u64);
            self.queues[w.dir as usize].requeue_front(again.into_iter());
            return;
        }
        self.finish(w, status);
    }

    /// Answers the member requests of a completed (or flushed) work request. A failure breaks
    /// the session: every later request fails with [`IoError::Closed`]; those in flight fail
    /// with why the session was broken on purpose, if it was.
    pub(super) fn finish(&self, w: InflightWr, status: WcStatus) {
        let c = &self.counters;
        c.retire(w.cost);
        Counters::add(&c.completions, 1);
        if !status.is_ok() {
            if !self.closed.swap(true, Ordering::AcqRel) {
                log::warn!("session broken by a transport error: {status:?}");
            }
            let e = match self.cause.get() {
                Some(cause) if status == WcStatus::WrFlushError => cause.clone(),
                _ => IoError::Transport(status),
            };
            for (r, _) in w.members {
                self.fail(r, e.clone());
            }
            return;
        }
        self.policy.on_completion(w.bytes, w.posted.elapsed());
        match w.dir {
            Dir::Read => Counters::add(&c.bytes_read, w.bytes),
            Dir::Write => Counters::add(&c.bytes_written, w.bytes),
        }
        for (r, staging) in w.members {
            match (r.buf, staging) {
                (Buffer::Plain(mut v), Staging::Pool(off)) if w.dir == Dir::Read => {
                    let slot = w.slot.as_ref().expect("staged members have a slot");
                    match r.done {
                        Done::Borrowing(done) => {
                            // SAFETY: the slot belongs to this work request alone until `w`
                            // drops, and transports write a slot only for work requests posted
                            // with it: this one's transfer is over, so nothing writes these
                            // bytes during the call.
                            done(Ok(unsafe { slot.bytes(off, r.len) }))
                        }
                        done => {
                            slot.read_at(off, &mut v);
                            Counters::add(&c.premr_copies, 1);
                            done.ok(Buffer::Plain(v))
                        }
                    }
                }
                // A write's buffer, or a dynMR read's, which it landed in.
                (buf, _) => r.done.ok(buf),
            }
        }
    }
}
