//! The file locks of every client, by file: an owner is a session and the lock owner its
//! client named (fcntl's, or a flock's open file). Locks are not journaled, as NFS's are not:
//! after a restart, clients take theirs again within the grace period, during which nobody
//! else may take one (see `SetLock`). A session that ends loses its locks, as a process that
//! dies does.
//!
//! Callers that wait (F_SETLKW) queue, and take locks in the order they asked: a lock that an
//! earlier waiter could take now is refused to later callers even while free, so that a process
//! that locks and unlocks in a loop cannot starve another mount's waiter. A waiter that could
//! not take its lock now (a holder's lock is in the way) reserves nothing: the holder may
//! change, grow or share what it holds as POSIX lets it, and nothing waits in a cycle that
//! POSIX would not. A waiter keeps its place by asking again (its client asks at least every
//! 100 ms, and at once when told that a lock of the file went); one whose wait ended says so
//! (`CancelWait`), and one that stops asking loses its place after [`WAIT_KEPT`].
//!
//! A session holds a bounded number of ranges on each file and over all (each lock call scans
//! the file's), so a client that splits ranges without end runs out of locks (ENOLCK), not the
//! node, and not the other clients: an unlock is never refused.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rfs_proto::locks::{FileLock, LockKind, LockSet};
use rfs_proto::types::Ino;
use rfs_proto::Errno;

use crate::meta::coherence::SessionId;

/// Who holds a lock: a session, and the owner its client named.
type Owner = (SessionId, u64);

/// Ranges one session holds on one file, at most.
const MAX_PER_FILE: usize = 4096;
/// Ranges one session holds, over every file, at most.
const MAX_PER_SESSION: usize = 16384;
/// Callers queued for one file's locks, at most (later ones wait without a place).
const MAX_WAITERS: usize = 1024;
/// How long a waiter keeps its place without asking again (its calls may queue behind others
/// of its session).
const WAIT_KEPT: Duration = Duration::from_secs(2);

/// Sessions to tell that a lock of a file went: they wait to take one.
pub(crate) type Woken = Vec<(SessionId, Ino)>;

/// A conflicting lock as `session` is told of it: the process id only if it is its own
/// (another machine's means nothing to the caller's kernel).
fn seen_by(session: SessionId, conflict: Option<(Owner, FileLock)>) -> Option<FileLock> {
    conflict.map(|((s, _), lock)| FileLock {
        pid: if s == session { lock.pid } else { 0 },
        ..lock
    })
}

#[derive(Default)]
struct FileLocks {
    held: LockSet<Owner>,
    /// Callers waiting to take a lock, in the order they first asked, with when they last did.
    waiting: Vec<(Owner, FileLock, Instant)>,
}

impl FileLocks {
    fn held_by(&self, session: SessionId) -> usize {
        self.held.iter().filter(|((s, _), _)| *s == session).count()
    }

    fn is_empty(&self) -> bool {
        self.held.is_empty() && self.waiting.is_empty()
    }

    /// Where `owner` waits for `lock` in the queue, if it does.
    fn place(&self, owner: Owner, lock: &FileLock) -> Option<usize> {
        let wish = |l: &FileLock| (l.start, l.end, l.kind);
        self.waiting
            .iter()
            .position(|(o, l, _)| *o == owner && wish(l) == wish(lock))
    }

    /// What keeps `owner` from taking `lock`: another owner's lock, or the wish of another
    /// owner waiting ahead of it (ahead of all, if it waits nowhere) that conflicts with it and
    /// could be granted now.
    fn obstacle(&self, owner: Owner, lock: &FileLock) -> Option<(Owner, FileLock)> {
        if let Some(&held) = self.held.conflict(owner, lock) {
            return Some(held);
        }
        let ahead = self.place(owner, lock).unwrap_or(self.waiting.len());
        // The wishes ahead that could be granted now, in order: each is free of the locks
        // held and of the granted-now wishes before it.
        let mut first: Vec<(Owner, FileLock)> = Vec::new();
        for &(o, wish, _) in &self.waiting[..ahead] {
            let free = self.held.conflict(o, &wish).is_none()
                && !first
                    .iter()
                    .any(|(fo, f)| *fo != o && f.conflicts_with(&wish));
            if !free {
                continue;
            }
            if o != owner && wish.conflicts_with(lock) {
                return Some((o, wish));
            }
            first.push((o, wish));
        }
        None
    }

