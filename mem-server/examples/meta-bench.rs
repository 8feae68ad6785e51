//! meta-bench: metadata RPC round-trip latency and metadata operations per second against an
//! in-process metadata node (loopback, chosen transport).
//!
//!   cargo run --release -p mem-server --example meta-bench -- [--transport tcp] [--ops 20000]

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use mem_server::config::NodeConfig;
use mem_server::node::Node;
use rdmabox::transport::{ProviderKind, TransportConfig};
use rfs_client::{Client, ClientConfig};
use rfs_proto::message::{GetAttr, Mknod, Unlink};
use rfs_proto::types::{Caller, FileKind, Name, Owner, ROOT};
use rfs_proto::MetadataChannel;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "tcp")]
    transport: ProviderKind,
    /// Operations per measurement.
    #[arg(long, default_value_t = 20000)]
    ops: usize,
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)] as f64 / 1000.0
}

fn main() {
    let args = Args::parse();
    let transport = TransportConfig::with_provider(args.transport);
    // Authenticated as in production: the secret never leaves this process.
    let mut secret = vec![0u8; 32];
    rdmabox::random::fill(&mut secret);
    let node = Node::start(NodeConfig {
        transport: transport.clone(),
        secret: Some(secret.clone()),
        ..NodeConfig::new("127.0.0.1:0".parse().unwrap(), 64 << 20)
    })
    .expect("start a node");
    let cfg = ClientConfig {
        transport,
        secret: Some(secret),
        ..ClientConfig::default()
    };
    let client = Arc::new(Client::connect(&node.addr().to_string(), cfg).expect("connect"));
    println!(
        "# meta-bench: transport {}, {} ops per row",
        client.transport(),
        args.ops
    );

    let mut lat: Vec<u64> = (0..args.ops)
        .map(|_| {
            let t = Instant::now();
            client.call(GetAttr { ino: ROOT }).expect("getattr");
            t.elapsed().as_nanos() as u64
        })
        .collect();
    lat.sort_unstable();
    println!(
        "| getattr round trip | p50 {:.1} us | p99 {:.1} us | p99.9 {:.1} us |",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        percentile(&lat, 0.999)
    );

    for threads in [1usize, 4] {
        let per = args.ops / threads;
        let t = Instant::now();
        let workers: Vec<_> = (0..threads)
            .map(|w| {
                let c = client.clone();
                std::thread::spawn(move || {
                    for i in 0..per {
                        let name = Name::from(format!("f-{w}-{i}").as_str());
                        c.call(Mknod {
                            parent: ROOT,
                            name: name.clone(),
                            kind: FileKind::RegularFile,
                            rdev: 0,
                            owner: Owner {
                                perm: 0o644,
                                uid: 0,
                                gid: 0,
                                umask: 0,
                            },
                            caller: Caller::default(),
                        })
                        .expect("mknod");
                        c.call(Unlink {
                            parent: ROOT,
                            name,
                            caller: Caller::default(),
                        })
                        .expect("unlink");
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let secs = t.elapsed().as_secs_f64();
        println!(
            "| create+unlink, {threads} thread(s) | {:.0} metadata ops/s |",
            (2 * per * threads) as f64 / secs
        );
    }
    node.shutdown();
}
