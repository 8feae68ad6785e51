//! Byte-range file locks (fcntl's; flock's are whole-file ones, as NFS has them), held at the
//! metadata node for every client, so that two mounts never both hold conflicting locks of one
//! file. [`LockSet`] is the set of locks of one file, by owner, with POSIX's rules: an owner's
//! new lock replaces what it held over that range (splitting what it overlaps), and its
//! adjacent locks of one kind merge. The node keeps one per file over every session's owners;
//! a client keeps one of its own owners' locks, to take them again from a node that restarted
//! and to know which closes must drop locks there.

use crate::wire_struct;

/// No lock: what an unlock sets.
pub const UNLOCK: u8 = 0;
/// A shared (read) lock.
pub const READ: u8 = 1;
/// An exclusive (write) lock.
pub const WRITE: u8 = 2;

/// The last byte of a lock that reaches the end of the file, however far it grows.
pub const TO_END: u64 = i64::MAX as u64;

wire_struct! {
    /// Bytes `start..=end` of a file, locked `kind` ([`READ`], [`WRITE`]; [`UNLOCK`] in a
    /// request that removes locks), by process `pid` of the client that holds it (what
    /// fcntl's F_GETLK reports).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct FileLock { pub start: u64, pub end: u64, pub kind: u8, pub pid: u32 }
}

impl FileLock {
    /// Whether the request is well formed: a known kind and a range that does not end
    /// before it starts, nor past [`TO_END`] (the kernel refuses to report such a lock).
    pub fn is_valid(&self) -> bool {
        self.kind <= WRITE && self.start <= self.end && self.end <= TO_END
    }

    /// Whether this lock and `other`, of different owners, cannot be held together.
    pub fn conflicts_with(&self, other: &FileLock) -> bool {
        self.kind != UNLOCK
            && other.kind != UNLOCK
            && self.conflicts(other.start, other.end, other.kind)
    }

    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    /// Whether this lock and one of another owner's, of `kind` over `start..=end`, cannot be
    /// held together: they overlap and one of them is exclusive.
    fn conflicts(&self, start: u64, end: u64, kind: u8) -> bool {
        self.overlaps(start, end) && (self.kind == WRITE || kind == WRITE)
    }
}

/// The locks of one file, each with its owner.
#[derive(Clone, Debug, PartialEq)]
pub struct LockSet<O> {
    held: Vec<(O, FileLock)>,
}

impl<O> Default for LockSet<O> {
    fn default() -> Self {
        LockSet { held: Vec::new() }
    }
}

impl<O: Copy + Eq> LockSet<O> {
    /// A lock of another owner than `owner` that keeps it from taking `wanted`, with its
    /// owner.
    pub fn conflict(&self, owner: O, wanted: &FileLock) -> Option<&(O, FileLock)> {
        if wanted.kind == UNLOCK {
            return None;
        }
        self.held
            .iter()
            .find(|(o, l)| *o != owner && l.conflicts(wanted.start, wanted.end, wanted.kind))
    }

    /// Sets `lock` for `owner` (removes its locks over the range, for [`UNLOCK`]), whatever
    /// other owners hold: check [`Self::conflict`] first.
    pub fn set(&mut self, owner: O, lock: FileLock) {
        let (start, end) = (lock.start, lock.end);
        let mut kept = Vec::with_capacity(self.held.len() + 2);
        for (o, l) in self.held.drain(..) {
            if o != owner || !l.overlaps(start, end) {
                kept.push((o, l));
                continue;
            }
            // What the new range leaves of an old lock of the owner: a head and a tail.
            if l.start < start {
                kept.push((
                    o,
                    FileLock {
                        end: start - 1,
                        ..l
                    },
                ));
            }
            if l.end > end {
                kept.push((
                    o,
                    FileLock {
                        start: end + 1,
                        ..l
                    },
                ));
            }
        }
        self.held = kept;
        if lock.kind == UNLOCK {
            return;
        }
        let mut new = lock;
        // Adjacent or overlapping locks of the owner of the same kind become one.
        self.held.retain(|(o, l)| {
            let touches =
                l.start <= new.end.saturating_add(1) && new.start <= l.end.saturating_add(1);
            if *o == owner && l.kind == new.kind && touches {
                new.start = new.start.min(l.start);
                new.end = new.end.max(l.end);
                return false;
            }
            true
        });
        self.held.push((owner, new));
    }

