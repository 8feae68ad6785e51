//! Extended attributes: read, listed, set and removed through the metadata node, which checks
//! who may (the kernel checks first: the mount has `default_permissions`). What this mount
//! read is kept, values and absences alike, as attributes are: the node tells every session
//! that read an inode's attributes when they change, and the copy goes then (and when the
//! connection is lost, and a quarter of the lease after the node first answered about it). The
//! kernel asks for `security.capability` before writes (once per file with the writeback
//! cache, see `fuse`), so its absence is answered here, not by a call each time.
//!
//! An answer that a callback overtook (sent before another mount's change, arrived after the
//! callback about it) is not kept: every callback moves an epoch on, and an answer counts only
//! if the epoch did not move while its call was out.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lru::LruCache;
use rfs_proto::message::{GetXattr, ListXattr, RemoveXattr, SetXattr};
use rfs_proto::types::{Attr, Caller, Ino};
use rfs_proto::xattr::{XattrValue, POSIX_ACL_ACCESS};
use rfs_proto::Errno;

use super::backend::Backend;
use super::error::Result;
use super::ring_link::RING_INO;
use super::stats::STATS_INO;
use super::Rfs;

/// Inodes whose attributes are kept.
const INODES: usize = 4096;
/// The attribute that holds a file's capabilities (asked for before writes).
const CAPABILITIES: &[u8] = b"security.capability";
/// Bytes of values kept over every inode; past it, the least recently used inodes go.
const BYTES: usize = 16 << 20;

/// What is kept of one inode's extended attributes, for root and for anyone else apart: the
/// node answers them differently (trusted attributes are root's; under root squash root is
/// nobody, while the kernel lets it past the mode bits). Others share what one of them read:
/// the kernel checked the mode bits before asking.
#[derive(Default)]
struct Kept {
    /// Values by name; None: the node said there is none.
    values: [HashMap<Vec<u8>, Option<Vec<u8>>>; 2],
    /// The names as listed.
    lists: [Option<Vec<u8>>; 2],
    confirmed: Option<Instant>,
}

impl Kept {
    fn bytes(&self) -> usize {
        let values: usize = (self.values.iter().flatten())
            .map(|(n, v)| n.len() + v.as_ref().map_or(0, Vec::len))
            .sum();
        values + self.lists.iter().flatten().map(Vec::len).sum::<usize>()
    }
}

/// The extended attributes this mount read, by inode.
pub(crate) struct XattrCache {
    inner: Mutex<Inner>,
    max_age: Duration,
}

struct Inner {
    inodes: LruCache<Ino, Kept>,
    bytes: usize,
    epoch: u64,
}

/// When a call whose answer may be kept went out.
#[derive(Clone, Copy)]
pub(crate) struct Sent(u64);

impl XattrCache {
    pub(crate) fn new(max_age: Duration) -> XattrCache {
        XattrCache {
            inner: Mutex::new(Inner {
                inodes: LruCache::new(NonZeroUsize::new(INODES).expect("nonzero")),
                bytes: 0,
                epoch: 0,
            }),
            max_age,
        }
    }

    pub(crate) fn sent(&self) -> Sent {
        Sent(self.inner.lock().unwrap().epoch)
    }

    fn fresh(&self, k: &Kept) -> bool {
        k.confirmed.is_some_and(|t| t.elapsed() < self.max_age)
    }

    /// The value of `name` kept for `ino` (for root, or for others): Some(None) if it is
    /// known to be absent (answered so, or missing from a list kept).
    fn value(&self, ino: Ino, name: &[u8], root: bool) -> Option<Option<Vec<u8>>> {
        let mut inner = self.inner.lock().unwrap();
        let k = inner.inodes.get(&ino)?;
        if !self.fresh(k) {
            return None;
        }
        let slot = root as usize;
        if let Some(v) = k.values[slot].get(name) {
            return Some(v.clone());
        }
        let listed = |list: &Vec<u8>| list.split(|&b| b == 0).any(|n| n == name);
        // Others' list leaves trusted attributes out: only root's says those are absent.
        let trusted = name.starts_with(b"trusted.");
        match &k.lists[slot] {
            Some(list) if (root || !trusted) && !listed(list) => Some(None),
            _ => None,
        }
    }

    /// `attr` was made by this mount, at `sent`: it has no capabilities (the ACLs of its
    /// directory's default ACL it may have).
    pub(crate) fn made(&self, attr: &Attr, sent: Sent) {
        self.keep(attr.ino, sent, |k| {
            for values in &mut k.values {
                values.insert(CAPABILITIES.to_vec(), None);
            }
        });
        self.saw(attr, sent);
    }

