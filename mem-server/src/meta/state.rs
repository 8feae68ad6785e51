//! What the metadata service keeps under its one lock: the namespace, the allocator, who
//! caches what, file locks, and which clients hold handles (journaled with the rest, so that a
//! restart knows whom to wait for).

use std::collections::{HashMap, HashSet};

use rfs_proto::types::{ChunkRef, Ino};

use super::coherence::Holders;
use crate::alloc::Allocator;
use crate::journal::Durable;
use crate::meta::lock_table::LockTable;
use crate::namespace::Namespace;
use crate::record::Record;

/// The namespace, the allocator and who caches what, under one lock (journaled: see
/// [`Journaled`]).
pub(crate) struct MetaState {
    pub(crate) ns: Namespace,
    pub(crate) alloc: Allocator,
    pub(crate) holders: Holders,
    /// How many frees there were: grants decided now carry it, so that a data node refuses
    /// one that arrives after a later free was revoked.
    pub(crate) frees: u64,
    /// Chunks being copied to new replicas: maps of them are not handed out (EAGAIN: the
    /// client asks again) until the copies are in them.
    pub(crate) frozen: HashSet<(Ino, u64)>,
    /// Copies (node, address) whose tail a cut is zeroing: freed meanwhile, they are not
    /// reused until it is done (a late zero must not land in another file's data).
    pub(crate) tails_zeroing: HashSet<(u32, u64)>,
    /// Copies moved (node, address of the old one) until the old one is reused, to the copy
    /// made from each: a write that reached the old one and missed another copy names it when
    /// it asks for the others to be dropped (see [`crate::meta::moves`]).
    pub(crate) moved: HashMap<(u32, u64), ChunkRef>,
    /// A rebalance was asked for and the nodes' fill is not even yet (not journaled).
    pub(crate) rebalancing: bool,
    /// Every client's file locks (not journaled: clients take them again after a restart).
    pub(crate) locks: LockTable,
    /// The clients holding handles open (journaled): those a restart waits for.
    pub(crate) holding: HandleHolders,
}

/// The clients that hold handles open, journaled as they come and go: after a restart, those
/// that held some are waited for (to take them back) before closed files give back what they
/// kept past their size and files unlinked while open go.
#[derive(Default)]
pub(crate) struct HandleHolders {
    pub(super) clients: HashSet<u64>,
    pub(super) log: Vec<Record>,
}

impl HandleHolders {
    /// Client `client` holds handles now (`holds`), or no more.
    pub(super) fn set(&mut self, client: u64, holds: bool) {
        let changed = if holds {
            self.clients.insert(client)
        } else {
            self.clients.remove(&client)
        };
        if changed {
            self.log.push(Record::Holding { client, holds });
        }
    }

    /// The clients that `records` leave holding handles.
    pub(super) fn replay(records: &[Record]) -> HashSet<u64> {
        let mut clients = HashSet::new();
        for r in records {
            if let Record::Holding { client, holds } = *r {
                if holds {
                    clients.insert(client);
                } else {
                    clients.remove(&client);
                }
            }
        }
        clients
    }
}

impl Durable for MetaState {
    fn take_records(&mut self, out: &mut Vec<Record>) {
        let before = out.len();
        self.ns.take_records(out);
        self.alloc.take_records(out);
        // A client that now holds handles is journaled before the call that made it so is
        // answered: a restart that did not know it would end its grace without it, trimming
        // what it wrote past sizes. One that holds none any more rides along with the next
        // change journaled anyway (lost, it is only waited for in vain until the grace ends),
        // rather than costing an fsync at every last close.
        let holds = |r: &Record| matches!(r, Record::Holding { holds: true, .. });
        if out.len() > before || self.holding.log.iter().any(holds) {
            out.append(&mut self.holding.log);
        }
    }

    fn records(&self) -> Vec<Record> {
        let mut all = self.ns.records();
        all.extend(self.alloc.records());
        all.extend(self.holding.clients.iter().map(|&client| Record::Holding {
            client,
            holds: true,
        }));
        all
    }
}
