//! Close-to-open consistency, as in NFS: what this client knows of the files it has open.
//! Sizes and mtimes of our writes are committed to the metadata node on flush, fsync and
//! release; opening a file refetches its attributes and drops its cached chunk map.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use rfs_proto::message::{Commit, Create, GetAttr, Open};
use rfs_proto::types::{Attr, Caller, FileAccess, FileKind, Ino, Owner, Timestamp};
use rfs_proto::Errno;

use super::backend::Backend;
use super::coherence::KernelInval;
use super::error::{Error, Result};
use super::owed::worth_retrying;
use super::pages::PageVersion;
use super::space::SPACE_WAIT;
use super::stats::{ClientStats, STATS_INO};
use super::Rfs;

/// What this client knows of a file it has open (or has uncommitted writes to).
#[derive(Default)]
pub(crate) struct OpenFile {
    handles: u32,
    /// The size including our uncommitted writes.
    size: u64,
    /// The size the metadata node has, as far as we know.
    committed: u64,
    /// Writes not yet committed to the metadata node.
    dirty: bool,
    /// Commits on their way: until they are answered, the node may answer sizes from before
    /// them (a getattr it answered first), which must not take ours back.
    committing: u32,
    mtime: Option<Timestamp>,
    /// We had chunks allocated while the file was open here: its closes may give back chunks
    /// allocated ahead, which the holders of its map (we too) must hear of at the close.
    allocated: bool,
    /// The file's count of cuts as far as we heard ([`Attr::cuts`]): our commits carry it, and
    /// the node refuses one made before a cut we had not heard of.
    cuts: u64,
    /// When a descriptor of it was last closed here (FLUSH): its RELEASE, which may give
    /// chunks back, may be on its way.
    flushed: Option<Instant>,
    /// Commits that failed: a commit that waited for another's answer takes its failure.
    commits_failed: u64,
    /// Its permission bits, as the latest answer or callback told.
    perm: u16,
}

impl OpenFile {
    pub(crate) fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Whether our size may be ahead of the metadata node's.
    fn ahead(&self) -> bool {
        self.dirty || self.committing > 0
    }

    /// Learns what the node says of the file: a cut we had not heard of (its callback lost
    /// with a connection, or not here yet) holds over our uncommitted writes, made before we
    /// heard of it. Counts only grow: an answer overtaken by a later one tells nothing new.
    /// Whether it told of a cut.
    pub(crate) fn learn(&mut self, a: &Attr) -> bool {
        if a.cuts <= self.cuts {
            return false;
        }
        self.cuts = a.cuts;
        self.follow(a.size, true);
        self.dirty = false;
        self.mtime = None;
        true
    }

    /// Takes what an answer of the node says of the file's size: a cut we had not heard of
    /// holds ([`Self::learn`]); an answer from before a cut we did hear of (fewer cuts than
    /// ours, overtaken by the cut) tells nothing; otherwise the size can only grow
    /// ([`Self::follow`]).
    pub(crate) fn answered(&mut self, a: &Attr) {
        self.perm = a.perm;
        if !self.learn(a) && a.cuts == self.cuts {
            self.follow(a.size, false);
        }
    }

    /// Follows a size the node told of: a cut (truncate) holds even over our uncommitted
    /// writes (they came before it). Otherwise the larger of the two: but for cuts, which its
    /// count tells, the node's sizes only grow, so a smaller one is from an answer overtaken
    /// by our commit (sent before it, back after it) and must not take ours back.
    pub(crate) fn follow(&mut self, size: u64, cut: bool) {
        if cut {
            self.committed = size;
            self.size = size;
        } else {
            self.committed = self.committed.max(size);
            self.size = self.size.max(size);
        }
    }
}

