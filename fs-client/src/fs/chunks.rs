//! The chunk cache: where each chunk of each file lives, fetched from the metadata node once
//! and then used for one-sided I/O. Writers past a file's first chunk allocate ahead, so that a
//! sequential writer asks for chunks once per run, not once per write.

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;
use rfs_proto::message::{Allocate, ChunkMap};
use rfs_proto::types::{ChunkRef, Ino};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::{Errno, MetadataChannel};

use super::error::{Error, Result};

/// Chunks allocated ahead for a file that grows past its first chunk (sequential writers).
const ALLOC_AHEAD: u64 = 16;
/// Chunk references kept.
const CAPACITY: usize = 1 << 16;

pub(crate) struct ChunkCache {
    map: Mutex<LruCache<(Ino, u64), ChunkRef>>,
}

impl Default for ChunkCache {
    fn default() -> Self {
        ChunkCache {
            map: Mutex::new(LruCache::new(
                NonZeroUsize::new(CAPACITY).expect("non-zero"),
            )),
        }
    }
}

impl ChunkCache {
    /// References cached.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    /// Drops what we know of chunks `from..` of `ino` (close-to-open, truncation).
    pub(crate) fn forget(&self, ino: Ino, from: u64) {
        let mut cache = self.map.lock().unwrap();
        let stale: Vec<_> = cache
            .iter()
            .filter(|((i, idx), _)| *i == ino && *idx >= from)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            cache.pop(&k);
        }
    }

    /// The chunks `first..first+count` of `ino` (None: a hole). With `allocate`, holes are
    /// filled by the metadata node first.
    pub(crate) fn refs(
        &self,
        meta: &impl MetadataChannel,
        ino: Ino,
        first: u64,
        count: u64,
        allocate: bool,
    ) -> Result<Vec<Option<ChunkRef>>> {
        let mut out: Vec<Option<ChunkRef>> = {
            let mut cache = self.map.lock().unwrap();
            (first..first + count)
                .map(|i| cache.get(&(ino, i)).copied())
                .collect()
        };
        let Some(lo) = out.iter().position(Option::is_none) else {
            return Ok(out);
        };
        let hi = out
            .iter()
            .rposition(Option::is_none)
            .expect("one is missing");
        let start = first + lo as u64;
        let needed = (hi - lo + 1) as u64;
        let mut got = Err(Error::from(Errno::ENOSPC));
        if allocate && start >= 1 && needed < ALLOC_AHEAD {
            // A file growing past its first chunk: reserve a run ahead of the writer, unless
            // space is too short for that; then take only what this write needs.
            got = self.fetch(meta, ino, start, ALLOC_AHEAD, true);
        }
        if matches!(&got, Err(e) if e.errno() == Errno::ENOSPC) {
            got = self.fetch(meta, ino, start, needed, allocate);
        }
        for (i, c) in got? {
            if (first..first + count).contains(&i) {
                out[(i - first) as usize] = Some(c);
            }
        }
        if allocate && out.iter().any(Option::is_none) {
            return Err(Error::new(
                Errno::EIO,
                format!("the metadata node left holes in chunks {first}+{count} of inode {ino}"),
            ));
        }
        Ok(out)
    }

    /// Chunks `start..start+want` from the metadata node (allocated first if asked), cached.
    fn fetch(
        &self,
        meta: &impl MetadataChannel,
        ino: Ino,
        mut start: u64,
        mut want: u64,
        allocate: bool,
    ) -> Result<Vec<(u64, ChunkRef)>> {
        let mut all = Vec::new();
        while want > 0 {
            let count = want.min(MAX_LIST as u64) as u32;
            let got = if allocate {
                meta.call(Allocate {
                    ino,
                    first: start,
                    count,
                })?
            } else {
                meta.call(ChunkMap {
                    ino,
                    first: start,
                    count,
                })?
            };
            let mut cache = self.map.lock().unwrap();
            for &(i, c) in &got {
                cache.put((ino, i), c);
            }
            all.extend(got);
            start += count as u64;
            want -= count as u64;
        }
        Ok(all)
    }
}
