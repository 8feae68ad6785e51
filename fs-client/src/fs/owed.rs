//! Commits owed. A close whose commit failed for a fault (the metadata node unreachable, or
//! silent past the call's deadline) reports EIO, as NFS does, but loses nothing: without a
//! later commit the node would keep the file's old size, and every other client would see the
//! file cut short of bytes that are in remote memory. So the handle is not given back (the node
//! refuses a commit through no handle), it stays listed with the open ones (a metadata node
//! that restarts takes it again), and the commit is made again from a thread of its own: at
//! once when the metadata connection comes back, else after a pause doubling from
//! [`FIRST_PAUSE`] to [`LAST_PAUSE`]. Once it goes through, the handle goes back. A commit the
//! node answers with an error of the file system's (the file is gone) is not made again. One
//! made over a cut made elsewhere meanwhile, whose callback was lost with the connection, the
//! node refuses, and the cut holds (see `Rfs::commit_size`). At unmount each is tried once
//! more, and what still fails is logged.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rfs_daemon::backoff::Backoff;
use rfs_proto::types::{FileAccess, Ino};
use rfs_proto::Errno;

use super::backend::Backend;
use super::error::{Error, Result};
use super::stats::ClientStats;
use super::Rfs;

/// The pause before the first retry of a commit that did not reach the node.
const FIRST_PAUSE: Duration = Duration::from_millis(250);
/// The longest pause between retries.
const LAST_PAUSE: Duration = Duration::from_secs(4);

/// A closed handle whose commit the metadata node has not had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OwedClose {
    ino: Ino,
    access: FileAccess,
    /// Chunks were allocated for the file while it was open here (see `closes`).
    allocated: bool,
}

/// What wakes the retrying thread.
enum Wake {
    /// A commit is owed: retry after the first pause, unless a retry is due already.
    Owed,
    /// The metadata connection is back: retry now.
    Now,
}

#[derive(Default)]
pub(crate) struct Owed {
    closes: Mutex<Vec<OwedClose>>,
    /// One round of retries at a time: two would give one handle back twice.
    round: Mutex<()>,
    /// Wakes the retrying thread (started with the first commit owed); None: it could not
    /// start, and the commits wait for the unmount.
    wake: OnceLock<Option<Sender<Wake>>>,
}

impl Owed {
    /// The handles kept for a commit, as (inode, access).
    pub(crate) fn handles(&self) -> Vec<(Ino, FileAccess)> {
        let owed = self.closes.lock().unwrap();
        owed.iter().map(|c| (c.ino, c.access)).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.closes.lock().unwrap().len()
    }

    fn wake(&self, why: Wake) {
        if let Some(Some(wake)) = self.wake.get() {
            let _ = wake.send(why);
        }
    }
}

impl<B: Backend> Rfs<B> {
    /// Keeps a closed handle of `ino` until the commit that failed goes through. Called with
    /// the handles' lock held, so that the handle is listed either open or owed throughout.
    pub(crate) fn owe_commit(self: &Arc<Self>, ino: Ino, access: FileAccess, allocated: bool) {
        self.owed.closes.lock().unwrap().push(OwedClose {
            ino,
            access,
            allocated,
        });
        log::warn!("inode {ino}: its size will be committed once the metadata node answers");
        self.owed.wake.get_or_init(|| {
            let (tx, rx) = crossbeam_channel::unbounded();
            let fs = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name("rfs-owed".into())
                .spawn(move || retry_owed(fs, rx));
            match spawned {
                Ok(_) => Some(tx),
                Err(e) => {
                    log::warn!(
                        "no thread to commit again ({e}): owed commits wait for the unmount"
                    );
                    None
                }
            }
        });
        self.owed.wake(Wake::Owed);
    }

    /// Retries the commits owed now (the metadata connection is back).
    pub(crate) fn retry_owed_now(&self) {
        self.owed.wake(Wake::Now);
    }

    /// Tries every commit owed once more, and logs those that still fail (at unmount).
    pub fn commits_owed_sent(self: &Arc<Self>) {
        if self.commit_owed() > 0 {
            for c in self.owed.closes.lock().unwrap().iter() {
                log::error!(
                    "inode {}: the metadata node did not take its size and mtime; other \
                     clients may see the file shorter than written",
                    c.ino
                );
            }
        }
    }

    /// Commits each owed file and gives its handle back; returns how many are still owed.
    /// A round ends at the first commit that must wait: the others wait for the same node.
    fn commit_owed(self: &Arc<Self>) -> usize {
        let _round = self.owed.round.lock().unwrap();
        let owed = self.owed.closes.lock().unwrap().clone();
        for c in owed {
            match self.commit_owed_file(c.ino) {
                Ok(true) => ClientStats::add(&self.stats.commits_resent, 1),
                Ok(false) => {}
                Err(e) if worth_retrying(&e) => break,
                Err(e) => {
                    log::warn!("inode {}: commit not taken ({e}); given up", c.ino);
                    self.uncommitted_dropped(c.ino);
                }
            }
            // From owed to closing at once: a node that restarts meanwhile is told of the
            // handle exactly once.
            let listed = self.closes.listed(|| {
                let mut owed = self.owed.closes.lock().unwrap();
                let at = owed.iter().position(|o| *o == c)?;
                owed.remove(at);
                Some((c.ino, c.access))
            });
            if !listed {
                continue;
            }
            if let Err(e) = self.close_listed_handle(c.ino, c.access, c.allocated) {
                log::warn!("inode {}: handle not given back ({e})", c.ino);
            }
        }
        self.owed.len()
    }

    /// Makes the commit owed of `ino`, if it still is: whether one was sent.
    fn commit_owed_file(&self, ino: Ino) -> Result<bool> {
        if !self
            .open
            .lock()
            .unwrap()
            .get(&ino)
            .is_some_and(|f| f.is_dirty())
        {
            return Ok(false);
        }
        self.commit_size(ino).map(|()| true)
    }
}

/// Whether a commit that failed may go through when made again: a fault (the node unreachable
/// or silent), or EIO from the node itself, its answer to a call that reached it too late to
/// be applied (or that it could not make durable).
pub(crate) fn worth_retrying(e: &Error) -> bool {
    e.is_fault() || e.errno() == Errno::EIO
}

/// Retries owed commits until none is owed, pausing longer after each round that left some,
/// then sleeps until the next; ends with the file system.
fn retry_owed<B: Backend>(fs: Weak<Rfs<B>>, wake: Receiver<Wake>) {
    let mut due: Option<Instant> = None;
    let mut backoff = Backoff::new(FIRST_PAUSE, LAST_PAUSE);
    loop {
        let woken = match due {
            Some(at) => wake.recv_deadline(at),
            None => wake.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match woken {
            Ok(Wake::Owed) => {
                if due.is_none() {
                    backoff.reset();
                    due = Some(Instant::now() + backoff.peek());
                }
                continue;
            }
            Ok(Wake::Now) => backoff.reset(),
            Err(RecvTimeoutError::Timeout) => drop(backoff.next_pause()),
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let Some(fs) = fs.upgrade() else { return };
        due = (fs.commit_owed() > 0).then(|| Instant::now() + backoff.peek());
    }
}
