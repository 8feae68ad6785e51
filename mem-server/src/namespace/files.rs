//! Files: attributes, handles (an unlinked file goes with its last one), sizes committed by
//! clients, and what closed files give back past their size.

use rfs_proto::types::setid_cleared_by_write;

use super::*;

impl Namespace {
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
        let kill = s.kill_setid && i.attr.kind == FileKind::RegularFile;
        if kill {
            let perm = u32::from(i.attr.perm);
            i.attr.perm = (perm & !setid_cleared_by_write(perm)) as u16;
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
        if let Some(from) = cut {
            self.note(|| Record::Cut { ino, from });
            self.recount(ino);
        }
        if kill {
            self.drop_capabilities(ino);
        }
        if s.mode.is_some() || kill {
            self.chmod_acl(ino);
        }
        Ok((self.get(ino)?.attr, freed))
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

    /// Gives back the space past a closed file's size (allocated ahead, never written): the
    /// chunks past it, and the pages past it of the chunk it ends in (its copies keep a
    /// shorter span). The first index given back from and what went. Nothing while any handle
    /// is open, since a writer may have written past the size it committed.
    pub fn trim(&mut self, ino: Ino) -> Option<(u64, Vec<ChunkRef>)> {
        let chunk_size = self.chunk_size;
        let i = self.inodes.get_mut(&ino)?;
        if i.open > 0 {
            return None;
        }
        let Data::File { chunks } = &mut i.data else {
            return None;
        };
        let size = i.attr.size;
        let keep = size.div_ceil(chunk_size);
        let mut freed: Vec<_> = chunks.split_off(&keep).into_values().flatten().collect();
        let mut from = keep;
        let last = keep.checked_sub(1);
        let end_in_last = size - last.unwrap_or(0) * chunk_size;
        let tail = last.and_then(|l| {
            let c = chunks.get(&l)?.first()?;
            Some((l, spans::trimmed((c.lo, c.len), end_in_last, size)?))
        });
        if let Some((index, (lo, len))) = tail {
            let copies = chunks.remove(&index).unwrap_or_default();
            let (kept, tails): (Replicas, Vec<ChunkRef>) = copies
                .into_iter()
                .map(|c| {
                    let keep = ChunkRef { lo, len, ..c };
                    let gone = ChunkRef {
                        addr: c.addr + len as u64,
                        lo: lo + len,
                        len: c.len.saturating_sub(len),
                        ..c
                    };
                    (keep, gone)
                })
                .unzip();
            freed.extend(tails);
            if len > 0 {
                chunks.insert(index, kept);
            }
            from = index;
        }
        freed.retain(|c| c.len > 0);
        if freed.is_empty() {
            return None;
        }
        // A commit past the size now would reach into space given back. Journaled here, not
        // through `get_mut`, which would journal the attributes at every last close.
        i.attr.cuts += 1;
        if self.log.is_some() {
            self.touched.insert(ino);
        }
        self.note(|| Record::Cut { ino, from: keep });
        if from < keep {
            self.note_chunk(ino, from);
        }
        self.recount(ino);
        Some((from, freed))
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
}
