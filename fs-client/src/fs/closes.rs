//! Closes sent together. A handle's release goes to the metadata node about [`LINGER`] later, in
//! one call (`ReleaseMany`) with the other closes of that time, from a thread of its own: the
//! kernel does not wait for a release, and a program that creates many files then costs one
//! metadata call per file instead of two. What the node must hear before a close returns (the
//! file's size and mtime, with its writes landed) is still committed by the close itself.
//!
//! A file we had chunks allocated for while it was open here is closed before the close
//! returns, together with the closes waiting (which may be of the same file), as its last
//! close may give back chunks allocated ahead past its size, which the holders of its map (we
//! too) must hear of then (else our page cache is dropped at the next open, and others see the
//! old map late).
//!
//! A close is listed with the open handles until the node answered it: a metadata node that
//! restarts meanwhile takes it again with them, and the close, resent to it, closes that one
//! and not another handle of the same file.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use rfs_proto::message::{Release, ReleaseMany};
use rfs_proto::types::{FileAccess, Ino};
use rfs_proto::wire::MAX_LIST;

use super::backend::Backend;
use super::error::Result;
use super::stats::ClientStats;
use super::Rfs;

/// How long a close waits for others to go with it.
pub(crate) const LINGER: Duration = Duration::from_millis(2);

enum Close {
    /// A handle of (inode, access) to give back.
    Handle(Ino, FileAccess),
    /// Send what waits now, and say so.
    Flush(Sender<()>),
}

/// The closes not answered yet, and the thread that sends them (started with the first close).
#[derive(Default)]
pub(crate) struct Closes {
    /// None: the thread could not start, and closes go one by one.
    queue: OnceLock<Option<Sender<Close>>>,
    /// Handles closed here and not yet given back, as (inode, access): a metadata node that
    /// restarts meanwhile is told of them with the open ones, so that the close, resent to
    /// it, closes them and not another handle of the same file.
    unanswered: Mutex<Vec<(Ino, FileAccess)>>,
}

impl Closes {
    /// `f` of the handles closed and not given back yet, with their list held.
    pub(crate) fn with_unanswered<R>(&self, f: impl FnOnce(&[(Ino, FileAccess)]) -> R) -> R {
        f(&self.unanswered.lock().unwrap())
    }

    /// Runs `take`, which takes a handle out of another list (None: it was not there), with
    /// the closes' list held, so that nobody sees the handle in neither list or in both; then
    /// lists it here as a close, if it was taken, and says whether it was.
    pub(crate) fn listed(&self, take: impl FnOnce() -> Option<(Ino, FileAccess)>) -> bool {
        let mut waiting = self.unanswered.lock().unwrap();
        match take() {
            Some(h) => {
                waiting.push(h);
                true
            }
            None => false,
        }
    }

    fn answered(&self, handles: &[(Ino, FileAccess)]) {
        let mut waiting = self.unanswered.lock().unwrap();
        for h in handles {
            if let Some(i) = waiting.iter().position(|w| w == h) {
                waiting.swap_remove(i);
            }
        }
    }
}

impl<B: Backend> Rfs<B> {
    /// Gives a handle of `ino` taken for `access`, already listed as a close (see
    /// [`Closes::listed`]), back to the metadata node: soon, together with other closes, or
    /// (`now`) before returning, with every close made before it.
    pub(crate) fn close_listed_handle(
        self: &Arc<Self>,
        ino: Ino,
        access: FileAccess,
        now: bool,
    ) -> Result<()> {
        let Some(queue) = self.closes_queue() else {
            let released = self.call(Release { ino, access });
            self.closes.answered(&[(ino, access)]);
            if released.is_ok() {
                ClientStats::add(&self.stats.handles_closed, 1);
            }
            return released;
        };
        let _ = queue.send(Close::Handle(ino, access));
        if now {
            self.closes_sent();
        }
        Ok(())
    }

    /// Sends every close made so far and waits for the answer (at unmount, and for tests).
    pub fn closes_sent(self: &Arc<Self>) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if let Some(queue) = self.closes_queue() {
            if queue.send(Close::Flush(tx)).is_ok() {
                let _ = rx.recv();
            }
        }
    }

    fn closes_queue(self: &Arc<Self>) -> Option<&Sender<Close>> {
        self.closes
            .queue
            .get_or_init(|| {
                let (tx, rx) = crossbeam_channel::unbounded();
                let fs = Arc::downgrade(self);
                let spawned = std::thread::Builder::new()
                    .name("rfs-closes".into())
                    .spawn(move || send_closes(fs, rx));
                match spawned {
                    Ok(_) => Some(tx),
                    Err(e) => {
                        log::warn!("no thread to send closes together ({e}): one call each");
                        None
                    }
                }
            })
            .as_ref()
    }
}

/// Sends closes in batches until the file system is gone.
fn send_closes<B: Backend>(fs: Weak<Rfs<B>>, queue: Receiver<Close>) {
    let mut batch = Vec::new();
    let mut flushed = Vec::new();
    while let Ok(first) = queue.recv() {
        let until = Instant::now() + LINGER;
        let mut next = Some(first);
        while let Some(close) = next.take() {
            match close {
                Close::Handle(ino, access) => batch.push((ino, access)),
                Close::Flush(done) => flushed.push(done),
            }
            if batch.len() == MAX_LIST as usize || !flushed.is_empty() {
                break;
            }
            next = queue.recv_deadline(until).ok();
        }
        let Some(fs) = fs.upgrade() else { return };
        if !batch.is_empty() {
            give_back(&fs, &batch);
            batch.clear();
        }
        for done in flushed.drain(..) {
            let _ = done.send(());
        }
    }
}

/// One call for a batch of closes. A call already rides out reconnections within its
/// deadline, so a batch that fails is left to the end of the session, which releases every
/// handle it holds (and a node that restarted took them again: see [`Closes`]).
fn give_back<B: Backend>(fs: &Rfs<B>, batch: &[(Ino, FileAccess)]) {
    let n = batch.len();
    match fs.call(ReleaseMany {
        handles: batch.to_vec(),
    }) {
        Ok(closed) => {
            if (closed as usize) < n {
                log::debug!(
                    "{} of {n} closes were of handles the node did not hold",
                    n - closed as usize
                );
            }
            ClientStats::add(&fs.stats.handles_closed, n as u64);
        }
        Err(e) => log::warn!(
            "{n} closes not given back ({e}): the node keeps them until this session ends"
        ),
    }
    fs.closes.answered(batch);
}
