//! A pool of threads that grows with the work waiting and shrinks when idle: for a server
//! whose jobs may wait (an RPC handler waiting on a callback, a callback waiting on its
//! answer), so that what is busy, not what is connected, costs threads. A job never waits for
//! a free thread: one is started for it when none is idle, so jobs that wait on each other
//! cannot starve. Jobs may also be set for later ([`Workers::run_after`]): one timer thread
//! keeps them, instead of a sleeping thread each.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

/// A unit of work.
pub type Job = Box<dyn FnOnce() + Send>;

/// Threads kept when idle.
const KEEP: usize = 2;
/// How long a thread beyond those waits for work before it ends (shorter in tests, which
/// wait for it).
#[cfg(not(test))]
const IDLE_EXIT: Duration = Duration::from_secs(10);
#[cfg(test)]
const IDLE_EXIT: Duration = Duration::from_secs(1);

/// The pool; cheap to clone.
#[derive(Clone)]
pub struct Workers {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    jobs: (Sender<Job>, Receiver<Job>),
    counts: Mutex<Counts>,
    later: Mutex<Later>,
    later_changed: Condvar,
}

/// Jobs set for later, by when, numbered in the order they were set.
#[derive(Default)]
struct Later {
    due: BinaryHeap<Reverse<(Instant, u64)>>,
    jobs: HashMap<u64, Job>,
    next: u64,
    timer_started: bool,
}

#[derive(Default)]
struct Counts {
    live: usize,
    idle: usize,
    queued: usize,
}

impl Workers {
    /// An empty pool whose threads are called `name`.
    pub fn new(name: &str) -> Workers {
        Workers {
            inner: Arc::new(Inner {
                name: name.to_string(),
                jobs: crossbeam_channel::unbounded(),
                counts: Mutex::default(),
                later: Mutex::default(),
                later_changed: Condvar::new(),
            }),
        }
    }

    /// Runs `job` on a thread of the pool, a new one if none is free.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        self.inner.run(Box::new(job));
    }

    /// Runs `job` on a thread of the pool once `delay` has passed.
    pub fn run_after(&self, delay: Duration, job: impl FnOnce() + Send + 'static) {
        let mut later = self.inner.later.lock().unwrap();
        let n = later.next;
        later.next += 1;
        later.due.push(Reverse((Instant::now() + delay, n)));
        later.jobs.insert(n, Box::new(job));
        if !later.timer_started {
            let inner = self.inner.clone();
            match std::thread::Builder::new()
                .name(format!("{}-timer", self.inner.name))
                .spawn(move || inner.keep_time())
            {
                Ok(_) => later.timer_started = true,
                Err(e) => log::error!("{}: no timer thread: {e}", self.inner.name),
            }
        }
        self.inner.later_changed.notify_one();
    }

    /// Threads alive now.
    pub fn threads(&self) -> usize {
        self.inner.counts.lock().unwrap().live
    }
}

impl Inner {
    fn run(self: &Arc<Self>, job: Job) {
        let mut c = self.counts.lock().unwrap();
        // Sent under the lock: a thread deciding to end sees it.
        let _ = self.jobs.0.send(job);
        c.queued += 1;
        if c.queued > c.idle {
            let inner = self.clone();
            match std::thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || inner.work())
            {
                Ok(_) => {
                    c.live += 1;
                    c.idle += 1;
                }
                // The job waits for a thread to come free.
                Err(e) => log::error!("{}: no thread for a job: {e}", self.name),
            }
        }
    }

    /// The timer thread: hands each job set for later to the pool when it is due.
    fn keep_time(self: Arc<Self>) {
        let mut later = self.later.lock().unwrap();
        loop {
            let now = Instant::now();
            match later.due.peek().copied() {
                Some(Reverse((at, n))) if at <= now => {
                    later.due.pop();
                    if let Some(job) = later.jobs.remove(&n) {
                        drop(later);
                        self.run(job);
                        later = self.later.lock().unwrap();
                    }
                }
                Some(Reverse((at, _))) => {
                    later = self.later_changed.wait_timeout(later, at - now).unwrap().0;
                }
                None => later = self.later_changed.wait(later).unwrap(),
            }
        }
    }

    fn work(&self) {
        loop {
            match self.jobs.1.recv_timeout(IDLE_EXIT) {
                Ok(job) => {
                    {
                        let mut c = self.counts.lock().unwrap();
                        c.queued -= 1;
                        c.idle -= 1;
                    }
                    job();
                    self.counts.lock().unwrap().idle += 1;
                }
                Err(RecvTimeoutError::Timeout) => {
                    let mut c = self.counts.lock().unwrap();
                    if c.live > KEEP && c.queued == 0 {
                        c.live -= 1;
                        c.idle -= 1;
                        return;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn jobs_that_wait_on_each_other_each_get_a_thread() {
        let w = Workers::new("test-worker");
        let (tx, rx) = crossbeam_channel::unbounded::<usize>();
        let done = Arc::new(AtomicUsize::new(0));
        // Each of 20 jobs waits for the next one's word: 20 threads at once, or a hang.
        for i in 0..20usize {
            let (tx, rx, done) = (tx.clone(), rx.clone(), done.clone());
            w.run(move || {
                if i > 0 {
                    tx.send(i).unwrap();
                }
                if i < 19 {
                    rx.recv_timeout(Duration::from_secs(5))
                        .expect("the next job ran");
                }
                done.fetch_add(1, Ordering::SeqCst);
            });
        }
        let start = std::time::Instant::now();
        while done.load(Ordering::SeqCst) < 20 {
            assert!(start.elapsed() < Duration::from_secs(10), "jobs starved");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(w.threads() >= 2);
    }

    #[test]
    fn jobs_set_for_later_run_in_order_of_when_without_a_thread_each() {
        let w = Workers::new("test-worker");
        let (tx, rx) = crossbeam_channel::unbounded();
        let start = Instant::now();
        for (i, ms) in [(0, 300u64), (1, 100), (2, 200)] {
            let tx = tx.clone();
            w.run_after(Duration::from_millis(ms), move || tx.send(i).unwrap());
        }
        assert_eq!(w.threads(), 0, "nothing runs before it is due");
        let order: Vec<i32> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(order, [1, 2, 0]);
        assert!(start.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn one_at_a_time_takes_one_thread() {
        let w = Workers::new("test-worker");
        for _ in 0..50 {
            let (tx, rx) = crossbeam_channel::bounded(1);
            w.run(move || tx.send(()).unwrap());
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
            // Let the thread count itself idle again.
            std::thread::sleep(Duration::from_millis(2));
        }
        // A job may come just before its thread counted itself idle; not one per job.
        assert!(w.threads() <= 5, "{} threads", w.threads());
    }
}
