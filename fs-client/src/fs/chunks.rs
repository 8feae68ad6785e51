//! The chunk cache: where each chunk of each file lives, fetched from the metadata node and then
//! used for one-sided I/O. Writers past a file's first chunk allocate ahead, so that a
//! sequential writer asks for chunks once per run, not once per write.
//!
//! References are the metadata node's to take back. A recall (a callback after a truncate,
//! unlink or trim elsewhere) drops them and is answered only once every transfer that took
//! them has completed: each transfer holds an [`InFlight`] from the moment it reads its
//! references (under the cache lock) until its completion. A fetch that a recall overtook is
//! not cached (a per-file generation tells), and a reference older than the lease's share is
//! refetched before use: a client that missed a recall (stopped past the lease) never writes
//! through it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfs_daemon::backoff::Backoff;
use rfs_proto::message::{Allocate, ChunkMap};
use rfs_proto::types::{FileMap, Ino, Replicas};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::{CallError, Errno, MetadataChannel};

use super::error::{Error, Result};

/// Chunks allocated ahead for a file that grows past its first chunk (sequential writers).
const ALLOC_AHEAD: u64 = 16;
/// Chunks whose map a read asks for at once, from the first it needs: readers go on to the
/// next chunks, and one call for 64 costs the metadata node little more than one for one (a
/// 1 GiB sequential read made 1,800 calls, one per chunk and some twice, racing).
const MAP_AHEAD: u64 = 64;
/// Chunk references kept.
const CAPACITY: usize = 1 << 16;
/// How long a map fetch waits for a file whose chunks are being copied to new replicas.
const FROZEN_WAIT: Duration = Duration::from_secs(30);

struct Cached {
    replicas: Replicas,
    /// When the fetch that brought it was sent.
    fetched: Instant,
}

/// What the cache knows of one file.
#[derive(Default)]
struct FileChunks {
    chunks: BTreeMap<u64, Cached>,
    /// Bumped by every recall: a fetch sent before it may carry what the recall took back.
    gen: u64,
    /// Transfers using this file's references, by the generation they took them in.
    in_flight: Vec<(u64, usize)>,
    /// Fetches under way (the file's generation must outlive them).
    fetching: usize,
    /// The most cuts of the file a fetch was told of.
    cuts: u64,
}

impl FileChunks {
    fn idle(&self) -> bool {
        self.chunks.is_empty() && self.in_flight.is_empty() && self.fetching == 0
    }
}

#[derive(Default)]
struct Files {
    files: HashMap<Ino, FileChunks>,
    entries: usize,
    /// Recalls waiting for transfers to finish: only then does a finishing transfer wake
    /// anyone (a wake-up is a system call, and every transfer finishes).
    recalls_waiting: usize,
}

impl Files {
    fn prune(&mut self, ino: Ino) {
        if self.files.get(&ino).is_some_and(FileChunks::idle) {
            self.files.remove(&ino);
        }
    }

    /// Drops `ino`'s references from chunk `from` on and starts a new generation; the old one's
    /// number.
    fn drop_from(&mut self, ino: Ino, from: u64) -> Option<u64> {
        let f = self.files.get_mut(&ino)?;
        let dropped = f.chunks.split_off(&from).len();
        self.entries -= dropped;
        f.gen += 1;
        Some(f.gen - 1)
    }

    /// Keeps the cache within its capacity by forgetting whole files no transfer is using.
    fn shrink(&mut self) {
        if self.entries <= CAPACITY {
            return;
        }
        let mut freed = 0;
        for f in self.files.values_mut() {
            if f.in_flight.is_empty() {
                freed += f.chunks.len();
                f.chunks.clear();
            }
            if self.entries - freed <= CAPACITY / 2 {
                break;
            }
        }
        self.entries -= freed;
        self.files.retain(|_, f| !f.idle());
    }
}

pub(crate) struct ChunkCache {
    files: Mutex<Files>,
    /// Signalled when transfers finish, for recalls waiting on them.
    finished: Condvar,
    /// References older than this are refetched.
    max_age: Duration,
    chunk_size: u64,
}

/// A fetch of a file's map under way outside [`ChunkCache::refs`]: hand it to
/// [`ChunkCache::fetched`] whatever its answer.
pub(crate) struct Fetch {
    ino: Ino,
    gen: u64,
    sent: Instant,
}