    /// Whether `owner`'s `lock` lets go of anything it holds (an unlock of a range it holds
    /// some of, a shared lock over an exclusive one): waiters may take it now.
    fn frees(&self, owner: Owner, lock: &FileLock) -> bool {
        let over = FileLock {
            kind: LockKind::Write,
            ..*lock
        };
        self.held.iter().any(|(o, l)| {
            *o == owner
                && l.conflicts_with(&over)
                && (lock.kind == LockKind::Unlock
                    || (lock.kind == LockKind::Read && l.kind == LockKind::Write))
        })
    }

    /// The sessions that wait here, each once, to tell that a lock of `ino` went.
    fn woken(&self, ino: Ino) -> Woken {
        let mut out = Woken::new();
        for &((s, _), _, _) in &self.waiting {
            if !out.contains(&(s, ino)) {
                out.push((s, ino));
            }
        }
        out
    }
}

#[derive(Default)]
pub(crate) struct LockTable {
    files: HashMap<Ino, FileLocks>,
    /// Ranges held, by session.
    per_session: HashMap<SessionId, usize>,
}

impl LockTable {
    /// Takes `lock` for `owner` of `session` on `ino` unless another owner's lock, or the
    /// wish of a waiter ahead, conflicts (that lock is answered, and nothing changes but the
    /// caller's place in the queue if it `wait`s). ENOLCK past the bounds on ranges held.
    /// Also answers the sessions to tell that a lock went.
    pub(crate) fn set(
        &mut self,
        ino: Ino,
        session: SessionId,
        owner: u64,
        lock: FileLock,
        wait: bool,
        now: Instant,
    ) -> (Result<Option<FileLock>, Errno>, Woken) {
        let file = self.files.entry(ino).or_default();
        file.waiting
            .retain(|&(_, _, asked)| now.duration_since(asked) < WAIT_KEPT);
        let me = (session, owner);
        let obstacle = file.obstacle(me, &lock);
        let here = file.held_by(session);
        let total = self.per_session.get(&session).copied().unwrap_or(0);
        // A lock adds at most two ranges (it splits one of another kind of its owner's).
        let bounded = lock.kind == LockKind::Unlock
            || (here + 2 <= MAX_PER_FILE && total + 2 <= MAX_PER_SESSION);
        let place = file.place(me, &lock);
        let mut woken = Woken::new();
        match (obstacle, bounded) {
            (None, true) => {
                let frees = file.frees(me, &lock);
                file.held.set(me, lock);
                let now_here = file.held_by(session);
                *self.per_session.entry(session).or_default() = total + now_here - here;
                // Its waits that this lock answers end (one for a smaller range too).
                file.waiting.retain(|&(o, wish, _)| {
                    o != me
                        || lock.kind == LockKind::Unlock
                        || wish.start < lock.start
                        || wish.end > lock.end
                        || (wish.kind == LockKind::Write && lock.kind == LockKind::Read)
                });
                if frees {
                    woken = file.woken(ino);
                }
            }
            (Some(_), true) if wait && lock.kind != LockKind::Unlock => match place {
                Some(at) => file.waiting[at].2 = now,
                None if file.waiting.len() < MAX_WAITERS => file.waiting.push((me, lock, now)),
                None => {}
            },
            _ => {}
        }
        self.tidy(ino, session);
        let answer = match bounded {
            true => Ok(seen_by(session, obstacle)),
            false => Err(Errno::ENOLCK),
        };
        (answer, woken)
    }

    /// The lock that would keep `owner` of `session` from taking `lock`: another owner's, or
    /// the wish of a waiter that comes first (as [`Self::set`] would answer).
    pub(crate) fn conflict(
        &self,
        ino: Ino,
        session: SessionId,
        owner: u64,
        lock: &FileLock,
    ) -> Option<FileLock> {
        let file = self.files.get(&ino)?;
        seen_by(session, file.obstacle((session, owner), lock))
    }

