//! Write-behind: what is in flight of each file's writes. A write may be answered once its
//! bytes are copied into its transfer's own buffer and its chunks are mapped, before its
//! transfers are posted, rather than once they are in remote memory, so that the kernel hands
//! over the next write while this one is posted and travels, and the merge queues see
//! adjacent writes together. Flush, fsync and release
//! wait for a file's writes and report the first that failed (as NFS does); until then, a
//! new write to that file fails at once with it.
//!
//! Bounded: at most `limit` bytes are in flight per mount (a write beyond it waits), and a
//! write or read that overlaps one in flight waits for it, so that bytes land in the order
//! they were written (transfers on different queue pairs may complete in any order) and a
//! read sees every write answered before it. Every wait ends: a transfer completes or fails
//! within its deadline (and the retry window).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Condvar, Mutex, MutexGuard};

use rfs_proto::types::Ino;

use super::error::{Error, Result};

pub(crate) struct WriteBehind {
    /// Bytes that may be in flight; 0: writes are answered once they are in remote memory.
    limit: u64,
    state: Mutex<State>,
    /// Signalled whenever a write completes.
    landed: Condvar,
}

#[derive(Default)]
struct State {
    /// Bytes in flight, over every file.
    bytes: u64,
    files: HashMap<Ino, FileWrites>,
    /// Admission order, so that a flush waits for the writes before it and not for those a
    /// busy writer keeps adding.
    next_seq: u64,
}

#[derive(Default)]
struct FileWrites {
    /// The byte ranges in flight, start to (end, admission number): disjoint, since an
    /// overlapping write waits.
    in_flight: BTreeMap<u64, (u64, u64)>,
    /// The admission numbers of the writes in flight.
    seqs: BTreeSet<u64>,
    /// The first failure of a write answered before it landed, not yet reported.
    failure: Option<Error>,
}

impl FileWrites {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        // Disjoint ranges sorted by start have their ends sorted too: the last range that
        // starts before `end` reaches furthest.
        self.in_flight
            .range(..end)
            .next_back()
            .is_some_and(|(_, &(e, _))| e > start)
    }

    /// Whether a write admitted before `seq` overlaps `start..end`.
    fn overlaps_before(&self, start: u64, end: u64, seq: u64) -> bool {
        self.in_flight
            .range(..end)
            .rev()
            .take_while(|(_, &(e, _))| e > start)
            .any(|(_, &(_, s))| s < seq)
    }

    /// Whether a write admitted before `seq` is still in flight.
    fn in_flight_before(&self, seq: u64) -> bool {
        self.seqs.first().is_some_and(|&first| first < seq)
    }

    fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.failure.is_none()
    }
}

impl WriteBehind {
    /// Up to `limit` bytes in flight; 0 turns write-behind off (writes are still ordered).
    pub(crate) fn new(limit: u64) -> WriteBehind {
        WriteBehind {
            limit,
            state: Mutex::new(State::default()),
            landed: Condvar::new(),
        }
    }

    /// Whether a write may be answered before it lands.
    pub(crate) fn enabled(&self) -> bool {
        self.limit > 0
    }

