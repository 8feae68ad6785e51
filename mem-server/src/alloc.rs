//! Chunk allocation across every data node, on the metadata node.
//!
//! Chunks are handed out by smooth weighted round robin, the weight of a node being its free
//! chunk count: consecutive chunks of a file land on different nodes (parallelism), and fuller
//! nodes get fewer. A batch is all or nothing: ENOSPC allocates nothing. Freed chunks are zeroed
//! before they are reused (a new file must read zeros, and must never see another file's data);
//! until then they sit in the node's `dirty` list.

use rfs_proto::types::{ChunkRef, NodeInfo};
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

    /// (total, free) chunks over the live nodes; chunks waiting to be zeroed count as free.
    pub fn totals(&self) -> (u64, u64) {
        self.nodes
            .iter()
            .filter(|n| n.alive)
            .fold((0, 0), |(t, f), n| {
                (
                    t + n.total,
                    f + n.free.len() + n.dirty.len() as u64 + n.zeroing,
                )
            })
    }

    /// Chunks freed but not yet zeroed: allocatable soon.
    pub fn zeroing(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.alive)
            .map(|n| n.dirty.len() as u64 + n.zeroing)
            .sum()
    }

    /// `n` chunks, or ENOSPC and nothing allocated.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<ChunkRef>, Errno> {
        let available: u64 = self
            .nodes
            .iter()
            .filter(|x| x.alive)
            .map(|x| x.free.len())
            .sum();
        if available < n as u64 {
            return Err(Errno::ENOSPC);
        }
        // Weights are fixed for the batch (free counts at its start), so that the smooth round
        // robin alternates instead of chasing counts that change under it.
        let weights: Vec<i64> = self
            .nodes
            .iter()
            .map(|x| if x.alive { x.free.len() as i64 } else { 0 })
            .collect();
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let candidates = |x: &NodeChunks| x.alive && !x.free.is_empty();
            let total: i64 = self
                .nodes
                .iter()
                .filter(|x| candidates(x))
                .map(|x| weights[x.id as usize])
                .sum();
            for x in self.nodes.iter_mut().filter(|x| candidates(x)) {
                x.current += weights[x.id as usize];
            }
            let pick = self
                .nodes
                .iter_mut()
                .filter(|x| candidates(x))
                .max_by_key(|x| x.current)
                .expect("enough free chunks were counted");
            pick.current -= total;
            let addr = pick.free.pop().expect("picked nodes have a free chunk");
            out.push(ChunkRef {
                node: pick.id,
                addr,
                // Granted per client session when a map is handed out.
                rkey: 0,
            });
        }
        Ok(out)
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
        let got = a.alloc(10).unwrap();
        let on_b = got.iter().filter(|c| c.node == 1).count();
        assert_eq!(on_b, 5, "equal nodes share evenly");
        for w in got.windows(2) {
            assert_ne!(w[0].node, w[1].node, "consecutive chunks alternate");
        }
        // A fuller node gets fewer.
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 30);
        a.add_node("b".into(), 1 << 40, 100, 90);
        let got = a.alloc(40).unwrap();
        let on_b = got.iter().filter(|c| c.node == 1).count();
        assert!(on_b >= 25, "{on_b} of 40 on the emptier node");
    }

    #[test]
    fn enospc_allocates_nothing_and_dead_nodes_are_skipped() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 3);
        a.add_node("b".into(), 1000, 100, 3);
        a.set_alive(1, false);
        assert_eq!(a.alloc(4), Err(Errno::ENOSPC));
        assert_eq!(a.totals(), (3, 3));
        let got = a.alloc(3).unwrap();
        assert!(got.iter().all(|c| c.node == 0));
        assert_eq!(a.alloc(1), Err(Errno::ENOSPC));
    }

    #[test]
    fn a_huge_pool_costs_nothing_until_used() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 4096, 1 << 38);
        assert_eq!(a.totals(), (1 << 38, 1 << 38));
        let got = a.alloc(3).unwrap();
        let addrs: Vec<u64> = got.iter().map(|c| c.addr).collect();
        assert_eq!(addrs, [0, 4096, 8192], "low addresses first");
        a.release(got);
        let (node, dirty) = a.take_dirty().pop().unwrap();
        a.zeroed(node, dirty, 0);
        assert_eq!(a.totals(), (1 << 38, 1 << 38));
        assert!(
            a.alloc(1).unwrap()[0].addr < 3 * 4096,
            "zeroed chunks are reused first"
        );
    }

    #[test]
    fn freed_chunks_come_back_only_after_zeroing() {
        let mut a = Allocator::default();
        a.add_node("a".into(), 0, 100, 2);
        let got = a.alloc(2).unwrap();
        a.release(got.clone());
        assert_eq!(
            a.alloc(1),
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
        assert_eq!(a.alloc(2).unwrap().len(), 2);
    }
}
