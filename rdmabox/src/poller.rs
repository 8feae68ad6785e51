//! Completion polling: busy, event, event-batch and adaptive, as one state machine with
//! different parameters (the paper's Fig. 2 and Algorithm 3).
//!
//! Adaptive polling: after a wake-up, poll up to `max_poll_wc` completions per round; count
//! empty rounds and, after `max_retry` of them, re-arm the CQ, poll once more (a completion may
//! have landed before the arm took effect) and only then sleep. The paper's Algorithm 3 never
//! resets its retry counter; here finding work resets it, so a busy CQ keeps being polled.
//!
//! [`PollState`] is the decision; `drive` is the loop around it (poll rounds, arm, re-poll,
//! bounded sleep) that both the session's completion threads and the RPC pumps run, each
//! supplying its CQ and completion handling as a `PollTarget`.

use std::fmt;
use std::ops::ControlFlow;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How a poller waits for completions; parsed from and shown as the `--polling` strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Never sleep.
    Busy,
    /// Sleep after every completion: one event, one completion.
    Event,
    /// On each event, drain the CQ in batches, then sleep.
    EventBatch,
    /// Keep polling through `max_retry` empty rounds before sleeping.
    Adaptive {
        /// Completions taken per poll.
        max_poll_wc: usize,
        /// Empty rounds before sleeping.
        max_retry: u32,
    },
}

/// The paper's benchmark settings.
const DEFAULT_MAX_POLL_WC: usize = 32;
const DEFAULT_MAX_RETRY: u32 = 120;

impl Default for PollMode {
    fn default() -> Self {
        PollMode::Adaptive {
            max_poll_wc: DEFAULT_MAX_POLL_WC,
            max_retry: DEFAULT_MAX_RETRY,
        }
    }
}

impl PollMode {
    /// Completions taken per poll call.
    pub fn batch(self) -> usize {
        match self {
            PollMode::Event => 1,
            PollMode::Adaptive { max_poll_wc, .. } => max_poll_wc.max(1),
            PollMode::Busy | PollMode::EventBatch => 32,
        }
    }

    /// Whether the poller ever sleeps (all but busy polling), so that a completion that comes
    /// while it sleeps is best handled where it was produced: waking a sleeper costs more
    /// than the work it wakes for. (An adaptive poller sleeps once its spin ran dry or gave
    /// way to threads that wanted the core.)
    pub fn sleeps(self) -> bool {
        self != PollMode::Busy
    }

    fn max_retry(self) -> Option<u32> {
        match self {
            PollMode::Busy => None,
            PollMode::Event | PollMode::EventBatch => Some(1),
            PollMode::Adaptive { max_retry, .. } => Some(max_retry.max(1)),
        }
    }
}

impl fmt::Display for PollMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PollMode::Busy => write!(f, "busy"),
            PollMode::Event => write!(f, "event"),
            PollMode::EventBatch => write!(f, "event-batch"),
            PollMode::Adaptive {
                max_poll_wc,
                max_retry,
            } => write!(f, "adaptive:{max_poll_wc}:{max_retry}"),
        }
    }
}

/// "busy", "event", "event-batch", "adaptive" or "adaptive:MAX_POLL_WC:MAX_RETRY".
impl FromStr for PollMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let mode = match parts.next().unwrap_or("") {
            "busy" => PollMode::Busy,
            "event" => PollMode::Event,
            "event-batch" => PollMode::EventBatch,
            "adaptive" => {
                let mut max_poll_wc = DEFAULT_MAX_POLL_WC;
                let mut max_retry = DEFAULT_MAX_RETRY;
                if let Some(w) = parts.next() {
                    max_poll_wc = w.parse().map_err(|_| format!("bad MAX_POLL_WC in {s:?}"))?;
                }
                if let Some(r) = parts.next() {
                    max_retry = r.parse().map_err(|_| format!("bad MAX_RETRY in {s:?}"))?;
                }
                PollMode::Adaptive {
                    max_poll_wc,
                    max_retry,
                }
            }
            other => {
                return Err(format!(
                    "unknown polling mode {other:?}: expected busy, event, event-batch or adaptive"
                ))
            }
        };
        if parts.next().is_some() {
            return Err(format!("bad polling mode {s:?}"));
        }
        Ok(mode)
    }
}

