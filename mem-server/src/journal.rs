//! The metadata node's state directory: a journal of [`Record`]s, made durable before any
//! reply that depends on them goes out (fsync'd in groups: whoever waits first writes and syncs
//! everything appended so far, for everyone waiting), and snapshots of the whole state that
//! bound what a restart replays.
//!
//! Files: `snapshot.N` (the state as of when segment N began) and `journal.N`, `journal.N+1`...
//! (the changes since). A snapshot is written aside and renamed into place once synced, so the
//! newest `snapshot.N` is always whole; older files go only after that. Every file is frames
//! of `[length u32][crc32 u32][records]`; a crash can leave only the last journal's last frame
//! torn, and replay stops there (and cuts it off). Damage anywhere else refuses the restart:
//! a namespace must not come back silently missing changes it had answered.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use rfs_proto::wire::Writer;

use crate::record::Record;

const JOURNAL_MAGIC: &[u8; 8] = b"RFSJRNL1";
const SNAPSHOT_MAGIC: &[u8; 8] = b"RFSSNAP1";
/// A segment this long is followed by a snapshot (replay stays short).
const SNAPSHOT_AFTER: u64 = 64 << 20;
/// Snapshot records per frame (a frame is read whole).
const RECORDS_PER_FRAME: usize = 4096;
/// The largest frame a reader accepts.
const MAX_FRAME: usize = 1 << 30;

fn damaged(path: &Path, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: {why}", path.display()),
    )
}

/// Encodes `records` as one frame.
fn frame(records: &[Record], out: &mut Vec<u8>) {
    let mut w = Writer::default();
    for r in records {
        r.put(&mut w);
    }
    out.extend_from_slice(&(w.0.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&w.0).to_le_bytes());
    out.extend_from_slice(&w.0);
}

/// What reading a file's frames found.
struct Frames {
    records: Vec<Record>,
    /// Bytes of whole frames (with the header): where a torn tail starts.
    good_len: u64,
    /// Why reading stopped before the end of the file, if it did.
    torn: Option<String>,
    /// Whether an empty frame (a snapshot's end) was read.
    ended: bool,
}

fn read_frames(path: &Path, magic: &[u8; 8]) -> io::Result<Frames> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    if bytes.len() < magic.len() && magic.starts_with(&bytes) {
        // Created, and stopped before its header was whole: nothing was ever written after it.
        return Ok(Frames {
            records: Vec::new(),
            good_len: 0,
            torn: Some(format!("a header of {} bytes", bytes.len())),
            ended: false,
        });
    }
    if bytes.len() < magic.len() || &bytes[..magic.len()] != magic {
        return Err(damaged(path, "not an rfs state file"));
    }
    let mut at = magic.len();
    let mut out = Frames {
        records: Vec::new(),
        good_len: at as u64,
        torn: None,
        ended: false,
    };
    while at < bytes.len() {
        let rest = &bytes[at..];
        let Some((len, crc)) = frame_header(rest) else {
            out.torn = Some(format!("{} stray bytes at the end", rest.len()));
            break;
        };
        if len > MAX_FRAME || rest.len() - 8 < len {
            out.torn = Some(format!(
                "a frame of {len} bytes with {} left",
                rest.len() - 8
            ));
            break;
        }
        let body = &rest[8..8 + len];
        if crc32fast::hash(body) != crc {
            if is_whole_frame(&rest[8 + len..]) {
                // Not a write cut short: whole frames follow it.
                return Err(damaged(path, format!("a damaged frame at byte {at}")));
            }
            out.torn = Some(format!("a damaged frame at byte {at}"));
            break;
        }
        match Record::decode_all(body) {
            Ok(records) => out.records.extend(records),
            Err(e) => return Err(damaged(path, format!("a frame at byte {at}: {e}"))),
        }
        at += 8 + len;
        out.good_len = at as u64;
        if len == 0 {
            out.ended = true;
            break;
        }
    }
    Ok(out)
}

/// The length and checksum at the start of `b`, if it holds a frame header.
fn frame_header(b: &[u8]) -> Option<(usize, u32)> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?);
    let crc = u32::from_le_bytes(b.get(4..8)?.try_into().ok()?);
    Some((len as usize, crc))
}

/// Whether `b` starts with a whole, intact frame.
fn is_whole_frame(b: &[u8]) -> bool {
    frame_header(b)
        .is_some_and(|(len, crc)| len <= b.len() - 8 && crc32fast::hash(&b[8..8 + len]) == crc)
}

