//! rdmabox-bench: the RDMABox mechanisms measured between two processes.
//!
//! `rdmabox-bench` starts a lender process (itself, `serve`) that registers memory and does
//! nothing else, then runs, in one go: the paper's Table I (threads x size x pattern x
//! merging/chaining), its Fig. 2/9 (polling modes: CPU and wake-ups at low and high load), its
//! Fig. 8 (a window sweep past the peak number of threads) and a QP sweep. Each cell prints
//! throughput, p50/p99/p99.9 latency, client and lender CPU time, and work-request and doorbell
//! counts. Ratios are measured side by side in one run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rdmabox::size::parse_size;
use rdmabox::transport::{
    Access, Context, ProviderKind, QpCaps, QpRoute, RemoteAddr, RemoteRegion, TransportConfig,
};
use rdmabox::{connect_links, PollMode, Session, SessionConfig, Snapshot, WindowConfig};

#[derive(Parser)]
#[command(about = "Measures the RDMABox mechanisms between two processes")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Transport provider: auto, verbs or tcp.
    #[arg(long, default_value = "auto", global = true)]
    transport: ProviderKind,
    /// Seconds per measured cell.
    #[arg(long, default_value_t = 1.0)]
    secs: f64,
    /// Use a lender already running at this address instead of starting one.
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Which tables to print: all, or a list of table1, polling, window, qps, mr, scale.
    #[arg(long, default_value = "all")]
    only: String,
    /// Remote memory used by the workload.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    memory: u64,
}

#[derive(Subcommand)]
enum Cmd {
    /// Lend memory: register it and serve one-sided I/O until killed.
    Serve {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        memory: u64,
    },
}

/// A thousand queue pairs take a thousand descriptors on each side: lift the soft limit to the
/// hard one (the lender, our child, inherits it).
fn raise_fd_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid rlimit on our stack.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

fn transport(kind: ProviderKind) -> TransportConfig {
    TransportConfig::with_provider(kind)
}

/// Set in a session's queue-pair count: the lender's side of its queue pairs is responder-only.
const RESPONDER_FLAG: u32 = 1 << 31;

/// The lender: one region, any number of sessions; each connection says how many QPs it wants,
/// and whether the lender's side of them is responder-only.
fn serve(kind: ProviderKind, listen: SocketAddr, memory: u64) -> std::io::Result<()> {
    let ctx = Arc::new(Context::open(&transport(kind))?);
    let pd = Arc::new(ctx.alloc_pd()?);
    let mem = Arc::new(pd.alloc_region(memory as usize, Access::ALL)?);
    let l = TcpListener::bind(listen)?;
    println!("{}", l.local_addr()?);
    std::io::stdout().flush()?;
    for conn in l.incoming() {
        let mut s = conn?;
        let (ctx, pd, mem) = (ctx.clone(), pd.clone(), mem.clone());
        std::thread::spawn(move || -> std::io::Result<()> {
            let mut n = [0u8; 4];
            s.read_exact(&mut n)?;
            let asked = u32::from_le_bytes(n);
            let qps = (asked & !RESPONDER_FLAG).clamp(1, 64) as usize;
            let caps = if asked & RESPONDER_FLAG != 0 {
                QpCaps::RESPONDER
            } else {
                SessionConfig::default().caps
            };
            let links = connect_links(&ctx, &pd, &mut s, qps, caps, &QpRoute::OwnPort)?;
            let r = mem.remote();
            let mut msg = r.addr.to_le_bytes().to_vec();
            msg.extend_from_slice(&r.len.to_le_bytes());
            msg.extend_from_slice(&r.rkey.to_le_bytes());
            s.write_all(&msg)?;
            let _ = s.read(&mut n); // until the client goes
            drop(links);
            Ok(())
        });
    }
    Ok(())
}

struct Lender {
    addr: SocketAddr,
    child: Option<Child>,
}