/// A transfer's hold on a file's chunk references: a recall waits until it is dropped.
pub(crate) struct InFlight {
    cache: Arc<ChunkCache>,
    ino: Ino,
    gen: u64,
    /// The most cuts of the file a fetch of its map was told of, when the hold was taken.
    pub(crate) cuts_mapped: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut files = self.cache.lock();
        if let Some(f) = files.files.get_mut(&self.ino) {
            if let Some(i) = f.in_flight.iter().position(|&(g, _)| g == self.gen) {
                f.in_flight[i].1 -= 1;
                if f.in_flight[i].1 == 0 {
                    f.in_flight.swap_remove(i);
                    if files.recalls_waiting > 0 {
                        self.cache.finished.notify_all();
                    }
                }
            }
        }
        files.prune(self.ino);
    }
}

impl ChunkCache {
    /// A cache of chunks of `chunk_size` bytes whose references live at most `max_age`.
    pub(crate) fn new(max_age: Duration, chunk_size: u64) -> ChunkCache {
        ChunkCache {
            files: Mutex::default(),
            finished: Condvar::new(),
            max_age,
            chunk_size,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Files> {
        self.files.lock().unwrap()
    }

    /// References cached.
    pub(crate) fn len(&self) -> usize {
        self.lock().entries
    }

    /// Drops what we know of chunks `from..` of `ino` (close-to-open, our own truncation).
    pub(crate) fn forget(&self, ino: Ino, from: u64) {
        let mut files = self.lock();
        files.drop_from(ino, from);
        files.prune(ino);
    }

    /// The metadata node takes back `ino`'s chunks from `from` on: drop their references and
    /// wait (up to `limit`) until no transfer that took them is still running.
    pub(crate) fn recall(&self, ino: Ino, from: u64, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut files = self.lock();
        let Some(old) = files.drop_from(ino, from) else {
            return; // nothing cached, nothing in flight
        };
        let busy = |files: &Files| {
            files
                .files
                .get(&ino)
                .is_some_and(|f| f.in_flight.iter().any(|&(g, _)| g <= old))
        };
        files.recalls_waiting += 1;
        while busy(&files) {
            let now = Instant::now();
            if now >= deadline {
                log::warn!("recall of inode {ino}: transfers still running after {limit:?}");
                break;
            }
            files = self.finished.wait_timeout(files, deadline - now).unwrap().0;
        }
        files.recalls_waiting -= 1;
        files.prune(ino);
    }

    /// Drops the references to chunks on `nodes` without waiting: our data sessions there were
    /// replaced, and keys granted to the old ones would be refused on the new.
    pub(crate) fn forget_nodes(&self, nodes: &[u32]) {
        let mut files = self.lock();
        let Files {
            files: all,
            entries,
            ..
        } = &mut *files;
        for f in all.values_mut() {
            let before = f.chunks.len();
            f.chunks
                .retain(|_, c| c.replicas.iter().all(|r| !nodes.contains(&r.node)));
            *entries -= before - f.chunks.len();
            if f.chunks.len() != before || f.fetching > 0 {
                // A fetch under way may bring keys of the old sessions.
                f.gen += 1;
            }
        }
        files.files.retain(|_, f| !f.idle());
    }

    /// Drops every file's references without waiting (the metadata connection was lost:
    /// recalls sent meanwhile never came, and their chunks wait out the lease instead).
    pub(crate) fn forget_all(&self) {
        let mut files = self.lock();
        let inos: Vec<Ino> = files.files.keys().copied().collect();
        for ino in inos {
            files.drop_from(ino, 0);
            files.prune(ino);
        }
    }

    /// Starts a fetch of `ino`'s map made outside [`Self::refs`] (an open's answer brings
    /// one): the file's generation stays known until [`Self::fetched`] ends it, so that a
    /// recall meanwhile keeps its answer out.
    pub(crate) fn fetching(&self, ino: Ino) -> Fetch {
        let mut files = self.lock();
        let f = files.files.entry(ino).or_default();
        f.fetching += 1;
        Fetch {
            ino,
            gen: f.gen,
            sent: Instant::now(),
        }
    }

    /// Ends `fetch`, caching what its answer brought (`map`; none if it failed) unless a
    /// recall came since it was sent. Chunks not granted are left to be fetched when used.
    pub(crate) fn fetched(&self, fetch: Fetch, map: Option<&FileMap>) {
        let mut files = self.lock();
        let Some(f) = files.files.get_mut(&fetch.ino) else {
            return;
        };
        f.fetching -= 1;
        let current = f.gen == fetch.gen;
        let mut added = 0;
        if let Some(map) = map.filter(|_| current) {
            // As fresh as the open and fresher than any fetch sent before it was answered
            // (one with read-only keys, say): those go, and their answers with them.
            files.drop_from(fetch.ino, 0);
            let f = files
                .files
                .get_mut(&fetch.ino)
                .expect("kept while fetching");
            f.cuts = f.cuts.max(map.cuts);
            for (i, replicas) in &map.chunks {
                if replicas.is_empty() || replicas.iter().all(|r| r.rkey == 0) {
                    continue;
                }
                let cached = Cached {
                    replicas: replicas.clone(),
                    fetched: fetch.sent,
                };
                added += usize::from(f.chunks.insert(*i, cached).is_none());
            }
        }
        files.entries += added;
        files.prune(fetch.ino);
        files.shrink();
    }

    /// The chunks `first..first+count` of `ino` (None: a hole), each with every replica, and
    /// the hold that keeps a recall waiting until the transfer through them is done. With
    /// `write` (bytes of the file), the metadata node first backs those bytes with space
    /// (fills holes, grows spans that do not hold them).
    pub(crate) fn refs(
        self: &Arc<Self>,
        meta: &impl MetadataChannel,
        ino: Ino,
        first: u64,
        count: u64,
        write: Option<(u64, u64)>,
    ) -> Result<(Vec<Option<Replicas>>, InFlight)> {
        let range = first..first + count;
        let allocate = write.is_some();
        let cs = self.chunk_size;
        // Whether the copies of chunk `i` hold the bytes written there.
        let holds = |i: u64, r: &Replicas| match write {
            None => true,
            Some((from, end)) => r.first().is_some_and(|c| {
                let a = from.max(i * cs).min((i + 1) * cs) - i * cs;
                let b = end.min((i + 1) * cs).max(i * cs) - i * cs;
                a >= b || c.holds(a, b - a)
            }),
        };
        loop {
            let mut files = self.lock();
            let now = Instant::now();
            let f = files.files.entry(ino).or_default();
            let fresh = |f: &FileChunks, i: u64| {
                f.chunks
                    .get(&i)
                    .filter(|c| now.duration_since(c.fetched) < self.max_age)
                    .filter(|c| holds(i, &c.replicas))
                    .map(|c| c.replicas.clone())
            };
            let out: Vec<Option<Replicas>> = range.clone().map(|i| fresh(f, i)).collect();
            let Some(lo) = out.iter().position(Option::is_none) else {
                return Ok((out, self.hold(f, ino)));
            };
            let hi = out
                .iter()
                .rposition(Option::is_none)
                .expect("one is missing");
            let gen = f.gen;
            f.fetching += 1;
            // A writer that filled the chunk before this one reserves a run ahead.
            let start = first + lo as u64;
            let sequential = start >= 1
                && fresh(f, start - 1)
                    .is_some_and(|r| r.first().is_some_and(|c| c.lo == 0 && c.hi() == cs));
            drop(files);

            let sent = Instant::now();
            log::debug!(
                "inode {ino}: fetching chunks {}..={} (allocate: {allocate})",
                first + lo as u64,
                first + hi as u64
            );
            let needed = (hi - lo + 1) as u64;
            let bytes =
                write.map(|(from, end)| (from.max(start * cs), end.min((start + needed) * cs)));
            let got = self.fetch(meta, ino, start, needed, bytes, sequential);
            let mut files = self.lock();
            let f = files.files.get_mut(&ino).expect("kept while fetching");
            f.fetching -= 1;
            let got = match got {
                Ok(g) if g.chunks.iter().any(|(_, r)| r.is_empty()) => Err(Error::new(
                    Errno::EIO,
                    format!("the metadata node sent a chunk of inode {ino} without a replica"),
                )),
                other => other,
            };
            let got = match got {
                Ok(g) => g,
                Err(e) => {
                    files.prune(ino);
                    return Err(e);
                }
            };
            if f.gen != gen {
                continue; // a recall overtook the fetch: its answer may be stale
            }
            f.cuts = f.cuts.max(got.cuts);
            let mut out = out;
            let mut added = 0;
            for (i, replicas) in got.chunks {
                if range.contains(&i) {
                    out[(i - first) as usize] = Some(replicas.clone());
                }
                if replicas.iter().all(|r| r.rkey == 0) {
                    continue; // not granted: asked for again once granted
                }
                let fetched = sent;
                let cached = Cached { replicas, fetched };
                added += usize::from(f.chunks.insert(i, cached).is_none());
            }
            let short = out
                .iter()
                .zip(range.clone())
                .any(|(r, i)| r.as_ref().is_none_or(|r| !holds(i, r)));
            if allocate && short {
                files.entries += added;
                return Err(Error::new(
                    Errno::EIO,
                    format!(
                        "the metadata node left bytes of chunks {first}+{count} of inode {ino} \
                         without space"
                    ),
                ));
            }
            let hold = self.hold(f, ino);
            files.entries += added;
            files.shrink();
            return Ok((out, hold));
        }
    }

    fn hold(self: &Arc<Self>, f: &mut FileChunks, ino: Ino) -> InFlight {
        match f.in_flight.iter_mut().find(|(g, _)| *g == f.gen) {
            Some((_, n)) => *n += 1,
            None => f.in_flight.push((f.gen, 1)),
        }
        InFlight {
            cache: self.clone(),
            ino,
            gen: f.gen,
            cuts_mapped: f.cuts,
        }
    }

    /// Chunks `start..start+needed` from the metadata node, with `write`'s bytes backed by
    /// space first if given; a `sequential` writer (it filled the chunk before) reserves a run
    /// of whole chunks ahead, unless space is too short.
    fn fetch(
        &self,
        meta: &impl MetadataChannel,
        ino: Ino,
        start: u64,
        needed: u64,
        write: Option<(u64, u64)>,
        sequential: bool,
    ) -> Result<FileMap> {
        let cs = self.chunk_size;
        if let Some((offset, _)) = write.filter(|_| sequential && needed < ALLOC_AHEAD) {
            // Ahead of need, so asked once: a pool short of whole chunks (ENOSPC, or EAGAIN
            // while the metadata node makes some out of fragmented space) gives what is needed.
            let end = (start + ALLOC_AHEAD) * cs;
            match meta.call(Allocate { ino, offset, end }) {
                Err(CallError::Remote(Errno::ENOSPC | Errno::EAGAIN)) => {}
                r => return r.map_err(Error::from),
            }
        }
        match write {
            Some((from, end)) => Self::allocate(meta, ino, from, end, cs),
            None => Self::map(meta, ino, start, needed.max(MAP_AHEAD)),
        }
    }

    fn map(
        meta: &impl MetadataChannel,
        ino: Ino,
        mut start: u64,
        mut want: u64,
    ) -> Result<FileMap> {
        let mut all = FileMap::default();
        while want > 0 {
            let count = want.min(MAX_LIST as u64) as u32;
            let first = start;
            let page = Self::while_frozen(ino, || meta.call(ChunkMap { ino, first, count }))?;
            all.cuts = all.cuts.max(page.cuts);
            all.chunks.extend(page.chunks);
            start += count as u64;
            want -= count as u64;
        }
        Ok(all)
    }

    /// Bytes `from..end` backed by space, a page of chunks at a time.
    fn allocate(
        meta: &impl MetadataChannel,
        ino: Ino,
        mut from: u64,
        end: u64,
        cs: u64,
    ) -> Result<FileMap> {
        let mut all = FileMap::default();
        while from < end {
            let offset = from;
            let upto = end.min((offset / cs + MAX_LIST as u64) * cs);
            let page = Self::while_frozen(ino, || {
                meta.call(Allocate {
                    ino,
                    offset,
                    end: upto,
                })
            })?;
            all.cuts = all.cuts.max(page.cuts);
            all.chunks.extend(page.chunks);
            from = upto;
        }
        Ok(all)
    }

    /// Asks again while the metadata node answers EAGAIN: the file's chunks are being copied
    /// to new replicas (milliseconds, or a lease if a holder of its map is silent).
    pub(super) fn while_frozen<T>(
        ino: Ino,
        mut call: impl FnMut() -> Result<T, CallError>,
    ) -> Result<T> {
        let give_up = Instant::now() + FROZEN_WAIT;
        let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
        loop {
            match call() {
                Err(CallError::Remote(Errno::EAGAIN)) if Instant::now() < give_up => {
                    std::thread::sleep(backoff.next_pause());
                }
                Err(CallError::Remote(Errno::EAGAIN)) => {
                    return Err(Error::new(
                        Errno::EIO,
                        format!("the chunks of inode {ino} stayed frozen for {FROZEN_WAIT:?}"),
                    ))
                }
                r => return r.map_err(Error::from),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::types::ChunkRef;
    use std::io;

    /// A metadata node whose files have [`FILE_CHUNKS`] chunks, at addresses 1000 + index,
    /// and which can run something while a fetch is "on the wire".
    struct Maps(Mutex<Option<Box<dyn FnOnce() + Send>>>);

    const FILE_CHUNKS: u64 = 4;
    const CHUNK: u64 = 1 << 20;

    impl MetadataChannel for Maps {
        fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>> {
            use rfs_proto::message::{encode_reply, Request};
            if let Some(meanwhile) = self.0.lock().unwrap().take() {
                meanwhile();
            }
            let (op, first, end) = match Request::decode(request).unwrap() {
                Request::ChunkMap(m) => {
                    (m_op(&m), m.first, FILE_CHUNKS.min(m.first + m.count as u64))
                }
                Request::Allocate(m) => (m_op(&m), m.offset / CHUNK, m.end.div_ceil(CHUNK)),
                _ => unreachable!(),
            };
            let chunks = (first..end).map(|i| (i, vec![chunk(i)])).collect();
            Ok(encode_reply(op, &Ok(FileMap { cuts: 0, chunks })))
        }
    }

    fn m_op<C: rfs_proto::message::Call>(_: &C) -> u8 {
        C::OP as u8
    }

    /// Chunk `i` of every file: on node 0 or 1 by its parity.
    fn chunk(i: u64) -> ChunkRef {
        ChunkRef {
            node: (i % 2) as u32,
            addr: 1000 + i,
            rkey: 1,
            lo: 0,
            len: CHUNK as u32,
        }
    }

    fn cache() -> Arc<ChunkCache> {
        Arc::new(ChunkCache::new(Duration::from_secs(60), CHUNK))
    }

    #[test]
    fn a_recall_waits_for_the_transfers_that_took_the_references() {
        let c = cache();
        let meta = Maps(Mutex::default());
        let (refs, hold) = c.refs(&meta, 1, 0, 4, None).unwrap();
        assert_eq!(refs[3], Some(vec![chunk(3)]));
        let recalled = {
            let c = c.clone();
            std::thread::spawn(move || {
                c.recall(1, 2, Duration::from_secs(5));
                Instant::now()
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            !recalled.is_finished(),
            "answered with a transfer in flight"
        );
        let released = Instant::now();
        drop(hold);
        let answered = recalled.join().unwrap();
        assert!(answered >= released, "answered before the transfer ended");
        assert_eq!(c.len(), 2, "chunks 2 and 3 dropped, 0 and 1 kept");
        // Nothing in flight: a recall is answered at once.
        drop(c.refs(&meta, 1, 0, 1, None).unwrap());
        let start = Instant::now();
        c.recall(1, 0, Duration::from_secs(5));
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(c.len(), 0);
    }

    /// An open's answer is cached and serves reads without a call; a fetch sent before it
    /// was answered (one with read-only keys) and answered after it does not replace it; and
    /// one overtaken by a recall is not cached at all.
    #[test]
    fn an_opens_map_is_kept_over_older_fetches_and_dropped_by_a_recall() {
        let c = cache();
        let map = |rkey| FileMap {
            cuts: 0,
            chunks: vec![(0, vec![ChunkRef { rkey, ..chunk(0) }])],
        };
        let older = c.fetching(1);
        let open = c.fetching(1);
        c.fetched(open, Some(&map(7)));
        c.fetched(older, Some(&map(5)));
        let answered = Maps(Mutex::new(Some(Box::new(|| {
            panic!("a call for a cached map")
        }))));
        let (refs, hold) = c.refs(&answered, 1, 0, 1, None).unwrap();
        assert_eq!(refs[0].as_ref().unwrap()[0].rkey, 7, "the open's keys");
        drop(hold);
        let open = c.fetching(1);
        c.recall(1, 0, Duration::from_secs(1));
        c.fetched(open, Some(&map(9)));
        assert_eq!(c.len(), 0, "overtaken by a recall: not cached");
        let failed = c.fetching(1);
        c.fetched(failed, None);
        assert!(c.lock().files.is_empty(), "nothing left behind");
    }

    #[test]
    fn a_fetch_overtaken_by_a_recall_is_not_cached() {
        let c = cache();
        let meta = Maps(Mutex::default());
        drop(c.refs(&meta, 1, 0, 1, None).unwrap());
        c.recall(1, 2, Duration::from_secs(1));
        // The next fetch (of chunk 2) is overtaken by a recall of everything.
        let c2 = c.clone();
        *meta.0.lock().unwrap() = Some(Box::new(move || {
            c2.recall(1, 0, Duration::from_secs(1));
        }));
        let (refs, _hold) = c.refs(&meta, 1, 0, 3, None).unwrap();
        assert_eq!(
            refs,
            vec![
                Some(vec![chunk(0)]),
                Some(vec![chunk(1)]),
                Some(vec![chunk(2)])
            ]
        );
        assert!(
            meta.0.lock().unwrap().is_none(),
            "fetched again after the recall"
        );
    }

    #[test]
    fn a_read_maps_the_chunks_ahead_of_it_and_an_allocation_only_its_own() {
        let c = cache();
        let meta = Maps(Mutex::default());
        let fetched = Arc::new(Mutex::new(0));
        let counting = |meta: &Maps| {
            let f = fetched.clone();
            *meta.0.lock().unwrap() = Some(Box::new(move || *f.lock().unwrap() += 1));
        };
        counting(&meta);
        drop(c.refs(&meta, 1, 0, 1, None).unwrap());
        assert_eq!(c.len(), FILE_CHUNKS as usize, "the whole (short) file");
        counting(&meta);
        let (refs, _) = c.refs(&meta, 1, 1, 3, None).unwrap();
        assert_eq!(refs[2], Some(vec![chunk(3)]));
        assert_eq!(
            *fetched.lock().unwrap(),
            1,
            "the next chunks: from the cache"
        );
        drop(c.refs(&meta, 2, 0, 1, Some((0, 10))).unwrap());
        assert_eq!(c.len(), FILE_CHUNKS as usize + 1);
    }

    #[test]
    fn references_older_than_the_lease_share_are_refetched() {
        let c = Arc::new(ChunkCache::new(Duration::from_millis(50), CHUNK));
        let meta = Maps(Mutex::default());
        drop(c.refs(&meta, 1, 0, 1, None).unwrap());
        let fetched_again = Arc::new(Mutex::new(false));
        let f = fetched_again.clone();
        *meta.0.lock().unwrap() = Some(Box::new(move || *f.lock().unwrap() = true));
        drop(c.refs(&meta, 1, 0, 1, None).unwrap());
        assert!(!*fetched_again.lock().unwrap(), "fresh: from the cache");
        std::thread::sleep(Duration::from_millis(80));
        drop(c.refs(&meta, 1, 0, 1, None).unwrap());
        assert!(*fetched_again.lock().unwrap(), "expired: refetched");
    }

    #[test]
    fn a_replaced_session_forgets_only_its_own_nodes_keys() {
        let c = cache();
        let meta = Maps(Mutex::default());
        drop(c.refs(&meta, 1, 0, 4, None).unwrap());
        drop(c.refs(&meta, 2, 0, 2, None).unwrap());
        assert_eq!(c.len(), 8, "both files' maps, whole");
        c.forget_nodes(&[1]);
        assert_eq!(c.len(), 4, "the even chunks stay");
        let fetched = Arc::new(Mutex::new(false));
        let f = fetched.clone();
        *meta.0.lock().unwrap() = Some(Box::new(move || *f.lock().unwrap() = true));
        drop(c.refs(&meta, 1, 2, 1, None).unwrap());
        assert!(!*fetched.lock().unwrap(), "node 0's key: from the cache");
        drop(c.refs(&meta, 1, 3, 1, None).unwrap());
        assert!(*fetched.lock().unwrap(), "node 1's key: fetched again");
    }
}
