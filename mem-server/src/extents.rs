//! A data node's allocatable space as extents: the never-used tail of its pool (a bump
//! pointer, whose progress the allocator journals), and the space given back and zeroed since,
//! kept as free extents that merge with their neighbours as they come back. An allocation may
//! ask for an alignment within the pool (a chunk for a chunk's worth: the pool itself is only
//! page-aligned), and how many whole aligned units (chunks) are free is kept as a count.

use std::collections::{BTreeMap, BTreeSet};

/// Free space of one pool: `[next_fresh, end)` never used, plus recycled extents.
pub(crate) struct FreeExtents {
    /// The pool's first byte: alignments count from it.
    base: u64,
    /// The unit whose whole, aligned free copies are counted.
    unit: u64,
    /// Whole units in the recycled extents.
    recycled_units: u64,
    /// Recycled extents by address: their lengths.
    by_addr: BTreeMap<u64, u64>,
    /// The same extents by (length, address): best fit.
    by_len: BTreeSet<(u64, u64)>,
    recycled: u64,
    next_fresh: u64,
    end: u64,
}

impl FreeExtents {
    /// `[from, end)` of a pool starting at `base`, none of it used yet, counting `unit`s.
    pub(crate) fn fresh(base: u64, from: u64, end: u64, unit: u64) -> FreeExtents {
        FreeExtents {
            base,
            unit,
            recycled_units: 0,
            by_addr: BTreeMap::new(),
            by_len: BTreeSet::new(),
            recycled: 0,
            next_fresh: from,
            end: end.max(from),
        }
    }

    /// Free bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.recycled + (self.end - self.next_fresh)
    }

    /// Where the never-used space starts.
    pub(crate) fn next_fresh(&self) -> u64 {
        self.next_fresh
    }

    /// How many whole units (aligned to themselves) could be taken now, one after another.
    pub(crate) fn units(&self) -> u64 {
        self.recycled_units + self.units_in(self.next_fresh, self.end - self.next_fresh)
    }

    fn units_in(&self, addr: u64, len: u64) -> u64 {
        fitting(addr - self.base, len, self.unit, self.unit)
    }

    /// Takes `len` bytes aligned to `align` in the pool: the smallest
    /// recycled extent they fit in, else the never-used tail.
    pub(crate) fn take(&mut self, len: u64, align: u64) -> Option<u64> {
        debug_assert!(len > 0 && align > 0);
        let base = self.base;
        let found = self
            .by_len
            .range((len, 0)..)
            .find(|&&(l, a)| fitting(a - base, l, len, align) > 0)
            .copied();
        if let Some((l, a)) = found {
            let at = self.aligned(a, align);
            self.remove(a, l);
            if at > a {
                self.insert(a, at - a);
            }
            if at + len < a + l {
                self.insert(at + len, a + l - at - len);
            }
            return Some(at);
        }
        let at = self.aligned(self.next_fresh, align);
        if at.checked_add(len)? > self.end {
            return None;
        }
        if at > self.next_fresh {
            // The skipped space is still zero: recycled, not lost.
            let skipped = (self.next_fresh, at - self.next_fresh);
            self.next_fresh = at + len;
            self.give(skipped.0, skipped.1);
        } else {
            self.next_fresh = at + len;
        }
        Some(at)
    }

    /// Whether [`FreeExtents::take`] would find `len` bytes aligned to `align`.
    pub(crate) fn can_take(&self, len: u64, align: u64) -> bool {
        let base = self.base;
        self.by_len
            .range((len, 0)..)
            .any(|&(l, a)| fitting(a - base, l, len, align) > 0)
            || self
                .aligned(self.next_fresh, align)
                .checked_add(len)
                .is_some_and(|end| end <= self.end)
    }

    /// Whether all of `[addr, addr + len)` is free (an empty range is).
    pub(crate) fn is_free(&self, addr: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        if addr >= self.next_fresh {
            return addr + len <= self.end;
        }
        self.by_addr
            .range(..=addr)
            .next_back()
            .is_some_and(|(&a, &l)| a + l >= addr + len)
    }

    /// Takes `[addr, addr + len)`, which [`FreeExtents::is_free`] says is free.
    pub(crate) fn take_at(&mut self, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        if addr >= self.next_fresh {
            let skipped = (self.next_fresh, addr - self.next_fresh);
            self.next_fresh = addr + len;
            self.give(skipped.0, skipped.1);
            return;
        }
        let (&a, &l) = self
            .by_addr
            .range(..=addr)
            .next_back()
            .expect("taken only where free");
        self.remove(a, l);
        if addr > a {
            self.insert(a, addr - a);
        }
        if addr + len < a + l {
            self.insert(addr + len, a + l - addr - len);
        }
    }

    /// Free bytes in each `unit`-aligned window below the never-used tail that has any: (the
    /// window's address, its free bytes). Used space lies in these windows and in those not
    /// listed.
    pub(crate) fn free_per_window(&self) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        for (&a, &l) in &self.by_addr {
            let mut at = a;
            while at < a + l {
                let window = self.base + (at - self.base) / self.unit * self.unit;
                let upto = (window + self.unit).min(a + l);
                *out.entry(window).or_default() += upto - at;
                at = upto;
            }
        }
        out
    }

    /// Takes every free piece of `[lo, hi)` (below the never-used tail): the pieces.
    pub(crate) fn take_within(&mut self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        let hi = hi.min(self.next_fresh);
        let mut pieces = Vec::new();
        let first = self.by_addr.range(..lo).next_back().map(|(&a, _)| a);
        let starts: Vec<(u64, u64)> = first
            .into_iter()
            .chain(self.by_addr.range(lo..hi).map(|(&a, _)| a))
            .map(|a| (a, self.by_addr[&a]))
            .collect();
        for (a, l) in starts {
            let (from, to) = (a.max(lo), (a + l).min(hi));
            if from < to {
                self.take_at(from, to - from);
                pieces.push((from, to - from));
            }
        }
        pieces
    }

    /// Gives back `[addr, addr + len)` (zeroed): it merges with free neighbours.
    pub(crate) fn give(&mut self, mut addr: u64, mut len: u64) {
        if len == 0 {
            return;
        }
        if let Some((&a, &l)) = self.by_addr.range(..addr).next_back() {
            if a + l == addr {
                self.remove(a, l);
                addr = a;
                len += l;
            }
        }
        if let Some(&l) = self.by_addr.get(&(addr + len)) {
            self.remove(addr + len, l);
            len += l;
        }
        if addr + len == self.next_fresh {
            // Zeroed, as the never-used tail is: one with it.
            self.next_fresh = addr;
            return;
        }
        self.insert(addr, len);
    }

    /// The first address from `addr` on aligned to `align` within the pool.
    fn aligned(&self, addr: u64, align: u64) -> u64 {
        self.base + (addr - self.base).next_multiple_of(align)
    }

    fn insert(&mut self, addr: u64, len: u64) {
        self.by_addr.insert(addr, len);
        self.by_len.insert((len, addr));
        self.recycled += len;
        self.recycled_units += self.units_in(addr, len);
    }

    fn remove(&mut self, addr: u64, len: u64) {
        self.by_addr.remove(&addr);
        self.by_len.remove(&(len, addr));
        self.recycled -= len;
        self.recycled_units -= self.units_in(addr, len);
    }
}

