//! File locks (fcntl's byte ranges; flock's, which the kernel sends as whole-file ones) held
//! at the metadata node, so that processes on two mounts exclude each other as they would on
//! one machine. What this mount holds is kept here too: a close drops locks at the node only
//! when its owner holds some (a close costs no call otherwise), and a metadata node that
//! restarts is given them again.
//!
//! Locks order data as they do on NFS: before a lock is let go (or shared), the file's writes
//! are committed, so whoever takes it next sees them (its cached pages and size are dropped by
//! the commit's callbacks before the commit is answered).
//!
//! A lock that must wait (F_SETLKW) waits on a thread of its own, not on a FUSE worker (the
//! unlock that would end the wait may need one): it asks again when the metadata node says a
//! lock of the file went, and with backoff (to keep its place in the node's queue, and in case
//! that word was lost). It ends with EINTR once the asking thread has a signal to take: the
//! kernel does not interrupt a request the file system holds, and a killed process would wait
//! for it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rfs_client::HeldLock;
use rfs_daemon::backoff::Backoff;
use rfs_proto::locks::{FileLock, LockKind, LockSet};
use rfs_proto::message::{CancelWait, DropLocks, GetLock, SetLock};
use rfs_proto::types::Ino;
use rfs_proto::{Errno, MetadataChannel};

use super::backend::Backend;
use super::error::{Error, Result};
use super::stats::ClientStats;
use super::Rfs;

/// Locks waited for at once, at most: each waits on a thread.
const MAX_WAITERS: usize = 1024;
/// How often a lock being waited for is asked again, at first and at most (the metadata node
/// keeps a waiter's place for a second).
const FIRST_ASK: Duration = Duration::from_millis(1);
const LAST_ASK: Duration = Duration::from_millis(100);
/// How often a lock is asked again while the metadata node's grace period after a restart
/// keeps new locks back (EAGAIN).
const GRACE_ASK: Duration = Duration::from_millis(100);

/// What this mount holds, by file.
#[derive(Default)]
pub(crate) struct Locks {
    files: Mutex<HashMap<Ino, FileLocks>>,
    /// The lock owners that took locks through each open handle: its last close drops them
    /// (a flock's, and an open file description's F_OFD locks, which the kernel never drops).
    by_handle: Mutex<HashMap<u64, HashSet<u64>>>,
    waiters: AtomicUsize,
    /// Counts the metadata node's words that a lock went (of any file): waiters ask again.
    freed: Mutex<u64>,
    freed_now: Condvar,
}

#[derive(Default)]
struct FileLocks {
    /// The locks the metadata node granted, by owner: taken again from a node that restarted.
    granted: LockSet<u64>,
    /// The owners that may hold locks at the node: counted before a call goes (it may be
    /// applied and its answer lost), and forgotten once they hold nothing for sure.
    asked: HashMap<u64, Asked>,
}

/// An owner's lock calls on a file.
#[derive(Default)]
struct Asked {
    begun: u64,
    ended: u64,
    /// A call of it failed: applied or not, nobody knows.
    unsure: bool,
}

impl FileLocks {
    /// Forgets `owner` if it holds nothing for sure: no call under way, none unsure, none
    /// granted.
    fn settle(&mut self, owner: u64) {
        let clear = self
            .asked
            .get(&owner)
            .is_some_and(|a| a.begun == a.ended && !a.unsure);
        if clear && !self.granted.holds(owner) {
            self.asked.remove(&owner);
        }
    }
}

impl Locks {
    fn with<T>(&self, ino: Ino, f: impl FnOnce(&mut FileLocks) -> T) -> T {
        let mut files = self.files.lock().unwrap();
        let file = files.entry(ino).or_default();
        let out = f(file);
        if file.asked.is_empty() && file.granted.is_empty() {
            files.remove(&ino);
        }
        out
    }

    /// A lock call of `owner` begins, through handle `fh`.
    fn asking(&self, ino: Ino, fh: u64, owner: u64) {
        self.with(ino, |f| f.asked.entry(owner).or_default().begun += 1);
        let mut by_handle = self.by_handle.lock().unwrap();
        by_handle.entry(fh).or_default().insert(owner);
    }

    /// Whether `owner` holds a write lock on `ino`, as far as the node told us.
    fn holds_write(&self, ino: Ino, owner: u64) -> bool {
        let files = self.files.lock().unwrap();
        files.get(&ino).is_some_and(|f| {
            f.granted
                .iter()
                .any(|&(o, l)| o == owner && l.kind == LockKind::Write)
        })
    }

    /// A lock call of `owner` ended: `granted` the lock it set, or failed (`None`: it was
    /// refused for a conflict, or the call failed, `unsure`).
    fn answered(&self, ino: Ino, owner: u64, granted: Option<FileLock>, unsure: bool) {
        self.with(ino, |f| {
            if let Some(a) = f.asked.get_mut(&owner) {
                a.ended += 1;
                a.unsure |= unsure;
            }
            if let Some(lock) = granted {
                f.granted.set(owner, lock);
            }
            f.settle(owner);
        });
    }

