//! The data path: a read or write is split at chunk boundaries, each piece goes one-sidedly to
//! the chunk's data node through the backend, and the caller is answered once every piece is
//! done (from the completion path of the last one), with the first failure if any: the FUSE
//! adapter logs it, once.
//!
//! A piece a data node refused for a stale reference (the node took back its grants because
//! the metadata node that made them restarted, or our session there broke) is sent again with
//! a fresh chunk map, within the retry window: an outage of the metadata node delays I/O
//! instead of failing it. A write keeps its bytes for that in the transfer's own buffer, which
//! comes back either way.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfs_proto::message::DropReplicas;
use rfs_proto::types::{ChunkRef, Ino, Replicas};
use rfs_proto::Errno;

use super::backend::{Backend, DataDone};
use super::chunks::InFlight;
use super::error::{Error, Result};
use super::space::SPACE_WAIT;
use super::stats::{ClientStats, STATS_INO};
use super::Rfs;

/// Receives the bytes of a read (short at end of file).
pub type ReadDone = Box<dyn FnOnce(Result<&[u8]>) + Send>;
/// Receives the byte count of a write.
pub type WriteDone = Box<dyn FnOnce(Result<u32>) + Send>;

/// The first pause before a transfer is sent again; it doubles, up to [`MAX_RETRY_PAUSE`].
const RETRY_PAUSE: Duration = Duration::from_millis(20);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Which try of a transfer this is, and until when another may be made.
#[derive(Clone, Copy)]
struct Attempt {
    pause: Duration,
    deadline: Instant,
}

impl Attempt {
    fn first(window: Duration) -> Attempt {
        Attempt {
            pause: RETRY_PAUSE,
            deadline: Instant::now() + window,
        }
    }

    /// The next try and the pause before it, if it fits in the window.
    fn next(self) -> Option<(Attempt, Duration)> {
        (Instant::now() + self.pause < self.deadline).then(|| {
            let next = Attempt {
                pause: (self.pause * 2).min(MAX_RETRY_PAUSE),
                ..self
            };
            (next, self.pause)
        })
    }
}

/// Runs `work` on a thread of its own: it makes metadata calls, which the completion path (a
/// poller thread) must not wait on. Where no thread can be had, it runs here.
fn off_the_completion_path(name: &str, work: impl FnOnce() + Send + 'static) {
    let work = Arc::new(Mutex::new(Some(work)));
    let theirs = work.clone();
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let taken = theirs.lock().unwrap().take();
            if let Some(w) = taken {
                w()
            }
        });
    if let Err(e) = spawned {
        log::warn!("no thread for {name} ({e}): running it on the completion path");
        let taken = work.lock().unwrap().take();
        if let Some(w) = taken {
            w()
        }
    }
}

/// A piece of a file range that lies in one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

impl<B: Backend> Rfs<B> {
    /// The replicas of chunks `first..first+count` of `ino`, held, with a data session to
    /// each node they are on, granted to it: connecting may take metadata calls, which must
    /// not happen while the references are held (a recall of them may be what the metadata
    /// node is busy with). A replica not granted (key 0) means our data session there is not
    /// attached to our metadata session (first use, or the metadata node lost the session):
    /// attach, and ask again. A write needs every replica, a read one per chunk. Nodes that
    /// failed moments ago are not dialled: transfers there fail at once (a read then tries
    /// another replica, a write drops it).
    pub(super) fn refs(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
        allocate: bool,
    ) -> Result<(Vec<Option<Replicas>>, InFlight)> {
        if allocate {
            self.allocating(ino);
        }
        for attempt in 0.. {
            let (refs, hold) = self.chunk_refs(ino, first, count, allocate)?;
            let usable = |c: &ChunkRef| c.rkey != 0 && self.backend.is_connected(c.node);
            let mut disconnected = Vec::new();
            let mut ungranted = Vec::new();
            for replicas in refs.iter().flatten() {
                // A read needs one usable replica, a write all (one it cannot use is dropped
                // from the map, so first use connects, and a session the metadata node does
                // not know, after its restart, is attached again); a read asks again for a
                // replica not granted on a session we have only if there is no other.
                let any_usable = replicas.iter().any(usable);
                for c in replicas.iter().filter(|c| !self.backend.is_down(c.node)) {
                    if !self.backend.is_connected(c.node) && (allocate || !any_usable) {
                        disconnected.push(c.node);
                    } else if c.rkey == 0 && (allocate || !any_usable) {
                        ungranted.push(c.node);
                    }
                }
            }
            // A chunk whose every replica is on a node that failed moments ago fails at once,
            // and the cached maps stay (fetching them again would have the metadata node
            // grant on the failed nodes).
            if let Some(node) = self.all_down(&refs) {
                return Err(Error::new(
                    Errno::EIO,
                    format!("data node {node} failed moments ago"),
                ));
            }
            if (disconnected.is_empty() && ungranted.is_empty()) || attempt == 2 {
                // What is still unusable fails in the transfer.
                return Ok((refs, hold));
            }
            drop(hold);
            if !disconnected.is_empty() {
                // Keys granted to a session that is gone would be refused on its successor:
                // forgotten before it exists, so that no transfer carries one there.
                self.chunks.forget_nodes(&disconnected);
            }
            let mut missing = [disconnected, ungranted].concat();
            missing.sort_unstable();
            missing.dedup();
            for node in missing {
                if let Err(e) = self.backend.connect(node) {
                    log::warn!("inode {ino}: {e}");
                }
            }
            if let Some(node) = self.all_down(&refs) {
                return Err(Error::new(
                    Errno::EIO,
                    format!("data node {node} cannot be reached"),
                ));
            }
        }
        unreachable!("the loop returns by its third attempt")
    }

