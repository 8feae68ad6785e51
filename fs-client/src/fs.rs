//! The file system operations, independent of FUSE: metadata by RPC to the metadata node, file
//! data by one-sided RDMA through the rdmabox sessions of the data nodes. Reads and writes are
//! asynchronous: they return at once and call `done` from the completion path, so many can be in
//! flight together (which is what the merge queues feed on).
//!
//! Consistency is close-to-open, as in NFS: sizes and mtimes are committed on flush, fsync and
//! release; opening a file refetches its attributes and drops its cached chunk map.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use lru::LruCache;
use mem_server::client::Client;
use mem_server::namespace::{now, Owner};
use mem_server::proto::{
    Attr, ChunkRef, FileKind, Reply, Request, SetAttr, StatFs, Timestamp, MAX_LIST,
};

pub type Errno = i32;

/// The hidden read-only file in the root that shows live statistics.
pub const STATS_NAME: &str = ".rfs-stats";
pub const STATS_INO: u64 = u64::MAX - 1;
/// Chunks allocated ahead for a file that grows past its first chunk (sequential writers).
const ALLOC_AHEAD: u64 = 16;
const CHUNK_CACHE: usize = 1 << 16;

pub type ReadDone = Box<dyn FnOnce(Result<Vec<u8>, Errno>) + Send>;
pub type WriteDone = Box<dyn FnOnce(Result<u32, Errno>) + Send>;

/// What this client knows of a file it has open.
#[derive(Default)]
struct OpenFile {
    handles: u32,
    /// The size including our uncommitted writes.
    size: u64,
    /// Writes not yet committed to the metadata node.
    dirty: bool,
    mtime: Option<Timestamp>,
}

#[derive(Default)]
pub struct ClientStats {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    metadata_ops: AtomicU64,
    io_errors: AtomicU64,
}

pub struct Rfs {
    client: Client,
    chunk_size: u64,
    chunks: Mutex<LruCache<(u64, u64), ChunkRef>>,
    open: Mutex<HashMap<u64, OpenFile>>,
    handles: Mutex<HashMap<u64, u64>>,
    next_fh: AtomicU64,
    stats: Arc<ClientStats>,
}

/// A piece of a file range that lies in one chunk.
struct Segment {
    index: u64,
    offset_in_chunk: u64,
    len: usize,
    /// Where the piece starts in the caller's buffer.
    at: usize,
}

fn segments(offset: u64, len: usize, chunk: u64) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut pos = offset;
    let end = offset + len as u64;
    while pos < end {
        let index = pos / chunk;
        let in_chunk = pos % chunk;
        let n = (chunk - in_chunk).min(end - pos);
        out.push(Segment {
            index,
            offset_in_chunk: in_chunk,
            len: n as usize,
            at: (pos - offset) as usize,
        });
        pos += n;
    }
    out
}

impl Rfs {
    pub fn new(client: Client) -> Result<Rfs, Errno> {
        let fs = Rfs {
            client,
            chunk_size: 1,
            chunks: Mutex::new(LruCache::new(
                NonZeroUsize::new(CHUNK_CACHE).expect("non-zero"),
            )),
            open: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            stats: Arc::default(),
        };
        let chunk_size = fs.statfs()?.chunk_size;
        if chunk_size == 0 {
            return Err(libc::EIO);
        }
        Ok(Rfs { chunk_size, ..fs })
    }

    fn call(&self, req: Request) -> Result<Reply, Errno> {
        self.stats.metadata_ops.fetch_add(1, Relaxed);
        self.client.call(&req)
    }

    fn attr_of(&self, req: Request) -> Result<Attr, Errno> {
        match self.call(req)? {
            Reply::Attr(a) => Ok(self.with_local_size(a)),
            _ => Err(libc::EIO),
        }
    }

    fn empty_of(&self, req: Request) -> Result<(), Errno> {
        match self.call(req)? {
            Reply::Empty => Ok(()),
            _ => Err(libc::EIO),
        }
    }

    /// Our uncommitted writes make a file look larger to us than to the server.
    fn with_local_size(&self, mut a: Attr) -> Attr {
        if let Some(f) = self.open.lock().unwrap().get_mut(&a.ino) {
            if f.dirty {
                a.size = f.size;
                if let Some(m) = f.mtime {
                    a.mtime = m;
                }
            } else {
                f.size = a.size;
            }
        }
        a
    }