impl<B: Backend> Rfs<B> {
    /// Like [`Self::open`], and whether the kernel may keep the pages it cached of the file
    /// (FOPEN_KEEP_CACHE): yes when the file is the version it was when they were cached here,
    /// and no callback or lost connection came since (as NFS keeps its cache across opens of
    /// an unchanged file). Otherwise the kernel drops them at this open.
    pub fn open_keeping_cache(
        &self,
        ino: Ino,
        access: FileAccess,
        caller: &Caller,
    ) -> Result<(u64, Attr, bool)> {
        if ino == STATS_INO {
            return Ok((0, self.stats_attr(), false));
        }
        // Close-to-open: no reference from before this open serves it. Its answer brings the
        // first chunks of the map, as fresh as the open: a small file's read needs no call.
        self.chunks.forget(ino, 0);
        let fetch = self.chunks.fetching(ino);
        let opened = self.call(Open {
            ino,
            access,
            caller: caller.clone(),
        });
        // Close-to-open: nothing cached before a loss of the connection may serve this open,
        // nor may this answer if it is one a resent call got from before the loss (what the
        // reconnection drops starts a new generation, which keeps it out).
        self.backend.reconnection_settled();
        self.chunks
            .fetched(fetch, opened.as_ref().ok().map(|o| &o.map));
        let attr = opened?.attr;
        let now = PageVersion::of(&attr);
        let keep = attr.kind == FileKind::RegularFile
            && self.page_versions.lock().unwrap().insert(ino, now) == Some(now);
        let (fh, attr) = self.took_handle(attr, access);
        Ok((fh, attr, keep))
    }

    /// Opens a file for `access` (FileAccess::READ, FileAccess::WRITE) on behalf of `caller`: fresh
    /// attributes and chunk map (close-to-open), and a handle. The metadata node checks the
    /// file's mode, and gives chunk maps only while a handle is open.
    pub fn open(&self, ino: Ino, access: FileAccess, caller: &Caller) -> Result<(u64, Attr)> {
        self.open_keeping_cache(ino, access, caller)
            .map(|(fh, attr, _)| (fh, attr))
    }

    /// Creates a regular file in `parent` and opens it for `access`, in one call.
    pub fn create(
        &self,
        parent: Ino,
        name: &[u8],
        owner: Owner,
        access: FileAccess,
        caller: &Caller,
    ) -> Result<(u64, Attr)> {
        self.not_a_reserved_name(parent, name)?;
        let sent = self.dirs.sent();
        let no_xattrs = self.xattrs.sent();
        let create = Create {
            parent,
            name: name.into(),
            owner,
            access,
            caller: caller.clone(),
        };
        let made = self.changing(parent, create)?;
        self.dirs.added(sent, made.dir, name);
        // A new file has no capabilities: its writes need not ask for them.
        self.xattrs.made(&made.attr, no_xattrs);
        // The kernel has no pages of a new file, so none of another version.
        let new = PageVersion::of(&made.attr);
        self.page_versions
            .lock()
            .unwrap()
            .insert(made.attr.ino, new);
        Ok(self.opened(made.attr, access))
    }

    /// open(2) with O_CREAT and without O_EXCL: creates `name` in `parent` like
    /// [`Self::create`], but makes a create whose fate our lost session hides (the node
    /// restarted under it) again: EEXIST then may mean the first one made it. EEXIST is not
    /// this open's failure (the caller has the kernel look the name up again and open what is
    /// there).
    pub fn create_unchecked(
        &self,
        parent: Ino,
        name: &[u8],
        owner: Owner,
        access: FileAccess,
        caller: &Caller,
    ) -> Result<(u64, Attr)> {
        let mut tries = 0;
        loop {
            tries += 1;
            match self.create(parent, name, owner, access, caller) {
                Err(e) if e.is_unsettled() && tries < 3 => {
                    log::warn!("create in directory {parent}: {e}: made again");
                }
                made => return made,
            }
        }
    }

    /// A handle the metadata node granted.
    fn opened(&self, attr: Attr, access: FileAccess) -> (u64, Attr) {
        if attr.kind == FileKind::RegularFile {
            self.chunks.forget(attr.ino, 0);
        }
        self.took_handle(attr, access)
    }

