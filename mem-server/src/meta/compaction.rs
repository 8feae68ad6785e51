//! Compaction's moving half. When whole chunks are asked for and a pool has none free, only
//! windows that small spans fragmented ([`crate::alloc`]'s compaction), the allocator picks
//! windows to empty and holds their free pieces; this thread moves every copy in them out, a
//! few chunks of one file per freeze as a drain does (frozen, copied by the node's own sessions
//! into space outside the windows, the map switched, the old copy freed like any moved one:
//! after a lease, zeroed). As the old copies come back the allocator holds them too; a window
//! all held is a whole free chunk again. The writer that asked is told EAGAIN meanwhile, and
//! asks again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use rfs_proto::types::{ChunkRef, Ino};

use super::effects::Effects;
use super::repair::per_freeze;
use super::MetaService;

/// How long one copy's READ or WRITE may take before its move is given up.
const COPY_LIMIT: Duration = Duration::from_secs(2);
/// Chunks of one file moved per freeze.
const PER_FREEZE: usize = 16;
/// How often windows are looked at for being whole again.
const TICK: Duration = Duration::from_millis(100);
/// Windows emptied at once at least, whatever was asked: each batch waits a lease for the old
/// copies to come back, so a large file gets its chunks in few batches.
const BATCH: usize = 128;

/// Whole chunks asked for, and what compaction did.
pub(crate) struct Compaction {
    ask: Sender<usize>,
    asked: Receiver<usize>,
    /// Windows that came back as whole chunks.
    pub(crate) chunks_made: AtomicU64,
    /// Bytes of copies moved out of windows.
    pub(crate) bytes_moved: AtomicU64,
}

impl Compaction {
    pub(crate) fn new() -> Compaction {
        let (ask, asked) = crossbeam_channel::bounded(1);
        Compaction {
            ask,
            asked,
            chunks_made: AtomicU64::new(0),
            bytes_moved: AtomicU64::new(0),
        }
    }

    /// Asks for `chunks` whole chunks to be made (asking again while a batch is under way
    /// adds nothing: the writer asks again when it finds none).
    pub(crate) fn ask(&self, chunks: usize) {
        let _ = self.ask.try_send(chunks);
    }
}

impl MetaService {
    /// Starts the thread that empties windows when whole chunks are asked for.
    pub(crate) fn start_compaction(self: &Arc<Self>) -> std::io::Result<()> {
        let me = self.clone();
        // A window whose copies cannot all move (a holder silent for its lease, a node gone)
        // is given back after two leases and a margin (their old copies linger a lease), so
        // that a writer asking again gets ENOSPC before it gives up waiting (30 s).
        let give_up = self.lease * 2 + Duration::from_secs(4);
        std::thread::Builder::new()
            .name("compaction".into())
            .spawn(move || loop {
                if let Ok(wanted) = me.compaction.asked.recv_timeout(TICK) {
                    // One window at a time, each on its own clock and as there is room for it
                    // then; those done meanwhile are given back between them.
                    let most = wanted.max(BATCH);
                    loop {
                        let next = me.state.lock().alloc.start_window(most);
                        let Some((node, addr)) = next else {
                            break;
                        };
                        me.empty_window(node, addr, give_up);
                        me.finish_windows(give_up);
                    }
                }
                me.finish_windows(give_up);
            })?;
        Ok(())
    }

    /// Gives back the windows that are whole again (or given up), and counts them.
    fn finish_windows(&self, give_up: Duration) {
        let made = self.state.lock().alloc.finish_compaction(give_up);
        if made > 0 {
            self.compaction
                .chunks_made
                .fetch_add(made as u64, Ordering::Relaxed);
            log::debug!("compaction: {made} whole chunks made");
        }
    }

