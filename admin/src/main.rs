//! rfs: the cluster's admin tool. It authenticates as any peer does (the shared secret) and
//! asks the metadata node, as root.
//!
//!   rfs status HOST:PORT [--json]   every data node, every client session, copies short
//!   rfs drain HOST:PORT NODE        moves every copy off a data node, then says it may stop
//!   rfs remove HOST:PORT NODE       forgets a data node that is down or away
//!   rfs rebalance HOST:PORT         evens the data nodes' fill out

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args as ClapArgs, Parser, Subcommand};
use nix::unistd::{getegid, geteuid};
use rdmabox::transport::{ProviderKind, TransportConfig};
use rfs_client::{Client, ClientConfig};
use rfs_proto::message::{Drain, Rebalance, RemoveNode, Status};
use rfs_proto::types::{Caller, ClusterStatus, NodeStatus};
use rfs_proto::{Errno, MetadataChannel};

/// How often `rfs drain` and `rfs rebalance` look at the nodes again.
const POLL: Duration = Duration::from_secs(1);

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
        #[command(flatten)]
        to: Node,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Drain a data node: it takes no new chunks, and every copy it holds moves to other
    /// nodes. Waits until it holds nothing (printing what is left), after which it can be
    /// stopped losing nothing.
    Drain {
        #[command(flatten)]
        to: Node,
        /// The data node, by its address as `rfs status` lists it (or its id).
        node: String,
        /// End draining instead: the node takes new chunks again.
        #[arg(long)]
        stop: bool,
        /// Start draining and return without waiting.
        #[arg(long)]
        no_wait: bool,
    },
    /// End a drain: the data node takes new chunks again (as `rfs drain --stop`).
    Undrain {
        #[command(flatten)]
        to: Node,
        /// The data node, by its address as `rfs status` lists it (or its id).
        node: String,
    },
    /// Forget a data node that is not up: it is no longer listed, and its pool, were it to
    /// come back, joins as a new one. NODE by address removes every node there that is down
    /// or away. Refused while chunks have their only copies there (drain the node while it
    /// is up, or bring it back: an away node comes back with its pool).
    Remove {
        #[command(flatten)]
        to: Node,
        /// The data node, by its address as `rfs status` lists it (or its id).
        node: String,
        /// Remove it even though the chunks whose only copies it holds are lost with it (they
        /// stay unreadable).
        #[arg(long)]
        force: bool,
    },
    /// Even the data nodes' fill out: copies move from the fullest live node to emptier ones
    /// until each holds within a tenth of the mean share of its pool (within the repair
    /// rate, while I/O goes on). Waits until it is done, printing each node's copies.
    Rebalance {
        #[command(flatten)]
        to: Node,
        /// Start and return without waiting.
        #[arg(long)]
        no_wait: bool,
    },
}

/// How to reach the metadata node.
#[derive(ClapArgs)]
struct Node {
    /// The metadata node, HOST:PORT.
    server: String,
    /// The shared secret of the nodes [default: /etc/rfs/secret for root,
    /// $XDG_CONFIG_HOME/rfs/secret or ~/.config/rfs/secret for others].
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// Transport: auto (verbs when an RDMA device exists), verbs or tcp.
    #[arg(long, default_value = "auto")]
    transport: ProviderKind,
}

impl Node {
    /// A client of the metadata node, or the exit status of why not (said on stderr).
    fn connect(&self) -> Result<Client, ExitCode> {
        let secret = rfs_daemon::secret::for_peer(self.secret_file.as_deref()).map_err(|e| {
            eprintln!("rfs: {e}");
            ExitCode::from(2)
        })?;
        let cfg = ClientConfig {
            transport: TransportConfig::with_provider(self.transport),
            secret,
            ..ClientConfig::default()
        };
        Client::connect(&self.server, cfg).map_err(|e| {
            eprintln!("rfs: cannot reach {}: {e}", self.server);
            ExitCode::FAILURE
        })
    }
}

fn caller() -> Caller {
    Caller {
        uid: geteuid().as_raw(),
        gid: getegid().as_raw(),
        groups: Vec::new(),
    }
}

