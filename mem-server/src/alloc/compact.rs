//! Compaction: whole chunks made again out of space that small spans fragmented.
//!
//! A large file's chunk needs a whole chunk of a pool, aligned to a chunk. Small files and
//! their deletion can leave a pool with plenty of free bytes and no such window: every window
//! holds a few spans. Then a window (the least used one of a node) is emptied: its free pieces
//! are held back from allocation, the spans in it move out (the metadata service copies them,
//! [`crate::meta`]'s compaction), and what they leave, once freed and zeroed like any freed
//! space, is held too; when the whole window is held it is given back as one whole chunk.

use std::time::{Duration, Instant};

use super::{Allocator, NodeChunks};

/// A window being emptied: the free pieces of it held back so far.
pub(crate) struct Window {
    pub(crate) addr: u64,
    held: Vec<(u64, u64)>,
    held_bytes: u64,
    started: Instant,
}

impl NodeChunks {
    /// Gives back `[addr, addr + len)` (zeroed): the parts within a window being emptied are
    /// held there, the rest is free.
    pub(super) fn give_free(&mut self, addr: u64, len: u64) {
        let mut rest = vec![(addr, len)];
        for w in &mut self.compacting {
            let (lo, hi) = (w.addr, w.addr + self.chunk_size);
            let mut outside = Vec::new();
            for (a, l) in rest {
                let (from, to) = (a.max(lo), (a + l).min(hi));
                if from >= to {
                    outside.push((a, l));
                    continue;
                }
                w.held.push((from, to - from));
                w.held_bytes += to - from;
                outside.extend(
                    [(a, from - a), (to, a + l - to)]
                        .into_iter()
                        .filter(|p| p.1 > 0),
                );
            }
            rest = outside;
        }
        for (a, l) in rest {
            self.free.give(a, l);
        }
    }

    /// Bytes held back in windows being emptied: free space, not allocatable for now.
    pub(super) fn held_bytes(&self) -> u64 {
        self.compacting.iter().map(|w| w.held_bytes).sum()
    }

    /// The window of this node worth emptying now, if any: among those with free space and
    /// not being emptied, the one with the most free (the fewest bytes to move), if what it
    /// holds fits in the node's free space outside it beside what the windows under way still
    /// hold (counted whole until it is back: a window never waits for room another took).
    fn window_to_empty(&self) -> Option<u64> {
        if self
            .compaction_stuck
            .is_some_and(|until| Instant::now() < until)
        {
            return None;
        }
        let free = self.free.bytes();
        let cs = self.chunk_size;
        let to_move: u64 = self.compacting.iter().map(|w| cs - w.held_bytes).sum();
        self.free
            .free_per_window()
            .into_iter()
            .filter(|&(w, _)| self.compacting.iter().all(|c| c.addr != w))
            .filter(|&(w, _)| w + cs <= self.free.next_fresh())
            .filter(|&(_, f)| f < cs && to_move + (cs - f) <= free - f)
            .max_by_key(|&(w, f)| (f, std::cmp::Reverse(w)))
            .map(|(w, _)| w)
    }
}

impl Allocator {
    /// Whether whole chunks could be had by emptying windows (or soon will be, from windows
    /// being emptied): a live node that takes chunks has none free, and has a window worth
    /// emptying or one under way. Asked when an allocation of whole chunks finds no room,
    /// before it is refused with ENOSPC.
    pub fn compactable(&self) -> bool {
        self.nodes.iter().any(|n| {
            n.alive
                && !n.draining
                && !n.has_free_chunk()
                && (!n.compacting.is_empty() || n.window_to_empty().is_some())
        })
    }

    /// Starts emptying one window, if fewer than `most` are under way over every node: on the
    /// node with the most free space that has no whole chunk free and a window worth emptying.
    /// Its free pieces are held from now on; the caller moves what it holds out. (node, window
    /// address).
    pub fn start_window(&mut self, most: usize) -> Option<(u32, u64)> {
        let under_way: usize = self.nodes.iter().map(|n| n.compacting.len()).sum();
        if under_way >= most {
            return None;
        }
        let (n, addr) = self
            .nodes
            .iter_mut()
            .filter(|n| n.alive && !n.draining && !n.has_free_chunk())
            .filter_map(|n| n.window_to_empty().map(|w| (n, w)))
            .max_by_key(|(n, _)| n.free.bytes())?;
        let held = n.free.take_within(addr, addr + n.chunk_size);
        let held_bytes = held.iter().map(|&(_, l)| l).sum();
        n.compacting.push(Window {
            addr,
            held,
            held_bytes,
            started: Instant::now(),
        });
        Some((n.id, addr))
    }

    /// Gives back the windows all of whose space is held (each a whole free chunk now), and
    /// those older than `give_up` whatever they hold (something in them could not move, or
    /// its node went; no window of that node is tried again for as long): how many came back
    /// whole.
    pub fn finish_compaction(&mut self, give_up: Duration) -> usize {
        let mut whole = 0;
        for n in &mut self.nodes {
            let (done, going): (Vec<Window>, Vec<Window>) = std::mem::take(&mut n.compacting)
                .into_iter()
                .partition(|w| {
                    w.held_bytes >= n.chunk_size || w.started.elapsed() > give_up || !n.alive
                });
            n.compacting = going;
            for w in done {
                let made = w.held_bytes >= n.chunk_size;
                whole += usize::from(made);
                if !made {
                    n.compaction_stuck = Some(Instant::now() + give_up);
                }
                for (a, l) in w.held {
                    n.free.give(a, l);
                }
            }
        }
        whole
    }

