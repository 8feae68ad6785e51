//! What applying a request changed beyond its answer, for the service to carry out once the
//! state lock is released: callbacks to caches, revocations, freed chunks.

use std::collections::{HashMap, HashSet};

use rfs_proto::message::RequestOp;
use rfs_proto::types::{ChunkRef, Ino, Replicas};

use super::coherence::{Change, Recall};
use crate::meta::lock_table::Woken;

/// What applying a request did beyond its answer: chunks it freed, the change for caches, and
/// grants to revoke at the data nodes (once the state lock is released).
#[derive(Default)]
pub(crate) struct Effects {
    pub(crate) freed: Vec<ChunkRef>,
    pub(crate) change: Change,
    /// Chunks whose grants to the session go: files it closed its last handle of.
    pub(crate) closed: Vec<ChunkRef>,
    /// Chunks whose grants for writing go: files it closed its last writable handle of.
    pub(crate) closed_for_writing: Vec<ChunkRef>,
    /// Data sessions the session attached before and no more, by node: all their grants go.
    pub(crate) detached: Vec<(u32, u64)>,
    /// Holders are waited for only briefly ([`super::freeing::REMAP_WAIT`]).
    pub(crate) quick: bool,
    /// Sessions waiting for a lock of a file that one of went: told, not waited for.
    pub(crate) woken: Woken,
    /// Closed files keep their chunks past their size: after a restart, until clients took
    /// their handles again, a file closed here may be open at a client that wrote past the
    /// size it committed, into chunks allocated ahead.
    pub(crate) keep_past_size: bool,
    /// The freed chunks wait out the lease whatever the answers (copies a move dropped).
    pub(crate) linger: bool,
    /// Chunks a cut split, frozen: their tails are zeroed once their holders let go.
    pub(crate) tails: Vec<Tail>,
    /// [`crate::alloc::Allocator::stamp`] when the freed chunks left their maps, if that was
    /// before this hold of the state lock (moves gather the copies they dropped over several).
    pub(crate) freed_since: Option<u64>,
}

/// The chunk a cut splits (its tail is zeroed by [`super::tails`]): chunk `index` of `ino`, from byte `from` of it on, on `replicas`.
pub(crate) struct Tail {
    pub(crate) ino: Ino,
    pub(crate) index: u64,
    pub(crate) from: u64,
    pub(crate) replicas: Replicas,
}

/// A chunk map to hand out once its chunks are granted to the caller's data sessions.
pub(crate) struct Granting {
    pub(crate) op: RequestOp,
    pub(crate) writable: bool,
    /// The free number when the map was read.
    pub(crate) seq: u64,
    /// [`crate::alloc::Allocator::stamp`] when the map was read.
    pub(crate) stamp: u64,
    /// The file's count of cuts when the map was read.
    pub(crate) cuts: u64,
    pub(crate) chunks: Vec<(u64, Replicas)>,
    /// An open's answer: the file's attributes go with the map.
    pub(crate) opened: Option<rfs_proto::types::Attr>,
}

/// Chunks freed together, and their free number.
pub(crate) struct Freed {
    pub(crate) seq: u64,
    pub(crate) chunks: Vec<ChunkRef>,
    /// [`crate::alloc::Allocator::stamp`] when they left their maps.
    pub(crate) stamp: u64,
}

impl Freed {
    pub(crate) fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len as u64).sum()
    }
}

/// Whether any of chunks `first..first+count` of `ino` is being copied.
pub(crate) fn is_frozen(frozen: &HashSet<(Ino, u64)>, ino: Ino, first: u64, count: u32) -> bool {
    let span = first..first.saturating_add(count as u64);
    frozen
        .iter()
        .any(|&(i, index)| i == ino && span.contains(&index))
}

/// The chunks of `refs`, by node.
pub(crate) fn by_node<'a>(
    refs: impl IntoIterator<Item = &'a ChunkRef>,
) -> HashMap<u32, Vec<(u64, u32)>> {
    let mut out: HashMap<u32, Vec<(u64, u32)>> = HashMap::new();
    for c in refs {
        out.entry(c.node).or_default().push((c.addr, c.len));
    }
    out
}

impl Effects {
    /// Copies of `ino`'s chunks that moved (to other nodes, or to larger extents), dropped
    /// from its map: its holders let go of the map, and the old copies are kept out of reuse
    /// for a lease, since a write's late drop of the copies it missed may still name one
    /// ([`super::MetaState::moved`]).
    /// Copies moved off (`old`), the first of them when the state's stamp was `since`.
    pub(crate) fn moved_off(ino: Ino, old: Vec<ChunkRef>, since: u64) -> Effects {
        let mut effects = Effects {
            freed: old,
            quick: true,
            linger: true,
            freed_since: Some(since),
            ..Effects::default()
        };
        effects.change.remaps.push(ino);
        effects
    }

    /// Records chunks freed from `ino` (from chunk index `from` on), with its contents.
    pub(crate) fn freed(&mut self, ino: Ino, from: u64, chunks: Vec<ChunkRef>) {
        self.give_back(ino, from, chunks, true);
    }

    /// Records chunks past `ino`'s size given back (from chunk index `from` on): its
    /// contents stay as they were.
    pub(crate) fn trimmed(&mut self, ino: Ino, from: u64, chunks: Vec<ChunkRef>) {
        self.give_back(ino, from, chunks, false);
    }

    fn give_back(&mut self, ino: Ino, from: u64, chunks: Vec<ChunkRef>, cut: bool) {
        if !chunks.is_empty() {
            self.change.recalls.push(Recall { ino, from, cut });
            self.freed.extend(chunks);
        }
    }
}
