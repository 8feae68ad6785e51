//! The tables: Table I, the polling modes, the window and queue-pair sweeps, memory
//! registration, and scale (lender threads at 10 to 1,000 queue pairs).

use std::sync::Arc;
use std::time::Duration;

use rdmabox::{PollMode, SessionConfig, WindowConfig};

use crate::cli::Cli;
use crate::lender::Lender;
use crate::load::{
    drive, header, open_session, row, run_cell, size_name, Load, Op, Pattern, RANDOM_4K_READS,
};

pub(crate) fn mechanisms() -> Vec<(&'static str, SessionConfig)> {
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

pub(crate) fn table1(cli: &Cli, lender: &Lender) {
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

pub(crate) fn polling(cli: &Cli, lender: &Lender) {
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

pub(crate) fn window(cli: &Cli, lender: &Lender) {
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

pub(crate) fn qps(cli: &Cli, lender: &Lender) {
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
pub(crate) fn threads_and_rss(pid: u32) -> (u64, u64) {
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

pub(crate) fn scale(cli: &Cli, lender: &Lender) {
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

pub(crate) fn mr(cli: &Cli, lender: &Lender) {
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
