//! Extended attributes: read, listed, set and removed as the caller may (see
//! [`crate::access::check_xattr`]). A session that read an inode's attributes is told when they
//! change, as it is of the inode's other attributes (it may cache both). POSIX ACLs are set
//! through theirs, checked and kept in step with the mode bits (see [`crate::acl`]).

use rfs_proto::message::{GetXattr, ListXattr, RemoveXattr, SetXattr};
use rfs_proto::types::{Attr, Caller, Ino};
use rfs_proto::xattr::{XattrValue, POSIX_ACL_ACCESS, POSIX_ACL_DEFAULT};
use rfs_proto::Errno;

use super::{answer, Answer, Ctx};
use crate::access::{acl_clears_setgid, check_xattr, shows_xattr, XattrUse};
use crate::acl::Acl;

impl Ctx<'_> {
    /// The caller as the checks see them, if they may `how` `name` of `ino`; and the inode's
    /// attributes.
    fn xattr_caller(
        &self,
        caller: &Caller,
        ino: Ino,
        name: &[u8],
        how: XattrUse,
    ) -> Result<(Caller, Attr), Errno> {
        let c = self.svc.policy.caller(caller)?;
        let p = self.st.ns.perms(ino)?;
        check_xattr(&p, &c, name, how)?;
        Ok((c, p.attr))
    }

    /// The session read `ino`'s extended attributes: it is told when they change.
    fn read_xattrs_of(&mut self, ino: Ino) {
        self.st.holders.saw(self.cs.id, ino);
    }

    /// `ino`'s extended attributes changed: its holders are told, and the caller gets its
    /// attributes after.
    fn xattrs_changed(&mut self, r: Result<Attr, Errno>, ino: Ino) -> Result<Attr, Errno> {
        if r.is_ok() {
            self.fx.change.inodes.push((ino, false));
        }
        self.told(r, None)
    }
}

pub(super) fn get_xattr(cx: &mut Ctx<'_>, m: &GetXattr) -> Answer {
    let r = cx
        .xattr_caller(&m.caller, m.ino, &m.name.0, XattrUse::Read)
        .and_then(|_| cx.st.ns.get_xattr(m.ino, &m.name.0));
    // A value or its absence, either may be cached.
    if matches!(r, Ok(_) | Err(Errno::ENODATA)) {
        cx.read_xattrs_of(m.ino);
    }
    answer(m, r.map(XattrValue))
}

pub(super) fn list_xattr(cx: &mut Ctx<'_>, m: &ListXattr) -> Answer {
    let r = cx.svc.policy.caller(&m.caller).and_then(|c| {
        let names = cx.st.ns.xattr_names(m.ino)?;
        let mut list = Vec::new();
        for n in names.iter().filter(|n| shows_xattr(&c, n)) {
            list.extend_from_slice(n);
            list.push(0);
        }
        Ok(XattrValue(list))
    });
    if r.is_ok() {
        cx.read_xattrs_of(m.ino);
    }
    answer(m, r)
}

pub(super) fn set_xattr(cx: &mut Ctx<'_>, m: &SetXattr) -> Answer {
    let (ino, name) = (m.ino, m.name.0.as_slice());
    let r = cx
        .xattr_caller(&m.caller, ino, name, XattrUse::Set)
        .and_then(|(c, a)| {
            let ns = &mut cx.st.ns;
            if name != POSIX_ACL_ACCESS && name != POSIX_ACL_DEFAULT {
                return ns.set_xattr(ino, name, &m.value.0, m.flags);
            }
            // An ACL without entries removes the ACL, as on Linux.
            match Acl::parse(&m.value.0)? {
                Some(acl) if name == POSIX_ACL_ACCESS => {
                    ns.set_access_acl(ino, &acl, acl_clears_setgid(&a, &c))
                }
                Some(acl) => ns.set_xattr(ino, name, &acl.to_bytes(), 0),
                None => match ns.remove_xattr(ino, name) {
                    Err(Errno::ENODATA) => Ok(a),
                    r => r,
                },
            }
        });
    answer(m, cx.xattrs_changed(r, ino))
}

pub(super) fn remove_xattr(cx: &mut Ctx<'_>, m: &RemoveXattr) -> Answer {
    let name = m.name.0.as_slice();
    let acl = name == POSIX_ACL_ACCESS || name == POSIX_ACL_DEFAULT;
    let r = cx
        .xattr_caller(&m.caller, m.ino, name, XattrUse::Remove)
        .and_then(|(_, a)| match cx.st.ns.remove_xattr(m.ino, name) {
            // Taking away an ACL there is none of leaves nothing to do, as on Linux.
            Err(Errno::ENODATA) if acl => Ok(a),
            r => r,
        });
    answer(m, cx.xattrs_changed(r, m.ino))
}
