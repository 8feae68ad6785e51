//! How a node runs: its configuration, with the defaults and the checks made before it
//! starts.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use rdmabox::rpc::RpcConfig;
use rdmabox::transport::TransportConfig;
use rfs_proto::types::MAX_REPLICAS;

use crate::access::Policy;
use crate::admission::Limits;

/// How a node runs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Where to listen for clients and nodes.
    pub listen: SocketAddr,
    /// Bytes of pool to lend.
    pub memory: u64,
    /// The unit of allocation.
    pub chunk_size: u64,
    /// Which provider, and its settings.
    pub transport: TransportConfig,
    /// The shared secret peers must prove they know; `None` only with `insecure`.
    pub secret: Option<Vec<u8>>,
    /// Run without authentication: anyone who reaches the node has every peer's reach.
    pub insecure: bool,
    /// Take only encrypted queue pairs, and encrypt this node's own (tcp).
    pub encrypt: bool,
    /// Join this metadata node as a data node instead of running the metadata service.
    pub join: Option<SocketAddr>,
    /// How long a joining node keeps trying to reach a metadata node that is not up yet.
    pub join_timeout: Duration,
    /// host:port clients use to reach this node (default: derived from the listen address).
    pub advertise: Option<String>,
    /// The metadata channels' buffers and deadline.
    pub rpc: RpcConfig,
    /// How long a client may take to answer a callback before its chunk references are taken
    /// as dropped (clients refetch maps older than this, less their I/O deadline).
    pub lease: Duration,
    /// How many connections the node takes, in total and per peer address.
    pub limits: Limits,
    /// How the metadata service treats callers (root squash).
    pub policy: Policy,
    /// Copies of each chunk, on distinct data nodes (the metadata node's choice).
    pub replicas: u32,
    /// Bytes per second that re-replication may copy.
    pub repair_rate: u64,
    /// Whether copies move to even the data nodes' fill out when one joins (else only when
    /// `rfs rebalance` asks).
    pub rebalance_on_join: bool,
    /// Where the metadata node journals its state, to come back with it after a restart
    /// (none: the namespace lives in memory only).
    pub state_dir: Option<std::path::PathBuf>,
    /// Mode and owner given to the root directory at start (`--root-mode`, `--root-owner`):
    /// under root squash nobody else could make it writable.
    pub root_dir: rfs_proto::types::AttrChanges,
    /// The most inodes the namespace holds: creates past it fail with ENOSPC, so that clients
    /// cannot grow the metadata node's memory without bound (`df -i` shows it).
    pub max_files: u64,
    /// The most grants (registrations of a copy's extent) one data session holds
    /// (`--max-grants`); the node holds four times that over all sessions.
    pub max_grants: usize,
}

/// The default of [`NodeConfig::max_grants`]: more small files than a data loader holds open
/// at once, and what a NIC's table of registrations takes four times over.
pub const DEFAULT_MAX_GRANTS: usize = 65_536;

/// What one inode costs the metadata node, as budgeted for the default file limit: about
/// what `examples/namespace-scale.rs` measures (about 470 B at a million files, live and after
/// a restart), with room.
const BYTES_PER_FILE: u64 = 1024;

/// The default file limit: a quarter of the memory beside a pool of `pool` bytes (the
/// machine's, or the cgroup's limit if lower), at [`BYTES_PER_FILE`] each; at least a million.
pub fn default_max_files(pool: u64) -> u64 {
    (memory_limit().saturating_sub(pool) / 4 / BYTES_PER_FILE).max(1 << 20)
}

/// The memory this process may use: the machine's, or its cgroup's limit if lower.
fn memory_limit() -> u64 {
    cgroup_room(meminfo("MemTotal:").unwrap_or(0), |limit, _| limit)
}

/// The memory a pool could take now: what the kernel says is available (free, and cache it
/// can drop), or what the cgroup leaves below its limit if less (its usage counts cache it
/// can drop too: that is left out). None if /proc says nothing.
pub fn available_memory() -> Option<u64> {
    let available = meminfo("MemAvailable:")?;
    Some(cgroup_room(available, |limit, used| {
        limit.saturating_sub(used)
    }))
}

/// A field of /proc/meminfo, in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = m.lines().find_map(|l| l.strip_prefix(field))?;
    Some(
        kib.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?
            * 1024,
    )
}

