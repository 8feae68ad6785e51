//! rdmabox-bench: the RDMABox mechanisms measured between two processes.
//!
//! `rdmabox-bench` starts a lender process (itself, `serve`) that registers memory and does
//! nothing else, then runs, in one go: the paper's Table I (threads x size x pattern x
//! merging/chaining), its Fig. 2/9 (polling modes: CPU and wake-ups at low and high load), its
//! Fig. 8 (a window sweep past the peak number of threads) and a QP sweep. Each cell prints
//! throughput, p50/p99/p99.9 latency, client and lender CPU time, and work-request and doorbell
//! counts. Ratios are measured side by side in one run.

use clap::Parser;
use rdmabox::transport::Context;

use cli::{Cli, Cmd};
use lender::{raise_fd_limit, serve, transport, Lender};
use sweeps::{mr, polling, qps, scale, table1, window};

mod cli;
mod lender;
mod load;
mod sweeps;

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
