//! The namespace as journal records: the changes each operation made (taken after it), the
//! whole namespace (for a snapshot), and the namespace rebuilt from them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rfs_proto::types::{Attr, ChunkRef, FileKind, Ino, ROOT};

use super::{Data, Inode, Namespace};
use crate::record::Record;

impl Namespace {
    /// Records every change from now on, for [`Namespace::take_records`].
    pub fn journal_changes(&mut self) {
        self.log.get_or_insert_with(Vec::new);
    }

    /// The changes made since the last call, in order (the attributes of each inode changed,
    /// as they now are, last).
    pub fn take_records(&mut self, out: &mut Vec<Record>) {
        let Some(log) = &mut self.log else { return };
        out.append(log);
        for ino in std::mem::take(&mut self.touched) {
            if let Some(i) = self.inodes.get(&ino) {
                out.push(Record::Attr(i.attr));
            }
        }
    }

    /// The whole namespace as records: replayed from nothing, they rebuild it.
    pub fn records(&self) -> Vec<Record> {
        let mut out = vec![
            Record::Format {
                chunk_size: self.chunk_size,
            },
            Record::NextIno(self.next_ino),
        ];
        let mut inos: Vec<&Ino> = self.inodes.keys().collect();
        inos.sort_unstable();
        for &ino in &inos {
            let i = &self.inodes[ino];
            let (parent, target) = match &i.data {
                Data::Dir { parent, .. } => (*parent, Vec::new()),
                Data::Symlink(t) => (0, t.clone()),
                _ => (0, Vec::new()),
            };
            out.push(Record::Created {
                attr: i.attr,
                parent,
                target,
            });
            for (name, value) in i.xattrs.iter().flat_map(|x| x.iter()) {
                out.push(Record::Xattr {
                    ino: *ino,
                    name: name.clone(),
                    value: Some(value.clone()),
                });
            }
        }
        for &ino in &inos {
            match &self.inodes[ino].data {
                Data::Dir { entries, .. } => {
                    out.extend(entries.iter().map(|(name, &child)| Record::Entry {
                        dir: *ino,
                        name: name.clone(),
                        ino: child,
                    }))
                }
                Data::File { chunks } => {
                    out.extend(chunks.iter().map(|(&index, r)| Record::Chunk {
                        ino: *ino,
                        index,
                        replicas: r.clone(),
                    }))
                }
                _ => {}
            }
        }
        out
    }

    /// The namespace `records` describe (from a snapshot and the journal since), journaling
    /// its changes from then on. Records of the allocator are passed over; records about
    /// inodes that are not there are counted (second value) and skipped.
    pub fn replay(chunk_size: u64, records: &[Record]) -> Result<(Namespace, usize), String> {
        let mut ns = Namespace {
            inodes: HashMap::new(),
            max_inodes: u64::MAX,
            next_ino: ROOT + 1,
            chunk_size,
            log: Some(Vec::new()),
            touched: BTreeSet::new(),
            xattr_bytes: 0,
            max_xattr_bytes: u64::MAX,
        };
        let mut skipped = 0;
        for r in records {
            if !ns.apply(r)? {
                skipped += 1;
            }
        }
        if !ns.inodes.contains_key(&ROOT) {
            return Err("the state has no root directory".into());
        }
        let files: Vec<Ino> = ns.inodes.keys().copied().collect();
        for ino in files {
            ns.recount(ino);
        }
        Ok((ns, skipped))
    }

