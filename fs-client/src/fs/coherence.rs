//! The metadata node's callbacks, as this client takes them: chunk references it recalls are
//! dropped (and the transfers through them finished) before the answer; sizes of files open
//! here follow changes made elsewhere; the kernel is told to drop the attributes, pages and
//! names it caches. Kernel invalidations go through a queue to a thread of their own, since the
//! kernel may take a lock held by an operation of ours that waits on the metadata node; the
//! answer waits for them (briefly, for that same reason), so that once the change that caused
//! the callback returns, this mount no longer serves a name or attributes it made stale.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rfs_client::{Held, Notice};
use rfs_proto::callback::Callback;
use rfs_proto::message::GetAttr;
use rfs_proto::types::{Attr, Ino, Name, ROOT};

use super::backend::Backend;
use super::stats::ClientStats;
use super::Rfs;

/// How long a callback's answer waits for the kernel to have dropped what it names. The kernel
/// blocks an invalidation while one of our operations in that directory holds its lock, and
/// that operation may be waiting for this very answer (through the metadata node): past this,
/// the answer goes and the invalidation follows when the lock is free.
const KERNEL_INVAL_WAIT: Duration = Duration::from_millis(200);

/// The same after a reconnection, whose invalidations are many and must be done before a lock
/// granted or a file opened meanwhile is answered (they wait for this): the kernel blocks one
/// only while a request of ours holds a page or inode lock, so past this the waiting ends and
/// the rest follows.
const RECONNECTED_INVAL_WAIT: Duration = Duration::from_secs(1);

/// The inodes the kernel was given (by lookups, creates and directory listings), with how
/// many times: the kernel holds one until it forgets as many lookups, and may cache its
/// attributes and pages until then.
#[derive(Default)]
pub(crate) struct KernelInodes(Mutex<HashMap<Ino, u64>>);

impl KernelInodes {
    pub(crate) fn looked_up(&self, ino: Ino) {
        *self.0.lock().unwrap().entry(ino).or_default() += 1;
    }

    /// The kernel let go of `n` lookups of `ino`: whether it holds it no more.
    pub(crate) fn forgot(&self, ino: Ino, n: u64) -> bool {
        let mut known = self.0.lock().unwrap();
        match known.get_mut(&ino) {
            Some(count) if *count > n => {
                *count -= n;
                false
            }
            _ => {
                known.remove(&ino);
                true
            }
        }
    }

    /// Every inode the kernel may hold, the root among them.
    pub(crate) fn all(&self) -> Vec<Ino> {
        let known = self.0.lock().unwrap();
        let root = (!known.contains_key(&ROOT)).then_some(ROOT);
        known.keys().copied().chain(root).collect()
    }
}

/// A cache entry of the kernel's to drop.
#[derive(Clone, Debug)]
pub enum KernelInval {
    /// An inode's attributes, and its cached pages if `data`.
    Inode { ino: Ino, data: bool },
    /// A name in a directory.
    Entry { parent: Ino, name: Name },
    /// Every name the kernel caches (it looks each up again before using it).
    Names,
    /// Everything queued before is done: say so on the channel.
    Done(crossbeam_channel::Sender<()>),
}

impl<B: Backend> Rfs<B> {
    /// Takes the metadata node's callbacks from now on, trusts nothing cached when the
    /// connection comes back after a loss ([`Self::reconnected`]), and lists our open handles
    /// and locks for a metadata node that lost them.
    pub fn attach(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        self.backend
            .on_reclaim(Box::new(move || match me.upgrade() {
                Some(fs) => Held {
                    handles: fs.open_handles(),
                    locks: fs.held_locks(),
                },
                None => Held::default(),
            }));
        let me = Arc::downgrade(self);
        self.backend.on_notice(Box::new(move |notice| {
            let Some(fs) = me.upgrade() else { return };
            match notice {
                Notice::Callback(cb) => fs.on_callback(cb),
                Notice::Reconnected => fs.reconnected(),
                Notice::LocksLost(lost) => fs.locks_lost(&lost),
            }
        }));
        let me = Arc::downgrade(self);
        let watching = std::thread::Builder::new()
            .name("rfs-redial".into())
            .spawn(move || keep_connected(me));
        if let Err(e) = watching {
            log::warn!("no thread to redial a lost metadata connection ({e}): the next call will");
        }
    }

