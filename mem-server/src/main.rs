//! mem-server: an rfs storage node.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use mem_server::access::Policy;
use mem_server::admission::Limits;
use mem_server::config::{available_memory, NodeConfig};
use mem_server::node::Node;
use nix::sys::signal::{SigSet, Signal};
use rdmabox::size::parse_size;
use rdmabox::transport::{ProviderKind, TransportConfig, VerbsConfig};
use rfs_daemon::logging::{self, LogTarget};
use rfs_daemon::metrics;
use rfs_daemon::secret;
use rfs_proto::types::{AttrChanges, MAX_REPLICAS};

/// An rfs storage node: lends its RAM to clients for one-sided RDMA; the first node also runs
/// the metadata service, more nodes `--join` it.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Address to listen on for clients and other nodes.
    #[arg(long, default_value = "127.0.0.1:7470")]
    listen: SocketAddr,
    /// Memory to lend, with a unit: K, M, G or T (e.g. 8G), or a share of what is available
    /// now (e.g. 80%). 0 on the metadata node: it keeps the namespace only, and every chunk is
    /// on data nodes. More than the machine (or the cgroup) has available is refused.
    #[arg(long, value_parser = parse_memory)]
    memory: Memory,
    /// Join the metadata node at HOST:PORT as a data node.
    #[arg(long)]
    join: Option<SocketAddr>,
    /// Seconds to keep trying to reach a metadata node that is not up yet (at boot, or while
    /// it prepares its pool) before giving up.
    #[arg(long, default_value = "60", value_parser = parse_secs, requires = "join")]
    join_timeout: Duration,
    /// Seconds a data node asked to stop (SIGTERM, SIGINT) may spend moving its copies to the
    /// other data nodes first, so that stopping loses nothing; 0 stops at once. A second
    /// signal stops it at once too. At the default repair rate 300 s moves about 75 GiB: drain
    /// larger nodes with `rfs drain` before stopping them.
    #[arg(long, default_value = "300", value_parser = parse_drain_secs, requires = "join")]
    drain_on_stop: Duration,
    /// Where to log: a file (appended to), `syslog` (the local /dev/log, which journald also
    /// serves) or `-` for stderr (the default). RUST_LOG filters as usual.
    #[arg(long, value_name = "PATH|syslog|-", default_value = "-")]
    log_file: LogTarget,
    /// Serve the node's counters for Prometheus on this address (GET /metrics).
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<SocketAddr>,
    /// Chunk size: the unit of allocation and striping (power of two, 4K to 1G).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    chunk_size: u64,
    /// Transport: auto (verbs when an RDMA device exists, else tcp), verbs or tcp.
    #[arg(long, default_value = "auto")]
    transport: ProviderKind,
    /// verbs: the RDMA device to use, e.g. mlx5_0 (default: the first).
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
    /// verbs: the GID index (default: the last RoCE v2 GID, or 0 on InfiniBand).
    #[arg(long, value_name = "N")]
    gid_index: Option<u8>,
    /// File holding the shared secret that clients and nodes must prove they know (default:
    /// /etc/rfs/secret for root, else ~/.config/rfs/secret; the first node creates it there).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Run without authentication: any peer that reaches the node can read and write every
    /// file. Only for isolated test networks.
    #[arg(long, conflicts_with = "secret_file")]
    insecure: bool,
    /// tcp: take only encrypted queue pairs (mounts with -o encrypt), and encrypt this node's
    /// own (AES-256-GCM, keys from the shared secret): calls, callbacks and file data. Costs
    /// CPU per byte.
    #[arg(long, conflicts_with = "insecure")]
    encrypt: bool,
    /// HOST:PORT that clients should use to reach this node (default: from --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// Seconds a client may take to answer a callback (a recall of chunks freed by truncate,
    /// unlink or trimming) before its references are taken as dropped; freed chunks wait at
    /// most this long before reuse. Clients refetch chunk maps older than this, less their
    /// io_timeout, so keep it above the clients' io_timeout.
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    lease: Duration,
    /// Most connections taken at once: clients' metadata channels and data sessions, joined
    /// nodes, on tcp each of their queue pairs (a connection of its own), and peers still
    /// authenticating; more are refused.
    #[arg(long, default_value_t = Limits::default().total)]
    max_connections: usize,
    /// Treat root (uid 0) on clients as nobody (65534), as NFS's root_squash does. Root then
    /// cannot make the root directory writable: give it --root-owner or --root-mode.
    #[arg(long)]
    root_squash: bool,
    /// The root directory's mode, in octal (e.g. 1777), set at every start.
    #[arg(long, value_name = "OCTAL", value_parser = parse_mode, conflicts_with = "join")]
    root_mode: Option<u32>,
    /// The root directory's owner as UID:GID, set at every start.
    #[arg(long, value_name = "UID:GID", value_parser = parse_owner, conflicts_with = "join")]
    root_owner: Option<(u32, u32)>,
    /// Copies of each chunk, each on a different data node (this node counts as one): writes
    /// go to every copy, reads fail over between them, and the copies a dead node held are
    /// made again on the others. Chosen when the file system is created (the metadata node).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_REPLICAS as i64), conflicts_with = "join")]
    replicas: u32,
    /// How fast lost copies are made again, in bytes per second with a unit (e.g. 256M).
    #[arg(long, default_value = "256M", value_parser = parse_size, conflicts_with = "join")]
    repair_rate: u64,
    /// Move copies to even the data nodes' fill out only when `rfs rebalance` asks, not also
    /// each time a data node joins.
    #[arg(long, conflicts_with = "join")]
    manual_rebalance: bool,
    /// Keep the namespace in this directory (a journal of every change, synced before each
    /// answer, and snapshots): a metadata node restarted with it comes back with every file,
    /// data nodes join it again with their data, and clients carry on without a remount.
    /// Without it the namespace lives in memory only. This node's own pool does not survive
    /// its restart: give it --memory 0 (or --replicas 2 or more) so that no file relies on it.
    #[arg(long, value_name = "DIR", conflicts_with = "join")]
    state_dir: Option<std::path::PathBuf>,
    /// Most connections from one peer address (counted as for --max-connections).
    #[arg(long, default_value_t = Limits::default().per_peer)]
    max_connections_per_peer: usize,
    /// Most files, directories and links the namespace holds (`df -i`); creates past it fail
    /// with ENOSPC. Default: a quarter of the memory beside the pool, at 1 KiB a file (at least
    /// a million).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "join")]
    max_files: Option<u64>,
    /// Most chunk grants (registrations of a file's extent) one data session holds; past it the
    /// oldest goes (a transfer through it fails and the client fetches the map again). The node
    /// holds four times this over all sessions. At least 256 (the chunks of one map).
    #[arg(long, default_value_t = mem_server::config::DEFAULT_MAX_GRANTS as u64,
          value_parser = clap::value_parser!(u64).range(256..(1 << 24)))]
    max_grants: u64,
}

