//! Closes sent together. A handle's release goes to the metadata node within [`LINGER`], in
//! one call (`ReleaseMany`) with the other closes of that time, from a thread of its own: the
//! kernel does not wait for a release, and a program that creates many files then costs one
//! metadata call per file instead of two. What the node must hear before a close returns (the
//! file's size and mtime, with its writes landed) is still committed by the close itself.
//!
//! Only closes that change nothing but the node's count of handles wait here: a file we had
//! chunks allocated for while it was open here is closed at once, alone, as its close may give
//! back chunks allocated ahead past its size, which the holders of its map (we too) must hear
//! of then (else our page cache is dropped at the next open, and others see the old map).
//!
//! A close waiting here is no longer among the handles a restarted metadata node is told of,
//! and the node skips a close of a handle it does not know, as it fails a lone one.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rfs_proto::message::ReleaseMany;
use rfs_proto::types::Ino;
use rfs_proto::wire::MAX_LIST;

use super::backend::Backend;
use super::stats::ClientStats;
use super::Rfs;

/// How long a close waits for others to go with it.
pub(crate) const LINGER: Duration = Duration::from_millis(2);

enum Close {
    /// A handle of (inode, access) to give back.
    Handle(Ino, u8),
    /// Send what waits now, and say so.
    Flush(Sender<()>),
}

/// The closes not sent yet, and the thread that sends them (started with the first close).
#[derive(Default)]
pub(crate) struct Closes {
    queue: OnceLock<Sender<Close>>,
    /// Serializes starting the thread.
    starting: Mutex<()>,
}

impl<B: Backend> Rfs<B> {
    /// Gives a handle of `ino` taken for `access` back to the metadata node, soon.
    pub(crate) fn close_later(self: &Arc<Self>, ino: Ino, access: u8) {
        let _ = self.closes_queue().send(Close::Handle(ino, access));
    }

    /// Sends every close made so far and waits for the answer (at unmount, and for tests).
    pub fn closes_sent(self: &Arc<Self>) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.closes_queue().send(Close::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    fn closes_queue(self: &Arc<Self>) -> &Sender<Close> {
        if let Some(q) = self.closes.queue.get() {
            return q;
        }
        let _one = self.closes.starting.lock().unwrap();
        self.closes.queue.get_or_init(|| {
            let (tx, rx) = crossbeam_channel::unbounded();
            let fs = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name("rfs-closes".into())
                .spawn(move || send_closes(fs, rx));
            if let Err(e) = spawned {
                // Closes then pile up unsent: the node takes them back when the session ends.
                log::error!("cannot start the thread that sends closes: {e}");
            }
            tx
        })
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
            next = match queue.recv_deadline(until) {
                Ok(close) => Some(close),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => None,
            };
        }
        let Some(fs) = fs.upgrade() else { return };
        if !batch.is_empty() {
            let handles = std::mem::take(&mut batch);
            let n = handles.len();
            match fs.call(ReleaseMany { handles }) {
                // Fewer: handles of a metadata node that restarted since.
                Ok(closed) if (closed as usize) < n => {
                    log::debug!(
                        "{} of {n} closes were of unknown handles",
                        n - closed as usize
                    )
                }
                Ok(_) => {}
                // The session's handles go with it.
                Err(e) => log::debug!("{n} closes not sent: {e}"),
            }
            ClientStats::add(&fs.stats.handles_closed, n as u64);
        }
        for done in flushed.drain(..) {
            let _ = done.send(());
        }
    }
}
