//! Coherence by callback, on the metadata node: which client sessions may cache what (chunk
//! maps they fetched, attributes and names they were told), and telling them when it changes,
//! as NFSv4 recalls delegations and Lustre cancels locks. A change is planned under the state
//! lock (so a fetch either precedes it and is recalled, or follows it and sees it), sent by
//! each session's callbacks (`callbacks.rs`), and waited for with the lock released, up to the lease: a
//! session that does not answer in time is taken to have dropped what it was told (its own
//! lease makes it refetch), and is not waited for again until it answers. Chunks that a
//! session could not be asked about (its connection is down, dead or cut: the service cannot
//! tell which) stay in quarantine until the lease has passed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::callbacks::Callbacks;

use rfs_proto::callback::{Callback, EntryChange, Invalidation};
use rfs_proto::types::{Attr, Ino, Name};

/// A client session of the metadata service.
pub(crate) type SessionId = u64;

/// What one session may cache, as far as the service knows.
struct Cached {
    /// Inodes whose chunk maps it fetched: it may read and write their chunks.
    maps: HashSet<Ino>,
    /// Inodes whose attributes it was told (forgotten once it is told of a change: it asks
    /// again).
    seen: HashSet<Ino>,
    /// Files it has open: it is told of every change to them, since it keeps their sizes.
    open: HashMap<Ino, u32>,
    /// The connection whose callback channel this is.
    epoch: u64,
    /// Directories it looked names up in: its kernel may keep those names for as long as it
    /// likes, whatever it re-asks about the directory itself, so these are kept.
    dirs: HashSet<Ino>,
    callbacks: Arc<Callbacks>,
}

/// Every session's caches.
#[derive(Default)]
pub(crate) struct Holders {
    sessions: HashMap<SessionId, Cached>,
}

/// A change, described for the caches.
#[derive(Default)]
pub(crate) struct Change {
    /// Inodes whose attributes changed, and whether their contents did.
    pub(crate) inodes: Vec<(Ino, bool)>,
    /// Files whose chunks from an index on are no longer theirs.
    pub(crate) recalls: Vec<Recall>,
    /// Names that no longer lead where they did.
    pub(crate) entries: Vec<(Ino, Name)>,
    /// Files whose chunk maps changed without a size cut (replicas dropped or added).
    pub(crate) remaps: Vec<Ino>,
}

/// A file's chunks from index `from` on are no longer its own.
pub(crate) struct Recall {
    pub(crate) ino: Ino,
    pub(crate) from: u64,
    /// Its contents changed with them (a size cut, or the file is gone); not when only chunks
    /// past its size went back (a trim of those allocated ahead, at its last close), which
    /// leaves every cached byte of it as it was.
    pub(crate) cut: bool,
}

impl Change {
    pub(crate) fn is_empty(&self) -> bool {
        self.inodes.is_empty()
            && self.recalls.is_empty()
            && self.entries.is_empty()
            && self.remaps.is_empty()
    }
}

impl Holders {
    /// Session `id`'s connection `epoch` has a callback channel; returns the one that goes
    /// (the older of the two: connections of one session may race to get here). What a
    /// reconnecting session held, it is still taken to hold (it drops its chunk maps once it
    /// learns it reconnected, which may be after the next recall).
    pub(crate) fn attach(
        &mut self,
        id: SessionId,
        epoch: u64,
        callbacks: Arc<Callbacks>,
    ) -> Option<Arc<Callbacks>> {
        match self.sessions.get_mut(&id) {
            Some(c) if c.epoch > epoch => Some(callbacks),
            Some(c) => {
                c.epoch = epoch;
                Some(std::mem::replace(&mut c.callbacks, callbacks))
            }
            None => {
                self.sessions.insert(
                    id,
                    Cached {
                        maps: HashSet::new(),
                        seen: HashSet::new(),
                        dirs: HashSet::new(),
                        open: HashMap::new(),
                        callbacks,
                        epoch,
                    },
                );
                None
            }
        }
    }

    pub(crate) fn remove(&mut self, id: SessionId) {
        self.sessions.remove(&id);
    }

