//! Chunk allocation across every data node, on the metadata node.
//!
//! Chunks are handed out by smooth weighted round robin, the weight of a node being its free
//! space: consecutive chunks of a file land on different nodes (parallelism), and fuller nodes
//! get fewer. A copy holds a whole chunk, or a span of it (a small file, the tail of one): an
//! extent of whole pages of the node's pool, which may grow in place while its neighbours are
//! free. A batch is all or nothing: ENOSPC allocates nothing. Freed extents are zeroed before
//! they are reused (a new file must read zeros, and must never see another file's data); until
//! then they sit in the node's `dirty` list.

use rfs_proto::types::{ChunkRef, NodeInfo, Replicas};
use rfs_proto::Errno;

use crate::extents::FreeExtents;
use crate::record::Record;

mod compact;
mod membership;

/// The unit of a span: spans start and end on a page of the pool.
pub const PAGE: u64 = 4096;

/// Fresh chunks journaled as handed out ahead of use, per node: a restart zeroes at most this
/// many never-used chunks (allocations wait for them, or take fresh ones past them), and the
/// journal gets one record per this many allocations.
const RESERVE_AHEAD: u64 = 32;

pub struct NodeChunks {
    pub id: u32,
    pub addr: String,
    /// Names the node's pool (its contents), across restarts of the metadata node.
    pub pool_id: u64,
    pub pool_addr: u64,
    pub total: u64,
    pub alive: bool,
    /// Being drained: takes no new chunks, and its copies are moved to other nodes.
    pub draining: bool,
    /// Not connected, with a pool that may come back holding the chunks the maps name there
    /// ([`Allocator::rejoin`]): its join connection ended (a crash, or a node stopped past the
    /// grant deadline), or it is known from the journal and not back since a restart.
    pub away: bool,
    /// Removed from the namespace (`rfs remove`): never listed, and its pool never back.
    pub removed: bool,
    /// Nothing at or past this address was handed out (journaled): still zero.
    reserved: u64,
    chunk_size: u64,
    free: FreeExtents,
    /// Freed extents waiting to be zeroed: (address, length).
    dirty: Vec<(u64, u64)>,
    /// Bytes taken by the zeroer and not yet back.
    zeroing: u64,
    /// Windows being emptied to make whole chunks again ([`compact`]).
    compacting: Vec<compact::Window>,
    /// A window was given up on: none is tried again until then.
    compaction_stuck: Option<std::time::Instant>,
    current: i64,
    /// [`Allocator::stamp`] as of when it last left.
    left_at: u64,
    /// [`Allocator::stamp`] as of when it last came back (after a restart, or after it left).
    rejoined_at: u64,
}

impl NodeChunks {
    /// Whole chunks that can be taken now.
    fn free_chunks(&self) -> u64 {
        self.free.units()
    }

    fn has_free_chunk(&self) -> bool {
        self.free.units() > 0
    }

    /// Whether new chunks may go here.
    fn takes(&self, len: u64) -> bool {
        self.alive && !self.draining && self.has_room(len)
    }

    /// Whether a copy of `len` bytes fits now (a whole chunk's worth aligned to a chunk).
    fn has_room(&self, len: u64) -> bool {
        match len >= self.chunk_size {
            true => self.has_free_chunk(),
            false => self.free.can_take(len, PAGE),
        }
    }

    fn take(&mut self, len: u64) -> Option<u64> {
        match len >= self.chunk_size {
            true => self.free.take(self.chunk_size, self.chunk_size),
            false => self.free.take(len, PAGE),
        }
    }

    fn dirty_bytes(&self) -> u64 {
        self.dirty.iter().map(|&(_, l)| l).sum()
    }

    fn end(&self) -> u64 {
        self.pool_addr + self.total * self.chunk_size
    }
}

#[derive(Default)]
pub struct Allocator {
    nodes: Vec<NodeChunks>,
    /// Changes not yet taken for the journal (none: not journaled).
    log: Option<Vec<Record>>,
    /// Bytes freed and not yet released here (waiting for their holders or nodes): free
    /// space soon, as extents being zeroed are.
    pending: u64,
    /// Counts nodes leaving and coming back since this process started: what work is
    /// stamped with when it begins ([`Allocator::stamp`]), so that it knows when it ends
    /// whether a node it was about left or came back meanwhile.
    changes: u64,
}

impl Allocator {
    /// How many nodes there are: (alive, all including dead ones; ids are never reused).
    pub fn node_counts(&self) -> (usize, usize) {
        (
            self.nodes.iter().filter(|n| n.alive).count(),
            self.nodes.len(),
        )
    }

