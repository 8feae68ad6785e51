//! Writes: each piece to every replica of its chunk; replicas a write missed are dropped from
//! the map (to be copied again) so that nobody reads them; a piece refused for a stale
//! reference goes again with a fresh map; write-behind answers once the chunks are mapped.

use rfs_proto::message::GetAttr;

use super::*;
use crate::fs::KernelInval;

/// A write's bytes: borrowed (FUSE's, copied into a buffer per chunk piece), or owned (moved
/// into the pieces).
enum Bytes<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Bytes<'_> {
    fn len(&self) -> usize {
        match self {
            Bytes::Borrowed(b) => b.len(),
            Bytes::Owned(v) => v.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer of each of `segs` (in order, covering the bytes).
    fn into_pieces(self, segs: Vec<Segment>) -> Vec<(Segment, Vec<u8>)> {
        match self {
            Bytes::Borrowed(data) => segs
                .into_iter()
                .map(|s| {
                    let piece = data[s.at..s.at + s.len].to_vec();
                    (s, piece)
                })
                .collect(),
            Bytes::Owned(mut data) => {
                // From the last piece back: the first keeps the buffer itself.
                let mut pieces: Vec<_> = segs
                    .into_iter()
                    .rev()
                    .map(|s| {
                        let piece = match s.at {
                            0 => std::mem::take(&mut data),
                            at => data.split_off(at),
                        };
                        (s, piece)
                    })
                    .collect();
                pieces.reverse();
                pieces
            }
        }
    }
}

impl<B: Backend> Rfs<B> {
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

    /// Writes `data` at `offset`; `done` gets the byte count once every piece is in remote
    /// memory, on every replica.
    pub fn write(self: &Arc<Self>, ino: Ino, offset: u64, data: &[u8], done: WriteDone) {
        self.write_answering(ino, offset, Bytes::Borrowed(data), false, done)
    }

    /// Like [`Self::write`], with bytes the caller gives up: they become the transfer's
    /// buffer rather than being copied into one (all of them within one chunk; a piece past
    /// a chunk's edge is split off).
    pub(crate) fn write_owned(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        data: Vec<u8>,
        done: WriteDone,
    ) {
        self.write_answering(ino, offset, Bytes::Owned(data), false, done)
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
        self.write_answering(ino, offset, Bytes::Borrowed(data), early, done)
    }

    /// A write, answered once mapped (`early`) or once landed.
    fn write_answering(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        data: Bytes<'_>,
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
        let pieces = data.into_pieces(segments(offset, len as usize, self.chunk_size));
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
        let (mapped, admitted) = match self.map_pieces_after_cuts_heard(ino, &pieces) {
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
        let attempt = Attempt::first(self.retry_window, self.hard);
        self.post_pieces(ino, pieces, mapped, (attempt, admitted), finish);
    }

    /// The references of a new write's pieces (see [`Self::map_pieces`]), from a map that
    /// shows no cut we have not heard of, and the count of cuts heard of then (the write is
    /// ordered after them). A map read after a cut whose callback is still on its way is let
    /// go and the cut heard of first (it holds over our writes until then), so that this
    /// write's bytes, landing after the cut's zeros, count from its new end.
    fn map_pieces_after_cuts_heard(
        &self,
        ino: Ino,
        pieces: &[(Segment, Vec<u8>)],
    ) -> Result<(Mapped, Option<u64>)> {
        for _ in 0..MAX_CUTS_OVERTAKING {
            let mapped = self.map_pieces(ino, pieces)?;
            let Some(heard) = self.cuts_heard(ino) else {
                return Ok((mapped, None)); // not open here: nothing of ours to order
            };
            if mapped.hold.cuts_mapped <= heard {
                return Ok((mapped, Some(heard)));
            }
            drop(mapped);
            self.hear_of_cut(ino)?;
        }
        Err(Error::new(
            Errno::EIO,
            format!("inode {ino}: cut by others faster than a write of ours could be mapped"),
        ))
    }

    /// One try of the pieces of a write (see [`Self::write`]); those refused for a stale
    /// reference make another, with the bytes their transfers gave back. `admitted`: the count
    /// of cuts of the file we had heard of when the write was admitted, if it must not land
    /// after a cut made since: the cut's tail may have been zeroed, so bytes landing past the
    /// cut now would show when the file grows again. Such a write fails (EIO) instead; the
    /// cut holds over it, as over a write that landed before the cut.
    pub(super) fn write_pieces(
        self: &Arc<Self>,
        ino: Ino,
        pieces: Vec<(Segment, Vec<u8>)>,
        (attempt, admitted): (Attempt, Option<u64>),
        finish: FinishWrite<B>,
    ) {
        // A cut after the map was read is recalled from us and waits for this transfer (or
        // revokes its grant, if we cannot be asked): its bytes land before the cut's zeros.
        let mapped = self
            .map_pieces(ino, &pieces)
            .and_then(|mapped| match admitted {
                Some(cuts) if mapped.hold.cuts_mapped > cuts => {
                    drop(mapped);
                    Err(self.cut_under_write(ino))
                }
                _ => Ok(mapped),
            });
        match mapped {
            Ok(mapped) => self.post_pieces(ino, pieces, mapped, (attempt, admitted), finish),
            Err(e) => finish(self, Err(e)),
        }
    }

    /// The references of the chunks `pieces` write to (allocated where new), held.
    fn map_pieces(&self, ino: Ino, pieces: &[(Segment, Vec<u8>)]) -> Result<Mapped> {
        // Pieces sent again come in the order their transfers failed.
        let first = pieces.iter().map(|(s, _)| s.index).min().expect("a piece");
        let last = pieces.iter().map(|(s, _)| s.index).max().expect("a piece");
        let at = |s: &Segment| s.index * self.chunk_size + s.offset_in_chunk;
        let from = pieces.iter().map(|(s, _)| at(s)).min().expect("a piece");
        let end = pieces.iter().map(|(s, _)| at(s) + s.len as u64).max();
        let (refs, hold) = self
            .refs(ino, first, last - first + 1, end.map(|end| (from, end)))
            .inspect_err(|e| Self::piece_failed(&self.stats, e))?;
        Ok(Mapped { first, refs, hold })
    }

    /// Posts the transfers of `pieces` to the chunks `mapped` holds; `finish` answers once
    /// every piece is done.
    fn post_pieces(
        self: &Arc<Self>,
        ino: Ino,
        pieces: Vec<(Segment, Vec<u8>)>,
        mapped: Mapped,
        (attempt, admitted): (Attempt, Option<u64>),
        finish: FinishWrite<B>,
    ) {
        let Mapped { first, refs, hold } = mapped;
        let job = Arc::new(WriteJob {
            admitted,
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
            Self::piece_failed(&self.stats, &e);
            return finish(self, Err(e));
        }
        if st.missed.is_empty() && st.again.is_empty() {
            return finish(self, Ok(()));
        }
        let (fs, admitted) = (self.clone(), job.admitted);
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
                Ok(next) => retry_fs.write_pieces(ino, again, (next, admitted), finish),
                Err(e) => finish(&retry_fs, Err(e)),
            });
        });
    }

    /// Asks the node for `ino`'s attributes and hears of a cut it tells of that we had not:
    /// it holds over our writes so far.
    fn hear_of_cut(&self, ino: Ino) -> Result<()> {
        let now = self.call(GetAttr { ino })?;
        let learned = self
            .open
            .lock()
            .unwrap()
            .get_mut(&ino)
            .is_some_and(|f| f.learn(&now));
        if learned {
            ClientStats::add(&self.stats.commits_over_cuts, 1);
            self.pages_changed(ino);
            self.kernel(KernelInval::Inode { ino, data: true });
        }
        Ok(())
    }

    /// The error of a write of `ino` that a cut made elsewhere overtook, unheard of here
    /// when the write was admitted (see [`Self::write_pieces`]); the cut is heard of.
    fn cut_under_write(&self, ino: Ino) -> Error {
        if let Err(e) = self.hear_of_cut(ino) {
            log::warn!("inode {ino}: a cut overtook a write, and asking for its size failed: {e}");
        }
        Error::new(
            Errno::EIO,
            format!(
                "inode {ino}: cut by another client while a write of ours was on its way, \
                 unheard of here when it was made: the write is not applied"
            ),
        )
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
        let (refs, hold) = self.refs(ino, index, 1, None)?;
        drop(hold);
        // Past the span of the chunk's copies is a hole: zeros already.
        let Some(hi) = refs[0].as_ref().and_then(|r| r.first()).map(ChunkRef::hi) else {
            return Ok(None);
        };
        let end = end.min(index * self.chunk_size + hi);
        let lo = refs[0]
            .as_ref()
            .and_then(|r| r.first())
            .map_or(0, |c| c.lo as u64);
        let start = new.max(index * self.chunk_size + lo);
        if end <= start {
            return Ok(None);
        }
        let tail = self.read_now(ino, start, (end - start) as usize)?;
        if let Err(e) = self.overwrite_tail(ino, start, vec![0; tail.len()]) {
            // Some copies may have the zeros.
            self.put_tail_back(ino, (start, tail));
            return Err(e);
        }
        Ok(Some((start, tail)))
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
        let attempt = Attempt::first(self.retry_window, self.hard);
        let finish: FinishWrite<B> = Box::new(move |_, r| drop(tx.send(r)));
        self.write_pieces(ino, vec![(piece, bytes)], (attempt, None), finish);
        rx.recv().unwrap_or_else(|_| {
            Err(Error::new(
                Errno::EIO,
                "overwriting a truncated tail: no answer",
            ))
        })
    }
}

/// How many times a new write's map may show a cut we had not heard of before it gives up.
const MAX_CUTS_OVERTAKING: usize = 8;

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
    /// See [`Rfs::write_pieces`].
    admitted: Option<u64>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_bytes_make_the_same_pieces_as_borrowed_ones() {
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        for (offset, len) in [
            (0, 10_000),
            (100, 4096),
            (4000, 9000),
            (4096, 1),
            (12_000, 0),
        ] {
            let bytes = &data[..len];
            let borrowed = Bytes::Borrowed(bytes).into_pieces(segments(offset, len, 4096));
            let owned = Bytes::Owned(bytes.to_vec()).into_pieces(segments(offset, len, 4096));
            let shape = |p: &[(Segment, Vec<u8>)]| {
                p.iter()
                    .map(|(s, b)| (s.index, s.offset_in_chunk, s.at, b.clone()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(shape(&borrowed), shape(&owned), "{offset} {len}");
            assert_eq!(borrowed.iter().map(|(_, b)| b.len()).sum::<usize>(), len);
        }
    }
}