/// What `--memory` says: bytes, and whether as a share of what was available.
#[derive(Clone, Copy)]
struct Memory {
    bytes: u64,
    share: bool,
}

/// `--memory`: a size, or a percentage of the memory available now.
fn parse_memory(s: &str) -> Result<Memory, String> {
    let Some(pct) = s.trim().strip_suffix('%') else {
        return parse_size(s).map(|bytes| Memory {
            bytes,
            share: false,
        });
    };
    let pct: f64 = match pct.trim().parse() {
        Ok(p) if p > 0.0 && p <= 100.0 => p,
        _ => return Err(format!("{s:?} is not a percentage above 0, up to 100")),
    };
    let available = available_memory().ok_or("cannot tell the memory available (/proc/meminfo)")?;
    let bytes = (available as f64 * pct / 100.0) as u64 & !4095;
    if bytes == 0 {
        return Err(format!("{s} of the {available} bytes available is nothing"));
    }
    Ok(Memory { bytes, share: true })
}

/// Refuses a pool the machine cannot back now: its pages are touched as files fill it, and
/// the kernel would kill the node then, with everything in it. A share was measured already.
fn check_backable(memory: Memory) -> Result<(), String> {
    if memory.share {
        return Ok(());
    }
    let memory = memory.bytes;
    match available_memory() {
        Some(available) if memory > available => Err(format!(
            "--memory {} MiB is more than this machine can back now ({} MiB available, the \
             cgroup's limit counted): the node would be killed as its pool fills; lend less, \
             or a share such as 80%",
            memory >> 20,
            available >> 20,
        )),
        _ => Ok(()),
    }
}

fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o7777 => Ok(m),
        _ => Err(format!("{s:?} is not a mode in octal (0 to 7777)")),
    }
}

fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (uid, gid) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not UID:GID"))?;
    let id = |x: &str| {
        x.parse::<u32>()
            .map_err(|_| format!("{x:?} is not a numeric id"))
    };
    Ok((id(uid)?, id(gid)?))
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.1..=3600.0).contains(&secs) {
        return Err("must be between 0.1 and 3600 seconds".into());
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_drain_secs(s: &str) -> Result<Duration, String> {
    match s.parse::<u64>() {
        Ok(secs) if secs <= 86_400 => Ok(Duration::from_secs(secs)),
        _ => Err(format!("{s:?}: a whole number of seconds, 0 to 86400")),
    }
}

/// The secret peers must prove they know, and how the banner says so. The first node creates
/// one at the default path if there is none; a joining node must find the metadata node's.
fn authentication(args: &Args) -> io::Result<(Option<Vec<u8>>, String)> {
    if args.insecure {
        return Ok((None, "NO AUTHENTICATION (--insecure)".into()));
    }
    let path = args
        .secret_file
        .clone()
        .unwrap_or_else(secret::default_path);
    let (bytes, created) = match (&args.secret_file, args.join) {
        (None, None) => secret::read_or_create(&path)?,
        (None, Some(meta)) => match secret::read(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "no secret at {}: copy the secret file of the metadata node {meta} there (mode 0600), or pass --secret-file",
                        path.display()
                    ),
                ))
            }
            other => (other?, false),
        },
        (Some(_), _) => (secret::read(&path)?, false),
    };
    let how = if created { "created" } else { "in" };
    Ok((
        Some(bytes),
        format!(
            "peers authenticate with the secret {how} {}",
            path.display()
        ),
    ))
}

