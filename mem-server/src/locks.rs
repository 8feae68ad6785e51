//! The file locks of every client, by file: an owner is a session and the lock owner its
//! client named (fcntl's, or a flock's open file). Locks are not journaled, as NFS's are not:
//! after a restart, clients take theirs again within the grace period, during which nobody
//! else may take one (see `SetLock`). A session that ends loses its locks, as a process that
//! dies does. A session holds a bounded number of ranges (each lock call scans the file's),
//! so a client that splits ranges without end runs out of locks (ENOLCK), not the node.

use std::collections::HashMap;

use rfs_proto::locks::{FileLock, LockSet};
use rfs_proto::types::Ino;
use rfs_proto::Errno;

use crate::coherence::SessionId;

/// Who holds a lock: a session, and the owner its client named.
type Owner = (SessionId, u64);

/// Ranges held on one file, over every owner, at most.
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
        if conflict.is_some() {
            return Ok(conflict);
        }
        let before = (set.clone(), held_by(set, session));
        set.set((session, owner), lock);
        let mine = self.per_session.entry(session).or_default();
        let now = *mine + held_by(set, session) - before.1;
        if set.len() > MAX_PER_FILE || now > MAX_PER_SESSION {
            *set = before.0;
            return Err(Errno::ENOLCK);
        }
        *mine = now;
        self.tidy(ino, session);
        Ok(None)
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
    use rfs_proto::locks::{TO_END, UNLOCK, WRITE};

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
    fn a_session_that_splits_ranges_without_end_runs_out_of_locks() {
        let mut t = LockTable::default();
        let byte = |at: u64| FileLock {
            start: at,
            end: at,
            kind: WRITE,
            pid: 1,
        };
        for i in 0..MAX_PER_FILE as u64 {
            assert_eq!(t.set(1, 1, 1, byte(2 * i)), Ok(None));
        }
        assert_eq!(
            t.set(1, 1, 1, byte(2 * MAX_PER_FILE as u64)),
            Err(Errno::ENOLCK)
        );
        assert_eq!(t.count(), MAX_PER_FILE, "the refused one changed nothing");
        // Merging into a neighbour adds no range.
        assert_eq!(t.set(1, 1, 1, byte(1)), Ok(None));
        assert_eq!(t.count(), MAX_PER_FILE - 1);
        for ino in 2..=4 {
            for i in 0..MAX_PER_FILE as u64 {
                let _ = t.set(ino, 1, 1, byte(2 * i));
            }
        }
        assert_eq!(t.count(), MAX_PER_SESSION - 1);
        assert_eq!(t.set(9, 1, 1, byte(0)), Ok(None));
        assert_eq!(
            t.set(9, 1, 1, byte(2)),
            Err(Errno::ENOLCK),
            "the session's bound"
        );
        assert_eq!(t.set(9, 2, 1, byte(4)), Ok(None), "another session's own");
        t.drop_on(2, 1, None);
        assert_eq!(t.set(9, 1, 1, byte(2)), Ok(None));
    }
}