/// The generations of the files named `prefix.N` in `dir`, sorted.
fn generations(dir: &Path, prefix: &str) -> io::Result<Vec<u64>> {
    let mut found = Vec::new();
    for e in fs::read_dir(dir)? {
        let name = e?.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = name
            .strip_prefix(prefix)
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.parse::<u64>().ok())
        {
            found.push(n);
        }
    }
    found.sort_unstable();
    Ok(found)
}

fn file_name(prefix: &str, generation: u64) -> String {
    format!("{prefix}.{generation:016}")
}

/// Creates (or empties) `path` readable and writable by its owner only: the state holds every
/// name of the file system, those inside private directories too.
fn create_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

/// Makes `dir` (creating it if need be) and what is in it private to its owner, as a state
/// directory made by an older node, or by hand, may not be.
fn make_private(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    // What cannot be tightened (not ours, a file system without modes) is said, not refused:
    // the node ran with it before.
    let tighten = |path: &Path, mode: u32| {
        let Ok(meta) = fs::symlink_metadata(path) else {
            return;
        };
        let now = meta.permissions().mode() & 0o7777;
        if now & !mode == 0 {
            return;
        }
        match fs::set_permissions(path, fs::Permissions::from_mode(now & mode)) {
            Ok(()) => log::warn!(
                "{}: mode {now:o} let others read the file system's names; made {:o}",
                path.display(),
                now & mode
            ),
            Err(e) => log::warn!(
                "{}: mode {now:o} lets others read the file system's names, and it could not \
                 be changed: {e}",
                path.display()
            ),
        }
    };
    tighten(dir, 0o700);
    for e in fs::read_dir(dir)?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_file()) {
            tighten(&e.path(), 0o600);
        }
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes a snapshot of `records` as `snapshot.<generation>`: aside, synced, then renamed.
fn write_snapshot(dir: &Path, generation: u64, records: &[Record]) -> io::Result<()> {
    let name = file_name("snapshot", generation);
    let tmp = dir.join(format!("{name}.tmp"));
    let mut bytes = SNAPSHOT_MAGIC.to_vec();
    for part in records.chunks(RECORDS_PER_FRAME) {
        frame(part, &mut bytes);
    }
    frame(&[], &mut bytes);
    let mut f = create_private(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// Removes the snapshots and journal segments before `generation` (a snapshot of it is
/// whole).
fn remove_before(dir: &Path, generation: u64) {
    for prefix in ["snapshot", "journal"] {
        for g in generations(dir, prefix).unwrap_or_default() {
            if g < generation {
                if let Err(e) = fs::remove_file(dir.join(file_name(prefix, g))) {
                    log::warn!("removing an old {prefix} {g}: {e}");
                }
            }
        }
    }
}

/// Removes snapshots a stopped node left half written (never renamed into place).
fn remove_unfinished_snapshots(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snapshot.") && name.ends_with(".tmp") {
            if let Err(err) = fs::remove_file(e.path()) {
                log::warn!("removing the unfinished {name}: {err}");
            }
        }
    }
}

/// Replays the state directory: the newest snapshot, then every journal segment since.
fn replay(dir: &Path) -> io::Result<(Vec<Record>, u64)> {
    let snapshots = generations(dir, "snapshot")?;
    let Some(&base) = snapshots.last() else {
        if !generations(dir, "journal")?.is_empty() {
            return Err(damaged(dir, "journal segments without a snapshot"));
        }
        return Ok((Vec::new(), 0));
    };
    let path = dir.join(file_name("snapshot", base));
    let snap = read_frames(&path, SNAPSHOT_MAGIC)?;
    if !snap.ended {
        return Err(damaged(&path, snap.torn.unwrap_or_else(|| "no end".into())));
    }
    let mut records = snap.records;
    let segments: Vec<u64> = generations(dir, "journal")?
        .into_iter()
        .filter(|&g| g >= base)
        .collect();
    let mut last = base;
    for (i, &g) in segments.iter().enumerate() {
        if g != base + i as u64 {
            return Err(damaged(
                dir,
                format!("journal segment {} is missing", base + i as u64),
            ));
        }
        let path = dir.join(file_name("journal", g));
        let seg = read_frames(&path, JOURNAL_MAGIC)?;
        if let Some(why) = &seg.torn {
            if i + 1 < segments.len() {
                return Err(damaged(&path, why));
            }
            // The last frame was being written when the node stopped: it was never answered.
            log::warn!("{}: {why}; cutting the unfinished tail off", path.display());
            let mut f = OpenOptions::new().write(true).open(&path)?;
            f.set_len(seg.good_len)?;
            if seg.good_len == 0 {
                f.write_all(JOURNAL_MAGIC)?;
            }
            f.sync_all()?;
        }
        records.extend(seg.records);
        last = g;
    }
    Ok((records, last))
}