/// SIGINT and SIGTERM stop the node; SIGHUP opens its log file again (logrotate's way).
fn signals() -> SigSet {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGHUP);
    set
}

/// Waits for a stop signal, taken synchronously (blocked in every thread by
/// [`block_signals`]), opening the log file again at each SIGHUP meanwhile.
fn wait_for_stop() {
    loop {
        match signals().wait() {
            Ok(Signal::SIGHUP) => logging::reopen(),
            Ok(_) => return,
            Err(e) => {
                log::error!("waiting for a signal: {e}");
                return;
            }
        }
    }
}

/// What says whether a stop signal came within a wait: a thread that takes the signals from
/// now on (a SIGHUP still opens the log file again).
fn later_stop_signals() -> impl FnMut(Duration) -> bool {
    let (tx, rx) = crossbeam_channel::unbounded();
    let taking = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            wait_for_stop();
            let _ = tx.send(());
        });
    if let Err(e) = taking {
        log::warn!("no thread to take a second stop signal: {e}");
    }
    move |wait| match rx.recv_timeout(wait) {
        Ok(()) => true,
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => false,
        // No thread takes them: only the time says when to stop.
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
            std::thread::sleep(wait);
            false
        }
    }
}

/// Blocks our signals before any thread exists, so every thread inherits the mask.
fn block_signals() {
    if let Err(e) = signals().thread_block() {
        log::error!("blocking signals: {e}");
    }
}

/// Tells systemd, when it runs this node as a `Type=notify` service, that the node serves
/// (its pool is ready): units ordered after it start only then.
fn notify_systemd_ready() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = UnixDatagram::unbound().and_then(|sock| match path.as_bytes().strip_prefix(b"@") {
        Some(name) => sock.send_to_addr(b"READY=1", &UnixAddr::from_abstract_name(name)?),
        None => sock.send_to(b"READY=1", &path),
    });
    if let Err(e) = sent {
        log::warn!("telling systemd we are ready (NOTIFY_SOCKET={path:?}): {e}");
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = check_backable(args.memory) {
        eprintln!("mem-server: {e}");
        return ExitCode::from(2);
    }
    if let Err(e) = logging::init("mem-server", "info", &args.log_file) {
        eprintln!("mem-server: {e}");
        return ExitCode::from(2);
    }
    let (secret, auth) = match authentication(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mem-server: {e}");
            return ExitCode::from(2);
        }
    };
    if secret.is_none() {
        log::warn!(
            "--insecure: no authentication. Any peer that reaches {} can read and write every file",
            args.listen
        );
    }
    block_signals();
    let cfg = NodeConfig {
        chunk_size: args.chunk_size,
        transport: TransportConfig {
            verbs: VerbsConfig {
                device: args.device,
                gid_index: args.gid_index,
                ..VerbsConfig::default()
            },
            ..mem_server::config::node_transport(args.transport)
        },
        secret,
        insecure: args.insecure,
        encrypt: args.encrypt,
        join: args.join,
        join_timeout: args.join_timeout,
        advertise: args.advertise,
        lease: args.lease,
        replicas: args.replicas,
        repair_rate: args.repair_rate,
        rebalance_on_join: !args.manual_rebalance,
        state_dir: args.state_dir.clone(),
        max_files: args
            .max_files
            .unwrap_or_else(|| mem_server::config::default_max_files(args.memory.bytes)),
        max_grants: args.max_grants as usize,
        root_dir: AttrChanges {
            mode: args.root_mode,
            uid: args.root_owner.map(|(uid, _)| uid),
            gid: args.root_owner.map(|(_, gid)| gid),
            ..AttrChanges::default()
        },
        policy: Policy {
            root_squash: args.root_squash,
        },
        limits: Limits {
            total: args.max_connections,
            per_peer: args.max_connections_per_peer,
        },
        ..NodeConfig::new(args.listen, args.memory.bytes)
    };
    let node = match Node::start(cfg) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("mem-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(addr) = args.metrics {
        let figures = node.metrics();
        let served = metrics::serve(addr, move || metrics::render("rfs_node", &figures()));
        if let Err(e) = served {
            eprintln!("mem-server: {e}");
            node.shutdown();
            return ExitCode::FAILURE;
        }
    }
    println!(
        "mem-server listening on {} ({}), serving {} MiB{}; {auth}",
        node.addr(),
        node.transport(),
        node.pool_bytes() >> 20,
        match args.join {
            Some(m) => format!(" as a data node of {m}"),
            None => " with the metadata service".into(),
        }
    );
    notify_systemd_ready();
    wait_for_stop();
    let emptied = node.drain_before_stop(args.drain_on_stop, later_stop_signals());
    log::info!("stopping");
    node.shutdown();
    // A data node that stops with copies its cluster still needs says so in its status too.
    if emptied {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
