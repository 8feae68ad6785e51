//! Crash runs: the metadata node (lending nothing, with a state directory) is killed and
//! started again every 0.3-2 s while writers create, write and fsync, cut and remove files
//! through one mount; then another mount reads every file back against the writers' model.
//! Whatever a kill interrupts may or may not have happened, but nothing fsynced is lost, and
//! no file ever holds a byte another file was given: every 8-byte word written names its file.
//!
//! `RFS_CRASH_SECS` runs it longer than the suite's default (hundreds of kills for issue 36's
//! goal: `RFS_CRASH_SECS=600 cargo test -p rfs-e2e --test crash -- --nocapture`).

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rfs_e2e::rng::Rng;
use rfs_e2e::{MemServer, Mount};

/// A tiny deterministic generator: the model needs no crate.
const MIB: u64 = 1 << 20;
/// What files a run writes: up to `max_len` bytes each, `max_write` bytes at a time.
#[derive(Clone, Copy)]
struct Shape {
    max_len: u64,
    max_write: u64,
}

/// Files of several 1 MiB chunks each.
const LARGE: Shape = Shape {
    max_len: 3 * MIB,
    max_write: 256 << 10,
};
/// Small files, within a chunk: spans of a few pages that grow, move and are trimmed.
const SMALL: Shape = Shape {
    max_len: 64 << 10,
    max_write: 8 << 10,
};
const WRITERS: u64 = 4;
const FILES_PER_WRITER: usize = 3;

/// The 8-byte word written at `offset` of file `id` by write number `seq`: its top 16 bits
/// name the file (never 0, so that a word of zeros is told apart).
fn word(id: u64, seq: u64, offset: u64) -> [u8; 8] {
    (((id + 1) & 0xffff) << 48 | (seq & 0xff_ffff) << 24 | (offset / 8) & 0xff_ffff).to_le_bytes()
}

fn owner_of(w: &[u8]) -> u64 {
    u64::from_le_bytes(w.try_into().unwrap()) >> 48
}

/// What a writer knows of one of its files.
struct Tracked {
    id: u64,
    /// Its content, if every change to it was answered; None once a change failed (the
    /// kill hid whether it happened): then only whose words it holds is checked.
    content: Option<Vec<u8>>,
    /// A write of it was answered: it exists.
    made: bool,
}

fn name_of(id: u64) -> String {
    format!("f{id}")
}

/// Totals of a run, printed at its end.
#[derive(Default)]
struct Tally {
    synced_writes: AtomicU64,
    failed_changes: AtomicU64,
    kills: AtomicU64,
}

/// One writer's files, changed until `stop`: writes at 8-byte-aligned offsets (fsynced),
/// cuts, and removals with a new file in the slot. Returns its files (and names it gave up
/// on, whose fate a kill hid).
fn writer(
    m: &Mount,
    shape: Shape,
    w: u64,
    next_id: &AtomicU64,
    stop: &AtomicBool,
    tally: &Tally,
) -> (Vec<Tracked>, Vec<u64>) {
    let mut rng = Rng(w * 7919 + 1);
    let mut files: Vec<Tracked> = Vec::new();
    let mut abandoned = Vec::new();
    let mut seq = 0u64;
    let fresh = |files: &mut Vec<Tracked>| {
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        files.push(Tracked {
            id,
            content: Some(Vec::new()),
            made: false,
        });
    };
    for _ in 0..FILES_PER_WRITER {
        fresh(&mut files);
    }
    while !stop.load(Ordering::Relaxed) {
        let slot = rng.below(files.len() as u64) as usize;
        let f = &mut files[slot];
        let path = m.path(&name_of(f.id));
        // Cuts and removals of a file not made yet would only fail; a file whose content a kill
        // hid is replaced, so that most files stay checked byte for byte however long the run.
        let roll = match (f.made, &f.content) {
            (_, None) => 99,
            (true, Some(_)) => rng.below(100),
            (false, Some(_)) => 0,
        };
        seq += 1;
        if roll < 80 {
            let offset = rng.below(shape.max_len / 8) * 8;
            let len = (1 + rng.below(shape.max_write) / 8) * 8;
            let len = len.min(shape.max_len - offset);
            let mut data = Vec::with_capacity(len as usize);
            for at in (offset..offset + len).step_by(8) {
                data.extend_from_slice(&word(f.id, seq, at));
            }
            let done = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .and_then(|h| h.write_all_at(&data, offset).and_then(|()| h.sync_all()));
            f.made |= done.is_ok();
            match (done, &mut f.content) {
                (Ok(()), Some(c)) => {
                    let end = (offset + len) as usize;
                    if c.len() < end {
                        c.resize(end, 0);
                    }
                    c[offset as usize..end].copy_from_slice(&data);
                    tally.synced_writes.fetch_add(1, Ordering::Relaxed);
                }
                (Ok(()), None) => {
                    tally.synced_writes.fetch_add(1, Ordering::Relaxed);
                }
                (Err(e), _) => {
                    println!("writer {w}: writing {}: {e}", name_of(f.id));
                    tally.failed_changes.fetch_add(1, Ordering::Relaxed);
                    f.content = None;
                }
            }
        } else if roll < 90 {
            let Some(c) = &f.content else { continue };
            let size = rng.below(c.len() as u64 / 8 + 1) * 8;
            let done = OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|h| h.set_len(size).and_then(|()| h.sync_all()));
            match done {
                Ok(()) => {
                    if let Some(c) = &mut f.content {
                        c.truncate(size as usize);
                    }
                }
                Err(e) => {
                    println!("writer {w}: cutting {}: {e}", name_of(f.id));
                    tally.failed_changes.fetch_add(1, Ordering::Relaxed);
                    f.content = None;
                }
            }
        } else {
            let gone = files.remove(slot);
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !gone.made => {}
                Err(e) => {
                    println!("writer {w}: removing {}: {e}", name_of(gone.id));
                    tally.failed_changes.fetch_add(1, Ordering::Relaxed);
                    abandoned.push(gone.id);
                }
            }
            fresh(&mut files);
        }
    }
    (files, abandoned)
}