/// What the poller does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Poll again right away.
    Poll,
    /// Arm the CQ, poll once more, and sleep if that finds nothing.
    ArmAndSleep,
}

/// The retry counter of one poller.
pub struct PollState {
    mode: PollMode,
    empty_rounds: u32,
}

impl PollState {
    /// A fresh count for a poller running in `mode`.
    pub fn new(mode: PollMode) -> PollState {
        PollState {
            mode,
            empty_rounds: 0,
        }
    }

    /// A fresh count, after the poller slept for a reason of its own.
    pub fn restart(&mut self) {
        self.empty_rounds = 0;
    }

    /// After a poll round that found `found` completions.
    pub fn after_poll(&mut self, found: usize) -> Next {
        if found > 0 && self.mode != PollMode::Event {
            self.empty_rounds = 0;
            return Next::Poll;
        }
        let Some(max) = self.mode.max_retry() else {
            return Next::Poll;
        };
        if self.mode == PollMode::Event {
            // One completion per event: sleep again right after handling it.
            return Next::ArmAndSleep;
        }
        self.empty_rounds += 1;
        if self.empty_rounds >= max {
            self.empty_rounds = 0;
            Next::ArmAndSleep
        } else {
            Next::Poll
        }
    }
}

/// The longest a poller sleeps on its CQ event, so that a stop request is noticed.
pub(crate) const MAX_SLEEP: Duration = Duration::from_millis(100);

/// A yield that took longer than this ran another thread: the core was wanted. (Where no
/// other thread is runnable, a yield returns within a microsecond or two.)
const WANTED: Duration = Duration::from_micros(20);

/// Yields in a row that ran another thread before a spin gives way.
const GIVE_WAY_AFTER: u32 = 3;

/// How long one look at the machine's runnable threads stands for every poller.
const RUNNABLE_FRESH: Duration = Duration::from_millis(1);

/// This process's pollers spinning now (see [`Spinning`]).
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// A poller's place among [`SPINNING`] while it spins.
struct Spinning(bool);

impl Spinning {
    fn start(&mut self, target: &mut impl PollTarget) {
        if !self.0 {
            SPINNING.fetch_add(1, Ordering::Relaxed);
            self.0 = true;
            target.spinning(true);
        }
    }

    fn stop(&mut self, target: &mut impl PollTarget) {
        if self.0 {
            target.spinning(false);
            SPINNING.fetch_sub(1, Ordering::Relaxed);
            self.0 = false;
        }
    }
}

impl Drop for Spinning {
    fn drop(&mut self) {
        if self.0 {
            SPINNING.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Whether our spinning pollers take cores that other threads wait for: more of them spin than
/// there are cores left by the threads that are runnable and not spinning (the running count
/// of /proc/loadavg, less our spinners, when last looked at). One look stands for
/// [`RUNNABLE_FRESH`], for every poller of the process; where it cannot be read, no.
pub(crate) fn cores_wanted() -> bool {
    static EPOCH: OnceLock<(Instant, usize)> = OnceLock::new();
    static LOOKED_NS: AtomicU64 = AtomicU64::new(0);
    static FREE_CORES: AtomicUsize = AtomicUsize::new(usize::MAX);
    let (epoch, cores) = *EPOCH.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (Instant::now(), cores)
    });
    let now = epoch.elapsed().as_nanos() as u64 + 1;
    let looked = LOOKED_NS.load(Ordering::Relaxed);
    if now.saturating_sub(looked) > RUNNABLE_FRESH.as_nanos() as u64
        && LOOKED_NS
            .compare_exchange(looked, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let spinning = SPINNING.load(Ordering::Relaxed);
        let free = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| runnable_in_loadavg(&l))
            .map_or(usize::MAX, |r| {
                cores.saturating_sub(r.saturating_sub(spinning))
            });
        FREE_CORES.store(free, Ordering::Relaxed);
    }
    // Spinners beyond the free cores give way one by one, until the rest fit.
    SPINNING.load(Ordering::Relaxed) > FREE_CORES.load(Ordering::Relaxed)
}