    /// `owner` of `session` stopped waiting for locks of `ino` (interrupted, or gone): its
    /// places go, and whoever waited behind them is told.
    pub(crate) fn cancel_wait(&mut self, ino: Ino, session: SessionId, owner: u64) -> Woken {
        let Some(file) = self.files.get_mut(&ino) else {
            return Woken::new();
        };
        let before = file.waiting.len();
        file.waiting.retain(|&(o, _, _)| o != (session, owner));
        let woken = match file.waiting.len() != before {
            true => file.woken(ino),
            false => Woken::new(),
        };
        self.tidy(ino, session);
        woken
    }

    /// Drops the locks and places of `session` on `ino`: those of `owner`, or all of them.
    /// Answers the sessions to tell that a lock went.
    pub(crate) fn drop_on(&mut self, ino: Ino, session: SessionId, owner: Option<u64>) -> Woken {
        let Some(file) = self.files.get_mut(&ino) else {
            return Woken::new();
        };
        let gone = |(s, o): Owner| s == session && owner.is_none_or(|only| only == o);
        let before = file.held_by(session);
        let dropped = file.held.drop_owners(gone);
        file.waiting.retain(|&(o, _, _)| !gone(o));
        let after = file.held_by(session);
        if let Some(n) = self.per_session.get_mut(&session) {
            *n -= before - after;
        }
        let woken = match dropped {
            true => file.woken(ino),
            false => Woken::new(),
        };
        self.tidy(ino, session);
        woken
    }

    /// Drops every lock and place of `session` (it ended); answers the sessions to tell that
    /// a lock went.
    pub(crate) fn drop_session(&mut self, session: SessionId) -> Woken {
        let mut woken = Woken::new();
        self.files.retain(|&ino, file| {
            file.waiting.retain(|&((s, _), _, _)| s != session);
            if file.held.drop_owners(|(s, _)| s == session) {
                woken.extend(file.woken(ino));
            }
            !file.is_empty()
        });
        self.per_session.remove(&session);
        woken
    }

    /// Keeps no empty entries.
    fn tidy(&mut self, ino: Ino, session: SessionId) {
        if self.files.get(&ino).is_some_and(FileLocks::is_empty) {
            self.files.remove(&ino);
        }
        if self.per_session.get(&session) == Some(&0) {
            self.per_session.remove(&session);
        }
    }

    /// Locks held, over every file (for the metrics).
    pub(crate) fn count(&self) -> usize {
        self.per_session.values().sum()
    }