/// How many extents of `len` aligned to `align` fit in `[offset, offset + space)` of a pool.
fn fitting(offset: u64, space: u64, len: u64, align: u64) -> u64 {
    let at = offset.next_multiple_of(align);
    let left = (offset + space).saturating_sub(at);
    if left < len {
        return 0;
    }
    // After the first, each next one starts at the next aligned address.
    1 + (left - len) / len.next_multiple_of(align)
}

#[cfg(test)]
mod tests {
    use rfs_e2e::rng::Rng;

    use super::*;

    const CHUNK: u64 = 1 << 20;
    const GRANULE: u64 = 4096;

    #[test]
    fn neighbours_merge_as_they_come_back() {
        let mut f = FreeExtents::fresh(0, 0, 8 * GRANULE, GRANULE);
        let a: Vec<u64> = (0..8).map(|_| f.take(GRANULE, GRANULE).unwrap()).collect();
        assert_eq!(a, (0..8).map(|i| i * GRANULE).collect::<Vec<_>>());
        assert_eq!((f.take(GRANULE, GRANULE), f.bytes()), (None, 0));
        for &i in &[1, 3, 2] {
            f.give(a[i], GRANULE);
        }
        assert_eq!(f.by_addr.len(), 1, "1, 2 and 3 are one extent");
        assert_eq!(f.take(3 * GRANULE, GRANULE), Some(GRANULE));
        f.give(a[0], GRANULE);
        f.give(a[7], GRANULE);
        assert_eq!(f.bytes(), 2 * GRANULE);
        assert_eq!(
            f.take(2 * GRANULE, GRANULE),
            None,
            "two apart do not make one"
        );
    }

    #[test]
    fn aligned_takes_leave_what_they_skip_free() {
        let mut f = FreeExtents::fresh(0, 0, 4 * CHUNK, CHUNK);
        assert_eq!(f.take(GRANULE, GRANULE), Some(0));
        assert_eq!(f.take(CHUNK, CHUNK), Some(CHUNK));
        assert_eq!(f.bytes(), 3 * CHUNK - GRANULE);
        assert_eq!(f.units(), 2);
        assert_eq!(
            f.take(CHUNK - GRANULE, GRANULE),
            Some(GRANULE),
            "the skipped space"
        );
        f.give(0, GRANULE);
        f.give(GRANULE, CHUNK - GRANULE);
        assert_eq!(f.take(CHUNK, CHUNK), Some(0));
    }

