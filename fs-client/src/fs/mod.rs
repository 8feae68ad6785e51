//! The file system operations, independent of FUSE: metadata by RPC to the metadata node, file
//! data by one-sided RDMA to the data nodes, both through a [`Backend`]. Reads and writes are
//! asynchronous: they return at once and call `done` from the completion path, so many can be
//! in flight together (which is what the merge queues feed on).
//!
//! - this module: metadata operations, passed through;
//! - [`open`](self::open): close-to-open state (handles, local sizes, commits);
//! - [`closes`](self::closes): handles given back together, off the path of the close;
//! - [`owed`](self::owed): commits that a fault kept from the metadata node, made again;
//! - [`space`](self::space): allocations short of space wait for the chunks our closes give back;
//! - [`chunks`](self::chunks): the chunk cache with allocate-ahead, recalls and leases;
//! - [`coherence`](self::coherence): the metadata node's callbacks, and the kernel's caches;
//! - [`data`](self::data): the data path (reads and writes split at chunk boundaries);
//! - [`behind`](self::behind): write-behind (what is in flight of each file's writes);
//! - [`dirs`](self::dirs): what we know of the directories we change (attributes, names);
//! - [`locks`](self::locks): file locks, held at the metadata node for every mount;
//! - [`ranges`](self::ranges): copy_file_range and fallocate, without data through FUSE;
//! - [`stats`]: the live statistics file;
//! - [`error`]: the one error type; [`backend`]: the seam.

mod backend;
mod behind;
mod chunks;
mod closes;
mod coherence;
mod data;
mod dirs;
mod error;
#[cfg(test)]
mod fake;
mod kernel_handles;
mod locks;
mod open;
mod owed;
mod pages;
mod ranges;
mod ring_link;
mod setid;
mod space;
mod stats;
#[cfg(test)]
mod tests;
mod xattrs;

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use rfs_client::Client;
use rfs_proto::message::{
    Call, GetAttr, GetStatFs, Link, Lookup, Made, Mkdir, Mknod, ReadDir, Readlink, Rename, Rmdir,
    SetAttr, Symlink, Unlink,
};
use rfs_proto::types::{
    Attr, AttrChanges, Caller, DirEntry, FileAccess, FileKind, Ino, Name, Owner, StatFs, ROOT,
};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::{Errno, MetadataChannel};

pub use backend::{Backend, DataDone, LandedDone, WriteBack};
pub use coherence::KernelInval;
pub use data::{LandDone, ReadDone, WriteDone};
pub use error::{Error, Result};
pub use kernel_handles::{access, PageCacheUse};
pub use locks::{LockDone, StillWanted};
pub use ring_link::{RING_INO, RING_NAME};
pub use setid::setid_cleared_by_write;
pub use stats::{stats_json, STATS_INO, STATS_NAME};

use behind::WriteBehind;
use chunks::ChunkCache;
use closes::Closes;
use coherence::KernelInodes;
use dirs::Dirs;
use locks::Locks;
use open::OpenFile;
use owed::Owed;
use pages::PageVersion;
use space::GivingBack;
use stats::ClientStats;

/// The file system, over a backend (the real [`Client`] by default).
pub struct Rfs<B: Backend = Client> {
    backend: B,
    chunk_size: u64,
    chunks: Arc<ChunkCache>,
    /// How long the metadata node waits for our answer to a callback.
    lease: Duration,
    /// Where invalidations of the kernel's caches go (set once mounted).
    kernel: OnceLock<crossbeam_channel::Sender<KernelInval>>,
    /// The inodes the kernel holds.
    kernel_inodes: KernelInodes,
    open: Mutex<HashMap<Ino, OpenFile>>,
    /// Signalled when a commit is answered (see [`OpenFile`]'s `committing`).
    commit_answered: Condvar,
    /// The version (size, mtime, ctime) each file's pages cached here are of; kept until a
    /// callback or a lost connection says they may be stale.
    page_versions: Mutex<HashMap<Ino, PageVersion>>,
    /// Open handles: the file and the access each was opened with.
    handles: Mutex<HashMap<u64, (Ino, FileAccess)>>,
    next_fh: AtomicU64,
    /// Whose turn it is among a chunk's replicas, for the next read.
    next_replica: AtomicUsize,
    /// How long a transfer refused for a stale reference is sent again: as long as a
    /// metadata call may take.
    retry_window: Duration,
    /// A hard mount: transfers that cannot reach their node wait for it.
    hard: bool,
    /// The kernel's writeback cache is on ([`FsConfig::writeback_cache`]).
    writeback_cache: bool,
    /// The kernel leaves clearing set-ID bits and capabilities to us (`setid`).
    leaves_setid: std::sync::atomic::AtomicBool,
    /// Writes in flight, answered or not.
    behind: WriteBehind,
    /// What we know of the directories we change.
    dirs: Dirs,
    /// The extended attributes we read.
    xattrs: xattrs::XattrCache,
    /// Handles closed and not yet given back.
    closes: Closes,
    /// Handles closed whose commit has not reached the metadata node yet.
    owed: Owed,
    /// Releases that may give chunks back, for allocations short of space to wait for.
    giving_back: GivingBack,
    /// The file locks this mount holds.
    locks: Locks,
    /// Where the ring service listens, once it does (see [`ring_link`]).
    ring_socket: OnceLock<std::path::PathBuf>,
    stats: Arc<ClientStats>,
}

