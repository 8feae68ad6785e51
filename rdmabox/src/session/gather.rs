//! Gathered reads: several remote ranges read side by side into one staging slot and lent to
//! one callback as one run of bytes. A FUSE read that crosses a chunk boundary is two ranges,
//! in two chunks that are rarely next to each other in the node's memory; gathered, its reply
//! is written from the slot, and the caller zeroes and copies into no buffer of its own.
//!
//! Each range is a request of its own (work requests are per remote range), whose bytes land
//! at its place in the gather's slot; the last one to finish answers for all.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::mr_pool::Slot;

use super::{BorrowingCallback, IoError};

/// Where a gathered read's bytes come together.
pub(super) enum Store {
    /// A staging slot, which the pieces land in.
    Slot(Slot),
    /// A buffer of its own, which the pieces are copied into (no slot was free, or the whole
    /// is larger than one).
    Copied(Mutex<Vec<u8>>),
}

/// One gathered read: its store, the pieces still under way, the first failure, and who gets
/// the bytes.
pub(super) struct Gather {
    store: Store,
    len: usize,
    left: AtomicUsize,
    failure: Mutex<Option<IoError>>,
    done: Mutex<Option<BorrowingCallback>>,
}

impl Gather {
    /// A gather of `pieces` ranges, `len` bytes in all, into `store`.
    pub(super) fn new(store: Store, len: usize, pieces: usize, done: BorrowingCallback) -> Gather {
        Gather {
            store,
            len,
            left: AtomicUsize::new(pieces),
            failure: Mutex::new(None),
            done: Mutex::new(Some(done)),
        }
    }

    /// Where the piece at `at` lands in the pool region (a slot store only).
    pub(super) fn pool_offset(&self, at: usize) -> Option<usize> {
        match &self.store {
            Store::Slot(slot) => Some(slot.offset() + at),
            Store::Copied(_) => None,
        }
    }

    /// Copies a piece's bytes to its place (a copied store only).
    pub(super) fn copy_in(&self, at: usize, bytes: &[u8]) {
        if let Store::Copied(buf) = &self.store {
            buf.lock().unwrap()[at..at + bytes.len()].copy_from_slice(bytes);
        }
    }

    /// A piece is over: landed (`None`) or failed. The last one answers, with the first
    /// failure or the whole run of bytes.
    pub(super) fn piece_done(&self, failure: Option<IoError>) {
        if let Some(e) = failure {
            self.failure.lock().unwrap().get_or_insert(e);
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let done = self.done.lock().unwrap().take().expect("answered once");
        let failure = self.failure.lock().unwrap().take();
        if let Some(e) = failure {
            return done(Err(e));
        }
        match &self.store {
            // SAFETY: the slot is this gather's alone, and every piece's transfer into it is
            // over (each piece was answered after its work request completed), so nothing
            // writes these bytes during the call.
            Store::Slot(slot) => done(Ok(unsafe { slot.bytes(0, self.len) })),
            Store::Copied(buf) => done(Ok(&buf.lock().unwrap())),
        }
    }
}
