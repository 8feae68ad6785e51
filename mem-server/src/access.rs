//! Permission checks of the metadata service: mode bits against the caller's uid, gid and
//! groups, as a local file system makes them, with NFS's root squash as an option. The kernel
//! of an honest client checks too (it mounts with default_permissions); these checks are what
//! a client holding the secret but lying about nothing else cannot get around, and what makes
//! a chunk map (and with it the data) reachable only through an open that passed them.

use rfs_proto::types::{
    Attr, AttrChanges, Caller, FileAccess, FileKind, Owner, MAX_GROUPS, RENAME_EXCHANGE,
};
use rfs_proto::xattr::{XattrClass, POSIX_ACL_DEFAULT};
use rfs_proto::Errno;

use crate::acl::Acl;
use crate::namespace::SETGID;

/// Who root becomes under root squash.
pub const NOBODY: u32 = 65534;

/// How the service treats callers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Treat uid 0 as nobody (and gid 0 as nogroup), as NFS's root_squash does.
    pub root_squash: bool,
}

impl Policy {
    /// The caller the checks see, or EINVAL for one no kernel would send.
    pub fn caller(&self, c: &Caller) -> Result<Caller, Errno> {
        if c.groups.len() > MAX_GROUPS {
            return Err(Errno::EINVAL);
        }
        if !self.root_squash {
            return Ok(c.clone());
        }
        let squash = |id: u32| if id == 0 { NOBODY } else { id };
        Ok(Caller {
            uid: squash(c.uid),
            gid: squash(c.gid),
            groups: c.groups.iter().map(|&g| squash(g)).collect(),
        })
    }

    /// Who a new node belongs to: its creator, squashed like a caller.
    pub fn owner(&self, o: Owner) -> Owner {
        if !self.root_squash {
            return o;
        }
        let squash = |id: u32| if id == 0 { NOBODY } else { id };
        Owner {
            uid: squash(o.uid),
            gid: squash(o.gid),
            ..o
        }
    }
}

/// A file as the permission checks see it: its attributes and its access ACL, if it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Perms {
    pub attr: Attr,
    pub acl: Option<Acl>,
}

impl From<Attr> for Perms {
    fn from(attr: Attr) -> Perms {
        Perms { attr, acl: None }
    }
}

fn in_group(c: &Caller, gid: u32) -> bool {
    c.gid == gid || c.groups.contains(&gid)
}

fn owns(p: &Perms, c: &Caller) -> bool {
    c.uid == 0 || c.uid == p.attr.uid
}

/// Whether `c` may have `want` on file `p`: the owner's bits for the owner; for anyone else
/// the access ACL if there is one and the mode's group class (its mask) grants anything (see
/// [`Acl::permits`]), else the group's bits for a member and the others' for the rest, as
/// Linux's acl_permission_check decides; root reads and writes anything, and executes what has
/// any execute bit.
pub fn may(p: &Perms, c: &Caller, want: FileAccess) -> bool {
    let a = &p.attr;
    if c.uid == 0 {
        return !want.contains(FileAccess::EXEC)
            || a.perm & 0o111 != 0
            || a.kind == FileKind::Directory;
    }
    if let Some(acl) = p
        .acl
        .as_ref()
        .filter(|_| c.uid != a.uid && a.perm & 0o070 != 0)
    {
        return acl.permits((a.uid, a.gid), c, want);
    }
    let perm = a.perm as u32;
    let bits = if c.uid == a.uid {
        perm >> 6
    } else if in_group(c, a.gid) {
        perm >> 3
    } else {
        perm
    } & 7;
    FileAccess::from_bits_truncate(bits as u8).contains(want)
}

/// Checks that an open asks for reading, writing, executing or a mix (the wire admits no other
/// bits).
pub fn check_access_bits(access: FileAccess) -> Result<(), Errno> {
    if access.is_empty() {
        return Err(Errno::EINVAL);
    }
    Ok(())
}