    /// The chunk cache's references; an allocation short of space waits for the chunks our
    /// releases under way (or on their way from the kernel after a close) give back.
    fn chunk_refs(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
        allocate: bool,
    ) -> Result<(Vec<Option<Replicas>>, InFlight)> {
        if !allocate {
            return self.chunks.refs(&self.meta(), ino, first, count, false);
        }
        let mut deadline = None;
        loop {
            let seen = self.giving_back.ended();
            match self.chunks.refs(&self.meta(), ino, first, count, true) {
                Err(e) if e.errno() == Errno::ENOSPC => {
                    let until = *deadline.get_or_insert_with(|| Instant::now() + SPACE_WAIT);
                    if !self
                        .giving_back
                        .wait(seen, until, || self.others_closing(ino))
                    {
                        return Err(e);
                    }
                    ClientStats::add(&self.stats.space_retries, 1);
                }
                got => return got,
            }
        }
    }

    /// A node of a chunk among `refs` whose replicas are all on nodes that failed moments ago.
    fn all_down(&self, refs: &[Option<Replicas>]) -> Option<u32> {
        refs.iter()
            .flatten()
            .find(|r| r.iter().all(|c| self.backend.is_down(c.node)))
            .and_then(|r| r.first().map(|c| c.node))
    }

    /// Counts a failed piece.
    fn piece_failed(stats: &ClientStats) {
        ClientStats::add(&stats.io_errors, 1);
    }

    /// Reads `len` bytes at `offset` of a chunk from one of its replicas, and from the next
    /// one if that fails (an error, or the deadline): replicas take turns, so that reads
    /// spread over them; those on nodes that failed moments ago come last.
    fn read_replicas(
        self: &Arc<Self>,
        mut replicas: Replicas,
        offset: u64,
        len: usize,
        done: DataDone,
    ) {
        if let [c] = replicas[..] {
            // One copy (the common case): nothing to choose or fail over to.
            if c.rkey == 0 {
                return done(Err(not_granted(&c)));
            }
            return self.backend.read(&c, offset, len, done);
        }
        let turn = self.next_replica.fetch_add(1, Ordering::Relaxed) % replicas.len();
        replicas.rotate_left(turn);
        let chosen = replicas[0];
        // Stable: the turn order stays among equals.
        replicas.sort_by_key(|c| c.rkey == 0 || self.backend.is_down(c.node));
        if replicas[0] != chosen {
            ClientStats::add(&self.stats.failovers, 1);
        }
        self.read_from(replicas, 0, offset, len, None, done);
    }

    /// [`Self::read_replicas`] from replica `k` on; `failure` is the first one's error.
    fn read_from(
        self: &Arc<Self>,
        replicas: Replicas,
        k: usize,
        offset: u64,
        len: usize,
        failure: Option<Error>,
        done: DataDone,
    ) {
        let Some(&c) = replicas.get(k) else {
            return done(Err(failure.expect("at least one replica was tried")));
        };
        if k > 0 {
            ClientStats::add(&self.stats.failovers, 1);
        }
        if c.rkey == 0 {
            let e = not_granted(&c);
            return self.read_from(replicas, k + 1, offset, len, failure.or(Some(e)), done);
        }
        let fs = self.clone();
        self.backend.read(
            &c,
            offset,
            len,
            Box::new(move |r: Result<&[u8]>| match r {
                Ok(data) => done(Ok(data)),
                Err(e) => {
                    if k + 1 < replicas.len() {
                        log::warn!("{e}: reading another replica");
                    }
                    fs.read_from(replicas, k + 1, offset, len, failure.or(Some(e)), done)
                }
            }),
        );
    }

