//! Live counters: the figures of the RDMABox paper's Table I and Figs. 2, 8 and 9, readable at
//! any time while the session runs.
//!
//! Each counter is a relaxed atomic, so the hot path pays one uncontended add per event. A
//! [`Snapshot`] reads each counter exactly; counters are read in dependency order (effects before
//! causes, e.g. completions before posts) so that derived figures never go negative.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Default)]
pub struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) requests_merged: AtomicU64,
    pub(crate) requests_chained: AtomicU64,
    pub(crate) requests_single: AtomicU64,
    pub(crate) requests_failed: AtomicU64,
    pub(crate) work_requests: AtomicU64,
    pub(crate) doorbells: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) premr_copies: AtomicU64,
    pub(crate) dynmr_registrations: AtomicU64,
    pub(crate) inflight_bytes: AtomicU64,
    pub(crate) inflight_peak: AtomicU64,
    pub(crate) window_stalls: AtomicU64,
    pub(crate) pool_stalls: AtomicU64,
    pub(crate) polls_empty: AtomicU64,
    pub(crate) polls_nonempty: AtomicU64,
    pub(crate) completions: AtomicU64,
    pub(crate) event_wakeups: AtomicU64,
}

/// A copy of every counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Read and write requests submitted.
    pub requests: u64,
    /// Requests that went out merged with an adjacent one in a single work request.
    pub requests_merged: u64,
    /// Requests whose work request was chained behind another in one post call.
    pub requests_chained: u64,
    /// Requests that went out alone: one work request, one post call.
    pub requests_single: u64,
    pub requests_failed: u64,
    /// RDMA work requests posted.
    pub work_requests: u64,
    /// Post calls (doorbells rung).
    pub doorbells: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests copied through a pre-registered buffer.
    pub premr_copies: u64,
    /// Requests whose own buffer was registered.
    pub dynmr_registrations: u64,
    pub inflight_bytes: u64,
    pub inflight_peak: u64,
    /// Times the admission window held a request back.
    pub window_stalls: u64,
    /// Times the pre-registered pool was empty.
    pub pool_stalls: u64,
    pub polls_empty: u64,
    pub polls_nonempty: u64,
    pub completions: u64,
    pub event_wakeups: u64,
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

    pub fn snapshot(&self) -> Snapshot {
        let r = |c: &AtomicU64| c.load(Relaxed);
        // Effects first: completions and byte counts, then what caused them.
        let completions = r(&self.completions);
        let bytes_read = r(&self.bytes_read);
        let bytes_written = r(&self.bytes_written);
        let requests_failed = r(&self.requests_failed);
        let doorbells = r(&self.doorbells);
        let work_requests = r(&self.work_requests);
        let requests_merged = r(&self.requests_merged);
        let requests_chained = r(&self.requests_chained);
        let requests_single = r(&self.requests_single);
        Snapshot {
            requests: r(&self.requests),
            requests_merged,
            requests_chained,
            requests_single,
            requests_failed,
            work_requests,
            doorbells,
            bytes_read,
            bytes_written,
            premr_copies: r(&self.premr_copies),
            dynmr_registrations: r(&self.dynmr_registrations),
            inflight_bytes: r(&self.inflight_bytes),
            inflight_peak: r(&self.inflight_peak),
            window_stalls: r(&self.window_stalls),
            pool_stalls: r(&self.pool_stalls),
            polls_empty: r(&self.polls_empty),
            polls_nonempty: r(&self.polls_nonempty),
            completions,
            event_wakeups: r(&self.event_wakeups),
        }
    }
}

impl Snapshot {
    /// The sum of two sessions' counters (peaks: the larger).
    pub fn plus(&self, o: &Snapshot) -> Snapshot {
        Snapshot {
            requests: self.requests + o.requests,
            requests_merged: self.requests_merged + o.requests_merged,
            requests_chained: self.requests_chained + o.requests_chained,
            requests_single: self.requests_single + o.requests_single,
            requests_failed: self.requests_failed + o.requests_failed,
            work_requests: self.work_requests + o.work_requests,
            doorbells: self.doorbells + o.doorbells,
            bytes_read: self.bytes_read + o.bytes_read,
            bytes_written: self.bytes_written + o.bytes_written,
            premr_copies: self.premr_copies + o.premr_copies,
            dynmr_registrations: self.dynmr_registrations + o.dynmr_registrations,
            inflight_bytes: self.inflight_bytes + o.inflight_bytes,
            inflight_peak: self.inflight_peak.max(o.inflight_peak),
            window_stalls: self.window_stalls + o.window_stalls,
            pool_stalls: self.pool_stalls + o.pool_stalls,
            polls_empty: self.polls_empty + o.polls_empty,
            polls_nonempty: self.polls_nonempty + o.polls_nonempty,
            completions: self.completions + o.completions,
            event_wakeups: self.event_wakeups + o.event_wakeups,
        }
    }

    /// Counter growth from `earlier` to `self` (peaks and the in-flight gauge are kept as is).
    pub fn since(&self, earlier: &Snapshot) -> Snapshot {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Snapshot {
            requests: d(self.requests, earlier.requests),
            requests_merged: d(self.requests_merged, earlier.requests_merged),
            requests_chained: d(self.requests_chained, earlier.requests_chained),
            requests_single: d(self.requests_single, earlier.requests_single),
            requests_failed: d(self.requests_failed, earlier.requests_failed),
            work_requests: d(self.work_requests, earlier.work_requests),
            doorbells: d(self.doorbells, earlier.doorbells),
            bytes_read: d(self.bytes_read, earlier.bytes_read),
            bytes_written: d(self.bytes_written, earlier.bytes_written),
            premr_copies: d(self.premr_copies, earlier.premr_copies),
            dynmr_registrations: d(self.dynmr_registrations, earlier.dynmr_registrations),
            inflight_bytes: self.inflight_bytes,
            inflight_peak: self.inflight_peak,
            window_stalls: d(self.window_stalls, earlier.window_stalls),
            pool_stalls: d(self.pool_stalls, earlier.pool_stalls),
            polls_empty: d(self.polls_empty, earlier.polls_empty),
            polls_nonempty: d(self.polls_nonempty, earlier.polls_nonempty),
            completions: d(self.completions, earlier.completions),
            event_wakeups: d(self.event_wakeups, earlier.event_wakeups),
        }
    }
}

impl fmt::Display for Snapshot {
    /// `name value` lines, for a stats file or command.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows = [
            ("requests", self.requests),
            ("requests_merged", self.requests_merged),
            ("requests_chained", self.requests_chained),
            ("requests_single", self.requests_single),
            ("requests_failed", self.requests_failed),
            ("work_requests", self.work_requests),
            ("doorbells", self.doorbells),
            ("bytes_read", self.bytes_read),
            ("bytes_written", self.bytes_written),
            ("premr_copies", self.premr_copies),
            ("dynmr_registrations", self.dynmr_registrations),
            ("inflight_bytes", self.inflight_bytes),
            ("inflight_peak", self.inflight_peak),
            ("window_stalls", self.window_stalls),
            ("pool_stalls", self.pool_stalls),
            ("polls_empty", self.polls_empty),
            ("polls_nonempty", self.polls_nonempty),
            ("completions", self.completions),
            ("event_wakeups", self.event_wakeups),
        ];
        for (name, v) in rows {
            writeln!(f, "{name} {v}")?;
        }
        Ok(())
    }
}
