//! The zeroer, on the metadata node: freed chunks are zeroed before they are allocated again
//! (a new file must read zeros, never another file's data): locally by memset, on other nodes by
//! one-sided writes of zeros over a data session of our own to each.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, Sender};
use rdmabox::transport::RemoteAddr;
use rfs_proto::data::DataSession;

use crate::meta::MetaState;
use crate::node::Shared;

pub(crate) struct Zeroer {
    /// Sessions to the other data nodes, used only to zero their freed chunks.
    sessions: Mutex<HashMap<u32, Arc<DataSession>>>,
    kick: Sender<()>,
}

impl Zeroer {
    /// The zeroer, and the kicks its thread waits on ([`Zeroer::run`]).
    pub(crate) fn new() -> (Zeroer, Receiver<()>) {
        // One pending kick is enough: a pass takes every dirty chunk there is.
        let (kick, wait) = crossbeam_channel::bounded(1);
        let z = Zeroer {
            sessions: Mutex::new(HashMap::new()),
            kick,
        };
        (z, wait)
    }

    /// Says there are dirty chunks.
    pub(crate) fn kick(&self) {
        let _ = self.kick.try_send(());
    }

    /// Zeroes the chunks of `node` through `session` from now on.
    pub(crate) fn add_node(&self, node: u32, session: DataSession) {
        self.sessions
            .lock()
            .unwrap()
            .insert(node, Arc::new(session));
    }

    pub(crate) fn remove_node(&self, node: u32) {
        self.sessions.lock().unwrap().remove(&node);
    }

    /// Zeroes dirty chunks whenever kicked, and makes them allocatable again.
    pub(crate) fn run(&self, local: &Shared, state: &Mutex<MetaState>, kick: Receiver<()>) {
        let chunk = local.cfg.chunk_size as usize;
        while kick.recv().is_ok() {
            let dirty = state.lock().unwrap().alloc.take_dirty();
            for (node, addrs) in dirty {
                let taken = addrs.len();
                let done = if node == 0 {
                    addrs
                        .into_iter()
                        .filter(|&a| {
                            let off = (a - local.pool.addr()) as usize;
                            local.pool.fill(off, chunk, 0).is_ok()
                        })
                        .collect()
                } else {
                    self.zero_remote(node, addrs, chunk)
                };
                let failed = taken - done.len();
                state.lock().unwrap().alloc.zeroed(node, done, failed);
            }
        }
    }

    /// Writes zeros over `addrs` on `node`, all in flight at once; returns those that took.
    fn zero_remote(&self, node: u32, addrs: Vec<u64>, chunk: usize) -> Vec<u64> {
        let Some(d) = self.sessions.lock().unwrap().get(&node).cloned() else {
            return Vec::new();
        };
        let pending: Vec<_> = addrs
            .iter()
            .map(|&a| {
                let at = RemoteAddr {
                    addr: a,
                    rkey: d.pool.rkey,
                };
                (a, d.session.write_pending(at, vec![0u8; chunk]))
            })
            .collect();
        pending
            .into_iter()
            .filter_map(|(a, p)| match p.wait() {
                Ok(_) => Some(a),
                Err(e) => {
                    log::warn!("zeroing a chunk on node {node}: {e}");
                    None
                }
            })
            .collect()
    }
}