    /// Gives window `addr` of `node` back now, whatever it holds (a span in it found no room
    /// elsewhere), and tries no window of that node for `cooldown`.
    pub fn give_up_window(&mut self, node: u32, addr: u64, cooldown: Duration) {
        let Some(n) = self.nodes.get_mut(node as usize) else {
            return;
        };
        let Some(at) = n.compacting.iter().position(|w| w.addr == addr) else {
            return;
        };
        let w = n.compacting.remove(at);
        for (a, l) in w.held {
            n.free.give(a, l);
        }
        n.compaction_stuck = Some(Instant::now() + cooldown);
    }

    /// Whether windows are being emptied: space held now that comes back soon (an
    /// allocation that finds no room now may find it then).
    pub fn compacting(&self) -> bool {
        self.nodes.iter().any(|n| !n.compacting.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::super::PAGE;
    use super::*;
    use rfs_proto::types::ChunkRef;

    const CHUNK: u64 = 1 << 20;

    /// Starts windows while fewer than `most` are under way: those started.
    fn start(a: &mut Allocator, most: usize) -> Vec<(u32, u64)> {
        std::iter::from_fn(|| a.start_window(most)).collect()
    }

    /// Whether `copy` lies (at least partly) in a window being emptied on its node.
    fn in_window(a: &Allocator, copy: &ChunkRef) -> bool {
        let n = &a.nodes[copy.node as usize];
        let end = copy.addr + copy.len as u64;
        n.compacting
            .iter()
            .any(|w| copy.addr < w.addr + n.chunk_size && w.addr < end)
    }

    /// A pool of four chunks filled with pages, every other one freed: no whole chunk.
    fn fragmented() -> (Allocator, Vec<ChunkRef>) {
        let mut a = Allocator::default();
        a.add_node("a".into(), 7, 0, CHUNK, 4);
        let pages = (CHUNK * 4 / PAGE) as usize;
        let got = a.alloc_spans(&vec![(0, PAGE as u32); pages], 1).unwrap();
        let (gone, kept): (Vec<_>, Vec<_>) = got
            .into_iter()
            .flatten()
            .enumerate()
            .partition(|(i, _)| i % 2 == 0);
        a.release(gone.into_iter().map(|(_, c)| c));
        let (node, dirty) = a.take_dirty().pop().unwrap();
        a.zeroed(node, dirty, 0, a.stamp());
        (a, kept.into_iter().map(|(_, c)| c).collect())
    }

    #[test]
    fn a_window_emptied_comes_back_as_a_whole_chunk() {
        let (mut a, kept) = fragmented();
        assert_eq!(
            a.alloc(1, 1),
            Err(rfs_proto::Errno::ENOSPC),
            "no whole chunk"
        );
        assert_eq!(a.totals().1, 2 * CHUNK, "though half the pool is free");
        assert!(a.compactable());
        let started = start(&mut a, 1);
        assert_eq!(started.len(), 1);
        let (_, window) = started[0];
        assert_eq!(start(&mut a, 1), vec![], "one under way is enough for one");
        assert_eq!(a.totals().1, 2 * CHUNK, "held space still counts as free");
        // Its spans move out: new space for each, the old freed and zeroed.
        let inside: Vec<ChunkRef> = kept
            .iter()
            .copied()
            .filter(|c| c.addr >= window && c.addr < window + CHUNK)
            .collect();
        assert_eq!(inside.len(), (CHUNK / PAGE / 2) as usize);
        for c in &inside {
            assert!(in_window(&a, c));
            let moved = a.alloc_moved(c, &[], (0, PAGE as u32)).unwrap();
            assert!(
                !in_window(&a, &moved),
                "nothing moves into a window being emptied"
            );
        }
        a.release(inside);
        assert_eq!(
            a.finish_compaction(Duration::from_secs(60)),
            0,
            "not all back yet"
        );
        let (node, dirty) = a.take_dirty().pop().unwrap();
        a.zeroed(node, dirty, 0, a.stamp());
        assert_eq!(a.finish_compaction(Duration::from_secs(60)), 1);
        assert!(!a.compactable(), "a whole chunk is free");
        let whole = a.alloc(1, 1).unwrap();
        assert_eq!(whole[0][0].addr, window, "the emptied window");
    }

    /// Half of four chunks free: two can be emptied into the other two's holes, not more.
    #[test]
    fn no_more_windows_are_emptied_than_there_is_room_to_move_into() {
        let (mut a, _) = fragmented();
        assert_eq!(start(&mut a, 10).len(), 2);
        assert!(a.compactable(), "under way");
    }

    #[test]
    fn a_window_that_does_not_empty_is_given_back_in_time() {
        let (mut a, _) = fragmented();
        let free = a.allocatable_bytes();
        assert_eq!(start(&mut a, 2).len(), 2);
        assert!(a.allocatable_bytes() < free, "held back");
        assert!(a.compacting());
        assert_eq!(a.finish_compaction(Duration::ZERO), 0);
        assert_eq!(a.allocatable_bytes(), free, "free again, nothing lost");
        assert!(!a.compacting());
        assert!(
            a.compactable(),
            "tried again once its time is up (here at once)"
        );
    }

    /// A span that finds no hole gives its window up at once, and the node's windows rest
    /// for the cooldown: a writer is told ENOSPC, not to wait.
    #[test]
    fn a_window_given_up_rests_its_node() {
        let (mut a, _) = fragmented();
        let free = a.allocatable_bytes();
        let (node, addr) = start(&mut a, 1)[0];
        a.give_up_window(node, addr, Duration::from_secs(60));
        assert_eq!(a.allocatable_bytes(), free, "nothing lost");
        assert!(!a.compactable() && !a.compacting());
        assert_eq!(start(&mut a, 1), vec![]);
    }
}