    /// The node answered `attr` to a call sent at `sent`: an inode without an access ACL is
    /// known to have none (the kernel asks before it lets anyone but the owner in), and what
    /// was kept saying one that has one has none goes (a value it said absent, a list without
    /// it).
    pub(crate) fn saw(&self, attr: &Attr, sent: Sent) {
        let has = attr.acl;
        self.keep(attr.ino, sent, |k| {
            for (values, list) in k.values.iter_mut().zip(&mut k.lists) {
                if !has {
                    values.insert(POSIX_ACL_ACCESS.to_vec(), None);
                    continue;
                }
                if values.get(POSIX_ACL_ACCESS) == Some(&None) {
                    values.remove(POSIX_ACL_ACCESS);
                }
                let listed = |l: &Vec<u8>| l.split(|&b| b == 0).any(|n| n == POSIX_ACL_ACCESS);
                if list.as_ref().is_some_and(|l| !listed(l)) {
                    *list = None;
                }
            }
        });
    }

    fn list(&self, ino: Ino, root: bool) -> Option<Vec<u8>> {
        let mut inner = self.inner.lock().unwrap();
        let k = inner.inodes.get(&ino)?;
        if !self.fresh(k) {
            return None;
        }
        k.lists[root as usize].clone()
    }

    /// Keeps what a call sent at `sent` answered about `ino`, unless a callback came since.
    fn keep(&self, ino: Ino, sent: Sent, change: impl FnOnce(&mut Kept)) {
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        if inner.epoch != sent.0 {
            return;
        }
        let mut k = inner.inodes.pop(&ino).unwrap_or_default();
        inner.bytes -= k.bytes();
        if !self.fresh(&k) {
            k = Kept::default();
        }
        change(&mut k);
        // The oldest answer kept says how old the copy is.
        k.confirmed.get_or_insert_with(Instant::now);
        inner.bytes += k.bytes();
        if let Some((_, evicted)) = inner.inodes.push(ino, k) {
            inner.bytes -= evicted.bytes();
        }
        while inner.bytes > BYTES {
            match inner.inodes.pop_lru() {
                Some((_, evicted)) => inner.bytes -= evicted.bytes(),
                None => break,
            }
        }
    }

    /// `ino`'s attributes changed (here or elsewhere): nothing kept of them holds.
    pub(crate) fn changed(&self, ino: Ino) {
        let mut inner = self.inner.lock().unwrap();
        inner.epoch += 1;
        if let Some(k) = inner.inodes.pop(&ino) {
            inner.bytes -= k.bytes();
        }
    }

    /// Callbacks may have been missed: nothing kept holds.
    pub(crate) fn forget_all(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.epoch += 1;
        inner.inodes.clear();
        inner.bytes = 0;
    }
}

