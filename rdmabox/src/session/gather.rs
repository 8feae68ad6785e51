//! Gathered reads: several remote ranges read side by side into one staging slot and lent to
//! one callback as one run of bytes. A FUSE read that crosses a chunk boundary is two ranges,
//! in two chunks that are rarely next to each other in the node's memory; gathered, its reply
//! is written from the slot, and the caller zeroes and copies into no buffer of its own. A
//! lone read above the dynMR threshold goes the same way (a gather of one), so that it needs
//! no buffer allocated and registered for it.
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

    /// Copies a piece's bytes to its place (a copied store only).
    pub(super) fn copy_in(&self, at: usize, bytes: &[u8]) {
        if let Store::Copied(buf) = &self.store {
            buf.lock().unwrap()[at..at + bytes.len()].copy_from_slice(bytes);
        }
    }

    /// A piece is over: landed (`None`) or failed. The last one answers, with the whole run
    /// of bytes or the failure that says most: the first, unless it only says that the
    /// session is closed and a later one says why.
    pub(super) fn piece_done(&self, failure: Option<IoError>) {
        if let Some(e) = failure {
            let mut first = self.failure.lock().unwrap();
            if first.as_ref().is_none_or(|f| *f == IoError::Closed) {
                *first = Some(e);
            }
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// A gather of two pieces into a buffer of its own, and what its callback was given.
    fn gather() -> (Gather, mpsc::Receiver<Result<Vec<u8>, IoError>>) {
        let (tx, rx) = mpsc::channel();
        let store = Store::Copied(Mutex::new(vec![0; 4]));
        let done: BorrowingCallback = Box::new(move |r| drop(tx.send(r.map(<[u8]>::to_vec))));
        (Gather::new(store, 4, 2, done), rx)
    }

    #[test]
    fn the_last_piece_answers_once_with_every_piece_in_its_place() {
        let (g, rx) = gather();
        g.copy_in(2, b"cd");
        g.piece_done(None);
        assert!(rx.try_recv().is_err(), "one piece still under way");
        g.copy_in(0, b"ab");
        g.piece_done(None);
        assert_eq!(rx.try_recv().unwrap().unwrap(), b"abcd");
    }

    #[test]
    fn a_failure_that_says_why_wins_over_a_closed_session() {
        let (g, rx) = gather();
        g.piece_done(Some(IoError::Closed));
        g.piece_done(Some(IoError::TimedOut(Duration::from_secs(5))));
        assert_eq!(
            rx.try_recv().unwrap(),
            Err(IoError::TimedOut(Duration::from_secs(5)))
        );
        let (g, rx) = gather();
        let refused = IoError::OutOfBounds { addr: 1, len: 2 };
        g.piece_done(Some(refused.clone()));
        g.piece_done(Some(IoError::Closed));
        assert_eq!(
            rx.try_recv().unwrap(),
            Err(refused),
            "the first that says why"
        );
    }
}