/// The backend's metadata channel, counting calls for the stats file.
struct Counted<'a, B>(&'a B, &'a AtomicU64);

impl<B: MetadataChannel> MetadataChannel for Counted<'_, B> {
    fn exchange(&self, request: &[u8]) -> std::io::Result<Vec<u8>> {
        ClientStats::add(self.1, 1);
        self.0.exchange(request)
    }
}

/// How the file system behaves, fixed when it is made.
#[derive(Clone, Copy, Debug, Default)]
pub struct FsConfig {
    /// Bytes of writes answered before they land that may be in flight (0: a write is
    /// answered once it landed): see [`behind`](self::behind).
    pub write_behind: u64,
    /// The kernel's writeback cache is on: the kernel keeps sizes itself and writes through
    /// its pages, wherever the handle was opened for.
    pub writeback_cache: bool,
    /// How long a metadata call may take at the least (the client's RPC deadline).
    pub rpc_timeout: Duration,
    /// How long a transfer may take.
    pub io_timeout: Duration,
    /// Transfers that find no node are tried again until one answers (a hard mount).
    pub hard: bool,
}

impl<B: Backend> Rfs<B> {
    /// The file system of the namespace behind `backend`. A metadata call may take as long as
    /// the node's lease (it may wait for other clients' answers that long) and a transfer: the
    /// backend's calls are given that long, and so is a transfer refused for a stale
    /// reference to be sent again, so that an outage of the metadata node that calls ride out
    /// delays I/O rather than failing it.
    pub fn new(backend: B, cfg: FsConfig) -> Result<Rfs<B>> {
        let stats = Arc::<ClientStats>::default();
        let fs = Counted(&backend, &stats.metadata_ops).call(GetStatFs {})?;
        let (chunk_size, lease) = (fs.chunk_size, Duration::from_millis(fs.lease_ms));
        if chunk_size == 0 {
            return Err(Error::new(
                Errno::EIO,
                "the metadata node reports 0-byte chunks",
            ));
        }
        let call_timeout = cfg.rpc_timeout.max(lease + cfg.io_timeout);
        backend.set_call_timeout(call_timeout);
        Ok(Rfs {
            backend,
            chunk_size,
            writeback_cache: cfg.writeback_cache,
            leaves_setid: Default::default(),
            // Half the lease: a reference is never used past the lease, counting the
            // transfer's own deadline (at most the other half).
            chunks: Arc::new(ChunkCache::new(lease / 2, chunk_size)),
            lease,
            kernel: OnceLock::new(),
            kernel_inodes: KernelInodes::default(),
            open: Mutex::new(HashMap::new()),
            commit_answered: Condvar::new(),
            page_versions: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            next_replica: AtomicUsize::new(0),
            retry_window: call_timeout,
            hard: cfg.hard,
            behind: WriteBehind::new(cfg.write_behind),
            // A quarter: with the kernel's half lease, nothing older than a lease is served.
            dirs: Dirs::new(lease / 4),
            xattrs: xattrs::XattrCache::new(lease / 4),
            closes: Closes::default(),
            owed: Owed::default(),
            giving_back: GivingBack::default(),
            locks: Locks::default(),
            ring_socket: OnceLock::new(),
            stats,
        })
    }

    /// Waits until every write landed (at unmount).
    pub fn writes_landed(&self) {
        self.behind.drain_all();
    }