/// Checks an open of file `p` for `access`.
pub fn check_open(p: &Perms, c: &Caller, access: FileAccess) -> Result<(), Errno> {
    check_access_bits(access)?;
    if p.attr.kind == FileKind::Directory && access.contains(FileAccess::WRITE) {
        return Err(Errno::EISDIR);
    }
    if !may(p, c, access) {
        return Err(Errno::EACCES);
    }
    Ok(())
}

/// Checks a setattr of file `p`; `writing` says the caller's session holds a handle open for
/// writing (ftruncate on a descriptor opened before a chmod still works).
pub fn check_setattr(p: &Perms, c: &Caller, s: &AttrChanges, writing: bool) -> Result<(), Errno> {
    let a = &p.attr;
    let root = c.uid == 0;
    let owner = owns(p, c);
    let can_write = writing || may(p, c, FileAccess::WRITE);
    // A write by someone else clears set-ID bits (the kernel, or the client for writes that go
    // around the page cache, asks for that as a chmod in the writer's name); anything more is
    // the owner's.
    let only_clears_setid = |m: u32| {
        let (now, m) = (a.perm as u32 & 0o7777, m & 0o7777);
        m & !now == 0 && (m ^ now) & !0o6000 == 0
    };
    if s.mode
        .is_some_and(|m| !(owner || (can_write && only_clears_setid(m))))
    {
        return Err(Errno::EPERM);
    }
    if s.uid.is_some_and(|u| u != a.uid) && !root {
        return Err(Errno::EPERM);
    }
    if let Some(g) = s.gid.filter(|&g| g != a.gid) {
        if !(root || (owner && in_group(c, g))) {
            return Err(Errno::EPERM);
        }
    }
    if s.size.is_some() && !can_write {
        return Err(Errno::EACCES);
    }
    if s.kill_setid && !(owner || can_write) {
        return Err(Errno::EPERM);
    }
    if (s.atime.is_some() || s.mtime.is_some()) && !(owner || can_write) {
        return Err(Errno::EPERM);
    }
    Ok(())
}

/// Checks that `c` may look names up in directory `dir` (search permission). The kernel of a
/// client lets root through every directory; under root squash this is root's only check.
/// A `dir` that is not a directory passes: the namespace answers ENOTDIR.
pub fn check_search(dir: &Perms, c: &Caller) -> Result<(), Errno> {
    check_dir(dir, c, FileAccess::EXEC)
}

/// Checks that `c` may list directory `dir` (read permission).
pub fn check_list(dir: &Perms, c: &Caller) -> Result<(), Errno> {
    check_dir(dir, c, FileAccess::READ)
}

/// Checks that `c` may add names to directory `dir` or take them out (write and search).
pub fn check_change(dir: &Perms, c: &Caller) -> Result<(), Errno> {
    check_dir(dir, c, FileAccess::WRITE | FileAccess::EXEC)
}

fn check_dir(dir: &Perms, c: &Caller, want: FileAccess) -> Result<(), Errno> {
    if dir.attr.kind != FileKind::Directory || may(dir, c, want) {
        Ok(())
    } else {
        Err(Errno::EACCES)
    }
}

/// What a call does with an extended attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrUse {
    Read,
    Set,
    Remove,
}