    /// A handle of `access` on the file `attr` describes, its chunk references already fresh.
    fn took_handle(&self, attr: Attr, access: FileAccess) -> (u64, Attr) {
        let ino = attr.ino;
        let fh = self.next_fh.fetch_add(1, Relaxed);
        self.handles.lock().unwrap().insert(fh, (ino, access));
        let mut open = self.open.lock().unwrap();
        let f = open.entry(ino).or_default();
        f.handles += 1;
        f.answered(&attr);
        drop(open);
        (fh, self.with_local_size(attr))
    }

    /// Every handle open, as (inode, access), with those closed and not yet given back.
    pub(crate) fn open_handles(&self) -> Vec<(Ino, FileAccess)> {
        // Every list held at once: a handle moves from one to the next (open, owed, closing)
        // under the locks of both, so it is listed exactly once.
        let handles = self.handles.lock().unwrap();
        self.closes.with_unanswered(|closing| {
            let mut all: Vec<_> = handles.values().copied().collect();
            all.extend(self.owed.handles());
            all.extend_from_slice(closing);
            all
        })
    }

    /// Whether this client holds a handle of `ino` open for writing.
    pub(crate) fn has_writable_handle(&self, ino: Ino) -> bool {
        self.handles
            .lock()
            .unwrap()
            .values()
            .any(|&(i, access)| i == ino && access.contains(FileAccess::WRITE))
    }

    /// fsync: waits for our writes of `ino` in flight, commits our size and mtime of it to
    /// the metadata node if we changed them, and reports a write that failed after it was
    /// answered.
    pub fn commit(&self, ino: Ino) -> Result<()> {
        self.commit_reporting(ino, true)
    }

    /// close (FLUSH) of handle `fh` of `ino`: a commit; a failed write is reported to
    /// handles that may write (a reader's close neither hears of it nor hides it).
    pub fn flush(&self, ino: Ino, fh: u64) -> Result<()> {
        if let Some(f) = self.open.lock().unwrap().get_mut(&ino) {
            f.flushed = Some(Instant::now());
        }
        let writes = self
            .handles
            .lock()
            .unwrap()
            .get(&fh)
            .is_some_and(|&(_, access)| access.contains(FileAccess::WRITE));
        self.commit_reporting(ino, writes)
    }

    /// Waits for the writes of `ino` admitted so far, then commits (see [`Self::commit`]).
    pub(crate) fn commit_reporting(&self, ino: Ino, report: bool) -> Result<()> {
        let landed = self.behind.drain(ino, report);
        let committed = self.commit_size(ino);
        landed.and(committed)
    }

    /// Commits our size and mtime of `ino`, if we changed them: the size only up to where
    /// bytes still in flight start (another writer's, answered after the drain), so that no
    /// other client sees a size before its bytes; the rest stays for the next commit.
    ///
    /// A commit the node refuses for a cut made elsewhere that we had not heard of (ESTALE)
    /// commits nothing: we learn the cut, which holds over our writes so far as the callback
    /// would have had it, and that is no failure of the close.
    ///
    /// One commit of a file is on its way at a time: while another thread's is (another
    /// process closing a descriptor it inherited), this waits for its answer, then commits
    /// what is left, if anything (that one may have carried our writes), so a close returns
    /// only once the node has the size. Two at once could be answered out of order, and the
    /// earlier answer, taken last, made our pages look older than the file (see
    /// [`Self::pages_committed`]): the next open dropped them.
    ///
    /// If the commit waited for fails (the metadata node is out of reach), this one fails with
    /// it rather than sending another: closes that pile up behind a dead node wait one call's
    /// deadline, not one each.
    pub(crate) fn commit_size(&self, ino: Ino) -> Result<()> {
        let made = {
            let mut open = self.open.lock().unwrap();
            let failed_before = open.get(&ino).map(|f| f.commits_failed);
            loop {
                match open.get_mut(&ino) {
                    Some(f) if f.committing > 0 => {
                        open = self.commit_answered.wait(open).unwrap();
                    }
                    Some(f) if Some(f.commits_failed) != failed_before => {
                        return Err(Error::new(
                            Errno::EIO,
                            format!("inode {ino}: the commit this one waited for failed"),
                        ));
                    }
                    Some(f) if f.dirty => {
                        f.committing += 1;
                        break self.commit_of(ino, f);
                    }
                    _ => return Ok(()),
                }
            }
        };
        self.send_commit(ino, made, true)
    }

