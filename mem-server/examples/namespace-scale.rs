//! namespace-scale: what many files cost the metadata node. For each count it starts a real
//! `mem-server` (the one built beside this example) with a fresh `--state-dir`, creates that
//! many empty files in directories of `--per-dir` entries through the client (4 threads), and
//! prints the node's memory per file, create, lookup and listing rates, and how long a restart
//! from the state directory takes until the node answers again (snapshot and journal replay).
//!
//!   cargo build --release -p mem-server
//!   cargo run --release -p mem-server --example namespace-scale -- [--files 10000,100000] [--per-dir 100000]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rdmabox::transport::{ProviderKind, TransportConfig};
use rfs_client::{Client, ClientConfig};
use rfs_proto::message::{GetAttr, Lookup, Mkdir, Mknod, ReadDir};
use rfs_proto::types::{Caller, FileKind, Ino, Name, Owner, ROOT};
use rfs_proto::MetadataChannel;

#[derive(Parser)]
struct Args {
    /// File counts to measure, each in a namespace of its own.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    files: Vec<usize>,
    /// Entries per directory.
    #[arg(long, default_value_t = 100_000)]
    per_dir: usize,
    /// Client threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
}

const PORT: u16 = 17_950;

fn mem_server() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    // target/<profile>/examples/namespace-scale -> target/<profile>/mem-server
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("mem-server")
}

fn start(state: &Path) -> Child {
    Command::new(mem_server())
        .args(["--listen", &format!("127.0.0.1:{PORT}"), "--memory", "64M"])
        .args(["--insecure", "--transport", "tcp", "--state-dir"])
        .arg(state)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start mem-server (build it first: cargo build --release -p mem-server)")
}

/// Connects once the node answers; how long that took.
fn connect() -> (Client, Duration) {
    let t = Instant::now();
    loop {
        let cfg = ClientConfig {
            transport: TransportConfig::with_provider(ProviderKind::Tcp),
            ..ClientConfig::default()
        };
        match Client::connect(&format!("127.0.0.1:{PORT}"), cfg) {
            Ok(c) if c.call(GetAttr { ino: ROOT }).is_ok() => return (c, t.elapsed()),
            _ if t.elapsed() > Duration::from_secs(600) => panic!("the node never answered"),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

fn owner(perm: u16) -> Owner {
    Owner {
        perm,
        uid: 0,
        gid: 0,
        umask: 0,
    }
}

/// Runs `work(i)` for every i in `0..n` on `threads` threads; the rate per second.
fn rate(threads: usize, n: usize, work: impl Fn(usize) + Sync) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for w in 0..threads {
            let work = &work;
            s.spawn(move || (w..n).step_by(threads).for_each(work));
        }
    });
    n as f64 / t.elapsed().as_secs_f64()
}

fn stop(mut node: Child) {
    // SIGTERM: the node's orderly stop.
    let _ = Command::new("kill").arg(node.id().to_string()).status();
    let _ = node.wait();
}

fn main() {
    let args = Args::parse();
    println!(
        "| files | node memory per file | creates/s | lookups/s | listed entries/s | restart until answering | memory per file after it |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &files in &args.files {
        let state =
            std::env::temp_dir().join(format!("rfs-namespace-scale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let node = start(&state);
        let (client, _) = connect();
        let before = rss_bytes(node.id());
        let dirs: Vec<Ino> = (0..files.div_ceil(args.per_dir))
            .map(|d| {
                client
                    .call(Mkdir {
                        parent: ROOT,
                        name: Name::from(format!("d{d}").as_str()),
                        owner: owner(0o755),
                        caller: Caller::default(),
                    })
                    .expect("mkdir")
                    .attr
                    .ino
            })
            .collect();
        let client = Arc::new(client);
        let name = |i: usize| Name::from(format!("file-{i:08}").as_str());
        let creates = rate(args.threads, files, |i| {
            client
                .call(Mknod {
                    parent: dirs[i / args.per_dir],
                    name: name(i),
                    kind: FileKind::RegularFile,
                    rdev: 0,
                    owner: owner(0o644),
                    caller: Caller::default(),
                })
                .expect("mknod");
        });
        let per_file = rss_bytes(node.id()).saturating_sub(before) as f64 / files as f64;
        let lookups = rate(args.threads, files, |i| {
            client
                .call(Lookup {
                    parent: dirs[i / args.per_dir],
                    name: name(i),
                    caller: Caller::default(),
                })
                .expect("lookup");
        });
        let t = Instant::now();
        let mut listed = 0usize;
        let mut cookie = 0;
        loop {
            let page = client
                .call(ReadDir {
                    ino: dirs[0],
                    cookie,
                    max: 1024,
                    caller: Caller::default(),
                })
                .expect("readdir");
            let Some(last) = page.last() else { break };
            cookie = last.cookie;
            listed += page.len();
        }
        let listing = listed as f64 / t.elapsed().as_secs_f64();
        drop(client);
        stop(node);
        let node = start(&state);
        let (client, restart) = connect();
        let after = rss_bytes(node.id());
        let found = client
            .call(Lookup {
                parent: dirs[dirs.len() - 1],
                name: name(files - 1),
                caller: Caller::default(),
            })
            .is_ok();
        assert!(found, "the last file is there after the restart");
        drop(client);
        stop(node);
        let _ = std::fs::remove_dir_all(&state);
        println!(
            "| {files} | {:.0} B | {creates:.0} | {lookups:.0} | {listing:.0} | {:.2} s | {:.0} B |",
            per_file,
            restart.as_secs_f64(),
            after.saturating_sub(before) as f64 / files as f64
        );
    }
}
