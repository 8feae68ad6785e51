//! POSIX ACLs of inodes, kept in the extended attributes Linux keeps them in and in step with
//! the mode bits: setting an access ACL sets the mode's three classes, a chmod sets the ACL's,
//! and what is made in a directory with a default ACL inherits it (see [`crate::acl`]). Who may
//! set them is the operations' to check (`access::check_xattr`).

use rfs_proto::xattr::{POSIX_ACL_ACCESS, POSIX_ACL_DEFAULT};

use super::xattrs::cost;
use super::*;
use crate::access::Perms;
use crate::acl::Acl;

/// The ACL kept in `i`'s attribute `name`, if any. Only valid ACLs are kept (they are checked
/// as they are set), so one that does not parse is not there.
fn acl_of(i: &Inode, name: &[u8]) -> Option<Acl> {
    let bytes = i.xattrs.as_ref()?.get(name)?;
    Acl::parse(bytes).ok().flatten()
}

/// What a node made in a directory gets of its ACLs: its access ACL and, for a directory, the
/// default ACL it passes on.
pub(super) struct Inherited {
    access: Option<Acl>,
    default: Option<Acl>,
}

impl Inherited {
    fn cost(&self) -> u64 {
        let one = |name, acl: &Option<Acl>| acl.as_ref().map_or(0, |a| cost(name, &a.to_bytes()));
        one(POSIX_ACL_ACCESS, &self.access) + one(POSIX_ACL_DEFAULT, &self.default)
    }
}

impl Namespace {
    /// `ino` as the permission checks see it: its attributes and its access ACL.
    pub fn perms(&self, ino: Ino) -> Result<Perms, Errno> {
        let i = self.get(ino)?;
        Ok(Perms {
            attr: i.attr,
            acl: acl_of(i, POSIX_ACL_ACCESS),
        })
    }

    /// Sets `ino`'s access ACL as setxattr(2) of `system.posix_acl_access` does: the mode's
    /// three classes take the ACL's (the owner's entry, the mask, the others' entry), and an
    /// ACL the mode bits say all of is not kept. `clear_setgid`: the caller is neither root nor
    /// in the file's group, and the set-group-ID bit goes. The attributes after.
    pub fn set_access_acl(
        &mut self,
        ino: Ino,
        acl: &Acl,
        clear_setgid: bool,
    ) -> Result<Attr, Errno> {
        let before = self.get(ino)?;
        let mut perm = (before.attr.perm & !0o777) | acl.mode_bits();
        if clear_setgid {
            perm &= !SETGID;
        }
        let kept = before
            .xattrs
            .as_ref()
            .is_some_and(|x| x.contains_key(POSIX_ACL_ACCESS));
        if !acl.is_minimal() {
            self.set_xattr(ino, POSIX_ACL_ACCESS, &acl.to_bytes(), 0)?;
        } else if kept {
            self.remove_xattr(ino, POSIX_ACL_ACCESS)?;
        }
        let i = self.get_mut(ino)?;
        i.attr.perm = perm;
        i.attr.ctime = now();
        Ok(i.attr)
    }

    /// After a chmod of `ino`: its access ACL takes the new mode's classes.
    pub(super) fn chmod_acl(&mut self, ino: Ino) {
        let Ok(i) = self.get(ino) else { return };
        let Some(mut acl) = acl_of(i, POSIX_ACL_ACCESS) else {
            return;
        };
        acl.chmod(i.attr.perm);
        self.put_xattr(ino, POSIX_ACL_ACCESS, &acl.to_bytes());
    }

    /// What a node of `kind` made in `dir` with permission bits `perm` inherits: the bits it
    /// gets (the umask taken out, or the directory's default ACL applied instead), and its ACLs.
    /// ENOSPC if they would take the attributes past the node's budget.
    pub(super) fn inherit(
        &self,
        dir: Ino,
        kind: FileKind,
        perm: u16,
        umask: u16,
    ) -> Result<(u16, Inherited), Errno> {
        let none = Inherited {
            access: None,
            default: None,
        };
        if kind == FileKind::Symlink {
            return Ok((perm, none));
        }
        let Some(default) = acl_of(self.get(dir)?, POSIX_ACL_DEFAULT) else {
            return Ok((perm & !(umask & 0o777), none));
        };
        let (perm, access) = default.inherit(perm);
        let inherited = Inherited {
            access,
            default: (kind == FileKind::Directory).then_some(default),
        };
        if self.xattr_bytes + inherited.cost() > self.max_xattr_bytes {
            return Err(Errno::ENOSPC);
        }
        Ok((perm, inherited))
    }

    /// Gives the new node `ino` what it inherited (its budget was checked by `inherit`).
    pub(super) fn give(&mut self, ino: Ino, inherited: Inherited) {
        if let Some(acl) = inherited.access {
            self.put_xattr(ino, POSIX_ACL_ACCESS, &acl.to_bytes());
        }
        if let Some(acl) = inherited.default {
            self.put_xattr(ino, POSIX_ACL_DEFAULT, &acl.to_bytes());
        }
    }
}
