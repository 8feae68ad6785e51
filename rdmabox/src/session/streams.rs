//! Streams: small requests that continue one just on the wire wait a little, to merge.
//!
//! The merge queue merges what stacks up in it (the paper's §IV-A), and requests stack up only
//! while the admission window holds them back. A reader that keeps many small sequential
//! requests in flight, and submits the next as each completes, finds nothing queued to merge
//! with: each request goes out alone, well inside the window. So while [`STREAM_WINDOW`] bytes
//! are in flight, a small request that continues a deep stream stays queued, the stream's later
//! requests queue behind it, and the run goes out as one work request at a later drain (each
//! completion drains). A request continues a deep stream when it starts where a held request
//! ends, or where a recently posted work request ended that merged several requests, is still
//! in flight, or has more of the stream queued behind it. A reader with one request at a
//! time posts single work requests, each done before the next comes: it never waits. Nothing
//! waits past [`HOLD_MAX_AGE`], however busy the session is with others; random requests and
//! large ones go out at once, as before.
//!
//! 4K sequential reads through the ring (tcp, loopback), each variant against the build before
//! it in one run. Every small request held back by a 64 KiB window: 0.14 work requests per
//! request and 1.6x the reads a second at depth 64, but random reads lost 19-39%. Waiting only
//! while the stream's own newest work request (or 32-64 KiB of it) was in flight left streams
//! with little in flight at each turn: 0.85-0.9x at 16 and 32 in flight. Holding whatever
//! continued a recent work request merged well everywhere, but held a reader with one request
//! at a time for as long as other traffic kept the session busy.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use crate::transport::RemoteAddr;

/// In-flight bytes (the session's) from which a stream's small requests wait to merge.
pub(super) const STREAM_WINDOW: u64 = 64 << 10;
/// Requests up to this size may be held back; larger ones gain little from merging.
pub(super) const HOLD_MAX_LEN: usize = 16 << 10;
/// The longest a request is held back from its submission.
pub(super) const HOLD_MAX_AGE: Duration = Duration::from_micros(200);
/// Ends of work requests remembered: streams that can be told apart at once.
const TRACKED: usize = 16;

/// Where recently posted work requests of one direction end, how many requests each merged,
/// and whether it is still in flight. Plain atomics, no lock on the hot path: a reader may see
/// a slot half rewritten, which at worst holds back, or lets go, one request that the rule
/// would have decided otherwise.
#[derive(Default)]
pub(super) struct Streams {
    /// Each slot's key (high 32 bits), in-flight flag ([`IN_FLIGHT`]) and requests merged.
    keys: [AtomicU64; TRACKED],
    ends: [AtomicU64; TRACKED],
    next: AtomicUsize,
}

const IN_FLIGHT: u64 = 1 << 31;
const REQUESTS: u64 = IN_FLIGHT - 1;

/// What is known of the work request a request continues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Predecessor {
    pub(super) merged: u64,
    pub(super) in_flight: bool,
}

impl Streams {
    /// A work request to `rkey` ending at `end`, of `requests` merged, went out.
    pub(super) fn posted(&self, rkey: u32, end: u64, requests: usize) {
        let i = self.next.fetch_add(1, Relaxed) % TRACKED;
        let requests = (requests as u64).min(REQUESTS);
        self.ends[i].store(end, Relaxed);
        self.keys[i].store(u64::from(rkey) << 32 | IN_FLIGHT | requests, Relaxed);
    }

    /// The work request to `rkey` ending at `end` completed.
    pub(super) fn completed(&self, rkey: u32, end: u64) {
        for i in 0..TRACKED {
            if self.ends[i].load(Relaxed) == end
                && (self.keys[i].load(Relaxed) >> 32) as u32 == rkey
            {
                self.keys[i].fetch_and(!IN_FLIGHT, Relaxed);
            }
        }
    }

    /// The recently posted work request that ended where `remote` starts, if one did.
    pub(super) fn continues(&self, remote: RemoteAddr) -> Option<Predecessor> {
        (0..TRACKED).find_map(|i| {
            if self.ends[i].load(Relaxed) != remote.addr {
                return None;
            }
            let key = self.keys[i].load(Relaxed);
            let merged = key & REQUESTS;
            ((key >> 32) as u32 == remote.rkey && merged > 0).then_some(Predecessor {
                merged,
                in_flight: key & IN_FLIGHT != 0,
            })
        })
    }
}

/// What one pass over the queue held back: where each request starts and ends.
#[derive(Default)]
pub(super) struct Held {
    starts: HashSet<(u32, u64)>,
    ends: HashSet<(u32, u64)>,
}

impl Held {
    pub(super) fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    pub(super) fn push(&mut self, remote: RemoteAddr, len: usize) {
        self.starts.insert((remote.rkey, remote.addr));
        self.ends.insert((remote.rkey, remote.addr + len as u64));
    }

    /// Whether a request at `remote` was held.
    pub(super) fn has(&self, remote: RemoteAddr) -> bool {
        self.starts.contains(&(remote.rkey, remote.addr))
    }

    /// Whether a request at `remote` starts where a held one ends.
    pub(super) fn continued_by(&self, remote: RemoteAddr) -> bool {
        self.ends.contains(&(remote.rkey, remote.addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(rkey: u32, addr: u64) -> RemoteAddr {
        RemoteAddr { addr, rkey }
    }

    #[test]
    fn a_request_continues_what_was_posted_lately() {
        let s = Streams::default();
        assert_eq!(s.continues(at(1, 0)), None, "nothing posted yet");
        s.posted(1, 4096, 3);
        let p = |merged, in_flight| Some(Predecessor { merged, in_flight });
        assert_eq!(s.continues(at(1, 4096)), p(3, true));
        assert_eq!(
            s.continues(at(2, 4096)),
            None,
            "another key, another region"
        );
        assert_eq!(s.continues(at(1, 8192)), None);
        s.completed(2, 4096);
        assert_eq!(
            s.continues(at(1, 4096)),
            p(3, true),
            "another key's completion"
        );
        s.completed(1, 4096);
        assert_eq!(s.continues(at(1, 4096)), p(3, false));
        for i in 0..TRACKED as u64 {
            s.posted(3, i, 1);
        }
        assert_eq!(
            s.continues(at(1, 4096)),
            None,
            "forgotten after enough others"
        );
    }

    #[test]
    fn held_requests_are_continued_by_the_rest_of_their_stream() {
        let mut h = Held::default();
        h.push(at(1, 4096), 4096);
        assert!(h.continued_by(at(1, 8192)));
        assert!(!h.continued_by(at(1, 4096)));
        assert!(
            !h.continued_by(at(2, 8192)),
            "another key is another region"
        );
        assert!(h.has(at(1, 4096)));
        assert!(!h.has(at(1, 8192)));
    }
}