    /// What to commit of `f` now, taken as sent: (size, mtime, count of cuts). Any bytes still
    /// in flight (another thread's writes, admitted after this one's drain) leave it dirty,
    /// below the committed size too: this commit makes a new version of the file, which
    /// another mount may cache the old bytes under, so another commit must follow their
    /// landing.
    fn commit_of(&self, ino: Ino, f: &mut OpenFile) -> (u64, Option<Timestamp>, u64) {
        let landed = self
            .behind
            .unlanded_from(ino, f.committed)
            .map_or(f.size, |from| from.min(f.size));
        f.dirty = self.behind.unlanded_from(ino, 0).is_some();
        (landed, f.mtime, f.cuts)
    }

    /// Sends a commit counted as on its way, and takes its answer; `may_retry`: once more if
    /// it is refused for a cut we heard of meanwhile (see [`Self::cut_unheard`]).
    fn send_commit(
        &self,
        ino: Ino,
        (size, mtime, cuts): (u64, Option<Timestamp>, u64),
        may_retry: bool,
    ) -> Result<()> {
        let committed = self.call(Commit {
            ino,
            size,
            mtime,
            cuts,
        });
        if let Ok(c) = &committed {
            self.pages_committed(ino, c);
        }
        if committed
            .as_ref()
            .is_err_and(|e| e.errno() == Errno::ESTALE)
        {
            return self.cut_unheard(ino, size, cuts, may_retry);
        }
        self.committed(ino, |f| match committed {
            Ok(_) => f.committed = f.committed.max(size),
            Err(_) => {
                f.dirty = true;
                f.commits_failed += 1;
            }
        });
        committed.map(drop)
    }

    /// A commit of `ino` is answered: `then` updates what we know of the file.
    fn committed(&self, ino: Ino, then: impl FnOnce(&mut OpenFile)) {
        let mut open = self.open.lock().unwrap();
        // Kept while committing: `release` leaves a file that is ahead of the node.
        if let Some(f) = open.get_mut(&ino) {
            f.committing -= 1;
            self.commit_answered.notify_all();
            then(f);
            if f.handles == 0 && !f.ahead() {
                open.remove(&ino); // released meanwhile
            }
        }
    }

