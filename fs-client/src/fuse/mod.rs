//! The FUSE adapter: translates fuser calls into [`Rfs`] operations and their results into
//! replies; nothing else. Every failed operation goes through [`fuse_error!`], which logs it
//! once (faults as warnings, plain answers such as ENOENT at debug level) and replies with its
//! errno; extended attributes, which rfs does not have, answer ENOSYS directly. Reads and
//! writes answer from the completion path; everything else answers in place.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, FileAttr, FileHandle, Filesystem, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyLock, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
    TimeOrNow, WriteFlags,
};
use rfs_proto::types::{Attr, AttrChanges, Caller};
use rfs_proto::Errno;

use crate::fs::{Error, Rfs};
use crate::host::{self, Callers};
use crate::options::MountConfig;

#[macro_use]
mod replies;
mod convert;
mod init;
mod kernel_names;

use convert::{fcntl_type, file_lock, fopen_flags, kind_of, name, owner, timestamp};
pub use kernel_names::KernelNames;
use replies::empty;

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

    fn caller(&self, req: &Request) -> Caller {
        self.callers.of(req.pid(), req.uid(), req.gid())
    }

    fn attr(&self, a: &Attr) -> FileAttr {
        convert::file_attr(a, self.cfg.max_write)
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

    /// `ino` is about to change by `req`'s fallocate or copy_file_range: the kernel leaves
    /// clearing its set-ID bits and capabilities to us (`fs::setid`), and says nothing of these
    /// (root is taken to have CAP_FSETID).
    fn modified_by(&self, req: &Request, ino: u64) -> Result<(), Error> {
        match self.fs.leaves_setid() && req.uid() != 0 {
            true => self.fs.write_clears_setid(ino, &self.caller(req)).map(drop),
            false => Ok(()),
        }
    }

    fn attr_reply(&self, op: &'static str, r: Result<Attr, Error>, reply: ReplyAttr) {
        match r {
            Ok(a) => reply.attr(&self.attr_ttl, &self.attr(&a)),
            Err(e) => fuse_error!(op, reply, e),
        }
    }
}

impl Filesystem for RfsFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let leaves_setid = init::negotiate(&self.cfg, config);
        self.fs.kernel_leaves_setid(leaves_setid);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEntry) {
        let n = name(n);
        self.entry(
            "lookup",
            self.fs.lookup(parent.0, n, &self.caller(req)),
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
            kill_setid: false,
        };
        self.attr_reply(
            "setattr",
            self.fs.setattr(ino.0, changes, &self.caller(req)),
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
            &self.caller(req),
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
            .mkdir(parent.0, n, owner(req, mode, umask), &self.caller(req));
        self.entry("mkdir", made, reply);
    }

    fn unlink(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let n = name(n);
        empty(
            "unlink",
            self.fs.unlink(parent.0, n, &self.caller(req)),
            reply,
        );
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let n = name(n);
        empty(
            "rmdir",
            self.fs.rmdir(parent.0, n, &self.caller(req)),
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
            &self.caller(req),
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
            &self.caller(req),
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
        let linked = self.fs.link(ino.0, newparent.0, newname, &self.caller(req));
        self.entry("link", linked, reply);
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let opened = self.fs.open_for_kernel(ino.0, flags.0, &self.caller(req));
        reply!("open", opened, reply, |(fh, cache)| reply
            .opened(FileHandle(fh), fopen_flags(cache)));
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
            if let Err(e) = self.fs.write_clears_setid(ino.0, &self.caller(req)) {
                return fuse_error!("write", reply, e);
            }
        }
        self.fs.write_from_kernel(
            ino.0,
            offset,
            data,
            flags.0,
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
        let found = self.fs.seek(ino.0, offset, data);
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
                    Box::new(move || host::still_waiting(asker)),
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
        let listed = self.fs.list(ino.0, offset, &self.caller(req), |c, n, a| {
            reply.add(INodeNo(a.ino), c, self.attr(a).kind, OsStr::from_bytes(n))
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
        let listed = self.fs.list(ino.0, offset, &self.caller(req), |c, n, a| {
            let full = reply.add(
                INodeNo(a.ino),
                c,
                OsStr::from_bytes(n),
                &ttl,
                &self.attr(a),
                Generation(0),
            );
            // The kernel counts a lookup for each entry it takes, but for "." and "..".
            if !full && n != b"." && n != b".." {
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
            reply.statfs(
                s.bytes_total / 4096,
                s.bytes_free / 4096,
                s.bytes_free / 4096,
                // A node restarted under a lower limit may hold more than it.
                s.inodes_max.max(s.inodes),
                s.inodes_max.saturating_sub(s.inodes),
                4096,
                255,
                4096,
            )
        });
    }

    fn getxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: fuser::ReplyXattr,
    ) {
        self.fs.xattr_asked();
        let value = self.fs.getxattr(ino.0, name.as_bytes(), &self.caller(req));
        replies::sized("getxattr", value, size, reply);
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        self.fs.xattr_asked();
        let names = self.fs.listxattr(ino.0, &self.caller(req));
        replies::sized("listxattr", names, size, reply);
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        self.fs.xattr_asked();
        let caller = self.caller(req);
        let set = self
            .fs
            .setxattr(ino.0, name.as_bytes(), value, flags as u32, &caller);
        empty("setxattr", set, reply);
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.fs.xattr_asked();
        let caller = self.caller(req);
        empty(
            "removexattr",
            self.fs.removexattr(ino.0, name.as_bytes(), &caller),
            reply,
        );
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        or_reply!("fallocate", self.modified_by(req, ino.0), reply);
        empty(
            "fallocate",
            self.fs.fallocate(ino.0, offset, length, mode),
            reply,
        );
    }

    fn copy_file_range(
        &self,
        req: &Request,
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
        or_reply!("copy_file_range", self.modified_by(req, ino_out.0), reply);
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
        let made = self
            .fs
            .create_for_kernel(parent.0, n, owner, flags, &self.caller(req));
        reply!("create", made, reply, |(fh, a, cache)| {
            self.fs.kernel_looked_up(a.ino);
            reply.created(
                &self.entry_ttl,
                &self.attr(&a),
                Generation(0),
                FileHandle(fh),
                fopen_flags(cache),
            )
        });
    }
}
