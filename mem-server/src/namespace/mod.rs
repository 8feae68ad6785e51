//! The namespace: inodes, directories, attributes, link counts and each file's chunk map. Pure
//! in-memory logic with POSIX semantics, no I/O; every operation returns an errno on failure.
//!
//! Permission checks are the kernel's (the client mounts with `default_permissions`); this module
//! enforces structure: names, emptiness, types, link counts, unlink-while-open.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rfs_proto::message::Committed;
use rfs_proto::types::{
    Attr, AttrChanges, ChunkRef, DirEntry, FileKind, Ino, Name, Owner, Replicas, Timestamp,
    NAME_MAX, RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT,
};
use rfs_proto::Errno;

use crate::record::Record;
use crate::spans;

mod acls;
mod chunks;
mod durable;
mod files;
#[cfg(test)]
mod tests;
mod tree;
mod xattrs;

enum Data {
    File {
        chunks: BTreeMap<u64, Replicas>,
    },
    Dir {
        entries: BTreeMap<Vec<u8>, Ino>,
        parent: Ino,
    },
    Symlink(Vec<u8>),
    Special,
}

/// An inode's extended attributes by name. Boxed: most inodes have none, and pay 8 bytes for
/// that rather than a map's 24 (a million inodes: 16 MB).
#[allow(clippy::box_collection)]
type Xattrs = Option<Box<BTreeMap<Vec<u8>, Vec<u8>>>>;

struct Inode {
    attr: Attr,
    data: Data,
    /// Open handles; an unlinked inode lives until the last one is released.
    open: u32,
    xattrs: Xattrs,
}

fn now() -> Timestamp {
    Timestamp::now()
}

pub struct Namespace {
    inodes: HashMap<Ino, Inode>,
    /// The most inodes creates may make (restoring from the journal is not held to it).
    max_inodes: u64,
    next_ino: Ino,
    chunk_size: u64,
    /// Changes not yet taken for the journal (none: not journaled).
    log: Option<Vec<Record>>,
    /// Inodes whose attributes changed since the journal last took them.
    touched: BTreeSet<Ino>,
    /// What every inode's extended attributes cost, and the most they may (see `xattrs`).
    xattr_bytes: u64,
    max_xattr_bytes: u64,
}

/// The set-group-ID bit of a mode.
pub(crate) const SETGID: u16 = 0o2000;

/// Names are bytes, as Linux has them: anything but "", ".", "..", '/' and NUL, up to NAME_MAX.
fn check_name(name: &[u8]) -> Result<(), Errno> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(Errno::EINVAL);
    }
    if name.len() > NAME_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    Ok(())
}

impl Namespace {
    pub fn new(chunk_size: u64) -> Namespace {
        let t = now();
        let root = Inode {
            attr: Attr {
                ino: ROOT,
                kind: FileKind::Directory,
                perm: 0o755,
                nlink: 2,
                uid: 0,
                gid: 0,
                rdev: 0,
                size: 0,
                atime: t,
                mtime: t,
                ctime: t,
                cuts: 0,
                acl: false,
                held: 0,
            },
            data: Data::Dir {
                entries: BTreeMap::new(),
                parent: ROOT,
            },
            open: 0,
            xattrs: None,
        };
        Namespace {
            inodes: HashMap::from([(ROOT, root)]),
            max_inodes: u64::MAX,
            next_ino: ROOT + 1,
            chunk_size,
            log: None,
            touched: BTreeSet::new(),
            xattr_bytes: 0,
            max_xattr_bytes: u64::MAX,
        }
    }

    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    pub fn inode_count(&self) -> u64 {
        self.inodes.len() as u64
    }

    /// The most inodes creates may make.
    pub fn max_inodes(&self) -> u64 {
        self.max_inodes
    }

    /// Holds creates to `max` inodes (those there already stay, however many).
    pub fn set_max_inodes(&mut self, max: u64) {
        self.max_inodes = max;
    }

    fn get(&self, ino: Ino) -> Result<&Inode, Errno> {
        self.inodes.get(&ino).ok_or(Errno::ENOENT)
    }

    /// The inode, to change: its attributes are journaled.
    fn get_mut(&mut self, ino: Ino) -> Result<&mut Inode, Errno> {
        let i = self.inodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        if self.log.is_some() {
            self.touched.insert(ino);
        }
        Ok(i)
    }

    fn note(&mut self, record: impl FnOnce() -> Record) {
        if let Some(log) = &mut self.log {
            log.push(record());
        }
    }

