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

mod durable;

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

struct Inode {
    attr: Attr,
    data: Data,
    /// Open handles; an unlinked inode lives until the last one is released.
    open: u32,
}

fn now() -> Timestamp {
    Timestamp::now()
}

pub struct Namespace {
    inodes: HashMap<Ino, Inode>,
    next_ino: Ino,
    chunk_size: u64,
    /// Changes not yet taken for the journal (none: not journaled).
    log: Option<Vec<Record>>,
    /// Inodes whose attributes changed since the journal last took them.
    touched: BTreeSet<Ino>,
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
            },
            data: Data::Dir {
                entries: BTreeMap::new(),
                parent: ROOT,
            },
            open: 0,
        };
        Namespace {
            inodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            chunk_size,
            log: None,
            touched: BTreeSet::new(),
        }
    }

    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    pub fn inode_count(&self) -> u64 {
        self.inodes.len() as u64
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

    fn insert(
        &mut self,
        parent: Ino,
        name: &[u8],
        (kind, rdev): (FileKind, u32),
        owner: Owner,
        data: Data,
    ) -> Result<Attr, Errno> {
        let Owner {
            mut perm,
            uid,
            mut gid,
        } = owner;
        check_name(name)?;
        if self.entries(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let dir = self.get(parent)?.attr;
        if dir.perm & SETGID != 0 {
            // A set-group-ID directory gives what is made in it its group, and its
            // subdirectories the bit, as on a local file system (whether a file keeps a bit
            // it was made with depends on the maker's groups: `access::made_in`).
            if kind == FileKind::Directory {
                perm |= SETGID;
            }
            gid = dir.gid;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let t = now();
        let is_dir = kind == FileKind::Directory;
        let (dir_parent, target) = match &data {
            Data::Dir { parent, .. } => (*parent, Vec::new()),
            Data::Symlink(t) => (0, t.clone()),
            _ => (0, Vec::new()),
        };
        let attr = Attr {
            ino,
            kind,
            perm: perm & 0o7777,
            nlink: if is_dir { 2 } else { 1 },
            uid,
            gid,
            rdev,
            size: match &data {
                Data::Symlink(t) => t.len() as u64,
                _ => 0,
            },
            atime: t,
            mtime: t,
            ctime: t,
            cuts: 0,
        };
        self.inodes.insert(
            ino,
            Inode {
                attr,
                data,
                open: 0,
            },
        );
        self.note(|| Record::Created {
            attr,
            parent: dir_parent,
            target,
        });
        self.set_entry(parent, name, Some(ino))?;
        if is_dir {
            self.get_mut(parent)?.attr.nlink += 1;
        }
        self.touch_dir(parent);
        Ok(attr)
    }

    pub fn mknod(
        &mut self,
        parent: Ino,
        name: impl AsRef<[u8]>,
        kind: FileKind,
        rdev: u32,
        owner: Owner,
    ) -> Result<Attr, Errno> {
        let data = match kind {
            FileKind::RegularFile => Data::File {
                chunks: BTreeMap::new(),
            },
            FileKind::NamedPipe
            | FileKind::CharDevice
            | FileKind::BlockDevice
            | FileKind::Socket => Data::Special,
            FileKind::Directory | FileKind::Symlink => return Err(Errno::EINVAL),
        };
        self.insert(parent, name.as_ref(), (kind, rdev), owner, data)
    }

    pub fn mkdir(
        &mut self,
        parent: Ino,
        name: impl AsRef<[u8]>,
        owner: Owner,
    ) -> Result<Attr, Errno> {
        let data = Data::Dir {
            entries: BTreeMap::new(),
            parent,
        };
        self.insert(parent, name.as_ref(), (FileKind::Directory, 0), owner, data)
    }

    pub fn symlink(
        &mut self,
        parent: Ino,
        name: impl AsRef<[u8]>,
        target: impl AsRef<[u8]>,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, Errno> {
        let target = target.as_ref();
        if target.is_empty() {
            return Err(Errno::ENOENT);
        }
        if target.len() > 4096 {
            return Err(Errno::ENAMETOOLONG);
        }
        let data = Data::Symlink(target.to_vec());
        let owner = Owner {
            perm: 0o777,
            uid,
            gid,
        };
        self.insert(parent, name.as_ref(), (FileKind::Symlink, 0), owner, data)
    }

    pub fn readlink(&self, ino: Ino) -> Result<Name, Errno> {
        match &self.get(ino)?.data {
            Data::Symlink(t) => Ok(Name(t.clone())),
            _ => Err(Errno::EINVAL),
        }
    }

    pub fn link(
        &mut self,
        ino: Ino,
        newparent: Ino,
        newname: impl AsRef<[u8]>,
    ) -> Result<Attr, Errno> {
        let newname = newname.as_ref();
        check_name(newname)?;
        if self.get(ino)?.attr.kind == FileKind::Directory {
            return Err(Errno::EPERM);
        }
        if self.entries(newparent)?.contains_key(newname) {
            return Err(Errno::EEXIST);
        }
        self.set_entry(newparent, newname, Some(ino))?;
        let i = self.get_mut(ino)?;
        i.attr.nlink += 1;
        i.attr.ctime = now();
        let attr = i.attr;
        self.touch_dir(newparent);
        Ok(attr)
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
        match self.inodes.remove(&ino).map(|i| i.data) {
            Some(Data::File { chunks }) => chunks.into_values().flatten().collect(),
            _ => Vec::new(),
        }
    }

    pub fn unlink(&mut self, parent: Ino, name: impl AsRef<[u8]>) -> Result<Vec<ChunkRef>, Errno> {
        let name = name.as_ref();
        check_name(name)?;
        let ino = *self.entries(parent)?.get(name).ok_or(Errno::ENOENT)?;
        if self.get(ino)?.attr.kind == FileKind::Directory {
            return Err(Errno::EISDIR);
        }
        self.set_entry(parent, name, None)?;
        self.touch_dir(parent);
        Ok(self.drop_link(ino))
    }

    pub fn rmdir(&mut self, parent: Ino, name: impl AsRef<[u8]>) -> Result<(), Errno> {
        let name = name.as_ref();
        if name == b"." {
            return Err(Errno::EINVAL);
        }
        if name == b".." {
            return Err(Errno::ENOTEMPTY);
        }
        check_name(name)?;
        let ino = *self.entries(parent)?.get(name).ok_or(Errno::ENOENT)?;
        if !self.entries(ino)?.is_empty() {
            return Err(Errno::ENOTEMPTY);
        }
        self.set_entry(parent, name, None)?;
        self.get_mut(parent)?.attr.nlink -= 1;
        self.touch_dir(parent);
        let i = self.get_mut(ino)?;
        i.attr.nlink = 0;
        self.reap(ino);
        Ok(())
    }

    /// Whether `ino` is `ancestor` or lies below it.
    fn is_within(&self, mut ino: Ino, ancestor: Ino) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            match self.inodes.get(&ino).map(|i| &i.data) {
                Some(Data::Dir { parent, .. }) if *parent != ino => ino = *parent,
                _ => return false,
            }
        }
    }

    fn set_parent(&mut self, dir: Ino, new_parent: Ino) {
        if let Some(Inode {
            data: Data::Dir { parent, .. },
            ..
        }) = self.inodes.get_mut(&dir)
        {
            *parent = new_parent;
            self.note(|| Record::Parent {
                dir,
                parent: new_parent,
            });
        }
    }

    /// rename(2) with renameat2's RENAME_NOREPLACE and RENAME_EXCHANGE. Returns the chunks of
    /// a replaced file that are now free.
    pub fn rename(
        &mut self,
        parent: Ino,
        name: impl AsRef<[u8]>,
        newparent: Ino,
        newname: impl AsRef<[u8]>,
        flags: u32,
    ) -> Result<Vec<ChunkRef>, Errno> {
        let (name, newname) = (name.as_ref(), newname.as_ref());
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags == RENAME_NOREPLACE | RENAME_EXCHANGE
        {
            return Err(Errno::EINVAL);
        }
        check_name(name)?;
        check_name(newname)?;
        let src = *self.entries(parent)?.get(name).ok_or(Errno::ENOENT)?;
        let dst = self.entries(newparent)?.get(newname).copied();
        let src_is_dir = self.get(src)?.attr.kind == FileKind::Directory;
        if src_is_dir && self.is_within(newparent, src) {
            return Err(Errno::EINVAL);
        }
        if flags & RENAME_EXCHANGE != 0 {
            let dst = dst.ok_or(Errno::ENOENT)?;
            let dst_is_dir = self.get(dst)?.attr.kind == FileKind::Directory;
            if dst_is_dir && self.is_within(parent, dst) {
                return Err(Errno::EINVAL);
            }
            self.set_entry(parent, name, Some(dst))?;
            self.set_entry(newparent, newname, Some(src))?;
            if src_is_dir != dst_is_dir && parent != newparent {
                let (to_new, to_old) = if src_is_dir { (1i64, -1i64) } else { (-1, 1) };
                self.get_mut(newparent)?.attr.nlink =
                    (self.get(newparent)?.attr.nlink as i64 + to_new) as u32;
                self.get_mut(parent)?.attr.nlink =
                    (self.get(parent)?.attr.nlink as i64 + to_old) as u32;
            }
            if src_is_dir {
                self.set_parent(src, newparent);
            }
            if dst_is_dir {
                self.set_parent(dst, parent);
            }
            self.touch_dir(parent);
            self.touch_dir(newparent);
            return Ok(Vec::new());
        }
        let mut freed = Vec::new();
        if let Some(dst) = dst {
            if flags & RENAME_NOREPLACE != 0 {
                return Err(Errno::EEXIST);
            }
            if dst == src {
                return Ok(Vec::new());
            }
            let dst_is_dir = self.get(dst)?.attr.kind == FileKind::Directory;
            match (src_is_dir, dst_is_dir) {
                (true, false) => return Err(Errno::ENOTDIR),
                (false, true) => return Err(Errno::EISDIR),
                (true, true) if !self.entries(dst)?.is_empty() => return Err(Errno::ENOTEMPTY),
                _ => {}
            }
            self.set_entry(newparent, newname, None)?;
            if dst_is_dir {
                self.get_mut(newparent)?.attr.nlink -= 1;
                self.get_mut(dst)?.attr.nlink = 0;
                self.reap(dst);
            } else {
                freed = self.drop_link(dst);
            }
        }
        self.set_entry(parent, name, None)?;
        self.set_entry(newparent, newname, Some(src))?;
        if src_is_dir && parent != newparent {
            self.get_mut(parent)?.attr.nlink -= 1;
            self.get_mut(newparent)?.attr.nlink += 1;
            self.set_parent(src, newparent);
        }
        self.get_mut(src)?.attr.ctime = now();
        self.touch_dir(parent);
        self.touch_dir(newparent);
        Ok(freed)
    }

    /// Entries after `cookie` (0: from the start, with "." and ".."): at most `max` of them
    /// and `max_bytes` of reply (at least one entry, so a listing always moves on).
    pub fn readdir(
        &self,
        ino: Ino,
        cookie: u64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<DirEntry>, Errno> {
        let entries = self.entries(ino)?;
        let parent = match &self.get(ino)?.data {
            Data::Dir { parent, .. } => *parent,
            _ => unreachable!("entries() checked it is a directory"),
        };
        // Cookies: 1 = ".", 2 = "..", then 3 + the entry's position among the sorted names.
        let dots = [(1, ".", ino), (2, "..", parent)];
        let dots = dots
            .into_iter()
            .filter(|&(c, _, _)| cookie < c)
            .map(|(c, n, i)| (c, n.as_bytes(), i));
        let skip = cookie.saturating_sub(2) as usize;
        let named = entries
            .iter()
            .enumerate()
            .skip(skip)
            .map(|(pos, (name, &child))| (pos as u64 + 3, name.as_slice(), child));
        let mut out = Vec::new();
        let mut bytes = 0;
        for (cookie, name, child) in dots.chain(named) {
            let e = DirEntry {
                cookie,
                name: Name::from(name),
                attr: self.getattr(child)?,
            };
            if out.len() >= max || (!out.is_empty() && bytes + e.wire_len() > max_bytes) {
                break;
            }
            bytes += e.wire_len();
            out.push(e);
        }
        Ok(out)
    }

    /// Applies chmod/chown/truncate/utimens. Returns the new attributes and the chunks that a
    /// truncation freed.
    pub fn setattr(&mut self, ino: Ino, s: &AttrChanges) -> Result<(Attr, Vec<ChunkRef>), Errno> {
        let chunk_size = self.chunk_size;
        let i = self.get_mut(ino)?;
        let t = now();
        let mut freed = Vec::new();
        let mut cut = None;
        if let Some(size) = s.size {
            match &mut i.data {
                Data::File { chunks } => {
                    let keep = size.div_ceil(chunk_size);
                    freed = chunks.split_off(&keep).into_values().flatten().collect();
                    cut = Some(keep);
                    i.attr.size = size;
                    i.attr.mtime = t;
                    i.attr.cuts += 1;
                }
                Data::Dir { .. } => return Err(Errno::EISDIR),
                _ => return Err(Errno::EINVAL),
            }
        }
        if let Some(mode) = s.mode {
            i.attr.perm = (mode & 0o7777) as u16;
        }
        if let Some(uid) = s.uid {
            i.attr.uid = uid;
        }
        if let Some(gid) = s.gid {
            i.attr.gid = gid;
        }
        if let Some(a) = s.atime {
            i.attr.atime = a;
        }
        if let Some(m) = s.mtime {
            i.attr.mtime = m;
        }
        i.attr.ctime = t;
        let attr = i.attr;
        if let Some(from) = cut {
            self.note(|| Record::Cut { ino, from });
        }
        Ok((attr, freed))
    }

    pub fn open(&mut self, ino: Ino) -> Result<Attr, Errno> {
        // Open handles are the sessions' (reclaimed after a restart), not journaled.
        let i = self.inodes.get_mut(&ino).ok_or(Errno::ENOENT)?;
        i.open += 1;
        Ok(i.attr)
    }

    /// Releases an open handle; returns chunks freed if it was the last one of an unlinked file.
    pub fn release(&mut self, ino: Ino) -> Vec<ChunkRef> {
        match self.inodes.get_mut(&ino) {
            Some(i) => {
                i.open = i.open.saturating_sub(1);
                self.reap(ino)
            }
            None => Vec::new(),
        }
    }

    /// Gives back the chunks past a closed file's size (allocated ahead, never written): the
    /// first index given back and the chunks. Nothing while any handle is open, since a writer
    /// may have written into them without committing its size yet.
    pub fn trim(&mut self, ino: Ino) -> Option<(u64, Vec<ChunkRef>)> {
        let chunk_size = self.chunk_size;
        let i = self.inodes.get_mut(&ino)?;
        if i.open > 0 {
            return None;
        }
        let Data::File { chunks } = &mut i.data else {
            return None;
        };
        let keep = i.attr.size.div_ceil(chunk_size);
        let freed: Vec<_> = chunks.split_off(&keep).into_values().flatten().collect();
        if freed.is_empty() {
            return None;
        }
        // A commit past the size now would reach into chunks given back. Journaled here, not
        // through `get_mut`, which would journal the attributes at every last close.
        i.attr.cuts += 1;
        if self.log.is_some() {
            self.touched.insert(ino);
        }
        self.note(|| Record::Cut { ino, from: keep });
        Some((keep, freed))
    }

    /// [`Self::trim`] of every closed file: the first index given back and the chunks, by file.
    pub fn trim_closed(&mut self) -> Vec<(Ino, u64, Vec<ChunkRef>)> {
        let closed: Vec<Ino> = self
            .inodes
            .iter()
            .filter(|(_, i)| i.open == 0 && matches!(i.data, Data::File { .. }))
            .map(|(&ino, _)| ino)
            .collect();
        closed
            .into_iter()
            .filter_map(|ino| self.trim(ino).map(|(from, chunks)| (ino, from, chunks)))
            .collect()
    }

    /// Records a client's writes: the size grows to `size` (never shrinks: that is truncate).
    /// ESTALE if the file was cut since the client last heard (`cuts` is the count of cuts it
    /// made its size with): its size would grow the file back over the cut. Answers the
    /// attributes before and after.
    pub fn commit(
        &mut self,
        ino: Ino,
        size: u64,
        mtime: Option<Timestamp>,
        cuts: u64,
    ) -> Result<Committed, Errno> {
        let i = self.get_mut(ino)?;
        if i.attr.kind != FileKind::RegularFile {
            return Err(Errno::EINVAL);
        }
        if cuts != i.attr.cuts {
            return Err(Errno::ESTALE);
        }
        let before = i.attr;
        if size > i.attr.size {
            i.attr.size = size;
        }
        if let Some(m) = mtime {
            i.attr.mtime = m;
            i.attr.ctime = now();
        }
        Ok(Committed {
            before,
            after: i.attr,
        })
    }

    fn chunks(&self, ino: Ino) -> Result<&BTreeMap<u64, Replicas>, Errno> {
        match &self.get(ino)?.data {
            Data::File { chunks } => Ok(chunks),
            Data::Dir { .. } => Err(Errno::EISDIR),
            _ => Err(Errno::EINVAL),
        }
    }

    /// The allocated chunks among `first..first+count`.
    pub fn chunk_map(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
    ) -> Result<Vec<(u64, Replicas)>, Errno> {
        self.chunk_map_page(ino, first, count, usize::MAX)
    }

    /// The first `most` allocated chunks among `first..first+count`: a page of a map, whose
    /// span may be vast and sparse.
    pub fn chunk_map_page(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
        most: usize,
    ) -> Result<Vec<(u64, Replicas)>, Errno> {
        Ok(self
            .chunks(ino)?
            .range(first..first.saturating_add(count))
            .take(most)
            .map(|(&i, c)| (i, c.clone()))
            .collect())
    }

    /// Indices in `first..first+count` that have no chunk yet.
    pub fn missing_chunks(&self, ino: Ino, first: u64, count: u64) -> Result<Vec<u64>, Errno> {
        let chunks = self.chunks(ino)?;
        Ok((first..first.saturating_add(count))
            .filter(|i| !chunks.contains_key(i))
            .collect())
    }

    pub fn add_chunks(&mut self, ino: Ino, new: &[(u64, Replicas)]) -> Result<(), Errno> {
        let Data::File { chunks } = &mut self.inodes.get_mut(&ino).ok_or(Errno::ENOENT)?.data
        else {
            return Err(Errno::EINVAL);
        };
        let mut added = Vec::new();
        for (i, c) in new {
            if !chunks.contains_key(i) {
                chunks.insert(*i, c.clone());
                added.push(*i);
            }
        }
        for index in added {
            self.note_chunk(ino, index);
        }
        Ok(())
    }

    fn chunk_mut(&mut self, ino: Ino, index: u64) -> Option<&mut Replicas> {
        match &mut self.inodes.get_mut(&ino)?.data {
            Data::File { chunks } => chunks.get_mut(&index),
            _ => None,
        }
    }

    /// Keeps only the replicas of chunk `index` that a write reached (`reached`, by node and
    /// address): the others may miss it. Returns those dropped; EIO if none of `reached` is
    /// left to keep (the write reached nothing the map still has). A chunk that is gone
    /// (truncated meanwhile) has nothing to drop.
    pub fn drop_replicas(
        &mut self,
        ino: Ino,
        index: u64,
        reached: &[ChunkRef],
    ) -> Result<Vec<ChunkRef>, Errno> {
        let Some(chunk) = self.chunk_mut(ino, index) else {
            return Ok(Vec::new());
        };
        let has_write = |c: &ChunkRef| reached.iter().any(|r| same_chunk(r, c));
        if !chunk.iter().any(has_write) {
            return Err(Errno::EIO);
        }
        let (kept, dropped): (Replicas, _) = chunk.drain(..).partition(has_write);
        *chunk = kept;
        if !dropped.is_empty() {
            self.note_chunk(ino, index);
        }
        Ok(dropped)
    }

    /// Drops every replica on `node` (which died) from chunks that have another; a chunk whose
    /// only replica was there keeps it, so that reading it fails rather than reading a hole's
    /// zeros. Returns how many chunks lost a replica.
    pub fn drop_node(&mut self, node: u32) -> usize {
        let mut dropped = Vec::new();
        for (&ino, i) in self.inodes.iter_mut() {
            if let Data::File { chunks } = &mut i.data {
                for (&index, chunk) in chunks.iter_mut() {
                    if chunk.len() > 1 && chunk.iter().any(|c| c.node == node) {
                        chunk.retain(|c| c.node != node);
                        dropped.push((ino, index));
                    }
                }
            }
        }
        for &(ino, index) in &dropped {
            self.note_chunk(ino, index);
        }
        dropped.len()
    }

    /// Up to `limit` chunks with fewer than `target` replicas on live nodes (and at least one
    /// there to copy from), file by file, and how many there are in all.
    pub fn under_replicated(
        &self,
        target: usize,
        alive: impl Fn(u32) -> bool,
        limit: usize,
    ) -> (Vec<(Ino, u64)>, usize) {
        let mut found = Vec::new();
        let mut total = 0;
        for (&ino, i) in &self.inodes {
            if let Data::File { chunks } = &i.data {
                for (&index, chunk) in chunks {
                    let live = chunk.iter().filter(|c| alive(c.node)).count();
                    if live > 0 && live < target {
                        total += 1;
                        if found.len() < limit {
                            found.push((ino, index));
                        }
                    }
                }
            }
        }
        found.sort_unstable();
        (found, total)
    }

    /// The replicas of chunk `index` of `ino`, if it has that chunk.
    pub fn replicas(&self, ino: Ino, index: u64) -> Option<Replicas> {
        self.chunks(ino).ok()?.get(&index).cloned()
    }

    /// Adds `new` to chunk `index` of `ino`, copied from `source`: only if the chunk still has
    /// `source` (it may have been freed, or its replica dropped, while it was copied).
    pub fn add_replica(&mut self, ino: Ino, index: u64, source: &ChunkRef, new: ChunkRef) -> bool {
        match self.chunk_mut(ino, index) {
            Some(chunk) if chunk.iter().any(|c| same_chunk(c, source)) => {
                chunk.push(new);
                self.note_chunk(ino, index);
                true
            }
            _ => false,
        }
    }
}

/// Whether two references name the same chunk (whatever key each was granted with).
fn same_chunk(a: &ChunkRef, b: &ChunkRef) -> bool {
    a.node == b.node && a.addr == b.addr
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: Owner = Owner {
        perm: 0o755,
        uid: 0,
        gid: 0,
    };

    fn ns() -> Namespace {
        Namespace::new(1 << 20)
    }

    fn file(ns: &mut Namespace, parent: Ino, name: impl AsRef<[u8]>) -> Ino {
        ns.mknod(parent, name, FileKind::RegularFile, 0, OWNER)
            .unwrap()
            .ino
    }

    fn chunk(n: u64) -> Replicas {
        vec![ChunkRef {
            node: 0,
            addr: n << 20,
            rkey: 1,
        }]
    }

    /// A map page answers at most what it is asked for over any span; the whole map (what a
    /// last close revokes the grants of) has every chunk, past a page's worth too.
    #[test]
    fn a_map_page_is_bounded_and_the_whole_map_is_whole() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "f");
        let far = 1u64 << 40;
        let chunks: Vec<_> = (0..5000u64).map(|i| (i * far / 5000, chunk(i))).collect();
        n.add_chunks(f, &chunks).unwrap();
        assert_eq!(n.chunk_map(f, 0, u64::MAX).unwrap().len(), 5000);
        let page = n.chunk_map_page(f, 0, u64::MAX, 4096).unwrap();
        assert_eq!(page.len(), 4096);
        assert_eq!(page[4095].0, chunks[4095].0, "the first ones");
        let rest = n
            .chunk_map_page(f, page[4095].0 + 1, u64::MAX, 4096)
            .unwrap();
        assert_eq!(rest.len(), 904);
    }

    #[test]
    fn create_lookup_and_errors() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        assert_eq!(n.lookup(ROOT, "a").unwrap().ino, f);
        assert_eq!(
            n.mknod(ROOT, "a", FileKind::RegularFile, 0, OWNER),
            Err(Errno::EEXIST)
        );
        assert_eq!(n.lookup(ROOT, "b"), Err(Errno::ENOENT));
        assert_eq!(n.lookup(f, "x"), Err(Errno::ENOTDIR));
        let long = "x".repeat(256);
        assert_eq!(n.mkdir(ROOT, &long, OWNER), Err(Errno::ENAMETOOLONG));
        assert_eq!(n.lookup(ROOT, &long), Err(Errno::ENAMETOOLONG));
        assert_eq!(n.mkdir(ROOT, "a/b", OWNER), Err(Errno::EINVAL));
        assert_eq!(n.lookup(ROOT, "..").unwrap().ino, ROOT);
    }

    #[test]
    fn a_set_group_id_directory_gives_its_group_and_its_bit_to_what_is_made_in_it() {
        let mut n = ns();
        let shared = Owner {
            perm: 0o2777,
            uid: 0,
            gid: 100,
        };
        let d = n.mkdir(ROOT, "d", shared).unwrap().ino;
        let maker = |perm| Owner {
            perm,
            uid: 1000,
            gid: 1000,
        };
        let f = n
            .mknod(d, "f", FileKind::RegularFile, 0, maker(0o644))
            .unwrap();
        assert_eq!((f.gid, f.perm), (100, 0o644));
        let sub = n.mkdir(d, "sub", maker(0o755)).unwrap();
        assert_eq!((sub.gid, sub.perm), (100, 0o2755));
        let deeper = n
            .mknod(sub.ino, "g", FileKind::RegularFile, 0, maker(0o600))
            .unwrap();
        assert_eq!(deeper.gid, 100, "the subdirectory passes it on");
        let link = n.symlink(d, "l", "f", 1000, 1000).unwrap();
        assert_eq!(link.gid, 100);
        // Elsewhere the maker's group.
        let plain = n
            .mknod(ROOT, "r", FileKind::RegularFile, 0, maker(0o644))
            .unwrap();
        assert_eq!(plain.gid, 1000);
    }

    #[test]
    fn directory_link_counts_and_rmdir() {
        let mut n = ns();
        let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
        assert_eq!(n.getattr(ROOT).unwrap().nlink, 3);
        n.mkdir(d, "e", OWNER).unwrap();
        file(&mut n, d, "f");
        assert_eq!(n.getattr(d).unwrap().nlink, 3);
        assert_eq!(n.rmdir(ROOT, "d"), Err(Errno::ENOTEMPTY));
        assert_eq!(n.rmdir(d, "f"), Err(Errno::ENOTDIR));
        assert_eq!(n.unlink(d, "e"), Err(Errno::EISDIR));
        n.rmdir(d, "e").unwrap();
        n.unlink(d, "f").unwrap();
        n.rmdir(ROOT, "d").unwrap();
        assert_eq!(n.getattr(ROOT).unwrap().nlink, 2);
        assert_eq!(n.getattr(d), Err(Errno::ENOENT));
    }

    #[test]
    fn hard_links_count_and_free_on_last_unlink() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        n.add_chunks(f, &[(0, chunk(0)), (1, chunk(1))]).unwrap();
        assert_eq!(n.link(f, ROOT, "b").unwrap().nlink, 2);
        assert!(n.unlink(ROOT, "a").unwrap().is_empty(), "still linked");
        assert_eq!(n.getattr(f).unwrap().nlink, 1);
        assert_eq!(n.unlink(ROOT, "b").unwrap().len(), 2, "chunks freed");
        assert_eq!(n.getattr(f), Err(Errno::ENOENT));
        let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
        assert_eq!(n.link(d, ROOT, "d2"), Err(Errno::EPERM));
    }

    #[test]
    fn unlink_while_open_keeps_data_until_release() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        n.add_chunks(f, &[(0, chunk(0))]).unwrap();
        n.open(f).unwrap();
        n.open(f).unwrap();
        assert!(n.unlink(ROOT, "a").unwrap().is_empty());
        assert_eq!(n.chunk_map(f, 0, 10).unwrap().len(), 1, "data still there");
        assert!(n.release(f).is_empty(), "one handle left");
        assert_eq!(n.release(f).len(), 1, "freed at the last release");
        assert_eq!(n.getattr(f), Err(Errno::ENOENT));
    }

    #[test]
    fn rename_over_existing_and_its_errors() {
        let mut n = ns();
        let a = file(&mut n, ROOT, "a");
        let b = file(&mut n, ROOT, "b");
        n.add_chunks(b, &[(0, chunk(7))]).unwrap();
        assert_eq!(n.rename(ROOT, "a", ROOT, "b", 0).unwrap(), chunk(7));
        assert_eq!(n.lookup(ROOT, "b").unwrap().ino, a);
        assert_eq!(n.lookup(ROOT, "a"), Err(Errno::ENOENT));
        let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
        let e = n.mkdir(ROOT, "e", OWNER).unwrap().ino;
        file(&mut n, e, "x");
        assert_eq!(n.rename(ROOT, "b", ROOT, "d", 0), Err(Errno::EISDIR));
        assert_eq!(n.rename(ROOT, "d", ROOT, "b", 0), Err(Errno::ENOTDIR));
        assert_eq!(n.rename(ROOT, "d", ROOT, "e", 0), Err(Errno::ENOTEMPTY));
        assert_eq!(n.rename(ROOT, "d", d, "inside", 0), Err(Errno::EINVAL));
        assert_eq!(
            n.rename(ROOT, "b", ROOT, "d", RENAME_NOREPLACE),
            Err(Errno::EEXIST)
        );
        // Move a directory into another: link counts follow.
        n.rename(ROOT, "d", e, "d", 0).unwrap();
        assert_eq!(n.getattr(e).unwrap().nlink, 3);
        assert_eq!(n.getattr(ROOT).unwrap().nlink, 3);
        assert_eq!(n.lookup(d, "..").unwrap().ino, e);
        // Replace an empty directory.
        let f = n.mkdir(ROOT, "f", OWNER).unwrap().ino;
        n.rename(e, "d", ROOT, "f", 0).unwrap();
        assert_eq!(n.getattr(f), Err(Errno::ENOENT));
        assert_eq!(n.lookup(ROOT, "f").unwrap().ino, d);
    }

    #[test]
    fn rename_exchange_swaps() {
        let mut n = ns();
        let a = file(&mut n, ROOT, "a");
        let d = n.mkdir(ROOT, "d", OWNER).unwrap().ino;
        n.rename(ROOT, "a", ROOT, "d", RENAME_EXCHANGE).unwrap();
        assert_eq!(n.lookup(ROOT, "a").unwrap().ino, d);
        assert_eq!(n.lookup(ROOT, "d").unwrap().ino, a);
        assert_eq!(
            n.rename(ROOT, "a", ROOT, "zz", RENAME_EXCHANGE),
            Err(Errno::ENOENT)
        );
        assert_eq!(n.rename(ROOT, "a", ROOT, "d", 3), Err(Errno::EINVAL));
    }

    #[test]
    fn truncate_frees_whole_chunks_past_the_size() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        n.add_chunks(f, &[(0, chunk(0)), (1, chunk(1)), (2, chunk(2))])
            .unwrap();
        let set = AttrChanges {
            size: Some((1 << 20) + 1),
            ..AttrChanges::default()
        };
        let (attr, freed) = n.setattr(f, &set).unwrap();
        assert_eq!(attr.size, (1 << 20) + 1);
        assert_eq!(freed, chunk(2));
        assert_eq!(n.missing_chunks(f, 0, 3).unwrap(), vec![2]);
        assert_eq!(
            n.commit(f, 10, None, 0),
            Err(Errno::ESTALE),
            "made before the cut"
        );
        n.commit(f, 10, None, 1).unwrap();
        assert_eq!(
            n.getattr(f).unwrap().size,
            (1 << 20) + 1,
            "commit never shrinks"
        );
    }

    #[test]
    fn every_closed_file_gives_back_chunks_past_its_size_at_once() {
        let mut n = ns();
        let (open, closed) = (file(&mut n, ROOT, "a"), file(&mut n, ROOT, "b"));
        for f in [open, closed] {
            n.add_chunks(f, &[(0, chunk(0)), (1, chunk(1))]).unwrap();
        }
        n.open(open).unwrap();
        let trimmed = n.trim_closed();
        assert_eq!(trimmed.len(), 1, "{trimmed:?}");
        assert_eq!((trimmed[0].0, trimmed[0].1), (closed, 0));
        assert_eq!(n.chunk_map(open, 0, 2).unwrap().len(), 2);
    }

    #[test]
    fn a_commit_answers_the_attributes_before_and_after_it() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        let first = n.getattr(f).unwrap();
        let m = Timestamp { secs: 7, nsecs: 8 };
        let c = n.commit(f, 4096, Some(m), 0).unwrap();
        assert_eq!(c.before, first);
        assert_eq!((c.after.size, c.after.mtime), (4096, m));
        assert_eq!(n.getattr(f).unwrap(), c.after);
        let again = n.commit(f, 10, None, 0).unwrap();
        assert_eq!(
            again.before, c.after,
            "the one before is the last commit's after"
        );
        assert_eq!(again.after, c.after, "a commit never shrinks the file");
    }

    #[test]
    fn closed_files_give_back_chunks_past_their_size() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        let ahead: Vec<_> = (0..16).map(|i| (i, chunk(i))).collect();
        n.add_chunks(f, &ahead).unwrap();
        n.open(f).unwrap();
        n.commit(f, (1 << 20) + 512 * 1024, None, 0).unwrap();
        assert_eq!(n.trim(f), None, "open: a writer may not have committed yet");
        n.release(f);
        let (from, freed) = n.trim(f).unwrap();
        assert_eq!(
            n.getattr(f).unwrap().cuts,
            1,
            "counted: chunks past the size went"
        );
        assert_eq!(from, 2);
        assert_eq!(freed.len(), 14);
        assert_eq!(n.chunk_map(f, 0, 16).unwrap().len(), 2);
        assert_eq!(n.trim(f), None, "nothing left past the size");
    }

    #[test]
    fn readdir_pages_through_a_large_directory() {
        let mut n = ns();
        for i in 0..1000 {
            file(&mut n, ROOT, format!("f{i:04}"));
        }
        let mut names = Vec::new();
        let mut cookie = 0;
        loop {
            let page = n.readdir(ROOT, cookie, 64, usize::MAX).unwrap();
            if page.is_empty() {
                break;
            }
            cookie = page.last().unwrap().cookie;
            names.extend(page.into_iter().map(|e| e.name));
        }
        assert_eq!(names.len(), 1002);
        assert_eq!(names[..3], [".".into(), "..".into(), "f0000".into()]);
    }

    #[test]
    fn readdir_pages_are_cut_to_fit_a_message() {
        let mut n = ns();
        for i in 0..260 {
            file(&mut n, ROOT, format!("{i:03}{}", "x".repeat(177)));
        }
        let budget = 16 << 10;
        let (mut cookie, mut listed, mut pages) = (0, 0, 0);
        loop {
            let page = n.readdir(ROOT, cookie, 256, budget).unwrap();
            if page.is_empty() {
                break;
            }
            let bytes: usize = page.iter().map(DirEntry::wire_len).sum();
            assert!(bytes <= budget, "page of {bytes} bytes");
            cookie = page.last().unwrap().cookie;
            listed += page.len();
            pages += 1;
        }
        assert_eq!(listed, 262);
        assert!(pages > 4, "{pages} pages");
        // An entry larger than the budget still goes out, alone: a listing always moves on.
        assert_eq!(n.readdir(ROOT, 2, 256, 1).unwrap().len(), 1);
    }

    #[test]
    fn names_are_bytes() {
        let mut n = ns();
        let latin1 = b"caf\xe9";
        let f = file(&mut n, ROOT, latin1);
        assert_eq!(n.lookup(ROOT, latin1).unwrap().ino, f);
        assert_eq!(
            n.lookup(ROOT, "caf\u{e9}"),
            Err(Errno::ENOENT),
            "UTF-8 é is another name"
        );
        let page = n.readdir(ROOT, 0, 10, usize::MAX).unwrap();
        assert_eq!(page[2].name.as_bytes(), latin1);
        n.symlink(ROOT, b"l\xff", b"/t\xfe", 0, 0).unwrap();
        let l = n.lookup(ROOT, b"l\xff").unwrap().ino;
        assert_eq!(n.readlink(l).unwrap().as_bytes(), b"/t\xfe");
        n.rename(ROOT, latin1, ROOT, b"\x80", 0).unwrap();
        n.unlink(ROOT, b"\x80").unwrap();
        for bad in [&b""[..], b".", b"..", b"a/b", b"a\0b"] {
            assert_eq!(n.mkdir(ROOT, bad, OWNER), Err(Errno::EINVAL), "{bad:?}");
        }
        assert_eq!(n.mkdir(ROOT, [b'x'; 256], OWNER), Err(Errno::ENAMETOOLONG));
    }

    fn on(node: u32, addr: u64) -> ChunkRef {
        ChunkRef {
            node,
            addr,
            rkey: 9,
        }
    }

    #[test]
    fn a_write_keeps_only_the_replicas_it_reached() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        n.add_chunks(f, &[(0, vec![on(1, 0), on(2, 0)]), (1, vec![on(2, 64)])])
            .unwrap();
        // Keys do not matter: a reference names a chunk by node and address.
        let reached = ChunkRef {
            rkey: 0,
            ..on(1, 0)
        };
        assert_eq!(n.drop_replicas(f, 0, &[reached]), Ok(vec![on(2, 0)]));
        assert_eq!(n.replicas(f, 0), Some(vec![on(1, 0)]));
        assert_eq!(
            n.drop_replicas(f, 0, &[on(1, 0)]),
            Ok(vec![]),
            "all it has reached"
        );
        assert_eq!(
            n.drop_replicas(f, 0, &[on(2, 0)]),
            Err(Errno::EIO),
            "reached none left"
        );
        assert_eq!(n.drop_replicas(f, 0, &[]), Err(Errno::EIO));
        assert_eq!(
            n.drop_replicas(f, 7, &[on(1, 0)]),
            Ok(vec![]),
            "no such chunk"
        );
        // A copy made from a replica that missed the write goes too.
        assert!(n.add_replica(f, 0, &on(1, 0), on(3, 0)));
        assert_eq!(n.drop_replicas(f, 0, &[on(1, 0)]), Ok(vec![on(3, 0)]));
        // A dead node's replicas go where another is left; an only replica stays.
        n.add_chunks(f, &[(2, vec![on(1, 128), on(2, 128)])])
            .unwrap();
        assert_eq!(n.drop_node(2), 1);
        assert_eq!(n.replicas(f, 1), Some(vec![on(2, 64)]), "its only copy");
        assert_eq!(n.replicas(f, 2), Some(vec![on(1, 128)]));
    }

    #[test]
    fn under_replicated_chunks_are_found_and_copies_land_only_on_what_is_still_there() {
        let mut n = ns();
        let f = file(&mut n, ROOT, "a");
        let g = file(&mut n, ROOT, "b");
        n.add_chunks(f, &[(0, vec![on(1, 0), on(2, 0)]), (1, vec![on(1, 64)])])
            .unwrap();
        n.add_chunks(g, &[(0, vec![on(3, 0)]), (5, vec![on(2, 64), on(3, 64)])])
            .unwrap();
        let alive = |node| node != 3;
        // g's chunk 0 is only on a dead node: nothing to copy from.
        assert_eq!(n.under_replicated(2, alive, 10), (vec![(f, 1), (g, 5)], 2));
        let (some, all) = n.under_replicated(2, alive, 1);
        assert_eq!((some.len(), all), (1, 2), "a limit, and the count of all");
        assert_eq!(n.under_replicated(1, alive, 10).1, 0);
        assert!(n.add_replica(f, 1, &on(1, 64), on(2, 192)));
        assert_eq!(n.replicas(f, 1), Some(vec![on(1, 64), on(2, 192)]));
        assert!(
            !n.add_replica(f, 0, &on(3, 0), on(2, 256)),
            "source not in it"
        );
        n.setattr(
            f,
            &AttrChanges {
                size: Some(0),
                ..AttrChanges::default()
            },
        )
        .unwrap();
        assert!(
            !n.add_replica(f, 1, &on(1, 64), on(2, 256)),
            "truncated meanwhile"
        );
    }
}
