//! Byte-range file locks (fcntl's; flock's are whole-file ones, as NFS has them), held at the
//! metadata node for every client, so that two mounts never both hold conflicting locks of one
//! file. [`LockSet`] is the set of locks of one file, by owner, with POSIX's rules: an owner's
//! new lock replaces what it held over that range (splitting what it overlaps), and its
//! adjacent locks of one kind merge. The node keeps one per file over every session's owners;
//! a client keeps one of its own owners' locks, to take them again from a node that restarted
//! and to know which closes must drop locks there.

use crate::wire::{bad, DecodeError, Reader, Wire, Writer};
use crate::wire_struct;

/// What a lock holds. A kind the wire does not know is a malformed request (EPROTO), not a
/// bad argument: clients map fcntl's kinds themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum LockKind {
    /// No lock: what an unlock sets.
    Unlock = 0,
    /// A shared (read) lock.
    Read = 1,
    /// An exclusive (write) lock.
    Write = 2,
}

impl Wire for LockKind {
    fn put(&self, w: &mut Writer) {
        (*self as u8).put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(LockKind::Unlock),
            1 => Ok(LockKind::Read),
            2 => Ok(LockKind::Write),
            k => bad(format!("unknown lock kind {k}")),
        }
    }
}

/// The last byte of a lock that reaches the end of the file, however far it grows.
pub const TO_END: u64 = i64::MAX as u64;

wire_struct! {
    /// Bytes `start..=end` of a file, locked `kind` ([`LockKind::Unlock`] in a
    /// request that removes locks), by process `pid` of the client that holds it (what
    /// fcntl's F_GETLK reports).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct FileLock { pub start: u64, pub end: u64, pub kind: LockKind, pub pid: u32 }
}

impl FileLock {
    /// Whether the request is well formed: a range that does not end before it starts, nor
    /// past [`TO_END`] (the kernel refuses to report such a lock).
    pub fn is_valid(&self) -> bool {
        self.start <= self.end && self.end <= TO_END
    }

    /// Whether this lock and `other`, of different owners, cannot be held together.
    pub fn conflicts_with(&self, other: &FileLock) -> bool {
        self.kind != LockKind::Unlock
            && other.kind != LockKind::Unlock
            && self.conflicts(other.start, other.end, other.kind)
    }

    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    /// Whether this lock and one of another owner's, of `kind` over `start..=end`, cannot be
    /// held together: they overlap and one of them is exclusive.
    fn conflicts(&self, start: u64, end: u64, kind: LockKind) -> bool {
        self.overlaps(start, end) && (self.kind == LockKind::Write || kind == LockKind::Write)
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
        if wanted.kind == LockKind::Unlock {
            return None;
        }
        self.held
            .iter()
            .find(|(o, l)| *o != owner && l.conflicts(wanted.start, wanted.end, wanted.kind))
    }

    /// Sets `lock` for `owner` (removes its locks over the range, for [`LockKind::Unlock`]), whatever
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
        if lock.kind == LockKind::Unlock {
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

    fn lock(start: u64, end: u64, kind: LockKind) -> FileLock {
        FileLock {
            start,
            end,
            kind,
            pid: 7,
        }
    }

    /// The owner's ranges, sorted, as (start, end, kind).
    fn ranges(set: &LockSet<u32>, owner: u32) -> Vec<(u64, u64, LockKind)> {
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
        s.set(1, lock(0, 99, LockKind::Read));
        assert_eq!(s.conflict(2, &lock(50, 60, LockKind::Read)), None);
        assert_eq!(
            s.conflict(2, &lock(50, 60, LockKind::Write)),
            Some(&(1, lock(0, 99, LockKind::Read)))
        );
        assert_eq!(
            s.conflict(2, &lock(100, 200, LockKind::Write)),
            None,
            "no overlap"
        );
        assert_eq!(
            s.conflict(1, &lock(0, 99, LockKind::Write)),
            None,
            "its own lock"
        );
        assert_eq!(s.conflict(2, &lock(0, 99, LockKind::Unlock)), None);
        s.set(1, lock(0, 99, LockKind::Write));
        assert_eq!(
            s.conflict(2, &lock(99, 99, LockKind::Read)),
            Some(&(1, lock(0, 99, LockKind::Write)))
        );
    }

    #[test]
    fn a_lock_over_part_of_another_of_its_owner_splits_it() {
        let mut s = LockSet::default();
        s.set(1, lock(0, 99, LockKind::Read));
        s.set(1, lock(40, 59, LockKind::Write));
        assert_eq!(
            ranges(&s, 1),
            vec![
                (0, 39, LockKind::Read),
                (40, 59, LockKind::Write),
                (60, 99, LockKind::Read)
            ]
        );
        s.set(1, lock(50, 69, LockKind::Unlock));
        assert_eq!(
            ranges(&s, 1),
            vec![
                (0, 39, LockKind::Read),
                (40, 49, LockKind::Write),
                (70, 99, LockKind::Read)
            ]
        );
        assert_eq!(
            s.conflict(2, &lock(50, 69, LockKind::Write)),
            None,
            "unlocked"
        );
    }

    #[test]
    fn adjacent_locks_of_one_kind_merge_and_others_owners_stay() {
        let mut s = LockSet::default();
        s.set(1, lock(0, 9, LockKind::Read));
        s.set(2, lock(5, 30, LockKind::Read));
        s.set(1, lock(10, 19, LockKind::Read));
        s.set(1, lock(30, TO_END, LockKind::Read));
        assert_eq!(
            ranges(&s, 1),
            vec![(0, 19, LockKind::Read), (30, TO_END, LockKind::Read)]
        );
        s.set(1, lock(20, 29, LockKind::Read));
        assert_eq!(ranges(&s, 1), vec![(0, TO_END, LockKind::Read)]);
        assert_eq!(ranges(&s, 2), vec![(5, 30, LockKind::Read)]);
        s.set(1, lock(0, TO_END, LockKind::Unlock));
        assert!(!s.holds(1));
        assert!(s.holds(2));
    }

    #[test]
    fn gone_owners_lose_every_lock() {
        let mut s = LockSet::default();
        s.set((1, 10), lock(0, 9, LockKind::Write));
        s.set((1, 11), lock(10, 19, LockKind::Write));
        s.set((2, 10), lock(20, 29, LockKind::Write));
        assert!(s.drop_owners(|(session, _)| session == 1));
        assert!(!s.drop_owners(|(session, _)| session == 1));
        assert_eq!(s.iter().count(), 1);
        assert_eq!(s.conflict((3, 1), &lock(0, 19, LockKind::Write)), None);
    }

    #[test]
    fn malformed_requests_are_told_apart() {
        assert!(lock(0, 0, LockKind::Write).is_valid());
        assert!(!lock(5, 4, LockKind::Read).is_valid());
        assert!(!lock(0, TO_END + 1, LockKind::Read).is_valid());
    }

    #[test]
    fn a_kind_the_wire_does_not_know_does_not_decode() {
        let mut w = Writer(Vec::new());
        lock(0, 9, LockKind::Write).put(&mut w);
        let mut r = Reader::new(&w.0);
        assert_eq!(FileLock::get(&mut r).unwrap(), lock(0, 9, LockKind::Write));
        let kind_at = 16;
        assert_eq!(w.0[kind_at], LockKind::Write as u8);
        w.0[kind_at] = 3;
        let e = FileLock::get(&mut Reader::new(&w.0)).unwrap_err();
        assert!(e.0.contains("unknown lock kind 3"), "{e:?}");
    }
}
