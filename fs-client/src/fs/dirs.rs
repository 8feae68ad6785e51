//! What this client knows of the directories it changes: their attributes after its last
//! change, and every name in those it made itself.
//!
//! A call that adds or removes a name answers its directory's attributes after the change (as
//! NFS answers post-operation attributes). The kernel, which drops a directory's attributes
//! whenever a name in it changes, asks for them next, and gets them from here: a create costs
//! no getattr of its directory, an unlink is one call.
//!
//! A directory made here starts empty and complete; while nobody else changes it, this client
//! knows every name in it, so the lookup the kernel makes before each create of a new name is
//! answered "no such name" here instead of by the metadata node.
//!
//! What is kept of a directory goes when the metadata node says it changed (its callbacks reach
//! every session that was answered its attributes or looked in it, and another mount's change
//! returns only once they are answered), when the connection is lost (callbacks may have been
//! missed), when a call about it fails, and once a quarter of the lease passed since the
//! metadata node last answered us about it: with the kernel's own caching (half of one), a
//! mount that missed callbacks serves nothing older than the lease. An answer that a callback
//! overtook (sent before another mount's change, arrived after the callback about it) is not
//! kept: every callback moves an epoch on, and an answer counts only if the epoch did not move
//! while its call was out.

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lru::LruCache;
use rfs_proto::types::{Attr, Ino, Name, RENAME_EXCHANGE};

/// Directories whose attributes are kept: those being changed right now.
const ATTRS: usize = 1024;
/// Directories whose names are kept.
const LISTINGS: usize = 256;
/// Names kept in all listings together; the least recently used listings go past it.
const NAMES: usize = 1 << 18;

pub(crate) struct Dirs {
    kept: Mutex<Kept>,
    max_age: Duration,
}

struct Kept {
    attrs: LruCache<Ino, (Attr, Instant)>,
    listings: LruCache<Ino, Listing>,
    names: usize,
    epoch: u64,
}

/// Every name in a directory, and when the metadata node last answered us about it.
struct Listing {
    names: HashSet<Name>,
    confirmed: Instant,
}

/// When a call that answers directory attributes went out (see [`Dirs::sent`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sent(u64);

impl Kept {
    fn fresh(&self, sent: Sent) -> bool {
        self.epoch == sent.0
    }

    fn drop_listing(&mut self, dir: Ino) {
        if let Some(l) = self.listings.pop(&dir) {
            self.names -= l.names.len();
        }
    }

    fn new_listing(&mut self, dir: Ino) {
        self.drop_listing(dir);
        let empty = Listing {
            names: HashSet::new(),
            confirmed: Instant::now(),
        };
        if let Some((_, evicted)) = self.listings.push(dir, empty) {
            self.names -= evicted.names.len();
        }
    }

    /// Applies a change of `dir`'s names that the metadata node answered. An answer that a
    /// callback (about any inode) overtook cannot tell whether the listing still holds: the
    /// listing goes.
    fn edit(&mut self, sent: Sent, dir: Ino, change: impl FnOnce(&mut HashSet<Name>)) {
        if !self.fresh(sent) {
            self.drop_listing(dir);
            return;
        }
        let Some(l) = self.listings.get_mut(&dir) else {
            return;
        };
        let before = l.names.len();
        change(&mut l.names);
        l.confirmed = Instant::now();
        let after = l.names.len();
        self.names = self.names + after - before;
        while self.names > NAMES {
            match self.listings.pop_lru() {
                Some((_, l)) => self.names -= l.names.len(),
                None => break,
            }
        }
    }
}

impl Dirs {
    pub(crate) fn new(max_age: Duration) -> Dirs {
        Dirs {
            kept: Mutex::new(Kept {
                attrs: LruCache::new(NonZeroUsize::new(ATTRS).expect("not zero")),
                listings: LruCache::new(NonZeroUsize::new(LISTINGS).expect("not zero")),
                names: 0,
                epoch: 0,
            }),
            max_age,
        }
    }

    /// Taken before a call that changes a directory.
    pub(crate) fn sent(&self) -> Sent {
        Sent(self.kept.lock().unwrap().epoch)
    }

    /// A call sent at `sent` added `name` to directory `dir` (its attributes after).
    pub(crate) fn added(&self, sent: Sent, dir: Attr, name: &[u8]) {
        let mut k = self.kept.lock().unwrap();
        Self::keep_attrs(&mut k, sent, dir);
        k.edit(sent, dir.ino, |names| {
            names.insert(name.into());
        });
    }

