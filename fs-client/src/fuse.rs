//! The FUSE adapter: translates fuser calls into [`Rfs`] operations and errnos into replies.
//! Reads and writes answer from the completion path; everything else answers in place.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use mem_server::namespace::Owner;
use mem_server::proto::{Attr, FileKind, SetAttr, Timestamp};

use crate::fs::{Rfs, STATS_INO};
use crate::options::MountConfig;

pub struct RfsFuse {
    fs: Arc<Rfs>,
    cfg: MountConfig,
}

impl RfsFuse {
    pub fn new(fs: Arc<Rfs>, cfg: MountConfig) -> RfsFuse {
        RfsFuse { fs, cfg }
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
        mut add: impl FnMut(u64, &str, &Attr) -> bool,
    ) -> Result<(), Errno> {
        let mut cookie = offset;
        loop {
            let page = self.fs.readdir(ino.0, cookie).map_err(Errno::from_i32)?;
            if page.is_empty() {
                return Ok(());
            }
            for (c, n, a) in &page {
                if add(*c, n, a) {
                    return Ok(());
                }
                cookie = *c;
            }
        }
    }

    fn entry(&self, r: Result<Attr, i32>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&self.cfg.entry_timeout, &self.attr(&a), Generation(0)),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }
}

fn name(n: &OsStr) -> Result<&str, Errno> {
    n.to_str().ok_or(Errno::EINVAL)
}

fn timestamp(t: TimeOrNow) -> Timestamp {
    let st = match t {
        TimeOrNow::SpecificTime(s) => s,
        TimeOrNow::Now => SystemTime::now(),
    };
    match st.duration_since(UNIX_EPOCH) {
        Ok(d) => Timestamp {
            secs: d.as_secs() as i64,
            nsecs: d.subsec_nanos(),
        },
        Err(e) => Timestamp {
            secs: -(e.duration().as_secs() as i64),
            nsecs: 0,
        },
    }
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

macro_rules! or_reply {
    ($e:expr, $reply:ident) => {
        match $e {
            Ok(v) => v,
            Err(e) => return $reply.error(e),
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
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEntry) {
        let n = or_reply!(name(n), reply);
        self.entry(self.fs.lookup(parent.0, n), reply);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&self.cfg.attr_timeout, &self.attr(&a)),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
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
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(timestamp),
            mtime: mtime.map(timestamp),
        };
        match self.fs.setattr(ino.0, set) {
            Ok(a) => reply.attr(&self.cfg.attr_timeout, &self.attr(&a)),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(ino.0) {
            Ok(t) => reply.data(t.as_bytes()),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
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
        let n = or_reply!(name(n), reply);
        let Some(kind) = kind_of(mode) else {
            return reply.error(Errno::EINVAL);
        };
        let perm = (mode & !umask & 0o7777) as u16;
        self.entry(
            self.fs.mknod(
                parent.0,
                n,
                kind,
                rdev,
                Owner {
                    perm,
                    uid: req.uid(),
                    gid: req.gid(),
                },
            ),
            reply,
        );
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
        let n = or_reply!(name(n), reply);
        let perm = (mode & !umask & 0o7777) as u16;
        self.entry(
            self.fs.mkdir(parent.0, n, perm, req.uid(), req.gid()),
            reply,
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let n = or_reply!(name(n), reply);
        match self.fs.unlink(parent.0, n) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let n = or_reply!(name(n), reply);
        match self.fs.rmdir(parent.0, n) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let link = or_reply!(name(link), reply);
        let target = or_reply!(target.to_str().ok_or(Errno::EINVAL), reply);
        self.entry(
            self.fs
                .symlink(parent.0, link, target, req.uid(), req.gid()),
            reply,
        );
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        n: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let n = or_reply!(name(n), reply);
        let newname = or_reply!(name(newname), reply);
        match self
            .fs
            .rename(parent.0, n, newparent.0, newname, flags.bits())
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let newname = or_reply!(name(newname), reply);
        self.entry(self.fs.link(ino.0, newparent.0, newname), reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.open(ino.0) {
            // The stats file changes size under the kernel's feet: no page cache for it.
            Ok((fh, _)) if ino.0 == STATS_INO => {
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO)
            }
            Ok((fh, _)) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
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
            Box::new(move |r| match r {
                Ok(d) => reply.data(&d),
                Err(e) => reply.error(Errno::from_i32(e)),
            }),
        );
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.fs.write(
            ino.0,
            offset,
            data,
            Box::new(move |r| match r {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(Errno::from_i32(e)),
            }),
        );
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        match self.fs.commit(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        match self.fs.release(fh.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
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
        // Data is in remote memory once a write is answered; fsync commits size and mtime.
        match self.fs.commit(ino.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let listed = self.list(ino, offset, |c, n, a| {
            reply.add(INodeNo(a.ino), c, self.attr(a).kind, n)
        });
        match listed {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let ttl = self.cfg.entry_timeout;
        let listed = self.list(ino, offset, |c, n, a| {
            reply.add(INodeNo(a.ino), c, n, &ttl, &self.attr(a), Generation(0))
        });
        match listed {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.fs.statfs() {
            Ok(s) => {
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
            }
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        // No extended attributes: saying so once lets the kernel stop asking.
        reply.error(Errno::ENOTSUP);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOTSUP);
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
        reply.error(Errno::ENOTSUP);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::ENOTSUP);
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
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let n = or_reply!(name(n), reply);
        let perm = (mode & !umask & 0o7777) as u16;
        let owner = Owner {
            perm,
            uid: req.uid(),
            gid: req.gid(),
        };
        let attr = match self.fs.mknod(parent.0, n, FileKind::RegularFile, 0, owner) {
            Ok(a) => a,
            Err(e) => return reply.error(Errno::from_i32(e)),
        };
        match self.fs.open(attr.ino) {
            Ok((fh, a)) => reply.created(
                &self.cfg.entry_timeout,
                &self.attr(&a),
                Generation(0),
                FileHandle(fh),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }
}
