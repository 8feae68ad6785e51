//! Conversions between the kernel's (fuser's) types and the protocol's: attributes, file
//! kinds, lock requests, open flags, names and times.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{FileAttr, FileType, FopenFlags, INodeNo, Request, TimeOrNow};
use rfs_proto::locks::{FileLock, LockKind};
use rfs_proto::types::{Attr, FileKind, Owner, Timestamp};
use rfs_proto::Errno;

use crate::fs::{Error, PageCacheUse, STATS_INO};

/// The kernel's attributes of `a`, with `blksize` the preferred I/O size.
pub(super) fn file_attr(a: &Attr, blksize: u32) -> FileAttr {
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
        blocks: a.held.div_ceil(512),
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
        blksize,
        flags: 0,
    }
}

/// A lock request as the protocol has it (the stats file takes none).
pub(super) fn file_lock(
    ino: INodeNo,
    start: u64,
    end: u64,
    typ: i32,
    pid: u32,
) -> Result<FileLock, Error> {
    let kind = match typ {
        libc::F_RDLCK => LockKind::Read,
        libc::F_WRLCK => LockKind::Write,
        libc::F_UNLCK => LockKind::Unlock,
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
pub(super) fn fcntl_type(kind: LockKind) -> i32 {
    match kind {
        LockKind::Read => libc::F_RDLCK,
        LockKind::Write => libc::F_WRLCK,
        LockKind::Unlock => libc::F_UNLCK,
    }
}

/// What the kernel is told at an open about its page cache.
pub(super) fn fopen_flags(cache: PageCacheUse) -> FopenFlags {
    let mut open = FopenFlags::empty();
    if cache.keep_cache {
        open |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if cache.direct_io {
        open |= FopenFlags::FOPEN_DIRECT_IO;
    }
    open
}

/// Names are bytes, as Linux has them.
pub(super) fn name(n: &OsStr) -> &[u8] {
    n.as_bytes()
}

pub(super) fn timestamp(t: TimeOrNow) -> Timestamp {
    Timestamp::from(match t {
        TimeOrNow::SpecificTime(s) => s,
        TimeOrNow::Now => SystemTime::now(),
    })
}

pub(super) fn kind_of(mode: u32) -> Option<FileKind> {
    Some(match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => FileKind::RegularFile,
        libc::S_IFIFO => FileKind::NamedPipe,
        libc::S_IFCHR => FileKind::CharDevice,
        libc::S_IFBLK => FileKind::BlockDevice,
        libc::S_IFSOCK => FileKind::Socket,
        _ => return None,
    })
}

/// The creator of a new node, and its umask (the metadata node applies it, or the parent's
/// default ACL instead: the mount asks the kernel to leave the umask to it).
pub(super) fn owner(req: &Request, mode: u32, umask: u32) -> Owner {
    Owner {
        perm: (mode & 0o7777) as u16,
        uid: req.uid(),
        gid: req.gid(),
        umask: (umask & 0o777) as u16,
    }
}