    /// The metadata connection is back after a loss, and callbacks sent meanwhile did not
    /// arrive (as NFSv4 clients after a lease loss, CephFS clients after a reconnect): every
    /// chunk map, directory and page version goes, the sizes of files open here are asked for
    /// again, and the kernel drops every name, attribute and page it caches (open files first),
    /// before the call that reconnected goes on: a lock taken by that call then sees what
    /// others wrote under it.
    pub(crate) fn reconnected(&self) {
        // First: a loss while this runs is a loss of the new connection.
        ClientStats::add(&self.stats.reconnections, 1);
        self.chunks.forget_all();
        self.dirs.forget_all();
        self.xattrs.forget_all();
        self.pages_unknown();
        let open: Vec<Ino> = self.open.lock().unwrap().keys().copied().collect();
        for &ino in &open {
            match self.call(GetAttr { ino }) {
                Ok(a) => self.changed_elsewhere(&a),
                // Lost again: the next connection asks for them all (a call each waiting out
                // its deadline would hold the caller up once per open file).
                Err(e) if e.is_fault() => {
                    log::warn!("revalidating open files after a reconnection: {e}");
                    break;
                }
                Err(e) => log::debug!("revalidating open file {ino}: {e}"),
            }
        }
        // Open files first: the kernel may hold many more.
        let first: std::collections::HashSet<Ino> = open.iter().copied().collect();
        let rest = self
            .kernel_inodes
            .all()
            .into_iter()
            .filter(|i| !first.contains(i));
        let inodes: Vec<Ino> = open.iter().copied().chain(rest).collect();
        self.kernel_forgets(&inodes, true, RECONNECTED_INVAL_WAIT);
        self.retry_owed_now();
    }

    /// The metadata connection was found lost: callbacks cannot reach us until it is back,
    /// so the kernel is to ask before it serves a name or attributes it caches (and we answer
    /// from the node, reconnecting). Its pages stay for descriptors already open (the next
    /// open drops them: page versions go at the reconnection), as NFS keeps them until an
    /// open or a lock revalidates.
    pub(crate) fn connection_lost(&self) {
        self.kernel_forgets(&self.kernel_inodes.all(), false, KERNEL_INVAL_WAIT);
        self.xattrs.forget_all();
        ClientStats::add(&self.stats.connections_lost, 1);
    }

    /// Has the kernel drop every cached name, and the attributes (with the pages if `data`)
    /// of `inodes`, waiting up to `wait` for it.
    fn kernel_forgets(&self, inodes: &[Ino], data: bool, wait: Duration) {
        if self.kernel.get().is_some() {
            self.kernel(KernelInval::Names);
            self.kernel_drops(inodes, data, wait);
        }
    }

    /// Has the kernel drop the attributes (with the pages if `data`) of `inodes`, waiting up
    /// to `wait` for it.
    fn kernel_drops(&self, inodes: &[Ino], data: bool, wait: Duration) {
        if self.kernel.get().is_none() {
            return;
        }
        for &ino in inodes {
            self.kernel(KernelInval::Inode { ino, data });
        }
        let (done, finished) = crossbeam_channel::bounded(1);
        self.kernel(KernelInval::Done(done));
        let _ = finished.recv_timeout(wait);
    }

    /// `ino`'s attributes changed here other than through the kernel (the ring): the kernel
    /// drops what it cached of them before this returns (or [`KERNEL_INVAL_WAIT`] passed).
    /// Not from a FUSE operation: the kernel may hold the inode's lock for it.
    pub(crate) fn kernel_attrs_changed(&self, ino: Ino) {
        self.kernel_drops(&[ino], false, KERNEL_INVAL_WAIT);
    }