struct Inner {
    generation: u64,
    /// The segment being written (none before [`Journal::start`]).
    file: Option<Arc<File>>,
    /// Frames appended and not yet written.
    buf: Vec<u8>,
    /// Frames appended so far, and how many of them are durable.
    appended: u64,
    durable: u64,
    /// Someone is writing and syncing (outside the lock).
    flushing: bool,
    segment_bytes: u64,
    /// A write or sync failed: nothing later can be made durable.
    failed: Option<String>,
}

/// An open state directory.
pub struct Journal {
    dir: PathBuf,
    inner: Mutex<Inner>,
    flushed: Condvar,
    /// Snapshots are written one at a time, in order.
    snapshotting: Arc<Mutex<()>>,
    /// Held for as long as this node uses the directory.
    _lock: File,
}

impl Journal {
    /// Opens (creating it if need be) the state directory `dir`, locks it against a second
    /// metadata node, and replays it: the records to rebuild the state from (none: a new file
    /// system). Call [`Journal::start`] with the rebuilt state before appending.
    pub fn open(dir: &Path) -> io::Result<(Journal, Vec<Record>)> {
        make_private(dir)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(dir.join("lock"))?;
        lock.try_lock().map_err(|_| {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another metadata node", dir.display()),
            )
        })?;
        remove_unfinished_snapshots(dir);
        let (records, generation) = replay(dir)?;
        let journal = Journal {
            dir: dir.to_path_buf(),
            inner: Mutex::new(Inner {
                generation,
                file: None,
                buf: Vec::new(),
                appended: 0,
                durable: 0,
                flushing: false,
                segment_bytes: 0,
                failed: None,
            }),
            flushed: Condvar::new(),
            snapshotting: Arc::default(),
            _lock: lock,
        };
        Ok((journal, records))
    }

    /// Begins journaling after `state` (the whole rebuilt state, as records): written as a
    /// new snapshot before anything else, so each restart replays from one file.
    pub fn start(&self, state: &[Record]) -> io::Result<()> {
        let mut inner = self.inner.lock().unwrap();
        let generation = inner.generation + 1;
        write_snapshot(&self.dir, generation, state)?;
        self.new_segment(&mut inner, generation)?;
        remove_before(&self.dir, generation);
        Ok(())
    }

    fn new_segment(&self, inner: &mut Inner, generation: u64) -> io::Result<()> {
        let mut f = create_private(&self.dir.join(file_name("journal", generation)))?;
        f.write_all(JOURNAL_MAGIC)?;
        f.sync_all()?;
        sync_dir(&self.dir)?;
        inner.file = Some(Arc::new(f));
        inner.generation = generation;
        inner.segment_bytes = 0;
        Ok(())
    }

    /// Appends `records` as one frame (nothing if there are none): they are durable once
    /// [`Journal::sync`] returns. Call in the order the changes were made. Says whether the
    /// segment is now long enough that a snapshot should follow ([`Journal::snapshot`]).
    pub fn append(&self, records: &[Record]) -> bool {
        if records.is_empty() {
            return false;
        }
        let mut inner = self.inner.lock().unwrap();
        let before = inner.buf.len();
        frame(records, &mut inner.buf);
        inner.segment_bytes += (inner.buf.len() - before) as u64;
        inner.appended += 1;
        inner.segment_bytes >= SNAPSHOT_AFTER
    }

    /// Returns once everything appended so far is durable (or could not be made so).
    pub fn sync(&self) -> io::Result<()> {
        let mut inner = self.inner.lock().unwrap();
        let target = inner.appended;
        loop {
            if let Some(why) = &inner.failed {
                return Err(io::Error::other(format!("the journal failed: {why}")));
            }
            if inner.durable >= target {
                return Ok(());
            }
            if inner.flushing {
                inner = self.flushed.wait(inner).unwrap();
                continue;
            }
            inner = self.flush(inner);
        }
    }

    /// Writes and syncs what is buffered, outside the lock (others keep appending meanwhile,
    /// for the next group).
    fn flush<'a>(&'a self, mut inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        let bytes = std::mem::take(&mut inner.buf);
        let upto = inner.appended;
        let file = inner.file.clone();
        inner.flushing = true;
        drop(inner);
        let written = match &file {
            Some(f) => (&**f).write_all(&bytes).and_then(|()| f.sync_data()),
            None => Err(io::Error::other("appended to before it was started")),
        };
        let mut inner = self.inner.lock().unwrap();
        inner.flushing = false;
        match written {
            Ok(()) => inner.durable = upto,
            Err(e) => {
                log::error!("the journal could not be written: {e}; changes are no longer durable");
                inner.failed = Some(e.to_string());
            }
        }
        self.flushed.notify_all();
        inner
    }

    /// Starts a new segment after `state` (the whole state as records, taken with nothing
    /// appended since): the old segment is flushed, the snapshot written in the background,
    /// and the old files removed once it is whole.
    pub fn snapshot(&self, state: Vec<Record>) {
        let mut inner = self.inner.lock().unwrap();
        while inner.flushing {
            inner = self.flushed.wait(inner).unwrap();
        }
        if inner.durable < inner.appended {
            inner = self.flush(inner);
        }
        if inner.failed.is_some() {
            return;
        }
        let generation = inner.generation + 1;
        if let Err(e) = self.new_segment(&mut inner, generation) {
            log::error!("starting journal segment {generation}: {e}");
            inner.failed = Some(e.to_string());
            return;
        }
        drop(inner);
        let dir = self.dir.clone();
        let one_at_a_time = self.snapshotting.clone();
        let write = move || {
            let _one = one_at_a_time.lock().unwrap();
            match write_snapshot(&dir, generation, &state) {
                Ok(()) => {
                    remove_before(&dir, generation);
                    log::info!("snapshot {generation} written ({} records)", state.len());
                }
                Err(e) => log::error!("writing snapshot {generation}: {e}; replay stays longer"),
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("snapshot".into())
            .spawn(write)
        {
            log::error!("no thread to write snapshot {generation}: {e}");
        }
    }
}

/// State whose changes are journaled: it hands over the records of its changes, and all of
/// itself for a snapshot.
pub trait Durable {
    fn take_records(&mut self, out: &mut Vec<Record>);
    fn records(&self) -> Vec<Record>;
}

/// A mutex over journaled state: whatever a holder of the lock changed is appended to the
/// journal as the lock is let go (so the journal has changes in the order they were made),
/// and a snapshot follows when the journal grew long.
pub struct Journaled<T: Durable> {
    state: Mutex<T>,
    journal: Option<Journal>,
}

/// The lock of a [`Journaled`] state.
pub struct Guard<'a, T: Durable> {
    state: MutexGuard<'a, T>,
    journal: Option<&'a Journal>,
}

