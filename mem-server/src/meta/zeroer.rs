//! The zeroer, on the metadata node: freed chunks are zeroed before they are allocated again
//! (a new file must read zeros, never another file's data): locally by memset, on other nodes by
//! one-sided writes of zeros over a data session of our own to each. The same sessions copy
//! chunks for re-replication ([`Zeroer::read_chunk`], [`Zeroer::write_chunk`]).
//!
//! Each session is stamped with its node's epoch (when the node last came back), and every
//! transfer names the stamp its work began with ([`crate::alloc::Allocator::stamp`]): work
//! begun before a node left and came back must not reach its pool, where what it was about
//! may be another file's by now.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use rdmabox::transport::{MemoryRegion, RemoteAddr};
use rfs_proto::data::DataSession;
use rfs_proto::types::ChunkRef;

use crate::journal::Journaled;
use crate::meta::MetaState;
use crate::runtime::Runtime;

pub(crate) struct Zeroer {
    /// The metadata node's own pool's id: zeroed and copied by memory operations.
    local: u32,
    /// That pool.
    pool: Arc<MemoryRegion>,
    /// Sessions to the other data nodes, reaching their whole pools, with their nodes'
    /// epochs: to zero freed chunks and to copy replicas.
    sessions: Mutex<HashMap<u32, (u64, Arc<DataSession>)>>,
    kick: Sender<()>,
    /// Bytes zeroed so far: what freeing costs, beside what clients write.
    zeroed_bytes: AtomicU64,
}

impl Zeroer {
    /// The zeroer, and the kicks its thread waits on ([`Zeroer::run`]).
    pub(crate) fn new(local: u32, pool: Arc<MemoryRegion>) -> (Zeroer, Receiver<()>) {
        // One pending kick is enough: a pass takes every dirty chunk there is.
        let (kick, wait) = crossbeam_channel::bounded(1);
        let z = Zeroer {
            local,
            pool,
            sessions: Mutex::new(HashMap::new()),
            kick,
            zeroed_bytes: AtomicU64::new(0),
        };
        (z, wait)
    }

    /// Bytes zeroed since the node started.
    pub(crate) fn zeroed_bytes(&self) -> u64 {
        self.zeroed_bytes.load(Ordering::Relaxed)
    }

    /// Says there are dirty chunks.
    pub(crate) fn kick(&self) {
        let _ = self.kick.try_send(());
    }

    /// Zeroes the chunks of `node` through `session` from now on.
    pub(crate) fn add_node(&self, node: u32, epoch: u64, session: DataSession) {
        self.sessions
            .lock()
            .unwrap()
            .insert(node, (epoch, Arc::new(session)));
    }

    /// The session of `node`'s `epoch` goes (not one of a later return).
    pub(crate) fn remove_node(&self, node: u32, epoch: u64) {
        let mut sessions = self.sessions.lock().unwrap();
        if sessions.get(&node).is_some_and(|(e, _)| *e == epoch) {
            sessions.remove(&node);
        }
    }

    /// Zeroes dirty extents whenever kicked, and makes them allocatable again.
    pub(crate) fn run(&self, local: &Runtime, state: &Journaled<MetaState>, kick: Receiver<()>) {
        while kick.recv().is_ok() {
            let (stamp, dirty) = {
                let mut st = state.lock();
                (st.alloc.stamp(), st.alloc.take_dirty())
            };
            // The frees must be durable before the data goes: a restart must not find a
            // file whose chunks were wiped.
            if let Err(e) = state.sync() {
                log::error!("not zeroing freed chunks: {e}");
                continue;
            }
            let piece = local.cfg.chunk_size;
            for (node, extents) in dirty {
                // A chunk at a time: a restart lists what its nodes handed out as extents of
                // any length, and one write (and its buffer of zeros) must stay small.
                let extents: Vec<(u64, u64)> = extents
                    .into_iter()
                    .flat_map(|(a, len)| {
                        (0..len.div_ceil(piece))
                            .map(move |k| (a + k * piece, piece.min(len - k * piece)))
                    })
                    .collect();
                let taken: u64 = extents.iter().map(|&(_, l)| l).sum();
                let done: Vec<(u64, u64)> = if node == self.local {
                    extents
                        .into_iter()
                        .filter(|&(a, len)| {
                            let off = (a - local.pool.addr()) as usize;
                            local.pool.fill(off, len as usize, 0).is_ok()
                        })
                        .collect()
                } else {
                    self.zero_remote(node, extents, stamp)
                };
                let bytes: u64 = done.iter().map(|&(_, l)| l).sum();
                self.zeroed_bytes.fetch_add(bytes, Ordering::Relaxed);
                state.lock().alloc.zeroed(node, done, taken - bytes, stamp);
            }
        }
    }

