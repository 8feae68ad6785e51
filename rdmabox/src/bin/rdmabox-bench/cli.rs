//! The command line.

use std::net::SocketAddr;

use clap::{Parser, Subcommand};
use rdmabox::size::parse_size;
use rdmabox::transport::ProviderKind;

#[derive(Parser)]
#[command(about = "Measures the RDMABox mechanisms between two processes")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Option<Cmd>,
    /// Transport provider: auto, verbs or tcp.
    #[arg(long, default_value = "auto", global = true)]
    pub(crate) transport: ProviderKind,
    /// Seconds per measured cell.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) secs: f64,
    /// Use a lender already running at this address instead of starting one.
    #[arg(long)]
    pub(crate) connect: Option<SocketAddr>,
    /// Which tables to print: all, or a list of table1, polling, window, qps, mr, scale.
    #[arg(long, default_value = "all")]
    pub(crate) only: String,
    /// Remote memory used by the workload.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub(crate) memory: u64,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Lend memory: register it and serve one-sided I/O until killed.
    Serve {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        memory: u64,
    },
}
