//! File locks (fcntl's byte ranges; flock's, which the kernel sends as whole-file ones) held
//! at the metadata node, so that processes on two mounts exclude each other as they would on
//! one machine. What this mount holds is kept here too: a close drops locks at the node only
//! when its owner holds some (a close costs no call otherwise), and a metadata node that
//! restarts is given them again.
//!
//! Locks order data as they do on NFS: before a lock is let go, the file's writes are
//! committed, so whoever takes it next sees them (its cached pages and size are dropped by the
//! commit's callbacks before the commit is answered).
//!
//! A lock that must wait (F_SETLKW) waits on a thread of its own, asking again with backoff,
//! not on a FUSE worker: the unlock that would end the wait may need one. It ends with an
//! error once the process that asked has a signal to take or is gone: the kernel does not
//! interrupt a request the file system holds, and a killed process would wait for it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfs_proto::client::HeldLock;
use rfs_proto::locks::{FileLock, LockSet, UNLOCK};
use rfs_proto::message::{DropLocks, GetLock, SetLock};
use rfs_proto::types::Ino;
use rfs_proto::{Errno, MetadataChannel};

use super::backend::Backend;
use super::error::{Error, Result};
use super::stats::ClientStats;
use super::Rfs;

/// Locks waited for at once, at most: each waits on a thread.
const MAX_WAITERS: usize = 1024;
/// How often a lock being waited for is asked again, at first and at most.
const FIRST_ASK: Duration = Duration::from_millis(1);
const LAST_ASK: Duration = Duration::from_millis(50);
/// How often a lock is asked again while the metadata node's grace period after a restart
/// keeps new locks back (EAGAIN).
const GRACE_ASK: Duration = Duration::from_millis(100);

/// What this mount holds: locks by file, by owner.
#[derive(Default)]
pub(crate) struct Locks {
    held: Mutex<HashMap<Ino, LockSet<u64>>>,
    waiters: AtomicUsize,
}

impl Locks {
    fn holds(&self, ino: Ino, owner: u64) -> bool {
        self.held
            .lock()
            .unwrap()
            .get(&ino)
            .is_some_and(|s| s.holds(owner))
    }

    fn set(&self, ino: Ino, owner: u64, lock: FileLock) {
        let mut held = self.held.lock().unwrap();
        let set = held.entry(ino).or_default();
        set.set(owner, lock);
        if set.is_empty() {
            held.remove(&ino);
        }
    }

    fn drop_owner(&self, ino: Ino, owner: u64) {
        let mut held = self.held.lock().unwrap();
        if let Some(set) = held.get_mut(&ino) {
            set.drop_owners(|o| o == owner);
            if set.is_empty() {
                held.remove(&ino);
            }
        }
    }

    /// Every lock held, for a metadata node that lost them.
    pub(crate) fn list(&self) -> Vec<HeldLock> {
        let held = self.held.lock().unwrap();
        held.iter()
            .flat_map(|(&ino, set)| set.iter().map(move |&(owner, lock)| (ino, owner, lock)))
            .collect()
    }

    /// The metadata node did not take these again: they are not ours any more.
    pub(crate) fn lost(&self, lost: &[HeldLock]) {
        let mut held = self.held.lock().unwrap();
        for &(ino, owner, lock) in lost {
            if let Some(set) = held.get_mut(&ino) {
                set.set(
                    owner,
                    FileLock {
                        kind: UNLOCK,
                        ..lock
                    },
                );
                if set.is_empty() {
                    held.remove(&ino);
                }
            }
        }
    }
}

/// Says whether a wait for a lock is still wanted (false: the process that asked is gone or
/// has a signal to take).
pub type StillWanted = Box<dyn Fn() -> bool + Send>;
/// Receives the end of a wait for a lock.
pub type LockDone = Box<dyn FnOnce(Result<()>) + Send>;

impl<B: Backend> Rfs<B> {
    /// Takes, changes or removes `lock` for `owner` on `ino` without waiting for other
    /// owners: `None` once done, or a lock of another owner that conflicts. Before a lock is
    /// let go, the file's writes are committed.
    pub fn set_lock(&self, ino: Ino, owner: u64, lock: FileLock) -> Result<Option<FileLock>> {
        if lock.kind == UNLOCK {
            self.commit(ino)?;
        }
        let conflict = self.through_grace(|| {
            self.meta().call(SetLock {
                ino,
                owner,
                lock,
                reclaim: false,
            })
        })?;
        if conflict.is_none() {
            self.locks.set(ino, owner, lock);
        }
        Ok(conflict)
    }

    /// A lock of another owner that would keep `owner` from taking `lock` on `ino`.
    pub fn get_lock(&self, ino: Ino, owner: u64, lock: FileLock) -> Result<Option<FileLock>> {
        self.through_grace(|| self.meta().call(GetLock { ino, owner, lock }))
    }

    /// A close by `owner` (a process's of fcntl locks, an open file's last of its flock):
    /// its locks on `ino` go, after the file's writes are committed. No call when it holds
    /// none.
    pub fn drop_locks(&self, ino: Ino, owner: u64) -> Result<()> {
        if !self.locks.holds(ino, owner) {
            return Ok(());
        }
        let committed = self.commit(ino);
        self.meta().call(DropLocks { ino, owner })?;
        self.locks.drop_owner(ino, owner);
        committed
    }

    /// Takes `lock` once no other owner's lock conflicts, on a thread of its own: `done` gets
    /// the outcome, EINTR once `wanted` says the wait is not wanted any more.
    pub fn wait_lock(
        self: &Arc<Self>,
        ino: Ino,
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
                let mut pause = FIRST_ASK;
                let outcome = loop {
                    let Some(fs) = fs.upgrade() else {
                        break Err(Errno::EINTR.into()); // unmounted
                    };
                    match fs.set_lock(ino, owner, lock) {
                        // Not a fault: the process was interrupted, or killed.
                        Ok(Some(_)) if !wanted() => break Err(Errno::EINTR.into()),
                        Ok(Some(_)) => {}
                        Ok(None) => break Ok(()),
                        Err(e) => break Err(e),
                    }
                    drop(fs);
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(LAST_ASK);
                };
                if let Some(fs) = fs.upgrade() {
                    fs.locks.waiters.fetch_sub(1, Ordering::AcqRel);
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