/// `machine`, or what `room(limit, usage)` gives for this process's cgroup if less.
fn cgroup_room(machine: u64, room: impl Fn(u64, u64) -> u64) -> u64 {
    // v2: "0::/path" under /sys/fs/cgroup; v1: "N:memory:/path" under /sys/fs/cgroup/memory.
    // In a container the path may name the host's hierarchy: the mount's root counts too.
    let groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let v2 = groups.lines().find_map(|l| l.strip_prefix("0::"));
    let v1 = groups
        .lines()
        .find_map(|l| Some(l.split_once(":memory:")?.1));
    let v2_files = ("memory.max", "memory.current", "inactive_file ");
    let v1_files = (
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "total_inactive_file ",
    );
    let dirs = [
        v2.map(|p| (format!("/sys/fs/cgroup{p}"), v2_files)),
        v1.map(|p| (format!("/sys/fs/cgroup/memory{p}"), v1_files)),
        Some(("/sys/fs/cgroup".into(), v2_files)),
        Some(("/sys/fs/cgroup/memory".into(), v1_files)),
    ];
    let read = |f: String| std::fs::read_to_string(f).ok()?.trim().parse::<u64>().ok();
    dirs.into_iter()
        .flatten()
        // "max" (v2) and a huge number (v1) say there is no limit.
        .filter_map(|(dir, (limit, usage, inactive))| {
            let limit = read(format!("{dir}/{limit}"))?;
            let stat = std::fs::read_to_string(format!("{dir}/memory.stat")).unwrap_or_default();
            let droppable = stat
                .lines()
                .find_map(|l| l.strip_prefix(inactive)?.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let used = read(format!("{dir}/{usage}")).unwrap_or(0);
            Some(room(limit, used.saturating_sub(droppable)))
        })
        .fold(machine, u64::min)
}

/// A node's transport: on tcp, every queue pair is served by the process's event loops, so
/// that a node's threads do not grow with the mounts and peers it serves.
pub fn node_transport(provider: rdmabox::transport::ProviderKind) -> TransportConfig {
    let mut t = TransportConfig::with_provider(provider);
    t.tcp.served_by_loops = true;
    t
}

impl NodeConfig {
    /// A metadata node on `listen` lending `memory` bytes, with the defaults.
    pub fn new(listen: SocketAddr, memory: u64) -> NodeConfig {
        NodeConfig {
            listen,
            memory,
            chunk_size: 1 << 20,
            transport: node_transport(TransportConfig::default().provider),
            secret: None,
            insecure: false,
            encrypt: false,
            join: None,
            join_timeout: Duration::from_secs(60),
            advertise: None,
            rpc: rfs_proto::message::METADATA_RPC,
            lease: Duration::from_secs(10),
            limits: Limits::default(),
            policy: Policy::default(),
            replicas: 1,
            repair_rate: 256 << 20,
            rebalance_on_join: true,
            state_dir: None,
            root_dir: rfs_proto::types::AttrChanges::default(),
            max_files: default_max_files(memory),
            max_grants: DEFAULT_MAX_GRANTS,
        }
    }

    pub(crate) fn validate(&self) -> io::Result<()> {
        // Spans of a chunk are counted in 32 bits.
        if self.chunk_size < 4096 || self.chunk_size > 1 << 30 || !self.chunk_size.is_power_of_two()
        {
            return Err(invalid(format!(
                "chunk size {} must be a power of two from 4 KiB to 1 GiB",
                self.chunk_size
            )));
        }
        if self.lease < Duration::from_millis(100) {
            return Err(invalid(format!(
                "lease {:?} is too short (at least 100 ms)",
                self.lease
            )));
        }
        if self.secret.is_none() && !self.insecure {
            return Err(invalid(
                "no shared secret: give one, or run insecure on purpose".into(),
            ));
        }
        if self.encrypt && self.secret.is_none() {
            return Err(invalid(
                "encryption needs the shared secret: its keys come from it".into(),
            ));
        }
        if self.limits.total == 0 || self.limits.per_peer == 0 {
            return Err(invalid("connection limits must be at least 1".into()));
        }
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(invalid(format!(
                "{} replicas: between 1 and {MAX_REPLICAS}",
                self.replicas
            )));
        }
        if self.repair_rate < self.chunk_size {
            return Err(invalid(format!(
                "repair rate {} B/s is below one chunk a second",
                self.repair_rate
            )));
        }
        if self.memory == 0 && self.join.is_some() {
            return Err(invalid("a data node must lend some memory".into()));
        }
        if self.memory != 0 && self.memory < self.chunk_size {
            return Err(invalid(format!(
                "memory {} is smaller than one chunk ({})",
                self.memory, self.chunk_size
            )));
        }
        Ok(())
    }
}

pub(crate) fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}