    /// Writes `data` at `offset` of a chunk to every replica at once; `done` gets None once
    /// each has it, the replicas it reached if some failed (those the map must drop before the
    /// write is answered: see [`Self::drop_missed`]), or an error if none got it or one refused
    /// a stale reference (the chunk is then sent again to every replica); and the bytes.
    fn write_replicas(
        self: &Arc<Self>,
        replicas: Replicas,
        offset: u64,
        data: Vec<u8>,
        done: Written,
    ) {
        if let [c] = replicas[..] {
            // One copy (the common case): its result is the write's.
            if c.rkey == 0 {
                return done(Err(not_granted(&c)), data);
            }
            return self.backend.write(
                &c,
                offset,
                data,
                Box::new(move |r, data| done(r.map(|()| None), data)),
            );
        }
        let fanout = Arc::new(Fanout {
            state: Mutex::new(FanoutState {
                left: replicas.len(),
                ..FanoutState::default()
            }),
            done: Mutex::new(Some(done)),
        });
        let mut data = Some(data);
        let count = replicas.len();
        for (k, c) in replicas.into_iter().enumerate() {
            let bytes = if k + 1 == count {
                data.take().expect("the last replica takes the buffer")
            } else {
                data.clone().expect("kept for the last replica")
            };
            if c.rkey == 0 {
                Self::replica_written(&fanout, c, Err(not_granted(&c)), bytes);
                continue;
            }
            let fanout = fanout.clone();
            self.backend.write(
                &c,
                offset,
                bytes,
                Box::new(move |r, bytes| Self::replica_written(&fanout, c, r, bytes)),
            );
        }
    }

    /// One replica of a [`Self::write_replicas`] is done; the last one answers.
    fn replica_written(fanout: &Fanout, c: ChunkRef, r: Result<()>, bytes: Vec<u8>) {
        let st = {
            let mut st = fanout.state.lock().unwrap();
            match r {
                Ok(()) => st.reached.push(c),
                Err(e) if e.is_stale() => {
                    st.stale.get_or_insert(e);
                }
                Err(e) => {
                    log::warn!("{e}");
                    st.failure.get_or_insert(e);
                }
            }
            st.bytes.get_or_insert(bytes);
            st.left -= 1;
            if st.left > 0 {
                return;
            }
            std::mem::take(&mut *st)
        };
        let done = fanout.done.lock().unwrap().take().expect("answered once");
        let bytes = st.bytes.expect("every replica gives its bytes back");
        done(
            match (st.stale, st.failure) {
                (Some(stale), _) => Err(stale),
                (None, None) => Ok(None),
                (None, Some(e)) if st.reached.is_empty() => Err(e),
                (None, Some(_)) => Ok(Some(st.reached)),
            },
            bytes,
        )
    }

    /// Has the metadata node keep, of each chunk in `missed`, only the replicas a write
    /// reached (the others may miss it), and forgets our own map of them. Called with no
    /// references held: the node tells the other holders, and waits (a little) for them.
    fn drop_missed(&self, ino: Ino, missed: Vec<(u64, Replicas)>) -> Result<()> {
        for (index, reached) in missed {
            let r = self.call(DropReplicas {
                ino,
                index,
                reached,
            });
            // Whatever the answer, our map of the chunk may list a replica without the write.
            self.chunks.forget(ino, index);
            let dropped = r.map_err(|e| {
                Error::new(
                    Errno::EIO,
                    format!("inode {ino} chunk {index}: a write missed some replicas, which could not be dropped: {e}"),
                )
            })?;
            ClientStats::add(&self.stats.replicas_dropped, dropped as u64);
        }
        Ok(())
    }