    /// What the file system runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Where metadata calls go.
    fn meta(&self) -> Counted<'_, B> {
        Counted(&self.backend, &self.stats.metadata_ops)
    }

    fn call<C: Call + Debug>(&self, req: C) -> Result<C::Reply> {
        Ok(self.meta().call(req)?)
    }

    /// A call that changes directory `dir`: if it fails, whether it took effect is not
    /// known, and what we knew of the directory goes.
    fn changing<C: Call + Debug>(&self, dir: Ino, req: C) -> Result<C::Reply> {
        self.call(req).inspect_err(|_| self.dirs.changed(dir))
    }

    /// A call that adds `name` to `dir`: the inode it leads to, seen with our own
    /// uncommitted writes.
    fn add<C: Call<Reply = Made> + Debug>(&self, dir: Ino, name: &[u8], req: C) -> Result<Attr> {
        self.not_a_reserved_name(dir, name)?;
        let (sent, acl_sent) = (self.dirs.sent(), self.xattrs.sent());
        let made = self.changing(dir, req)?;
        self.dirs.added(sent, made.dir, name);
        self.xattrs.saw(&made.attr, acl_sent);
        self.xattrs.saw(&made.dir, acl_sent);
        Ok(self.with_local_size(made.attr))
    }

    /// A call that removes `name` from `dir`.
    fn remove<C: Call<Reply = Attr> + Debug>(&self, dir: Ino, name: &[u8], req: C) -> Result<()> {
        self.not_a_reserved_name(dir, name)?;
        let sent = self.dirs.sent();
        let after = self.changing(dir, req)?;
        self.dirs.removed(sent, after, name);
        Ok(())
    }

    /// A call answering attributes, seen with our own uncommitted writes.
    fn attr_of<C: Call<Reply = Attr> + Debug>(&self, req: C) -> Result<Attr> {
        let sent = self.xattrs.sent();
        let a = self.call(req)?;
        self.xattrs.saw(&a, sent);
        Ok(self.with_local_size(a))
    }

    /// Where a write through a handle opened with O_APPEND goes: the end of the file as the
    /// metadata node has it now (appends that other clients committed since included), or of
    /// our own writes if further. The kernel would put it at the size it has cached, which
    /// another client's appends may have moved since; NFS asks for the size before each
    /// append too. (Appends from two clients at the same moment can still meet.)
    pub fn append_offset(&self, ino: Ino) -> Result<u64> {
        Ok(self.attr_of(GetAttr { ino })?.size)
    }

    /// Looks `name` up in `parent`.
    pub fn lookup(&self, parent: Ino, name: &[u8], caller: &Caller) -> Result<Attr> {
        // A file handle's inode, which the kernel forgot, asked for by number (an export:
        // `fuse::init`); any kind of inode.
        if name == b"." {
            return self.getattr(parent);
        }
        if parent == ROOT && name == STATS_NAME.as_bytes() {
            return Ok(self.stats_attr());
        }
        if parent == ROOT && name == RING_NAME.as_bytes() {
            return self.ring_link_attr().ok_or(Errno::ENOENT.into());
        }
        // Unless the metadata node is out of reach: callbacks may be missed meanwhile.
        if name != b".." && self.dirs.lacks(parent, name) && self.backend.metadata_connected() {
            return Err(Errno::ENOENT.into());
        }
        self.attr_of(Lookup {
            parent,
            name: name.into(),
            caller: caller.clone(),
        })
    }

    /// An inode's attributes.
    pub fn getattr(&self, ino: Ino) -> Result<Attr> {
        if ino == STATS_INO {
            return Ok(self.stats_attr());
        }
        if ino == RING_INO {
            return self.ring_link_attr().ok_or(Errno::ENOENT.into());
        }
        if let Some(a) = self.dirs.attrs(ino) {
            if self.backend.metadata_connected() {
                return Ok(a);
            }
        }
        self.attr_of(GetAttr { ino })
    }

    /// chmod, chown, utimens and truncate. A truncation commits our writes first and zeroes
    /// the rest of the last chunk kept, so that growing the file again reads zeros.
    pub fn setattr(
        self: &Arc<Self>,
        ino: Ino,
        changes: AttrChanges,
        caller: &Caller,
    ) -> Result<Attr> {
        if ino == STATS_INO {
            return Err(Errno::EACCES.into());
        }
        let changes = self.clearing_setid(changes, caller);
        // Chunk maps come only through a handle: a truncate without a writable one here opens
        // one (which checks that the caller may write) before zeroing the cut chunk's tail.
        let temporary = match changes.size {
            Some(_) if !self.has_writable_handle(ino) => {
                Some(self.open(ino, FileAccess::WRITE, caller)?.0)
            }
            _ => None,
        };
        let result = self.truncate_and_set(ino, changes, caller);
        if changes.kill_setid || changes.mode.is_some() {
            // The file's capabilities may have gone with it, and its ACL follows a chmod.
            self.xattrs.changed(ino);
        }
        match temporary {
            Some(fh) => {
                let released = self.release(fh);
                let attr = result?;
                released.map(|()| attr)
            }
            None => result,
        }
    }

    fn truncate_and_set(
        self: &Arc<Self>,
        ino: Ino,
        changes: AttrChanges,
        caller: &Caller,
    ) -> Result<Attr> {
        let mut zeroed = None;
        if let Some(new) = changes.size {
            // A failed write is left for the writer's flush or fsync to hear of.
            self.commit_reporting(ino, false)?;
            // A commit made before, on another thread (an owed one's retry), must not land
            // after the cut and grow the file back over it.
            self.commits_answered(ino);
            let before = self.call(GetAttr { ino })?;
            let old = self.with_local_size(before).size;
            if new < old {
                zeroed = self.zero_tail(ino, new, old)?.map(|tail| (before, tail));
            }
        }
        let attr = self.attr_of(SetAttr {
            ino,
            changes,
            caller: caller.clone(),
        });
        // A chmod of a directory whose attributes we keep (and the kernel asks for next).
        self.dirs.changed(ino);
        let attr = match (attr, zeroed) {
            (Err(e), Some((before, tail))) => self.cut_failed(ino, before, tail, e),
            (attr, _) => attr,
        };
        let attr = attr?;
        if let Some(new) = changes.size {
            self.truncated(ino, new);
        }
        Ok(attr)
    }

    /// The cut of `ino` that the rest of its last chunk was zeroed ahead of failed with `e`.
    /// The call is never applied once we gave up on it, so the node's attributes tell what
    /// became of it: cut (by us, its answer lost: the truncate happened), untouched since
    /// `before` (the zeroed bytes go back), or changed by someone else meanwhile (their
    /// bytes may be in the tail now: left as they are). If the node cannot tell us, the
    /// zeros stay, as the cut may have been made. Either way the kernel's pages go.
    fn cut_failed(
        self: &Arc<Self>,
        ino: Ino,
        before: Attr,
        (at, tail): (u64, Vec<u8>),
        e: Error,
    ) -> Result<Attr> {
        self.pages_left_stale(ino);
        let lost = |why: &str| {
            log::error!(
                "inode {ino}: a truncate to {at} bytes failed ({e}) after the rest of its last \
                 chunk was zeroed, and {why}: bytes {at}..{} of the file are zeros",
                at + tail.len() as u64
            )
        };
        match self.call(GetAttr { ino }) {
            Ok(now) if now.cuts == before.cuts + 1 && now.size == at => {
                self.truncated(ino, at);
                Ok(self.with_local_size(now))
            }
            Ok(now)
                if (now.size, now.mtime, now.ctime, now.cuts)
                    == (before.size, before.mtime, before.ctime, before.cuts) =>
            {
                self.put_tail_back(ino, (at, tail));
                Err(e)
            }
            Ok(_) => {
                lost("the file changed meanwhile");
                Err(e)
            }
            Err(_) => {
                lost("the metadata node cannot say whether the cut was made");
                Err(e)
            }
        }
    }

    /// Creates a file or special node.
    pub fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        kind: FileKind,
        rdev: u32,
        owner: Owner,
        caller: &Caller,
    ) -> Result<Attr> {
        let mknod = Mknod {
            parent,
            name: name.into(),
            kind,
            rdev,
            owner,
            caller: caller.clone(),
        };
        self.add(parent, name, mknod)
    }

    /// Creates a directory.
    pub fn mkdir(&self, parent: Ino, name: &[u8], owner: Owner, caller: &Caller) -> Result<Attr> {
        self.not_a_reserved_name(parent, name)?;
        let (sent, acl_sent) = (self.dirs.sent(), self.xattrs.sent());
        let mkdir = Mkdir {
            parent,
            name: name.into(),
            owner,
            caller: caller.clone(),
        };
        let made = self.changing(parent, mkdir)?;
        self.dirs.made_dir(sent, made.dir, name, made.attr.ino);
        self.xattrs.saw(&made.attr, acl_sent);
        self.xattrs.saw(&made.dir, acl_sent);
        Ok(made.attr)
    }

    /// Creates a symbolic link owned by `uid`:`gid`.
    pub fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
        caller: &Caller,
    ) -> Result<Attr> {
        let symlink = Symlink {
            parent,
            name: name.into(),
            target: target.into(),
            uid,
            gid,
            caller: caller.clone(),
        };
        self.add(parent, name, symlink)
    }

    /// A symbolic link's target.
    pub fn readlink(&self, ino: Ino) -> Result<Name> {
        if let (RING_INO, Some(target)) = (ino, self.ring_target()) {
            return Ok(Name(target.to_vec()));
        }
        self.call(Readlink { ino })
    }

    /// A hard link to `ino`.
    pub fn link(&self, ino: Ino, newparent: Ino, newname: &[u8], caller: &Caller) -> Result<Attr> {
        let link = Link {
            ino,
            newparent,
            newname: newname.into(),
            caller: caller.clone(),
        };
        self.add(newparent, newname, link)
    }

    /// Removes a name (not a directory).
    pub fn unlink(&self, parent: Ino, name: &[u8], caller: &Caller) -> Result<()> {
        let unlink = Unlink {
            parent,
            name: name.into(),
            caller: caller.clone(),
        };
        self.remove(parent, name, unlink)
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, parent: Ino, name: &[u8], caller: &Caller) -> Result<()> {
        self.not_a_reserved_name(parent, name)?;
        let sent = self.dirs.sent();
        let rmdir = Rmdir {
            parent,
            name: name.into(),
            caller: caller.clone(),
        };
        let after = self.changing(parent, rmdir)?;
        self.dirs.removed_dir(sent, after, name);
        Ok(())
    }

    /// rename(2), with renameat2's flags.
    pub fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        newparent: Ino,
        newname: &[u8],
        flags: u32,
        caller: &Caller,
    ) -> Result<()> {
        self.not_a_reserved_name(parent, name)?;
        self.not_a_reserved_name(newparent, newname)?;
        let sent = self.dirs.sent();
        let rename = Rename {
            parent,
            name: name.into(),
            newparent,
            newname: newname.into(),
            flags,
            caller: caller.clone(),
        };
        let (old, new) = self.changing(parent, rename).inspect_err(|_| {
            self.dirs.changed(newparent);
        })?;
        self.dirs.renamed(sent, (old, name), (new, newname), flags);
        Ok(())
    }

    /// One page of a directory after `cookie`.
    pub fn readdir(&self, ino: Ino, cookie: u64, caller: &Caller) -> Result<Vec<DirEntry>> {
        let sent = self.xattrs.sent();
        let page = self.call(ReadDir {
            ino,
            cookie,
            max: MAX_LIST,
            caller: caller.clone(),
        })?;
        for e in &page {
            self.xattrs.saw(&e.attr, sent);
        }
        Ok(page)
    }

    /// Walks directory `ino` after `cookie` page by page, handing each entry (its cookie, name
    /// and attributes) to `add` until it says it is full.
    pub fn list(
        &self,
        ino: Ino,
        cookie: u64,
        caller: &Caller,
        mut add: impl FnMut(u64, &[u8], &Attr) -> bool,
    ) -> Result<()> {
        let mut cookie = cookie;
        loop {
            let page = self.readdir(ino, cookie, caller)?;
            if page.is_empty() {
                return Ok(());
            }
            for e in &page {
                if add(e.cookie, e.name.as_bytes(), &e.attr) {
                    return Ok(());
                }
                cookie = e.cookie;
            }
        }
    }

    /// The file system's capacity.
    pub fn statfs(&self) -> Result<StatFs> {
        self.call(GetStatFs {})
    }
}

impl<B: Backend> Rfs<B> {
    /// The names of the stats file and the ring link in the root are ours, not the node's:
    /// nothing may be made, moved or linked there (the mount would show it in place of ours,
    /// and a link of someone else's there would take applications' memory and files), nor
    /// removed or moved away.
    fn not_a_reserved_name(&self, parent: Ino, name: &[u8]) -> Result<()> {
        let ours = [STATS_NAME.as_bytes(), RING_NAME.as_bytes()];
        if parent == ROOT && ours.contains(&name) {
            return Err(Error::new(Errno::EACCES, "the name is reserved"));
        }
        Ok(())
    }
}