    /// Applies one record; false if it named an inode that is not there.
    fn apply(&mut self, r: &Record) -> Result<bool, String> {
        match r {
            &Record::Format { chunk_size } if chunk_size != self.chunk_size => {
                return Err(format!(
                    "the state was made with {chunk_size}-byte chunks, this node uses {} \
                     (start it with --chunk-size {chunk_size})",
                    self.chunk_size
                ))
            }
            Record::Created {
                attr,
                parent,
                target,
            } => {
                let data = match attr.kind {
                    FileKind::Directory => Data::Dir {
                        entries: BTreeMap::new(),
                        parent: *parent,
                    },
                    FileKind::RegularFile => Data::File {
                        chunks: BTreeMap::new(),
                    },
                    FileKind::Symlink => Data::Symlink(target.clone()),
                    _ => Data::Special,
                };
                self.next_ino = self.next_ino.max(attr.ino + 1);
                self.inodes.insert(
                    attr.ino,
                    Inode {
                        attr: *attr,
                        data,
                        open: 0,
                        xattrs: None,
                    },
                );
            }
            Record::Attr(attr) => match self.inodes.get_mut(&attr.ino) {
                // Whether it has an ACL, its extended attributes' records say; what its chunks
                // hold is counted at the end.
                Some(i) => {
                    i.attr = Attr {
                        acl: i.attr.acl,
                        ..*attr
                    }
                }
                None => return Ok(false),
            },
            Record::Entry { dir, name, ino } => match self.inodes.get_mut(dir) {
                Some(Inode {
                    data: Data::Dir { entries, .. },
                    ..
                }) => {
                    if *ino == 0 {
                        entries.remove(name);
                    } else {
                        entries.insert(name.clone(), *ino);
                    }
                }
                _ => return Ok(false),
            },
            Record::Parent { dir, parent } => match self.inodes.get_mut(dir) {
                Some(Inode {
                    data: Data::Dir { parent: p, .. },
                    ..
                }) => *p = *parent,
                _ => return Ok(false),
            },
            Record::Chunk {
                ino,
                index,
                replicas,
            } => match self.inodes.get_mut(ino) {
                Some(Inode {
                    data: Data::File { chunks },
                    ..
                }) => {
                    if replicas.is_empty() {
                        chunks.remove(index);
                    } else {
                        let mut replicas = replicas.clone();
                        for c in replicas.iter_mut().filter(|c| c.len == 0) {
                            c.len = self.chunk_size as u32; // journaled before spans
                        }
                        chunks.insert(*index, replicas);
                    }
                }
                _ => return Ok(false),
            },
            Record::Cut { ino, from } => match self.inodes.get_mut(ino) {
                Some(Inode {
                    data: Data::File { chunks },
                    ..
                }) => drop(chunks.split_off(from)),
                _ => return Ok(false),
            },
            Record::Gone(ino) => match self.inodes.remove(ino) {
                Some(i) => self.xattr_bytes -= super::xattrs::cost_of(&i.xattrs),
                None => return Ok(false),
            },
            Record::NextIno(n) => self.next_ino = self.next_ino.max(*n),
            Record::Xattr { ino, name, value } => {
                if !self.restore_xattr(*ino, name, value.as_deref()) {
                    return Ok(false);
                }
            }
            Record::Format { .. }
            | Record::Node { .. }
            | Record::Fresh { .. }
            | Record::Removed { .. }
            | Record::Down { .. }
            | Record::Holding { .. } => {}
        }
        Ok(true)
    }

    /// Every copy on `node`, as its extent's length by address: what is in use of its pool.
    pub fn chunks_on(&self, node: u32) -> BTreeMap<u64, u64> {
        self.inodes
            .values()
            .filter_map(|i| match &i.data {
                Data::File { chunks } => Some(chunks.values().flatten()),
                _ => None,
            })
            .flatten()
            .filter(|c| c.node == node)
            .map(|c| (c.addr, c.len as u64))
            .collect()
    }

