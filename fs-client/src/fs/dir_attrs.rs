//! Directory attributes as our own changes left them. A call that adds or removes a name
//! answers its directory's attributes after the change (as NFS answers post-operation
//! attributes); the kernel, which drops a directory's attributes whenever a name in it changes,
//! asks for them next, and gets them from here instead of from the metadata node: a create
//! costs one call fewer, an unlink half as many.
//!
//! What is kept is dropped when the metadata node says the directory changed (its callbacks
//! reach every session that was answered its attributes) or when the connection is lost, and
//! is kept a quarter of the lease at most, so that with the kernel's own caching (half of one)
//! a mount that missed callbacks serves nothing older than the lease. An answer that a callback
//! overtook (it was sent before another mount's change, and arrived after the callback about
//! it) is not kept: every drop moves an epoch on, and an answer is kept only if the epoch did
//! not move while its call was out.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lru::LruCache;
use rfs_proto::types::{Attr, Ino};

/// Directories whose attributes are kept: those being changed right now.
const CAPACITY: usize = 1024;

pub(crate) struct DirAttrs {
    kept: Mutex<Kept>,
    max_age: Duration,
}

struct Kept {
    attrs: LruCache<Ino, (Attr, Instant)>,
    epoch: u64,
}

/// When a call that answers directory attributes went out (see [`DirAttrs::sent`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sent(u64);

impl DirAttrs {
    pub(crate) fn new(max_age: Duration) -> DirAttrs {
        DirAttrs {
            kept: Mutex::new(Kept {
                attrs: LruCache::new(NonZeroUsize::new(CAPACITY).expect("not zero")),
                epoch: 0,
            }),
            max_age,
        }
    }

    /// Taken before a call whose answer carries directory attributes.
    pub(crate) fn sent(&self) -> Sent {
        Sent(self.kept.lock().unwrap().epoch)
    }

    /// A call sent at `sent` answered `dir`'s attributes after its change.
    pub(crate) fn answered(&self, sent: Sent, dir: Attr) {
        let mut k = self.kept.lock().unwrap();
        if k.epoch == sent.0 {
            k.attrs.put(dir.ino, (dir, Instant::now()));
        }
    }

    /// `dir`'s attributes, if kept and young enough.
    pub(crate) fn get(&self, dir: Ino) -> Option<Attr> {
        let mut k = self.kept.lock().unwrap();
        match k.attrs.get(&dir) {
            Some(&(a, at)) if at.elapsed() < self.max_age => Some(a),
            Some(_) => {
                k.attrs.pop(&dir);
                None
            }
            None => None,
        }
    }

    /// `ino` changed in a way no answer of ours told: what is kept of it goes, and answers
    /// already on their way are not kept.
    pub(crate) fn changed(&self, ino: Ino) {
        let mut k = self.kept.lock().unwrap();
        k.epoch += 1;
        k.attrs.pop(&ino);
    }

    /// A rename sent at `sent` answered its two directories' attributes after it. What is kept
    /// of the others goes too: the renamed inode (its ctime changed) may be among them.
    pub(crate) fn renamed(&self, sent: Sent, old: Attr, new: Attr) {
        let mut k = self.kept.lock().unwrap();
        let current = k.epoch == sent.0;
        k.epoch += 1;
        k.attrs.clear();
        if current {
            let now = Instant::now();
            k.attrs.put(old.ino, (old, now));
            k.attrs.put(new.ino, (new, now));
        }
    }

    /// Callbacks may have been missed: nothing kept is trusted.
    pub(crate) fn forget_all(&self) {
        let mut k = self.kept.lock().unwrap();
        k.epoch += 1;
        k.attrs.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::types::{FileKind, Timestamp};

    fn dir(ino: Ino, nlink: u32) -> Attr {
        Attr {
            ino,
            kind: FileKind::Directory,
            perm: 0o755,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            atime: Timestamp::default(),
            mtime: Timestamp::default(),
            ctime: Timestamp::default(),
        }
    }

    #[test]
    fn answers_are_kept_until_a_change_and_not_past_their_age() {
        let d = DirAttrs::new(Duration::from_millis(100));
        assert_eq!(d.get(5), None);
        d.answered(d.sent(), dir(5, 3));
        assert_eq!(d.get(5).unwrap().nlink, 3);
        d.changed(5);
        assert_eq!(d.get(5), None);
        d.answered(d.sent(), dir(5, 4));
        d.answered(d.sent(), dir(6, 2));
        d.changed(6);
        assert_eq!(d.get(5).unwrap().nlink, 4, "another directory's change");
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(d.get(5), None, "too old");
        d.answered(d.sent(), dir(5, 5));
        d.forget_all();
        assert_eq!(d.get(5), None);
    }

    #[test]
    fn an_answer_overtaken_by_a_change_is_not_kept() {
        let d = DirAttrs::new(Duration::from_secs(10));
        let sent = d.sent();
        d.changed(9); // a callback, about any inode, while the call was out
        d.answered(sent, dir(5, 3));
        assert_eq!(d.get(5), None);
        let sent = d.sent();
        d.forget_all();
        d.answered(sent, dir(5, 3));
        assert_eq!(d.get(5), None);
    }

    #[test]
    fn a_rename_keeps_its_two_directories_only() {
        let d = DirAttrs::new(Duration::from_secs(10));
        d.answered(d.sent(), dir(7, 2)); // perhaps the directory renamed
        d.renamed(d.sent(), dir(5, 3), dir(6, 4));
        assert_eq!(d.get(7), None);
        assert_eq!(d.get(5).unwrap().nlink, 3);
        assert_eq!(d.get(6).unwrap().nlink, 4);
        let sent = d.sent();
        d.changed(1);
        d.renamed(sent, dir(5, 2), dir(6, 5));
        assert_eq!((d.get(5), d.get(6)), (None, None), "overtaken");
    }
}
