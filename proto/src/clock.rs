//! Call deadlines that the metadata service can hold without synchronized clocks.
//!
//! A client gives up on a call at its deadline; a service that reads the call only later (it
//! was stopped, starved, or the call sat in a queue) must not apply it then, behind the caller's
//! back. Each call carries the client's monotonic clock at sending and the time it has left.
//! The service cannot compare the two clocks directly, but it sees, for every call, its own
//! clock at reading minus the client's at sending: the clock offset plus the call's delay. The
//! smallest such value over the session is the offset plus the least delay; a call's age is how
//! much more than that it took. A late call is refused, unapplied.
//!
//! Clock rates differ a little (NTP keeps them within a few parts per million): the smallest
//! value is trusted less as it gets older, rising by [`DRIFT_ALLOWANCE`] of the time since it was
//! seen, so that drift can only make a call look younger, never refuse a timely one.

use std::sync::OnceLock;
use std::time::Instant;

/// How fast two monotonic clocks may drift apart that the service still tolerates: 100 parts
/// per million, far beyond what NTP-disciplined hosts show.
pub const DRIFT_ALLOWANCE: u64 = 10_000;

/// Milliseconds on this process's monotonic clock (from its first use).
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// What the service keeps of one client's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerClock {
    /// The least (our clock at reading - theirs at sending) seen, and our clock then.
    least: Option<(i64, u64)>,
}

impl PeerClock {
    /// A call sent at `sent` (their clock) and read at `read` (ours): how many milliseconds
    /// longer it took than the quickest call of the session.
    pub fn age(&mut self, sent: u64, read: u64) -> u64 {
        let skew = read as i64 - sent as i64;
        let floor = self.least.map(|(least, seen)| {
            least.saturating_add((read.saturating_sub(seen) / DRIFT_ALLOWANCE) as i64)
        });
        match floor {
            Some(f) if skew > f => (skew - f) as u64,
            _ => {
                self.least = Some((skew, read));
                0
            }
        }
    }
}

/// Whether a call `age` ms old with `budget` ms left at sending is too late to apply: past
/// nine tenths of its budget, so that the reply can still reach the caller in time.
pub fn too_late(age: u64, budget: u64) -> bool {
    age > budget - budget / 10
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_read_late_is_old_whatever_the_clock_offset() {
        for offset in [-1_000_000i64, 0, 123_456_789] {
            let mut c = PeerClock::default();
            let theirs = |ours: u64| (ours as i64 - offset) as u64;
            // Calls that took 1-3 ms: the quickest sets the floor.
            assert_eq!(c.age(theirs(1_000) - 2, 1_000), 0);
            assert_eq!(c.age(theirs(2_000) - 1, 2_000), 0);
            assert_eq!(c.age(theirs(3_000) - 3, 3_000), 2);
            // Sent at 4 s, read at 49 s (the service was stopped): 45 s old.
            let age = c.age(theirs(4_000), 49_000);
            assert!((44_990..=45_000).contains(&age), "{age}");
            assert!(too_late(age, 10_000));
            assert!(!too_late(2, 10_000));
        }
    }

    #[test]
    fn drift_never_makes_a_timely_call_old() {
        let mut c = PeerClock::default();
        // Their clock runs 50 ppm slower: each call seems 50 us per second later than the last.
        for s in 0..100_000u64 {
            let ours = s * 1_000;
            let theirs = ours - ours / 20_000;
            assert!(c.age(theirs, ours + 1) <= 1, "at {s} s");
        }
    }
}
