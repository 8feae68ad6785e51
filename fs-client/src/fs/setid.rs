//! Set-user-ID and set-group-ID bits, and file capabilities, that writes, truncates and chowns
//! clear, as Linux clears them. The mount asks the kernel to leave all of it to the file system
//! (FUSE_HANDLE_KILLPRIV_V2): otherwise the kernel asks for `security.capability` before every
//! write through its page cache. It then says which writes must clear
//! (FUSE_WRITE_KILL_SUIDGID), and leaves truncates, chowns, fallocate and copy_file_range to
//! us.

use std::sync::atomic::Ordering;
use std::sync::Arc;

pub use rfs_proto::types::setid_cleared_by_write;
use rfs_proto::types::{AttrChanges, Caller, Ino};

use super::backend::Backend;
use super::error::Result;
use super::Rfs;

impl<B: Backend> Rfs<B> {
    /// A write by `caller` that the kernel says clears the file's set-ID bits and capabilities
    /// (FUSE_WRITE_KILL_SUIDGID: writes that go around the page cache, and every write with the
    /// writeback cache, leave that to the file system; also fallocate and copy_file_range
    /// there, which the kernel says nothing of). The node clears what it holds then; the mode
    /// of a file open here is known (its open, and callbacks, tell it), and its capabilities
    /// are kept as extended attributes are, so a file with neither costs no call.
    /// Whether there was anything to clear.
    pub fn write_clears_setid(self: &Arc<Self>, ino: Ino, caller: &Caller) -> Result<bool> {
        let perm = match self.open_perm(ino) {
            Some(p) => p,
            None => self.getattr(ino)?.perm,
        };
        // Known to be there: a write does not fail for want of the metadata node (its data
        // nodes take it), nor wait for one known to be out of reach.
        let capabilities = self.backend.metadata_connected()
            && self.getxattr(ino, b"security.capability", caller).is_ok();
        if setid_cleared_by_write(u32::from(perm)) == 0 && !capabilities {
            return Ok(false);
        }
        let changes = AttrChanges {
            kill_setid: true,
            ..AttrChanges::default()
        };
        self.setattr(ino, changes, caller).map(|_| true)
    }

    /// The kernel leaves clearing set-ID bits and capabilities to us (said once mounted).
    pub fn kernel_leaves_setid(&self, leaves: bool) {
        self.leaves_setid.store(leaves, Ordering::Relaxed);
    }

    /// Whether the kernel leaves clearing set-ID bits and capabilities to us.
    pub fn leaves_setid(&self) -> bool {
        self.leaves_setid.load(Ordering::Relaxed)
    }

    /// `changes` with the set-ID bits (and capabilities) they clear, where the kernel leaves
    /// that to us: a truncate by anyone but root, and a chown (by root too, as Linux has it
    /// since 2.2.13), on a regular file.
    pub(super) fn clearing_setid(&self, mut changes: AttrChanges, caller: &Caller) -> AttrChanges {
        let chown = changes.uid.is_some() || changes.gid.is_some();
        let cut = changes.size.is_some() && caller.uid != 0;
        if self.leaves_setid() && (chown || cut) {
            changes.kill_setid = true;
        }
        changes
    }
}