fn main() -> ExitCode {
    match Args::parse().command {
        Command::Status { to, json } => status(&to, json),
        Command::Drain {
            to,
            node,
            stop,
            no_wait,
        } => drain(&to, &node, !stop, !(stop || no_wait)),
        Command::Undrain { to, node } => drain(&to, &node, false, false),
        Command::Remove { to, node, force } => remove(&to, &node, force),
        Command::Rebalance { to, no_wait } => rebalance(&to, !no_wait),
    }
}

fn cluster(client: &Client, server: &str) -> Result<ClusterStatus, ExitCode> {
    client.call(Status { caller: caller() }).map_err(|e| {
        eprintln!("rfs: status of {server}: {e} (it is for root)");
        ExitCode::FAILURE
    })
}

fn status(to: &Node, json: bool) -> ExitCode {
    let status = match to.connect().and_then(|c| cluster(&c, &to.server)) {
        Ok(s) => s,
        Err(code) => return code,
    };
    match json {
        true => println!("{}", as_json(&status)),
        false => print!("{}", as_text(&to.server, &status)),
    }
    ExitCode::SUCCESS
}

fn drain(to: &Node, name: &str, on: bool, wait: bool) -> ExitCode {
    let run = || -> Result<(), ExitCode> {
        let client = to.connect()?;
        let status = cluster(&client, &to.server)?;
        let Some(node) = status.node(name).map(|n| n.id) else {
            eprintln!(
                "rfs: {} has no data node {name} (see rfs status)",
                to.server
            );
            return Err(ExitCode::from(2));
        };
        let drain = Drain {
            caller: caller(),
            node,
            on,
        };
        client.call(drain).map_err(|e| {
            eprintln!("rfs: drain of {name}: {e}");
            ExitCode::FAILURE
        })?;
        if !wait {
            let what = if on {
                "draining"
            } else {
                "taking new chunks again"
            };
            println!("data node {name} (id {node}): {what}");
            return Ok(());
        }
        let mut said = None;
        loop {
            let status = cluster(&client, &to.server)?;
            let Some(n) = status.nodes.iter().find(|n| n.id == node) else {
                eprintln!("rfs: data node {name} was removed meanwhile");
                return Err(ExitCode::FAILURE);
            };
            match n.state.as_str() {
                "draining" => {}
                "up" => {
                    eprintln!(
                        "rfs: data node {name} is no longer draining (ended with --stop, or the \
                         metadata node restarted): {} copies left",
                        n.copies
                    );
                    return Err(ExitCode::FAILURE);
                }
                state => {
                    eprintln!(
                        "rfs: data node {name} is {state}: its {} copies cannot be moved",
                        n.copies
                    );
                    return Err(ExitCode::FAILURE);
                }
            }
            if n.copies == 0 {
                match n.meta {
                    true => println!(
                        "the metadata node's own pool ({name}) holds nothing; the metadata \
                         service itself must keep running"
                    ),
                    false => {
                        println!("data node {name} (id {node}) holds nothing: it can be stopped")
                    }
                }
                return Ok(());
            }
            if said != Some(n.copies) {
                println!("data node {name} (id {node}): {} copies left", n.copies);
                said = Some(n.copies);
            }
            std::thread::sleep(POLL);
        }
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

fn remove(to: &Node, name: &str, force: bool) -> ExitCode {
    let run = || -> Result<(), ExitCode> {
        let client = to.connect()?;
        let status = cluster(&client, &to.server)?;
        let named: Vec<&NodeStatus> = status
            .nodes
            .iter()
            .filter(|n| n.addr == name || name.parse() == Ok(n.id))
            .collect();
        let (gone, up): (Vec<&NodeStatus>, Vec<&NodeStatus>) = named
            .iter()
            .partition(|n| matches!(n.state.as_str(), "down" | "away"));
        if let (true, Some(n)) = (gone.is_empty(), up.first()) {
            eprintln!(
                "rfs: data node {name} (id {}) is {}: stop it first (its SIGTERM drains it), \
                 then remove it",
                n.id, n.state
            );
            return Err(ExitCode::FAILURE);
        }
        if gone.is_empty() {
            eprintln!(
                "rfs: {} has no data node {name} (see rfs status)",
                to.server
            );
            return Err(ExitCode::from(2));
        }
        let mut failed = false;
        for n in gone {
            let removal = RemoveNode {
                caller: caller(),
                node: n.id,
                force,
            };
            match client.call(removal) {
                Ok(()) => println!("data node {} (id {}) removed", n.addr, n.id),
                Err(e) if e.errno() == Errno::ENOTEMPTY => {
                    eprintln!(
                        "rfs: data node {} (id {}) is {} and holds the only copies of {} \
                         chunks ({} copies in all): not removed, as they would be lost with \
                         it. Bring it back (a node away comes back with its pool), or remove \
                         it with --force",
                        n.addr, n.id, n.state, n.only_copies, n.copies
                    );
                    failed = true;
                }
                Err(e) => {
                    eprintln!("rfs: removal of data node {} (id {}): {e}", n.addr, n.id);
                    failed = true;
                }
            }
        }
        match failed {
            true => Err(ExitCode::FAILURE),
            false => Ok(()),
        }
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

fn rebalance(to: &Node, wait: bool) -> ExitCode {
    let run = || -> Result<(), ExitCode> {
        let client = to.connect()?;
        client.call(Rebalance { caller: caller() }).map_err(|e| {
            eprintln!("rfs: rebalance of {}: {e} (it is for root)", to.server);
            ExitCode::FAILURE
        })?;
        let mut said = None;
        loop {
            let status = cluster(&client, &to.server)?;
            let copies: Vec<String> = status
                .nodes
                .iter()
                .filter(|n| n.state == "up")
                .map(|n| {
                    format!(
                        "{} {}/{}",
                        n.addr,
                        n.copies,
                        n.pool_bytes / status.chunk_size.max(1)
                    )
                })
                .collect();
            let line = copies.join(", ");
            if said.as_ref() != Some(&line) {
                println!("copies held/pool chunks: {line}");
                said = Some(line);
            }
            if status.rebalancing && !wait {
                println!("{}: rebalancing", to.server);
                return Ok(());
            }
            if !status.rebalancing {
                if even(&status) {
                    println!("{}: balanced", to.server);
                    return Ok(());
                }
                eprintln!(
                    "rfs: the rebalance of {} ended short of even: the fullest node's copies \
                     could not move to the emptier ones (see the metadata node's log)",
                    to.server
                );
                return Err(ExitCode::FAILURE);
            }
            std::thread::sleep(POLL);
        }
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}

/// Whether every live node holds within a tenth of the mean share of its pool (as the
/// metadata node rebalances), or a chunk of it.
fn even(s: &ClusterStatus) -> bool {
    let up: Vec<&NodeStatus> = s.nodes.iter().filter(|n| n.state == "up").collect();
    let room = |n: &NodeStatus| (n.pool_bytes / s.chunk_size.max(1)).max(1) as f64;
    let held: u64 = up.iter().map(|n| n.copies).sum();
    let total: f64 = up.iter().map(|n| room(n)).sum();
    let mean = held as f64 / total.max(1.0);
    up.iter()
        .all(|n| n.copies as f64 <= (mean * room(n) * 1.1).max(mean * room(n) + 1.0))
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
        "{:<5} {:<24} {:<8} {:>12} {:>12} {:>12} {:>8} {:>11}\n",
        "NODE", "ADDRESS", "STATE", "POOL", "USED", "FREE CHUNKS", "COPIES", "ONLY COPIES"
    );
    for n in &s.nodes {
        let meta = if n.meta { "  (the metadata node)" } else { "" };
        out += &format!(
            "{:<5} {:<24} {:<8} {:>12} {:>12} {:>12} {:>8} {:>11}{meta}\n",
            n.id,
            n.addr,
            n.state,
            mib(n.pool_bytes),
            mib(n.pool_bytes.saturating_sub(n.free_bytes)),
            n.free_chunks,
            n.copies,
            n.only_copies
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
    out += &format!(
        "\nrepair: {} copies made ({}) since the metadata node started\n",
        s.repaired_chunks,
        mib(s.repaired_bytes)
    );
    if !s.short.is_empty() {
        let first = if s.chunks_short > s.short.len() as u64 {
            format!(" ({} of them)", s.short.len())
        } else {
            String::new()
        };
        out += &format!(
            "\nCHUNKS SHORT OF COPIES{first}\n{:<20} {:>10} {:>7}\n",
            "INODE", "CHUNK", "COPIES"
        );
        for c in &s.short {
            out += &format!("{:<20} {:>10} {:>7}\n", c.ino, c.index, c.copies);
        }
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
                 \"used_bytes\":{},\"free_bytes\":{},\"free_chunks\":{},\"copies\":{},\
                 \"only_copies\":{}}}",
                n.id,
                quoted(&n.addr),
                quoted(&n.state),
                n.meta,
                n.pool_bytes,
                n.pool_bytes.saturating_sub(n.free_bytes),
                n.free_bytes,
                n.free_chunks,
                n.copies,
                n.only_copies
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
    let short: Vec<String> = s
        .short
        .iter()
        .map(|c| {
            format!(
                "{{\"ino\":{},\"index\":{},\"copies\":{}}}",
                c.ino, c.index, c.copies
            )
        })
        .collect();
    format!(
        "{{\"nodes\":[{}],\"clients\":[{}],\"replicas\":{},\"chunks_short\":{},\
         \"short\":[{}],\"repaired_chunks\":{},\"repaired_bytes\":{},\
         \"chunk_size\":{},\"inodes\":{},\"inodes_max\":{},\"rebalancing\":{}}}",
        nodes.join(","),
        clients.join(","),
        s.replicas,
        s.chunks_short,
        short.join(","),
        s.repaired_chunks,
        s.repaired_bytes,
        s.chunk_size,
        s.inodes,
        s.inodes_max,
        s.rebalancing
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32, state: &str, pool_chunks: u64, copies: u64) -> NodeStatus {
        NodeStatus {
            id,
            addr: format!("n{id}"),
            state: state.into(),
            meta: id == 0,
            pool_bytes: pool_chunks << 20,
            free_bytes: 0,
            free_chunks: 0,
            copies,
            only_copies: 0,
        }
    }

    fn cluster_of(nodes: Vec<NodeStatus>) -> ClusterStatus {
        ClusterStatus {
            nodes,
            clients: Vec::new(),
            replicas: 1,
            chunks_short: 0,
            short: Vec::new(),
            repaired_chunks: 0,
            repaired_bytes: 0,
            chunk_size: 1 << 20,
            inodes: 0,
            inodes_max: 0,
            rebalancing: false,
        }
    }

    #[test]
    fn even_means_within_a_tenth_of_the_mean_share_of_each_pool() {
        let even_with = |nodes| even(&cluster_of(nodes));
        assert!(even_with(vec![node(0, "up", 32, 8), node(1, "up", 32, 9)]));
        assert!(!even_with(vec![
            node(0, "up", 32, 17),
            node(1, "up", 32, 0)
        ]));
        // Shares of the pools, not counts: 100 of 300 and 50 of 150 are even.
        assert!(even_with(vec![
            node(0, "up", 300, 100),
            node(1, "up", 150, 50)
        ]));
        // Nodes that are down or draining do not count.
        assert!(even_with(vec![
            node(0, "up", 32, 8),
            node(1, "up", 32, 8),
            node(2, "down", 32, 30)
        ]));
        // Within a chunk of the share is even, for small pools.
        assert!(even_with(vec![node(0, "up", 2, 2), node(1, "up", 2, 1)]));
    }

    #[test]
    fn a_node_is_found_by_address_or_id_and_the_newest_live_one_wins() {
        let s = cluster_of(vec![
            node(0, "up", 32, 0),
            NodeStatus {
                addr: "10.0.0.7:7470".into(),
                ..node(1, "down", 32, 0)
            },
            NodeStatus {
                addr: "10.0.0.7:7470".into(),
                ..node(2, "up", 32, 0)
            },
        ]);
        assert_eq!(s.node("10.0.0.7:7470").map(|n| n.id), Some(2));
        assert_eq!(s.node("1").map(|n| n.id), Some(1));
        assert!(s.node("10.0.0.8:7470").is_none());
    }

    #[test]
    fn strings_are_quoted_as_json_wants() {
        assert_eq!(quoted("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
