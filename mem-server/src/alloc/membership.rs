//! Who lends the pools: the registry of data nodes as journal records and its replay after a
//! restart of the metadata node; nodes leaving, coming back (what a pool holds is known from
//! the maps; everything else it ever handed out is zeroed before reuse) and removed; and the
//! stamps by which work begun before a node left or came back knows it.

use std::collections::BTreeMap;

use rfs_proto::types::ChunkRef;
use rfs_proto::Errno;

use super::{Allocator, FreeExtents};
use crate::record::Record;

impl Allocator {
    /// Every node as records: replayed, they rebuild the registry.
    pub fn records(&self) -> Vec<Record> {
        self.nodes
            .iter()
            .flat_map(|n| {
                let fresh = Record::Fresh {
                    node: n.id,
                    upto: n.reserved,
                };
                // Removed, or down for good: never awaited after a restart.
                let gone = match (n.removed, n.alive || n.away) {
                    (true, _) => Some(Record::Removed { node: n.id }),
                    (false, false) => Some(Record::Down { node: n.id }),
                    (false, true) => None,
                };
                [Self::node_record(n), fresh].into_iter().chain(gone)
            })
            .collect()
    }

    /// The registry `records` describe (other records are passed over), journaling from then
    /// on: every node is away until it comes back ([`Allocator::rejoin`]).
    pub fn replay(chunk_size: u64, records: &[Record]) -> Result<Allocator, String> {
        let mut a = Allocator::default();
        for r in records {
            match r {
                Record::Node {
                    id,
                    pool_id,
                    addr,
                    pool_addr,
                    count,
                } => {
                    let id = *id as usize;
                    if id < a.nodes.len() {
                        a.nodes[id].addr = addr.clone();
                        continue;
                    }
                    if id != a.nodes.len() {
                        return Err(format!(
                            "data node {id} comes before node {}",
                            a.nodes.len()
                        ));
                    }
                    a.add_node(addr.clone(), *pool_id, *pool_addr, chunk_size, *count);
                    let n = &mut a.nodes[id];
                    n.alive = false;
                    n.away = true;
                }
                Record::Fresh { node, upto } => match a.nodes.get_mut(*node as usize) {
                    Some(n) => n.reserved = n.reserved.max(*upto),
                    None => return Err(format!("fresh chunks of unknown data node {node}")),
                },
                Record::Removed { node } => a
                    .remove(*node)
                    .map_err(|_| format!("removal of unknown data node {node}"))?,
                Record::Down { node } => match a.nodes.get_mut(*node as usize) {
                    Some(n) => n.away = false,
                    None => return Err(format!("unknown data node {node} down")),
                },
                _ => {}
            }
        }
        a.journal_changes();
        Ok(a)
    }

    /// A node with pool `pool_id` came back after a restart of the metadata node, with its
    /// pool as it was (`pool_addr`, `count` chunks): the id it had, the extents that the maps
    /// name (`in_use`: length by address) kept, everything else it ever handed out to be
    /// zeroed before reuse. None if the journal does not know the pool (or it is back already).
    pub fn rejoin(
        &mut self,
        pool_id: u64,
        addr: String,
        (pool_addr, count): (u64, u64),
        in_use: impl FnOnce(u32) -> BTreeMap<u64, u64>,
    ) -> Option<u32> {
        let n = self.nodes.iter_mut().find(|n| {
            n.away && n.pool_id == pool_id && n.pool_addr == pool_addr && n.total == count
        })?;
        let cs = n.chunk_size;
        let mut at = n.pool_addr;
        n.dirty = Vec::new();
        for (a, len) in in_use(n.id) {
            if a > at {
                n.dirty.push((at, a.min(n.reserved).saturating_sub(at)));
            }
            at = at.max(a + len);
        }
        if at < n.reserved {
            n.dirty.push((at, n.reserved - at));
        }
        n.dirty.retain(|&(_, len)| len > 0);
        let end = n.pool_addr + n.total * cs;
        n.free = FreeExtents::fresh(n.pool_addr, n.reserved, end, cs);
        n.compacting.clear();
        n.zeroing = 0;
        n.current = 0;
        n.alive = true;
        n.away = false;
        n.addr = addr;
        self.changes += 1;
        n.rejoined_at = self.changes;
        let id = n.id;
        let record = Self::node_record(n);
        self.note(record);
        Some(id)
    }

    /// Node `id` left (its join connection ended): away, until it comes back with its pool.
    pub fn leave(&mut self, id: u32) {
        if let Some(n) = self.nodes.get_mut(id as usize).filter(|n| !n.removed) {
            self.changes += 1;
            n.alive = false;
            n.away = true;
            n.left_at = self.changes;
        }
    }

