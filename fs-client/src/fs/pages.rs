//! The kernel's page cache across opens: what version of a file the kernel's cached pages are
//! of, so that an open of an unchanged file keeps them (FOPEN_KEEP_CACHE, as NFS does) and any
//! change, callback or lost connection drops them.

use rfs_proto::message::Committed;
use rfs_proto::types::{Attr, Ino, Timestamp};

use super::backend::Backend;
use super::coherence::KernelInval;
use super::Rfs;

/// What a file was when its pages were cached: a commit of data (which sets ctime), a
/// truncate, a utimens or a chmod anywhere changes it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct PageVersion {
    size: u64,
    mtime: Timestamp,
    ctime: Timestamp,
}

impl PageVersion {
    pub(super) fn of(a: &Attr) -> PageVersion {
        PageVersion {
            size: a.size,
            mtime: a.mtime,
            ctime: a.ctime,
        }
    }
}

impl<B: Backend> Rfs<B> {
    /// The kernel's pages of `ino` may be stale (a callback said it changed).
    pub(crate) fn pages_changed(&self, ino: Ino) {
        self.page_versions.lock().unwrap().remove(&ino);
    }

    /// The kernel let go of `lookups` lookups of `ino`. Once it holds none (it evicted the
    /// inode), it has no pages of it, so there is no version of them to remember.
    pub fn forget(&self, ino: Ino, lookups: u64) {
        if self.kernel_inodes.forgot(ino, lookups) {
            self.page_versions.lock().unwrap().remove(&ino);
        }
    }

    /// Bytes of `ino` changed here other than by a FUSE write that succeeded (a write that
    /// failed after the kernel copied it into the pages, a copy or fallocate that failed
    /// partway, whose pages the kernel drops only on success): the kernel's pages may hold
    /// bytes the file does not, so they go.
    pub(crate) fn pages_left_stale(&self, ino: Ino) {
        self.pages_changed(ino);
        self.kernel(KernelInval::Inode { ino, data: true });
    }

    /// Callbacks may have been missed (the connection was lost): no cached pages are kept at
    /// the next open.
    pub(crate) fn pages_unknown(&self) {
        self.page_versions.lock().unwrap().clear();
    }

    /// Our commit of `ino` is answered. The kernel's pages of the file hold our writes (they
    /// went through them, or the kernel dropped what a direct write overlapped), so if they
    /// were of the version the file had just before the commit (nobody else changed it since
    /// they were), they are of the version after: the next open keeps them, as a reopen of
    /// an unchanged file does, and a rewrite finds its pages in place.
    pub(super) fn pages_committed(&self, ino: Ino, c: &Committed) {
        let mut versions = self.page_versions.lock().unwrap();
        if let Some(v) = versions.get_mut(&ino) {
            if *v == PageVersion::of(&c.before) {
                *v = PageVersion::of(&c.after);
            }
        }
    }
}
