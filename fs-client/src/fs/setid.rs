//! Set-user-ID and set-group-ID bits that writes, truncates and chowns clear, as Linux clears
//! them. The kernel does it itself for what goes through its page cache, except with its
//! writeback cache on: there it leaves all of it to the file system (FUSE_HANDLE_KILLPRIV_V2,
//! which the mount asks for so that a write does not cost a getxattr of `security.capability`
//! each), and says which writes must clear (FUSE_WRITE_KILL_SUIDGID).

use std::sync::Arc;

use rfs_proto::types::{AttrChanges, Caller, FileKind, Ino};

use super::backend::Backend;
use super::error::Result;
use super::Rfs;

/// The set-ID bits of `perm` that a write by someone without CAP_FSETID clears: set-user-ID,
/// and set-group-ID on a group-executable file (without group execute it marks mandatory
/// locking, and stays).
pub fn setid_cleared_by_write(perm: u32) -> u32 {
    let mut bits = perm & 0o4000;
    if perm & 0o2010 == 0o2010 {
        bits |= 0o2000;
    }
    bits
}

impl<B: Backend> Rfs<B> {
    /// A write by `caller` that the kernel says clears the file's set-user-ID bit (and its
    /// set-group-ID bit when group-executable, as Linux clears them): writes that go around the
    /// page cache leave that to the file system (FUSE_WRITE_KILL_SUIDGID, on every such write
    /// of a caller without CAP_FSETID). The mode of a file open here is known (its open, and
    /// callbacks, tell it), so a file without those bits costs no call.
    pub fn write_clears_setid(self: &Arc<Self>, ino: Ino, caller: &Caller) -> Result<()> {
        let perm = match self.open_perm(ino) {
            Some(p) => p,
            None => self.getattr(ino)?.perm,
        };
        let perm = u32::from(perm);
        let cleared = perm & !setid_cleared_by_write(perm);
        if cleared == perm {
            return Ok(());
        }
        let changes = AttrChanges {
            mode: Some(cleared),
            ..AttrChanges::default()
        };
        self.setattr(ino, changes, caller).map(drop)
    }

    /// `changes` with the set-ID bits they clear, where the kernel leaves that to us (its
    /// writeback cache on): a truncate by anyone but root, and a chown (by root too, as Linux
    /// has it since 2.2.13), clear them on a regular file. A chmod in the same call says the
    /// mode itself.
    pub(super) fn clearing_setid(
        &self,
        ino: Ino,
        mut changes: AttrChanges,
        caller: &Caller,
    ) -> Result<AttrChanges> {
        let chown = changes.uid.is_some() || changes.gid.is_some();
        let cut = changes.size.is_some() && caller.uid != 0;
        if !self.writeback_cache || changes.mode.is_some() || !(chown || cut) {
            return Ok(changes);
        }
        let a = self.getattr(ino)?;
        let perm = u32::from(a.perm);
        let cleared = perm & !setid_cleared_by_write(perm);
        if a.kind == FileKind::RegularFile && cleared != perm {
            changes.mode = Some(cleared);
        }
        Ok(changes)
    }
}