    /// A call sent at `sent` removed `name` from directory `dir` (its attributes after).
    pub(crate) fn removed(&self, sent: Sent, dir: Attr, name: &[u8]) {
        let mut k = self.kept.lock().unwrap();
        Self::keep_attrs(&mut k, sent, dir);
        k.edit(sent, dir.ino, |names| {
            names.remove(&Name::from(name));
        });
    }

    /// A mkdir sent at `sent` made directory `made` as `name` in `parent`: it is empty.
    pub(crate) fn made_dir(&self, sent: Sent, parent: Attr, name: &[u8], made: Ino) {
        self.added(sent, parent, name);
        let mut k = self.kept.lock().unwrap();
        if k.fresh(sent) {
            k.new_listing(made);
        }
    }

    /// A rename sent at `sent` (renameat2 `flags`) moved `name` in `old` to `newname` in
    /// `new` (their attributes after). Other directories' attributes go too: the renamed
    /// inode's ctime changed, and it may be among them.
    pub(crate) fn renamed(
        &self,
        sent: Sent,
        (old, name): (Attr, &[u8]),
        (new, newname): (Attr, &[u8]),
        flags: u32,
    ) {
        let mut k = self.kept.lock().unwrap();
        if flags & RENAME_EXCHANGE == 0 {
            k.edit(sent, old.ino, |names| {
                names.remove(&Name::from(name));
            });
            k.edit(sent, new.ino, |names| {
                names.insert(newname.into());
            });
        }
        let current = k.fresh(sent);
        k.attrs.clear();
        if current {
            Self::keep_attrs(&mut k, sent, old);
            Self::keep_attrs(&mut k, sent, new);
        }
        k.epoch += 1;
    }

    /// Keeps `dir`'s attributes after a change; an answer that a callback overtook may be
    /// older than what it replaces: both go.
    fn keep_attrs(k: &mut Kept, sent: Sent, dir: Attr) {
        if k.fresh(sent) {
            k.attrs.put(dir.ino, (dir, Instant::now()));
        } else {
            k.attrs.pop(&dir.ino);
        }
    }

    /// A call sent at `sent` removed directory `name` from `dir` (its attributes after).
    /// The removed directory's attributes, which the kernel may still ask for (a process in
    /// it), go with every other directory's: its number is not known here.
    pub(crate) fn removed_dir(&self, sent: Sent, dir: Attr, name: &[u8]) {
        let mut k = self.kept.lock().unwrap();
        k.attrs.clear();
        Self::keep_attrs(&mut k, sent, dir);
        k.edit(sent, dir.ino, |names| {
            names.remove(&Name::from(name));
        });
    }

    /// `dir`'s attributes, if kept and young enough.
    pub(crate) fn attrs(&self, dir: Ino) -> Option<Attr> {
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

    /// Whether `dir` is known to have no `name`.
    pub(crate) fn lacks(&self, dir: Ino, name: &[u8]) -> bool {
        let mut k = self.kept.lock().unwrap();
        match k.listings.get(&dir) {
            Some(l) if l.confirmed.elapsed() < self.max_age => !l.names.contains(&Name::from(name)),
            Some(_) => {
                k.drop_listing(dir);
                false
            }
            None => false,
        }
    }

    /// `ino` changed in a way no answer of ours told (a callback), or a call about it failed:
    /// what is kept of it goes, and answers already on their way are not kept.
    pub(crate) fn changed(&self, ino: Ino) {
        let mut k = self.kept.lock().unwrap();
        k.epoch += 1;
        k.attrs.pop(&ino);
        k.drop_listing(ino);
    }

    /// Callbacks may have been missed: nothing kept is trusted.
    pub(crate) fn forget_all(&self) {
        let mut k = self.kept.lock().unwrap();
        k.epoch += 1;
        k.attrs.clear();
        k.listings.clear();
        k.names = 0;
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
            cuts: 0,
            acl: false,
            held: 0,
        }
    }

    #[test]
    fn attributes_are_kept_until_a_change_and_not_past_their_age() {
        let d = Dirs::new(Duration::from_millis(100));
        assert_eq!(d.attrs(5), None);
        d.added(d.sent(), dir(5, 3), b"x");
        assert_eq!(d.attrs(5).unwrap().nlink, 3);
        d.changed(5);
        assert_eq!(d.attrs(5), None);
        d.removed(d.sent(), dir(5, 4), b"x");
        d.added(d.sent(), dir(6, 2), b"y");
        d.changed(6);
        assert_eq!(d.attrs(5).unwrap().nlink, 4, "another directory's change");
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(d.attrs(5), None, "too old");
        d.added(d.sent(), dir(5, 5), b"z");
        d.forget_all();
        assert_eq!(d.attrs(5), None);
    }