    /// The nodes that left since `stamp` ([`Allocator::stamp`]): a chunk map read before
    /// may name copies there that their leave dropped.
    pub fn left_since(&self, stamp: u64) -> Vec<u32> {
        self.nodes
            .iter()
            .filter(|n| n.left_at > stamp)
            .map(|n| n.id)
            .collect()
    }

    /// A new node joined from `addr`: the nodes away from that address lent pools that went
    /// with their processes (a node's address is its listening socket, which only one process
    /// holds). They are down for good (journaled); their ids.
    pub fn gone_from(&mut self, addr: &str) -> Vec<u32> {
        let gone: Vec<u32> = self
            .nodes
            .iter_mut()
            .filter(|n| n.away && n.addr == addr)
            .map(|n| {
                n.away = false;
                n.id
            })
            .collect();
        for &node in &gone {
            self.note(Record::Down { node });
        }
        gone
    }

    /// Forgets node `id` (`rfs remove`): it is not listed any more, and its pool, were it to
    /// come back, joins as a new one. Only a node that is not up: EBUSY for one that is, ENOENT
    /// for no such node. Copies the maps still name there stay unreadable.
    pub fn remove(&mut self, id: u32) -> Result<(), Errno> {
        let n = match self.nodes.get_mut(id as usize) {
            Some(n) if !n.removed => n,
            _ => return Err(Errno::ENOENT),
        };
        if n.alive {
            return Err(Errno::EBUSY);
        }
        n.removed = true;
        n.away = false;
        n.draining = false;
        n.free = FreeExtents::fresh(n.pool_addr, n.pool_addr, n.pool_addr, n.chunk_size);
        n.dirty = Vec::new();
        n.compacting = Vec::new();
        n.zeroing = 0;
        self.note(Record::Removed { node: id });
        Ok(())
    }

    /// Whether node `id` is away: it may come back with its pool.
    pub fn is_away(&self, id: u32) -> bool {
        self.nodes.get(id as usize).is_some_and(|n| n.away)
    }

    /// Whether the pool `pool_id` is that of a node away.
    pub fn is_away_pool(&self, pool_id: u64) -> bool {
        self.nodes.iter().any(|n| n.away && n.pool_id == pool_id)
    }

    /// Whether the pool `pool_id` is that of a node up.
    pub fn is_live_pool(&self, pool_id: u64) -> bool {
        self.nodes.iter().any(|n| n.alive && n.pool_id == pool_id)
    }

    /// The nodes away.
    pub fn away(&self) -> Vec<u32> {
        self.nodes.iter().filter(|n| n.away).map(|n| n.id).collect()
    }

    /// What work begun now is stamped with: a chunk freed now (for
    /// [`Allocator::release_freed`]), a copy's target, a chunk map to grant.
    pub fn stamp(&self) -> u64 {
        self.changes
    }

    /// The [`Allocator::stamp`] count when node `id` last came back: what its sessions are
    /// stamped with, so that work begun before that (when it was away, or before it left)
    /// cannot use them.
    pub fn epoch(&self, id: u32) -> u64 {
        self.nodes.get(id as usize).map_or(0, |n| n.rejoined_at)
    }

    /// Whether node `id` came back (after a restart, or after it left) since `stamp`
    /// ([`Allocator::stamp`]).
    pub fn rejoined_since(&self, id: u32, stamp: u64) -> bool {
        self.nodes
            .get(id as usize)
            .is_some_and(|n| n.rejoined_at > stamp)
    }

    /// Whether no node of `copies` came back since `stamp`: space taken for them then is still
    /// theirs (a return lists every extent no map names for zeroing).
    pub fn none_back_since(&self, copies: &[ChunkRef], stamp: u64) -> bool {
        copies.iter().all(|c| !self.rejoined_since(c.node, stamp))
    }

    /// Takes chunks freed just now; they come back through `take_dirty` for zeroing.
    pub fn release(&mut self, chunks: impl IntoIterator<Item = ChunkRef>) {
        let now = self.changes;
        self.release_freed(chunks, now);
    }

    /// Takes chunks freed when [`Allocator::stamp`] was `stamp`, but those whose node came
    /// back since: its return listed every chunk of its pool that no map named for zeroing,
    /// these among them, and a second listing would hand one chunk to two files.
    pub fn release_freed(&mut self, chunks: impl IntoIterator<Item = ChunkRef>, stamp: u64) {
        for c in chunks {
            if let Some(n) = self.nodes.get_mut(c.node as usize) {
                if n.rejoined_at <= stamp {
                    n.dirty.push((c.addr, c.len as u64));
                }
            }
        }
    }
}
