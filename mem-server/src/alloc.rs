//! Chunk allocation across every data node, on the metadata node.
//!
//! Chunks are handed out by smooth weighted round robin, the weight of a node being its free
//! chunk count: consecutive chunks of a file land on different nodes (parallelism), and fuller
//! nodes get fewer. A batch is all or nothing: ENOSPC allocates nothing. Freed chunks are zeroed
//! before they are reused (a new file must read zeros, and must never see another file's data);
//! until then they sit in the node's `dirty` list.

use rfs_proto::types::{ChunkRef, NodeInfo, Replicas};
use rfs_proto::Errno;

pub struct NodeChunks {
    pub id: u32,
    pub addr: String,
    pub pool_addr: u64,
    pub total: u64,
    pub alive: bool,
    free: FreeChunks,
    dirty: Vec<u64>,
    /// Taken by the zeroer and not yet back.
    zeroing: u64,
    current: i64,
}

/// A node's allocatable chunks: those zeroed after use, then the never-used tail of the pool.
/// Kept as a counter rather than a list, so that what it costs follows what was used and not
/// what a joining node claims to lend.
struct FreeChunks {
    recycled: Vec<u64>,
    next_fresh: u64,
    fresh_left: u64,
    chunk_size: u64,
}

impl FreeChunks {
    fn len(&self) -> u64 {
        self.recycled.len() as u64 + self.fresh_left
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn pop(&mut self) -> Option<u64> {
        if let Some(a) = self.recycled.pop() {
            return Some(a);
        }
        if self.fresh_left == 0 {
            return None;
        }
        let a = self.next_fresh;
        self.next_fresh += self.chunk_size;
        self.fresh_left -= 1;
        Some(a)
    }
}

#[derive(Default)]
pub struct Allocator {
    nodes: Vec<NodeChunks>,
    /// Chunks freed and not yet released here (waiting for their holders or nodes): free
    /// space soon, as chunks being zeroed are.
    pending: u64,
}

impl Allocator {
    /// How many nodes there are: (alive, all including dead ones; ids are never reused).
    pub fn node_counts(&self) -> (usize, usize) {
        (
            self.nodes.iter().filter(|n| n.alive).count(),
            self.nodes.len(),
        )
    }

    /// Adds a node whose pool (all zero) is cut into `count` chunks of `chunk_size`.
    pub fn add_node(&mut self, addr: String, pool_addr: u64, chunk_size: u64, count: u64) -> u32 {
        let id = self.nodes.len() as u32;
        self.nodes.push(NodeChunks {
            id,
            addr,
            pool_addr,
            total: count,
            alive: true,
            free: FreeChunks {
                recycled: Vec::new(),
                next_fresh: pool_addr,
                fresh_left: count,
                chunk_size,
            },
            dirty: Vec::new(),
            zeroing: 0,
            current: 0,
        });
        id
    }

    pub fn set_alive(&mut self, id: u32, alive: bool) {
        if let Some(n) = self.nodes.get_mut(id as usize) {
            n.alive = alive;
        }
    }

    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.nodes
            .iter()
            .map(|n| NodeInfo {
                id: n.id,
                addr: n.addr.clone(),
                alive: n.alive,
            })
            .collect()
    }

    /// (total, free) chunks over the live nodes; chunks freed and not yet allocatable count
    /// as free.
    pub fn totals(&self) -> (u64, u64) {
        let (total, free) = self
            .nodes
            .iter()
            .filter(|n| n.alive)
            .fold((0, 0), |(t, f), n| {
                (
                    t + n.total,
                    f + n.free.len() + n.dirty.len() as u64 + n.zeroing,
                )
            });
        (total, (free + self.pending).min(total))
    }

    /// Chunks freed but not yet allocatable (waiting for their holders, or to be zeroed):
    /// allocatable soon.
    pub fn zeroing(&self) -> u64 {
        self.pending
            + self
                .nodes
                .iter()
                .filter(|n| n.alive)
                .map(|n| n.dirty.len() as u64 + n.zeroing)
                .sum::<u64>()
    }

