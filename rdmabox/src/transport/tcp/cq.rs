//! The tcp provider's completion queue: a locked queue plus an eventfd that fires once per arm,
//! like a completion channel.
//!
//! Unlike a NIC, this provider has a thread of its own that produces completions: the QP's
//! engine. With an inline consumer set, what the engine completes while the CQ is armed (its
//! poller asleep) is handed to the consumer on the engine's thread, once the engine holds no
//! lock, instead of waking the poller: one thread hop and one wake-up fewer per completion.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::transport::types::Completion;

/// A tcp completion queue, filled by the engines and polled by the application.
pub struct Cq {
    state: Mutex<CqState>,
    eventfd: EventFd,
    inline: OnceLock<InlineConsumer>,
    /// The engine added completions to the armed queue and owes the consumer a call.
    inline_due: AtomicBool,
}

/// Takes completions off a CQ and handles them, on whichever thread calls it.
pub type InlineConsumer = Arc<dyn Fn() + Send + Sync>;

struct CqState {
    queue: VecDeque<Completion>,
    armed: bool,
}

impl Cq {
    /// An empty, unarmed queue with room reserved for `capacity` completions.
    pub fn new(capacity: usize) -> io::Result<Cq> {
        let eventfd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        Ok(Cq {
            state: Mutex::new(CqState {
                queue: VecDeque::with_capacity(capacity),
                armed: false,
            }),
            eventfd,
            inline: OnceLock::new(),
            inline_due: AtomicBool::new(false),
        })
    }

    /// Adds one completion; fires the event if the queue was armed.
    pub fn push(&self, c: Completion) {
        self.push_all(std::iter::once(c));
    }

    /// Adds completions; fires the event if the queue was armed.
    pub fn push_all(&self, cs: impl IntoIterator<Item = Completion>) {
        self.add(cs, false);
    }

    /// Adds completions from the engine's thread, which calls [`run_inline`](Self::run_inline)
    /// once it holds no lock: with an inline consumer, an armed queue stays armed and owes the
    /// consumer a call instead of firing its event.
    pub fn push_deferred(&self, cs: impl IntoIterator<Item = Completion>) {
        self.add(cs, true);
    }

    fn add(&self, cs: impl IntoIterator<Item = Completion>, deferred: bool) {
        let mut st = self.state.lock().unwrap();
        let before = st.queue.len();
        st.queue.extend(cs);
        if st.queue.len() > before && st.armed {
            if deferred && self.inline.get().is_some() {
                self.inline_due.store(true, Ordering::Release);
                return;
            }
            st.armed = false;
            // It cannot fail for want of room: the counter is drained by every wait.
            let _ = self.eventfd.write(1);
        }
    }

    /// Moves up to `out.len()` completions into `out`, oldest first; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> usize {
        let mut st = self.state.lock().unwrap();
        let n = out.len().min(st.queue.len());
        for (slot, c) in out.iter_mut().zip(st.queue.drain(..n)) {
            *slot = c;
        }
        n
    }

    /// Sets the consumer that the engine runs on its own thread for what it completes while
    /// the queue is armed; false if one was set already.
    pub fn set_inline(&self, consumer: InlineConsumer) -> bool {
        self.inline.set(consumer).is_ok()
    }

    /// Runs the inline consumer if completions were deferred to it. The caller must hold no
    /// lock the consumer might take (it answers requests and posts more).
    pub fn run_inline(&self) {
        // A plain load first: the engine asks after every frame, and mostly nothing is due.
        if self.inline_due.load(Ordering::Acquire) && self.inline_due.swap(false, Ordering::AcqRel)
        {
            if let Some(consume) = self.inline.get() {
                consume();
            }
        }
    }

    /// Asks for one event on the next completion (completions already queued do not fire it).
    pub fn arm(&self) {
        self.state.lock().unwrap().armed = true;
    }

    /// The eventfd that turns readable when an armed event fires.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }

    /// Sleeps until an armed event fires (true, consumed) or `timeout` passes (false).
    pub fn wait_event(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let fired = super::super::poll_readable(self.event_fd(), timeout);
        if self.inline.get().is_some() {
            // The poller is awake: it takes what comes, until it arms again.
            self.state.lock().unwrap().armed = false;
        }
        if !fired? {
            return Ok(false);
        }
        Ok(self.eventfd.read().is_ok())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::transport::types::WcStatus;

    fn completion(wr_id: u64) -> Completion {
        Completion {
            wr_id,
            status: WcStatus::Success,
            ..Completion::EMPTY
        }
    }

    /// A CQ whose inline consumer drains it and counts the completions it took.
    fn with_consumer() -> (Arc<Cq>, Arc<AtomicUsize>) {
        let cq = Arc::new(Cq::new(8).unwrap());
        let taken = Arc::new(AtomicUsize::new(0));
        let (q, t) = (Arc::downgrade(&cq), taken.clone());
        assert!(cq.set_inline(Arc::new(move || {
            let q = q.upgrade().unwrap();
            let mut out = [Completion::EMPTY; 4];
            t.fetch_add(q.poll(&mut out), Ordering::Relaxed);
        })));
        (cq, taken)
    }

    fn fired(cq: &Cq) -> bool {
        cq.wait_event(Some(Duration::ZERO)).unwrap()
    }

    #[test]
    fn the_engine_answers_what_it_completes_while_armed_and_fires_no_event() {
        let (cq, taken) = with_consumer();
        cq.arm();
        cq.push_deferred([completion(1), completion(2)]);
        assert_eq!(
            taken.load(Ordering::Relaxed),
            0,
            "nothing runs under the engine's lock"
        );
        cq.run_inline();
        assert_eq!(taken.load(Ordering::Relaxed), 2);
        cq.run_inline();
        assert_eq!(taken.load(Ordering::Relaxed), 2, "one call per deferral");
        // Still armed: the next one goes the same way.
        cq.push_deferred([completion(3)]);
        cq.run_inline();
        assert_eq!(taken.load(Ordering::Relaxed), 3);
        assert!(!fired(&cq), "the poller slept through all of it");
    }

    #[test]
    fn unarmed_queues_and_other_threads_pushes_go_to_the_poller() {
        let (cq, taken) = with_consumer();
        // The poller is awake (not armed): it takes them.
        cq.push_deferred([completion(1)]);
        cq.run_inline();
        assert_eq!(taken.load(Ordering::Relaxed), 0);
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(cq.poll(&mut out), 1);
        // A flush pushed by a posting thread wakes the sleeping poller, as without a consumer.
        cq.arm();
        cq.push(completion(2));
        assert!(fired(&cq));
        cq.run_inline();
        assert_eq!(taken.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn without_a_consumer_deferred_pushes_fire_the_event() {
        let cq = Cq::new(8).unwrap();
        cq.arm();
        cq.push_deferred([completion(1)]);
        assert!(fired(&cq));
        let mut out = [Completion::EMPTY; 4];
        assert_eq!(cq.poll(&mut out), 1);
    }
}