    /// Names `ino` as `name` in `dir` (None: removes the name).
    fn set_entry(&mut self, dir: Ino, name: &[u8], ino: Option<Ino>) -> Result<(), Errno> {
        let entries = self.entries_mut(dir)?;
        match ino {
            Some(ino) => entries.insert(name.to_vec(), ino),
            None => entries.remove(name),
        };
        self.note(|| Record::Entry {
            dir,
            name: name.to_vec(),
            ino: ino.unwrap_or(0),
        });
        Ok(())
    }

    /// Journals chunk `index` of `ino` as it now is.
    fn note_chunk(&mut self, ino: Ino, index: u64) {
        if self.log.is_some() {
            let replicas = self.replicas(ino, index).unwrap_or_default();
            self.note(|| Record::Chunk {
                ino,
                index,
                replicas,
            });
        }
    }

    fn entries(&self, dir: Ino) -> Result<&BTreeMap<Vec<u8>, Ino>, Errno> {
        match &self.get(dir)?.data {
            Data::Dir { entries, .. } => Ok(entries),
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn entries_mut(&mut self, dir: Ino) -> Result<&mut BTreeMap<Vec<u8>, Ino>, Errno> {
        match &mut self.get_mut(dir)?.data {
            Data::Dir { entries, .. } => Ok(entries),
            _ => Err(Errno::ENOTDIR),
        }
    }

    fn touch_dir(&mut self, dir: Ino) {
        let t = now();
        if let Ok(i) = self.get_mut(dir) {
            i.attr.mtime = t;
            i.attr.ctime = t;
        }
    }

    pub fn getattr(&self, ino: Ino) -> Result<Attr, Errno> {
        Ok(self.get(ino)?.attr)
    }

    pub fn lookup(&self, parent: Ino, name: impl AsRef<[u8]>) -> Result<Attr, Errno> {
        let name = name.as_ref();
        if name.len() > NAME_MAX {
            return Err(Errno::ENAMETOOLONG);
        }
        let entries = self.entries(parent)?;
        let ino = match name {
            b"." => parent,
            b".." => match &self.get(parent)?.data {
                Data::Dir { parent, .. } => *parent,
                _ => unreachable!("entries() checked it is a directory"),
            },
            _ => *entries.get(name).ok_or(Errno::ENOENT)?,
        };
        self.getattr(ino)
    }

    /// Drops one link of `ino`; frees it (returning its chunks) once unlinked and closed.
    fn drop_link(&mut self, ino: Ino) -> Vec<ChunkRef> {
        let Ok(i) = self.get_mut(ino) else {
            return Vec::new();
        };
        i.attr.nlink = i.attr.nlink.saturating_sub(1);
        i.attr.ctime = now();
        self.reap(ino)
    }

    fn reap(&mut self, ino: Ino) -> Vec<ChunkRef> {
        match self.inodes.get(&ino) {
            Some(i) if i.attr.nlink == 0 && i.open == 0 => {}
            _ => return Vec::new(),
        }
        self.note(|| Record::Gone(ino));
        let gone = self.inodes.remove(&ino);
        self.xattr_bytes -= gone.as_ref().map_or(0, |i| xattrs::cost_of(&i.xattrs));
        match gone.map(|i| i.data) {
            Some(Data::File { chunks }) => chunks.into_values().flatten().collect(),
            _ => Vec::new(),
        }
    }

    fn chunks(&self, ino: Ino) -> Result<&BTreeMap<u64, Replicas>, Errno> {
        match &self.get(ino)?.data {
            Data::File { chunks } => Ok(chunks),
            Data::Dir { .. } => Err(Errno::EISDIR),
            _ => Err(Errno::EINVAL),
        }
    }

    fn chunk_mut(&mut self, ino: Ino, index: u64) -> Option<&mut Replicas> {
        match &mut self.inodes.get_mut(&ino)?.data {
            Data::File { chunks } => chunks.get_mut(&index),
            _ => None,
        }
    }
}

/// Whether two references name the same chunk (whatever key each was granted with).
fn same_chunk(a: &ChunkRef, b: &ChunkRef) -> bool {
    a.node == b.node && a.addr == b.addr
}

/// Whether two references name the same copy as it is now: the same place and the same span
/// (a copy trimmed or grown since `b` was read is not the one `b` was read from).
fn same_copy(a: &ChunkRef, b: &ChunkRef) -> bool {
    same_chunk(a, b) && (a.lo, a.len) == (b.lo, b.len)
}
