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

use rfs_daemon::backoff::Backoff;
use rfs_proto::message::DropReplicas;
use rfs_proto::types::{ChunkRef, Ino, Replicas};
use rfs_proto::Errno;

use super::backend::{Backend, DataDone, LandedDone};
use super::chunks::InFlight;
use super::error::{Error, Result};
use super::space::SPACE_WAIT;
use super::stats::{ClientStats, STATS_INO};
use super::Rfs;

mod read;
mod write;

/// Receives the bytes of a read (short at end of file).
pub type ReadDone = Box<dyn FnOnce(Result<&[u8]>) + Send>;
/// Receives how many bytes a read put in the caller's memory.
pub type LandDone = Box<dyn FnOnce(Result<usize>) + Send>;
/// Receives the byte count of a write.
pub type WriteDone = Box<dyn FnOnce(Result<u32>) + Send>;

/// The first pause before a transfer is sent again; it doubles, up to [`MAX_RETRY_PAUSE`].
const RETRY_PAUSE: Duration = Duration::from_millis(20);
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Which try of a transfer this is, and until when another may be made.
#[derive(Clone, Copy)]
struct Attempt {
    backoff: Backoff,
    deadline: Instant,
    /// A hard mount's: a transfer that cannot reach its node is tried again past the window.
    hard: bool,
}

impl Attempt {
    fn first(window: Duration, hard: bool) -> Attempt {
        Attempt {
            backoff: Backoff::new(RETRY_PAUSE, MAX_RETRY_PAUSE),
            deadline: Instant::now() + window,
            hard,
        }
    }

    /// The next try after `failure` and the pause before it, if it fits in the window (or the
    /// mount is hard and the node could not be reached).
    fn next(mut self, failure: &Error) -> Option<(Attempt, Duration)> {
        let in_window = Instant::now() + self.backoff.peek() < self.deadline;
        (in_window || (self.hard && failure.is_outage())).then(|| {
            let pause = self.backoff.next_pause();
            (self, pause)
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
        write: Option<(u64, u64)>,
    ) -> Result<(Vec<Option<Replicas>>, InFlight)> {
        let allocate = write.is_some();
        if allocate {
            self.allocating(ino);
        }
        for attempt in 0.. {
            let (refs, hold) = self.chunk_refs(ino, first, count, write)?;
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
        write: Option<(u64, u64)>,
    ) -> Result<(Vec<Option<Replicas>>, InFlight)> {
        if write.is_none() {
            return self.chunks.refs(&self.meta(), ino, first, count, None);
        }
        let mut deadline = None;
        loop {
            let seen = self.giving_back.ended();
            match self.chunks.refs(&self.meta(), ino, first, count, write) {
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

    /// Counts a piece that failed with EIO (a full pool, say, is no I/O error).
    fn piece_failed(stats: &ClientStats, e: &Error) {
        if e.errno() == Errno::EIO {
            ClientStats::add(&stats.io_errors, 1);
        }
    }

    /// After a read attempt of `ino` (its references let go) failed with `e`: a stale
    /// reference goes [`Self::again`]; any other failure is counted and handed to `then`.
    fn after_failed_read(
        self: &Arc<Self>,
        ino: Ino,
        from: u64,
        attempt: Attempt,
        e: Error,
        then: impl FnOnce(Result<Attempt>) + Send + 'static,
    ) {
        if e.is_stale() {
            return self.again(ino, from, attempt, e, then);
        }
        Self::piece_failed(&self.stats, &e);
        then(Err(e))
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
        off_the_completion_path("rfs-retry", move || match attempt.next(&stale) {
            Some((next, pause)) => {
                log::info!("inode {ino}: {stale}; sending it again with a fresh map");
                ClientStats::add(&fs.stats.retries, 1);
                std::thread::sleep(pause);
                fs.chunks.forget(ino, from);
                then(Ok(next))
            }
            None => {
                Self::piece_failed(&fs.stats, &stale);
                then(Err(stale))
            }
        });
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
/// session yet: it restarted, or the node is coming back, or did not answer the grant): worth
/// another try, and on a hard mount worth waiting for.
fn not_granted(c: &ChunkRef) -> Error {
    Error::unreachable(c.node, "the chunk was not granted to this client")
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
            umask: 0,
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
        let attempt = Attempt::first(std::time::Duration::from_secs(1), false);
        fs.write_pieces(
            ino,
            pieces,
            (attempt, None),
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