    /// Reads up to `len` bytes at `offset`; `done` gets them (short at end of file).
    pub fn read(self: &Arc<Self>, ino: Ino, offset: u64, len: usize, done: ReadDone) {
        if ino == STATS_INO {
            return done(Ok(&self.stats_read(offset, len)));
        }
        // A read sees every write answered before it.
        self.behind.settle(ino, offset, offset + len as u64);
        let size = match self.size_for_read(ino) {
            Ok(s) => s,
            Err(e) => return done(Err(e)),
        };
        let len = (size.saturating_sub(offset)).min(len as u64) as usize;
        if len == 0 {
            return done(Ok(&[]));
        }
        ClientStats::add(&self.stats.reads, 1);
        ClientStats::add(&self.stats.bytes_read, len as u64);
        self.read_attempt(ino, offset, len, Attempt::first(self.retry_window), done);
    }

    /// One try of a read (see [`Self::read`]); a stale reference makes another, whole.
    fn read_attempt(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        len: usize,
        attempt: Attempt,
        done: ReadDone,
    ) {
        let segs = segments(offset, len, self.chunk_size);
        let (refs, hold) = match self.refs(ino, segs[0].index, segs.len() as u64, false) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        // Answers once the references are let go: a stale one sends the read again.
        let answer = {
            let (fs, from) = (self.clone(), segs[0].index);
            move |r: Result<&[u8]>| {
                drop(hold);
                match r {
                    Err(e) if e.is_stale() => {
                        let retry_fs = fs.clone();
                        fs.again(ino, from, attempt, e, move |next| match next {
                            Ok(next) => retry_fs.read_attempt(ino, offset, len, next, done),
                            Err(e) => done(Err(e)),
                        })
                    }
                    Err(e) => {
                        Self::piece_failed(&fs.stats);
                        done(Err(e))
                    }
                    Ok(data) => done(Ok(data)),
                }
            }
        };
        // One segment in one chunk (the common case): hand the transfer's buffer straight back.
        if let [s] = segs.as_slice() {
            let Some(replicas) = refs.into_iter().next().flatten() else {
                return answer(Ok(&vec![0; len])); // a hole
            };
            return self.read_replicas(replicas, s.offset_in_chunk, len, Box::new(answer));
        }
        // Pieces that all have a copy on one node (the common case: a read crossing a chunk
        // boundary): gathered where they land, and answered from there. Should that fail, a
        // replicated file's pieces are read again each from its own copies (which report a
        // stale reference themselves, if every copy of a piece had one).
        if let Some(chunks) = self.copies_on_one_node(&refs) {
            let pieces: Vec<_> = segs
                .iter()
                .zip(chunks)
                .map(|(s, c)| (c, s.offset_in_chunk, s.len))
                .collect();
            let replicated = refs.iter().flatten().any(|r| r.len() > 1);
            let fs = self.clone();
            return self.backend.read_gathered(
                &pieces,
                Box::new(move |r: Result<&[u8]>| match r {
                    Err(e) if replicated => {
                        log::warn!("{e}: reading the other replicas");
                        ClientStats::add(&fs.stats.failovers, 1);
                        fs.read_pieces(&segs, refs, len, Box::new(answer))
                    }
                    r => answer(r),
                }),
            );
        }
        self.read_pieces(&segs, refs, len, Box::new(answer));
    }

    /// A read of several chunks, each piece from its own replicas, put together in a buffer.
    fn read_pieces(
        self: &Arc<Self>,
        segs: &[Segment],
        refs: Vec<Option<Replicas>>,
        len: usize,
        answer: DataDone,
    ) {
        let buf = Arc::new(Mutex::new(vec![0u8; len]));
        let job = {
            let buf = buf.clone();
            Pieces::new(
                segs.len(),
                Box::new(move |r| {
                    let whole = std::mem::take(&mut *buf.lock().unwrap());
                    answer(r.map(|()| &whole[..]))
                }),
            )
        };
        for (s, r) in segs.iter().zip(refs) {
            let Some(replicas) = r else {
                job.part_done(); // a hole: zeros already
                continue;
            };
            let (job, buf, at) = (job.clone(), buf.clone(), s.at);
            self.read_replicas(
                replicas,
                s.offset_in_chunk,
                s.len,
                Box::new(move |r: Result<&[u8]>| {
                    match r {
                        Ok(data) => buf.lock().unwrap()[at..at + data.len()].copy_from_slice(data),
                        Err(e) => job.fail(e),
                    }
                    job.part_done();
                }),
            );
        }
    }