    /// Removes every lock of the owners `gone` says are gone; whether any went.
    pub fn drop_owners(&mut self, mut gone: impl FnMut(O) -> bool) -> bool {
        let before = self.held.len();
        self.held.retain(|(o, _)| !gone(*o));
        self.held.len() != before
    }

    /// Whether `owner` holds any lock here.
    pub fn holds(&self, owner: O) -> bool {
        self.held.iter().any(|(o, _)| *o == owner)
    }

    /// Every lock, with its owner.
    pub fn iter(&self) -> impl Iterator<Item = &(O, FileLock)> {
        self.held.iter()
    }

    /// How many ranges are held, over every owner.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock(start: u64, end: u64, kind: u8) -> FileLock {
        FileLock {
            start,
            end,
            kind,
            pid: 7,
        }
    }

    /// The owner's ranges, sorted, as (start, end, kind).
    fn ranges(set: &LockSet<u32>, owner: u32) -> Vec<(u64, u64, u8)> {
        let mut v: Vec<_> = set
            .iter()
            .filter(|(o, _)| *o == owner)
            .map(|(_, l)| (l.start, l.end, l.kind))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn shared_locks_go_together_and_an_exclusive_one_goes_alone() {
        let mut s = LockSet::default();
        s.set(1, lock(0, 99, READ));
        assert_eq!(s.conflict(2, &lock(50, 60, READ)), None);
        assert_eq!(
            s.conflict(2, &lock(50, 60, WRITE)),
            Some(&(1, lock(0, 99, READ)))
        );
        assert_eq!(s.conflict(2, &lock(100, 200, WRITE)), None, "no overlap");
        assert_eq!(s.conflict(1, &lock(0, 99, WRITE)), None, "its own lock");
        assert_eq!(s.conflict(2, &lock(0, 99, UNLOCK)), None);
        s.set(1, lock(0, 99, WRITE));
        assert_eq!(
            s.conflict(2, &lock(99, 99, READ)),
            Some(&(1, lock(0, 99, WRITE)))
        );
    }

    #[test]
    fn a_lock_over_part_of_another_of_its_owner_splits_it() {
        let mut s = LockSet::default();
        s.set(1, lock(0, 99, READ));
        s.set(1, lock(40, 59, WRITE));
        assert_eq!(
            ranges(&s, 1),
            vec![(0, 39, READ), (40, 59, WRITE), (60, 99, READ)]
        );
        s.set(1, lock(50, 69, UNLOCK));
        assert_eq!(
            ranges(&s, 1),
            vec![(0, 39, READ), (40, 49, WRITE), (70, 99, READ)]
        );
        assert_eq!(s.conflict(2, &lock(50, 69, WRITE)), None, "unlocked");
    }

    #[test]
    fn adjacent_locks_of_one_kind_merge_and_others_owners_stay() {
        let mut s = LockSet::default();
        s.set(1, lock(0, 9, READ));
        s.set(2, lock(5, 30, READ));
        s.set(1, lock(10, 19, READ));
        s.set(1, lock(30, TO_END, READ));
        assert_eq!(ranges(&s, 1), vec![(0, 19, READ), (30, TO_END, READ)]);
        s.set(1, lock(20, 29, READ));
        assert_eq!(ranges(&s, 1), vec![(0, TO_END, READ)]);
        assert_eq!(ranges(&s, 2), vec![(5, 30, READ)]);
        s.set(1, lock(0, TO_END, UNLOCK));
        assert!(!s.holds(1));
        assert!(s.holds(2));
    }

    #[test]
    fn gone_owners_lose_every_lock() {
        let mut s = LockSet::default();
        s.set((1, 10), lock(0, 9, WRITE));
        s.set((1, 11), lock(10, 19, WRITE));
        s.set((2, 10), lock(20, 29, WRITE));
        assert!(s.drop_owners(|(session, _)| session == 1));
        assert!(!s.drop_owners(|(session, _)| session == 1));
        assert_eq!(s.iter().count(), 1);
        assert_eq!(s.conflict((3, 1), &lock(0, 19, WRITE)), None);
    }

    #[test]
    fn malformed_requests_are_told_apart() {
        assert!(lock(0, 0, WRITE).is_valid());
        assert!(!lock(5, 4, READ).is_valid());
        assert!(!lock(0, 1, 3).is_valid());
        assert!(!lock(0, TO_END + 1, READ).is_valid());
    }
}