    /// Adds a node whose pool `pool_id` (all zero) is cut into `count` chunks of `chunk_size`.
    pub fn add_node(
        &mut self,
        addr: String,
        pool_id: u64,
        pool_addr: u64,
        chunk_size: u64,
        count: u64,
    ) -> u32 {
        let id = self.nodes.len() as u32;
        self.nodes.push(NodeChunks {
            id,
            addr,
            pool_id,
            pool_addr,
            total: count,
            alive: true,
            draining: false,
            away: false,
            removed: false,
            reserved: pool_addr,
            chunk_size,
            free: FreeExtents::fresh(
                pool_addr,
                pool_addr,
                pool_addr + count * chunk_size,
                chunk_size,
            ),
            dirty: Vec::new(),
            zeroing: 0,
            compacting: Vec::new(),
            compaction_stuck: None,
            current: 0,
            left_at: 0,
            rejoined_at: 0,
        });
        let record = Self::node_record(&self.nodes[id as usize]);
        self.note(record);
        id
    }

    /// Registers the metadata node's own pool, new with this process, at `addr` (the node's
    /// own address). Its pools of earlier lives, known from the journal, are gone with the
    /// processes that lent them: never awaited. An empty one (a node lending nothing) is taken
    /// over, id and all, rather than leaving one more node behind at every restart. Returns
    /// the pool's id and the ids of earlier pools that held chunks (their copies are lost).
    pub fn add_own_pool(
        &mut self,
        addr: String,
        pool_id: u64,
        pool_addr: u64,
        chunk_size: u64,
        count: u64,
    ) -> (u32, Vec<u32>) {
        let earlier: Vec<u32> = self
            .nodes
            .iter_mut()
            .filter(|n| n.away && n.addr == addr)
            .map(|n| {
                n.away = false;
                n.alive = false;
                n.id
            })
            .collect();
        let (empty, lost): (Vec<u32>, Vec<u32>) = earlier
            .into_iter()
            .partition(|&id| self.nodes[id as usize].total == 0);
        let Some(&reused) = empty.first().filter(|_| count == 0) else {
            let id = self.add_node(addr, pool_id, pool_addr, chunk_size, count);
            return (id, lost);
        };
        let n = &mut self.nodes[reused as usize];
        n.pool_id = pool_id;
        n.pool_addr = pool_addr;
        n.reserved = pool_addr;
        n.chunk_size = chunk_size;
        n.free = FreeExtents::fresh(pool_addr, pool_addr, pool_addr, chunk_size);
        n.compacting.clear();
        n.alive = true;
        let record = Self::node_record(n);
        self.note(record);
        (reused, lost)
    }

    fn node_record(n: &NodeChunks) -> Record {
        Record::Node {
            id: n.id,
            pool_id: n.pool_id,
            addr: n.addr.clone(),
            pool_addr: n.pool_addr,
            count: n.total,
        }
    }

    fn note(&mut self, record: Record) {
        if let Some(log) = &mut self.log {
            log.push(record);
        }
    }

    /// Journals how far `node`'s fresh chunks are handed out, ahead of use: a chunk past
    /// what the journal says was never given to anyone (so never written).
    fn reserve(&mut self, node: u32) {
        let Some(n) = self.nodes.get_mut(node as usize) else {
            return;
        };
        if n.free.next_fresh() <= n.reserved {
            return;
        }
        n.reserved = (n.free.next_fresh() + RESERVE_AHEAD * n.chunk_size).min(n.end());
        let record = Record::Fresh {
            node,
            upto: n.reserved,
        };
        self.note(record);
    }

    /// Records every change from now on, for [`Allocator::take_records`].
    pub fn journal_changes(&mut self) {
        self.log.get_or_insert_with(Vec::new);
    }

    /// The changes made since the last call, in order.
    pub fn take_records(&mut self, out: &mut Vec<Record>) {
        if let Some(log) = &mut self.log {
            out.append(log);
        }
    }

    /// Every node, `local` being the metadata node's own pool.
    pub fn nodes(&self, local: u32) -> Vec<NodeInfo> {
        self.nodes
            .iter()
            .map(|n| NodeInfo {
                id: n.id,
                addr: n.addr.clone(),
                alive: n.alive,
                meta: n.id == local,
            })
            .collect()
    }

    /// (total, free) bytes over the live nodes; space freed and not yet allocatable counts
    /// as free.
    pub fn totals(&self) -> (u64, u64) {
        let (total, free) = self
            .nodes
            .iter()
            .filter(|n| n.alive)
            .fold((0, 0), |(t, f), n| {
                let pool = n.total * n.chunk_size;
                match n.draining {
                    // Its space is leaving with it.
                    true => (t + pool - n.free.bytes(), f),
                    false => {
                        let free = n.free.bytes() + n.held_bytes() + n.dirty_bytes() + n.zeroing;
                        (t + pool, f + free)
                    }
                }
            });
        (total, (free + self.pending).min(total))
    }