    #[test]
    fn an_answer_overtaken_by_a_callback_is_not_kept_and_what_it_changed_goes() {
        let d = Dirs::new(Duration::from_secs(10));
        let sent = d.sent();
        d.changed(9); // a callback, about any inode, while the call was out
        d.added(sent, dir(5, 3), b"x");
        assert_eq!(d.attrs(5), None);
        // Kept before, then an overtaken answer about the same directory: both go.
        d.made_dir(d.sent(), dir(1, 3), b"d", 5);
        d.added(d.sent(), dir(5, 2), b"a");
        let sent = d.sent();
        d.changed(9);
        d.added(sent, dir(5, 2), b"b");
        assert_eq!(d.attrs(5), None, "the older attributes go");
        assert!(!d.lacks(5, b"b"), "the listing without b goes");
        let sent = d.sent();
        d.changed(9);
        d.made_dir(sent, dir(1, 3), b"d", 5);
        assert!(!d.lacks(5, b"x"), "a made directory a callback overtook");
        let sent = d.sent();
        d.forget_all();
        d.added(sent, dir(5, 3), b"x");
        assert_eq!(d.attrs(5), None);
    }

    #[test]
    fn a_made_directory_lists_every_name_until_another_mount_changes_it() {
        let d = Dirs::new(Duration::from_secs(10));
        d.made_dir(d.sent(), dir(1, 3), b"d", 5);
        assert!(d.lacks(5, b"a") && d.lacks(5, b"b"));
        assert!(!d.lacks(1, b"anything"), "the parent was not made here");
        d.added(d.sent(), dir(5, 2), b"a");
        assert!(!d.lacks(5, b"a") && d.lacks(5, b"b"));
        d.removed(d.sent(), dir(5, 2), b"a");
        assert!(d.lacks(5, b"a"));
        d.added(d.sent(), dir(5, 2), b"b");
        d.renamed(d.sent(), (dir(5, 2), b"b"), (dir(5, 2), b"c"), 0);
        assert!(d.lacks(5, b"b") && !d.lacks(5, b"c"));
        d.changed(5); // another mount's create in it
        assert!(!d.lacks(5, b"zz"), "no longer known");
    }

    #[test]
    fn a_listing_is_trusted_a_quarter_lease_after_the_last_answer_about_it() {
        let d = Dirs::new(Duration::from_millis(100));
        d.made_dir(d.sent(), dir(1, 3), b"d", 5);
        std::thread::sleep(Duration::from_millis(60));
        d.added(d.sent(), dir(5, 2), b"a"); // confirms it
        std::thread::sleep(Duration::from_millis(60));
        assert!(d.lacks(5, b"b"));
        std::thread::sleep(Duration::from_millis(110));
        assert!(!d.lacks(5, b"b"), "too old");
    }

    #[test]
    fn an_exchange_keeps_both_names_and_listings_stay_within_their_budget() {
        let d = Dirs::new(Duration::from_secs(10));
        d.made_dir(d.sent(), dir(1, 3), b"d", 5);
        d.added(d.sent(), dir(5, 2), b"a");
        d.added(d.sent(), dir(5, 2), b"b");
        d.renamed(
            d.sent(),
            (dir(5, 2), b"a"),
            (dir(5, 2), b"b"),
            RENAME_EXCHANGE,
        );
        assert!(!d.lacks(5, b"a") && !d.lacks(5, b"b"));
        d.made_dir(d.sent(), dir(1, 3), b"e", 6);
        for i in 0..NAMES {
            d.added(d.sent(), dir(6, 2), format!("n{i}").as_bytes());
        }
        assert!(
            !d.lacks(5, b"zz"),
            "the older listing went to keep the budget"
        );
        assert!(d.lacks(6, b"zz"));
        d.added(d.sent(), dir(6, 2), b"one more");
        assert!(!d.lacks(6, b"zz"), "over the budget alone: not kept");
    }

    #[test]
    fn listings_pushed_out_give_their_names_back() {
        let d = Dirs::new(Duration::from_secs(10));
        for dir_ino in 0..LISTINGS as u64 * 2 {
            d.made_dir(d.sent(), dir(1, 3), b"d", 100 + dir_ino);
            d.added(d.sent(), dir(100 + dir_ino, 2), b"a");
        }
        assert_eq!(
            d.kept.lock().unwrap().names,
            LISTINGS,
            "one name per listing kept"
        );
    }

    #[test]
    fn a_removed_directorys_attributes_are_not_kept() {
        let d = Dirs::new(Duration::from_secs(10));
        d.added(d.sent(), dir(7, 2), b"x"); // perhaps the directory removed next
        d.removed_dir(d.sent(), dir(5, 2), b"sub");
        assert_eq!(d.attrs(7), None);
        assert_eq!(d.attrs(5).unwrap().nlink, 2);
    }
}