    /// `n` chunks of `replicas` replicas each, every replica of a chunk on a different node,
    /// or ENOSPC and nothing allocated. While fewer live nodes than `replicas` have space,
    /// chunks get one replica per such node (the re-replicator adds the rest when nodes
    /// join); a chunk that cannot get as many as that is ENOSPC.
    pub fn alloc(&mut self, n: usize, replicas: usize) -> Result<Vec<Replicas>, Errno> {
        let available: u64 = self
            .nodes
            .iter()
            .filter(|x| x.alive)
            .map(|x| x.free.len())
            .sum();
        let want = replicas.min(self.nodes_with_space()).max(1);
        if available < (n * want) as u64 {
            return Err(Errno::ENOSPC);
        }
        // Weights are fixed for the batch (free counts at its start), so that the smooth round
        // robin alternates instead of chasing counts that change under it.
        let weights: Vec<i64> = self
            .nodes
            .iter()
            .map(|x| if x.alive { x.free.len() as i64 } else { 0 })
            .collect();
        let mut out: Vec<Replicas> = Vec::with_capacity(n);
        for _ in 0..n {
            match self.pick(&weights, want) {
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

    /// Live nodes that have a free chunk.
    fn nodes_with_space(&self) -> usize {
        self.nodes
            .iter()
            .filter(|x| x.alive && !x.free.is_empty())
            .count()
    }

    /// One chunk on `want` distinct nodes, by smooth weighted round robin generalized to
    /// several picks a round: every candidate gains `want` times its weight, the `want`
    /// highest are picked and each gives back the round's total, so that each node gets its
    /// share of replicas however many a chunk has.
    fn pick(&mut self, weights: &[i64], want: usize) -> Option<Replicas> {
        let candidates = |x: &NodeChunks| x.alive && !x.free.is_empty();
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
            let addr = node.free.pop().expect("candidates have a free chunk");
            // Granted per client session when a map is handed out.
            picked.push(ChunkRef {
                node: node.id,
                addr,
                rkey: 0,
            });
        }
        Some(picked)
    }

    /// One chunk for a new replica: on the live node with the most free chunks that none of
    /// `besides` is on, and not one of `avoid`.
    pub fn alloc_replica(&mut self, besides: &[ChunkRef], avoid: &[u32]) -> Option<ChunkRef> {
        let node = self
            .nodes
            .iter_mut()
            .filter(|x| Self::may_place(x, besides, avoid))
            .max_by_key(|x| x.free.len())?;
        let addr = node.free.pop().expect("placeable nodes have a free chunk");
        Some(ChunkRef {
            node: node.id,
            addr,
            rkey: 0,
        })
    }

    /// Whether [`Allocator::alloc_replica`] would find a place.
    pub fn can_place(&self, besides: &[ChunkRef], avoid: &[u32]) -> bool {
        self.nodes
            .iter()
            .any(|x| Self::may_place(x, besides, avoid))
    }

    fn may_place(x: &NodeChunks, besides: &[ChunkRef], avoid: &[u32]) -> bool {
        x.alive
            && !x.free.is_empty()
            && !avoid.contains(&x.id)
            && besides.iter().all(|c| c.node != x.id)
    }

    /// Chunks allocated and never handed out: free again at once (they were never written).
    fn give_back(&mut self, chunks: impl IntoIterator<Item = ChunkRef>) {
        for c in chunks {
            if let Some(n) = self.nodes.get_mut(c.node as usize) {
                n.free.recycled.push(c.addr);
            }
        }
    }

    /// Whether node `id` is alive.
    pub fn is_alive(&self, id: u32) -> bool {
        self.nodes.get(id as usize).is_some_and(|n| n.alive)
    }

    /// `n` chunks were freed and will be released once out of everyone's reach.
    pub fn expect_freed(&mut self, n: usize) {
        self.pending += n as u64;
    }

    /// `n` chunks announced by [`Allocator::expect_freed`] were released (or lost).
    pub fn freed_now(&mut self, n: usize) {
        self.pending = self.pending.saturating_sub(n as u64);
    }

    /// Takes freed chunks; they come back through `take_dirty` for zeroing.
    pub fn release(&mut self, chunks: impl IntoIterator<Item = ChunkRef>) {
        for c in chunks {
            if let Some(n) = self.nodes.get_mut(c.node as usize) {
                n.dirty.push(c.addr);
            }
        }
    }

    /// Dirty chunks to zero, by node.
    pub fn take_dirty(&mut self) -> Vec<(u32, Vec<u64>)> {
        self.nodes
            .iter_mut()
            .filter(|n| !n.dirty.is_empty())
            .map(|n| {
                n.zeroing += n.dirty.len() as u64;
                (n.id, std::mem::take(&mut n.dirty))
            })
            .collect()
    }

    /// Zeroed chunks become allocatable again; `failed` of the batch could not be zeroed (and
    /// are lost with their node).
    pub fn zeroed(&mut self, node: u32, addrs: Vec<u64>, failed: usize) {
        if let Some(n) = self.nodes.get_mut(node as usize) {
            n.zeroing = n.zeroing.saturating_sub((addrs.len() + failed) as u64);
            n.free.recycled.extend(addrs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_spread_over_nodes_by_free_space() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 100);
        a.add_node("b".into(), 1 << 40, 100, 100);
        let got: Vec<_> = a.alloc(10, 1).unwrap().concat();
        let on_b = got.iter().filter(|c| c.node == 1).count();
        assert_eq!(on_b, 5, "equal nodes share evenly");
        for w in got.windows(2) {
            assert_ne!(w[0].node, w[1].node, "consecutive chunks alternate");
        }
        // A fuller node gets fewer.
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 30);
        a.add_node("b".into(), 1 << 40, 100, 90);
        let got: Vec<_> = a.alloc(40, 1).unwrap().concat();
        let on_b = got.iter().filter(|c| c.node == 1).count();
        assert!(on_b >= 25, "{on_b} of 40 on the emptier node");
    }

    #[test]
    fn enospc_allocates_nothing_and_dead_nodes_are_skipped() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 3);
        a.add_node("b".into(), 1000, 100, 3);
        a.set_alive(1, false);
        assert_eq!(a.alloc(4, 1), Err(Errno::ENOSPC));
        assert_eq!(a.totals(), (3, 3));
        let got = a.alloc(3, 1).unwrap().concat();
        assert!(got.iter().all(|c| c.node == 0));
        assert_eq!(a.alloc(1, 1), Err(Errno::ENOSPC));
    }

