//! Extended attributes of an inode: kept with it (so renames and hard links carry them, and
//! they go with its last link), journaled as they change, bounded as Linux bounds them. Who
//! may read or change which is the operations' to check (`access::check_xattr`).

use rfs_proto::xattr::{
    XATTR_CREATE, XATTR_LIST_MAX, XATTR_REPLACE, XATTR_SIZE_MAX, XATTR_TOTAL_MAX,
};

use super::*;

impl Namespace {
    /// The value of `ino`'s attribute `name` (ENODATA: none).
    pub fn get_xattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>, Errno> {
        let i = self.get(ino)?;
        let value = i.xattrs.as_ref().and_then(|x| x.get(name));
        value.cloned().ok_or(Errno::ENODATA)
    }

    /// The names of `ino`'s attributes.
    pub fn xattr_names(&self, ino: Ino) -> Result<Vec<Vec<u8>>, Errno> {
        let i = self.get(ino)?;
        Ok(i.xattrs.iter().flat_map(|x| x.keys().cloned()).collect())
    }

    /// Sets `ino`'s attribute `name` to `value`, with setxattr(2)'s `flags`: EEXIST (create)
    /// or ENODATA (replace) as they say, E2BIG for a value over 64 KiB, ENOSPC past the
    /// inode's bounds (its names as listed, or its names and values together). The change
    /// time moves; the attributes after.
    pub fn set_xattr(
        &mut self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) -> Result<Attr, Errno> {
        if value.len() > XATTR_SIZE_MAX {
            return Err(Errno::E2BIG);
        }
        let x = self.get(ino)?.xattrs.as_deref();
        let old = x.and_then(|x| x.get(name));
        match old {
            Some(_) if flags & XATTR_CREATE != 0 => return Err(Errno::EEXIST),
            None if flags & XATTR_REPLACE != 0 => return Err(Errno::ENODATA),
            _ => {}
        }
        let (mut list, mut total) = x.map_or((0, 0), sizes);
        if old.is_none() {
            list += name.len() + 1;
            total += name.len();
        }
        total = total - old.map_or(0, Vec::len) + value.len();
        if list > XATTR_LIST_MAX || total > XATTR_TOTAL_MAX {
            return Err(Errno::ENOSPC);
        }
        let i = self.get_mut(ino)?;
        i.xattrs
            .get_or_insert_default()
            .insert(name.to_vec(), value.to_vec());
        i.attr.ctime = now();
        let attr = i.attr;
        self.note(|| Record::Xattr {
            ino,
            name: name.to_vec(),
            value: Some(value.to_vec()),
        });
        Ok(attr)
    }

    /// Removes `ino`'s attribute `name` (ENODATA: none); the attributes after.
    pub fn remove_xattr(&mut self, ino: Ino, name: &[u8]) -> Result<Attr, Errno> {
        let present = self
            .get(ino)?
            .xattrs
            .as_ref()
            .is_some_and(|x| x.contains_key(name));
        if !present {
            return Err(Errno::ENODATA);
        }
        let i = self.get_mut(ino)?;
        if let Some(x) = &mut i.xattrs {
            x.remove(name);
            if x.is_empty() {
                i.xattrs = None;
            }
        }
        i.attr.ctime = now();
        let attr = i.attr;
        self.note(|| Record::Xattr {
            ino,
            name: name.to_vec(),
            value: None,
        });
        Ok(attr)
    }
}

/// What an inode's attributes take: their names as listxattr(2) lists them (each with its
/// NUL), and their names and values together.
fn sizes(x: &BTreeMap<Vec<u8>, Vec<u8>>) -> (usize, usize) {
    x.iter().fold((0, 0), |(list, total), (n, v)| {
        (list + n.len() + 1, total + n.len() + v.len())
    })
}