    /// The `len` bytes of `chunk` (on another node, or in this node's pool `local`), by a
    /// one-sided READ given `limit` (a node that stopped must not hold its caller up; a
    /// transfer given up on still owns its buffer), for work begun at `stamp`.
    pub(crate) fn read_chunk(
        &self,
        chunk: &ChunkRef,
        len: usize,
        limit: Duration,
        stamp: u64,
    ) -> io::Result<Vec<u8>> {
        if chunk.node == self.local {
            let mut buf = vec![0; len];
            self.pool.read_at(self.local_offset(chunk)?, &mut buf)?;
            return Ok(buf);
        }
        let d = self.session(chunk.node, stamp)?;
        let at = RemoteAddr {
            addr: chunk.addr,
            rkey: d.pool.rkey,
        };
        d.session
            .read_pending(at, vec![0; len])
            .wait_timeout(limit)
            .map_err(|e| io::Error::other(format!("reading data node {}: {e}", chunk.node)))
    }

    /// Writes `data` into `chunk` from `offset` of its extent on, as [`Zeroer::read_chunk`]
    /// reads (a write given up on may still land: before the zeros of the chunk's freeing,
    /// which follow it on the same session).
    pub(crate) fn write_chunk(
        &self,
        chunk: &ChunkRef,
        offset: u64,
        data: Vec<u8>,
        limit: Duration,
        stamp: u64,
    ) -> io::Result<()> {
        if chunk.node == self.local {
            return self
                .pool
                .write_at(self.local_offset(chunk)? + offset as usize, &data);
        }
        self.write_remote(chunk, offset, data, limit, stamp)
    }

    /// Where `chunk` of this node starts in its pool.
    fn local_offset(&self, chunk: &ChunkRef) -> io::Result<usize> {
        chunk
            .addr
            .checked_sub(self.pool.addr())
            .map(|o| o as usize)
            .ok_or_else(|| io::Error::other(format!("chunk {:#x} is not in this pool", chunk.addr)))
    }

    /// Writes zeros over `len` bytes of `chunk` from `offset` of its extent on (the tail a cut left),
    /// given `limit` on another node; a write given up on may still land, zeros all the same.
    pub(crate) fn zero_range(
        &self,
        chunk: &ChunkRef,
        offset: u64,
        len: usize,
        limit: Duration,
        stamp: u64,
    ) -> io::Result<()> {
        if chunk.node == self.local {
            let start = chunk.addr.checked_sub(self.pool.addr()).ok_or_else(|| {
                io::Error::other(format!("chunk {:#x} is not in this pool", chunk.addr))
            })?;
            self.pool.fill((start + offset) as usize, len, 0)?;
        } else {
            self.write_remote(chunk, offset, vec![0; len], limit, stamp)?;
        }
        self.zeroed_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    fn write_remote(
        &self,
        chunk: &ChunkRef,
        offset: u64,
        data: Vec<u8>,
        limit: Duration,
        stamp: u64,
    ) -> io::Result<()> {
        let d = self.session(chunk.node, stamp)?;
        let at = RemoteAddr {
            addr: chunk.addr + offset,
            rkey: d.pool.rkey,
        };
        d.session
            .write_pending(at, data)
            .wait_timeout(limit)
            .map(drop)
            .map_err(|e| io::Error::other(format!("writing data node {}: {e}", chunk.node)))
    }

    /// `node`'s session, for work begun at `stamp`: none if the node left, or came back
    /// since.
    fn session(&self, node: u32, stamp: u64) -> io::Result<Arc<DataSession>> {
        match self.sessions.lock().unwrap().get(&node) {
            Some((epoch, d)) if *epoch <= stamp => Ok(d.clone()),
            Some(_) => Err(io::Error::other(format!(
                "data node {node} came back since: its pool is not what this was about"
            ))),
            None => Err(io::Error::other(format!("data node {node} has left"))),
        }
    }

    /// Writes zeros over `extents` on `node` (taken at `stamp`), all in flight at once;
    /// returns those that took.
    fn zero_remote(&self, node: u32, extents: Vec<(u64, u64)>, stamp: u64) -> Vec<(u64, u64)> {
        let Ok(d) = self.session(node, stamp) else {
            return Vec::new();
        };
        let pending: Vec<_> = extents
            .iter()
            .map(|&(a, len)| {
                let at = RemoteAddr {
                    addr: a,
                    rkey: d.pool.rkey,
                };
                (
                    (a, len),
                    d.session.write_pending(at, vec![0u8; len as usize]),
                )
            })
            .collect();
        pending
            .into_iter()
            .filter_map(|(e, p)| match p.wait() {
                Ok(_) => Some(e),
                Err(err) => {
                    log::warn!("zeroing freed space on node {node}: {err}");
                    None
                }
            })
            .collect()
    }
}