    fn wait_while<'a>(
        &self,
        guard: MutexGuard<'a, State>,
        busy: impl FnMut(&mut State) -> bool,
    ) -> MutexGuard<'a, State> {
        self.landed.wait_while(guard, busy).unwrap()
    }

    /// Admits a write of `ino`'s bytes `start..end`: waits for room, and for the writes in
    /// flight it overlaps; fails at once if an earlier write of the file failed unreported.
    /// Pair with [`Self::landed`].
    pub(crate) fn admit(&self, ino: Ino, start: u64, end: u64) -> Result<()> {
        let (len, limit) = (end - start, self.limit);
        let st = self.state.lock().unwrap();
        let mut st = self.wait_while(st, |st| {
            let file = st.files.get(&ino);
            let room = limit == 0 || st.bytes == 0 || st.bytes + len <= limit;
            file.is_none_or(|f| f.failure.is_none())
                && (!room || file.is_some_and(|f| f.overlaps(start, end)))
        });
        let seq = st.next_seq;
        let file = st.files.entry(ino).or_default();
        if let Some(e) = &file.failure {
            return Err(e.clone());
        }
        file.in_flight.insert(start, (end, seq));
        file.seqs.insert(seq);
        st.bytes += len;
        st.next_seq += 1;
        Ok(())
    }

    /// The write admitted at `start` of `ino` landed, or failed with `failure` after it was
    /// answered (a failure the caller already got is not kept).
    pub(crate) fn landed(&self, ino: Ino, start: u64, failure: Option<Error>) {
        let mut st = self.state.lock().unwrap();
        let Some(file) = st.files.get_mut(&ino) else {
            return;
        };
        let Some((end, seq)) = file.in_flight.remove(&start) else {
            return;
        };
        file.seqs.remove(&seq);
        if let Some(e) = failure {
            file.failure.get_or_insert(e);
        }
        if file.is_idle() {
            st.files.remove(&ino);
        }
        st.bytes -= end - start;
        drop(st);
        self.landed.notify_all();
    }

    /// Waits until no write admitted so far that overlaps `ino`'s bytes `start..end` is in
    /// flight (later ones, a writer that keeps at it, do not hold the read up).
    pub(crate) fn settle(&self, ino: Ino, start: u64, end: u64) {
        let st = self.state.lock().unwrap();
        if st.bytes == 0 {
            return;
        }
        let mark = st.next_seq;
        drop(self.wait_while(st, |st| {
            st.files
                .get(&ino)
                .is_some_and(|f| f.overlaps_before(start, end, mark))
        }));
    }

    /// Where the bytes of `ino` past `from` that have not landed start: `from` or after it
    /// (None: all landed). A size committed up to there covers no byte still in flight.
    pub(crate) fn unlanded_from(&self, ino: Ino, from: u64) -> Option<u64> {
        let st = self.state.lock().unwrap();
        let file = st.files.get(&ino)?;
        if let Some((_, &(end, _))) = file.in_flight.range(..from).next_back() {
            if end > from {
                return Some(from);
            }
        }
        file.in_flight.range(from..).next().map(|(&start, _)| start)
    }

    /// Waits until every write of `ino` admitted so far landed; if `report`, reports the
    /// first that failed (once), which until then fails the file's new writes.
    pub(crate) fn drain(&self, ino: Ino, report: bool) -> Result<()> {
        let st = self.state.lock().unwrap();
        let mark = st.next_seq;
        let mut st = self.wait_while(st, |st| {
            st.files.get(&ino).is_some_and(|f| f.in_flight_before(mark))
        });
        let Some(file) = st.files.get_mut(&ino) else {
            return Ok(());
        };
        if !report {
            return Ok(());
        }
        let failure = file.failure.take();
        if file.is_idle() {
            st.files.remove(&ino);
        }
        failure.map_or(Ok(()), Err)
    }

    /// Waits until every write landed (at unmount); the failures nobody will hear of are
    /// logged.
    pub(crate) fn drain_all(&self) {
        let st = self.state.lock().unwrap();
        let mut st = self.wait_while(st, |st| st.bytes > 0);
        for (ino, file) in st.files.drain() {
            if let Some(e) = file.failure {
                log::error!("inode {ino}: a write failed after it was answered, and no flush or fsync came to report it: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::Errno;
    use std::sync::Arc;
    use std::time::Duration;

    /// Runs `f` on a thread; whether it finished within a moment.
    fn finishes(f: impl FnOnce() + Send + 'static) -> std::sync::mpsc::Receiver<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            f();
            let _ = tx.send(());
        });
        rx
    }

    fn blocked(rx: &std::sync::mpsc::Receiver<()>) -> bool {
        rx.recv_timeout(Duration::from_millis(100)).is_err()
    }

    #[test]
    fn an_overlapping_write_or_read_waits_for_the_one_in_flight_and_others_do_not() {
        let wb = Arc::new(WriteBehind::new(1 << 20));
        wb.admit(7, 100, 200).unwrap();
        // Adjacent ranges and other files go at once.
        wb.admit(7, 200, 300).unwrap();
        wb.admit(7, 0, 100).unwrap();
        wb.admit(8, 150, 160).unwrap();
        wb.settle(7, 300, 400);
        let w = wb.clone();
        let write = finishes(move || w.admit(7, 199, 201).unwrap());
        let w = wb.clone();
        let read = finishes(move || w.settle(7, 150, 151));
        assert!(blocked(&write) && blocked(&read));
        wb.landed(7, 100, None);
        // The read's range is free; the write still overlaps 200..300.
        read.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(blocked(&write));
        wb.landed(7, 200, None);
        write.recv_timeout(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn writes_past_the_limit_wait_for_room_but_one_alone_always_goes() {
        let wb = Arc::new(WriteBehind::new(1000));
        wb.admit(1, 0, 600).unwrap();
        let w = wb.clone();
        let second = finishes(move || w.admit(2, 0, 600).unwrap());
        assert!(blocked(&second));
        wb.landed(1, 0, None);
        second.recv_timeout(Duration::from_secs(5)).unwrap();
        wb.landed(2, 0, None);
        // Larger than the limit, with nothing in flight.
        wb.admit(3, 0, 5000).unwrap();
        wb.landed(3, 0, None);
        wb.drain_all();
    }

    #[test]
    fn a_failure_after_the_answer_fails_the_next_write_and_is_reported_once_by_drain() {
        let wb = WriteBehind::new(1 << 20);
        wb.admit(5, 0, 10).unwrap();
        wb.admit(5, 10, 20).unwrap();
        wb.landed(5, 0, Some(Error::new(Errno::EIO, "node 1 died")));
        let e = wb.admit(5, 20, 30).unwrap_err();
        assert_eq!(e.errno(), Errno::EIO);
        wb.admit(6, 0, 10).unwrap(); // other files are not affected
        wb.landed(6, 0, None);
        let drain = {
            let wb = Arc::new(wb);
            let w = wb.clone();
            let rx = finishes(move || assert!(w.drain(5, true).is_err()));
            assert!(blocked(&rx), "drain waits for the write still in flight");
            wb.landed(5, 10, None);
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
            wb
        };
        drain.drain(5, true).unwrap();
        drain.admit(5, 20, 30).unwrap();
        drain.landed(5, 20, None);
        assert_eq!(drain.state.lock().unwrap().bytes, 0);
        assert!(drain.state.lock().unwrap().files.is_empty());
    }

    #[test]
    fn a_read_waits_only_for_the_writes_before_it_and_a_drain_without_report_keeps_the_failure() {
        let wb = Arc::new(WriteBehind::new(1 << 20));
        wb.admit(4, 0, 10).unwrap();
        let w = wb.clone();
        let read = finishes(move || w.settle(4, 0, 100));
        assert!(blocked(&read));
        // A later write over the same bytes (its turn came) does not hold the read up.
        wb.landed(4, 0, None);
        wb.admit(4, 0, 10).unwrap();
        read.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(wb.unlanded_from(4, 0), Some(0));
        assert_eq!(wb.unlanded_from(4, 5), Some(5));
        assert_eq!(wb.unlanded_from(4, 10), None);
        wb.admit(4, 30, 40).unwrap();
        assert_eq!(wb.unlanded_from(4, 10), Some(30));
        wb.landed(4, 0, Some(Error::new(Errno::EIO, "lost")));
        wb.landed(4, 30, None);
        wb.drain(4, false).unwrap();
        assert!(
            wb.admit(4, 0, 1).is_err(),
            "not reported: still failing writes"
        );
        assert!(wb.drain(4, true).is_err());
        wb.drain(4, true).unwrap();
    }

    #[test]
    fn a_failure_the_caller_was_told_of_is_not_kept() {
        let wb = WriteBehind::new(0);
        wb.admit(5, 0, 10).unwrap();
        wb.landed(5, 0, None);
        wb.drain(5, true).unwrap();
        assert!(wb.state.lock().unwrap().files.is_empty());
    }
}