    /// The node to gather a read of several chunks from, as the copy of each chunk there: one
    /// that holds a granted copy of every chunk (none for a hole). Where several do, they
    /// take turns, as replicas do for single reads, among those we have a session with that
    /// did not fail moments ago (a read does not dial a node while another copy will do).
    fn copies_on_one_node(&self, refs: &[Option<Replicas>]) -> Option<Vec<ChunkRef>> {
        let candidates: Vec<u32> = refs
            .first()?
            .as_ref()?
            .iter()
            .filter(|c| c.rkey != 0)
            .map(|c| c.node)
            .collect();
        let choice = candidates.len() > 1;
        let turn = match choice {
            true => self.next_replica.fetch_add(1, Ordering::Relaxed),
            false => 0,
        };
        (0..candidates.len())
            .map(|k| candidates[(turn + k) % candidates.len()])
            .filter(|&node| {
                !choice || (self.backend.is_connected(node) && !self.backend.is_down(node))
            })
            .find_map(|node| copies_on(refs, node))
    }

    /// After a transfer of `ino` failed for a `stale` reference: once the attempt's pause is
    /// over, forgets the file's chunk map from `from` on and has `then` send it again (given
    /// the next attempt), or fail it (given `stale`) if the window is spent. Called with no
    /// references held; runs off the completion path, since fetching maps and reconnecting
    /// are metadata calls.
    fn again(
        self: &Arc<Self>,
        ino: Ino,
        from: u64,
        attempt: Attempt,
        stale: Error,
        then: impl FnOnce(Result<Attempt>) + Send + 'static,
    ) {
        let fs = self.clone();
        off_the_completion_path("rfs-retry", move || match attempt.next() {
            Some((next, pause)) => {
                log::info!("inode {ino}: {stale}; sending it again with a fresh map");
                ClientStats::add(&fs.stats.retries, 1);
                std::thread::sleep(pause);
                fs.chunks.forget(ino, from);
                then(Ok(next))
            }
            None => {
                Self::piece_failed(&fs.stats);
                then(Err(stale))
            }
        });
    }

    /// Writes `data` at `offset`; `done` gets the byte count once every piece is in remote
    /// memory, on every replica.
    pub fn write(self: &Arc<Self>, ino: Ino, offset: u64, data: &[u8], done: WriteDone) {
        self.write_answering(ino, offset, data, false, done)
    }

    /// Like [`Self::write`], but with write-behind on (see [`behind`](super::behind)), and
    /// unless `sync` (O_SYNC, O_DSYNC, O_DIRECT), `done` gets the byte count once the bytes
    /// are copied and their chunks mapped (allocated where new), before their transfers are
    /// posted: the writer copies its next bytes while this thread posts these. A failure
    /// after that is reported by the next flush or fsync of the file, and fails its next
    /// write.
    pub fn write_behind(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        data: &[u8],
        sync: bool,
        done: WriteDone,
    ) {
        let early = !sync && self.behind.enabled();
        self.write_answering(ino, offset, data, early, done)
    }

    /// A write, answered once mapped (`early`) or once landed.
    fn write_answering(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        data: &[u8],
        early: bool,
        done: WriteDone,
    ) {
        if ino == STATS_INO {
            return done(Err(Errno::EACCES.into()));
        }
        if data.is_empty() {
            return done(Ok(0));
        }
        let (end, len) = (offset + data.len() as u64, data.len() as u32);
        // In order after the writes in flight it overlaps, within the bytes in flight allowed.
        if let Err(e) = self.behind.admit(ino, offset, end) {
            return done(Err(e));
        }
        ClientStats::add(&self.stats.writes, 1);
        let pieces: Vec<_> = segments(offset, data.len(), self.chunk_size)
            .into_iter()
            .map(|s| (s, data[s.at..s.at + s.len].to_vec()))
            .collect();
        // Answered by whichever comes first: the end of the transfers (always, without
        // write-behind; with it, when mapping their chunks fails), or their mapping.
        let answer = Arc::new(Mutex::new(Some(done)));
        let finish: FinishWrite<B> = {
            let answer = answer.clone();
            Box::new(move |fs, r| {
                if r.is_err() {
                    // Before a flush waiting for this write can return.
                    fs.pages_left_stale(ino);
                }
                let unanswered = answer.lock().unwrap().take();
                let Some(done) = unanswered else {
                    return fs.behind.landed(ino, offset, r.err());
                };
                if r.is_ok() {
                    fs.wrote(ino, end, len);
                }
                fs.behind.landed(ino, offset, None);
                done(r.map(|()| len))
            })
        };
        let mapped = match self.map_pieces(ino, &pieces) {
            Ok(mapped) => mapped,
            Err(e) => return finish(self, Err(e)),
        };
        if early {
            let unanswered = answer.lock().unwrap().take();
            if let Some(done) = unanswered {
                self.wrote(ino, end, len);
                done(Ok(len));
            }
        }
        let attempt = Attempt::first(self.retry_window);
        self.post_pieces(ino, pieces, mapped, attempt, finish);
    }