/// Checks file `id` at `path` as read through another mount: byte for byte against `content`
/// if known, and in any case holding no word of another file's. Bytes checked.
fn check(path: &Path, id: u64, content: Option<&[u8]>) -> u64 {
    let got = match fs::read(path) {
        Ok(g) => g,
        // Never made (no write of it got through), or its removal's fate hidden by a kill.
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound && content.is_none_or(|c| c.is_empty()) =>
        {
            return 0
        }
        Err(e) => panic!("{}: {e}", path.display()),
    };
    for (i, w) in got.chunks(8).enumerate() {
        let owner = if w.len() == 8 { owner_of(w) } else { 0 };
        assert!(
            w.iter().all(|&b| b == 0) || owner == (id + 1) & 0xffff,
            "{}: the word at {} belongs to file {}: {:02x?}",
            path.display(),
            i * 8,
            owner.wrapping_sub(1),
            w
        );
    }
    if let Some(c) = content {
        assert_eq!(got.len(), c.len(), "{}: size", path.display());
        if let Some(at) = got.iter().zip(c).position(|(a, b)| a != b) {
            panic!(
                "{}: differs from what was fsynced at byte {at} of {}",
                path.display(),
                c.len()
            );
        }
    }
    got.len() as u64
}

/// Kills and restarts the metadata node every 0.3-2 s for `secs` under fsyncing writers on
/// a file system with `replicas` copies on three data nodes, then checks every file.
fn crash_run(name: &str, replicas: &str, shape: Shape, secs: u64) {
    let secs = std::env::var("RFS_CRASH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(secs);
    let mut meta = MemServer::durable_meta(name, &["--replicas", replicas]);
    let _data: Vec<MemServer> = (0..3)
        .map(|_| MemServer::data(&meta, "192M", "1M"))
        .collect();
    let writing = Mount::new(&meta, &[]);
    let (stop, next_id, tally) = (AtomicBool::new(false), AtomicU64::new(0), Tally::default());
    let results = Mutex::new(HashMap::new());
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let (writing, stop, next_id, tally, results) =
                (&writing, &stop, &next_id, &tally, &results);
            s.spawn(move || {
                let out = writer(writing, shape, w, next_id, stop, tally);
                results.lock().unwrap().insert(w, out);
            });
        }
        let mut rng = Rng(secs + 17);
        let until = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(300 + rng.below(1700)));
            meta.restart();
            tally.kills.fetch_add(1, Ordering::Relaxed);
        }
        // The writers' last changes go to a node that stays up.
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
    });
    let reading = Mount::new(&meta, &[]);
    let mut checked = 0;
    let mut known = 0;
    for (files, abandoned) in results.into_inner().unwrap().into_values() {
        for f in files {
            known += u64::from(f.content.is_some());
            checked += check(&reading.path(&name_of(f.id)), f.id, f.content.as_deref());
        }
        for id in abandoned {
            checked += check(&reading.path(&name_of(id)), id, None);
        }
    }
    let (kills, synced, failed) = (
        tally.kills.load(Ordering::Relaxed),
        tally.synced_writes.load(Ordering::Relaxed),
        tally.failed_changes.load(Ordering::Relaxed),
    );
    println!(
        "{name}, replicas {replicas}: {kills} kills in {secs} s, {synced} fsynced writes, {failed} \
         changes failed, {checked} bytes checked ({known} files byte for byte)"
    );
    // Minima that hold on a loaded machine too: the checks above are what the run is for.
    assert!(kills >= 2, "only {kills} kills");
    assert!(
        synced >= 5 * WRITERS,
        "writers got little through: {synced}"
    );
    assert!(known > 0, "every file's fate was hidden by a kill");
}

#[test]
fn metadata_kills_under_fsynced_writers_at_two_replicas_lose_and_mix_nothing() {
    crash_run("crash-r2", "2", LARGE, 30);
}

#[test]
fn metadata_kills_under_fsynced_writers_at_one_replica_lose_and_mix_nothing() {
    crash_run("crash-r1", "1", LARGE, 20);
}

#[test]
fn metadata_kills_under_small_file_writers_lose_and_mix_nothing() {
    crash_run("crash-small", "1", SMALL, 15);
}