    /// Locks `session` holds, over every file.
    pub(crate) fn held_by(&self, session: SessionId) -> usize {
        self.per_session.get(&session).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::locks::TO_END;

    const WHOLE: FileLock = FileLock {
        start: 0,
        end: TO_END,
        kind: LockKind::Write,
        pid: 1,
    };

    fn unlock(l: FileLock) -> FileLock {
        FileLock {
            kind: LockKind::Unlock,
            ..l
        }
    }

    #[test]
    fn two_sessions_never_hold_conflicting_locks_and_a_session_that_ends_frees_them() {
        let mut t = LockTable::default();
        let now = Instant::now();
        let set = |t: &mut LockTable, ino, session, owner, lock| {
            t.set(ino, session, owner, lock, false, now).0
        };
        assert_eq!(set(&mut t, 5, 1, 10, WHOLE), Ok(None));
        let theirs = FileLock { pid: 0, ..WHOLE };
        assert_eq!(
            set(&mut t, 5, 2, 10, WHOLE),
            Ok(Some(theirs)),
            "same owner, other session"
        );
        assert_eq!(t.conflict(5, 2, 10, &WHOLE), Some(theirs));
        assert_eq!(
            t.conflict(5, 1, 11, &WHOLE),
            Some(WHOLE),
            "another owner of ours"
        );
        assert_eq!(set(&mut t, 6, 2, 10, WHOLE), Ok(None), "another file");
        assert_eq!(t.count(), 2);
        t.drop_session(1);
        assert_eq!(set(&mut t, 5, 2, 10, WHOLE), Ok(None));
        t.drop_on(5, 2, Some(11));
        assert_eq!(t.count(), 2, "another owner's drop takes nothing");
        t.drop_on(5, 2, Some(10));
        assert_eq!(set(&mut t, 6, 2, 10, unlock(WHOLE)), Ok(None));
        assert_eq!(t.count(), 0);
        assert!(
            t.files.is_empty() && t.per_session.is_empty(),
            "nothing empty kept"
        );
    }

    #[test]
    fn waiters_take_locks_in_the_order_they_asked_and_are_told_when_one_goes() {
        let mut t = LockTable::default();
        let now = Instant::now();
        assert_eq!(t.set(1, 1, 1, WHOLE, false, now), (Ok(None), vec![]));
        let theirs = Some(FileLock { pid: 0, ..WHOLE });
        // Session 2 waits; session 3 asks without waiting, then waits too.
        assert_eq!(t.set(1, 2, 1, WHOLE, true, now).0, Ok(theirs));
        assert_eq!(t.set(1, 3, 1, WHOLE, false, now).0, Ok(theirs));
        assert_eq!(t.set(1, 3, 1, WHOLE, true, now).0, Ok(theirs));
        // The holder lets go: both waiters are told; the lock is free, and kept for the first.
        let (r, woken) = t.set(1, 1, 1, unlock(WHOLE), false, now);
        assert_eq!(r, Ok(None));
        assert_eq!(woken, vec![(2, 1), (3, 1)]);
        assert_eq!(
            t.conflict(1, 3, 1, &WHOLE),
            theirs,
            "F_GETLK says what F_SETLK would"
        );
        assert_eq!(
            t.set(1, 3, 1, WHOLE, true, now).0,
            Ok(theirs),
            "2 asked first"
        );
        assert_eq!(
            t.set(1, 1, 1, WHOLE, false, now).0,
            Ok(theirs),
            "nor a newcomer"
        );
        let read = FileLock {
            kind: LockKind::Read,
            ..WHOLE
        };
        assert_eq!(
            t.set(1, 1, 1, read, false, now).0,
            Ok(theirs),
            "a shared one conflicts"
        );
        assert_eq!(t.set(1, 2, 1, WHOLE, true, now).0, Ok(None), "2 takes it");
        assert_eq!(t.set(1, 2, 1, unlock(WHOLE), false, now).1, vec![(3, 1)]);
        assert_eq!(t.set(1, 3, 1, WHOLE, true, now).0, Ok(None), "then 3");
    }

    /// A waiter that a holder's lock keeps out reserves nothing: the holder re-locks, shrinks,
    /// grows, shares and upgrades what it holds as POSIX lets it (a wish that reserved would
    /// wait for a holder that waits for it).
    #[test]
    fn a_waiter_held_off_by_a_holder_does_not_hold_that_holder_up() {
        let mut t = LockTable::default();
        let now = Instant::now();
        let range = |start, end, kind| FileLock {
            start,
            end,
            kind,
            pid: 1,
        };
        let read = FileLock {
            kind: LockKind::Read,
            ..WHOLE
        };
        assert_eq!(
            t.set(1, 1, 1, range(0, 9, LockKind::Write), false, now).0,
            Ok(None)
        );
        let (r, _) = t.set(1, 2, 1, range(0, 20, LockKind::Write), true, now);
        assert!(r.unwrap().is_some(), "2 waits for 1");
        for (lock, what) in [
            (range(0, 9, LockKind::Write), "the same lock again"),
            (range(0, 9, LockKind::Read), "a downgrade"),
            (range(0, 9, LockKind::Write), "an upgrade"),
            (
                range(15, 15, LockKind::Write),
                "more of the range 2 waits for",
            ),
        ] {
            assert_eq!(t.set(1, 1, 1, lock, true, now).0, Ok(None), "{what}");
        }
        assert_eq!(
            t.set(1, 1, 1, range(0, 20, LockKind::Unlock), false, now).0,
            Ok(None)
        );
        assert_eq!(
            t.set(1, 2, 1, WHOLE, true, now).0,
            Ok(None),
            "2 took it meanwhile"
        );
        assert_eq!(t.set(1, 2, 1, unlock(WHOLE), false, now).0, Ok(None));
        // 1 shares with another owner of its own (another descriptor) while 3 waits.
        assert_eq!(t.set(1, 1, 1, read, false, now).0, Ok(None));
        assert!(
            t.set(1, 3, 1, WHOLE, true, now).0.unwrap().is_some(),
            "3 waits"
        );
        assert_eq!(
            t.set(1, 1, 2, read, false, now).0,
            Ok(None),
            "shared with 1's other owner"
        );
        // Once the holders let go, 3's wish is first: a newcomer waits behind it.
        assert_eq!(t.set(1, 1, 1, unlock(read), false, now).1, vec![(3, 1)]);
        assert_eq!(t.set(1, 1, 2, unlock(read), false, now).1, vec![(3, 1)]);
        assert!(t.set(1, 4, 1, read, false, now).0.unwrap().is_some());
        assert_eq!(t.cancel_wait(1, 3, 1), vec![], "nobody else waits");
        assert_eq!(
            t.set(1, 4, 1, read, false, now).0,
            Ok(None),
            "3 gave up its place"
        );
    }

    #[test]
    fn a_waiter_that_stops_asking_loses_its_place_and_one_that_goes_is_dropped() {
        let mut t = LockTable::default();
        let start = Instant::now();
        assert!(t.set(1, 1, 1, WHOLE, false, start).0.is_ok());
        assert!(t.set(1, 2, 1, WHOLE, true, start).0.is_ok());
        assert!(t.set(1, 1, 1, unlock(WHOLE), false, start).0.is_ok());
        let later = start + WAIT_KEPT;
        assert_eq!(
            t.set(1, 3, 1, WHOLE, false, later).0,
            Ok(None),
            "2 stopped asking"
        );
        assert!(t.set(1, 3, 1, unlock(WHOLE), false, later).0.is_ok());
        assert!(t.set(1, 4, 1, WHOLE, false, later).0.is_ok());
        assert!(t.set(1, 2, 1, WHOLE, true, later).0.is_ok());
        t.drop_on(1, 2, None);
        assert_eq!(
            t.set(1, 4, 1, unlock(WHOLE), false, later).1,
            vec![],
            "nobody waits"
        );
        assert!(t.set(1, 4, 1, WHOLE, false, later).0.is_ok());
        assert!(t.set(1, 5, 1, WHOLE, true, later).0.is_ok());
        assert_eq!(t.drop_session(5), vec![]);
        assert_eq!(t.drop_session(4), vec![]);
        assert!(t.files.is_empty());
    }

    #[test]
    fn a_session_that_splits_ranges_without_end_runs_out_of_locks_and_only_it() {
        let mut t = LockTable::default();
        let now = Instant::now();
        let byte = |at: u64, kind| FileLock {
            start: at,
            end: at,
            kind,
            pid: 1,
        };
        let set =
            |t: &mut LockTable, ino, session, lock| t.set(ino, session, 1, lock, false, now).0;
        let mut held = 0;
        while set(&mut t, 1, 1, byte(2 * held, LockKind::Write)) == Ok(None) {
            held += 1;
        }
        assert_eq!(
            held as usize,
            MAX_PER_FILE - 1,
            "refused within two of the bound"
        );
        assert_eq!(
            set(&mut t, 1, 1, byte(2 * held, LockKind::Write)),
            Err(Errno::ENOLCK)
        );
        assert_eq!(t.count(), held as usize, "the refused one changed nothing");
        assert_eq!(
            set(&mut t, 1, 2, byte(1, LockKind::Write)),
            Ok(None),
            "another session's own"
        );
        assert_eq!(
            set(&mut t, 1, 1, byte(0, LockKind::Unlock)),
            Ok(None),
            "an unlock goes"
        );
        // Filling the gap between two ranges makes one of the three.
        assert_eq!(set(&mut t, 1, 1, byte(3, LockKind::Write)), Ok(None));
        assert_eq!(t.files[&1].held_by(1), held as usize - 2);
        for ino in 2..=5 {
            let mut i = 0;
            while set(&mut t, ino, 1, byte(2 * i, LockKind::Write)) == Ok(None) {
                i += 1;
            }
        }
        assert!(
            t.per_session[&1] + 2 > MAX_PER_SESSION,
            "{}",
            t.per_session[&1]
        );
        assert!(t.per_session[&1] <= MAX_PER_SESSION);
        assert_eq!(
            set(&mut t, 9, 1, byte(0, LockKind::Write)),
            Err(Errno::ENOLCK),
            "the session's bound"
        );
        assert!(
            !t.files.contains_key(&9),
            "nothing kept of the refused file"
        );
        t.drop_on(2, 1, None);
        assert_eq!(set(&mut t, 9, 1, byte(0, LockKind::Write)), Ok(None));
    }
}
