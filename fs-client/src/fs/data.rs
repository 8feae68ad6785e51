//! The data path: a read or write is split at chunk boundaries, each piece goes one-sidedly to
//! the chunk's data node through the backend, and the caller is answered once every piece is
//! done (from the completion path of the last one), with the first failure if any: the FUSE
//! adapter logs it, once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rfs_proto::message::DropReplicas;
use rfs_proto::types::{ChunkRef, Ino, Replicas};
use rfs_proto::Errno;

use super::backend::{Backend, DataDone};
use super::chunks::InFlight;
use super::error::{Error, Result};
use super::stats::{ClientStats, STATS_INO};
use super::Rfs;

/// Receives the bytes of a read (short at end of file).
pub type ReadDone = Box<dyn FnOnce(Result<Vec<u8>>) + Send>;
/// Receives the byte count of a write.
pub type WriteDone = Box<dyn FnOnce(Result<u32>) + Send>;

/// A piece of a file range that lies in one chunk.
#[derive(Debug, PartialEq, Eq)]
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
    fn refs(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
        allocate: bool,
    ) -> Result<(Vec<Option<Replicas>>, InFlight)> {
        for attempt in 0.. {
            let (refs, hold) = self
                .chunks
                .refs(&self.meta(), ino, first, count, allocate)?;
            let usable = |c: &ChunkRef| c.rkey != 0 && self.backend.is_connected(c.node);
            let mut disconnected = Vec::new();
            let mut ungranted = Vec::new();
            for replicas in refs.iter().flatten() {
                // A read needs one usable replica, a write all (one it cannot use is dropped
                // from the map, so first use connects); a replica still not granted on a
                // session we have is asked again only if there is no other.
                let any_usable = replicas.iter().any(usable);
                for c in replicas.iter().filter(|c| !self.backend.is_down(c.node)) {
                    if !self.backend.is_connected(c.node) && (allocate || !any_usable) {
                        disconnected.push(c.node);
                    } else if c.rkey == 0 && !any_usable {
                        ungranted.push(c.node);
                    }
                }
            }
            disconnected.sort_unstable();
            disconnected.dedup();
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
        }
        unreachable!("the loop returns by its third attempt")
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
        if replicas.len() > 1 {
            let turn = self.next_replica.fetch_add(1, Ordering::Relaxed) % replicas.len();
            replicas.rotate_left(turn);
            let chosen = replicas[0];
            // Stable: the turn order stays among equals.
            replicas.sort_by_key(|c| c.rkey == 0 || self.backend.is_down(c.node));
            if replicas[0] != chosen {
                ClientStats::add(&self.stats.failovers, 1);
            }
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
            vec![0; len],
            Box::new(move |r| match r {
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

    /// Writes `data` at `offset` of chunk `index` of `ino` to every replica at once; `done`
    /// gets Ok once each replica has it or was dropped from the map because it could not get
    /// it (before the answer: a read must not find the old bytes there), or the first error
    /// if no replica got it.
    fn write_replicas(
        self: &Arc<Self>,
        ino: Ino,
        index: u64,
        replicas: Replicas,
        offset: u64,
        data: Vec<u8>,
        done: Finish,
    ) {
        let fanout = Arc::new(Fanout {
            replicas: replicas.len(),
            state: Mutex::new((replicas.len(), Vec::new(), None)),
            done: Mutex::new(Some(done)),
        });
        let last = replicas.len() - 1;
        let mut data = Some(data);
        for (k, c) in replicas.into_iter().enumerate() {
            let bytes = if k == last {
                data.take().expect("the last replica takes the buffer")
            } else {
                data.clone().expect("kept for the last replica")
            };
            if c.rkey == 0 {
                self.replica_written(&fanout, ino, index, c, Err(not_granted(&c)));
                continue;
            }
            let (fs, fanout) = (self.clone(), fanout.clone());
            self.backend.write(
                &c,
                offset,
                bytes,
                Box::new(move |r| fs.replica_written(&fanout, ino, index, c, r.map(drop))),
            );
        }
    }

    /// One replica of a [`Self::write_replicas`] is done; the last one answers.
    fn replica_written(
        self: &Arc<Self>,
        fanout: &Fanout,
        ino: Ino,
        index: u64,
        c: ChunkRef,
        r: Result<()>,
    ) {
        let (failed, failure, all) = {
            let mut st = fanout.state.lock().unwrap();
            if let Err(e) = r {
                log::warn!("{e}");
                st.1.push(c);
                st.2.get_or_insert(e);
            }
            st.0 -= 1;
            if st.0 > 0 {
                return;
            }
            let all = st.1.len();
            (std::mem::take(&mut st.1), st.2.take(), all)
        };
        let done = fanout.done.lock().unwrap().take().expect("answered once");
        let Some(failure) = failure else {
            return done(Ok(()));
        };
        if all == fanout.replicas {
            return done(Err(failure));
        }
        // Dropping takes a metadata call: not on the completion path (a poller thread).
        let fs = self.clone();
        let slot = Arc::new(Mutex::new(Some(done)));
        let answer = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("drop-replicas".into())
            .spawn(move || {
                let r = fs.drop_replicas(ino, index, failed);
                if let Some(done) = answer.lock().unwrap().take() {
                    done(r);
                }
            });
        if let Err(e) = spawned {
            if let Some(done) = slot.lock().unwrap().take() {
                done(Err(Error::new(
                    Errno::EIO,
                    format!("no thread to drop replicas that missed a write: {e}"),
                )));
            }
        }
    }

    /// Has the metadata node drop the replicas of chunk `index` that a write could not reach,
    /// and forgets our own map of them.
    fn drop_replicas(&self, ino: Ino, index: u64, failed: Replicas) -> Result<()> {
        let n = failed.len() as u64;
        self.call(DropReplicas { ino, index, failed })
            .map_err(|e| {
                Error::new(
                    Errno::EIO,
                    format!("inode {ino} chunk {index}: a write missed {n} replicas, which could not be dropped: {e}"),
                )
            })?;
        ClientStats::add(&self.stats.replicas_dropped, n);
        self.chunks.forget(ino, index);
        Ok(())
    }

    /// Reads up to `len` bytes at `offset`; `done` gets them (short at end of file).
    pub fn read(self: &Arc<Self>, ino: Ino, offset: u64, len: usize, done: ReadDone) {
        if ino == STATS_INO {
            return done(Ok(self.stats_read(offset, len)));
        }
        let size = match self.size_for_read(ino) {
            Ok(s) => s,
            Err(e) => return done(Err(e)),
        };
        let len = (size.saturating_sub(offset)).min(len as u64) as usize;
        if len == 0 {
            return done(Ok(Vec::new()));
        }
        ClientStats::add(&self.stats.reads, 1);
        let segs = segments(offset, len, self.chunk_size);
        let (refs, hold) = match self.refs(ino, segs[0].index, segs.len() as u64, false) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        ClientStats::add(&self.stats.bytes_read, len as u64);
        // One segment in one chunk (the common case): hand the transfer's buffer straight back.
        if let [s] = segs.as_slice() {
            let Some(replicas) = refs.into_iter().next().flatten() else {
                return done(Ok(vec![0; len])); // a hole
            };
            let stats = self.stats.clone();
            return self.read_replicas(
                replicas,
                s.offset_in_chunk,
                len,
                Box::new(move |r| {
                    drop(hold);
                    if r.is_err() {
                        Self::piece_failed(&stats);
                    }
                    done(r)
                }),
            );
        }
        let buf = Arc::new(Mutex::new(vec![0u8; len]));
        let job = {
            let buf = buf.clone();
            Pieces::new(
                segs.len(),
                Box::new(move |r| {
                    drop(hold);
                    done(r.map(|()| std::mem::take(&mut *buf.lock().unwrap())))
                }),
            )
        };
        for (s, r) in segs.iter().zip(refs) {
            let Some(replicas) = r else {
                job.part_done(); // a hole: zeros already
                continue;
            };
            let (job, buf, at, stats) = (job.clone(), buf.clone(), s.at, self.stats.clone());
            self.read_replicas(
                replicas,
                s.offset_in_chunk,
                s.len,
                Box::new(move |r| {
                    match r {
                        Ok(data) => buf.lock().unwrap()[at..at + data.len()].copy_from_slice(&data),
                        Err(e) => {
                            Self::piece_failed(&stats);
                            job.fail(e);
                        }
                    }
                    job.part_done();
                }),
            );
        }
    }

    /// Writes `data` at `offset`; `done` gets the byte count once every piece is in remote
    /// memory, on every replica.
    pub fn write(self: &Arc<Self>, ino: Ino, offset: u64, data: &[u8], done: WriteDone) {
        if ino == STATS_INO {
            return done(Err(Errno::EACCES.into()));
        }
        if data.is_empty() {
            return done(Ok(0));
        }
        ClientStats::add(&self.stats.writes, 1);
        let segs = segments(offset, data.len(), self.chunk_size);
        let (refs, hold) = match self.refs(ino, segs[0].index, segs.len() as u64, true) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        let job = {
            let fs = self.clone();
            let (end, len) = (offset + data.len() as u64, data.len() as u32);
            Pieces::new(
                segs.len(),
                Box::new(move |r| {
                    drop(hold);
                    if r.is_ok() {
                        fs.wrote(ino, end, len);
                    }
                    done(r.map(|()| len))
                }),
            )
        };
        for (s, r) in segs.iter().zip(refs) {
            let replicas = r.expect("allocated above");
            let (job, stats) = (job.clone(), self.stats.clone());
            self.write_replicas(
                ino,
                s.index,
                replicas,
                s.offset_in_chunk,
                data[s.at..s.at + s.len].to_vec(),
                Box::new(move |r| {
                    if let Err(e) = r {
                        Self::piece_failed(&stats);
                        job.fail(e);
                    }
                    job.part_done();
                }),
            );
        }
    }

    /// On truncation inside a chunk, zeroes the rest of that chunk (up to the old size), so
    /// that growing the file again reads zeros there and not the old bytes.
    pub(crate) fn zero_tail(self: &Arc<Self>, ino: Ino, new: u64, old: u64) -> Result<()> {
        let in_chunk = new % self.chunk_size;
        if in_chunk == 0 {
            return Ok(());
        }
        let index = new / self.chunk_size;
        let end = ((index + 1) * self.chunk_size).min(old);
        let (refs, _hold) = self.refs(ino, index, 1, false)?;
        let Some(replicas) = refs.into_iter().next().flatten() else {
            return Ok(());
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.write_replicas(
            ino,
            index,
            replicas,
            in_chunk,
            vec![0; (end - new) as usize],
            Box::new(move |r| drop(tx.send(r))),
        );
        match rx.recv() {
            Ok(r) => r,
            Err(_) => Err(Error::new(
                Errno::EIO,
                "zeroing a truncated tail: no answer",
            )),
        }
    }
}

/// The error of a replica our session was not granted.
fn not_granted(c: &ChunkRef) -> Error {
    Error::new(
        Errno::EIO,
        format!("data node {}: the chunk was not granted to this client", c.node),
    )
}

/// One write going to every replica of a chunk: (replicas still to answer, those that failed,
/// the first failure), and what to do once all answered.
struct Fanout {
    replicas: usize,
    state: Mutex<(usize, Replicas, Option<Error>)>,
    done: Mutex<Option<Finish>>,
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

    /// Fails the request (the first failure is the one reported); call before this piece's
    /// `part_done`.
    fn fail(&self, e: Error) {
        self.failure.lock().unwrap().get_or_insert(e);
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
