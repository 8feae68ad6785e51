//! Chunk maps: each file's chunks by index, each with its replicas; allocation adds them,
//! writes that missed replicas and nodes that left drop them, repair adds copies.

use super::*;

/// A chunk whose span does not hold what is asked: its index, its copies (none: a hole), and
/// the span (`lo`, `len`) it needs.
pub(crate) type SpanNeeded = (u64, Option<Replicas>, (u32, u32));

impl Namespace {
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

    /// What bytes `offset..end` of `ino` need of its chunks (at most `most` chunks from the
    /// first): for each chunk whose span does not hold its part of them, its index, its copies
    /// (none: a hole) and the span it needs ([`spans::wanted`]).
    pub fn spans_needed(
        &self,
        ino: Ino,
        offset: u64,
        end: u64,
        most: u64,
        room: spans::Room,
    ) -> Result<Vec<SpanNeeded>, Errno> {
        let chunks = self.chunks(ino)?;
        let cs = self.chunk_size;
        let first = offset / cs;
        let last = ((end - 1) / cs).min(first + most - 1);
        Ok((first..=last)
            .filter_map(|i| {
                let a = offset.max(i * cs) - i * cs;
                let b = end.min((i + 1).saturating_mul(cs)) - i * cs;
                let copies = chunks.get(&i);
                let have = copies.and_then(|r| r.first()).map(|c| (c.lo, c.len));
                spans::wanted(have, a, b, cs, room).map(|span| (i, copies.cloned(), span))
            })
            .collect())
    }

    /// Chunk `index` of `ino` is now on `copies` (its span grew, or it moved), if it still has
    /// every one of `was`: whether it was replaced.
    pub fn replace_copies(
        &mut self,
        ino: Ino,
        index: u64,
        was: &[ChunkRef],
        copies: Replicas,
    ) -> bool {
        match self.chunk_mut(ino, index) {
            Some(chunk)
                if chunk.len() == was.len()
                    && was.iter().all(|w| chunk.iter().any(|c| same_copy(c, w))) =>
            {
                let was = span_of(chunk);
                let now = span_of(&copies);
                *chunk = copies;
                self.note_chunk(ino, index);
                self.hold(ino, was, now);
                true
            }
            _ => false,
        }
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
        let mut grew = 0;
        for (i, c) in new {
            if !chunks.contains_key(i) {
                chunks.insert(*i, c.clone());
                added.push(*i);
                grew += span_of(c);
            }
        }
        for index in added {
            self.note_chunk(ino, index);
        }
        self.hold(ino, 0, grew);
        Ok(())
    }

    /// What `ino`'s chunks hold went from `was` bytes to `now` (a write's allocation: counted
    /// as it happens, not over the whole map again).
    fn hold(&mut self, ino: Ino, was: u64, now: u64) {
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.attr.held = (i.attr.held + now).saturating_sub(was);
        }
    }

    /// Counts what `ino`'s chunks hold again (one copy of each: its span), after its map
    /// changed. Not a journaled change: the replay counts it too.
    pub(super) fn recount(&mut self, ino: Ino) {
        if let Some(i) = self.inodes.get_mut(&ino) {
            if let Data::File { chunks } = &i.data {
                i.attr.held = chunks.values().map(|copies| span_of(copies)).sum();
            }
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
        self.chunks_where(
            |chunk| {
                let live = chunk.iter().filter(|c| alive(c.node)).count();
                live > 0 && live < target
            },
            limit,
        )
    }

    /// Up to `limit` chunks with a replica on a node `on` says yes to, file by file, and how
    /// many there are in all.
    pub fn chunks_held_on(
        &self,
        on: impl Fn(u32) -> bool,
        limit: usize,
    ) -> (Vec<(Ino, u64)>, usize) {
        self.chunks_where(|chunk| chunk.iter().any(|c| on(c.node)), limit)
    }

    /// The chunks with a copy on `node` that lies (at least partly) in `[lo, hi)` of its
    /// pool, sorted by file.
    pub fn copies_within(&self, node: u32, lo: u64, hi: u64) -> Vec<(Ino, u64)> {
        let inside = |c: &ChunkRef| c.node == node && c.addr < hi && lo < c.addr + c.len as u64;
        self.chunks_where(|r| r.iter().any(inside), usize::MAX).0
    }

    /// Up to `limit` chunks whose replicas `wanted` says yes to, file by file, and how many
    /// there are in all.
    fn chunks_where(
        &self,
        wanted: impl Fn(&Replicas) -> bool,
        limit: usize,
    ) -> (Vec<(Ino, u64)>, usize) {
        let mut found = Vec::new();
        let mut total = 0;
        for (&ino, i) in &self.inodes {
            if let Data::File { chunks } = &i.data {
                for (&index, chunk) in chunks {
                    if wanted(chunk) {
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

    /// How many copies of chunks each node holds, by node.
    pub fn copies_per_node(&self) -> HashMap<u32, u64> {
        self.holdings_per_node()
            .into_iter()
            .map(|(node, (copies, _))| (node, copies))
            .collect()
    }

    /// By node: the copies of chunks it holds, and how many chunks have their only copies
    /// there (what is lost with it).
    pub fn holdings_per_node(&self) -> HashMap<u32, (u64, u64)> {
        let mut out: HashMap<u32, (u64, u64)> = HashMap::new();
        for i in self.inodes.values() {
            if let Data::File { chunks } = &i.data {
                for r in chunks.values() {
                    for c in r {
                        out.entry(c.node).or_default().0 += 1;
                    }
                    if let Some(first) = r.first() {
                        if r.iter().all(|c| c.node == first.node) {
                            out.entry(first.node).or_default().1 += 1;
                        }
                    }
                }
            }
        }
        out
    }

    /// How many chunks have their only copies on `node`: what it takes with it.
    pub fn held_only_on(&self, node: u32) -> u64 {
        let only_there = |r: &Replicas| !r.is_empty() && r.iter().all(|c| c.node == node);
        self.chunks_where(only_there, 0).1 as u64
    }

    /// The replicas of chunk `index` of `ino`, if it has that chunk.
    pub fn replicas(&self, ino: Ino, index: u64) -> Option<Replicas> {
        self.chunks(ino).ok()?.get(&index).cloned()
    }

    /// Adds `new` to chunk `index` of `ino`, copied from `source`: only if the chunk still has
    /// `source` (it may have been freed, or its replica dropped, while it was copied).
    pub fn add_replica(&mut self, ino: Ino, index: u64, source: &ChunkRef, new: ChunkRef) -> bool {
        match self.chunk_mut(ino, index) {
            Some(chunk) if chunk.iter().any(|c| same_copy(c, source)) => {
                chunk.push(new);
                self.note_chunk(ino, index);
                true
            }
            _ => false,
        }
    }
}

/// The bytes one copy of a chunk holds (its copies all hold the same span).
fn span_of(copies: &[ChunkRef]) -> u64 {
    copies.first().map_or(0, |c| u64::from(c.len))
}
