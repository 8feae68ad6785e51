//! Reads: each piece from one replica (turn by turn, or the one node that has every piece,
//! gathered into one transfer), another replica when one fails, and again with a fresh map
//! when a node refused a stale reference.

use rdmabox::transport::Landing;

use super::*;

/// Where one piece of a read goes: lent to a callback where it landed, or into the caller's
/// memory.
enum Sink {
    Lend(DataDone),
    Land(Landing, LandedDone),
}

impl Sink {
    fn fail(self, e: Error) {
        match self {
            Sink::Lend(done) => done(Err(e)),
            Sink::Land(_, done) => done(Err(e)),
        }
    }
}

impl<B: Backend> Rfs<B> {
    /// Reads `len` bytes at `offset` of a chunk from one of its replicas, and from the next
    /// one if that fails (an error, or the deadline): replicas take turns, so that reads
    /// spread over them; those on nodes that failed moments ago come last.
    fn read_replicas(
        self: &Arc<Self>,
        mut replicas: Replicas,
        offset: u64,
        len: usize,
        sink: Sink,
    ) {
        if let [c] = replicas[..] {
            // One copy (the common case): nothing to choose or fail over to.
            if c.rkey == 0 {
                return sink.fail(not_granted(&c));
            }
            return match sink {
                Sink::Lend(done) => self.backend.read(&c, offset, len, done),
                Sink::Land(into, done) => self.backend.read_into(&c, offset, into, done),
            };
        }
        let turn = self.next_replica.fetch_add(1, Ordering::Relaxed) % replicas.len();
        replicas.rotate_left(turn);
        let chosen = replicas[0];
        // Stable: the turn order stays among equals.
        replicas.sort_by_key(|c| c.rkey == 0 || self.backend.is_down(c.node));
        if replicas[0] != chosen {
            ClientStats::add(&self.stats.failovers, 1);
        }
        self.read_from(replicas, 0, offset, len, None, sink);
    }

    /// [`Self::read_replicas`] from replica `k` on; `failure` is the first one's error.
    fn read_from(
        self: &Arc<Self>,
        replicas: Replicas,
        k: usize,
        offset: u64,
        len: usize,
        failure: Option<Error>,
        sink: Sink,
    ) {
        let Some(&c) = replicas.get(k) else {
            return sink.fail(failure.expect("at least one replica was tried"));
        };
        if k > 0 {
            ClientStats::add(&self.stats.failovers, 1);
        }
        if c.rkey == 0 {
            let e = not_granted(&c);
            return self.read_from(replicas, k + 1, offset, len, failure.or(Some(e)), sink);
        }
        let fs = self.clone();
        let next = move |e: Error, sink: Sink| {
            if k + 1 < replicas.len() {
                log::warn!("{e}: reading another replica");
            }
            fs.read_from(replicas, k + 1, offset, len, failure.or(Some(e)), sink)
        };
        match sink {
            Sink::Lend(done) => self.backend.read(
                &c,
                offset,
                len,
                Box::new(move |r: Result<&[u8]>| match r {
                    Ok(data) => done(Ok(data)),
                    Err(e) => next(e, Sink::Lend(done)),
                }),
            ),
            Sink::Land(into, done) => {
                let again = into.clone();
                self.backend.read_into(
                    &c,
                    offset,
                    into,
                    Box::new(move |r: Result<()>| match r {
                        Ok(()) => done(Ok(())),
                        Err(e) => next(e, Sink::Land(again, done)),
                    }),
                )
            }
        }
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
        self.read_attempt(
            ino,
            offset,
            len,
            Attempt::first(self.retry_window, self.hard),
            done,
        );
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
        let (refs, hold) = match self.refs(ino, segs[0].index, segs.len() as u64, None) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        // Answers once the references are let go: a stale one sends the read again.
        let answer = {
            let (fs, from) = (self.clone(), segs[0].index);
            move |r: Result<&[u8]>| {
                drop(hold);
                match r {
                    Ok(data) => done(Ok(data)),
                    Err(e) => {
                        let retry = fs.clone();
                        fs.after_failed_read(ino, from, attempt, e, move |next| match next {
                            Ok(next) => retry.read_attempt(ino, offset, len, next, done),
                            Err(e) => done(Err(e)),
                        })
                    }
                }
            }
        };
        // A piece partly or wholly past its copies' span (in a sparse chunk) reads zeros
        // there: piece by piece, each clipped to its span.
        let in_spans = segs.iter().zip(&refs).all(|(s, r)| {
            r.as_ref()
                .and_then(|r| r.first())
                .is_none_or(|c| c.holds(s.offset_in_chunk, s.len as u64))
        });
        if !in_spans {
            return self.read_pieces(&segs, refs, len, Box::new(answer));
        }
        // One segment in one chunk (the common case): hand the transfer's buffer straight back.
        if let [s] = segs.as_slice() {
            let Some(replicas) = refs.into_iter().next().flatten() else {
                return answer(Ok(&vec![0; len])); // a hole
            };
            return self.read_replicas(
                replicas,
                s.offset_in_chunk,
                len,
                Sink::Lend(Box::new(answer)),
            );
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
            // What the copies hold of the piece: the rest is a hole, zeros already.
            let held = r.as_ref().and_then(|r| r.first()).map(|c| {
                let from = s.offset_in_chunk.max(c.lo as u64);
                (from, (s.offset_in_chunk + s.len as u64).min(c.hi()))
            });
            let (Some(replicas), Some((from, end))) = (r, held.filter(|(a, b)| a < b)) else {
                job.part_done();
                continue;
            };
            let at = s.at + (from - s.offset_in_chunk) as usize;
            let (job, buf) = (job.clone(), buf.clone());
            self.read_replicas(
                replicas,
                from,
                (end - from) as usize,
                Sink::Lend(Box::new(move |r: Result<&[u8]>| {
                    match r {
                        Ok(data) => buf.lock().unwrap()[at..at + data.len()].copy_from_slice(data),
                        Err(e) => job.fail(e),
                    }
                    job.part_done();
                })),
            );
        }
    }