    /// One try of the pieces of a write (see [`Self::write`]); those refused for a stale
    /// reference make another, with the bytes their transfers gave back.
    fn write_pieces(
        self: &Arc<Self>,
        ino: Ino,
        pieces: Vec<(Segment, Vec<u8>)>,
        attempt: Attempt,
        finish: FinishWrite<B>,
    ) {
        match self.map_pieces(ino, &pieces) {
            Ok(mapped) => self.post_pieces(ino, pieces, mapped, attempt, finish),
            Err(e) => finish(self, Err(e)),
        }
    }

    /// The references of the chunks `pieces` write to (allocated where new), held.
    fn map_pieces(&self, ino: Ino, pieces: &[(Segment, Vec<u8>)]) -> Result<Mapped> {
        // Pieces sent again come in the order their transfers failed.
        let first = pieces.iter().map(|(s, _)| s.index).min().expect("a piece");
        let last = pieces.iter().map(|(s, _)| s.index).max().expect("a piece");
        let (refs, hold) = self
            .refs(ino, first, last - first + 1, true)
            .inspect_err(|_| Self::piece_failed(&self.stats))?;
        Ok(Mapped { first, refs, hold })
    }

    /// Posts the transfers of `pieces` to the chunks `mapped` holds; `finish` answers once
    /// every piece is done.
    fn post_pieces(
        self: &Arc<Self>,
        ino: Ino,
        pieces: Vec<(Segment, Vec<u8>)>,
        mapped: Mapped,
        attempt: Attempt,
        finish: FinishWrite<B>,
    ) {
        let Mapped { first, refs, hold } = mapped;
        let job = Arc::new(WriteJob {
            state: Mutex::new(WriteState {
                left: pieces.len(),
                ..WriteState::default()
            }),
            hold: Mutex::new(Some(hold)),
            finish: Mutex::new(Some(finish)),
        });
        for (s, bytes) in pieces {
            let replicas = refs[(s.index - first) as usize]
                .clone()
                .expect("allocated above");
            let (fs, job) = (self.clone(), job.clone());
            self.write_replicas(
                replicas,
                s.offset_in_chunk,
                bytes,
                Box::new(move |r, bytes| fs.piece_written(ino, &job, s, r, bytes, attempt)),
            );
        }
    }

    /// A piece of [`Self::write_pieces`] is done; the last one answers, once the references
    /// are let go: at once if all went well, else (off the completion path) after dropping
    /// the replicas writes missed and sending the stale pieces again.
    fn piece_written(
        self: &Arc<Self>,
        ino: Ino,
        job: &WriteJob<B>,
        s: Segment,
        r: Result<Option<Replicas>>,
        bytes: Vec<u8>,
        attempt: Attempt,
    ) {
        let st = {
            let mut st = job.state.lock().unwrap();
            match r {
                Ok(None) => {}
                Ok(Some(reached)) => st.missed.push((s.index, reached)),
                Err(e) if e.is_stale() => {
                    st.again.push((s, bytes));
                    st.stale.get_or_insert(e);
                }
                Err(e) => {
                    st.failure.get_or_insert(e);
                }
            }
            st.left -= 1;
            if st.left > 0 {
                return;
            }
            std::mem::take(&mut *st)
        };
        drop(job.hold.lock().unwrap().take());
        let finish = job.finish.lock().unwrap().take().expect("answered once");
        if let Some(e) = st.failure {
            Self::piece_failed(&self.stats);
            return finish(self, Err(e));
        }
        if st.missed.is_empty() && st.again.is_empty() {
            return finish(self, Ok(()));
        }
        let fs = self.clone();
        off_the_completion_path("rfs-write-missed", move || {
            if !st.missed.is_empty() {
                if let Err(e) = fs.drop_missed(ino, st.missed) {
                    return finish(&fs, Err(e));
                }
            }
            let Some(stale) = st.stale else {
                return finish(&fs, Ok(()));
            };
            let from = st.again.iter().map(|(s, _)| s.index).min().expect("some");
            let (again, retry_fs) = (st.again, fs.clone());
            fs.again(ino, from, attempt, stale, move |next| match next {
                Ok(next) => retry_fs.write_pieces(ino, again, next, finish),
                Err(e) => finish(&retry_fs, Err(e)),
            });
        });
    }

