//! The FUSE adapter: translates fuser calls into [`Rfs`] operations and their results into
//! replies; nothing else. Every failed operation goes through [`fuse_error!`], which logs it
//! once (faults as warnings, plain answers such as ENOENT at debug level) and replies with its
//! errno; extended attributes, which rfs does not have, answer ENOSYS directly. Reads and
//! writes answer from the completion path; everything else answers in place.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLock, ReplyLseek, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use rfs_proto::locks::{FileLock, READ, UNLOCK, WRITE};
use rfs_proto::types::{
    Attr, AttrChanges, Caller, FileKind, Owner, Timestamp, MAY_EXEC, MAY_READ, MAY_WRITE,
};
use rfs_proto::Errno;

use crate::fs::{Error, Rfs, STATS_INO};
use crate::options::MountConfig;

/// Logs a failed operation and replies with its errno: faults (a node, the connection) as
/// warnings, plain answers (ENOENT, EEXIST...) at debug level.
macro_rules! fuse_error {
    ($op:expr, $reply:expr, $err:expr) => {{
        let err: Error = $err.into();
        if err.is_fault() {
            log::warn!("{}: {err}", $op);
        } else {
            log::debug!("{}: {err}", $op);
        }
        $reply.error(fuser::Errno::from_i32(err.errno().raw()))
    }};
}

/// The reply on `Ok`, [`fuse_error!`] on `Err`.
macro_rules! reply {
    ($op:literal, $result:expr, $reply:ident, |$v:pat_param| $ok:expr) => {
        match $result {
            Ok($v) => $ok,
            Err(e) => fuse_error!($op, $reply, e),
        }
    };
}

pub struct RfsFuse {
    fs: Arc<Rfs>,
    cfg: MountConfig,
    /// How long the kernel keeps attributes, and names.
    attr_ttl: Duration,
    entry_ttl: Duration,
    callers: Callers,
}

impl RfsFuse {
    pub fn new(fs: Arc<Rfs>, cfg: MountConfig) -> RfsFuse {
        let (attr_ttl, entry_ttl) = cfg.kernel_cache_for(fs.lease());
        RfsFuse {
            fs,
            cfg,
            attr_ttl,
            entry_ttl,
            callers: Callers::default(),
        }
    }

    /// How the kernel uses its page cache for a handle opened with `flags`: it keeps what it
    /// cached if `keep` (the file is unchanged since), and a handle that only writes goes
    /// around the cache (unless the writeback cache is on). Its writes are then taken from
    /// the application's buffer straight into the request we read, instead of being copied
    /// into page cache pages first, pages that nobody reads: our write changes the file, so
    /// the next open drops them anyway. (The kernel drops the cached pages a direct write
    /// overlaps, so other handles here read what was written.)
    fn page_cache_use(&self, flags: i32, keep: bool) -> FopenFlags {
        let mut open = FopenFlags::empty();
        if keep {
            open |= FopenFlags::FOPEN_KEEP_CACHE;
        }
        if self.goes_around_the_cache(flags) {
            open |= FopenFlags::FOPEN_DIRECT_IO;
        }
        open
    }

    /// Whether a handle opened with `flags` is one [`Self::page_cache_use`] sends around the
    /// page cache.
    fn goes_around_the_cache(&self, flags: i32) -> bool {
        let write_only = access(flags) == MAY_WRITE && direct_writes_drop_cached_pages();
        (write_only || self.appends_at_the_nodes_end(flags)) && !self.cfg.writeback_cache
    }

    /// Whether the writes of a handle opened with `flags` go where [`Rfs::append_offset`]
    /// says rather than where the kernel says: write-only O_APPEND ones (`>>`, loggers),
    /// unless the writeback cache is on (the kernel then keeps the size itself). Such a handle
    /// goes around the page cache, since the kernel would copy the bytes into its pages at its
    /// own offset. A handle that reads as well keeps the page cache, and with it mmap (the
    /// kernel maps no direct-I/O file here): its appends go where the kernel says.
    fn appends_at_the_nodes_end(&self, flags: i32) -> bool {
        flags & libc::O_APPEND != 0 && access(flags) == MAY_WRITE && !self.cfg.writeback_cache
    }