impl<B: Backend> Rfs<B> {
    /// The value of `ino`'s extended attribute `name` (ENODATA: none).
    pub fn getxattr(&self, ino: Ino, name: &[u8], caller: &Caller) -> Result<Vec<u8>> {
        if ino == STATS_INO || ino == RING_INO {
            return Err(Errno::ENODATA.into());
        }
        let root = caller.uid == 0;
        if let Some(kept) = self.xattrs.value(ino, name, root) {
            return kept.ok_or(Errno::ENODATA.into());
        }
        let sent = self.xattrs.sent();
        let r = self.call(GetXattr {
            ino,
            name: name.into(),
            caller: caller.clone(),
        });
        match r {
            Ok(XattrValue(v)) => {
                let kept = v.clone();
                self.xattrs.keep(ino, sent, |k| {
                    k.values[root as usize].insert(name.to_vec(), Some(kept));
                });
                Ok(v)
            }
            Err(e) if e.errno() == Errno::ENODATA => {
                self.xattrs.keep(ino, sent, |k| {
                    k.values[root as usize].insert(name.to_vec(), None);
                });
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// The names of `ino`'s extended attributes, each ended by a NUL.
    pub fn listxattr(&self, ino: Ino, caller: &Caller) -> Result<Vec<u8>> {
        if ino == STATS_INO || ino == RING_INO {
            return Ok(Vec::new());
        }
        let root = caller.uid == 0;
        if let Some(list) = self.xattrs.list(ino, root) {
            return Ok(list);
        }
        let sent = self.xattrs.sent();
        let list = self
            .call(ListXattr {
                ino,
                caller: caller.clone(),
            })?
            .0;
        let kept = list.clone();
        self.xattrs
            .keep(ino, sent, |k| k.lists[root as usize] = Some(kept));
        Ok(list)
    }

    /// Sets `ino`'s extended attribute `name` to `value`, with setxattr(2)'s `flags`.
    pub fn setxattr(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: u32,
        caller: &Caller,
    ) -> Result<()> {
        if ino == STATS_INO || ino == RING_INO {
            return Err(Errno::EPERM.into());
        }
        let set = SetXattr {
            ino,
            name: name.into(),
            value: XattrValue(value.to_vec()),
            flags,
            caller: caller.clone(),
        };
        // Whatever the answer: a call that failed may have taken effect. Its change time
        // moved (a directory's attributes may be kept).
        let r = self.call(set);
        self.xattrs.changed(ino);
        self.dirs.changed(ino);
        r.map(drop)
    }

    /// Removes `ino`'s extended attribute `name` (ENODATA: none).
    pub fn removexattr(&self, ino: Ino, name: &[u8], caller: &Caller) -> Result<()> {
        if ino == STATS_INO || ino == RING_INO {
            return Err(Errno::EPERM.into());
        }
        let r = self.call(RemoveXattr {
            ino,
            name: name.into(),
            caller: caller.clone(),
        });
        self.xattrs.changed(ino);
        self.dirs.changed(ino);
        r.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_kept_until_a_change_and_one_a_callback_overtook_is_not() {
        let c = XattrCache::new(Duration::from_secs(10));
        let sent = c.sent();
        c.keep(1, sent, |k| {
            k.values[0].insert(b"user.a".to_vec(), Some(b"x".to_vec()));
        });
        c.keep(1, c.sent(), |k| {
            k.values[0].insert(b"user.b".to_vec(), None);
        });
        assert_eq!(c.value(1, b"user.a", false), Some(Some(b"x".to_vec())));
        assert_eq!(
            c.value(1, b"user.a", true),
            None,
            "root's answers are its own"
        );
        assert_eq!(c.value(1, b"user.b", false), Some(None));
        assert_eq!(c.value(1, b"user.c", false), None);
        let before = c.sent();
        c.changed(2);
        c.keep(1, before, |k| {
            k.values[0].insert(b"user.c".to_vec(), None);
        });
        assert_eq!(
            c.value(1, b"user.c", false),
            None,
            "overtaken by a callback"
        );
        c.changed(1);
        assert_eq!(c.value(1, b"user.a", false), None);
        c.keep(1, c.sent(), |k| k.lists[0] = Some(b"user.a\0".to_vec()));
        assert_eq!(c.list(1, false), Some(b"user.a\0".to_vec()));
        assert_eq!(c.list(1, true), None, "root's list is its own");
        c.forget_all();
        assert_eq!(c.list(1, false), None);
    }

    fn attr(ino: Ino, acl: bool) -> Attr {
        let t = rfs_proto::types::Timestamp::default();
        Attr {
            ino,
            kind: rfs_proto::types::FileKind::RegularFile,
            perm: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            atime: t,
            mtime: t,
            ctime: t,
            cuts: 0,
            acl,
            held: 0,
        }
    }

    /// Attributes without an ACL answer the kernel's question for one; attributes with one
    /// take back whatever said there is none (a value, a list), and an answer a callback
    /// overtook is not kept.
    #[test]
    fn attributes_say_whether_there_is_an_acl() {
        let c = XattrCache::new(Duration::from_secs(10));
        let acl = POSIX_ACL_ACCESS;
        c.saw(&attr(1, false), c.sent());
        assert_eq!(c.value(1, acl, false), Some(None));
        assert_eq!(c.value(1, acl, true), Some(None), "root's too");
        c.keep(1, c.sent(), |k| k.lists[0] = Some(b"user.a\0".to_vec()));
        c.saw(&attr(1, true), c.sent());
        assert_eq!(c.value(1, acl, false), None, "asked again");
        assert_eq!(c.list(1, false), None, "the list did not have it");
        assert_eq!(c.value(1, b"user.b", false), None);
        let before = c.sent();
        c.changed(2);
        c.saw(&attr(3, false), before);
        assert_eq!(c.value(3, acl, false), None, "overtaken by a callback");
    }

    #[test]
    fn kept_answers_age_out_and_large_ones_make_room() {
        let c = XattrCache::new(Duration::from_millis(50));
        c.keep(1, c.sent(), |k| {
            k.values[0].insert(b"user.a".to_vec(), None);
        });
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(
            c.value(1, b"user.a", false),
            None,
            "older than the age kept"
        );
        let c = XattrCache::new(Duration::from_secs(10));
        for ino in 0..300 {
            c.keep(ino, c.sent(), |k| {
                k.values[0].insert(b"user.v".to_vec(), Some(vec![0; 65536]));
            });
        }
        assert!(c.inner.lock().unwrap().bytes <= BYTES);
        assert_eq!(c.value(0, b"user.v", false), None, "the oldest went");
        assert!(c.value(299, b"user.v", false).is_some());
    }
}