    /// On truncation inside a chunk, zeroes the rest of that chunk (up to the old size), so
    /// that growing the file again reads zeros there and not the old bytes. Answers what it
    /// overwrote, and where, for [`Self::put_tail_back`] if the cut does not happen.
    pub(crate) fn zero_tail(
        self: &Arc<Self>,
        ino: Ino,
        new: u64,
        old: u64,
    ) -> Result<Option<(u64, Vec<u8>)>> {
        let in_chunk = new % self.chunk_size;
        if in_chunk == 0 {
            return Ok(None);
        }
        let index = new / self.chunk_size;
        let end = ((index + 1) * self.chunk_size).min(old);
        let (refs, hold) = self.refs(ino, index, 1, false)?;
        drop(hold);
        if refs[0].is_none() {
            return Ok(None); // a hole: zeros already
        }
        let tail = self.read_now(ino, new, (end - new) as usize)?;
        if let Err(e) = self.overwrite_tail(ino, new, vec![0; tail.len()]) {
            // Some copies may have the zeros.
            self.put_tail_back(ino, (new, tail));
            return Err(e);
        }
        Ok(Some((new, tail)))
    }

    /// The cut that [`Self::zero_tail`] zeroed ahead of did not happen: the bytes go back.
    pub(crate) fn put_tail_back(self: &Arc<Self>, ino: Ino, (at, bytes): (u64, Vec<u8>)) {
        if let Err(e) = self.overwrite_tail(ino, at, bytes) {
            log::error!(
                "inode {ino}: a truncate failed, and the bytes zeroed ahead of it from offset \
                 {at} could not be put back: {e}"
            );
        }
    }

    /// Writes `bytes` at `at`, within one chunk, as a change of no size or mtime of ours.
    fn overwrite_tail(self: &Arc<Self>, ino: Ino, at: u64, bytes: Vec<u8>) -> Result<()> {
        let piece = Segment {
            index: at / self.chunk_size,
            offset_in_chunk: at % self.chunk_size,
            len: bytes.len(),
            at: 0,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let attempt = Attempt::first(self.retry_window);
        let finish: FinishWrite<B> = Box::new(move |_, r| drop(tx.send(r)));
        self.write_pieces(ino, vec![(piece, bytes)], attempt, finish);
        rx.recv().unwrap_or_else(|_| {
            Err(Error::new(
                Errno::EIO,
                "overwriting a truncated tail: no answer",
            ))
        })
    }
}

/// The granted copy on `node` of every chunk, if each has one there (a hole has none).
fn copies_on(refs: &[Option<Replicas>], node: u32) -> Option<Vec<ChunkRef>> {
    refs.iter()
        .map(|r| {
            r.as_ref()?
                .iter()
                .find(|c| c.node == node && c.rkey != 0)
                .copied()
        })
        .collect()
}

/// The error of a replica our session was not granted (the metadata node does not know the
/// session yet: it restarted, or the node is coming back): worth another try.
fn not_granted(c: &ChunkRef) -> Error {
    Error::stale(c.node, "the chunk was not granted to this client")
}

/// The chunks a write's pieces go to, from the first piece's chunk on, and the hold on their
/// references (see [`Rfs::refs`]).
struct Mapped {
    first: u64,
    refs: Vec<Option<Replicas>>,
    hold: InFlight,
}

/// Answers a write (see [`Rfs::write_pieces`]).
type FinishWrite<B> = Box<dyn FnOnce(&Rfs<B>, Result<()>) + Send>;

/// Receives how a write to every replica of a chunk went (see [`Rfs::write_replicas`]), and
/// the bytes.
type Written = Box<dyn FnOnce(Result<Option<Replicas>>, Vec<u8>) + Send>;

/// One write going to every replica of a chunk, and what to do once all answered.
struct Fanout {
    state: Mutex<FanoutState>,
    done: Mutex<Option<Written>>,
}

#[derive(Default)]
struct FanoutState {
    /// Replicas still to answer.
    left: usize,
    reached: Replicas,
    failure: Option<Error>,
    stale: Option<Error>,
    /// The bytes, from whichever replica gave them back first.
    bytes: Option<Vec<u8>>,
}

/// One try of the pieces of a write: what came of them, the references they hold, and how to
/// answer.
struct WriteJob<B: Backend> {
    state: Mutex<WriteState>,
    hold: Mutex<Option<InFlight>>,
    finish: Mutex<Option<FinishWrite<B>>>,
}

#[derive(Default)]
struct WriteState {
    /// Pieces still to answer.
    left: usize,
    /// Chunks whose write missed some replicas, with those it reached.
    missed: Vec<(u64, Replicas)>,
    /// Pieces refused for a stale reference, with their bytes, and the first such refusal.
    again: Vec<(Segment, Vec<u8>)>,
    stale: Option<Error>,
    failure: Option<Error>,
}

/// What a split request does once all its pieces are done: Ok, or the first failure.
type Finish = Box<dyn FnOnce(Result<()>) + Send>;

/// A read or write split over several chunks: `finish` runs once, when the last piece is done.
struct Pieces {
    left: AtomicUsize,
    failure: Mutex<Option<Error>>,
    finish: Mutex<Option<Finish>>,
}

impl Pieces {
    fn new(n: usize, finish: Finish) -> Arc<Pieces> {
        Arc::new(Pieces {
            left: AtomicUsize::new(n),
            failure: Mutex::new(None),
            finish: Mutex::new(Some(finish)),
        })
    }