    /// `id` was told `ino`'s attributes (or names in it).
    pub(crate) fn saw(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            c.seen.insert(ino);
        }
    }

    /// `id` looked names up in directory `dir` (and may cache them).
    pub(crate) fn looked_in(&mut self, id: SessionId, dir: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            c.dirs.insert(dir);
        }
    }

    /// `id` opened a handle of `ino`.
    pub(crate) fn opened(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            *c.open.entry(ino).or_default() += 1;
        }
    }

    /// `id` closed a handle of `ino`.
    pub(crate) fn closed(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            if let Some(n) = c.open.get_mut(&ino) {
                *n -= 1;
                if *n == 0 {
                    c.open.remove(&ino);
                }
            }
        }
    }

    /// `id` fetched part of `ino`'s chunk map.
    pub(crate) fn fetched(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            c.maps.insert(ino);
        }
    }

    /// The sessions waiting for locks to tell that a lock of each file went, with the files.
    pub(crate) fn lock_freed(&self, woken: &[(SessionId, Ino)]) -> Vec<(Arc<Callbacks>, Vec<Ino>)> {
        let mut by_session: HashMap<SessionId, Vec<Ino>> = HashMap::new();
        for &(session, ino) in woken {
            let inos = by_session.entry(session).or_default();
            if !inos.contains(&ino) {
                inos.push(ino);
            }
        }
        by_session
            .into_iter()
            .filter_map(|(session, inos)| {
                let c = self.sessions.get(&session)?;
                Some((c.callbacks.clone(), inos))
            })
            .collect()
    }

    /// The callback each session needs for `change` made by `caller` (None: by the service
    /// itself): chunk recalls go to every holder, the caller too (its other threads may have
    /// transfers in flight); remaps and the rest go to the others (the caller knows what it
    /// did, and may hold the very references a remap would wait for). Told sessions forget
    /// what they were told: they are told again only after they fetch again.
    pub(crate) fn plan(
        &mut self,
        caller: Option<SessionId>,
        change: &Change,
        attr: impl Fn(Ino) -> Option<Attr>,
    ) -> Vec<(Arc<Callbacks>, Callback)> {
        let gone: Vec<Ino> = change
            .inodes
            .iter()
            .map(|&(ino, _)| ino)
            .filter(|&ino| attr(ino).is_none())
            .collect();
        let mut out = Vec::new();
        for (&id, c) in &mut self.sessions {
            let mut cb = Callback::default();
            let mut told: HashMap<Ino, usize> = HashMap::new();
            let is_caller = Some(id) == caller;
            for &(ino, data) in &change.inodes {
                if is_caller || told.contains_key(&ino) {
                    continue;
                }
                if c.seen.remove(&ino) || c.open.contains_key(&ino) {
                    told.insert(ino, cb.inodes.len());
                    cb.inodes.push(Invalidation {
                        ino,
                        chunks_from: None,
                        attr: attr(ino),
                        data,
                        remapped: false,
                    });
                }
            }
            for &Recall { ino, from, cut } in &change.recalls {
                let gone = attr(ino).is_none();
                let holds = if from == 0 || gone {
                    c.maps.remove(&ino)
                } else {
                    c.maps.contains(&ino)
                };
                if !holds {
                    continue;
                }
                match told.get(&ino) {
                    Some(&i) => {
                        cb.inodes[i].chunks_from = Some(from);
                        cb.inodes[i].data |= cut;
                    }
                    None => {
                        told.insert(ino, cb.inodes.len());
                        cb.inodes.push(Invalidation {
                            ino,
                            chunks_from: Some(from),
                            attr: attr(ino),
                            data: cut,
                            remapped: false,
                        });
                    }
                }
            }
            for &ino in &change.remaps {
                if is_caller || !c.maps.remove(&ino) {
                    continue;
                }
                match told.get(&ino) {
                    Some(&i) => cb.inodes[i].remapped = true,
                    None => {
                        told.insert(ino, cb.inodes.len());
                        cb.inodes.push(Invalidation {
                            ino,
                            chunks_from: None,
                            attr: attr(ino),
                            data: false,
                            remapped: true,
                        });
                    }
                }
            }
            if !is_caller {
                for (parent, name) in &change.entries {
                    if c.dirs.contains(parent) {
                        cb.entries.push(EntryChange {
                            parent: *parent,
                            name: name.clone(),
                        });
                    }
                }
            }
            // An inode that is gone is cached by no one any more, once told.
            for ino in &gone {
                c.maps.remove(ino);
                c.seen.remove(ino);
                c.dirs.remove(ino);
            }
            if !cb.is_empty() {
                out.push((c.callbacks.clone(), cb));
            }
        }
        out
    }
}
