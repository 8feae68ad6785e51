//! Reads: each piece from one replica (turn by turn, or the one node that has every piece,
//! gathered into one transfer), another replica when one fails, and again with a fresh map
//! when a node refused a stale reference.

use super::*;

impl<B: Backend> Rfs<B> {
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
                    Err(e) if e.is_stale() => {
                        let retry_fs = fs.clone();
                        fs.again(ino, from, attempt, e, move |next| match next {
                            Ok(next) => retry_fs.read_attempt(ino, offset, len, next, done),
                            Err(e) => done(Err(e)),
                        })
                    }
                    Err(e) => {
                        Self::piece_failed(&fs.stats, &e);
                        done(Err(e))
                    }
                    Ok(data) => done(Ok(data)),
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
}