impl Lender {
    fn start(cli: &Cli) -> Lender {
        if let Some(addr) = cli.connect {
            return Lender { addr, child: None };
        }
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args([
                "--transport",
                &cli.transport.to_string(),
                "serve",
                "--memory",
            ])
            .arg(cli.memory.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the lender");
        let mut out = child.stdout.take().expect("piped");
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while out.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        let addr = String::from_utf8_lossy(&line)
            .trim()
            .parse()
            .expect("lender address");
        Lender {
            addr,
            child: Some(child),
        }
    }

    /// The lender's CPU seconds so far (0 when it is not our child).
    fn cpu(&self) -> f64 {
        self.child.as_ref().map_or(0.0, |c| proc_cpu(c.id()))
    }
}

impl Drop for Lender {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn proc_cpu(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15; `after` starts at field 3.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| f.get(i)?.parse::<f64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

fn self_cpu() -> f64 {
    proc_cpu(std::process::id())
}

/// A session to the lender, with the control connection that keeps the lender's side alive.
fn open_session(
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
    let links = connect_links(&ctx, &pd, &mut s, cfg.qps, cfg.caps, &QpRoute::OwnPort)
        .expect("connect qps");
    let mut m = [0u8; 20];
    s.read_exact(&mut m).unwrap();
    let r = RemoteRegion {
        addr: u64::from_le_bytes(m[..8].try_into().unwrap()),
        len: u64::from_le_bytes(m[8..16].try_into().unwrap()),
        rkey: u32::from_le_bytes(m[16..].try_into().unwrap()),
    };
    (
        Session::new(pd, links, vec![r], cfg).expect("session"),
        r,
        s,
    )
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pattern {
    Seq,
    Rand,
}

#[derive(Clone, Copy)]
enum Op {
    Read,
    Write,
}

struct Cell {
    mbps: f64,
    iops: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    cpu_client: f64,
    cpu_lender: f64,
    counters: Snapshot,
}

/// What one measured cell runs.
#[derive(Clone, Copy)]
struct Load {
    threads: usize,
    /// Requests each thread keeps in flight (1: a synchronous caller, like one FUSE thread;
    /// more: like kernel readahead and writeback).
    depth: usize,
    size: usize,
    pattern: Pattern,
    op: Op,
    /// Pause after each completion (low-load runs).
    think: Duration,
}

/// 16 synchronous callers reading 4 KiB at random places.
const RANDOM_4K_READS: Load = Load {
    threads: 16,
    depth: 1,
    size: 4096,
    pattern: Pattern::Rand,
    op: Op::Read,
    think: Duration::ZERO,
};

/// `threads` closed-loop workers with `depth` requests in flight each, for `secs`.
fn run_cell(
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
fn drive(
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

fn size_name(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{}M", b >> 20)
    } else {
        format!("{}K", b >> 10)
    }
}

fn header(extra: &str) {
    println!(
        "| {extra} | MB/s | kIOPS | p50 us | p99 us | p99.9 us | CPU client s | CPU lender s | WRs/req | doorbells/req |"
    );
    println!("|{}", "---|".repeat(10 + extra.matches('|').count()));
}

fn row(label: &str, c: &Cell) {
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

fn mechanisms() -> Vec<(&'static str, SessionConfig)> {
    let base = SessionConfig::default();
    vec![
        (
            "single I/O",
            SessionConfig {
                merge: false,
                chain: false,
                ..base.clone()
            },
        ),
        (
            "chaining",
            SessionConfig {
                merge: false,
                ..base.clone()
            },
        ),
        (
            "merging",
            SessionConfig {
                chain: false,
                ..base.clone()
            },
        ),
        ("merging+chaining", base),
    ]
}

fn table1(cli: &Cli, lender: &Lender) {
    println!("\n## Table I: merging and chaining (window 7 MiB, 4 QPs, adaptive polling)\n");
    header("op | threads x depth | size | pattern | mechanism");
    for op in [Op::Write, Op::Read] {
        for (threads, depth) in [(1usize, 1usize), (8, 1), (1, 8), (8, 4), (32, 1)] {
            for size in [4096usize, 128 << 10] {
                for pattern in [Pattern::Seq, Pattern::Rand] {
                    let mut single = 0.0;
                    for (name, cfg) in mechanisms() {
                        let load = Load {
                            threads,
                            depth,
                            size,
                            pattern,
                            op,
                            think: Duration::ZERO,
                        };
                        let c = run_cell(lender, cli.transport, cfg, load, cli.secs);
                        if name == "single I/O" {
                            single = c.mbps;
                        }
                        let label = format!(
                            "{} | {threads}x{depth} | {} | {} | {name} ({:.2}x)",
                            match op {
                                Op::Read => "read",
                                Op::Write => "write",
                            },
                            size_name(size),
                            if pattern == Pattern::Seq {
                                "seq"
                            } else {
                                "rand"
                            },
                            c.mbps / single.max(1e-9)
                        );
                        row(&label, &c);
                    }
                }
            }
        }
    }
}

fn polling(cli: &Cli, lender: &Lender) {
    println!("\n## Polling modes (Fig. 2, 9): 4 KiB writes; low load = 1 thread pausing 200 us, high load = 16 threads\n");
    header("load | mode | wake-ups | empty polls");
    let modes = [
        PollMode::Busy,
        PollMode::Event,
        PollMode::EventBatch,
        PollMode::default(),
    ];
    for (load, threads, think) in [
        ("low", 1, Duration::from_micros(200)),
        ("high", 16, Duration::ZERO),
    ] {
        for mode in modes {
            let cfg = SessionConfig {
                polling: mode,
                ..SessionConfig::default()
            };
            let work = Load {
                threads,
                depth: 1,
                size: 4096,
                pattern: Pattern::Rand,
                op: Op::Write,
                think,
            };
            let c = run_cell(lender, cli.transport, cfg, work, cli.secs);
            row(
                &format!(
                    "{load} | {mode} | {} | {}",
                    c.counters.event_wakeups, c.counters.polls_empty
                ),
                &c,
            );
        }
    }
}

fn window(cli: &Cli, lender: &Lender) {
    println!("\n## Window sweep (Fig. 8): 128 KiB sequential writes\n");
    header("window | threads | peak in flight KiB | stalls");
    let windows = [
        WindowConfig::Off,
        WindowConfig::Static(1 << 20),
        WindowConfig::Static(7 << 20),
        "adaptive".parse().expect("valid"),
    ];
    for w in windows {
        for threads in [1usize, 4, 16, 64, 128] {
            let cfg = SessionConfig {
                window: w,
                ..SessionConfig::default()
            };
            let load = Load {
                threads,
                depth: 1,
                size: 128 << 10,
                pattern: Pattern::Seq,
                op: Op::Write,
                think: Duration::ZERO,
            };
            let c = run_cell(lender, cli.transport, cfg, load, cli.secs);
            let name = match w {
                WindowConfig::Off => "off".to_string(),
                WindowConfig::Static(b) => format!("{}K", b >> 10),
                WindowConfig::Adaptive { .. } => "adaptive".into(),
            };
            row(
                &format!(
                    "{name} | {threads} | {} | {}",
                    c.counters.inflight_peak >> 10,
                    c.counters.window_stalls
                ),
                &c,
            );
        }
    }
}

fn qps(cli: &Cli, lender: &Lender) {
    println!("\n## QP sweep: 16 threads, 4 KiB random reads\n");
    header("QPs");
    for n in [1usize, 2, 4, 8] {
        let cfg = SessionConfig {
            qps: n,
            ..SessionConfig::default()
        };
        let c = run_cell(lender, cli.transport, cfg, RANDOM_4K_READS, cli.secs);
        row(&format!("{n}"), &c);
    }
}

/// (threads, resident KiB) of process `pid`.
fn threads_and_rss(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("Threads:"), field("VmRSS:"))
}

fn scale(cli: &Cli, lender: &Lender) {
    let Some(pid) = lender.child.as_ref().map(|c| c.id()) else {
        println!("\n(scale: needs a lender of our own, not --connect)");
        return;
    };
    println!("\n## Lender cost per queue pair: N queue pairs held open in sessions of 50, 16 threads of 4 KiB random reads over them\n");
    println!(
        "| QPs | lender side | lender threads | lender RSS MiB | IOPS | p99 us | lender CPU s |"
    );
    println!("|---|---|---|---|---|---|---|");
    for n in [10usize, 100, 1000] {
        for (name, responder) in [
            ("engine (2 threads per QP)", false),
            ("responder loop", true),
        ] {
            let (t0, _) = threads_and_rss(pid);
            let mut held = Vec::new();
            let mut left = n;
            let mut r = None;
            while left > 0 {
                let cfg = SessionConfig {
                    qps: left.min(50),
                    ..SessionConfig::default()
                };
                left -= cfg.qps;
                let (session, region, control) =
                    open_session(lender, cli.transport, cfg, responder);
                r = Some(region);
                held.push((Arc::new(session), control));
            }
            std::thread::sleep(Duration::from_millis(300));
            let (threads, rss) = threads_and_rss(pid);
            let sessions: Vec<_> = held.iter().map(|(s, _)| s.clone()).collect();
            let c = drive(
                lender,
                &sessions,
                r.expect("a session"),
                RANDOM_4K_READS,
                cli.secs,
            );
            println!(
                "| {n} | {name} | {} | {:.0} | {:.0} | {:.0} | {:.2} |",
                threads - t0,
                rss as f64 / 1024.0,
                c.iops,
                c.p99,
                c.cpu_lender
            );
            drop(sessions);
            drop(held);
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

fn mr(cli: &Cli, lender: &Lender) {
    println!("\n## preMR (copy into a registered slot) vs dynMR (register the caller's buffer): 4 threads, sequential writes\n");
    header("size | buffers");
    for size in [64usize << 10, 256 << 10, 928 << 10] {
        for (name, threshold) in [("preMR", usize::MAX), ("dynMR", 0)] {
            let cfg = SessionConfig {
                dyn_threshold: threshold,
                ..SessionConfig::default()
            };
            let load = Load {
                threads: 4,
                depth: 1,
                size,
                pattern: Pattern::Seq,
                op: Op::Write,
                think: Duration::ZERO,
            };
            let c = run_cell(lender, cli.transport, cfg, load, cli.secs);
            row(&format!("{} | {name}", size_name(size)), &c);
        }
    }
}

fn main() {
    env_logger::init();
    let cli = Cli::parse();
    raise_fd_limit();
    if let Some(Cmd::Serve { listen, memory }) = cli.cmd {
        if let Err(e) = serve(cli.transport, listen, memory) {
            eprintln!("rdmabox-bench serve: {e}");
            std::process::exit(1);
        }
        return;
    }
    let lender = Lender::start(&cli);
    let probe = Context::open(&transport(cli.transport)).expect("open transport");
    println!(
        "# rdmabox-bench: transport {}, {} s per cell, {} cores",
        probe.describe(),
        cli.secs,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    drop(probe);
    let want = |t: &str| cli.only == "all" || cli.only.split(',').any(|x| x == t);
    if want("table1") {
        table1(&cli, &lender);
    }
    if want("polling") {
        polling(&cli, &lender);
    }
    if want("window") {
        window(&cli, &lender);
    }
    if want("qps") {
        qps(&cli, &lender);
    }
    if want("mr") {
        mr(&cli, &lender);
    }
    if want("scale") {
        scale(&cli, &lender);
    }
}
