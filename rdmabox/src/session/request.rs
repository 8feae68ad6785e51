//! The request model: what a session keeps for one request from submission to its callback,
//! and for one work request while it is on the wire. Submission builds these and completion
//! takes them apart; keeping them apart from both lets each side read as one concern.

use std::sync::Arc;
use std::time::Instant;

use slab::Slab;

use crate::mr_pool::Slot;
use crate::transport::{MemoryRegion, RemoteAddr};

use super::gather::Gather;
use super::{BorrowingCallback, Callback, IoError, KeepingCallback, LandedCallback};

/// The direction of a request; indexes the session's two merge queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    Read = 0,
    Write = 1,
}

/// The caller's buffer: as handed in (to be staged through the preMR pool), registered for
/// the transfer itself (dynMR: the caller's vector, or the caller's memory a read lands in),
/// or a piece of a gathered read's slot, at this offset of the pool region.
pub(super) enum Buffer {
    Plain(Vec<u8>),
    Registered(Arc<MemoryRegion>),
    Gathered { pool_offset: usize },
}

impl Buffer {
    /// The caller's vector again (a copy only if a provider still holds the registration).
    pub(super) fn into_vec(self) -> Vec<u8> {
        match self {
            Buffer::Plain(v) => v,
            Buffer::Registered(mr) => match Arc::try_unwrap(mr) {
                Ok(mr) => mr.into_vec().unwrap_or_else(|mr| mr.to_vec()),
                // The poster still holds its clone for an instant: copy rather than wait.
                Err(mr) => mr.to_vec(),
            },
            Buffer::Gathered { .. } => Vec::new(),
        }
    }
}

/// Who gets a request's result.
pub(super) enum Done {
    /// The buffer on success.
    Result(Callback),
    /// The buffer on success and on failure.
    Keeping(KeepingCallback),
    /// A read's bytes, borrowed where they landed (the request has no buffer when staged).
    Borrowing(BorrowingCallback),
    /// A piece of a gathered read, which answers once all its pieces are over.
    Gathered(Arc<Gather>),
    /// A read that landed in the caller's memory (its buffer is a registration of it).
    Landed(LandedCallback),
}

impl Done {
    pub(super) fn ok(self, buf: Buffer) {
        match self {
            Done::Result(done) => done(Ok(buf.into_vec())),
            Done::Keeping(done) => done(Ok(buf.into_vec())),
            Done::Borrowing(done) => done(Ok(&buf.into_vec())),
            Done::Gathered(g) => g.piece_done(None),
            Done::Landed(done) => done(Ok(())),
        }
    }

    pub(super) fn fail(self, e: IoError, buf: Buffer) {
        match self {
            Done::Result(done) => done(Err(e)),
            Done::Keeping(done) => done(Err((e, buf.into_vec()))),
            Done::Borrowing(done) => done(Err(e)),
            Done::Gathered(g) => g.piece_done(Some(e)),
            Done::Landed(done) => done(Err(e)),
        }
    }
}

/// One read or write as submitted: where, how much, the buffer (as long as `len`, or empty for
/// a staged [`Done::Borrowing`] read) and who gets the result.
pub(super) struct Request {
    pub(super) remote: RemoteAddr,
    pub(super) len: usize,
    pub(super) buf: Buffer,
    pub(super) done: Done,
}

/// Where a member of a work request is staged.
pub(super) enum Staging {
    /// At this offset of the work request's pool slot.
    Pool(usize),
    /// In its own registered buffer.
    Dynamic,
}

/// One posted work request: its member requests (several when merged), the staging slot they
/// share, and what it charged to the admission window.
pub(super) struct InflightWr {
    pub(super) dir: Dir,
    pub(super) members: Vec<(Request, Staging)>,
    pub(super) slot: Option<Slot>,
    /// Window charge of all members, returned on completion.
    pub(super) cost: u64,
    /// Payload bytes of all members.
    pub(super) bytes: u64,
    /// When it was posted, for the adaptive window's latency samples.
    pub(super) posted: Instant,
}

/// The work requests in flight on one queue pair, by wr_id, and their payload bytes.
#[derive(Default)]
pub(super) struct InFlight {
    wrs: Slab<InflightWr>,
    bytes: u64,
}

impl InFlight {
    /// Enters a work request; answers its wr_id.
    pub(super) fn insert(&mut self, w: InflightWr) -> usize {
        self.bytes += w.bytes;
        self.wrs.insert(w)
    }

    /// Takes the work request `key` out, if it is in.
    pub(super) fn try_remove(&mut self, key: usize) -> Option<InflightWr> {
        let w = self.wrs.try_remove(key)?;
        self.bytes -= w.bytes;
        Some(w)
    }

    /// Takes every work request out.
    pub(super) fn drain(&mut self) -> Vec<InflightWr> {
        self.bytes = 0;
        self.wrs.drain().collect()
    }

    pub(super) fn len(&self) -> usize {
        self.wrs.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    /// Payload bytes in flight.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// When the oldest was posted.
    pub(super) fn oldest(&self) -> Option<Instant> {
        self.wrs.iter().map(|(_, w)| w.posted).min()
    }
}