    /// The kernel was given `ino` (a lookup, a create, a directory listing's entry).
    pub fn kernel_looked_up(&self, ino: Ino) {
        self.kernel_inodes.looked_up(ino);
    }

    /// Sends the kernel's cache invalidations to `to` from now on (once mounted).
    pub fn notify_kernel(&self, to: crossbeam_channel::Sender<KernelInval>) {
        let _ = self.kernel.set(to);
    }

    /// How long the metadata node waits for our answer to a callback.
    pub fn lease(&self) -> std::time::Duration {
        self.lease
    }

    /// One callback; it is answered when this returns.
    pub fn on_callback(&self, cb: Callback) {
        if !cb.locks_freed.is_empty() {
            self.locks.freed();
        }
        let invalidates = !cb.inodes.is_empty() || !cb.entries.is_empty();
        for inv in &cb.inodes {
            self.dirs.changed(inv.ino);
            self.xattrs.changed(inv.ino);
            // Replicas moved: the whole map goes (and the transfers through it finish).
            let recall_from = if inv.remapped {
                Some(0)
            } else {
                inv.chunks_from
            };
            if let Some(from) = recall_from {
                self.chunks.recall(inv.ino, from, self.lease);
            }
            if let Some(a) = &inv.attr {
                self.changed_elsewhere(a);
            }
            if inv.data {
                self.pages_changed(inv.ino);
            }
            self.kernel(KernelInval::Inode {
                ino: inv.ino,
                data: inv.data,
            });
        }
        for e in cb.entries {
            self.dirs.changed(e.parent);
            self.kernel(KernelInval::Entry {
                parent: e.parent,
                name: e.name,
            });
        }
        if invalidates && self.kernel.get().is_some() {
            let (done, wait) = crossbeam_channel::bounded(1);
            self.kernel(KernelInval::Done(done));
            let _ = wait.recv_timeout(KERNEL_INVAL_WAIT);
        }
    }

    /// Another client changed `a`'s file: a size cut (truncate) holds for our size too, even
    /// over our uncommitted writes (they were before it), and the count of cuts says whether
    /// there was one we had not heard of; a commit can only grow it.
    fn changed_elsewhere(&self, a: &Attr) {
        if let Some(f) = self.open.lock().unwrap().get_mut(&a.ino) {
            f.answered(a);
        }
    }

    pub(crate) fn kernel(&self, inval: KernelInval) {
        if let Some(k) = self.kernel.get() {
            let _ = k.send(inval);
        }
    }
}

/// How often the metadata connection is looked at while no call comes.
const REDIAL_EVERY: Duration = Duration::from_millis(250);

/// Tells of a lost metadata connection ([`Rfs::connection_lost`]), and dials it again at once
/// rather than at the next call: a restarted
/// metadata node forgets the handles of a client that is not back within its grace period
/// (their files then fail with EBADF), and callbacks sent while the connection was down are
/// lost, so cached pages and attributes must be dropped soon, not whenever a call comes. Ends
/// with the file system.
fn keep_connected<B: Backend>(fs: Weak<Rfs<B>>) {
    // The loss of each connection is told once: connections are counted by reconnections
    // (a call may reconnect, and the next loss come, between two looks).
    let mut lost_told: Option<u64> = None;
    loop {
        std::thread::sleep(REDIAL_EVERY);
        let Some(fs) = fs.upgrade() else { return };
        let connection = fs
            .stats
            .reconnections
            .load(std::sync::atomic::Ordering::Acquire);
        if !fs.backend.metadata_connected() && lost_told != Some(connection) {
            lost_told = Some(connection);
            fs.connection_lost();
        }
        if let Err(e) = fs.backend.redial() {
            log::debug!("redialling the metadata node: {e}");
        }
    }
}