    pub fn stats_attr(&self) -> Attr {
        let t = now();
        Attr {
            ino: STATS_INO,
            kind: FileKind::RegularFile,
            perm: 0o444,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: self.stats_text().len() as u64,
            atime: t,
            mtime: t,
            ctime: t,
        }
    }

    pub fn lookup(&self, parent: u64, name: &str) -> Result<Attr, Errno> {
        if parent == mem_server::namespace::ROOT && name == STATS_NAME {
            return Ok(self.stats_attr());
        }
        self.attr_of(Request::Lookup {
            parent,
            name: name.into(),
        })
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, Errno> {
        if ino == STATS_INO {
            return Ok(self.stats_attr());
        }
        self.attr_of(Request::GetAttr { ino })
    }

    pub fn setattr(&self, ino: u64, set: SetAttr) -> Result<Attr, Errno> {
        if ino == STATS_INO {
            return Err(libc::EACCES);
        }
        if let Some(new) = set.size {
            self.commit(ino)?;
            let old = self.getattr(ino)?.size;
            if new < old {
                self.zero_tail(ino, new, old)?;
            }
        }
        let attr = self.attr_of(Request::SetAttr { ino, set })?;
        if let Some(new) = set.size {
            if let Some(f) = self.open.lock().unwrap().get_mut(&ino) {
                f.size = new;
            }
            self.forget_chunks(ino, new.div_ceil(self.chunk_size));
        }
        Ok(attr)
    }

    /// On truncation inside a chunk, zero the rest of that chunk (up to the old size), so that
    /// growing the file again reads zeros there and not the old bytes.
    fn zero_tail(&self, ino: u64, new: u64, old: u64) -> Result<(), Errno> {
        let in_chunk = new % self.chunk_size;
        if in_chunk == 0 {
            return Ok(());
        }
        let index = new / self.chunk_size;
        let end = ((index + 1) * self.chunk_size).min(old);
        let Some(chunk) = self.chunk_refs(ino, index, 1, false)?[0] else {
            return Ok(());
        };
        let d = self.client.data(chunk.node)?;
        d.session
            .write_pending(
                Client::chunk_addr(&chunk, in_chunk),
                vec![0; (end - new) as usize],
            )
            .wait()
            .map(|_| ())
            .map_err(|_| libc::EIO)
    }

    pub fn mknod(
        &self,
        parent: u64,
        name: &str,
        kind: FileKind,
        rdev: u32,
        owner: Owner,
    ) -> Result<Attr, Errno> {
        let Owner { perm, uid, gid } = owner;
        self.attr_of(Request::Mknod {
            parent,
            name: name.into(),
            kind,
            perm,
            uid,
            gid,
            rdev,
        })
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &str,
        perm: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, Errno> {
        self.attr_of(Request::Mkdir {
            parent,
            name: name.into(),
            perm,
            uid,
            gid,
        })
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &str,
        target: &str,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, Errno> {
        self.attr_of(Request::Symlink {
            parent,
            name: name.into(),
            target: target.into(),
            uid,
            gid,
        })
    }

    pub fn readlink(&self, ino: u64) -> Result<String, Errno> {
        match self.call(Request::Readlink { ino })? {
            Reply::Target(t) => Ok(t),
            _ => Err(libc::EIO),
        }
    }

    pub fn link(&self, ino: u64, newparent: u64, newname: &str) -> Result<Attr, Errno> {
        self.attr_of(Request::Link {
            ino,
            newparent,
            newname: newname.into(),
        })
    }

    pub fn unlink(&self, parent: u64, name: &str) -> Result<(), Errno> {
        self.empty_of(Request::Unlink {
            parent,
            name: name.into(),
        })
    }

    pub fn rmdir(&self, parent: u64, name: &str) -> Result<(), Errno> {
        self.empty_of(Request::Rmdir {
            parent,
            name: name.into(),
        })
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &str,
        newparent: u64,
        newname: &str,
        flags: u32,
    ) -> Result<(), Errno> {
        self.empty_of(Request::Rename {
            parent,
            name: name.into(),
            newparent,
            newname: newname.into(),
            flags,
        })
    }

    /// One page of a directory after `cookie`: (cookie, name, attributes).
    pub fn readdir(&self, ino: u64, cookie: u64) -> Result<Vec<(u64, String, Attr)>, Errno> {
        match self.call(Request::ReadDir {
            ino,
            cookie,
            max: MAX_LIST,
        })? {
            Reply::Entries(e) => Ok(e),
            _ => Err(libc::EIO),
        }
    }

    pub fn statfs(&self) -> Result<StatFs, Errno> {
        match self.call(Request::StatFs)? {
            Reply::StatFs(s) => Ok(s),
            _ => Err(libc::EIO),
        }
    }

    /// Opens a file: fresh attributes and chunk map (close-to-open), and a handle.
    pub fn open(&self, ino: u64) -> Result<(u64, Attr), Errno> {
        if ino == STATS_INO {
            return Ok((0, self.stats_attr()));
        }
        let attr = match self.call(Request::Open { ino })? {
            Reply::Attr(a) => a,
            _ => return Err(libc::EIO),
        };
        if attr.kind == FileKind::RegularFile {
            self.forget_chunks(ino, 0);
        }
        let fh = self.next_fh.fetch_add(1, Relaxed);
        self.handles.lock().unwrap().insert(fh, ino);
        let mut open = self.open.lock().unwrap();
        let f = open.entry(ino).or_default();
        f.handles += 1;
        if !f.dirty {
            f.size = attr.size;
        }
        drop(open);
        Ok((fh, self.with_local_size(attr)))
    }

    /// Commits our size and mtime of `ino` to the metadata node, if we changed them.
    pub fn commit(&self, ino: u64) -> Result<(), Errno> {
        let (size, mtime) = {
            let mut open = self.open.lock().unwrap();
            match open.get_mut(&ino) {
                Some(f) if f.dirty => {
                    f.dirty = false;
                    (f.size, f.mtime)
                }
                _ => return Ok(()),
            }
        };
        match self.call(Request::Commit { ino, size, mtime }) {
            Ok(_) => Ok(()),
            Err(e) => {
                if let Some(f) = self.open.lock().unwrap().get_mut(&ino) {
                    f.dirty = true;
                }
                Err(e)
            }
        }
    }

    pub fn release(&self, fh: u64) -> Result<(), Errno> {
        let Some(ino) = self.handles.lock().unwrap().remove(&fh) else {
            return Ok(()); // the stats file, or an unknown handle
        };
        let committed = self.commit(ino);
        {
            let mut open = self.open.lock().unwrap();
            if let Some(f) = open.get_mut(&ino) {
                f.handles -= 1;
                if f.handles == 0 && !f.dirty {
                    open.remove(&ino);
                }
            }
        }
        let released = self.empty_of(Request::Release { ino });
        committed.and(released)
    }

    fn forget_chunks(&self, ino: u64, from: u64) {
        let mut cache = self.chunks.lock().unwrap();
        let stale: Vec<_> = cache
            .iter()
            .filter(|((i, idx), _)| *i == ino && *idx >= from)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            cache.pop(&k);
        }
    }

    /// The chunks `first..first+count` of `ino` (None: a hole). With `allocate`, holes are
    /// filled by the metadata node first.
    fn chunk_refs(
        &self,
        ino: u64,
        first: u64,
        count: u64,
        allocate: bool,
    ) -> Result<Vec<Option<ChunkRef>>, Errno> {
        let mut out: Vec<Option<ChunkRef>> = {
            let mut cache = self.chunks.lock().unwrap();
            (first..first + count)
                .map(|i| cache.get(&(ino, i)).copied())
                .collect()
        };
        let Some(lo) = out.iter().position(Option::is_none) else {
            return Ok(out);
        };
        let hi = out
            .iter()
            .rposition(Option::is_none)
            .expect("one is missing");
        let start = first + lo as u64;
        let needed = (hi - lo + 1) as u64;
        let mut got = Err(libc::ENOSPC);
        if allocate && start >= 1 && needed < ALLOC_AHEAD {
            // A file growing past its first chunk: reserve a run ahead of the writer, unless
            // space is too short for that; then take only what this write needs.
            got = self.fetch_chunks(ino, start, ALLOC_AHEAD, true);
        }
        if got == Err(libc::ENOSPC) {
            got = self.fetch_chunks(ino, start, needed, allocate);
        }
        for (i, c) in got? {
            if (first..first + count).contains(&i) {
                out[(i - first) as usize] = Some(c);
            }
        }
        if allocate && out.iter().any(Option::is_none) {
            return Err(libc::EIO);
        }
        Ok(out)
    }

    /// Chunks `start..start+want` from the metadata node (allocated first if asked), cached.
    fn fetch_chunks(
        &self,
        ino: u64,
        mut start: u64,
        mut want: u64,
        allocate: bool,
    ) -> Result<Vec<(u64, ChunkRef)>, Errno> {
        let mut all = Vec::new();
        while want > 0 {
            let n = want.min(MAX_LIST as u64) as u32;
            let req = if allocate {
                Request::Allocate {
                    ino,
                    first: start,
                    count: n,
                }
            } else {
                Request::ChunkMap {
                    ino,
                    first: start,
                    count: n,
                }
            };
            let got = match self.call(req)? {
                Reply::Chunks(c) => c,
                _ => return Err(libc::EIO),
            };
            let mut cache = self.chunks.lock().unwrap();
            for &(i, c) in &got {
                cache.put((ino, i), c);
            }
            all.extend(got);
            start += n as u64;
            want -= n as u64;
        }
        Ok(all)
    }

    fn size_for_read(&self, ino: u64) -> Result<u64, Errno> {
        if let Some(f) = self.open.lock().unwrap().get(&ino) {
            return Ok(f.size);
        }
        Ok(self.getattr(ino)?.size)
    }

    /// Reads up to `len` bytes at `offset`; `done` gets them (short at end of file).
    pub fn read(&self, ino: u64, offset: u64, len: usize, done: ReadDone) {
        if ino == STATS_INO {
            let text = self.stats_text().into_bytes();
            let start = (offset as usize).min(text.len());
            let end = (start + len).min(text.len());
            return done(Ok(text[start..end].to_vec()));
        }
        let size = match self.size_for_read(ino) {
            Ok(s) => s,
            Err(e) => return done(Err(e)),
        };
        let len = (size.saturating_sub(offset)).min(len as u64) as usize;
        if len == 0 {
            return done(Ok(Vec::new()));
        }
        self.stats.reads.fetch_add(1, Relaxed);
        let segs = segments(offset, len, self.chunk_size);
        let first = segs[0].index;
        let refs = match self.chunk_refs(ino, first, segs.len() as u64, false) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        let stats_bytes = len as u64;
        // One segment in one chunk (the common case): hand the session's buffer straight back.
        if segs.len() == 1 {
            let s = &segs[0];
            return match refs[0] {
                None => done(Ok(vec![0; len])),
                Some(c) => match self.client.data(c.node) {
                    Ok(d) => {
                        let stats = self.stats.clone();
                        self.stats.bytes_read.fetch_add(stats_bytes, Relaxed);
                        d.session.read(
                            Client::chunk_addr(&c, s.offset_in_chunk),
                            vec![0; len],
                            Box::new(move |r| {
                                done(r.map_err(|e| {
                                    log::warn!("read failed: {e}");
                                    stats.io_errors.fetch_add(1, Relaxed);
                                    libc::EIO
                                }))
                            }),
                        );
                    }
                    Err(e) => done(Err(e)),
                },
            };
        }
        let buf = Arc::new(Mutex::new(vec![0u8; len]));
        let job = {
            let buf = buf.clone();
            Pieces::new(
                segs.len(),
                Box::new(move |ok| {
                    done(if ok {
                        Ok(std::mem::take(&mut *buf.lock().unwrap()))
                    } else {
                        Err(libc::EIO)
                    })
                }),
            )
        };
        self.stats.bytes_read.fetch_add(stats_bytes, Relaxed);
        for (s, r) in segs.iter().zip(refs) {
            let Some(c) = r else {
                job.part_done(); // a hole: zeros already
                continue;
            };
            let d = match self.client.data(c.node) {
                Ok(d) => d,
                Err(_) => {
                    job.fail();
                    job.part_done();
                    continue;
                }
            };
            let (job2, buf, at, stats) = (job.clone(), buf.clone(), s.at, self.stats.clone());
            d.session.read(
                Client::chunk_addr(&c, s.offset_in_chunk),
                vec![0; s.len],
                Box::new(move |r| {
                    match r {
                        Ok(data) => buf.lock().unwrap()[at..at + data.len()].copy_from_slice(&data),
                        Err(e) => {
                            log::warn!("read failed: {e}");
                            stats.io_errors.fetch_add(1, Relaxed);
                            job2.fail();
                        }
                    }
                    job2.part_done();
                }),
            );
        }
    }

    /// Writes `data` at `offset`; `done` gets the byte count once every piece is in remote
    /// memory.
    pub fn write(self: &Arc<Self>, ino: u64, offset: u64, data: &[u8], done: WriteDone) {
        if ino == STATS_INO {
            return done(Err(libc::EACCES));
        }
        if data.is_empty() {
            return done(Ok(0));
        }
        self.stats.writes.fetch_add(1, Relaxed);
        let segs = segments(offset, data.len(), self.chunk_size);
        let refs = match self.chunk_refs(ino, segs[0].index, segs.len() as u64, true) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        let len = data.len();
        let job = {
            let fs = self.clone();
            let (end, len) = (offset + len as u64, len as u32);
            Pieces::new(
                segs.len(),
                Box::new(move |ok| {
                    if ok {
                        fs.wrote(ino, end, len);
                        done(Ok(len));
                    } else {
                        done(Err(libc::EIO));
                    }
                }),
            )
        };
        for (s, r) in segs.iter().zip(refs) {
            let c = r.expect("allocated above");
            let d = match self.client.data(c.node) {
                Ok(d) => d,
                Err(_) => {
                    job.fail();
                    job.part_done();
                    continue;
                }
            };
            let (job2, stats) = (job.clone(), self.stats.clone());
            d.session.write(
                Client::chunk_addr(&c, s.offset_in_chunk),
                data[s.at..s.at + s.len].to_vec(),
                Box::new(move |r| {
                    if let Err(e) = r {
                        log::warn!("write failed: {e}");
                        stats.io_errors.fetch_add(1, Relaxed);
                        job2.fail();
                    }
                    job2.part_done();
                }),
            );
        }
    }

    fn wrote(&self, ino: u64, end: u64, len: u32) {
        self.stats.bytes_written.fetch_add(len as u64, Relaxed);
        let mut open = self.open.lock().unwrap();
        let f = open.entry(ino).or_default();
        f.size = f.size.max(end);
        f.dirty = true;
        f.mtime = Some(now());
    }

    /// The live statistics: rdmabox counters and client figures, `name value` per line.
    pub fn stats_text(&self) -> String {
        let s = &self.stats;
        let open_files = self.open.lock().unwrap().len();
        format!(
            "transport {}\nreads {}\nwrites {}\nfile_bytes_read {}\nfile_bytes_written {}\nmetadata_ops {}\nio_errors {}\nopen_files {}\ncached_chunks {}\nchunk_size {}\n{}",
            self.client.transport(),
            s.reads.load(Relaxed),
            s.writes.load(Relaxed),
            s.bytes_read.load(Relaxed),
            s.bytes_written.load(Relaxed),
            s.metadata_ops.load(Relaxed),
            s.io_errors.load(Relaxed),
            open_files,
            self.chunks.lock().unwrap().len(),
            self.chunk_size,
            self.client.counters(),
        )
    }
}

/// What a split request does once all its pieces are done: `true` if none failed.
type Finish = Box<dyn FnOnce(bool) + Send>;

/// A read or write split over several chunks: `finish(ok)` runs once, when the last piece is
/// done, `ok` unless a piece failed.
struct Pieces {
    left: AtomicUsize,
    failed: AtomicBool,
    finish: Mutex<Option<Finish>>,
}

impl Pieces {
    fn new(n: usize, finish: Finish) -> Arc<Pieces> {
        Arc::new(Pieces {
            left: AtomicUsize::new(n),
            failed: AtomicBool::new(false),
            finish: Mutex::new(Some(finish)),
        })
    }

    fn fail(&self) {
        self.failed.store(true, Relaxed);
    }

    fn part_done(&self) {
        if self.left.fetch_sub(1, Relaxed) != 1 {
            return;
        }
        let finish = self.finish.lock().unwrap().take().expect("finished once");
        finish(!self.failed.load(Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::segments;

    #[test]
    fn ranges_split_at_chunk_boundaries() {
        let s = segments(1000, 3000, 1024);
        let v: Vec<_> = s
            .iter()
            .map(|s| (s.index, s.offset_in_chunk, s.len, s.at))
            .collect();
        assert_eq!(
            v,
            [
                (0, 1000, 24, 0),
                (1, 0, 1024, 24),
                (2, 0, 1024, 1048),
                (3, 0, 928, 2072)
            ]
        );
        assert_eq!(segments(2048, 1024, 1024).len(), 1);
        assert!(segments(5, 0, 1024).is_empty());
    }
}