    /// How many lock calls `owner` began, if it may hold locks on `ino`.
    fn asked(&self, ino: Ino, owner: u64) -> Option<u64> {
        let files = self.files.lock().unwrap();
        files
            .get(&ino)
            .and_then(|f| f.asked.get(&owner).map(|a| a.begun))
    }

    /// The node dropped `owner`'s locks on `ino`; a lock call that began after the first
    /// `begun` may have been applied after the drop, and keeps it counted.
    fn dropped(&self, ino: Ino, owner: u64, begun: u64) {
        self.with(ino, |f| {
            f.granted.drop_owners(|o| o == owner);
            if f.asked.get(&owner).is_some_and(|a| a.begun == begun) {
                f.asked.remove(&owner);
            }
        });
    }

    /// The owners that took locks through handle `fh`, which closed.
    fn owners_of(&self, fh: u64) -> HashSet<u64> {
        self.by_handle
            .lock()
            .unwrap()
            .remove(&fh)
            .unwrap_or_default()
    }

    /// The metadata node says a lock of a file we wait for went.
    pub(crate) fn freed(&self) {
        *self.freed.lock().unwrap() += 1;
        self.freed_now.notify_all();
    }

    /// How many times the node said a lock went.
    fn freed_count(&self) -> u64 {
        *self.freed.lock().unwrap()
    }

    /// Waits up to `pause` for the node to say a lock went, after `seen` times.
    fn wait_freed(&self, seen: u64, pause: Duration) {
        let count = self.freed.lock().unwrap();
        let _ = self
            .freed_now
            .wait_timeout_while(count, pause, |c| *c == seen)
            .unwrap();
    }

    /// The mount's last handle of `ino` closed: the node drops every lock of ours on it.
    pub(crate) fn forget(&self, ino: Ino) {
        self.files.lock().unwrap().remove(&ino);
    }

    /// Every lock held, for a metadata node that lost them.
    pub(crate) fn list(&self) -> Vec<HeldLock> {
        let files = self.files.lock().unwrap();
        files
            .iter()
            .flat_map(|(&ino, f)| {
                f.granted
                    .iter()
                    .map(move |&(owner, lock)| (ino, owner, lock))
            })
            .collect()
    }

    /// The metadata node did not take these again: they are not ours any more.
    pub(crate) fn lost(&self, lost: &[HeldLock]) {
        for &(ino, owner, lock) in lost {
            self.with(ino, |f| {
                f.granted.set(
                    owner,
                    FileLock {
                        kind: LockKind::Unlock,
                        ..lock
                    },
                );
                f.settle(owner);
            });
        }
    }
}

/// Says whether a wait for a lock is still wanted (false: the process that asked is gone or
/// has a signal to take).
pub type StillWanted = Box<dyn Fn() -> bool + Send>;
/// Receives the end of a wait for a lock.
pub type LockDone = Box<dyn FnOnce(Result<()>) + Send>;

impl<B: Backend> Rfs<B> {
    /// Takes, changes or removes `lock` for `owner` on `ino`, through handle `fh`, without
    /// waiting for other owners: `None` once done, or a lock of another owner that conflicts.
    /// One that will `wait` takes its place in the node's queue. Before a lock is let go or
    /// shared (an unlock, a read lock by an owner holding a write lock), the file's writes are
    /// committed; a commit that fails leaves them for the writer's close or fsync to report,
    /// and the lock goes anyway.
    pub fn set_lock(
        &self,
        ino: Ino,
        fh: u64,
        owner: u64,
        lock: FileLock,
        wait: bool,
    ) -> Result<Option<FileLock>> {
        if lock.kind == LockKind::Unlock
            || (lock.kind == LockKind::Read && self.locks.holds_write(ino, owner))
        {
            if let Err(e) = self.commit_reporting(ino, false) {
                log::warn!("inode {ino}: writes not committed before a lock went: {e}");
            }
        }
        self.locks.asking(ino, fh, owner);
        let answer = self.through_grace(|| {
            self.meta().call(SetLock {
                ino,
                owner,
                lock,
                wait,
                reclaim: false,
            })
        });
        let granted = matches!(answer, Ok(None)).then_some(lock);
        self.locks.answered(ino, owner, granted, answer.is_err());
        if granted.is_some() {
            // What the holder reads under it must not come from a cache of before a loss.
            self.backend.reconnection_settled();
        }
        answer
    }

    /// A lock of another owner that would keep `owner` from taking `lock` on `ino`.
    pub fn get_lock(&self, ino: Ino, owner: u64, lock: FileLock) -> Result<Option<FileLock>> {
        self.through_grace(|| self.meta().call(GetLock { ino, owner, lock }))
    }

