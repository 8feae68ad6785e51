//! rfs-ring-bench: reads or writes a file of an rfs mount through the ring (rfs-io) or
//! through the mount itself (pread/pwrite), for a while, and prints what it did: MB/s,
//! operations a second, and the host's CPU microseconds per operation (all processes, from
//! /proc/stat), so that the two ways compare side by side in one run.
//!
//!   rfs-ring-bench MOUNT FILE [--via ring|mount] [--op read|write] [--pattern rand|seq]
//!                  [--bs BYTES] [--depth N] [--jobs N] [--seconds S] [--direct on]
//!
//! FILE is relative to MOUNT and must exist (as large as the reads reach). Each job has a ring
//! of its own and keeps `depth` requests in flight (the mount's jobs one each: --depth is
//! the ring's); sequential jobs each take their own stretch of the file. `--direct on` opens
//! the file with O_DIRECT for the mount's reads and writes (around the page cache, as fio's
//! --direct=1); the ring never goes through the page cache. MOUNT may be any directory with
//! `--via mount` (bindfs over tmpfs, say).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfs_io::Ring;

#[derive(Clone)]
struct Job {
    mount: PathBuf,
    file: PathBuf,
    ring: bool,
    write: bool,
    random: bool,
    bs: u64,
    depth: u32,
    jobs: u64,
    seconds: f64,
    direct: bool,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: rfs-ring-bench MOUNT FILE [--via ring|mount] [--op read|write] \
         [--pattern rand|seq] [--bs BYTES] [--depth N] [--jobs N] [--seconds S] [--direct on]"
    );
    ExitCode::from(2)
}

fn parse() -> Option<Job> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mount, file) = (args.first()?, args.get(1)?);
    let mut job = Job {
        mount: mount.into(),
        file: file.into(),
        ring: true,
        write: false,
        random: true,
        bs: 4096,
        depth: 16,
        jobs: 1,
        seconds: 5.0,
        direct: false,
    };
    let mut rest = args[2..].iter();
    while let Some(flag) = rest.next() {
        let value = rest.next()?;
        match flag.as_str() {
            "--via" => job.ring = value == "ring",
            "--op" => job.write = value == "write",
            "--pattern" => job.random = value == "rand",
            "--bs" => job.bs = size(value)?,
            "--depth" => job.depth = value.parse().ok()?,
            "--jobs" => job.jobs = value.parse().ok()?,
            "--seconds" => job.seconds = value.parse().ok()?,
            "--direct" => job.direct = value == "on",
            _ => return None,
        }
    }
    (job.bs > 0 && job.depth.is_power_of_two() && job.jobs > 0).then_some(job)
}

/// `4K`, `1M`, `512`.
fn size(s: &str) -> Option<u64> {
    let (n, unit) = match s.char_indices().find(|(_, c)| c.is_alphabetic()) {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, ""),
    };
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    Some(n.parse::<u64>().ok()? << shift)
}

/// Busy and total jiffies of the whole host, from /proc/stat.
fn cpu() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// A cheap generator of offsets (xorshift).
struct Offsets {
    state: u64,
    next_seq: u64,
    lo: u64,
    blocks: u64,
    bs: u64,
    random: bool,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        if self.random {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            return self.lo + (self.state % self.blocks) * self.bs;
        }
        let at = self.lo + (self.next_seq % self.blocks) * self.bs;
        self.next_seq += 1;
        at
    }
}

fn run(job: &Job, k: u64, stop: &AtomicBool, ops: &AtomicU64) -> std::io::Result<()> {
    let path = job.mount.join(&job.file);
    let mut open = OpenOptions::new();
    open.read(true).write(job.write);
    if job.direct && !job.ring {
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut open, libc::O_DIRECT);
    }
    let file = open.open(&path)?;
    let len = file.metadata()?.len();
    let share = if job.random { len } else { len / job.jobs };
    let blocks = share / job.bs;
    if blocks == 0 {
        return Err(std::io::Error::other(format!(
            "{} is too small for {}-byte blocks",
            path.display(),
            job.bs
        )));
    }
    let mut offsets = Offsets {
        state: 0x9e37_79b9_7f4a_7c15 ^ (k + 1),
        next_seq: 0,
        lo: if job.random { 0 } else { k * share },
        blocks,
        bs: job.bs,
        random: job.random,
    };
    if !job.ring {
        // Aligned for O_DIRECT.
        let mut raw = vec![0xa5u8; job.bs as usize + 4096];
        let at = raw.as_ptr().align_offset(4096);
        let buf = &mut raw[at..at + job.bs as usize];
        while !stop.load(Ordering::Relaxed) {
            let at = offsets.next();
            match job.write {
                true => file.write_all_at(buf, at)?,
                false => file.read_exact_at(buf, at)?,
            }
            ops.fetch_add(1, Ordering::Relaxed);
        }
        return Ok(());
    }
    let depth = job.depth;
    let mut ring = Ring::connect(&job.mount, (job.bs * depth as u64) as usize, depth)?;
    let f = ring.register(&file)?;
    let bs = job.bs as u32;
    let submit = |ring: &mut Ring, slot: u64, at: u64| match job.write {
        true => ring.prep_write(&f, at, bs, slot * job.bs, slot),
        false => ring.prep_read(&f, at, bs, slot * job.bs, slot),
    };
    for slot in 0..depth as u64 {
        submit(&mut ring, slot, offsets.next())?;
    }
    while !stop.load(Ordering::Relaxed) {
        for c in ring.wait(1)? {
            let n = c.result?;
            if n != bs {
                return Err(std::io::Error::other(format!(
                    "a short transfer: {n} bytes"
                )));
            }
            ops.fetch_add(1, Ordering::Relaxed);
            submit(&mut ring, c.user_data, offsets.next())?;
        }
    }
    while ring.in_flight() > 0 {
        ring.wait(ring.in_flight() as usize)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let Some(job) = parse() else {
        return usage();
    };
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let (busy0, _) = cpu();
    let start = Instant::now();
    let threads: Vec<_> = (0..job.jobs)
        .map(|k| {
            let (job, stop, ops) = (job.clone(), stop.clone(), ops.clone());
            std::thread::spawn(move || run(&job, k, &stop, &ops))
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(job.seconds));
    stop.store(true, Ordering::Relaxed);
    let mut failed = false;
    for t in threads {
        if let Err(e) = t.join().expect("a job panicked") {
            eprintln!("rfs-ring-bench: {e}");
            failed = true;
        }
    }
    let took = start.elapsed().as_secs_f64();
    let (busy1, _) = cpu();
    let n = ops.load(Ordering::Relaxed);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let cpu_us = (busy1 - busy0) as f64 / hz * 1e6 / n.max(1) as f64;
    println!(
        "via={} op={} pattern={} bs={} depth={} jobs={}: {:.1} MB/s, {:.0} ops/s, {:.1} us CPU/op",
        match (job.ring, job.direct) {
            (true, _) => "ring",
            (false, true) => "mount-direct",
            (false, false) => "mount",
        },
        if job.write { "write" } else { "read" },
        if job.random { "rand" } else { "seq" },
        job.bs,
        if job.ring { job.depth } else { 1 },
        job.jobs,
        (n * job.bs) as f64 / took / 1e6,
        n as f64 / took,
        cpu_us,
    );
    match failed {
        true => ExitCode::FAILURE,
        false => ExitCode::SUCCESS,
    }
}