/// The threads runnable now, from /proc/loadavg ("0.20 0.18 0.12 3/245 1234": 3).
fn runnable_in_loadavg(loadavg: &str) -> Option<usize> {
    let field = loadavg.split_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

/// Yields the core; whether it came back at once (nobody else wanted to run here).
pub(crate) fn yield_core() -> bool {
    let start = Instant::now();
    std::thread::yield_now();
    start.elapsed() < WANTED
}

/// What [`drive`] polls: a completion queue and what to do with its completions.
pub(crate) trait PollTarget {
    /// Polls the CQ once and handles what it found: the number of completions, or `Break` to
    /// end the loop (stop requested, CQ or connection failed). Called before every poll, so it
    /// is also where a stop request is checked.
    fn poll_round(&mut self) -> ControlFlow<(), usize>;
    /// Asks the CQ for an event at the next completion; `Break` ends the loop.
    fn arm(&mut self) -> ControlFlow<()>;
    /// Sleeps until the CQ event fires or `timeout` passes.
    fn sleep(&mut self, timeout: Duration);
    /// Yields the core between empty rounds; whether nobody else wanted it.
    fn yield_core(&mut self) -> bool {
        yield_core()
    }
    /// Whether our spinning pollers take cores that other threads wait for (asked while this
    /// one spins, if it [`gives way to waiting threads`](Self::gives_way_to_waiting_threads)).
    fn cores_wanted(&mut self) -> bool {
        cores_wanted()
    }
    /// Whether this poller's spin ends when threads wait for a core. A poller whose every
    /// completion a caller waits for (an RPC pump: one call at a time per caller) spins on,
    /// and is one of the threads the others give way to.
    fn gives_way_to_waiting_threads(&self) -> bool {
        true
    }
    /// A spin was cut short because the core was wanted (for the counters).
    fn gave_way(&mut self) {}
    /// The poller starts (`true`) or stops spinning.
    fn spinning(&mut self, _on: bool) {}
}

/// Runs a poll loop as `mode` says until `target` ends it. Rounds that find nothing yield the
/// core while polling goes on; when [`PollState`] says sleep, the CQ is armed and polled once more
/// (a completion may have landed before the arm took effect), and only if that finds nothing
/// does the poller sleep, for at most [`MAX_SLEEP`].
///
/// Polling gives way: spinning pays only on a core nobody else needs, so (except in busy
/// mode, which is asked for) a spin ends, and the poller sleeps on its CQ event, once more
/// threads are runnable than there are cores, or [`GIVE_WAY_AFTER`] yields in a row ran
/// another thread. On few cores, the threads that would produce the completion (a FUSE
/// thread, the transport, the application) are often the ones waiting for the core.
pub(crate) fn drive(mode: PollMode, target: &mut impl PollTarget) {
    let mut state = PollState::new(mode);
    // Yields in a row that ran another thread: one is the thread a completion just woke
    // (which the spin should outlast); several mean the core is in demand.
    let mut wanted_in_a_row = 0;
    let mut spinning = Spinning(false);
    loop {
        let ControlFlow::Continue(n) = target.poll_round() else {
            return;
        };
        let sleep = match state.after_poll(n) {
            Next::Poll if n > 0 => {
                wanted_in_a_row = 0;
                spinning.stop(target);
                false
            }
            Next::Poll if mode == PollMode::Busy => {
                target.yield_core();
                false
            }
            Next::Poll => {
                if target.gives_way_to_waiting_threads() {
                    spinning.start(target);
                }
                wanted_in_a_row = if target.yield_core() {
                    0
                } else {
                    wanted_in_a_row + 1
                };
                let give_way = wanted_in_a_row >= GIVE_WAY_AFTER
                    || (target.gives_way_to_waiting_threads() && target.cores_wanted());
                if give_way {
                    target.gave_way();
                    state.restart();
                }
                give_way
            }
            Next::ArmAndSleep => true,
        };
        if sleep {
            wanted_in_a_row = 0;
            spinning.stop(target);
        }
        if sleep {
            if target.arm().is_break() {
                return;
            }
            match target.poll_round() {
                ControlFlow::Break(()) => return,
                ControlFlow::Continue(0) => target.sleep(MAX_SLEEP),
                ControlFlow::Continue(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_sleeps_after_max_retry_empty_rounds_and_work_resets_the_count() {
        let mut s = PollState::new(PollMode::Adaptive {
            max_poll_wc: 32,
            max_retry: 3,
        });
        assert_eq!(s.after_poll(0), Next::Poll);
        assert_eq!(s.after_poll(0), Next::Poll);
        assert_eq!(s.after_poll(5), Next::Poll, "work found");
        assert_eq!(s.after_poll(0), Next::Poll, "count restarted");
        assert_eq!(s.after_poll(0), Next::Poll);
        assert_eq!(s.after_poll(0), Next::ArmAndSleep);
        assert_eq!(s.after_poll(0), Next::Poll, "fresh count after a sleep");
    }

    #[test]
    fn busy_never_sleeps() {
        let mut s = PollState::new(PollMode::Busy);
        for _ in 0..10_000 {
            assert_eq!(s.after_poll(0), Next::Poll);
        }
    }

    #[test]
    fn event_batch_sleeps_at_the_first_empty_round() {
        let mut s = PollState::new(PollMode::EventBatch);
        assert_eq!(s.after_poll(32), Next::Poll);
        assert_eq!(s.after_poll(0), Next::ArmAndSleep);
    }

    #[test]
    fn event_sleeps_after_every_completion() {
        let mut s = PollState::new(PollMode::Event);
        assert_eq!(PollMode::Event.batch(), 1);
        assert_eq!(s.after_poll(1), Next::ArmAndSleep);
        assert_eq!(s.after_poll(0), Next::ArmAndSleep);
    }

    #[test]
    fn modes_parse() {
        assert_eq!("busy".parse::<PollMode>().unwrap(), PollMode::Busy);
        assert_eq!(
            "adaptive:16:4".parse::<PollMode>().unwrap(),
            PollMode::Adaptive {
                max_poll_wc: 16,
                max_retry: 4
            }
        );
        assert_eq!("adaptive".parse::<PollMode>().unwrap(), PollMode::default());
        assert!("spin".parse::<PollMode>().is_err());
        assert!("adaptive:x".parse::<PollMode>().is_err());
        assert!("busy:1".parse::<PollMode>().is_err());
    }

    /// A CQ that returns scripted poll results and records what the driver did.
    struct Script {
        polls: std::collections::VecDeque<usize>,
        arm_fails: bool,
        /// Whether each yield finds the core free (once they run out: always).
        yields: std::collections::VecDeque<bool>,
        /// Whether more threads are runnable than cores, at each look (then: no).
        crowded: std::collections::VecDeque<bool>,
        log: Vec<Did>,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Did {
        Poll(usize),
        Arm,
        Sleep,
        GaveWay,
    }

    impl Script {
        fn new(polls: &[usize]) -> Script {
            Script {
                polls: polls.iter().copied().collect(),
                arm_fails: false,
                yields: Default::default(),
                crowded: Default::default(),
                log: Vec::new(),
            }
        }
    }

    impl PollTarget for Script {
        /// Ends the loop when the script runs out.
        fn poll_round(&mut self) -> ControlFlow<(), usize> {
            let n = self
                .polls
                .pop_front()
                .map_or(ControlFlow::Break(()), ControlFlow::Continue);
            if let ControlFlow::Continue(n) = n {
                self.log.push(Did::Poll(n));
            }
            n
        }

        fn arm(&mut self) -> ControlFlow<()> {
            self.log.push(Did::Arm);
            if self.arm_fails {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        }

        fn sleep(&mut self, timeout: std::time::Duration) {
            assert_eq!(timeout, MAX_SLEEP);
            self.log.push(Did::Sleep);
        }

        fn yield_core(&mut self) -> bool {
            self.yields.pop_front().unwrap_or(true)
        }

        fn gave_way(&mut self) {
            self.log.push(Did::GaveWay);
        }

        fn cores_wanted(&mut self) -> bool {
            self.crowded.pop_front().unwrap_or(false)
        }
    }

    #[test]
    fn a_spin_gives_way_when_spinners_take_cores_others_wait_for() {
        use Did::*;
        let mode = PollMode::Adaptive {
            max_poll_wc: 16,
            max_retry: 100,
        };
        let mut s = Script::new(&[0, 0, 0, 0, 0]);
        s.crowded = [false, true].into();
        drive(mode, &mut s);
        assert_eq!(
            s.log,
            [
                Poll(0),
                Poll(0),
                GaveWay,
                Arm,
                Poll(0),
                Sleep,
                Poll(0),
                Poll(0)
            ]
        );
        let mut s = Script::new(&[0; 4]);
        s.crowded = [true; 4].into();
        drive(PollMode::Busy, &mut s);
        assert_eq!(s.log, [Poll(0); 4], "busy polling spins regardless");
    }

    #[test]
    fn the_runnable_count_is_read_from_loadavg() {
        assert_eq!(runnable_in_loadavg("0.20 0.18 0.12 3/245 1234\n"), Some(3));
        assert_eq!(runnable_in_loadavg("0.20 0.18 0.12"), None);
        assert_eq!(runnable_in_loadavg("a b c x/y z"), None);
        assert!(
            runnable_in_loadavg(&std::fs::read_to_string("/proc/loadavg").unwrap()).unwrap() >= 1
        );
    }

    #[test]
    fn a_spin_gives_way_when_a_yield_ran_another_thread_except_in_busy_mode() {
        use Did::*;
        let mode = PollMode::Adaptive {
            max_poll_wc: 16,
            max_retry: 100,
        };
        let mut s = Script::new(&[1, 0, 0, 0, 0, 0, 0, 0, 0]);
        s.yields = [false, true, false, false, false].into();
        drive(mode, &mut s);
        assert_eq!(
            s.log,
            [
                Poll(1),
                Poll(0), // another thread ran, once: spin on
                Poll(0), // the core was free: the count starts again
                Poll(0),
                Poll(0),
                Poll(0), // three in a row ran another thread: arm, re-poll, sleep
                GaveWay,
                Arm,
                Poll(0),
                Sleep,
                Poll(0),
                Poll(0),
            ]
        );
        let mut s = Script::new(&[0; 5]);
        s.yields = [false; 5].into();
        drive(PollMode::Busy, &mut s);
        assert_eq!(s.log, [Poll(0); 5], "busy polling spins regardless");
    }

    #[test]
    fn driver_arms_re_polls_and_sleeps_only_if_the_re_poll_is_empty() {
        use Did::*;
        let mode = PollMode::Adaptive {
            max_poll_wc: 16,
            max_retry: 3,
        };
        let mut s = Script::new(&[2, 0, 0, 0, 4, 0, 0, 0, 0, 1]);
        drive(mode, &mut s);
        assert_eq!(
            s.log,
            [
                Poll(2),
                Poll(0),
                Poll(0),
                Poll(0),
                Arm,
                Poll(4), // the re-poll found work: no sleep, fresh count
                Poll(0),
                Poll(0),
                Poll(0),
                Arm,
                Poll(0),
                Sleep,
                Poll(1),
            ]
        );
    }

    #[test]
    fn driver_spins_max_retry_empty_rounds_before_arming() {
        // The RPC pumps' setting.
        let mode = PollMode::Adaptive {
            max_poll_wc: 16,
            max_retry: 200,
        };
        let mut s = Script::new(&[0; 201]);
        drive(mode, &mut s);
        assert_eq!(s.log.iter().position(|d| *d == Did::Arm), Some(200));
        assert_eq!(s.log[201..], [Did::Poll(0), Did::Sleep]);
    }

    #[test]
    fn driver_stops_when_arming_fails() {
        let mut s = Script::new(&[0, 0]);
        s.arm_fails = true;
        drive(PollMode::EventBatch, &mut s);
        assert_eq!(s.log, [Did::Poll(0), Did::Arm], "no re-poll, no sleep");
    }

    #[test]
    fn busy_driver_never_arms() {
        let mut s = Script::new(&[0; 1000]);
        drive(PollMode::Busy, &mut s);
        assert_eq!(s.log.len(), 1000);
        assert!(s.log.iter().all(|d| *d == Did::Poll(0)));
    }
}