    /// Reads up to `into.len()` bytes at `offset` into the caller's memory: each piece lands
    /// where it belongs (straight from the wire at the dynMR size and above), and what no copy
    /// holds (a hole) is zeroed there; `done` gets how many bytes the file had (short at end
    /// of file: the rest of `into` is left as it was).
    pub fn read_into(self: &Arc<Self>, ino: Ino, offset: u64, into: Landing, done: LandDone) {
        if ino == STATS_INO {
            let bytes = self.stats_read(offset, into.len());
            into.copy_in(0, &bytes);
            return done(Ok(bytes.len()));
        }
        self.behind.settle(ino, offset, offset + into.len() as u64);
        let size = match self.size_for_read(ino) {
            Ok(s) => s,
            Err(e) => return done(Err(e)),
        };
        let len = (size.saturating_sub(offset)).min(into.len() as u64) as usize;
        let Some(into) = into.part(0, len).filter(|_| len > 0) else {
            return done(Ok(0));
        };
        ClientStats::add(&self.stats.reads, 1);
        ClientStats::add(&self.stats.bytes_read, len as u64);
        let attempt = Attempt::first(self.retry_window, self.hard);
        self.land_attempt(ino, offset, into, attempt, done);
    }

    /// One try of [`Self::read_into`]; a stale reference makes another, whole.
    fn land_attempt(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        into: Landing,
        attempt: Attempt,
        done: LandDone,
    ) {
        let len = into.len();
        let segs = segments(offset, len, self.chunk_size);
        let (refs, hold) = match self.refs(ino, segs[0].index, segs.len() as u64, None) {
            Ok(r) => r,
            Err(e) => return done(Err(e)),
        };
        let answer = {
            let (fs, from, into) = (self.clone(), segs[0].index, into.clone());
            move |r: Result<()>| {
                drop(hold);
                match r {
                    Ok(()) => done(Ok(len)),
                    Err(e) => {
                        let retry = fs.clone();
                        fs.after_failed_read(ino, from, attempt, e, move |next| match next {
                            Ok(next) => retry.land_attempt(ino, offset, into, next, done),
                            Err(e) => done(Err(e)),
                        })
                    }
                }
            }
        };
        let job = Pieces::new(segs.len(), Box::new(answer));
        for (s, r) in segs.iter().zip(refs) {
            let (lo, hi) = (s.offset_in_chunk, s.offset_in_chunk + s.len as u64);
            // What the copies hold of the piece (a span of the chunk): zeros around it.
            let held = r.as_ref().and_then(|r| r.first()).map(|c| {
                let from = lo.max(c.lo as u64).min(hi);
                (from, hi.min(c.hi()).max(from))
            });
            let (from, end) = held.unwrap_or((hi, hi));
            into.zero(s.at, (from - lo) as usize);
            into.zero(s.at + (end - lo) as usize, (hi - end) as usize);
            let Some(replicas) = r.filter(|_| from < end) else {
                job.part_done();
                continue;
            };
            let part = into
                .part(s.at + (from - lo) as usize, (end - from) as usize)
                .expect("a piece is inside its read");
            let job = job.clone();
            self.read_replicas(
                replicas,
                from,
                part.len(),
                Sink::Land(
                    part,
                    Box::new(move |r: Result<()>| {
                        if let Err(e) = r {
                            job.fail(e);
                        }
                        job.part_done();
                    }),
                ),
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
}
