//! Live counters: the figures of the RDMABox paper's Table I and Figs. 2, 8 and 9, readable at
//! any time while the session runs.
//!
//! Each counter is a relaxed atomic, so the hot path pays one uncontended add per event. A
//! [`Snapshot`] reads each counter exactly; counters are read in dependency order (effects before
//! causes, e.g. completions before posts) so that derived figures never go negative.
//!
//! Every counter is declared once, in the `counters!` invocation below, which generates
//! [`Counters`], [`Snapshot`] and the snapshot, sum, difference and text forms.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// One counter of a [`Snapshot`], described.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Its name, as the stats text shows it.
    pub name: &'static str,
    /// What it counts (its doc comment).
    pub help: &'static str,
    /// An event count that only grows (else a level or a high-water mark).
    pub cumulative: bool,
    /// Its value in the snapshot.
    pub value: u64,
}

/// Generates the counter types from one list. Each entry is its doc, its name and how it
/// combines:
/// - `sum`: an event count; [`Snapshot::plus`] adds, [`Snapshot::since`] takes the growth;
/// - `gauge`: a level; `plus` adds, `since` keeps the later value;
/// - `peak`: a high-water mark; `plus` takes the larger, `since` keeps the later value.
///
/// Entries are in display order: the order of [`Snapshot`]'s fields and of its text lines.
/// `read order` names every counter once more, in the order [`Counters::snapshot`] loads them
/// (a counter left out or named twice does not compile).
macro_rules! counters {
    (@plus sum, $a:expr, $b:expr) => { $a + $b };
    (@plus gauge, $a:expr, $b:expr) => { $a + $b };
    (@plus peak, $a:expr, $b:expr) => { $a.max($b) };
    (@since sum, $now:expr, $then:expr) => { $now.saturating_sub($then) };
    (@since gauge, $now:expr, $then:expr) => { $now };
    (@since peak, $now:expr, $then:expr) => { $now };
    (@settled sum, $v:expr) => { $v };
    (@settled gauge, $v:expr) => { 0 };
    (@settled peak, $v:expr) => { $v };
    (@cumulative sum) => { true };
    (@cumulative gauge) => { false };
    (@cumulative peak) => { false };
    (
        $( $(#[doc = $doc:literal])+ $name:ident: $kind:ident, )+
        read order: $( $read:ident ),+ $(,)?
    ) => {
        /// A session's live counters: one relaxed atomic per [`Snapshot`] field.
        #[derive(Default)]
        pub struct Counters {
            $( $(#[doc = $doc])+ pub(crate) $name: AtomicU64, )+
        }

        /// A copy of every counter.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Snapshot {
            $( $(#[doc = $doc])+ pub $name: u64, )+
        }

        impl Counters {
            /// Reads every counter, effects before causes.
            pub fn snapshot(&self) -> Snapshot {
                // One statement per load, so they happen in `read order`.
                $( let $read = self.$read.load(Relaxed); )+
                Snapshot { $( $read, )+ }
            }
        }

        impl Snapshot {
            /// The sum of two sessions' counters (peaks: the larger).
            pub fn plus(&self, o: &Snapshot) -> Snapshot {
                Snapshot {
                    $( $name: counters!(@plus $kind, self.$name, o.$name), )+
                }
            }

            /// What a session that is gone leaves to a total of several: its counts and
            /// peaks, and no level (nothing of it is in flight any more).
            pub fn settled(&self) -> Snapshot {
                Snapshot {
                    $( $name: counters!(@settled $kind, self.$name), )+
                }
            }

            /// Counter growth from `earlier` to `self` (peaks and the in-flight gauge are kept
            /// as is).
            pub fn since(&self, earlier: &Snapshot) -> Snapshot {
                Snapshot {
                    $( $name: counters!(@since $kind, self.$name, earlier.$name), )+
                }
            }
        }

        impl Snapshot {
            /// Every counter with its name and doc, in display order: for metrics endpoints.
            pub fn fields(&self) -> Vec<Field> {
                vec![
                    $( Field {
                        name: stringify!($name),
                        help: concat!($($doc),+).trim_ascii(),
                        cumulative: counters!(@cumulative $kind),
                        value: self.$name,
                    }, )+
                ]
            }
        }

        impl fmt::Display for Snapshot {
            /// `name value` lines, for a stats file or command.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                $( writeln!(f, "{} {}", stringify!($name), self.$name)?; )+
                Ok(())
            }
        }
    };
}

counters! {
    /// Read and write requests submitted.
    requests: sum,
    /// Requests that went out merged with an adjacent one in a single work request.
    requests_merged: sum,
    /// Requests whose work request was chained behind another in one post call.
    requests_chained: sum,
    /// Requests that went out alone: one work request, one post call.
    requests_single: sum,
    /// Requests answered with an error, whether refused at submission or failed later.
    requests_failed: sum,
    /// RDMA work requests posted.
    work_requests: sum,
    /// Post calls (doorbells rung).
    doorbells: sum,
    /// Payload bytes of completed reads.
    bytes_read: sum,
    /// Payload bytes of completed writes.
    bytes_written: sum,
    /// Requests copied through a pre-registered buffer (writes into it, reads out of it; a
    /// read that borrows its bytes there is not copied).
    premr_copies: sum,
    /// Requests whose own buffer was registered.
    dynmr_registrations: sum,
    /// Bytes admitted by the window and not yet completed, in whole pages (a gauge).
    inflight_bytes: gauge,
    /// The most `inflight_bytes` has been.
    inflight_peak: peak,
    /// Times the admission window held a request back.
    window_stalls: sum,
    /// Times the pre-registered pool was empty.
    pool_stalls: sum,
    /// CQ polls that found nothing.
    polls_empty: sum,
    /// CQ polls that found at least one completion.
    polls_nonempty: sum,
    /// Work requests answered by the transport, flushed ones included.
    completions: sum,
    /// Poller sleeps ended by a CQ event rather than the timeout.
    event_wakeups: sum,
    /// Times a work request went unanswered past the session's deadline (breaking it).
    deadline_expiries: sum,
    /// Spins a poller cut short, sleeping on its CQ event, because another thread wanted
    /// the core (a yield ran it).
    spins_given_way: sum,
    /// Completions the transport's own thread handled while the poller slept (event polling
    /// on the tcp provider), with no wake-up.
    completed_inline: sum,
    /// Work requests sent to a queue pair that had some in flight already rather than to an
    /// idle one, whose threads would have had to wake (providers that serve queue pairs with
    /// threads: tcp).
    joined_busy: sum,
    /// Work requests the peer refused (a stale or revoked key): each failed alone and took its
    /// queue pair to the error state; the session went on over the others.
    transfers_refused: sum,
    /// Requests flushed off a queue pair a refusal took, sent again over another.
    requests_resent: sum,

    // Effects first: completions and byte counts, then what caused them.
    read order:
        completions,
        bytes_read,
        bytes_written,
        requests_failed,
        doorbells,
        work_requests,
        requests_merged,
        requests_chained,
        requests_single,
        requests,
        premr_copies,
        dynmr_registrations,
        inflight_bytes,
        inflight_peak,
        window_stalls,
        pool_stalls,
        polls_empty,
        polls_nonempty,
        event_wakeups,
        completed_inline,
        spins_given_way,
        deadline_expiries,
        joined_busy,
        transfers_refused,
        requests_resent,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub(crate) fn admit(&self, bytes: u64) {
        let now = self.inflight_bytes.fetch_add(bytes, Relaxed) + bytes;
        self.inflight_peak.fetch_max(now, Relaxed);
    }

    pub(crate) fn retire(&self, bytes: u64) {
        self.inflight_bytes.fetch_sub(bytes, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text names, in the order tools have always seen them.
    const NAMES: [&str; 25] = [
        "requests",
        "requests_merged",
        "requests_chained",
        "requests_single",
        "requests_failed",
        "work_requests",
        "doorbells",
        "bytes_read",
        "bytes_written",
        "premr_copies",
        "dynmr_registrations",
        "inflight_bytes",
        "inflight_peak",
        "window_stalls",
        "pool_stalls",
        "polls_empty",
        "polls_nonempty",
        "completions",
        "event_wakeups",
        "deadline_expiries",
        "spins_given_way",
        "completed_inline",
        "joined_busy",
        "transfers_refused",
        "requests_resent",
    ];

    /// Every counter set, each to a different value (1 to 25, in `NAMES` order). No
    /// `..Default::default()`: a new counter must be added here.
    fn distinct() -> Snapshot {
        Snapshot {
            requests: 1,
            requests_merged: 2,
            requests_chained: 3,
            requests_single: 4,
            requests_failed: 5,
            work_requests: 6,
            doorbells: 7,
            bytes_read: 8,
            bytes_written: 9,
            premr_copies: 10,
            dynmr_registrations: 11,
            inflight_bytes: 12,
            inflight_peak: 13,
            window_stalls: 14,
            pool_stalls: 15,
            polls_empty: 16,
            polls_nonempty: 17,
            completions: 18,
            event_wakeups: 19,
            deadline_expiries: 20,
            spins_given_way: 21,
            completed_inline: 22,
            joined_busy: 23,
            transfers_refused: 24,
            requests_resent: 25,
        }
    }

    /// The `name value` lines of a snapshot's text.
    fn rows(s: &Snapshot) -> Vec<(String, u64)> {
        s.to_string()
            .lines()
            .map(|l| {
                let (name, v) = l.split_once(' ').expect("name value");
                (name.to_string(), v.parse().expect("a number"))
            })
            .collect()
    }

    fn value(s: &Snapshot, name: &str) -> u64 {
        rows(s).into_iter().find(|(n, _)| n == name).unwrap().1
    }

    #[test]
    fn text_has_every_counter_once_by_name_in_the_usual_order() {
        let rows = rows(&distinct());
        let names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, NAMES);
        let values: Vec<u64> = rows.iter().map(|&(_, v)| v).collect();
        assert_eq!(
            values,
            (1..=25).collect::<Vec<_>>(),
            "each line its own counter"
        );
    }

    #[test]
    fn plus_and_since_combine_every_counter() {
        let a = distinct();
        let sum = a.plus(&a);
        let diff = sum.since(&a);
        for (i, name) in NAMES.iter().enumerate() {
            let v = i as u64 + 1;
            match *name {
                "inflight_peak" => {
                    assert_eq!(value(&sum, name), v, "peaks: the larger");
                    assert_eq!(value(&diff, name), v, "peaks: kept");
                }
                "inflight_bytes" => {
                    assert_eq!(value(&sum, name), 2 * v, "gauge: summed");
                    assert_eq!(value(&diff, name), 2 * v, "gauge: kept");
                }
                _ => {
                    assert_eq!(value(&sum, name), 2 * v, "{name}: summed");
                    assert_eq!(value(&diff, name), v, "{name}: growth");
                }
            }
        }
        assert_eq!(a.since(&sum).requests, 0, "growth saturates at zero");
        let settled = a.settled();
        for (i, name) in NAMES.iter().enumerate() {
            let kept = if *name == "inflight_bytes" {
                0
            } else {
                i as u64 + 1
            };
            assert_eq!(value(&settled, name), kept, "settled {name}");
        }
    }

    #[test]
    fn snapshot_reads_every_counter() {
        let want = distinct();
        let live = Counters {
            requests: AtomicU64::new(want.requests),
            requests_merged: AtomicU64::new(want.requests_merged),
            requests_chained: AtomicU64::new(want.requests_chained),
            requests_single: AtomicU64::new(want.requests_single),
            requests_failed: AtomicU64::new(want.requests_failed),
            work_requests: AtomicU64::new(want.work_requests),
            doorbells: AtomicU64::new(want.doorbells),
            bytes_read: AtomicU64::new(want.bytes_read),
            bytes_written: AtomicU64::new(want.bytes_written),
            premr_copies: AtomicU64::new(want.premr_copies),
            dynmr_registrations: AtomicU64::new(want.dynmr_registrations),
            inflight_bytes: AtomicU64::new(want.inflight_bytes),
            inflight_peak: AtomicU64::new(want.inflight_peak),
            window_stalls: AtomicU64::new(want.window_stalls),
            pool_stalls: AtomicU64::new(want.pool_stalls),
            polls_empty: AtomicU64::new(want.polls_empty),
            polls_nonempty: AtomicU64::new(want.polls_nonempty),
            completions: AtomicU64::new(want.completions),
            event_wakeups: AtomicU64::new(want.event_wakeups),
            deadline_expiries: AtomicU64::new(want.deadline_expiries),
            spins_given_way: AtomicU64::new(want.spins_given_way),
            completed_inline: AtomicU64::new(want.completed_inline),
            joined_busy: AtomicU64::new(want.joined_busy),
            transfers_refused: AtomicU64::new(want.transfers_refused),
            requests_resent: AtomicU64::new(want.requests_resent),
        };
        assert_eq!(live.snapshot(), want);
    }
}
