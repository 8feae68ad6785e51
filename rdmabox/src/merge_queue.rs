//! The merge queue (the paper's §IV-A, Fig. 4): one per direction, shared by all threads. A
//! thread that submits a request appends it and tries to become the drainer; the first one wins
//! and posts everything queued, later ones simply return, their requests riding along with the
//! drainer's batch. A lone request is therefore posted at once: nothing ever waits to merge.
//!
//! The drainer may stop early (admission window full, staging pool empty, send queues full).
//! Whoever frees that resource calls [`MergeQueue::drain_with`] again, and a drainer re-checks
//! after giving up the role, so a request is never stranded. A pass that could do nothing ends
//! the drainer's turn, unless something was freed meanwhile: it must not spin on a queue that
//! only a completion can unblock (it may be the very thread that would reap it).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A queue of requests in one direction, with the drainer role that one thread at a time holds.
pub struct MergeQueue<T> {
    pending: Mutex<VecDeque<T>>,
    draining: AtomicBool,
}

impl<T> Default for MergeQueue<T> {
    fn default() -> Self {
        MergeQueue {
            pending: Mutex::new(VecDeque::new()),
            draining: AtomicBool::new(false),
        }
    }
}

impl<T> MergeQueue<T> {
    /// Appends a request at the tail; the caller then tries to drain.
    pub fn push(&self, item: T) {
        self.pending.lock().unwrap().push_back(item);
    }

    /// The queued requests, for the drainer to take from.
    pub fn pending(&self) -> MutexGuard<'_, VecDeque<T>> {
        self.pending.lock().unwrap()
    }

    /// Puts requests the drainer could not post back at the head, in their original order.
    pub fn requeue_front(&self, items: impl DoubleEndedIterator<Item = T>) {
        let mut q = self.pending.lock().unwrap();
        for item in items.rev() {
            q.push_front(item);
        }
    }

    /// Whether nothing is queued (a snapshot: other threads may push at any time).
    pub fn is_empty(&self) -> bool {
        self.pending.lock().unwrap().is_empty()
    }

    /// Runs `drain` unless another thread is already draining. After giving up the drainer
    /// role, checks `can_progress` once more and drains again if it says so: a request queued,
    /// or a resource freed, while the role was held is picked up by someone. `drain` returns
    /// false when its pass was stuck (it took requests and moved none): then the drainer stops
    /// unless `freed` (a count that whoever frees a resource bumps, and then drains) moved
    /// between the pass's start and the role's release; what it waits for is in flight, and
    /// its completion drains again.
    pub fn drain_with(
        &self,
        mut drain: impl FnMut(&Self) -> bool,
        can_progress: impl Fn(&Self) -> bool,
        freed: impl Fn() -> u64,
    ) {
        loop {
            // SeqCst here and for `freed`: a freer bumps the count and then tries the role; a
            // drainer releases the role and then reads the count. One of them sees the other.
            if self.draining.swap(true, Ordering::SeqCst) {
                return;
            }
            let before = freed();
            let moved = drain(self);
            self.draining.store(false, Ordering::SeqCst);
            if !moved && freed() == before {
                return;
            }
            if !can_progress(self) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn one_drainer_at_a_time_and_nothing_stranded() {
        let q = Arc::new(MergeQueue::<u64>::default());
        let active = Arc::new(AtomicUsize::new(0));
        let drained = Arc::new(Mutex::new(Vec::new()));
        let drains = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (q, active, drained, drains) =
                    (q.clone(), active.clone(), drained.clone(), drains.clone());
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        q.push(t * 10_000 + i);
                        q.drain_with(
                            |q| {
                                assert_eq!(
                                    active.fetch_add(1, Ordering::SeqCst),
                                    0,
                                    "two drainers"
                                );
                                drains.fetch_add(1, Ordering::Relaxed);
                                let batch: Vec<_> = q.pending().drain(..).collect();
                                drained.lock().unwrap().extend(batch);
                                active.fetch_sub(1, Ordering::SeqCst);
                                true
                            },
                            |q| !q.is_empty(),
                            || 0,
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(q.is_empty(), "a request was stranded");
        let mut all = drained.lock().unwrap().clone();
        assert_eq!(all.len(), 8000);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 8000);
        // Batching happened: fewer drains than requests is typical but not guaranteed, so only
        // check that the count is sane.
        assert!(drains.load(Ordering::Relaxed) <= 8000);
    }

    /// A pass that moved nothing ends the drainer's turn even though the queue is not empty:
    /// the drainer may be the thread whose next completion would unblock it.
    #[test]
    fn a_stuck_pass_ends_the_turn() {
        let q = MergeQueue::default();
        q.push(1);
        let passes = AtomicUsize::new(0);
        let stuck = |_: &MergeQueue<i32>| {
            passes.fetch_add(1, Ordering::Relaxed);
            false
        };
        q.drain_with(stuck, |q| !q.is_empty(), || 0);
        // Unless something was freed during the pass: then it looks again.
        let freed = AtomicUsize::new(0);
        let second = AtomicUsize::new(0);
        let stuck_while_freed = |_: &MergeQueue<i32>| {
            if second.fetch_add(1, Ordering::Relaxed) == 0 {
                freed.fetch_add(1, Ordering::Relaxed);
            }
            false
        };
        q.drain_with(
            stuck_while_freed,
            |q| !q.is_empty(),
            || freed.load(Ordering::Relaxed) as u64,
        );
        assert_eq!(second.load(Ordering::Relaxed), 2);
        // A pass that moves something goes on while more can move.
        let moving = |q: &MergeQueue<i32>| {
            passes.fetch_add(1, Ordering::Relaxed);
            q.pending().pop_front();
            true
        };
        q.push(2);
        q.drain_with(moving, |q| !q.is_empty(), || 0);
        assert!(q.is_empty());
        assert_eq!(passes.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn requeue_keeps_order_at_the_head() {
        let q = MergeQueue::default();
        q.push(5);
        q.requeue_front([1, 2, 3].into_iter());
        assert_eq!(
            q.pending().iter().copied().collect::<Vec<_>>(),
            [1, 2, 3, 5]
        );
    }
}