    /// The node refused our commit of `size` bytes, made with `cuts`, for a cut we had not
    /// heard of then. We ask the node: if that is how we hear of the cut, our writes so far
    /// are ordered before it. If we heard of it meanwhile (a callback), what was written since
    /// is committed again; so is what was refused if the node counts fewer cuts than we heard
    /// of (it lost one in a crash before making it durable: asked after the refusal, with no
    /// truncate of ours between, its count holds). The commit counts as on its way throughout,
    /// retry included, so that a truncate of ours waits for it and nothing takes our size for
    /// the node's meanwhile.
    fn cut_unheard(&self, ino: Ino, size: u64, cuts: u64, may_retry: bool) -> Result<()> {
        let now = match self.call(GetAttr { ino }) {
            Ok(a) => a,
            Err(e) => {
                // Not known to be cut: the commit stays to be made (owed, at a close).
                self.committed(ino, |f| f.dirty = true);
                return Err(e);
            }
        };
        let mut open = self.open.lock().unwrap();
        // Kept while committing, so there; if not, there is nothing left to commit.
        let Some(f) = open.get_mut(&ino) else {
            drop(open);
            self.committed(ino, |_| {});
            return Ok(());
        };
        if f.learn(&now) {
            drop(open);
            self.committed(ino, |_| {});
            log::warn!(
                "inode {ino}: cut by another client before our writes up to {size} bytes were \
                 committed: the cut holds"
            );
            ClientStats::add(&self.stats.commits_over_cuts, 1);
            self.pages_changed(ino);
            self.kernel(KernelInval::Inode { ino, data: true });
            return Ok(());
        }
        if f.cuts == cuts {
            f.cuts = now.cuts;
            f.dirty = true;
        }
        if !f.dirty || !may_retry {
            let dirty = f.dirty;
            drop(open);
            self.committed(ino, |_| {});
            return match dirty {
                false => Ok(()), // nothing written since we heard of the cut
                true => Err(Error::new(
                    Errno::EIO,
                    format!("inode {ino}: the metadata node refused a commit twice (ESTALE)"),
                )),
            };
        }
        let made = self.commit_of(ino, f);
        drop(open);
        self.send_commit(ino, made, false)
    }

    /// Waits until no commit of `ino` is on its way (each ends within its call's deadline).
    pub(crate) fn commits_answered(&self, ino: Ino) {
        let mut open = self.open.lock().unwrap();
        while open.get(&ino).is_some_and(|f| f.committing > 0) {
            open = self.commit_answered.wait(open).unwrap();
        }
    }

    /// Closes handle `fh`: commits (reporting a failed write to a handle that may write),
    /// then gives the handle back to the metadata node, together with other closes (see
    /// [`closes`](super::closes)). The handle stays listed until its writes landed: a metadata
    /// node that restarts meanwhile hears of it. A commit that a fault kept from the node is
    /// owed: the handle is kept until it goes through (see [`owed`](super::owed)).
    pub fn release(self: &Arc<Self>, fh: u64) -> Result<()> {
        let Some(&(ino, access)) = self.handles.lock().unwrap().get(&fh) else {
            return Ok(()); // the stats file, or an unknown handle
        };
        // A last close may give chunks back: from here until the node has it, writers short
        // of space wait for it.
        let _releasing = self
            .open
            .lock()
            .unwrap()
            .get(&ino)
            .is_some_and(|f| f.allocated && f.handles == 1)
            .then(|| self.giving_back.begin());
        let landed = self.behind.drain(ino, access.contains(FileAccess::WRITE));
        let commit = self.commit_size(ino);
        let fault = commit.as_ref().is_err_and(worth_retrying);
        let committed = landed.and(commit);
        let mut handles = self.handles.lock().unwrap();
        handles.remove(&fh);
        let (allocated, owed) = {
            let mut open = self.open.lock().unwrap();
            let (allocated, ahead, last) = match open.get_mut(&ino) {
                Some(f) => {
                    f.handles -= 1;
                    (f.allocated, f.ahead(), f.handles == 0)
                }
                None => (false, false, false),
            };
            if last && !ahead {
                open.remove(&ino);
            }
            if last {
                // The node drops our locks on the file with our last handle.
                self.locks.forget(ino);
            }
            (allocated, fault && ahead)
        };
        if owed {
            self.owe_commit(ino, access, allocated);
            return committed;
        }
        // From open to closing under both lists' locks (see `open_handles`).
        self.closes.listed(|| Some((ino, access)));
        drop(handles);
        // A file we had chunks allocated for goes back at once, and after the closes of it
        // made before: its last close may give back chunks allocated ahead.
        let released = self.close_listed_handle(ino, access, allocated);
        committed.and(released)
    }