    /// A close by `owner` (a process's, of its fcntl locks): its locks on `ino` go, after the
    /// file's writes are committed. No call when it holds none.
    pub fn drop_locks(&self, ino: Ino, owner: u64) -> Result<()> {
        let Some(asked) = self.locks.asked(ino, owner) else {
            return Ok(());
        };
        if let Err(e) = self.commit_reporting(ino, false) {
            log::warn!("inode {ino}: writes not committed before its locks went: {e}");
        }
        self.meta().call(DropLocks { ino, owner })?;
        self.locks.dropped(ino, owner, asked);
        Ok(())
    }

    /// The last close of handle `fh` of `ino`: the locks taken through it by owners that are
    /// the open file itself (flock's, `flock_owner`; F_OFD locks) go. A process's fcntl locks
    /// went at its close (FLUSH) before.
    pub fn drop_handle_locks(&self, ino: Ino, fh: u64, flock_owner: Option<u64>) -> Result<()> {
        let mut owners = self.locks.owners_of(fh);
        owners.extend(flock_owner);
        owners
            .into_iter()
            .map(|owner| self.drop_locks(ino, owner))
            .fold(Ok(()), Result::and)
    }

    /// Takes `lock` once no other owner's lock conflicts, on a thread of its own: `done` gets
    /// the outcome, EINTR once `wanted` says the wait is not wanted any more.
    pub fn wait_lock(
        self: &Arc<Self>,
        ino: Ino,
        fh: u64,
        owner: u64,
        lock: FileLock,
        wanted: StillWanted,
        done: LockDone,
    ) {
        if self.locks.waiters.fetch_add(1, Ordering::AcqRel) >= MAX_WAITERS {
            self.locks.waiters.fetch_sub(1, Ordering::AcqRel);
            return done(Err(Error::new(
                Errno::ENOLCK,
                format!("{MAX_WAITERS} locks waited for already"),
            )));
        }
        ClientStats::add(&self.stats.lock_waits, 1);
        let fs = Arc::downgrade(self);
        let waiting = std::thread::Builder::new()
            .name("rfs-lockwait".into())
            .spawn(move || {
                let mut backoff = Backoff::new(FIRST_ASK, LAST_ASK);
                let outcome = loop {
                    let Some(fs) = fs.upgrade() else {
                        break Err(Errno::EINTR.into()); // unmounted
                    };
                    let seen = fs.locks.freed_count();
                    match fs.set_lock(ino, fh, owner, lock, true) {
                        // Not a fault: the process was interrupted, or killed.
                        Ok(Some(_)) if !wanted() => break Err(Errno::EINTR.into()),
                        Ok(Some(_)) => {}
                        Ok(None) => break Ok(()),
                        Err(e) => break Err(e),
                    }
                    fs.locks.wait_freed(seen, backoff.next_pause());
                    drop(fs);
                };
                if let Some(fs) = fs.upgrade() {
                    fs.locks.waiters.fetch_sub(1, Ordering::AcqRel);
                    // Its place in the node's queue would hold up those behind it.
                    if outcome.is_err() {
                        if let Err(e) = fs.meta().call(CancelWait { ino, owner }) {
                            log::debug!("inode {ino}: a wait for a lock not cancelled: {e}");
                        }
                    }
                }
                done(outcome)
            });
        if let Err(e) = waiting {
            self.locks.waiters.fetch_sub(1, Ordering::AcqRel);
            log::warn!("no thread to wait for a lock: {e}");
            // `done` went with the closure: the kernel's request is answered by its drop.
        }
    }

    /// The locks this mount holds, for a metadata node that lost them.
    pub(crate) fn held_locks(&self) -> Vec<HeldLock> {
        self.locks.list()
    }

    /// The metadata node did not take these locks again after losing our session.
    pub(crate) fn locks_lost(&self, lost: &[HeldLock]) {
        ClientStats::add(&self.stats.locks_lost, lost.len() as u64);
        self.locks.lost(lost);
    }

    /// Asks again while the metadata node answers EAGAIN: its grace period after a restart,
    /// in which clients take their locks again, keeps new ones back (twice its lease).
    fn through_grace<T>(
        &self,
        mut call: impl FnMut() -> std::result::Result<T, rfs_proto::CallError>,
    ) -> Result<T> {
        let give_up = Instant::now() + self.lease * 3;
        loop {
            match call() {
                Err(e) if e.errno() == Errno::EAGAIN && Instant::now() < give_up => {
                    std::thread::sleep(GRACE_ASK)
                }
                r => return r.map_err(Error::from),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_asks_again_as_soon_as_the_node_says_a_lock_went() {
        let locks = Arc::new(Locks::default());
        let seen = locks.freed_count();
        let told = locks.clone();
        let teller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            told.freed();
        });
        let start = Instant::now();
        locks.wait_freed(seen, Duration::from_secs(30));
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "woken, not timed out"
        );
        teller.join().unwrap();
        let start = Instant::now();
        locks.wait_freed(seen, Duration::from_secs(30));
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "told before it waited"
        );
    }
}
