//! The tree: making, linking, removing and renaming names, symbolic links, and listing
//! directories in pages.

use super::*;

impl Namespace {
    pub(super) fn insert(
        &mut self,
        parent: Ino,
        name: &[u8],
        (kind, rdev): (FileKind, u32),
        owner: Owner,
        data: Data,
    ) -> Result<Attr, Errno> {
        let Owner {
            perm,
            uid,
            mut gid,
            umask,
        } = owner;
        check_name(name)?;
        if self.entries(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        if self.inode_count() >= self.max_inodes {
            return Err(Errno::ENOSPC);
        }
        let (mut perm, inherited) = self.inherit(parent, kind, perm, umask)?;
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
            acl: false,
            held: 0,
        };
        self.inodes.insert(
            ino,
            Inode {
                attr,
                data,
                open: 0,
                xattrs: None,
            },
        );
        self.note(|| Record::Created {
            attr,
            parent: dir_parent,
            target,
        });
        self.give(ino, inherited);
        self.set_entry(parent, name, Some(ino))?;
        if is_dir {
            self.get_mut(parent)?.attr.nlink += 1;
        }
        self.touch_dir(parent);
        // With what it inherited.
        Ok(self.get(ino)?.attr)
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
            umask: 0,
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
    pub(super) fn is_within(&self, mut ino: Ino, ancestor: Ino) -> bool {
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

    pub(super) fn set_parent(&mut self, dir: Ino, new_parent: Ino) {
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
}