    /// Our size and mtime of `ino` will not be committed: the file is gone. The node's size
    /// holds, and the kernel drops what it cached of ours; but while the file is open here,
    /// writes made since are kept for its next commit.
    pub(crate) fn uncommitted_dropped(&self, ino: Ino) {
        {
            let mut open = self.open.lock().unwrap();
            let Some(f) = open.get_mut(&ino) else { return };
            if f.handles > 0 {
                return;
            }
            f.dirty = false;
            f.size = f.committed;
            if !f.ahead() {
                open.remove(&ino);
            }
        }
        self.pages_changed(ino);
        self.kernel(KernelInval::Inode { ino, data: true });
    }

    /// The node's attributes of `a`'s file with our size: our uncommitted writes make it look
    /// larger to us than to the node, and an answer the node gave before our commit does not
    /// take the size back (see [`OpenFile::follow`]).
    pub(crate) fn with_local_size(&self, mut a: Attr) -> Attr {
        if let Some(f) = self.open.lock().unwrap().get_mut(&a.ino) {
            f.answered(&a);
            // Our mtime goes with our size: the answer's is older where its size is.
            if f.ahead() || a.size < f.size {
                if let Some(m) = f.mtime {
                    a.mtime = m;
                }
            }
            a.size = f.size;
        }
        a
    }

    /// A truncation to `size` took effect: our size follows, and the chunks past it are gone.
    pub(crate) fn truncated(&self, ino: Ino, size: u64) {
        if let Some(f) = self.open.lock().unwrap().get_mut(&ino) {
            f.size = size;
            f.committed = size;
        }
        self.chunks.forget(ino, size.div_ceil(self.chunk_size));
    }

    /// Whether a file other than `ino` that we had chunks allocated for is open here and had a
    /// descriptor closed moments ago: its release may be on its way from the kernel, and may
    /// give chunks back. (A file merely held open gives nothing back soon: no wait for it.)
    pub(crate) fn others_closing(&self, ino: Ino) -> bool {
        self.open.lock().unwrap().iter().any(|(&other, f)| {
            other != ino
                && f.allocated
                && f.handles > 0
                && f.flushed.is_some_and(|t| t.elapsed() < SPACE_WAIT)
        })
    }

    /// Chunks of `ino` are being allocated for us (a write, fallocate).
    pub(crate) fn allocating(&self, ino: Ino) {
        if let Some(f) = self.open.lock().unwrap().get_mut(&ino) {
            f.allocated = true;
        }
    }

    /// A write of `len` bytes ending at `end` is in remote memory.
    /// The count of cuts of `ino` we have heard of, if it is open here.
    pub(crate) fn cuts_heard(&self, ino: Ino) -> Option<u64> {
        self.open.lock().unwrap().get(&ino).map(|f| f.cuts)
    }

    pub(crate) fn wrote(&self, ino: Ino, end: u64, len: u32) {
        ClientStats::add(&self.stats.bytes_written, len as u64);
        let mut open = self.open.lock().unwrap();
        let f = open.entry(ino).or_default();
        f.size = f.size.max(end);
        f.dirty = true;
        f.mtime = Some(Timestamp::now());
    }

    /// The size reads are bounded by: ours while the file is open here, else the server's.
    /// The end of `ino` as this mount knows it while the file is open here: our writes, and
    /// what other clients committed (their commits' callbacks are in before the commit
    /// returns, so under a lock this is the end the last holder left). None if not open.
    /// The permission bits of `ino` if it is open here, as last told.
    pub(crate) fn open_perm(&self, ino: Ino) -> Option<u16> {
        self.open.lock().unwrap().get(&ino).map(|f| f.perm)
    }

    pub fn open_end(&self, ino: Ino) -> Option<u64> {
        self.open.lock().unwrap().get(&ino).map(|f| f.size)
    }

    pub(crate) fn size_for_read(&self, ino: Ino) -> Result<u64> {
        if let Some(f) = self.open.lock().unwrap().get(&ino) {
            return Ok(f.size);
        }
        Ok(self.getattr(ino)?.size)
    }

    pub(crate) fn open_file_count(&self) -> usize {
        self.open.lock().unwrap().len()
    }
}