impl<T: Durable> Journaled<T> {
    /// `state`, journaled to `journal` if there is one.
    pub fn new(state: T, journal: Option<Journal>) -> Journaled<T> {
        Journaled {
            state: Mutex::new(state),
            journal,
        }
    }

    pub fn lock(&self) -> Guard<'_, T> {
        Guard {
            state: self.state.lock().unwrap_or_else(|p| p.into_inner()),
            journal: self.journal.as_ref(),
        }
    }

    /// Returns once every change made so far is durable: before an answer that depends on
    /// any of them (a reply, a chunk zeroed for reuse, data written where the journal must
    /// first say it may be).
    pub fn sync(&self) -> io::Result<()> {
        match &self.journal {
            Some(j) => j.sync(),
            None => Ok(()),
        }
    }
}

impl<T: Durable> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.state
    }
}

impl<T: Durable> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.state
    }
}

impl<T: Durable> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        let Some(journal) = self.journal else { return };
        let mut records = Vec::new();
        self.state.take_records(&mut records);
        if journal.append(&records) {
            journal.snapshot(self.state.records());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rfs-journal-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn gone(i: u64) -> Record {
        Record::Gone(i)
    }

    #[test]
    fn what_was_synced_comes_back_in_order_across_restarts_and_snapshots() {
        let d = dir("order");
        {
            let (j, found) = Journal::open(&d).unwrap();
            assert!(found.is_empty(), "a new directory");
            j.start(&[Record::NextIno(2)]).unwrap();
            j.append(&[gone(1), gone(2)]);
            j.append(&[]);
            j.append(&[gone(3)]);
            j.sync().unwrap();
            assert!(
                Journal::open(&d).is_err(),
                "a second node cannot use the directory"
            );
        }
        let (j, found) = Journal::open(&d).unwrap();
        assert_eq!(found, [Record::NextIno(2), gone(1), gone(2), gone(3)]);
        j.start(&found).unwrap();
        j.append(&[gone(4)]);
        j.snapshot(found.iter().cloned().chain([gone(4)]).collect());
        j.append(&[gone(5)]);
        j.sync().unwrap();
        // The snapshot thread may or may not have finished: either way nothing is lost.
        drop(j);
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (_, found) = Journal::open(&d).unwrap();
        assert_eq!(
            found,
            [
                Record::NextIno(2),
                gone(1),
                gone(2),
                gone(3),
                gone(4),
                gone(5)
            ]
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_crash_at_any_byte_loses_only_the_unfinished_frame() {
        let d = dir("torn");
        let (j, _) = Journal::open(&d).unwrap();
        j.start(&[]).unwrap();
        let frames: Vec<Vec<Record>> = (0..5).map(|i| vec![gone(i), gone(100 + i)]).collect();
        for f in &frames {
            j.append(f);
            j.sync().unwrap();
        }
        drop(j);
        let segment = d.join(file_name("journal", 1));
        let whole = fs::read(&segment).unwrap();
        for cut in 0..=whole.len() {
            fs::write(&segment, &whole[..cut]).unwrap();
            let (j, found) = Journal::open(&d).unwrap();
            let whole_frames = found.len() / 2;
            assert_eq!(found, frames[..whole_frames].concat(), "cut at {cut}");
            drop(j);
            assert!(
                fs::metadata(&segment).unwrap().len() <= cut.max(JOURNAL_MAGIC.len()) as u64,
                "the torn tail is cut off (a torn header made whole)"
            );
        }
        // Bytes that are not a journal's header are not a crash either.
        fs::write(&segment, b"RFSJRNLX").unwrap();
        let refused = Journal::open(&d).err().expect("refused");
        assert!(
            refused.to_string().contains("not an rfs state file"),
            "{refused}"
        );
        // A damaged frame with whole frames after it is not a crash: refused, not skipped.
        let mut bad = whole.clone();
        bad[JOURNAL_MAGIC.len() + 9] ^= 0xff;
        fs::write(&segment, &bad).unwrap();
        let refused = Journal::open(&d).err().expect("refused");
        assert!(refused.to_string().contains("damaged"), "{refused}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_stop_while_a_segment_or_snapshot_is_begun_restarts_every_time() {
        let d = dir("begun");
        let (j, _) = Journal::open(&d).unwrap();
        j.start(&[Record::NextIno(2)]).unwrap();
        j.append(&[gone(1)]);
        j.sync().unwrap();
        drop(j);
        // Stopped after creating the next segment, before its header was written; and while
        // a snapshot was being written aside.
        fs::write(d.join(file_name("journal", 2)), b"").unwrap();
        fs::write(d.join(format!("{}.tmp", file_name("snapshot", 2))), b"RFS").unwrap();
        for restart in 0..3 {
            let (j, found) = Journal::open(&d).unwrap();
            assert_eq!(found, [Record::NextIno(2), gone(1)], "restart {restart}");
            if restart == 0 {
                // Stopped again before starting: the emptied segment must read as one.
                continue;
            }
            j.start(&found).unwrap();
        }
        let left: Vec<String> = fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!left.iter().any(|n| n.ends_with(".tmp")), "{left:?}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_state_is_readable_by_its_owner_only() {
        let d = dir("private");
        fs::create_dir_all(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(d.join("lock"), b"").unwrap();
        fs::set_permissions(d.join("lock"), fs::Permissions::from_mode(0o644)).unwrap();
        let (j, _) = Journal::open(&d).unwrap();
        j.start(&[Record::NextIno(2)]).unwrap();
        j.append(&[gone(1)]);
        j.sync().unwrap();
        j.snapshot(vec![Record::NextIno(2), gone(1)]);
        drop(j);
        std::thread::sleep(std::time::Duration::from_millis(100));
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&d), 0o700);
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            assert_eq!(mode(&p), 0o600, "{}", p.display());
        }
        let fresh = dir("private-new").join("state");
        drop(Journal::open(&fresh).unwrap());
        assert_eq!(mode(&fresh), 0o700);
        fs::remove_dir_all(&d).unwrap();
        fs::remove_dir_all(fresh.parent().unwrap()).unwrap();
    }
}
