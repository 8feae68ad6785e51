//! Driving a session: threads posting reads or writes of one size and pattern for a while,
//! and the table rows that report them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmabox::transport::{Context, ProviderKind, QpRoute, RemoteAddr, RemoteRegion};
use rdmabox::{connect_queue_pairs, Session, SessionConfig, Snapshot};

use crate::lender::{self_cpu, transport, Lender, RESPONDER_FLAG};

/// A session to the lender, with the control connection that keeps the lender's side alive.
pub(crate) fn open_session(
    lender: &Lender,
    kind: ProviderKind,
    cfg: SessionConfig,
    lender_responder: bool,
) -> (Session, RemoteRegion, TcpStream) {
    let ctx = Context::open(&transport(kind)).expect("open transport");
    let pd = Arc::new(ctx.alloc_pd().expect("pd"));
    let mut s = TcpStream::connect(lender.addr).expect("connect to lender");
    let flag = if lender_responder { RESPONDER_FLAG } else { 0 };
    s.write_all(&(cfg.qps as u32 | flag).to_le_bytes()).unwrap();
    let qps = connect_queue_pairs(&ctx, &pd, &mut s, cfg.qps, cfg.caps, &QpRoute::OwnPort)
        .expect("connect qps");
    let mut m = [0u8; 20];
    s.read_exact(&mut m).unwrap();
    let r = RemoteRegion {
        addr: u64::from_le_bytes(m[..8].try_into().unwrap()),
        len: u64::from_le_bytes(m[8..16].try_into().unwrap()),
        rkey: u32::from_le_bytes(m[16..].try_into().unwrap()),
    };
    (Session::new(pd, qps, vec![r], cfg).expect("session"), r, s)
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    Seq,
    Rand,
}

#[derive(Clone, Copy)]
pub(crate) enum Op {
    Read,
    Write,
}

pub(crate) struct Cell {
    pub(crate) mbps: f64,
    pub(crate) iops: f64,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) p999: f64,
    pub(crate) cpu_client: f64,
    pub(crate) cpu_lender: f64,
    pub(crate) counters: Snapshot,
}

/// What one measured cell runs.
#[derive(Clone, Copy)]
pub(crate) struct Load {
    pub(crate) threads: usize,
    /// Requests each thread keeps in flight (1: a synchronous caller, like one FUSE thread;
    /// more: like kernel readahead and writeback).
    pub(crate) depth: usize,
    pub(crate) size: usize,
    pub(crate) pattern: Pattern,
    pub(crate) op: Op,
    /// Pause after each completion (low-load runs).
    pub(crate) think: Duration,
}

/// 16 synchronous callers reading 4 KiB at random places.
pub(crate) const RANDOM_4K_READS: Load = Load {
    threads: 16,
    depth: 1,
    size: 4096,
    pattern: Pattern::Rand,
    op: Op::Read,
    think: Duration::ZERO,
};

/// `threads` closed-loop workers with `depth` requests in flight each, for `secs`.
pub(crate) fn run_cell(
    lender: &Lender,
    kind: ProviderKind,
    cfg: SessionConfig,
    load: Load,
    secs: f64,
) -> Cell {
    let (session, r, _control) = open_session(lender, kind, cfg, false);
    drive(lender, &[Arc::new(session)], r, load, secs)
}

/// Runs `load` over `sessions` (worker `t` on session `t % len`) for `secs`.
pub(crate) fn drive(
    lender: &Lender,
    sessions: &[Arc<Session>],
    r: RemoteRegion,
    load: Load,
    secs: f64,
) -> Cell {
    let Load {
        threads,
        depth,
        size,
        pattern,
        op,
        think,
    } = load;
    let session = &sessions[0];
    let span = (r.len as usize / size).max(1) as u64;
    let cursor = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let warm = session.counters();
    let (cpu0, lcpu0) = (self_cpu(), lender.cpu());
    let t0 = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let session = sessions[t % sessions.len()].clone();
            let (cursor, stop) = (cursor.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut lat = Vec::new();
                let mut rng = 0x9e37_79b9u64 ^ ((t as u64 + 1) * 0x1234_5678_9abc);
                let (tx, rx) = crossbeam_channel::unbounded();
                let mut submit = |buf: Vec<u8>| {
                    let block = match pattern {
                        Pattern::Seq => cursor.fetch_add(1, Ordering::Relaxed) % span,
                        Pattern::Rand => {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng % span
                        }
                    };
                    let at = RemoteAddr {
                        addr: r.addr + block * size as u64,
                        rkey: r.rkey,
                    };
                    let start = Instant::now();
                    let tx = tx.clone();
                    let done: rdmabox::session::Callback =
                        Box::new(move |res| drop(tx.send((start.elapsed(), res))));
                    match op {
                        Op::Read => session.read(at, buf, done),
                        Op::Write => session.write(at, buf, done),
                    }
                };
                for _ in 0..depth {
                    submit(vec![0xa5u8; size]);
                }
                let mut outstanding = depth;
                while outstanding > 0 {
                    let (took, res) = rx.recv().expect("completions arrive");
                    outstanding -= 1;
                    lat.push(took.as_nanos() as u64);
                    let buf = res.expect("benchmark request failed");
                    if !stop.load(Ordering::Relaxed) {
                        if !think.is_zero() {
                            std::thread::sleep(think);
                        }
                        submit(buf);
                        outstanding += 1;
                    }
                }
                lat
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let mut lat: Vec<u64> = workers
        .into_iter()
        .flat_map(|w| w.join().expect("worker"))
        .collect();
    let elapsed = t0.elapsed().as_secs_f64();
    let counters = session.counters().since(&warm);
    let (cpu1, lcpu1) = (self_cpu(), lender.cpu());
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .map_or(0.0, |&ns| ns as f64 / 1000.0)
    };
    Cell {
        mbps: lat.len() as f64 * size as f64 / elapsed / 1e6,
        iops: lat.len() as f64 / elapsed,
        p50: pct(0.50),
        p99: pct(0.99),
        p999: pct(0.999),
        cpu_client: cpu1 - cpu0,
        cpu_lender: lcpu1 - lcpu0,
        counters,
    }
}

pub(crate) fn size_name(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else {
        format!("{}K", b >> 10)
    }
}

pub(crate) fn header(extra: &str) {
    println!(
        "| {extra} | MB/s | kIOPS | p50 us | p99 us | p99.9 us | CPU client s | CPU lender s | WRs/req | doorbells/req |"
    );
    println!("|{}", "---|".repeat(10 + extra.matches('|').count()));
}

pub(crate) fn row(label: &str, c: &Cell) {
    let req = c.counters.requests.max(1) as f64;
    println!(
        "| {label} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.3} | {:.3} |",
        c.mbps,
        c.iops / 1e3,
        c.p50,
        c.p99,
        c.p999,
        c.cpu_client,
        c.cpu_lender,
        c.counters.work_requests as f64 / req,
        c.counters.doorbells as f64 / req,
    );
}