/// Checks that `c` may `use` extended attribute `name` of file `p`, as Linux has it without a
/// security module: `user.` ones on regular files and directories by their permissions (in a
/// sticky directory, set only by its owner), `trusted.` ones root's alone (others see none:
/// ENODATA), `security.` ones read by anyone and set by root, POSIX ACLs read by anyone and
/// set by the owner (not on symbolic links; default ACLs on directories alone). Other
/// namespaces: EOPNOTSUPP. One more: anyone who may write a file may remove its capabilities
/// (`security.capability`), as a write of theirs does (the kernel asks for that in the
/// writer's name when it clears them).
pub fn check_xattr(p: &Perms, c: &Caller, name: &[u8], how: XattrUse) -> Result<(), Errno> {
    let a = &p.attr;
    let write = how != XattrUse::Read;
    let refused = |errno| {
        if write {
            Err(errno)
        } else {
            Err(Errno::ENODATA)
        }
    };
    match XattrClass::of(name)? {
        XattrClass::Trusted if c.uid != 0 => refused(Errno::EPERM),
        XattrClass::Security
            if how == XattrUse::Remove
                && name == b"security.capability"
                && may(p, c, FileAccess::WRITE) =>
        {
            Ok(())
        }
        XattrClass::Security if write && c.uid != 0 => Err(Errno::EPERM),
        XattrClass::Trusted | XattrClass::Security => Ok(()),
        XattrClass::PosixAcl if a.kind == FileKind::Symlink => Err(Errno::ENOTSUP),
        XattrClass::PosixAcl if !write => Ok(()),
        XattrClass::PosixAcl if name == POSIX_ACL_DEFAULT && a.kind != FileKind::Directory => {
            // Only a directory has one: setting it is refused, removing it has nothing to do.
            match how {
                XattrUse::Set => Err(Errno::EACCES),
                _ => Ok(()),
            }
        }
        XattrClass::PosixAcl if !owns(p, c) => Err(Errno::EPERM),
        XattrClass::PosixAcl => Ok(()),
        XattrClass::User => {
            if !matches!(a.kind, FileKind::RegularFile | FileKind::Directory) {
                return refused(Errno::EPERM);
            }
            let sticky = a.kind == FileKind::Directory && a.perm & 0o1000 != 0;
            if write && sticky && c.uid != 0 && c.uid != a.uid {
                return Err(Errno::EPERM);
            }
            let want = if write {
                FileAccess::WRITE
            } else {
                FileAccess::READ
            };
            if may(p, c, want) {
                Ok(())
            } else {
                Err(Errno::EACCES)
            }
        }
    }
}

/// The changes `s` of a file with attributes `a` as they are applied for `c` (whom
/// [`check_setattr`] let make them): a mode set by a caller neither root nor in the file's
/// group (its new one, if the call changes that too) loses the set-group-ID bit, as Linux's
/// setattr_prepare has it. The kernel of an honest client asks so already.
pub fn as_applied(a: &Attr, c: &Caller, s: &AttrChanges) -> AttrChanges {
    let mut s = *s;
    let gid = s.gid.unwrap_or(a.gid);
    if let Some(mode) = s.mode.filter(|_| c.uid != 0 && !in_group(c, gid)) {
        s.mode = Some(mode & !u32::from(SETGID));
    }
    s
}

/// Whether setting an access ACL on a file with attributes `a` takes its set-group-ID bit away:
/// the caller is neither root nor in the file's group (as chmod by its owner would).
pub fn acl_clears_setgid(a: &Attr, c: &Caller) -> bool {
    c.uid != 0 && !in_group(c, a.gid)
}

/// Whether `c` sees extended attribute `name` in a listing (trusted ones are root's).
pub fn shows_xattr(c: &Caller, name: &[u8]) -> bool {
    c.uid == 0 || XattrClass::of(name) != Ok(XattrClass::Trusted)
}

/// Checks that `c` may remove or replace `victim` in `dir`: in a sticky directory (/tmp) only
/// the victim's owner, the directory's owner and root may (EPERM, as Linux answers).
pub fn check_sticky(dir: &Attr, victim: &Attr, c: &Caller) -> Result<(), Errno> {
    if dir.perm & 0o1000 == 0 || c.uid == 0 || c.uid == dir.uid || c.uid == victim.uid {
        Ok(())
    } else {
        Err(Errno::EPERM)
    }
}

/// Checks a rename (renameat2 `flags`) of `src` from directory `from` to directory `to`, over
/// `dst` if the name is taken there: both directories change, both names pass the sticky
/// rule, and a directory that moves to another parent needs write permission on itself (its
/// ".." changes): with RENAME_EXCHANGE, `dst` moves too.
pub fn check_rename(
    (from, src): (&Perms, Option<&Perms>),
    (to, dst): (&Perms, Option<&Perms>),
    flags: u32,
    c: &Caller,
) -> Result<(), Errno> {
    check_change(from, c)?;
    check_change(to, c)?;
    let moves_away = |d: &Perms| {
        d.attr.kind == FileKind::Directory
            && from.attr.ino != to.attr.ino
            && !may(d, c, FileAccess::WRITE)
    };
    if let Some(src) = src {
        check_sticky(&from.attr, &src.attr, c)?;
        if moves_away(src) {
            return Err(Errno::EACCES);
        }
    }
    if let Some(dst) = dst {
        check_sticky(&to.attr, &dst.attr, c)?;
        if flags & RENAME_EXCHANGE != 0 && moves_away(dst) {
            return Err(Errno::EACCES);
        }
    }
    Ok(())
}

