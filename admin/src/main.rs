//! rfs: the cluster's admin tool. It authenticates as any peer does (the shared secret) and
//! asks the metadata node, as root.
//!
//!   rfs status HOST:PORT [--json]   every data node, every client session, copies short

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use nix::unistd::{getegid, geteuid};
use rdmabox::transport::{ProviderKind, TransportConfig};
use rfs_client::{Client, ClientConfig};
use rfs_proto::message::Status;
use rfs_proto::types::{Caller, ClusterStatus};
use rfs_proto::MetadataChannel;

/// Operate an rfs cluster.
#[derive(Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The cluster as the metadata node sees it: data nodes (state, pool, free space), client
    /// sessions (address, age, open files, locks) and chunks short of copies.
    Status {
        /// The metadata node, HOST:PORT.
        server: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// The shared secret of the nodes [default: /etc/rfs/secret for root,
        /// $XDG_CONFIG_HOME/rfs/secret or ~/.config/rfs/secret for others].
        #[arg(long, value_name = "PATH")]
        secret_file: Option<PathBuf>,
        /// Transport: auto (verbs when an RDMA device exists), verbs or tcp.
        #[arg(long, default_value = "auto")]
        transport: ProviderKind,
    },
}

fn main() -> ExitCode {
    let Command::Status {
        server,
        json,
        secret_file,
        transport,
    } = Args::parse().command;
    let secret = match rfs_daemon::secret::for_peer(secret_file.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rfs: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = ClientConfig {
        transport: TransportConfig::with_provider(transport),
        secret,
        ..ClientConfig::default()
    };
    let client = match Client::connect(&server, cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rfs: cannot reach {server}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let caller = Caller {
        uid: geteuid().as_raw(),
        gid: getegid().as_raw(),
        groups: Vec::new(),
    };
    match client.call(Status { caller }) {
        Ok(status) if json => println!("{}", as_json(&status)),
        Ok(status) => print!("{}", as_text(&server, &status)),
        Err(e) => {
            eprintln!("rfs: status of {server}: {e} (it is for root)");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

fn as_text(server: &str, s: &ClusterStatus) -> String {
    let up = s.nodes.iter().filter(|n| n.state == "up").count();
    let mut out = format!(
        "rfs at {server}: {} data nodes ({up} up), {} cop{} of each chunk, {} chunks short of \
         copies, {} of {} inodes\n\n",
        s.nodes.len(),
        s.replicas,
        if s.replicas == 1 { "y" } else { "ies" },
        s.chunks_short,
        s.inodes,
        s.inodes_max
    );
    out += &format!(
        "{:<5} {:<24} {:<6} {:>12} {:>12} {:>12}\n",
        "NODE", "ADDRESS", "STATE", "POOL", "USED", "FREE CHUNKS"
    );
    for n in &s.nodes {
        let meta = if n.meta { "  (the metadata node)" } else { "" };
        out += &format!(
            "{:<5} {:<24} {:<6} {:>12} {:>12} {:>12}{meta}\n",
            n.id,
            n.addr,
            n.state,
            mib(n.pool_bytes),
            mib(n.pool_bytes.saturating_sub(n.free_bytes)),
            n.free_chunks
        );
    }
    out += &format!(
        "\n{:<18} {:<24} {:<10} {:>9} {:>10} {:>6}\n",
        "CLIENT", "ADDRESS", "CONNECTED", "AGE", "OPEN FILES", "LOCKS"
    );
    for c in &s.clients {
        let open = c.open_files.map_or("busy".into(), |n| n.to_string());
        out += &format!(
            "{:<18} {:<24} {:<10} {:>8}s {:>10} {:>6}\n",
            format!("{:016x}", c.client),
            c.addr,
            if c.connected { "yes" } else { "no (grace)" },
            c.age_secs,
            open,
            c.locks
        );
    }
    out
}

/// A JSON string.
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            c if (c as u32) < 0x20 => out += &format!("\\u{:04x}", c as u32),
            c => out.push(c),
        }
    }
    out + "\""
}

fn as_json(s: &ClusterStatus) -> String {
    let nodes: Vec<String> = s
        .nodes
        .iter()
        .map(|n| {
            format!(
                "{{\"id\":{},\"address\":{},\"state\":{},\"metadata\":{},\"pool_bytes\":{},\
                 \"used_bytes\":{},\"free_bytes\":{},\"free_chunks\":{}}}",
                n.id,
                quoted(&n.addr),
                quoted(&n.state),
                n.meta,
                n.pool_bytes,
                n.pool_bytes.saturating_sub(n.free_bytes),
                n.free_bytes,
                n.free_chunks
            )
        })
        .collect();
    let clients: Vec<String> = s
        .clients
        .iter()
        .map(|c| {
            format!(
                "{{\"client\":\"{:016x}\",\"address\":{},\"connected\":{},\"age_secs\":{},\
                 \"open_files\":{},\"locks\":{}}}",
                c.client,
                quoted(&c.addr),
                c.connected,
                c.age_secs,
                c.open_files.map_or("null".into(), |n| n.to_string()),
                c.locks
            )
        })
        .collect();
    format!(
        "{{\"nodes\":[{}],\"clients\":[{}],\"replicas\":{},\"chunks_short\":{},\
         \"chunk_size\":{},\"inodes\":{},\"inodes_max\":{}}}",
        nodes.join(","),
        clients.join(","),
        s.replicas,
        s.chunks_short,
        s.chunk_size,
        s.inodes,
        s.inodes_max
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_quoted_as_json_wants() {
        assert_eq!(quoted("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
