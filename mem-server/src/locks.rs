//! The file locks of every client, by file: an owner is a session and the lock owner its
//! client named (fcntl's, or a flock's open file). Locks are not journaled, as NFS's are not:
//! after a restart, clients take theirs again within the grace period, during which nobody
//! else may take one (see `SetLock`). A session that ends loses its locks, as a process that
//! dies does. A session holds a bounded number of ranges on each file and over all (each lock
//! call scans the file's), so a client that splits ranges without end runs out of locks
//! (ENOLCK), not the node, and not the other clients: an unlock is never refused.

use std::collections::HashMap;

use rfs_proto::locks::{FileLock, LockSet, UNLOCK};
use rfs_proto::types::Ino;
use rfs_proto::Errno;

use crate::coherence::SessionId;

/// Who holds a lock: a session, and the owner its client named.
type Owner = (SessionId, u64);

/// Ranges one session holds on one file, at most.
const MAX_PER_FILE: usize = 4096;
/// Ranges one session holds, over every file, at most.
const MAX_PER_SESSION: usize = 16384;

/// A conflicting lock as `session` is told of it: the process id only if it is its own
/// (another machine's means nothing to the caller's kernel).
fn seen_by(session: SessionId, conflict: Option<&(Owner, FileLock)>) -> Option<FileLock> {
    conflict.map(|&((s, _), lock)| FileLock {
        pid: if s == session { lock.pid } else { 0 },
        ..lock
    })
}

fn held_by(set: &LockSet<Owner>, session: SessionId) -> usize {
    set.iter().filter(|((s, _), _)| *s == session).count()
}

#[derive(Default)]
pub(crate) struct LockTable {
    files: HashMap<Ino, LockSet<Owner>>,
    /// Ranges held, by session.
    per_session: HashMap<SessionId, usize>,
}

impl LockTable {
    /// Takes `lock` for `owner` of `session` on `ino` unless another owner's lock conflicts
    /// (that lock is answered, and nothing changes). ENOLCK past the bounds on ranges held.
    pub(crate) fn set(
        &mut self,
        ino: Ino,
        session: SessionId,
        owner: u64,
        lock: FileLock,
    ) -> Result<Option<FileLock>, Errno> {
        let set = self.files.entry(ino).or_default();
        let conflict = seen_by(session, set.conflict((session, owner), &lock));
        let here = held_by(set, session);
        let total = self.per_session.get(&session).copied().unwrap_or(0);
        // A lock adds at most two ranges (it splits one of another kind of its owner's).
        let bounded =
            lock.kind == UNLOCK || (here + 2 <= MAX_PER_FILE && total + 2 <= MAX_PER_SESSION);
        if conflict.is_none() && bounded {
            set.set((session, owner), lock);
            let now = held_by(set, session);
            *self.per_session.entry(session).or_default() = total + now - here;
        }
        self.tidy(ino, session);
        match bounded {
            true => Ok(conflict),
            false => Err(Errno::ENOLCK),
        }
    }

    /// The lock of another owner that would keep `owner` of `session` from taking `lock`.
    pub(crate) fn conflict(
        &self,
        ino: Ino,
        session: SessionId,
        owner: u64,
        lock: &FileLock,
    ) -> Option<FileLock> {
        seen_by(
            session,
            self.files.get(&ino)?.conflict((session, owner), lock),
        )
    }

    /// Drops the locks of `session` on `ino`: those of `owner`, or all of them.
    pub(crate) fn drop_on(&mut self, ino: Ino, session: SessionId, owner: Option<u64>) {
        let Some(set) = self.files.get_mut(&ino) else {
            return;
        };
        let before = held_by(set, session);
        set.drop_owners(|(s, o)| s == session && owner.is_none_or(|only| only == o));
        let gone = before - held_by(set, session);
        if let Some(n) = self.per_session.get_mut(&session) {
            *n -= gone;
        }
        self.tidy(ino, session);
    }

    /// Drops every lock of `session` (it ended).
    pub(crate) fn drop_session(&mut self, session: SessionId) {
        self.files.retain(|_, set| {
            set.drop_owners(|(s, _)| s == session);
            !set.is_empty()
        });
        self.per_session.remove(&session);
    }

    /// Keeps no empty entries.
    fn tidy(&mut self, ino: Ino, session: SessionId) {
        if self.files.get(&ino).is_some_and(LockSet::is_empty) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::locks::{TO_END, WRITE};

    const WHOLE: FileLock = FileLock {
        start: 0,
        end: TO_END,
        kind: WRITE,
        pid: 1,
    };

    #[test]
    fn two_sessions_never_hold_conflicting_locks_and_a_session_that_ends_frees_them() {
        let mut t = LockTable::default();
        assert_eq!(t.set(5, 1, 10, WHOLE), Ok(None));
        let theirs = FileLock { pid: 0, ..WHOLE };
        assert_eq!(
            t.set(5, 2, 10, WHOLE),
            Ok(Some(theirs)),
            "same owner, other session"
        );
        assert_eq!(t.conflict(5, 2, 10, &WHOLE), Some(theirs));
        assert_eq!(
            t.conflict(5, 1, 11, &WHOLE),
            Some(WHOLE),
            "another owner of ours"
        );
        assert_eq!(t.set(6, 2, 10, WHOLE), Ok(None), "another file");
        assert_eq!(t.count(), 2);
        t.drop_session(1);
        assert_eq!(t.set(5, 2, 10, WHOLE), Ok(None));
        t.drop_on(5, 2, Some(11));
        assert_eq!(t.count(), 2, "another owner's drop takes nothing");
        t.drop_on(5, 2, Some(10));
        let unlock = FileLock {
            kind: UNLOCK,
            ..WHOLE
        };
        assert_eq!(t.set(6, 2, 10, unlock), Ok(None));
        assert_eq!(t.count(), 0);
        assert!(
            t.files.is_empty() && t.per_session.is_empty(),
            "nothing empty kept"
        );
    }

    #[test]
    fn a_session_that_splits_ranges_without_end_runs_out_of_locks_and_only_it() {
        let mut t = LockTable::default();
        let byte = |at: u64, kind| FileLock {
            start: at,
            end: at,
            kind,
            pid: 1,
        };
        let mut held = 0;
        while t.set(1, 1, 1, byte(2 * held, WRITE)) == Ok(None) {
            held += 1;
        }
        assert_eq!(
            held as usize,
            MAX_PER_FILE - 1,
            "refused within two of the bound"
        );
        assert_eq!(t.set(1, 1, 1, byte(2 * held, WRITE)), Err(Errno::ENOLCK));
        assert_eq!(t.count(), held as usize, "the refused one changed nothing");
        assert_eq!(
            t.set(1, 2, 1, byte(1, WRITE)),
            Ok(None),
            "another session's own"
        );
        assert_eq!(t.set(1, 1, 1, byte(0, UNLOCK)), Ok(None), "an unlock goes");
        // Filling the gap between two ranges makes one of the three.
        assert_eq!(t.set(1, 1, 1, byte(3, WRITE)), Ok(None));
        assert_eq!(held_by(&t.files[&1], 1), held as usize - 2);
        for ino in 2..=5 {
            let mut i = 0;
            while t.set(ino, 1, 1, byte(2 * i, WRITE)) == Ok(None) {
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
            t.set(9, 1, 1, byte(0, WRITE)),
            Err(Errno::ENOLCK),
            "the session's bound"
        );
        assert!(
            !t.files.contains_key(&9),
            "nothing kept of the refused file"
        );
        t.drop_on(2, 1, None);
        assert_eq!(t.set(9, 1, 1, byte(0, WRITE)), Ok(None));
    }
}
