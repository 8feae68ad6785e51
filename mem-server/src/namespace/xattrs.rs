//! Extended attributes of an inode: kept with it (so renames and hard links carry them, and
//! they go with its last link), journaled as they change, bounded as Linux bounds them per
//! inode and, over the whole namespace, by what the node budgets them (each costing its name,
//! its value and [`ENTRY_COST`]: a user must not grow the node's memory without bound, as
//! with the file limit). Who may read or change which is the operations' to check
//! (`access::check_xattr`).

use rfs_proto::xattr::{
    POSIX_ACL_ACCESS, XATTR_CREATE, XATTR_LIST_MAX, XATTR_REPLACE, XATTR_SIZE_MAX, XATTR_TOTAL_MAX,
};

use super::*;

/// The attribute that holds a file's capabilities.
const CAPABILITIES: &[u8] = b"security.capability";

/// What an attribute costs beyond its name and value (the map's node and two allocations).
pub(super) const ENTRY_COST: u64 = 64;

/// Keeps `i`'s attributes saying whether it has an access ACL, after its extended attributes
/// changed.
fn note_acl(i: &mut Inode) {
    i.attr.acl = (i.xattrs.as_ref()).is_some_and(|x| x.contains_key(POSIX_ACL_ACCESS));
}

/// What one attribute costs the node.
pub(super) fn cost(name: &[u8], value: &[u8]) -> u64 {
    (name.len() + value.len()) as u64 + ENTRY_COST
}

/// What an inode's attributes cost the node.
pub(super) fn cost_of(x: &Xattrs) -> u64 {
    x.iter()
        .flat_map(|x| x.iter())
        .map(|(n, v)| cost(n, v))
        .sum()
}

impl Namespace {
    /// Holds the extended attributes of every inode together to `max` bytes (as costed by
    /// [`cost`]): sets past it fail with ENOSPC (what is there already stays).
    pub fn set_max_xattr_bytes(&mut self, max: u64) {
        self.max_xattr_bytes = max;
    }

    /// What every inode's extended attributes cost, and the most they may.
    pub fn xattr_bytes(&self) -> (u64, u64) {
        (self.xattr_bytes, self.max_xattr_bytes)
    }

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
        let was = old.map_or(0, |v| cost(name, v));
        let all = self.xattr_bytes - was + cost(name, value);
        if list > XATTR_LIST_MAX || total > XATTR_TOTAL_MAX || all > self.max_xattr_bytes {
            return Err(Errno::ENOSPC);
        }
        self.xattr_bytes = all;
        let i = self.get_mut(ino)?;
        i.xattrs
            .get_or_insert_default()
            .insert(name.to_vec(), value.to_vec());
        note_acl(i);
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
        let mut freed = 0;
        if let Some(x) = &mut i.xattrs {
            freed = x.remove(name).map_or(0, |v| cost(name, &v));
            if x.is_empty() {
                i.xattrs = None;
            }
        }
        note_acl(i);
        i.attr.ctime = now();
        let attr = i.attr;
        self.xattr_bytes -= freed;
        self.note(|| Record::Xattr {
            ino,
            name: name.to_vec(),
            value: None,
        });
        Ok(attr)
    }
}

impl Namespace {
    /// Takes `ino`'s file capabilities away, if it has any (a write by someone without
    /// CAP_FSETID does, as Linux's does).
    pub(super) fn drop_capabilities(&mut self, ino: Ino) {
        if self.get_xattr(ino, CAPABILITIES).is_ok() {
            let _ = self.remove_xattr(ino, CAPABILITIES);
        }
    }

    /// Sets `ino`'s attribute `name` to `value`, journaled, past no check: for what is known to
    /// fit (an ACL handed down, its cost checked beforehand; an ACL rewritten at its own size,
    /// which a budget lowered since must not refuse).
    pub(super) fn put_xattr(&mut self, ino: Ino, name: &[u8], value: &[u8]) {
        if self.restore_xattr(ino, name, Some(value)) {
            self.note(|| Record::Xattr {
                ino,
                name: name.to_vec(),
                value: Some(value.to_vec()),
            });
        }
    }

    /// A journaled change of `ino`'s attribute `name` (None: it went), replayed: false if the
    /// inode is not there. Replays are not held to the budget (a node restarted with a
    /// smaller one keeps what it had).
    pub(super) fn restore_xattr(&mut self, ino: Ino, name: &[u8], value: Option<&[u8]>) -> bool {
        let Some(i) = self.inodes.get_mut(&ino) else {
            return false;
        };
        let x = i.xattrs.get_or_insert_default();
        let was = match value {
            Some(v) => x.insert(name.to_vec(), v.to_vec()),
            None => x.remove(name),
        };
        if x.is_empty() {
            i.xattrs = None;
        }
        note_acl(i);
        self.xattr_bytes -= was.map_or(0, |v| cost(name, &v));
        self.xattr_bytes += value.map_or(0, |v| cost(name, v));
        true
    }
}

/// What an inode's attributes take: their names as listxattr(2) lists them (each with its
/// NUL), and their names and values together.
fn sizes(x: &BTreeMap<Vec<u8>, Vec<u8>>) -> (usize, usize) {
    x.iter().fold((0, 0), |(list, total), (n, v)| {
        (list + n.len() + 1, total + n.len() + v.len())
    })
}