    fn attr(&self, a: &Attr) -> FileAttr {
        let t = |ts: Timestamp| {
            if ts.secs >= 0 {
                UNIX_EPOCH + Duration::new(ts.secs as u64, ts.nsecs)
            } else {
                UNIX_EPOCH - Duration::new(ts.secs.unsigned_abs(), 0)
            }
        };
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: t(a.atime),
            mtime: t(a.mtime),
            ctime: t(a.ctime),
            crtime: t(a.ctime),
            kind: match a.kind {
                FileKind::RegularFile => FileType::RegularFile,
                FileKind::Directory => FileType::Directory,
                FileKind::Symlink => FileType::Symlink,
                FileKind::NamedPipe => FileType::NamedPipe,
                FileKind::CharDevice => FileType::CharDevice,
                FileKind::BlockDevice => FileType::BlockDevice,
                FileKind::Socket => FileType::Socket,
            },
            perm: a.perm,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            blksize: self.cfg.max_write,
            flags: 0,
        }
    }

    /// Walks a directory from `offset` page by page, handing entries to `add` until it says
    /// the reply is full.
    fn list(
        &self,
        ino: INodeNo,
        offset: u64,
        caller: &Caller,
        mut add: impl FnMut(u64, &OsStr, &Attr) -> bool,
    ) -> Result<(), Error> {
        let mut cookie = offset;
        loop {
            let page = self.fs.readdir(ino.0, cookie, caller)?;
            if page.is_empty() {
                return Ok(());
            }
            for e in &page {
                if add(e.cookie, OsStr::from_bytes(e.name.as_bytes()), &e.attr) {
                    return Ok(());
                }
                cookie = e.cookie;
            }
        }
    }

    fn entry(&self, op: &'static str, r: Result<Attr, Error>, reply: ReplyEntry) {
        match r {
            Ok(a) => {
                self.fs.kernel_looked_up(a.ino);
                reply.entry(&self.entry_ttl, &self.attr(&a), Generation(0))
            }
            Err(e) => fuse_error!(op, reply, e),
        }
    }

    fn attr_reply(&self, op: &'static str, r: Result<Attr, Error>, reply: ReplyAttr) {
        match r {
            Ok(a) => reply.attr(&self.attr_ttl, &self.attr(&a)),
            Err(e) => fuse_error!(op, reply, e),
        }
    }
}

fn empty(op: &'static str, r: Result<(), Error>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => fuse_error!(op, reply, e),
    }
}

/// A lock request as the protocol has it (the stats file takes none).
fn file_lock(ino: INodeNo, start: u64, end: u64, typ: i32, pid: u32) -> Result<FileLock, Error> {
    let kind = match typ {
        libc::F_RDLCK => READ,
        libc::F_WRLCK => WRITE,
        libc::F_UNLCK => UNLOCK,
        _ => return Err(Errno::EINVAL.into()),
    };
    if ino.0 == STATS_INO {
        return Err(Errno::ENOLCK.into());
    }
    Ok(FileLock {
        start,
        end,
        kind,
        pid,
    })
}

/// fcntl's type of a lock of `kind`.
fn fcntl_type(kind: u8) -> i32 {
    match kind {
        READ => libc::F_RDLCK,
        WRITE => libc::F_WRLCK,
        _ => libc::F_UNLCK,
    }
}

/// Whether thread `tid` still waits for the lock it asked for: no signal is pending for it
/// that it neither blocks nor ignores (the kernel, which does not interrupt a request the file
/// system holds, delivers it once the request is answered; a killed process has SIGKILL
/// pending in every thread; one sent to a process of several threads may go to another). A thread we cannot look at (another pid namespace, hidepid, id
/// 0) waits on: it cannot be gone while its request is held, and an EINTR without a signal
/// would reach it as a bogus errno.
fn still_waiting(tid: u32) -> bool {
    if tid == 0 {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
        return true;
    };
    let mask = |field: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    // A signal sent to the process (alarm, kill) is the thread's too when it is the only one.
    let alone = status
        .lines()
        .any(|l| l.split_whitespace().eq(["Threads:", "1"]));
    let shared = if alone { mask("ShdPnd:") } else { 0 };
    (mask("SigPnd:") | shared) & !mask("SigBlk:") & !mask("SigIgn:") == 0
}

/// Names are bytes, as Linux has them.
fn name(n: &OsStr) -> &[u8] {
    n.as_bytes()
}

fn timestamp(t: TimeOrNow) -> Timestamp {
    Timestamp::from(match t {
        TimeOrNow::SpecificTime(s) => s,
        TimeOrNow::Now => SystemTime::now(),
    })
}

