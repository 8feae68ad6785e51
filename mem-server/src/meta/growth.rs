//! Spans that cannot grow in place move. A write past a copy's span asks for more of the chunk
//! ([`rfs_proto::message::Allocate`]); when the pool past every copy is free the span grows
//! there at once, else the chunk moves to extents of the span it needs: frozen (every holder
//! of the file's map lets go, after its transfers through it are done; the writer is told to
//! ask again), each copy read and written into its new extent by the metadata node's own
//! sessions, the map switched to the new copies, and the old ones freed like any other
//! (revoked, zeroed). A copy on a node that is down is dropped on the way, to be made again by
//! re-replication.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use rfs_proto::types::{Ino, Replicas};

use super::effects::Effects;
use super::MetaService;

/// How long one copy's READ or WRITE may take before the move is given up (and asked again).
const COPY_LIMIT: Duration = Duration::from_secs(2);

/// A chunk to move to a span: (file, chunk index, (lo, len)).
type Asked = (Ino, u64, (u32, u32));

/// The chunks asked to move, in turn.
pub(crate) struct Growth {
    ask: Sender<Asked>,
    asked: Receiver<Asked>,
    /// Asked and not yet done: asking again while a move is under way adds nothing.
    pending: Mutex<HashSet<(Ino, u64)>>,
}

impl Growth {
    pub(crate) fn new() -> Growth {
        let (ask, asked) = crossbeam_channel::unbounded();
        Growth {
            ask,
            asked,
            pending: Mutex::new(HashSet::new()),
        }
    }

    /// Asks for chunk `index` of `ino` to move to extents of span `span` (or more).
    pub(crate) fn ask(&self, ino: Ino, index: u64, span: (u32, u32)) {
        if self.pending.lock().unwrap().insert((ino, index)) {
            let _ = self.ask.send((ino, index, span));
        }
    }
}

impl MetaService {
    /// Starts the thread that moves chunks whose span could not grow in place.
    pub(crate) fn start_growth(self: &Arc<Self>) -> std::io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("growth".into())
            .spawn(move || {
                while let Ok((ino, index, span)) = me.growth.asked.recv() {
                    let frozen = me.freeze(ino, &[index]);
                    // Frozen by something else (a cut's tail, a copy): the writer asks again.
                    if !frozen.is_empty() {
                        me.move_to_span(ino, index, span);
                        me.thaw(ino, &frozen);
                    }
                    me.growth.pending.lock().unwrap().remove(&(ino, index));
                }
            })?;
        Ok(())
    }

    /// Moves chunk `index` of `ino` (frozen) to new extents of a span covering `span` and the
    /// one it has.
    fn move_to_span(&self, ino: Ino, index: u64, (lo, len): (u32, u32)) {
        let (old, targets, stamp) = {
            let mut st = self.state.lock();
            let Some(old) = st.ns.replicas(ino, index) else {
                return; // gone meanwhile
            };
            let Some(now) = old.first().copied() else {
                return;
            };
            let new_lo = lo.min(now.lo);
            let new_hi = (lo as u64 + len as u64).max(now.hi());
            if now.lo <= lo && lo as u64 + len as u64 <= now.hi() {
                return; // grew meanwhile
            }
            let span = (new_lo, (new_hi - new_lo as u64) as u32);
            let live: Replicas = old
                .iter()
                .copied()
                .filter(|c| st.alloc.is_alive(c.node))
                .collect();
            let mut targets: Replicas = Vec::with_capacity(live.len());
            for c in &live {
                let others: Replicas = live
                    .iter()
                    .filter(|o| o.place() != c.place())
                    .chain(&targets)
                    .copied()
                    .collect();
                match st.alloc.alloc_moved(c, &others, span) {
                    Some(t) => targets.push(t),
                    None => break,
                }
            }
            if live.is_empty() || targets.len() < live.len() {
                st.alloc.give_back(targets);
                log::warn!(
                    "inode {ino}: chunk {index}: no room to grow its span to {} bytes",
                    span.1
                );
                return;
            }
            let moves = live.into_iter().zip(targets).collect::<Vec<_>>();
            (old, moves, st.alloc.stamp())
        };
        // The journal must say the targets were handed out before data lands in them: a
        // restart takes what is past it for zeros.
        let copied = self.state.sync().and_then(|()| {
            targets.iter().try_for_each(|(from, to)| {
                let data = self
                    .zeroer
                    .read_chunk(from, from.len as usize, COPY_LIMIT, stamp)?;
                let at = (from.lo - to.lo) as u64;
                self.zeroer.write_chunk(to, at, data, COPY_LIMIT, stamp)
            })
        });
        let new: Replicas = targets.iter().map(|&(_, to)| to).collect();
        let mut st = self.state.lock();
        // Targets whose nodes came back meanwhile are not ours any more (their returns listed
        // them).
        let switched = copied.is_ok()
            && st.alloc.none_back_since(&new, stamp)
            && st.ns.replace_copies(ino, index, &old, new.clone());
        if !switched {
            // Never in a map: zeroed and reused like any freed space.
            st.alloc.release_freed(new, stamp);
            drop(st);
            self.zeroer.kick();
            if let Err(e) = copied {
                log::warn!("inode {ino}: chunk {index}: moving it to a larger span: {e}");
            }
            return;
        }
        for (from, to) in &targets {
            st.moved.insert(from.place(), *to);
        }
        log::debug!(
            "inode {ino}: chunk {index} moved to a span of {} bytes (no room to grow in place)",
            new[0].len
        );
        let since = st.alloc.stamp();
        self.settle(st, None, Effects::moved_off(ino, old, since));
    }
}