    #[test]
    fn a_huge_pool_costs_nothing_until_used() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 4096, 1 << 38);
        assert_eq!(a.totals(), (1 << 38, 1 << 38));
        let got = a.alloc(3, 1).unwrap().concat();
        let addrs: Vec<u64> = got.iter().map(|c| c.addr).collect();
        assert_eq!(addrs, [0, 4096, 8192], "low addresses first");
        a.release(got);
        let (node, dirty) = a.take_dirty().pop().unwrap();
        a.zeroed(node, dirty, 0);
        assert_eq!(a.totals(), (1 << 38, 1 << 38));
        assert!(
            a.alloc(1, 1).unwrap()[0][0].addr < 3 * 4096,
            "zeroed chunks are reused first"
        );
    }

    #[test]
    fn freed_chunks_come_back_only_after_zeroing() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 2);
        let got = a.alloc(2, 1).unwrap().concat();
        a.release(got.clone());
        assert_eq!(
            a.alloc(1, 1),
            Err(Errno::ENOSPC),
            "dirty chunks are not handed out"
        );
        assert_eq!(a.totals(), (2, 2), "but they count as free space");
        let dirty = a.take_dirty();
        assert_eq!(dirty.len(), 1);
        let (node, addrs) = dirty.into_iter().next().unwrap();
        assert_eq!(addrs.len(), 2);
        assert_eq!(a.totals(), (2, 2), "being zeroed still counts as free");
        a.zeroed(node, addrs, 0);
        assert_eq!(a.alloc(2, 1).unwrap().len(), 2);
    }

    #[test]
    fn replicas_of_a_chunk_are_on_distinct_nodes_and_spread() {
        let mut a = Allocator::default();
        for i in 0..3 {
            a.add_node(format!("n{i}"), i << 40, 100, 100);
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
        a.add_node("a".into(), 0, 100, 4);
        a.add_node("b".into(), 1000, 100, 2);
        a.set_alive(1, false);
        let one = a.alloc(2, 2).unwrap();
        assert!(
            one.iter().all(|c| c.len() == 1),
            "one live node: one replica"
        );
        a.set_alive(1, true);
        // 2 free on a, 2 on b: 2 chunks of 2 fit, 3 do not, and a refusal takes nothing.
        assert_eq!(a.alloc(3, 2), Err(Errno::ENOSPC));
        assert_eq!(a.totals(), (6, 4));
        let two = a.alloc(2, 2).unwrap();
        assert!(two.iter().all(|c| c.len() == 2));
        assert_eq!(a.totals(), (6, 0));
    }
}
