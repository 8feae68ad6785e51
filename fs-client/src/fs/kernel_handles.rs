//! Handles as the kernel opens them, by open(2) flags: the access asked, how the kernel is to
//! use its page cache for the handle, and where the handle's writes land. The FUSE adapter
//! only passes the flags on and tells the kernel what is decided here.

use std::sync::Arc;

use rfs_proto::types::{Attr, Caller, FileAccess, Ino, Owner};
use rfs_proto::Errno;

use super::{Backend, Result, Rfs, WriteDone, STATS_INO};
use crate::host::direct_writes_drop_cached_pages;

/// The kernel's mark on the open(s) execve(2) makes (__FMODE_EXEC), which FUSE passes on.
pub(crate) const FMODE_EXEC: i32 = 0x20;

/// The access an open with `flags` asks for.
pub fn access(flags: i32) -> FileAccess {
    match flags & libc::O_ACCMODE {
        _ if flags & FMODE_EXEC != 0 => FileAccess::EXEC,
        libc::O_WRONLY => FileAccess::WRITE,
        libc::O_RDWR => FileAccess::READ | FileAccess::WRITE,
        _ => FileAccess::READ,
    }
}

/// How the kernel is to use its page cache for a handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageCacheUse {
    /// Keep the pages it cached of the file: the file is unchanged since.
    pub keep_cache: bool,
    /// Send the handle's reads and writes here, around the page cache.
    pub direct_io: bool,
}

impl<B: Backend> Rfs<B> {
    /// Opens `ino` as the kernel's open with `flags` (and `caller`) asks: the handle, and how
    /// the kernel is to use its page cache for it.
    pub fn open_for_kernel(
        &self,
        ino: Ino,
        flags: i32,
        caller: &Caller,
    ) -> Result<(u64, PageCacheUse)> {
        let (fh, _, keep) = self.open_keeping_cache(ino, access(flags), caller)?;
        Ok((fh, self.page_cache_use(ino, flags, keep)))
    }

    /// Makes and opens `name` in `parent` as the kernel's create with `flags` asks: with
    /// O_EXCL the name must be new; without it, a name another client made since the kernel
    /// looked it up answers ESTALE, so that the kernel looks it up again and opens what is
    /// there the ordinary way (its permission checks, O_TRUNC, symlinks, not as a file this
    /// open made), where EEXIST would fail an open that POSIX lets succeed.
    pub fn create_for_kernel(
        &self,
        parent: Ino,
        name: &[u8],
        owner: Owner,
        flags: i32,
        caller: &Caller,
    ) -> Result<(u64, Attr, PageCacheUse)> {
        let (fh, attr) = if flags & libc::O_EXCL != 0 {
            self.create(parent, name, owner, access(flags), caller)?
        } else {
            self.create_unchecked(parent, name, owner, access(flags), caller)
                .map_err(|e| match e.errno() {
                    Errno::EEXIST => Errno::ESTALE.into(),
                    _ => e,
                })?
        };
        Ok((fh, attr, self.page_cache_use(attr.ino, flags, false)))
    }

    /// How the kernel uses its page cache for a handle of `ino` opened with `flags`: it keeps
    /// what it cached if `keep` (the file is unchanged since), and a handle that only writes
    /// goes around the cache (unless the writeback cache is on). Its writes are then taken
    /// from the application's buffer straight into the request we read, instead of being
    /// copied into page cache pages first, pages that nobody reads: our write changes the
    /// file, so the next open drops them anyway. (The kernel drops the cached pages a direct
    /// write overlaps, so other handles here read what was written.) The stats file changes
    /// size under the kernel's feet: no page cache for it.
    fn page_cache_use(&self, ino: Ino, flags: i32, keep: bool) -> PageCacheUse {
        if ino == STATS_INO {
            return PageCacheUse {
                keep_cache: false,
                direct_io: true,
            };
        }
        PageCacheUse {
            keep_cache: keep,
            direct_io: self.goes_around_the_cache(flags),
        }
    }

    /// Whether a handle opened with `flags` is one [`Self::page_cache_use`] sends around the
    /// page cache.
    fn goes_around_the_cache(&self, flags: i32) -> bool {
        let write_only = access(flags) == FileAccess::WRITE && direct_writes_drop_cached_pages();
        (write_only || self.appends_at_the_nodes_end(flags)) && !self.writeback_cache
    }

    /// Whether the writes of a handle opened with `flags` go where [`Rfs::append_offset`]
    /// says rather than where the kernel says: write-only O_APPEND ones (`>>`, loggers),
    /// unless the writeback cache is on (the kernel then keeps the size itself). Such a handle
    /// goes around the page cache, since the kernel would copy the bytes into its pages at its
    /// own offset. A handle that reads as well keeps the page cache, and with it mmap (the
    /// kernel maps no direct-I/O file here): its appends go where the kernel says.
    fn appends_at_the_nodes_end(&self, flags: i32) -> bool {
        flags & libc::O_APPEND != 0 && access(flags) == FileAccess::WRITE && !self.writeback_cache
    }

    /// A write the kernel sends at `offset` for a handle opened with `flags`: it lands where
    /// the handle's writes go (the end of the file for appends, see
    /// [`Self::appends_at_the_nodes_end`]), and is answered once it landed if the handle is
    /// synchronous (O_SYNC, O_DSYNC, O_DIRECT), else as write-behind answers it.
    pub fn write_from_kernel(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        data: &[u8],
        flags: i32,
        done: WriteDone,
    ) {
        let offset = if self.appends_at_the_nodes_end(flags) {
            match self.append_offset(ino) {
                Ok(end) => {
                    if end != offset {
                        // Pages other handles here cached where the write lands.
                        self.pages_left_stale(ino);
                    }
                    end
                }
                Err(e) => return done(Err(e)),
            }
        } else if flags & libc::O_APPEND != 0 && !self.writeback_cache {
            // A descriptor that also reads appends through the page cache, where the kernel's
            // cached size says: the kernel does not ask for the size first, so another
            // mount's appends (under a lock, say) would be overwritten. It goes at the end we
            // know; the kernel's pages and size, put where it thought, go.
            match self.open_end(ino) {
                Some(end) if end > offset => {
                    self.pages_left_stale(ino);
                    end
                }
                _ => offset,
            }
        } else {
            offset
        };
        // The kernel adds O_DSYNC and O_SYNC for RWF_DSYNC and RWF_SYNC writes too.
        let sync = flags & (libc::O_SYNC | libc::O_DSYNC | libc::O_DIRECT) != 0;
        if flags & libc::O_DIRECT != 0 || self.goes_around_the_cache(flags) {
            // Not through the pages: the kernel drops those it overlaps before sending it
            // (and, on some kernels, not after, so a reader here may cache old bytes
            // meanwhile), so our commit of it must not carry them over to the next open.
            self.pages_changed(ino);
        }
        self.write_behind(ino, offset, data, sync, done);
    }
}