    /// Every node not removed, for `rfs status`: (id, address, state, pool bytes, free bytes,
    /// free whole chunks). The state is "up", "draining", "away" (may come back with its pool)
    /// or "down" (its pool is gone).
    pub fn usage(&self) -> Vec<(u32, String, &'static str, u64, u64, u64)> {
        self.nodes
            .iter()
            .filter(|n| !n.removed)
            .map(|n| {
                let state = match (n.alive, n.away) {
                    (true, _) if n.draining => "draining",
                    (true, _) => "up",
                    (false, true) => "away",
                    (false, false) => "down",
                };
                let pool = n.total * n.chunk_size;
                (
                    n.id,
                    n.addr.clone(),
                    state,
                    pool,
                    n.free.bytes(),
                    n.free_chunks(),
                )
            })
            .collect()
    }

    /// Bytes that can be allocated now over the live nodes: [`Allocator::totals`] counts the
    /// whole chunks among them.
    pub fn allocatable_bytes(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.alive)
            .map(|n| n.free.bytes())
            .sum()
    }

    /// Bytes freed but not yet allocatable (waiting for their holders, or to be zeroed):
    /// allocatable soon.
    pub fn zeroing(&self) -> u64 {
        self.pending
            + self
                .nodes
                .iter()
                .filter(|n| n.alive)
                .map(|n| n.dirty_bytes() + n.zeroing)
                .sum::<u64>()
    }

    /// `n` whole chunks of `replicas` replicas each: see [`Allocator::alloc_spans`].
    pub fn alloc(&mut self, n: usize, replicas: usize) -> Result<Vec<Replicas>, Errno> {
        let whole = (0, self.chunk_size() as u32);
        self.alloc_spans(&vec![whole; n], replicas)
    }

    /// One chunk's span (`lo`, `len`) per entry of `spans`, of `replicas` replicas each, every
    /// replica of a chunk on a different node, or ENOSPC and nothing allocated. While fewer
    /// live nodes than `replicas` have space, chunks get one replica per such node (the
    /// re-replicator adds the rest when nodes join); a chunk that cannot get as many as that
    /// is ENOSPC.
    pub fn alloc_spans(
        &mut self,
        spans: &[(u32, u32)],
        replicas: usize,
    ) -> Result<Vec<Replicas>, Errno> {
        let available: u64 = self
            .nodes
            .iter()
            .filter(|x| x.alive && !x.draining)
            .map(|x| x.free.bytes())
            .sum();
        let most = spans
            .iter()
            .map(|&(_, len)| len as u64)
            .max()
            .unwrap_or(PAGE);
        let want = replicas.min(self.nodes_with_room(most)).max(1);
        let asked: u64 = spans.iter().map(|&(_, len)| len as u64).sum();
        if available < asked * want as u64 {
            return Err(Errno::ENOSPC);
        }
        // Weights are fixed for the batch (free space at its start), so that the smooth round
        // robin alternates instead of chasing what changes under it.
        let weights: Vec<i64> = self
            .nodes
            .iter()
            .map(|x| match x.alive && !x.draining {
                true => (x.free.bytes() / PAGE) as i64,
                false => 0,
            })
            .collect();
        let mut out: Vec<Replicas> = Vec::with_capacity(spans.len());
        for &span in spans {
            match self.pick(&weights, want, span) {
                Some(chunk) => out.push(chunk),
                None => {
                    // Space is left, but not on enough distinct nodes: give back.
                    self.give_back(out.into_iter().flatten());
                    return Err(Errno::ENOSPC);
                }
            }
        }
        Ok(out)
    }

    /// Live nodes that take new chunks and have room for `len` bytes of one.
    pub fn nodes_with_room(&self, len: u64) -> usize {
        self.nodes.iter().filter(|x| x.takes(len)).count()
    }

    /// Starts (`on`) or ends draining node `id`; ENOENT if there is no such node.
    pub fn set_draining(&mut self, id: u32, on: bool) -> Result<(), Errno> {
        let node = self.nodes.get_mut(id as usize).ok_or(Errno::ENOENT)?;
        node.draining = on;
        Ok(())
    }

    /// The nodes being drained.
    pub fn draining(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .filter(|x| x.draining)
            .map(|x| x.id)
            .collect()
    }

    /// One chunk's `span` on `want` distinct nodes, by smooth weighted round robin
    /// generalized to several picks a round: every candidate gains `want` times its weight,
    /// the `want` highest are picked and each gives back the round's total, so that each node
    /// gets its share of replicas however many a chunk has.
    fn pick(&mut self, weights: &[i64], want: usize, (lo, len): (u32, u32)) -> Option<Replicas> {
        let candidates = |x: &NodeChunks| x.takes(len as u64);
        let total: i64 = self
            .nodes
            .iter()
            .filter(|x| candidates(x))
            .map(|x| weights[x.id as usize].max(1))
            .sum();
        let mut picked: Replicas = Vec::with_capacity(want);
        if self.nodes.iter().filter(|x| candidates(x)).count() < want {
            return None;
        }
        for x in self.nodes.iter_mut().filter(|x| candidates(x)) {
            x.current += want as i64 * weights[x.id as usize].max(1);
        }
        for _ in 0..want {
            let node = self
                .nodes
                .iter_mut()
                .filter(|x| candidates(x) && picked.iter().all(|c| c.node != x.id))
                .max_by_key(|x| x.current)
                .expect("enough candidates were counted");
            node.current -= total;
            let addr = node.take(len as u64).expect("candidates have room");
            // Granted per client session when a map is handed out.
            picked.push(ChunkRef {
                node: node.id,
                addr,
                rkey: 0,
                lo,
                len,
            });
        }
        for c in &picked {
            self.reserve(c.node);
        }
        Some(picked)
    }

    /// Space for a new replica of the chunk `besides` are copies of (its span): on the live
    /// node with the most free space that none of `besides` is on, and not one of `avoid`.
    pub fn alloc_replica(&mut self, besides: &[ChunkRef], avoid: &[u32]) -> Option<ChunkRef> {
        let span = besides.first()?;
        let node = self
            .nodes
            .iter_mut()
            .filter(|x| Self::may_place(x, besides, avoid))
            .max_by_key(|x| x.free.bytes())?;
        let addr = node
            .take(span.len as u64)
            .expect("placeable nodes have room");
        let node = node.id;
        self.reserve(node);
        Some(ChunkRef {
            node,
            addr,
            rkey: 0,
            ..*span
        })
    }

    /// Grows every one of `copies`' span in place to `lo..lo + len` (which starts where they
    /// do and covers them), if each one's node has the pool past it free: the grown copies, or
    /// None and nothing taken. Their addresses stay, so references to them stay good.
    pub fn grow_in_place(&mut self, copies: &[ChunkRef], lo: u32, len: u32) -> Option<Replicas> {
        let room = |n: &NodeChunks, c: &ChunkRef| {
            c.lo == lo
                && c.len < len
                && n.alive
                && n.free.is_free(c.addr + c.len as u64, (len - c.len) as u64)
        };
        let fits = copies
            .iter()
            .all(|c| self.nodes.get(c.node as usize).is_some_and(|n| room(n, c)));
        if !fits || copies.is_empty() {
            return None;
        }
        for c in copies {
            let n = &mut self.nodes[c.node as usize];
            n.free.take_at(c.addr + c.len as u64, (len - c.len) as u64);
            self.reserve(c.node);
        }
        Some(copies.iter().map(|&c| ChunkRef { len, ..c }).collect())
    }

    /// Space for `copy`'s chunk with span (`lo`, `len`) instead: on its node if it has room,
    /// else on the live node with the most free space that none of `others` (the chunk's other
    /// copies, and the new ones so far) is on.
    pub fn alloc_moved(
        &mut self,
        copy: &ChunkRef,
        others: &[ChunkRef],
        (lo, len): (u32, u32),
    ) -> Option<ChunkRef> {
        let free = |x: &NodeChunks| others.iter().all(|c| c.node != x.id);
        let same = self
            .nodes
            .get(copy.node as usize)
            .is_some_and(|n| n.takes(len as u64) && free(n));
        let node = match same {
            true => copy.node,
            false => {
                self.nodes
                    .iter()
                    .filter(|x| x.takes(len as u64) && free(x))
                    .max_by_key(|x| x.free.bytes())?
                    .id
            }
        };
        let addr = self.nodes[node as usize].take(len as u64)?;
        self.reserve(node);
        Some(ChunkRef {
            node,
            addr,
            rkey: 0,
            lo,
            len,
        })
    }

    /// Whether `copies` could move to extents of `len` bytes now (a node with room for each):
    /// asked before a chunk is frozen for a move that would find none.
    pub fn can_move(&self, copies: &[ChunkRef], len: u32) -> bool {
        self.nodes_with_room(len as u64) >= copies.len().max(1)
    }

    /// Whether [`Allocator::alloc_replica`] would find a place.
    pub fn can_place(&self, besides: &[ChunkRef], avoid: &[u32]) -> bool {
        self.nodes
            .iter()
            .any(|x| Self::may_place(x, besides, avoid))
    }

    fn may_place(x: &NodeChunks, besides: &[ChunkRef], avoid: &[u32]) -> bool {
        let len = besides.first().map_or(x.chunk_size, |c| c.len as u64);
        x.takes(len) && !avoid.contains(&x.id) && besides.iter().all(|c| c.node != x.id)
    }

    /// Copies allocated and never handed out: free again at once (they were never written).
    pub fn give_back(&mut self, chunks: impl IntoIterator<Item = ChunkRef>) {
        for c in chunks {
            if let Some(n) = self.nodes.get_mut(c.node as usize) {
                n.give_free(c.addr, c.len as u64);
            }
        }
    }

    /// The chunk size of the file system (that of any node: they all agree).
    fn chunk_size(&self) -> u64 {
        self.nodes.first().map_or(1 << 20, |n| n.chunk_size)
    }

    /// Whether node `id` is alive.
    pub fn is_alive(&self, id: u32) -> bool {
        self.nodes.get(id as usize).is_some_and(|n| n.alive)
    }

    /// `bytes` were freed and will be released once out of everyone's reach.
    pub fn expect_freed(&mut self, bytes: u64) {
        self.pending += bytes;
    }

    /// `bytes` announced by [`Allocator::expect_freed`] were released (or lost).
    pub fn freed_now(&mut self, bytes: u64) {
        self.pending = self.pending.saturating_sub(bytes);
    }

    /// Dirty extents to zero, (address, length) by live node. A node not back after a
    /// restart keeps its list: its return lists them again (and more), which a batch taken
    /// before would duplicate.
    pub fn take_dirty(&mut self) -> Vec<(u32, Vec<(u64, u64)>)> {
        self.nodes
            .iter_mut()
            .filter(|n| n.alive && !n.dirty.is_empty())
            .map(|n| {
                n.zeroing += n.dirty_bytes();
                (n.id, std::mem::take(&mut n.dirty))
            })
            .collect()
    }

    /// Zeroed extents become allocatable again; `failed` bytes of the batch could not be
    /// zeroed (and are lost with their node). A batch taken when [`Allocator::stamp`] was
    /// `stamp` from a node that came back since is dropped: its return listed every extent
    /// no map names for zeroing again, these among them, and another may hold them by now.
    pub fn zeroed(&mut self, node: u32, extents: Vec<(u64, u64)>, failed: u64, stamp: u64) {
        if self.rejoined_since(node, stamp) {
            return;
        }
        if let Some(n) = self.nodes.get_mut(node as usize) {
            let done: u64 = extents.iter().map(|&(_, l)| l).sum();
            n.zeroing = n.zeroing.saturating_sub(done + failed);
            for (a, len) in extents {
                n.give_free(a, len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_spread_over_nodes_by_free_space() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 100, 100);
        a.add_node("b".into(), 7, 1 << 40, 100, 100);
        let got: Vec<_> = a.alloc(10, 1).unwrap().concat();
        let on_b = got.iter().filter(|c| c.node == 1).count();
        assert_eq!(on_b, 5, "equal nodes share evenly");
        for w in got.windows(2) {
            assert_ne!(w[0].node, w[1].node, "consecutive chunks alternate");
        }
        // A fuller node gets fewer.
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 100, 30);
        a.add_node("b".into(), 7, 1 << 40, 100, 90);
        let got: Vec<_> = a.alloc(40, 1).unwrap().concat();
        let on_b = got.iter().filter(|c| c.node == 1).count();
        assert!(on_b >= 25, "{on_b} of 40 on the emptier node");
    }

    #[test]
    fn enospc_allocates_nothing_and_dead_nodes_are_skipped() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 100, 3);
        a.add_node("b".into(), 7, 1000, 100, 3);
        a.nodes[1].alive = false;
        assert_eq!(a.alloc(4, 1), Err(Errno::ENOSPC));
        assert_eq!(a.totals(), (300, 300));
        let got = a.alloc(3, 1).unwrap().concat();
        assert!(got.iter().all(|c| c.node == 0));
        assert_eq!(a.alloc(1, 1), Err(Errno::ENOSPC));
    }

    #[test]
    fn a_draining_node_takes_no_new_chunks_nor_copies_and_says_so() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 100, 4);
        a.add_node("b".into(), 7, 1000, 100, 4);
        assert_eq!(a.set_draining(2, true), Err(Errno::ENOENT));
        a.set_draining(1, true).unwrap();
        assert_eq!(a.draining(), vec![1]);
        assert_eq!(a.usage()[1].2, "draining");
        let got = a.alloc(4, 1).unwrap().concat();
        assert!(got.iter().all(|c| c.node == 0));
        assert_eq!(
            a.alloc(1, 1),
            Err(Errno::ENOSPC),
            "only the draining node has room"
        );
        assert!(!a.can_place(&[], &[]));
        assert_eq!(a.alloc_replica(&[], &[]), None);
        a.set_draining(1, false).unwrap();
        assert_eq!(a.usage()[1].2, "up");
        assert_eq!(a.alloc(1, 1).unwrap()[0][0].node, 1);
    }

    #[test]
    fn a_huge_pool_costs_nothing_until_used() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 4096, 1 << 38);
        assert_eq!(a.totals(), (1 << 50, 1 << 50));
        let got = a.alloc(3, 1).unwrap().concat();
        let addrs: Vec<u64> = got.iter().map(|c| c.addr).collect();
        assert_eq!(addrs, [0, 4096, 8192], "low addresses first");
        a.release(got);
        let (node, dirty) = a.take_dirty().pop().unwrap();
        a.zeroed(node, dirty, 0, a.stamp());
        assert_eq!(a.totals(), (1 << 50, 1 << 50));
        assert!(
            a.alloc(1, 1).unwrap()[0][0].addr < 3 * 4096,
            "zeroed chunks are reused first"
        );
    }

    #[test]
    fn freed_chunks_come_back_only_after_zeroing() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 100, 2);
        let got = a.alloc(2, 1).unwrap().concat();
        a.release(got.clone());
        assert_eq!(
            a.alloc(1, 1),
            Err(Errno::ENOSPC),
            "dirty chunks are not handed out"
        );
        assert_eq!(a.totals(), (200, 200), "but they count as free space");
        let dirty = a.take_dirty();
        assert_eq!(dirty.len(), 1);
        let (node, addrs) = dirty.into_iter().next().unwrap();
        assert_eq!(addrs, [(0, 100), (100, 100)]);
        assert_eq!(a.totals(), (200, 200), "being zeroed still counts as free");
        a.zeroed(node, addrs, 0, a.stamp());
        assert_eq!(a.alloc(2, 1).unwrap().len(), 2);
    }

    #[test]
    fn replicas_of_a_chunk_are_on_distinct_nodes_and_spread() {
        let mut a = Allocator::default();
        for i in 0..3 {
            a.add_node(format!("n{i}"), i, i << 40, 100, 100);
        }
        let got = a.alloc(30, 2).unwrap();
        let mut per_node = [0; 3];
        for chunk in &got {
            assert_eq!(chunk.len(), 2);
            assert_ne!(chunk[0].node, chunk[1].node, "{chunk:?}");
            for c in chunk {
                per_node[c.node as usize] += 1;
            }
        }
        assert_eq!(per_node, [20, 20, 20], "equal nodes share evenly");
        // A new replica goes where none of the chunk is.
        let extra = a.alloc_replica(&got[0], &[]).unwrap();
        assert!(got[0].iter().all(|c| c.node != extra.node));
        let third = (0..3)
            .find(|n| got[1].iter().all(|c| c.node != *n))
            .unwrap();
        assert!(a.can_place(&got[1], &[]));
        assert!(!a.can_place(&got[1], &[third]), "avoided");
        assert_eq!(a.alloc_replica(&got[1], &[third]), None);
        let everywhere = a.alloc(1, 3).unwrap().remove(0);
        assert_eq!(
            a.alloc_replica(&everywhere, &[]),
            None,
            "no node left for it"
        );
    }

    #[test]
    fn too_few_nodes_give_fewer_replicas_and_too_little_space_gives_nothing() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, 100, 4);
        a.add_node("b".into(), 7, 1000, 100, 2);
        a.nodes[1].alive = false;
        let one = a.alloc(2, 2).unwrap();
        assert!(
            one.iter().all(|c| c.len() == 1),
            "one live node: one replica"
        );
        a.nodes[1].alive = true;
        // 2 free on a, 2 on b: 2 chunks of 2 fit, 3 do not, and a refusal takes nothing.
        assert_eq!(a.alloc(3, 2), Err(Errno::ENOSPC));
        assert_eq!(a.totals(), (600, 400));
        let two = a.alloc(2, 2).unwrap();
        assert!(two.iter().all(|c| c.len() == 2));
        assert_eq!(a.totals(), (600, 0));
    }

    #[test]
    fn a_node_back_after_a_restart_keeps_what_the_maps_name_and_zeroes_the_rest() {
        let mut a = Allocator::default();
        a.journal_changes();
        a.add_node("a".into(), 11, 0, 100, 1000);
        let used = a.alloc(3, 1).unwrap().concat();
        assert_eq!(
            used.iter().map(|c| c.addr).collect::<Vec<_>>(),
            [0, 100, 200]
        );
        let mut records = Vec::new();
        a.take_records(&mut records);
        assert!(
            records.contains(&Record::Fresh {
                node: 0,
                upto: 100 + RESERVE_AHEAD * 100
            }),
            "{records:?}"
        );
        let mut b = Allocator::replay(100, &records).unwrap();
        assert_eq!(
            b.records(),
            a.records(),
            "a snapshot of the replay is the same"
        );
        assert_eq!(b.totals(), (0, 0), "away until it comes back");
        let in_use = |_| std::collections::BTreeMap::from([(0, 100), (200, 100)]);
        assert_eq!(
            b.rejoin(12, "a".into(), (0, 1000), in_use),
            None,
            "another pool"
        );
        assert_eq!(
            b.rejoin(11, "a".into(), (0, 999), in_use),
            None,
            "another size"
        );
        assert_eq!(b.rejoin(11, "a2".into(), (0, 1000), in_use), Some(0));
        assert_eq!(
            b.rejoin(11, "a2".into(), (0, 1000), in_use),
            None,
            "back already"
        );
        assert_eq!(b.totals(), (100_000, 99_800));
        assert_eq!(b.nodes(0)[0].addr, "a2");
        // Every chunk handed out before the restart and not in a map is zeroed before reuse;
        // none in a map is handed out again.
        let (node, dirty) = b.take_dirty().pop().unwrap();
        let dirty_bytes: u64 = dirty.iter().map(|&(_, l)| l).sum();
        assert_eq!(dirty_bytes, (RESERVE_AHEAD + 1 - 2) * 100);
        assert_eq!(dirty[0], (100, 100));
        b.zeroed(node, dirty, 0, b.stamp());
        let all = b.alloc(998, 1).unwrap().concat();
        assert!(all.iter().all(|c| c.addr != 0 && c.addr != 200));
        assert_eq!(b.alloc(1, 1), Err(Errno::ENOSPC));
    }

    /// A restarted metadata node with one data node not back yet, chunks 0 and 100 in a map:
    /// (the allocator, the chunk the map names at 100).
    fn restarted_with_one_node_away() -> (Allocator, ChunkRef) {
        let mut a = Allocator::default();
        a.journal_changes();
        a.add_node("a".into(), 11, 0, 100, 10);
        let used = a.alloc(2, 1).unwrap().concat();
        let mut records = Vec::new();
        a.take_records(&mut records);
        (Allocator::replay(100, &records).unwrap(), used[1])
    }

    /// Every chunk the allocator hands out until it runs dry, zeroing as it goes: none twice.
    fn hand_everything_out(a: &mut Allocator) -> Vec<u64> {
        for (node, dirty) in a.take_dirty() {
            a.zeroed(node, dirty, 0, a.stamp());
        }
        let mut out = Vec::new();
        while let Ok(got) = a.alloc(1, 1) {
            out.push(got[0][0].addr);
        }
        let mut unique = out.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), out.len(), "a chunk handed out twice: {out:?}");
        out
    }

    #[test]
    fn a_chunk_freed_before_its_node_came_back_is_not_released_twice() {
        let (mut a, freed) = restarted_with_one_node_away();
        // Freed (its file unlinked) while the node is away; released once its holders let go,
        // after the node came back. The return listed it already: no map names it.
        let stamp = a.stamp();
        assert_eq!(
            a.rejoin(11, "a".into(), (0, 10), |_| [(0, 100)].into()),
            Some(0)
        );
        assert!(a.rejoined_since(0, stamp));
        a.release_freed([freed], stamp);
        let out = hand_everything_out(&mut a);
        assert_eq!(out.len(), 9, "all but the chunk in use: {out:?}");
        // A chunk freed after the return is released as usual.
        let (mut a, freed) = restarted_with_one_node_away();
        a.rejoin(11, "a".into(), (0, 10), |_| {
            [(0, 100), (freed.addr, 100)].into()
        });
        let stamp = a.stamp();
        a.release_freed([freed], stamp);
        assert_eq!(hand_everything_out(&mut a).len(), 9);
    }

    #[test]
    fn no_zeroing_batch_is_taken_from_a_node_not_back_yet() {
        let (mut a, freed) = restarted_with_one_node_away();
        // Released at once (no grant channel to the node), then the zeroer looks before the node is back.
        a.release([freed]);
        let batch = a.take_dirty();
        a.rejoin(11, "a".into(), (0, 10), |_| [(0, 100)].into());
        // The zeroer finishes what it took, its node's session found by then.
        for (node, addrs) in batch {
            a.zeroed(node, addrs, 0, a.stamp());
        }
        assert_eq!(hand_everything_out(&mut a).len(), 9);
    }

    #[test]
    fn a_metadata_node_lending_nothing_keeps_one_entry_across_restarts() {
        let mut records = Vec::new();
        for life in 0..5u64 {
            let mut a = Allocator::replay(100, &records).unwrap();
            if life == 0 {
                a.add_node("data".into(), 7, 0, 100, 10);
            }
            let (own, lost) = a.add_own_pool("meta".into(), 100 + life, 1 << 40, 100, 0);
            assert!(lost.is_empty());
            let nodes = a.nodes(own);
            assert_eq!(nodes.len(), 2, "life {life}: the data node and ours");
            assert!(nodes[own as usize].alive && nodes[own as usize].meta);
            let awaited: &[u32] = if life == 0 { &[] } else { &[0] };
            assert_eq!(
                a.away(),
                awaited,
                "life {life}: only the data node is awaited"
            );
            records = a.records();
        }
        // One that lent memory: its earlier pool is lost, not awaited, and the new one is new.
        let mut a = Allocator::replay(100, &records).unwrap();
        let (first, _) = a.add_own_pool("meta".into(), 200, 0, 100, 10);
        let mut b = Allocator::replay(100, &a.records()).unwrap();
        let (second, lost) = b.add_own_pool("meta".into(), 201, 0, 100, 10);
        assert_eq!(lost, [first]);
        assert_ne!(second, first);
        assert!(!b.is_away(first) && !b.is_alive(first));
    }

    #[test]
    fn a_node_that_left_comes_back_with_what_the_maps_name_and_zeroes_the_rest() {
        let mut a = Allocator::default();
        a.journal_changes();
        a.add_node("a".into(), 11, 0, 100, 10);
        let used = a.alloc(3, 1).unwrap().concat();
        a.leave(0);
        assert!(a.is_away(0) && !a.is_alive(0) && a.is_away_pool(11));
        assert_eq!(a.usage()[0].2, "away");
        // Freed while it was away, released only after it came back: not listed twice.
        let stamp = a.stamp();
        assert_eq!(
            a.rejoin(11, "a".into(), (0, 10), |_| [(used[0].addr, 100)].into()),
            Some(0)
        );
        a.release_freed([used[1]], stamp);
        assert!(a.is_alive(0) && !a.is_away(0));
        assert_eq!(
            hand_everything_out(&mut a).len(),
            9,
            "all but the one in use"
        );
    }

    #[test]
    fn a_new_node_at_an_away_nodes_address_leaves_it_down_for_good() {
        let mut a = Allocator::default();
        a.journal_changes();
        a.add_node("a".into(), 11, 0, 100, 10);
        a.add_node("b".into(), 12, 0, 100, 10);
        a.leave(0);
        a.leave(1);
        assert_eq!(a.gone_from("a"), [0]);
        assert!(!a.is_away_pool(11) && a.is_away_pool(12));
        assert_eq!(a.usage()[0].2, "down");
        assert_eq!(
            a.rejoin(11, "a".into(), (0, 10), |_| Default::default()),
            None
        );
        // Down for good after a restart too, from the journal and from a snapshot: never
        // awaited.
        let mut journal = Vec::new();
        a.take_records(&mut journal);
        for records in [journal, a.records()] {
            let b = Allocator::replay(100, &records).unwrap();
            assert_eq!(b.away(), [1], "only b may come back");
            assert_eq!(b.usage()[0].2, "down");
        }
    }

    #[test]
    fn a_removed_node_is_not_listed_its_pool_never_back_even_after_a_restart() {
        let mut a = Allocator::default();
        a.journal_changes();
        a.add_node("a".into(), 11, 0, 100, 10);
        a.add_node("b".into(), 12, 1000, 100, 10);
        assert_eq!(a.remove(1), Err(Errno::EBUSY), "up");
        assert_eq!(a.remove(2), Err(Errno::ENOENT));
        a.leave(1);
        a.remove(1).unwrap();
        assert_eq!(a.remove(1), Err(Errno::ENOENT), "removed once");
        let listed = |a: &Allocator| a.usage().iter().map(|u| u.0).collect::<Vec<_>>();
        assert_eq!(listed(&a), [0]);
        assert!(!a.is_away_pool(12));
        assert_eq!(
            a.rejoin(12, "b".into(), (1000, 10), |_| Default::default()),
            None
        );
        assert_eq!(a.totals(), (1000, 1000), "its space is not counted");
        // From the journal, and from a snapshot.
        let mut journal = Vec::new();
        a.take_records(&mut journal);
        for records in [journal, a.records()] {
            let b = Allocator::replay(100, &records).unwrap();
            assert_eq!(listed(&b), [0]);
            assert!(b.is_away(0) && !b.is_away(1) && !b.is_away_pool(12));
        }
    }

    #[test]
    fn a_zeroing_batch_taken_before_its_node_left_and_came_back_is_not_freed_twice() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 11, 0, 100, 10);
        let used = a.alloc(2, 1).unwrap().concat();
        a.release([used[1]]);
        let stamp = a.stamp();
        let batch = a.take_dirty();
        a.leave(0);
        a.rejoin(11, "a".into(), (0, 10), |_| [(used[0].addr, 100)].into());
        for (node, extents) in batch {
            a.zeroed(node, extents, 0, stamp);
        }
        assert_eq!(hand_everything_out(&mut a).len(), 9, "each extent once");
    }
}
