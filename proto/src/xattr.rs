//! Extended attributes: their namespaces, the bounds Linux's VFS sets them (and which the
//! metadata node keeps), and their values on the wire.

use crate::errno::Errno;
use crate::wire::{bad, DecodeError, Reader, Wire, Writer};

/// The longest name, its namespace prefix included.
pub const XATTR_NAME_MAX: usize = 255;
/// The largest value.
pub const XATTR_SIZE_MAX: usize = 65536;
/// The most bytes the names of one inode take as listxattr(2) hands them out (each with a NUL).
pub const XATTR_LIST_MAX: usize = 65536;
/// The most bytes the names and values of one inode take together.
pub const XATTR_TOTAL_MAX: usize = 256 << 10;

/// setxattr(2): fail with EEXIST if the attribute exists.
pub const XATTR_CREATE: u32 = 1;
/// setxattr(2): fail with ENODATA if the attribute does not exist.
pub const XATTR_REPLACE: u32 = 2;

/// The namespace of an attribute, by its name's prefix (xattr(7)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrClass {
    /// `user.`: regular files and directories, read and written as the file's bits allow.
    User,
    /// `trusted.`: root's alone; others neither see nor set them.
    Trusted,
    /// `security.`: anyone reads them, root sets them (Linux's capability rules, no LSM).
    Security,
    /// `system.posix_acl_access` and `system.posix_acl_default`: POSIX ACLs, read by anyone,
    /// set by the file's owner.
    PosixAcl,
}

/// The attribute that holds a file's POSIX access ACL.
pub const POSIX_ACL_ACCESS: &[u8] = b"system.posix_acl_access";
/// The attribute that holds a directory's POSIX default ACL.
pub const POSIX_ACL_DEFAULT: &[u8] = b"system.posix_acl_default";

impl XattrClass {
    /// The class of `name`: EOPNOTSUPP for another namespace (other `system.` attributes among
    /// them), ERANGE for a name too long or empty, EINVAL for a bare prefix.
    pub fn of(name: &[u8]) -> Result<XattrClass, Errno> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(Errno::ERANGE);
        }
        if name == POSIX_ACL_ACCESS || name == POSIX_ACL_DEFAULT {
            return Ok(XattrClass::PosixAcl);
        }
        let (class, prefix): (_, &[u8]) = if name.starts_with(b"user.") {
            (XattrClass::User, b"user.")
        } else if name.starts_with(b"trusted.") {
            (XattrClass::Trusted, b"trusted.")
        } else if name.starts_with(b"security.") {
            (XattrClass::Security, b"security.")
        } else {
            return Err(Errno::ENOTSUP);
        };
        if name.len() == prefix.len() || name.contains(&0) {
            return Err(Errno::EINVAL);
        }
        Ok(class)
    }
}

/// An attribute's value: bytes, counted by a u32 (values reach 64 KiB, past what a u16 counts),
/// refused over [`XATTR_SIZE_MAX`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct XattrValue(pub Vec<u8>);

impl std::fmt::Debug for XattrValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "XattrValue({} bytes)", self.0.len())
    }
}

impl Wire for XattrValue {
    fn put(&self, w: &mut Writer) {
        (self.0.len() as u32).put(w);
        w.0.extend_from_slice(&self.0);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = u32::get(r)? as usize;
        if n > XATTR_SIZE_MAX {
            return bad(format!("an attribute value of {n} bytes"));
        }
        Ok(XattrValue(r.take(n)?.to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fall_in_their_namespaces_or_are_refused() {
        assert_eq!(XattrClass::of(b"user.x"), Ok(XattrClass::User));
        assert_eq!(XattrClass::of(b"trusted.x"), Ok(XattrClass::Trusted));
        assert_eq!(
            XattrClass::of(b"security.capability"),
            Ok(XattrClass::Security)
        );
        assert_eq!(
            XattrClass::of(b"system.posix_acl_access"),
            Ok(XattrClass::PosixAcl)
        );
        assert_eq!(
            XattrClass::of(b"system.posix_acl_default"),
            Ok(XattrClass::PosixAcl)
        );
        assert_eq!(XattrClass::of(b"system.nfs4_acl"), Err(Errno::ENOTSUP));
        assert_eq!(XattrClass::of(b"other.x"), Err(Errno::ENOTSUP));
        assert_eq!(XattrClass::of(b"user."), Err(Errno::EINVAL));
        assert_eq!(XattrClass::of(b""), Err(Errno::ERANGE));
        let long = [b"user.".as_slice(), &[b'a'; 251]].concat();
        assert_eq!(XattrClass::of(&long), Err(Errno::ERANGE));
        assert_eq!(XattrClass::of(&long[..255]), Ok(XattrClass::User));
    }

    #[test]
    fn values_up_to_64_kib_cross_the_wire_and_larger_ones_are_refused() {
        for len in [0, 1, 65535, 65536] {
            let v = XattrValue(vec![7; len]);
            let mut w = Writer::default();
            v.put(&mut w);
            let mut r = Reader::new(&w.0);
            assert_eq!(XattrValue::get(&mut r).unwrap(), v);
            assert!(r.is_empty());
        }
        let mut w = Writer::default();
        (65537u32).put(&mut w);
        w.0.extend_from_slice(&[0; 65537]);
        assert!(XattrValue::get(&mut Reader::new(&w.0)).is_err());
    }
}