    /// Moves every copy out of the window at `addr` of `node`'s pool; a copy that finds no
    /// room elsewhere (the holes are too small for it) gives the window up at once.
    fn empty_window(&self, node: u32, addr: u64, cooldown: Duration) {
        let (inside, window) = {
            let st = self.state.lock();
            let cs = st.ns.chunk_size();
            (
                st.ns.copies_within(node, addr, addr + cs),
                (node, addr, addr + cs),
            )
        };
        log::debug!(
            "compaction: emptying window {addr:#x} of data node {node}: {} copies to move",
            inside.len()
        );
        for (ino, indices) in per_freeze(&inside, PER_FREEZE) {
            let indices = self.freeze(ino, &indices);
            let (mut moved, mut since) = (Vec::new(), None);
            let mut no_room = false;
            for &index in &indices {
                match self.move_out_of_window(ino, index, window) {
                    Moved::Out(old, stamp) => {
                        moved.push(old);
                        since.get_or_insert(stamp);
                    }
                    Moved::NoRoom => {
                        no_room = true;
                        break;
                    }
                    Moved::Nothing => {}
                }
            }
            if let Some(since) = since {
                self.settle(
                    self.state.lock(),
                    None,
                    Effects::moved_off(ino, moved, since),
                );
            }
            self.thaw(ino, &indices);
            if no_room {
                log::info!("compaction: data node {node}: a span in window {addr:#x} finds no hole to move to: given up");
                self.state.lock().alloc.give_up_window(node, addr, cooldown);
                return;
            }
        }
    }

    /// Moves the copy of chunk `index` of `ino` (frozen) that lies in `window` (node, from,
    /// to) to space outside it.
    fn move_out_of_window(&self, ino: Ino, index: u64, (node, lo, hi): (u32, u64, u64)) -> Moved {
        let (old, leaving, target, stamp) = {
            let mut st = self.state.lock();
            let Some(old) = st.ns.replicas(ino, index) else {
                return Moved::Nothing; // gone meanwhile
            };
            let inside = |c: &ChunkRef| c.node == node && c.addr < hi && lo < c.addr + c.len as u64;
            let Some(leaving) = old.iter().copied().find(inside) else {
                return Moved::Nothing;
            };
            if !st.alloc.is_alive(leaving.node) {
                return Moved::Nothing;
            }
            let others: Vec<ChunkRef> = old
                .iter()
                .copied()
                .filter(|c| c.place() != leaving.place())
                .collect();
            let Some(target) = st
                .alloc
                .alloc_moved(&leaving, &others, (leaving.lo, leaving.len))
            else {
                return Moved::NoRoom;
            };
            (old, leaving, target, st.alloc.stamp())
        };
        // The journal must say the target was handed out before data lands in it: a restart
        // takes what is past it for zeros.
        let copied = self.state.sync().and_then(|()| {
            let data = self
                .zeroer
                .read_chunk(&leaving, leaving.len as usize, COPY_LIMIT, stamp)?;
            self.zeroer.write_chunk(&target, 0, data, COPY_LIMIT, stamp)
        });
        let new: Vec<ChunkRef> = old
            .iter()
            .map(|c| match c.place() == leaving.place() {
                true => target,
                false => *c,
            })
            .collect();
        let mut st = self.state.lock();
        // A target whose node came back meanwhile is not ours any more (its return listed it).
        let ours = st.alloc.none_back_since(&[target], stamp);
        if copied.is_err() || !ours || !st.ns.replace_copies(ino, index, &old, new) {
            // Never in a map: zeroed and reused like any freed space.
            st.alloc.release_freed([target], stamp);
            drop(st);
            self.zeroer.kick();
            if let Err(e) = copied {
                log::warn!("compaction: inode {ino}: chunk {index}: {e}");
            }
            return Moved::Nothing;
        }
        st.moved.insert(leaving.place(), target);
        self.compaction
            .bytes_moved
            .fetch_add(leaving.len as u64, Ordering::Relaxed);
        Moved::Out(leaving, st.alloc.stamp())
    }
}

/// What became of a copy in a window being emptied.
enum Moved {
    /// Moved out: the old copy, which the map names no more since the state's stamp was this.
    Out(ChunkRef, u64),
    /// No room for it outside the windows.
    NoRoom,
    /// Not moved: gone or moved meanwhile, its node down, or the copy failed.
    Nothing,
}