/// Who a file made by `c` in directory `dir` belongs to, as the maker asked (`o`): in a
/// set-group-ID directory it takes the directory's group (the namespace sees to that), and a
/// set-group-ID file keeps the bit only for root and members of that group, as Linux has it.
pub fn made_in(mut o: Owner, dir: &Attr, c: &Caller) -> Owner {
    if dir.perm & SETGID != 0 && o.perm & SETGID != 0 && c.uid != 0 && !in_group(c, dir.gid) {
        o.perm &= !SETGID;
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::types::Timestamp;

    fn p(a: Attr) -> Perms {
        a.into()
    }

    fn file(perm: u16, uid: u32, gid: u32) -> Attr {
        let t = Timestamp::default();
        Attr {
            ino: 2,
            kind: FileKind::RegularFile,
            perm,
            nlink: 1,
            uid,
            gid,
            rdev: 0,
            size: 0,
            atime: t,
            mtime: t,
            ctime: t,
            cuts: 0,
            acl: false,
            held: 0,
        }
    }

    fn who(uid: u32, gid: u32, groups: &[u32]) -> Caller {
        Caller {
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn the_owner_group_and_other_bits_decide_in_that_order() {
        let f = file(0o640, 1000, 100);
        assert!(may(
            &p(f),
            &who(1000, 1, &[]),
            FileAccess::READ | FileAccess::WRITE
        ));
        assert!(may(&p(f), &who(2000, 100, &[]), FileAccess::READ));
        assert!(!may(&p(f), &who(2000, 100, &[]), FileAccess::WRITE));
        assert!(
            may(&p(f), &who(2000, 5, &[7, 100]), FileAccess::READ),
            "a supplementary group"
        );
        assert!(!may(&p(f), &who(2000, 5, &[7]), FileAccess::READ));
        assert!(
            may(&p(f), &who(0, 0, &[]), FileAccess::READ | FileAccess::WRITE),
            "root"
        );
        // The owner's bits hold for the owner even when others may do more.
        let odd = file(0o047, 1000, 100);
        assert!(!may(&p(odd), &who(1000, 100, &[]), FileAccess::READ));
    }

    fn dir(perm: u16, uid: u32) -> Attr {
        Attr {
            kind: FileKind::Directory,
            ..file(perm, uid, uid)
        }
    }

    #[test]
    fn directories_need_search_to_look_read_to_list_and_write_to_change() {
        let private = dir(0o700, 1000);
        let owner = who(1000, 1000, &[]);
        let squashed = Policy { root_squash: true }
            .caller(&who(0, 0, &[]))
            .unwrap();
        for check in [check_search, check_list, check_change] {
            assert_eq!(check(&p(private), &owner), Ok(()));
            assert_eq!(check(&p(private), &squashed), Err(Errno::EACCES));
            assert_eq!(check(&p(private), &who(0, 0, &[])), Ok(()), "root");
        }
        let listed_only = dir(0o755, 0);
        assert_eq!(check_search(&p(listed_only), &squashed), Ok(()));
        assert_eq!(check_list(&p(listed_only), &squashed), Ok(()));
        assert_eq!(check_change(&p(listed_only), &squashed), Err(Errno::EACCES));
        // Search without read: names can be looked up, not listed.
        let blind = dir(0o711, 0);
        assert_eq!(check_search(&p(blind), &owner), Ok(()));
        assert_eq!(check_list(&p(blind), &owner), Err(Errno::EACCES));
        // Not a directory: the namespace says ENOTDIR.
        assert_eq!(check_change(&p(file(0o400, 1, 1)), &owner), Ok(()));
    }

    #[test]
    fn the_sticky_bit_keeps_others_names_and_moved_directories_need_write_on_themselves() {
        let tmp = dir(0o1777, 0);
        let (alice, bob) = (who(1000, 1000, &[]), who(2000, 2000, &[]));
        let hers = file(0o644, 1000, 1000);
        assert_eq!(check_sticky(&tmp, &hers, &alice), Ok(()));
        assert_eq!(check_sticky(&tmp, &hers, &bob), Err(Errno::EPERM));
        assert_eq!(check_sticky(&tmp, &hers, &who(0, 0, &[])), Ok(()));
        let open = dir(0o777, 0);
        assert_eq!(check_sticky(&open, &hers, &bob), Ok(()));
        assert_eq!(
            check_rename((&p(tmp), Some(&p(hers))), (&p(open), None), 0, &bob),
            Err(Errno::EPERM)
        );
        assert_eq!(
            check_rename((&p(open), None), (&p(tmp), Some(&p(hers))), 0, &bob),
            Err(Errno::EPERM),
            "nor replace them"
        );
        let (a, b) = (
            dir(0o777, 0),
            Attr {
                ino: 3,
                ..dir(0o777, 0)
            },
        );
        let theirs = dir(0o755, 1000);
        assert_eq!(
            check_rename((&p(a), Some(&p(theirs))), (&p(b), None), 0, &bob),
            Err(Errno::EACCES),
            "its .. would change"
        );
        assert_eq!(
            check_rename((&p(a), Some(&p(theirs))), (&p(a), None), 0, &bob),
            Ok(())
        );
        // An exchange moves the other directory too (a reviewer swapped theirs for its own).
        let mine = dir(0o755, 2000);
        assert_eq!(
            check_rename(
                (&p(a), Some(&p(mine))),
                (&p(b), Some(&p(theirs))),
                RENAME_EXCHANGE,
                &bob
            ),
            Err(Errno::EACCES)
        );
        assert_eq!(
            check_rename((&p(a), Some(&p(mine))), (&p(b), Some(&p(theirs))), 0, &bob),
            Ok(()),
            "replacing it is the target directory's write permission's business"
        );
    }

    #[test]
    fn a_set_group_id_file_in_a_set_group_id_directory_keeps_the_bit_for_members_and_root() {
        let shared = Attr {
            gid: 100,
            ..dir(0o2777, 0)
        };
        let prog = Owner {
            perm: 0o2755,
            uid: 1000,
            gid: 1000,
            umask: 0,
        };
        let kept = |c: &Caller| made_in(prog, &shared, c).perm;
        assert_eq!(kept(&who(1000, 1000, &[100])), 0o2755, "a member");
        assert_eq!(kept(&who(0, 0, &[])), 0o2755, "root");
        assert_eq!(kept(&who(1000, 1000, &[])), 0o755, "not a member");
        assert_eq!(
            made_in(prog, &dir(0o777, 0), &who(1000, 1000, &[])).perm,
            0o2755
        );
    }

    #[test]
    fn opens_check_access_kind_and_mode() {
        let f = file(0o600, 1000, 100);
        assert_eq!(
            check_open(&p(f), &who(2000, 100, &[]), FileAccess::READ),
            Err(Errno::EACCES)
        );
        assert_eq!(
            check_open(
                &p(f),
                &who(1000, 1, &[]),
                FileAccess::READ | FileAccess::WRITE
            ),
            Ok(())
        );
        assert_eq!(
            check_open(&p(f), &who(1000, 1, &[]), FileAccess::empty()),
            Err(Errno::EINVAL)
        );
        // execve needs the execute bit, not the read bit; root needs some execute bit.
        let tool = file(0o711, 1000, 100);
        assert_eq!(
            check_open(&p(tool), &who(2000, 5, &[]), FileAccess::EXEC),
            Ok(())
        );
        assert_eq!(
            check_open(&p(tool), &who(2000, 5, &[]), FileAccess::READ),
            Err(Errno::EACCES)
        );
        assert_eq!(
            check_open(&p(f), &who(0, 0, &[]), FileAccess::EXEC),
            Err(Errno::EACCES)
        );
        assert_eq!(
            check_open(&p(tool), &who(0, 0, &[]), FileAccess::EXEC),
            Ok(())
        );
        let d = Attr {
            kind: FileKind::Directory,
            ..file(0o777, 0, 0)
        };
        assert_eq!(
            check_open(&p(d), &who(1, 1, &[]), FileAccess::WRITE),
            Err(Errno::EISDIR)
        );
        assert_eq!(check_open(&p(d), &who(1, 1, &[]), FileAccess::READ), Ok(()));
    }

    #[test]
    fn chmod_chown_truncate_and_times_follow_posix() {
        let f = file(0o644, 1000, 100);
        let owner = who(1000, 100, &[200]);
        let other = who(2000, 300, &[]);
        let mode = AttrChanges {
            mode: Some(0o777),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(f), &other, &mode, false),
            Err(Errno::EPERM)
        );
        assert_eq!(check_setattr(&p(f), &owner, &mode, false), Ok(()));
        // A writer who is not the owner may clear the set-id bits, and only that.
        let setuid = file(0o4666, 1000, 100);
        let clear = AttrChanges {
            mode: Some(0o666),
            ..Default::default()
        };
        assert_eq!(check_setattr(&p(setuid), &other, &clear, false), Ok(()));
        // Set-group-ID without group execute stays when set-user-ID goes, as Linux keeps it.
        let locking = file(0o6767, 1000, 100);
        let clear_suid = AttrChanges {
            mode: Some(0o2767),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(locking), &other, &clear_suid, false),
            Ok(())
        );
        let and_gexec = AttrChanges {
            mode: Some(0o2777),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(locking), &other, &and_gexec, false),
            Err(Errno::EPERM)
        );
        let widen = AttrChanges {
            mode: Some(0o4777),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(setuid), &other, &widen, false),
            Err(Errno::EPERM)
        );
        let give = AttrChanges {
            uid: Some(2000),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(f), &owner, &give, false),
            Err(Errno::EPERM)
        );
        assert_eq!(check_setattr(&p(f), &who(0, 0, &[]), &give, false), Ok(()));
        let chgrp = |g| AttrChanges {
            gid: Some(g),
            ..Default::default()
        };
        assert_eq!(check_setattr(&p(f), &owner, &chgrp(200), false), Ok(()));
        assert_eq!(
            check_setattr(&p(f), &owner, &chgrp(999), false),
            Err(Errno::EPERM)
        );
        assert_eq!(
            check_setattr(&p(f), &other, &chgrp(300), false),
            Err(Errno::EPERM)
        );
        let cut = AttrChanges {
            size: Some(0),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(f), &other, &cut, false),
            Err(Errno::EACCES)
        );
        assert_eq!(
            check_setattr(&p(f), &other, &cut, true),
            Ok(()),
            "a writable handle"
        );
        let touch = AttrChanges {
            mtime: Some(Timestamp::now()),
            ..Default::default()
        };
        assert_eq!(
            check_setattr(&p(f), &other, &touch, false),
            Err(Errno::EPERM)
        );
        assert_eq!(
            check_setattr(&p(file(0o666, 1, 1)), &other, &touch, false),
            Ok(())
        );
    }

    #[test]
    fn root_squash_makes_root_nobody() {
        let squash = Policy { root_squash: true };
        let c = squash.caller(&who(0, 0, &[0, 5])).unwrap();
        assert_eq!(
            (c.uid, c.gid, &c.groups[..]),
            (NOBODY, NOBODY, &[NOBODY, 5][..])
        );
        assert!(!may(&p(file(0o600, 0, 0)), &c, FileAccess::READ));
        let o = squash.owner(Owner {
            perm: 0o600,
            uid: 0,
            gid: 0,
            umask: 0,
        });
        assert_eq!((o.uid, o.gid), (NOBODY, NOBODY));
        let plain = Policy::default();
        assert_eq!(plain.caller(&who(0, 0, &[])).unwrap().uid, 0);
        let many = who(1, 1, &vec![1; MAX_GROUPS + 1]);
        assert_eq!(plain.caller(&many), Err(Errno::EINVAL));
    }
}