    /// Files with no name and no handle (they were open when the node stopped, and no client
    /// reclaimed them): they go, with the chunks returned.
    pub fn reap_orphans(&mut self) -> Vec<(Ino, Vec<ChunkRef>)> {
        let orphans: Vec<Ino> = self
            .inodes
            .iter()
            .filter(|(_, i)| i.attr.nlink == 0 && i.open == 0)
            .map(|(&ino, _)| ino)
            .collect();
        orphans
            .into_iter()
            .map(|ino| (ino, self.reap(ino)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::types::{AttrChanges, Owner, RENAME_EXCHANGE};

    const OWNER: Owner = Owner {
        perm: 0o644,
        uid: 1,
        gid: 1,
        umask: 0,
    };

    fn chunk(node: u32, addr: u64) -> Vec<ChunkRef> {
        vec![ChunkRef {
            node,
            addr,
            rkey: 0,
            lo: 0,
            len: 4096,
        }]
    }

    /// Every operation's records, replayed on the snapshot taken before it, give the
    /// namespace it made: the whole of it, compared through its own snapshot.
    #[test]
    fn journaled_changes_replay_to_the_same_namespace() {
        let mut ns = Namespace::new(4096);
        ns.journal_changes();
        let base = ns.records();
        let mut journal = Vec::new();
        let step = |ns: &mut Namespace, journal: &mut Vec<Record>| {
            ns.take_records(journal);
            let mut all = base.clone();
            all.extend(journal.iter().cloned());
            let (replayed, skipped) = Namespace::replay(4096, &all).unwrap();
            assert_eq!(skipped, 0);
            assert_eq!(replayed.records(), ns.records(), "after {journal:?}");
        };
        let d = ns.mkdir(ROOT, "d", OWNER).unwrap().ino;
        step(&mut ns, &mut journal);
        let f = ns
            .mknod(d, b"f\xff", FileKind::RegularFile, 0, OWNER)
            .unwrap()
            .ino;
        ns.add_chunks(f, &[(0, chunk(1, 0)), (3, chunk(2, 4096))])
            .unwrap();
        step(&mut ns, &mut journal);
        ns.symlink(ROOT, "s", "d/f", 0, 0).unwrap();
        ns.link(f, ROOT, "hard").unwrap();
        ns.commit(f, 20000, None, 0).unwrap();
        step(&mut ns, &mut journal);
        let e = ns.mkdir(ROOT, "e", OWNER).unwrap().ino;
        ns.rename(ROOT, "d", e, "d2", 0).unwrap();
        ns.rename(ROOT, "s", e, "d2", RENAME_EXCHANGE).unwrap();
        step(&mut ns, &mut journal);
        let truncate = AttrChanges {
            size: Some(5000),
            ..Default::default()
        };
        ns.setattr(f, &truncate).unwrap();
        ns.add_chunks(f, &[(1, [chunk(1, 8192), chunk(2, 0)].concat())])
            .unwrap();
        ns.drop_replicas(f, 1, &chunk(2, 0)).unwrap();
        ns.drop_node(1);
        step(&mut ns, &mut journal);
        ns.open(f).unwrap();
        ns.unlink(ROOT, "hard").unwrap();
        ns.unlink(ROOT, "d2").unwrap_or_default();
        step(&mut ns, &mut journal);
        ns.rmdir(ROOT, "e").unwrap_err();
        ns.release(f);
        step(&mut ns, &mut journal);
    }

    /// A restart under a lower file limit keeps every file it had, and refuses creates until
    /// enough are removed.
    #[test]
    fn a_lower_file_limit_keeps_what_is_there_and_refuses_creates() {
        let mut ns = Namespace::new(4096);
        ns.journal_changes();
        for i in 0..5 {
            ns.mknod(ROOT, format!("f{i}"), FileKind::RegularFile, 0, OWNER)
                .unwrap();
        }
        let (mut back, skipped) = Namespace::replay(4096, &ns.records()).unwrap();
        assert_eq!((back.inode_count(), skipped), (6, 0));
        back.set_max_inodes(4);
        assert_eq!(back.mkdir(ROOT, "d", OWNER), Err(rfs_proto::Errno::ENOSPC));
        for i in 0..3 {
            back.unlink(ROOT, format!("f{i}")).unwrap();
        }
        back.mkdir(ROOT, "d", OWNER).unwrap();
        assert_eq!(
            back.symlink(ROOT, "s", "d", 0, 0).map(|a| a.ino),
            Err(rfs_proto::Errno::ENOSPC)
        );
    }

    #[test]
    fn unlinked_files_open_at_a_restart_stay_until_reaped() {
        let mut ns = Namespace::new(4096);
        ns.journal_changes();
        let f = ns
            .mknod(ROOT, "f", FileKind::RegularFile, 0, OWNER)
            .unwrap()
            .ino;
        ns.add_chunks(f, &[(0, chunk(1, 0))]).unwrap();
        ns.open(f).unwrap();
        assert!(ns.unlink(ROOT, "f").unwrap().is_empty(), "open: kept");
        let (mut replayed, _) = Namespace::replay(4096, &ns.records()).unwrap();
        assert_eq!(replayed.getattr(f).unwrap().nlink, 0);
        assert_eq!(replayed.chunks_on(1), BTreeMap::from([(0, 4096)]));
        replayed.open(f).unwrap();
        assert!(replayed.reap_orphans().is_empty(), "reclaimed: kept");
        replayed.release(f);
        assert!(replayed.getattr(f).is_err(), "its last handle took it");
        let (mut replayed, _) = Namespace::replay(4096, &ns.records()).unwrap();
        assert_eq!(replayed.reap_orphans(), [(f, chunk(1, 0))]);
        assert!(replayed.chunks_on(1).is_empty());
    }

    #[test]
    fn a_state_with_other_chunks_or_no_root_is_refused() {
        let ns = Namespace::new(4096);
        assert!(
            Namespace::replay(8192, &ns.records()).is_err_and(|e| e.contains("--chunk-size 4096"))
        );
        assert!(Namespace::replay(4096, &[]).is_err_and(|e| e.contains("root")));
    }
}
