//! A pool of threads that grows with the work waiting and shrinks when idle: for a server
//! whose jobs may wait (an RPC handler waiting on a callback, a callback waiting on its
//! answer), so that what is busy, not what is connected, costs threads. A job never waits for
//! a free thread: one is started for it when none is idle, so jobs that wait on each other
//! cannot starve. Jobs may also be set for later ([`Workers::run_after`]): one timer thread
//! keeps them, instead of a sleeping thread each.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Condvar, Mutex, Weak};
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

/// The pool; cheap to clone. Its threads end once every clone is gone and their jobs are done.
#[derive(Clone)]
pub struct Workers {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    jobs: Sender<Job>,
    threads: Arc<Threads>,
    later: Arc<Timer>,
}

/// What the pool's threads hold: the queue and the counts.
struct Threads {
    jobs: Receiver<Job>,
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    live: usize,
    idle: usize,
    queued: usize,
}

/// Jobs set for later, and the condition their timer thread waits on.
#[derive(Default)]
struct Timer {
    later: Mutex<Later>,
    changed: Condvar,
}

/// Jobs set for later, by when, numbered in the order they were set.
#[derive(Default)]
struct Later {
    due: BinaryHeap<Reverse<(Instant, u64)>>,
    jobs: HashMap<u64, Job>,
    next: u64,
    timer_started: bool,
}

/// How long the timer thread sleeps at most, to notice that the pool is gone.
const TIMER_CHECK: Duration = Duration::from_secs(1);

impl Workers {
    /// An empty pool whose threads are called `name`.
    pub fn new(name: &str) -> Workers {
        let (tx, rx) = crossbeam_channel::unbounded();
        Workers {
            inner: Arc::new(Inner {
                name: name.to_string(),
                jobs: tx,
                threads: Arc::new(Threads {
                    jobs: rx,
                    counts: Mutex::default(),
                }),
                later: Arc::default(),
            }),
        }
    }

    /// Runs `job` on a thread of the pool, a new one if none is free.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        self.inner.run(Box::new(job));
    }

    /// Runs `job` on a thread of the pool once `delay` has passed.
    pub fn run_after(&self, delay: Duration, job: impl FnOnce() + Send + 'static) {
        let timer = &self.inner.later;
        let mut later = timer.later.lock().unwrap();
        let n = later.next;
        later.next += 1;
        later.due.push(Reverse((Instant::now() + delay, n)));
        later.jobs.insert(n, Box::new(job));
        if !later.timer_started {
            let (pool, timer) = (Arc::downgrade(&self.inner), timer.clone());
            match std::thread::Builder::new()
                .name(format!("{}-timer", self.inner.name))
                .spawn(move || keep_time(&pool, &timer))
            {
                Ok(_) => later.timer_started = true,
                Err(e) => log::error!("{}: no timer thread: {e}", self.inner.name),
            }
        }
        timer.changed.notify_one();
    }

    /// Threads alive now.
    pub fn threads(&self) -> usize {
        self.inner.threads.counts.lock().unwrap().live
    }
}

impl Inner {
    fn run(&self, job: Job) {
        let mut c = self.threads.counts.lock().unwrap();
        // Sent under the lock: a thread deciding to end sees it.
        let _ = self.jobs.send(job);
        c.queued += 1;
        if c.queued > c.idle {
            let threads = self.threads.clone();
            match std::thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || threads.work())
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
}

/// The timer thread: hands each job set for later to the pool when it is due; ends with the
/// pool (its jobs not yet due are dropped with it).
fn keep_time(pool: &Weak<Inner>, timer: &Timer) {
    let mut later = timer.later.lock().unwrap();
    loop {
        let now = Instant::now();
        match later.due.peek().copied() {
            Some(Reverse((at, n))) if at <= now => {
                later.due.pop();
                if let Some(job) = later.jobs.remove(&n) {
                    drop(later);
                    let Some(pool) = pool.upgrade() else {
                        return;
                    };
                    pool.run(job);
                    drop(pool);
                    later = timer.later.lock().unwrap();
                }
            }
            next => {
                if pool.strong_count() == 0 {
                    return;
                }
                let wait = next.map_or(TIMER_CHECK, |Reverse((at, _))| (at - now).min(TIMER_CHECK));
                later = timer.changed.wait_timeout(later, wait).unwrap().0;
            }
        }
    }
}

impl Threads {
    fn work(&self) {
        loop {
            match self.jobs.recv_timeout(IDLE_EXIT) {
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
                // Every handle of the pool is gone, and every job was taken.
                Err(RecvTimeoutError::Disconnected) => {
                    let mut c = self.counts.lock().unwrap();
                    c.live -= 1;
                    c.idle -= 1;
                    return;
                }
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
    fn the_threads_end_with_the_pool() {
        let w = Workers::new("test-worker");
        let threads = w.inner.threads.clone();
        for _ in 0..4 {
            w.run(|| std::thread::sleep(Duration::from_millis(50)));
        }
        w.run_after(Duration::from_secs(60), || {});
        drop(w);
        let start = Instant::now();
        while threads.counts.lock().unwrap().live > 0 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "threads outlive the pool"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
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