fn kind_of(mode: u32) -> Option<FileKind> {
    Some(match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => FileKind::RegularFile,
        libc::S_IFIFO => FileKind::NamedPipe,
        libc::S_IFCHR => FileKind::CharDevice,
        libc::S_IFBLK => FileKind::BlockDevice,
        libc::S_IFSOCK => FileKind::Socket,
        _ => return None,
    })
}

/// How long the supplementary groups read for a process are used again: a create asks twice
/// (its lookup, then the create), and a process making many files asks for each.
const GROUPS_KEPT: Duration = Duration::from_secs(1);

/// Who makes requests, for the metadata node's permission checks. FUSE gives the uid and gid;
/// the supplementary groups are the requesting process's, read from /proc (none if it has
/// exited since). A read costs about 15 us, so they are kept for [`GROUPS_KEPT`] per process
/// and credentials: a process whose groups change meanwhile (or a new one that takes its pid
/// with the same uid and gid) is checked with the old ones that long; its kernel checks it
/// with the new ones (`default_permissions`).
#[derive(Default)]
struct Callers {
    /// By (pid, uid, gid): the groups, and when they were read.
    groups: Mutex<HashMap<(u32, u32, u32), KeptGroups>>,
}

type KeptGroups = (Vec<u32>, Instant);

impl Callers {
    /// Most processes whose groups are kept; past it the list starts again.
    const MAX: usize = 1024;

    fn of(&self, req: &Request) -> Caller {
        let (pid, uid, gid) = (req.pid(), req.uid(), req.gid());
        let now = Instant::now();
        let kept = self
            .groups
            .lock()
            .unwrap()
            .get(&(pid, uid, gid))
            .and_then(|(g, at)| (now.duration_since(*at) < GROUPS_KEPT).then(|| g.clone()));
        let groups = kept.unwrap_or_else(|| {
            let g = groups_of(pid);
            let mut all = self.groups.lock().unwrap();
            if all.len() >= Self::MAX {
                all.clear();
            }
            all.insert((pid, uid, gid), (g.clone(), now));
            g
        });
        Caller { uid, gid, groups }
    }
}

/// The supplementary groups of process `pid`, from /proc (none if it has exited).
fn groups_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Groups:"))?;
            Some(
                line["Groups:".len()..]
                    .split_whitespace()
                    .filter_map(|g| g.parse().ok())
                    .collect(),
            )
        })
        .unwrap_or_default()
}

/// Whether this kernel drops the cached pages that a direct write overlaps (Linux 6.6 and
/// later; 6.1 does not, as a reviewer found in the Soft-RoCE VM): on an older one, other
/// handles of the file here would go on reading what they cached before the write, so no
/// handle goes around the page cache.
fn direct_writes_drop_cached_pages() -> bool {
    static DROPS: OnceLock<bool> = OnceLock::new();
    *DROPS.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .and_then(|r| kernel_version(&r))
            .is_some_and(|v| v >= (6, 6))
    })
}

/// (major, minor) of a kernel release such as "6.18.44-fc-v657".
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((numbers.next()?.parse().ok()?, numbers.next()?.parse().ok()?))
}

/// The kernel's mark on the open(s) execve(2) makes (__FMODE_EXEC), which FUSE passes on.
const FMODE_EXEC: i32 = 0x20;

/// The access an open asks for, in MAY_* bits.
fn access(flags: i32) -> u8 {
    match flags & libc::O_ACCMODE {
        _ if flags & FMODE_EXEC != 0 => MAY_EXEC,
        libc::O_WRONLY => MAY_WRITE,
        libc::O_RDWR => MAY_READ | MAY_WRITE,
        _ => MAY_READ,
    }
}

/// The creator of a new node, with the umask applied.
fn owner(req: &Request, mode: u32, umask: u32) -> Owner {
    Owner {
        perm: (mode & !umask & 0o7777) as u16,
        uid: req.uid(),
        gid: req.gid(),
    }
}

/// The value on `Ok`; on `Err`, reply and return.
macro_rules! or_reply {
    ($op:literal, $e:expr, $reply:ident) => {
        match $e {
            Ok(v) => v,
            Err(e) => return fuse_error!($op, $reply, e),
        }
    };
}