    /// A pool is only page-aligned: chunks are aligned from its start, not from address 0.
    #[test]
    fn alignment_counts_from_the_pool() {
        let base = 3 * GRANULE;
        let mut f = FreeExtents::fresh(base, base, base + 3 * CHUNK, CHUNK);
        assert_eq!(f.units(), 3);
        assert_eq!(f.take(GRANULE, GRANULE), Some(base));
        assert_eq!(f.take(CHUNK, CHUNK), Some(base + CHUNK));
        f.give(base, GRANULE);
        assert_eq!(f.units(), 2, "the first chunk is whole again");
        assert_eq!(f.take(CHUNK, CHUNK), Some(base));
    }

    /// A pool filled with small extents of random sizes, all given back in random order,
    /// is whole again: every chunk of it can be taken.
    #[test]
    fn a_pool_of_small_extents_given_back_is_whole_again() {
        let pool = 64 * CHUNK;
        let mut f = FreeExtents::fresh(0, 0, pool, CHUNK);
        let mut rng = Rng(7);
        let mut taken = Vec::new();
        while let Some(a) = {
            let len = (1 + rng.below(16)) * GRANULE;
            f.take(len, GRANULE).map(|a| (a, len))
        } {
            taken.push(a);
        }
        assert!(f.bytes() < 16 * GRANULE, "full: {} bytes left", f.bytes());
        while !taken.is_empty() {
            let (a, len) = taken.swap_remove(rng.below(taken.len() as u64) as usize);
            f.give(a, len);
        }
        assert_eq!(f.units(), 64);
        for _ in 0..64 {
            assert!(f.take(CHUNK, CHUNK).is_some());
        }
    }

    /// Half of a pool of small extents given back at random leaves it in pieces: what a
    /// large allocation can still use is measured, and every piece of a whole free chunk
    /// counts.
    #[test]
    fn what_half_freed_small_extents_leave_for_chunks() {
        let pool = 64 * CHUNK;
        let mut f = FreeExtents::fresh(0, 0, pool, CHUNK / 2);
        let mut rng = Rng(11);
        let mut taken = Vec::new();
        while let Some(a) = f.take(GRANULE, GRANULE) {
            taken.push(a);
        }
        for (i, a) in taken.iter().enumerate() {
            // Every other file of each chunk's first half goes, and every second half.
            let in_chunk = a % CHUNK;
            if in_chunk >= CHUNK / 2 || (i % 2 == 0 && rng.below(2) == 0) {
                f.give(*a, GRANULE);
            }
        }
        assert!(f.bytes() > pool / 2);
        assert_eq!(f.units(), 64, "each chunk's free second half, whole");
        assert_eq!(f.take(CHUNK, CHUNK), None, "no chunk is whole");
    }

    #[test]
    fn windows_count_their_free_bytes_and_give_up_their_pieces() {
        let mut f = FreeExtents::fresh(0, 0, 4 * CHUNK, CHUNK);
        let all: Vec<u64> = (0..4 * CHUNK / GRANULE)
            .map(|_| f.take(GRANULE, GRANULE).unwrap())
            .collect();
        // Every other page of the first two windows, and the last page of the first, which
        // makes one extent across their border.
        for &a in all.iter().take(2 * (CHUNK / GRANULE) as usize).step_by(2) {
            f.give(a, GRANULE);
        }
        f.give(CHUNK - GRANULE, GRANULE);
        let per = f.free_per_window();
        assert_eq!(per.len(), 2);
        assert_eq!(per[&0], CHUNK / 2 + GRANULE);
        assert_eq!(per[&CHUNK], CHUNK / 2);
        assert_eq!(f.units(), 0, "fragmented: no whole chunk");
        let before = f.bytes();
        let pieces = f.take_within(CHUNK, 2 * CHUNK);
        assert_eq!(pieces.iter().map(|p| p.1).sum::<u64>(), CHUNK / 2);
        assert!(pieces
            .iter()
            .all(|&(a, l)| a >= CHUNK && a + l <= 2 * CHUNK));
        assert_eq!(f.bytes(), before - CHUNK / 2);
        assert_eq!(
            f.free_per_window().get(&CHUNK),
            None,
            "nothing free left there"
        );
        assert_eq!(
            f.free_per_window()[&0],
            CHUNK / 2 + GRANULE,
            "the other untouched"
        );
    }
}
