//! The data path: a read or write is split at chunk boundaries, each piece goes one-sidedly to
//! the chunk's data node through the backend, and the caller is answered once every piece is
//! done (from the completion path of the last one), with the first failure if any: the FUSE
//! adapter logs it, once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rfs_proto::types::{ChunkRef, Ino};
use rfs_proto::Errno;

use super::backend::Backend;
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
    /// The references of chunks `first..first+count` of `ino`, held, with a data session to
    /// each node they are on, granted to it: connecting may take metadata calls, which must
    /// not happen while the references are held (a recall of them may be what the metadata
    /// node is busy with). A chunk not granted (key 0) means our data session there is not
    /// attached to our metadata session (first use, or the metadata node lost the session):
    /// attach, and ask again. A node that failed moments ago fails the transfer at once
    /// (EIO), without a metadata call.
    fn refs(
        &self,
        ino: Ino,
        first: u64,
        count: u64,
        allocate: bool,
    ) -> Result<(Vec<Option<ChunkRef>>, InFlight)> {
        for attempt in 0.. {
            let (refs, hold) = self
                .chunks
                .refs(&self.meta(), ino, first, count, allocate)?;
            let disconnected: Vec<u32> = refs
                .iter()
                .flatten()
                .map(|c| c.node)
                .filter(|&n| !self.backend.is_connected(n))
                .collect();
            let ungranted: Vec<u32> = refs
                .iter()
                .flatten()
                .filter(|c| c.rkey == 0)
                .map(|c| c.node)
                .collect();
            // A session lost again at once fails the transfer in the backend (EIO).
            if disconnected.is_empty() && ungranted.is_empty() {
                return Ok((refs, hold));
            }
            drop(hold);
            if attempt == 2 {
                return Err(Error::new(
                    Errno::EIO,
                    format!("chunks of inode {ino} on nodes {ungranted:?} {disconnected:?} were not granted to this client"),
                ));
            }
            let mut missing = [disconnected.clone(), ungranted].concat();
            missing.sort_unstable();
            missing.dedup();
            // A node that failed moments ago fails this at once, and the cached maps stay
            // (fetching them again would have the metadata node grant on the dead node).
            if let Some(node) = missing.iter().find(|&&n| self.backend.is_down(n)) {
                return Err(Error::new(
                    Errno::EIO,
                    format!("data node {node} failed moments ago"),
                ));
            }
            if !disconnected.is_empty() {
                // Keys granted to a session that is gone would be refused on its successor:
                // forgotten before it exists, so that no transfer carries one there.
                self.chunks.forget_nodes(&disconnected);
            }
            for node in missing {
                self.backend.connect(node)?;
            }
        }
        unreachable!("the loop returns by its third attempt")
    }

    /// Counts a failed piece.
    fn piece_failed(stats: &ClientStats) {
        ClientStats::add(&stats.io_errors, 1);
    }

    /// Reads up to `len` bytes at `offset`; `done` gets them (short at end of file).
    pub fn read(&self, ino: Ino, offset: u64, len: usize, done: ReadDone) {
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
            let Some(c) = refs[0] else {
                return done(Ok(vec![0; len])); // a hole
            };
            let stats = self.stats.clone();
            return self.backend.read(
                &c,
                s.offset_in_chunk,
                vec![0; len],
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
            let Some(c) = r else {
                job.part_done(); // a hole: zeros already
                continue;
            };
            let (job, buf, at, stats) = (job.clone(), buf.clone(), s.at, self.stats.clone());
            self.backend.read(
                &c,
                s.offset_in_chunk,
                vec![0; s.len],
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
    /// memory.
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
            let c = r.expect("allocated above");
            let (job, stats) = (job.clone(), self.stats.clone());
            self.backend.write(
                &c,
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
    pub(crate) fn zero_tail(&self, ino: Ino, new: u64, old: u64) -> Result<()> {
        let in_chunk = new % self.chunk_size;
        if in_chunk == 0 {
            return Ok(());
        }
        let index = new / self.chunk_size;
        let end = ((index + 1) * self.chunk_size).min(old);
        let (refs, _hold) = self.refs(ino, index, 1, false)?;
        let Some(chunk) = refs[0] else {
            return Ok(());
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.backend.write(
            &chunk,
            in_chunk,
            vec![0; (end - new) as usize],
            Box::new(move |r| drop(tx.send(r))),
        );
        match rx.recv() {
            Ok(r) => r.map(drop),
            Err(_) => Err(Error::new(
                Errno::EIO,
                "zeroing a truncated tail: no answer",
            )),
        }
    }
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