impl Filesystem for RfsFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_write(self.cfg.max_write) {
            log::warn!("kernel limits max_write to {max}");
            let _ = config.set_max_write(max);
        }
        let _ = config.set_max_readahead(self.cfg.max_readahead);
        let _ = config.set_max_background(64);
        let mut want = InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_READDIRPLUS_AUTO;
        if self.cfg.writeback_cache {
            want |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        if let Err(missing) = config.add_capabilities(want) {
            log::warn!("kernel lacks FUSE capabilities {missing:?}");
        }
        // Locks go to the metadata node, flock's as whole-file ones (as NFS has them).
        let locks = InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS;
        if let Err(missing) = config.add_capabilities(locks) {
            log::warn!("kernel lacks {missing:?}: file locks stay local to this mount");
        }
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEntry) {
        let n = name(n);
        self.entry(
            "lookup",
            self.fs.lookup(parent.0, n, &self.callers.of(req)),
            reply,
        );
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.attr_reply("getattr", self.fs.getattr(ino.0), reply);
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let changes = AttrChanges {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(timestamp),
            mtime: mtime.map(timestamp),
        };
        self.attr_reply(
            "setattr",
            self.fs.setattr(ino.0, changes, &self.callers.of(req)),
            reply,
        );
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        reply!("readlink", self.fs.readlink(ino.0), reply, |t| reply
            .data(t.as_bytes()));
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let n = name(n);
        let kind = or_reply!("mknod", kind_of(mode).ok_or(Errno::EINVAL), reply);
        let made = self.fs.mknod(
            parent.0,
            n,
            kind,
            rdev,
            owner(req, mode, umask),
            &self.callers.of(req),
        );
        self.entry("mknod", made, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let n = name(n);
        let made = self
            .fs
            .mkdir(parent.0, n, owner(req, mode, umask), &self.callers.of(req));
        self.entry("mkdir", made, reply);
    }

    fn unlink(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let n = name(n);
        empty(
            "unlink",
            self.fs.unlink(parent.0, n, &self.callers.of(req)),
            reply,
        );
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let n = name(n);
        empty(
            "rmdir",
            self.fs.rmdir(parent.0, n, &self.callers.of(req)),
            reply,
        );
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let link = name(link);
        let target = name(target.as_os_str());
        let made = self.fs.symlink(
            parent.0,
            link,
            target,
            req.uid(),
            req.gid(),
            &self.callers.of(req),
        );
        self.entry("symlink", made, reply);
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let n = name(n);
        let newname = name(newname);
        let renamed = self.fs.rename(
            parent.0,
            n,
            newparent.0,
            newname,
            flags.bits(),
            &self.callers.of(req),
        );
        empty("rename", renamed, reply);
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let newname = name(newname);
        let linked = self
            .fs
            .link(ino.0, newparent.0, newname, &self.callers.of(req));
        self.entry("link", linked, reply);
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let opened = self
            .fs
            .open_keeping_cache(ino.0, access(flags.0), &self.callers.of(req));
        reply!("open", opened, reply, |(fh, _, keep)| {
            // The stats file changes size under the kernel's feet: no page cache for it.
            let open = if ino.0 == STATS_INO {
                FopenFlags::FOPEN_DIRECT_IO
            } else {
                self.page_cache_use(flags.0, keep)
            };
            reply.opened(FileHandle(fh), open)
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.fs.read(
            ino.0,
            offset,
            size as usize,
            Box::new(move |r: Result<&[u8], Error>| reply!("read", r, reply, |d| reply.data(d))),
        );
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            // Before the bytes land, as the kernel clears them for writes through its pages.
            if let Err(e) = self.fs.write_clears_setid(ino.0, &self.callers.of(req)) {
                return fuse_error!("write", reply, e);
            }
        }
        let offset = if self.appends_at_the_nodes_end(flags.0) {
            match self.fs.append_offset(ino.0) {
                Ok(end) => {
                    if end != offset {
                        // Pages other handles here cached where the write lands.
                        self.fs.pages_left_stale(ino.0);
                    }
                    end
                }
                Err(e) => return fuse_error!("write", reply, e),
            }
        } else if flags.0 & libc::O_APPEND != 0 && !self.cfg.writeback_cache {
            // A descriptor that also reads appends through the page cache, where the kernel's
            // cached size says: the kernel does not ask for the size first, so another
            // mount's appends (under a lock, say) would be overwritten. It goes at the end we
            // know; the kernel's pages and size, put where it thought, go.
            match self.fs.open_end(ino.0) {
                Some(end) if end > offset => {
                    self.fs.pages_left_stale(ino.0);
                    end
                }
                _ => offset,
            }
        } else {
            offset
        };
        // The kernel adds O_DSYNC and O_SYNC for RWF_DSYNC and RWF_SYNC writes too.
        let sync = flags.0 & (libc::O_SYNC | libc::O_DSYNC | libc::O_DIRECT) != 0;
        if flags.0 & libc::O_DIRECT != 0 || self.goes_around_the_cache(flags.0) {
            // Not through the pages: the kernel drops those it overlaps before sending it
            // (and, on some kernels, not after, so a reader here may cache old bytes
            // meanwhile), so our commit of it must not carry them over to the next open.
            self.fs.pages_changed(ino.0);
        }
        self.fs.write_behind(
            ino.0,
            offset,
            data,
            sync,
            Box::new(move |r| reply!("write", r, reply, |n| reply.written(n))),
        );
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // A process's close drops its fcntl locks on the file, once its writes are committed.
        let flushed = self.fs.flush(ino.0, fh.0);
        let unlocked = self.fs.drop_locks(ino.0, lock_owner.0);
        empty("flush", flushed.and(unlocked), reply);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        flock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // The last close of an open file drops its flock and F_OFD locks.
        let unlocked = self
            .fs
            .drop_handle_locks(ino.0, fh.0, flock_owner.map(|o| o.0));
        empty("release", unlocked.and(self.fs.release(fh.0)), reply);
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            // The kernel answers the others itself.
            _ => return reply.error(fuser::Errno::from_i32(libc::EINVAL)),
        };
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(fuser::Errno::from_i32(libc::ENXIO));
        };
        let found = match ino.0 {
            STATS_INO => {
                let size = self.fs.stats_attr().size;
                match (offset < size, data) {
                    (false, _) => Err(Errno::ENXIO.into()),
                    (true, true) => Ok(offset),
                    (true, false) => Ok(size),
                }
            }
            ino => self.fs.seek(ino, offset, data),
        };
        reply!("lseek", found, reply, |o| reply.offset(o as i64));
    }

    fn getlk(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let lock = or_reply!("getlk", file_lock(ino, start, end, typ, pid), reply);
        reply!(
            "getlk",
            self.fs.get_lock(ino.0, lock_owner.0, lock),
            reply,
            |conflict| match conflict {
                Some(l) => reply.locked(l.start, l.end, fcntl_type(l.kind), l.pid),
                None => reply.locked(start, end, libc::F_UNLCK, 0),
            }
        );
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let lock = or_reply!("setlk", file_lock(ino, start, end, typ, pid), reply);
        let (ino, fh, owner) = (ino.0, fh.0, lock_owner.0);
        match self.fs.set_lock(ino, fh, owner, lock, sleep) {
            Ok(None) => reply.ok(),
            Ok(Some(_)) if !sleep => reply.error(fuser::Errno::from_i32(libc::EAGAIN)),
            Ok(Some(_)) => {
                let asker = req.pid();
                self.fs.wait_lock(
                    ino,
                    fh,
                    owner,
                    lock,
                    Box::new(move || still_waiting(asker)),
                    Box::new(move |r| empty("setlk", r, reply)),
                );
            }
            Err(e) => fuse_error!("setlk", reply, e),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Waits for the writes still in flight (write-behind), then commits size and mtime.
        empty("fsync", self.fs.commit(ino.0), reply);
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let listed = self.list(ino, offset, &self.callers.of(req), |c, n, a| {
            reply.add(INodeNo(a.ino), c, self.attr(a).kind, n)
        });
        reply!("readdir", listed, reply, |()| reply.ok());
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let ttl = self.entry_ttl;
        let mut given = Vec::new();
        let listed = self.list(ino, offset, &self.callers.of(req), |c, n, a| {
            let full = reply.add(INodeNo(a.ino), c, n, &ttl, &self.attr(a), Generation(0));
            // The kernel counts a lookup for each entry it takes, but for "." and "..".
            if !full && n != "." && n != ".." {
                given.push(a.ino);
            }
            full
        });
        reply!("readdirplus", listed, reply, |()| {
            for ino in given {
                self.fs.kernel_looked_up(ino);
            }
            reply.ok()
        });
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        reply!("statfs", self.fs.statfs(), reply, |s| {
            let per = s.chunk_size / 4096;
            reply.statfs(
                s.chunks_total * per,
                s.chunks_free * per,
                s.chunks_free * per,
                u64::MAX / 2,
                u64::MAX / 2 - s.inodes,
                4096,
                255,
                4096,
            )
        });
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        // No extended attributes. ENOSYS, not ENOTSUP: only ENOSYS makes the kernel stop
        // asking (applications then get EOPNOTSUPP from the kernel itself). It asks for
        // security.capability before every write, so any other answer costs a round trip
        // through this daemon per write.
        self.fs.xattr_asked();
        reply.error(fuser::Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        self.fs.xattr_asked();
        reply.error(fuser::Errno::ENOSYS);
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        self.fs.xattr_asked();
        reply.error(fuser::Errno::ENOSYS);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        self.fs.xattr_asked();
        reply.error(fuser::Errno::ENOSYS);
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        empty(
            "fallocate",
            self.fs.fallocate(ino.0, offset, length, mode),
            reply,
        );
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let copied = self
            .fs
            .copy_range(ino_in.0, offset_in, ino_out.0, offset_out, len);
        // At most 4 GiB - 1 MiB per call (copy_range's bound): fits the reply.
        reply!("copy_file_range", copied, reply, |n| reply
            .written(n as u32));
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        // No ioctls: the answer of a file that has none (Python asks TCGETS at every open).
        reply.error(fuser::Errno::ENOTTY);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Mounted with default_permissions: the kernel checks modes itself.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let n = name(n);
        let owner = owner(req, mode, umask);
        let caller = self.callers.of(req);
        let made = if flags & libc::O_EXCL != 0 {
            self.fs.create(parent.0, n, owner, access(flags), &caller)
        } else {
            // Another client made the name since the kernel looked it up. EEXIST would fail
            // an open that POSIX lets succeed; ESTALE has the kernel look the name up again
            // and open what is there the ordinary way (its permission checks, O_TRUNC,
            // symlinks, not as a file this open made).
            self.fs
                .create_unchecked(parent.0, n, owner, access(flags), &caller)
                .map_err(|e| match e.errno() {
                    Errno::EEXIST => Errno::ESTALE.into(),
                    _ => e,
                })
        };
        reply!("create", made, reply, |(fh, a)| {
            self.fs.kernel_looked_up(a.ino);
            reply.created(
                &self.entry_ttl,
                &self.attr(&a),
                Generation(0),
                FileHandle(fh),
                self.page_cache_use(flags, false),
            )
        });
    }
}

/// The FUSE notice that drops every name the kernel caches at once (it looks each up again
/// before using it): FUSE_NOTIFY_INC_EPOCH, of Linux 6.16 (FUSE 7.44), which fuser does not
/// send.
const FUSE_NOTIFY_INC_EPOCH: i32 = 8;

/// Drops every name the kernel caches for our mount, through our own descriptor of the FUSE
/// connection.
pub struct KernelNames {
    device: std::fs::File,
    /// The kernel took the notice so far (older kernels refuse it).
    supported: std::sync::atomic::AtomicBool,
}

impl KernelNames {
    pub fn new(device: std::os::fd::OwnedFd) -> KernelNames {
        KernelNames {
            device: device.into(),
            supported: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Drops every cached name; a kernel before 6.16 keeps them until their entry timeout.
    pub fn drop_all(&self) -> std::io::Result<()> {
        use std::io::Write;
        use std::sync::atomic::Ordering::Relaxed;
        if !self.supported.load(Relaxed) {
            return Ok(());
        }
        // A notice is a fuse_out_header alone: its length, the notice's code where a reply
        // has its error, and no request.
        let mut notice = [0u8; 16];
        notice[..4].copy_from_slice(&16u32.to_ne_bytes());
        notice[4..8].copy_from_slice(&FUSE_NOTIFY_INC_EPOCH.to_ne_bytes());
        match (&self.device).write(&notice) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.supported.store(false, Relaxed);
                log::warn!(
                    "this kernel cannot drop all cached names at once (Linux 6.16 can): after a \
                     lost metadata connection, names another mount changed meanwhile may be \
                     served until the entry timeout"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::kernel_version;

    #[test]
    fn kernel_releases_give_their_version() {
        assert_eq!(kernel_version("6.18.44-fc-v657\n"), Some((6, 18)));
        assert_eq!(kernel_version("6.1.0-56-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("5.15"), Some((5, 15)));
        assert!(kernel_version("6.6.0") >= Some((6, 6)));
        assert_eq!(kernel_version("6"), None);
        assert_eq!(kernel_version("linux"), None);
    }
}