    /// Fails the request (the first failure is the one reported, unless it was a stale
    /// reference and this is not: that one decides); call before this piece's `part_done`.
    fn fail(&self, e: Error) {
        let mut failure = self.failure.lock().unwrap();
        if failure
            .as_ref()
            .is_none_or(|f| f.is_stale() && !e.is_stale())
        {
            *failure = Some(e);
        }
    }

    fn part_done(&self) {
        // Release publishes this piece's work (its bytes, its failure); the last finisher's
        // Acquire sees every other piece's, as in `Arc`'s drop.
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let finish = self.finish.lock().unwrap().take().expect("finished once");
        finish(match self.failure.lock().unwrap().take() {
            Some(e) => Err(e),
            None => Ok(()),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn pieces_sent_again_may_come_in_any_order() {
        use crate::fs::fake::{Fake, FakeCluster, CHUNK};
        use rfs_proto::types::{Caller, FileKind, Owner, ROOT};
        let cluster: Arc<FakeCluster> = Arc::default();
        let fs = Arc::new(Rfs::new(Fake(cluster.clone()), Default::default()).unwrap());
        let owner = Owner {
            perm: 0o644,
            uid: 0,
            gid: 0,
        };
        let ino = fs
            .mknod(
                ROOT,
                b"f",
                FileKind::RegularFile,
                0,
                owner,
                &Caller::default(),
            )
            .unwrap()
            .ino;
        let data: Vec<u8> = (0..3 * CHUNK as usize).map(|i| (i % 251) as u8).collect();
        // As failed transfers give them back: last chunk first.
        let pieces: Vec<(Segment, Vec<u8>)> = segments(0, data.len(), CHUNK)
            .into_iter()
            .rev()
            .map(|s| (s, data[s.at..s.at + s.len].to_vec()))
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let attempt = Attempt::first(std::time::Duration::from_secs(1));
        fs.write_pieces(
            ino,
            pieces,
            attempt,
            Box::new(move |_, r| tx.send(r).unwrap()),
        );
        rx.recv().unwrap().unwrap();
        fs.wrote(ino, data.len() as u64, data.len() as u32);
        let (tx, rx) = std::sync::mpsc::channel();
        fs.read(
            ino,
            0,
            data.len(),
            Box::new(move |r: Result<&[u8]>| tx.send(r.map(<[u8]>::to_vec)).unwrap()),
        );
        assert!(rx.recv().unwrap().unwrap() == data);
    }

    #[test]
    fn a_failed_piece_fails_the_whole_whoever_finishes_last() {
        for failing in 0..3 {
            let (tx, rx) = std::sync::mpsc::channel();
            let job = Pieces::new(3, Box::new(move |r| tx.send(r).unwrap()));
            let threads: Vec<_> = (0..3)
                .map(|i| {
                    let job = job.clone();
                    std::thread::spawn(move || {
                        if i == failing {
                            job.fail(Error::new(Errno::EIO, format!("piece {i}")));
                        }
                        job.part_done();
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let e = rx.recv().unwrap().unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("piece {failing} (Input/output error)")
            );
            assert!(rx.try_recv().is_err(), "finished once");
        }
    }
}
