//! Mount options: every tunable is written once, in [`OPTIONS`], which gives both its command
//! line flag (`--max-write 128K`) and its `-o` form (`-o max_write=128K`, for mount helpers and
//! /etc/fstab). Flags apply first, then `-o` lists in order; [`MountConfig::validate`] checks
//! the result once.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Arg, ArgAction, ArgMatches};
use rdmabox::rpc::RpcConfig;
use rdmabox::size::parse_size;
use rdmabox::transport::{ProviderKind, TransportConfig};
use rdmabox::SessionConfig;
use rfs_client::ClientConfig;
use rfs_daemon::logging::LogTarget;

/// Everything the client is configured with.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Let other users access the mount.
    pub allow_other: bool,
    /// Largest FUSE write, in bytes (the kernel allows up to 1 MiB).
    pub max_write: u32,
    /// Kernel readahead, in bytes.
    pub max_readahead: u32,
    /// The kernel's writeback cache.
    pub writeback_cache: bool,
    /// Bytes of writes that may be in flight after they were answered (0: none).
    pub write_behind: u64,
    /// How long the kernel caches attributes (None: [`MountConfig::kernel_cache_for`]).
    pub attr_timeout: Option<Duration>,
    /// How long the kernel caches names (None: [`MountConfig::kernel_cache_for`]).
    pub entry_timeout: Option<Duration>,
    /// FUSE dispatch threads.
    pub threads: usize,
    /// Which transport provider.
    pub transport: ProviderKind,
    /// verbs: the RDMA device (default: the first).
    pub device: Option<String>,
    /// verbs: the GID index (default: the last RoCE v2 GID, or 0 on InfiniBand).
    pub gid_index: Option<u8>,
    /// The nodes' shared secret.
    pub secret_file: Option<PathBuf>,
    /// Encrypt every queue pair's connection (tcp).
    pub encrypt: bool,
    /// How long a storage node may stay silent before its I/O fails with EIO (soft), or
    /// before it is waited for without end (hard).
    pub io_timeout: Duration,
    /// Calls and transfers that find no node wait for it to come back (NFS's `hard`).
    pub hard: bool,
    /// The rdmabox tunables of every data session.
    pub session: SessionConfig,
    /// The metadata channel; its deadline follows `io_timeout`.
    pub rpc: RpcConfig,
    /// How long mounting keeps trying to reach a metadata node that is not up yet.
    pub mount_timeout: Duration,
    /// Where the client logs (a daemon without one logs to syslog).
    pub log_file: Option<LogTarget>,
    /// Kernel mount flags asked for: ro, nosuid, nodev, noexec.
    pub kernel_flags: Vec<KernelFlag>,
    /// Where to serve the counters for Prometheus (`GET /metrics`).
    pub metrics: Option<std::net::SocketAddr>,
    /// Where the ring service listens (see [`crate::ring`]).
    pub ring: RingPlace,
}

/// Where a mount's ring socket goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RingPlace {
    /// [`crate::ring::default_socket`].
    Default,
    At(PathBuf),
    /// No ring service.
    Off,
}

impl Default for MountConfig {
    fn default() -> Self {
        let io_timeout = Duration::from_secs(5);
        MountConfig {
            allow_other: false,
            max_write: 1 << 20,
            max_readahead: 1 << 20,
            writeback_cache: false,
            write_behind: 32 << 20,
            attr_timeout: None,
            entry_timeout: None,
            threads: 4,
            transport: ProviderKind::Auto,
            device: None,
            gid_index: None,
            secret_file: None,
            encrypt: false,
            io_timeout,
            hard: false,
            session: SessionConfig::default(),
            rpc: RpcConfig {
                timeout: io_timeout * 2,
                ..rfs_proto::message::METADATA_RPC
            },
            mount_timeout: Duration::from_secs(30),
            log_file: None,
            kernel_flags: Vec::new(),
            metrics: None,
            ring: RingPlace::Default,
        }
    }
}

/// What an option's value looks like.
#[derive(Clone, Copy)]
enum Value {
    /// Turned on by its bare flag or `-o name` (`-o name=off` turns it off).
    Switch,
    /// `--name on|off`; a bare `-o name` means on.
    OnOff,
    /// A value of this shape.
    Takes(&'static str),
}

/// One tunable: its `-o` name (the flag is the same with dashes), its value, its help, and how
/// it is set.
pub struct MountOption {
    /// The `-o` name.
    pub name: &'static str,
    value: Value,
    help: &'static str,
    /// The default as a value `set` takes (a test holds it to `MountConfig::default()`); None
    /// where there is none, or the help says what it is.
    default: Option<&'static str>,
    set: fn(&mut MountConfig, &str) -> Result<(), String>,
}

fn on_off(v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => Ok(true),
        "0" | "off" | "no" | "false" => Ok(false),
        other => Err(format!("expected on or off, got {other:?}")),
    }
}

fn secs(v: &str) -> Result<Duration, String> {
    let f: f64 = v
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("expected seconds, got {v:?}"))?;
    if !(0.0..=86400.0).contains(&f) {
        return Err(format!("{v} seconds is out of range"));
    }
    Ok(Duration::from_secs_f64(f))
}

fn number(v: &str) -> Result<usize, String> {
    v.parse().map_err(|_| "expected a number".to_string())
}

/// Every tunable.
pub const OPTIONS: &[MountOption] = &[
    MountOption {
        name: "allow_other",
        value: Value::Switch,
        help: "Let other users access the mount",
        default: Some("off"),
        set: |c, v| on_off(v).map(|x| c.allow_other = x),
    },
    MountOption {
        name: "max_write",
        value: Value::Takes("SIZE"),
        help: "Largest write the kernel sends, 4K to 1M",
        default: Some("1M"),
        set: |c, v| {
            let s = parse_size(v)?;
            c.max_write = u32::try_from(s).map_err(|_| format!("{s} is too large"))?;
            Ok(())
        },
    },
    MountOption {
        name: "max_readahead",
        value: Value::Takes("SIZE"),
        help: "Kernel readahead (set on the mount's backing device: needs root)",
        default: Some("1M"),
        set: |c, v| parse_size(v).map(|s| c.max_readahead = s.min(u32::MAX as u64) as u32),
    },
    MountOption {
        name: "writeback_cache",
        value: Value::OnOff,
        help: "Kernel writeback cache on/off. Only for a file system this mount alone \
               uses: the kernel then keeps file sizes itself and does not see other mounts' \
               writes past the size it knows",
        default: Some("off"),
        set: |c, v| on_off(v).map(|x| c.writeback_cache = x),
    },
    MountOption {
        name: "write_behind",
        value: Value::Takes("SIZE|off"),
        help: "Answer a write once its bytes are copied and its chunks mapped, with up to SIZE in flight per \
               mount; flush, fsync and close wait for them and report a failure. \
               O_SYNC, O_DSYNC and O_DIRECT writes are answered once they landed",
        default: Some("32M"),
        set: |c, v| {
            c.write_behind = match v {
                "off" | "0" => 0,
                v => parse_size(v)?,
            };
            Ok(())
        },
    },
    MountOption {
        name: "attr_timeout",
        value: Value::Takes("SECONDS"),
        help: "Seconds the kernel caches attributes (default: half the metadata node's lease; \
               another mount's change drops them at once)",
        default: None,
        set: |c, v| secs(v).map(|x| c.attr_timeout = Some(x)),
    },
    MountOption {
        name: "entry_timeout",
        value: Value::Takes("SECONDS"),
        help: "Seconds the kernel caches names (default: half the metadata node's lease; \
               another mount's change drops them at once)",
        default: None,
        set: |c, v| secs(v).map(|x| c.entry_timeout = Some(x)),
    },
    MountOption {
        name: "threads",
        value: Value::Takes("N"),
        help: "FUSE dispatch threads, 1 to 256",
        default: Some("4"),
        set: |c, v| number(v).map(|x| c.threads = x),
    },
    MountOption {
        name: "transport",
        value: Value::Takes("auto|verbs|tcp"),
        help: "Transport: auto (verbs when an RDMA device exists), verbs or tcp",
        default: Some("auto"),
        set: |c, v| v.parse().map(|x| c.transport = x),
    },
    MountOption {
        name: "hard",
        value: Value::Switch,
        help: "calls and transfers that find no node (down, restarting, unreachable) wait for it \
               to come back, however long, as NFS's hard mounts do; a fatal signal (Ctrl-C, \
               kill) still ends the waiting process. Off (soft): they fail with EIO after \
               io_timeout and the node's lease",
        default: Some("off"),
        set: |c, v| on_off(v).map(|x| c.hard = x),
    },
    MountOption {
        name: "soft",
        value: Value::Switch,
        help: "the opposite of hard (the default)",
        default: Some("on"),
        set: |c, v| on_off(v).map(|x| c.hard = !x),
    },
    MountOption {
        name: "encrypt",
        value: Value::Switch,
        help: "tcp: encrypt every byte between this mount and the nodes (AES-256-GCM, keys \
               from the shared secret): calls, callbacks and file data. Costs CPU per byte; \
               a node run with --encrypt takes no other mounts",
        default: Some("off"),
        set: |c, v| on_off(v).map(|x| c.encrypt = x),
    },
    MountOption {
        name: "device",
        value: Value::Takes("NAME"),
        help: "verbs: the RDMA device to use, e.g. mlx5_0 (default: the first)",
        default: None,
        set: |c, v| {
            c.device = Some(v.to_string());
            Ok(())
        },
    },
    MountOption {
        name: "gid_index",
        value: Value::Takes("N"),
        help: "verbs: the GID index (default: the last RoCE v2 GID, or 0 on InfiniBand)",
        default: None,
        set: |c, v| {
            c.gid_index = Some(
                v.parse()
                    .map_err(|_| format!("bad GID index {v:?}: 0 to 255"))?,
            );
            Ok(())
        },
    },
    MountOption {
        name: "secret_file",
        value: Value::Takes("PATH"),
        help: "Shared secret of the storage nodes",
        default: None,
        set: |c, v| {
            c.secret_file = Some(PathBuf::from(v));
            Ok(())
        },
    },
    MountOption {
        name: "mount_timeout",
        value: Value::Takes("SECONDS"),
        help: "Seconds mounting keeps trying to reach a metadata node that is not up yet (0: once)",
        default: Some("30"),
        set: |c, v| secs(v).map(|x| c.mount_timeout = x),
    },
    MountOption {
        name: "log_file",
        value: Value::Takes("PATH|syslog|-"),
        help:
            "Where to log: a file, syslog or - for stderr (default: stderr, syslog with --daemon)",
        default: None,
        set: |c, v| v.parse().map(|x| c.log_file = Some(x)),
    },
    MountOption {
        name: "metrics",
        value: Value::Takes("HOST:PORT"),
        help: "Serve the counters for Prometheus on this address (GET /metrics)",
        default: None,
        set: |c, v| {
            c.metrics = Some(v.parse().map_err(|_| format!("{v:?} is not HOST:PORT"))?);
            Ok(())
        },
    },
    MountOption {
        name: "ring",
        value: Value::Takes("PATH|off"),
        help: "The ring socket, for rfs-io beside the mount (default: /run/rfs/ring-PID.sock \
               as root, else under $XDG_RUNTIME_DIR or /tmp); off: no ring",
        default: None,
        set: |c, v| {
            c.ring = match v {
                "off" => RingPlace::Off,
                "" => return Err("an empty path".into()),
                path => RingPlace::At(PathBuf::from(path)),
            };
            Ok(())
        },
    },
    MountOption {
        name: "io_timeout",
        value: Value::Takes("SECONDS"),
        help: "Seconds before I/O to a silent storage node fails with EIO (at least 1)",
        default: Some("5"),
        set: |c, v| secs(v).map(|x| c.io_timeout = x),
    },
    MountOption {
        name: "qps",
        value: Value::Takes("N"),
        help: "Queue pairs per storage node, 1 to 64",
        default: Some("4"),
        set: |c, v| number(v).map(|x| c.session.qps = x),
    },
    MountOption {
        name: "window",
        value: Value::Takes("off|SIZE|adaptive"),
        help: "Admission window: off, a size (7M) or adaptive",
        default: Some("7M"),
        set: |c, v| v.parse().map(|x| c.session.window = x),
    },
    MountOption {
        name: "dyn_threshold",
        value: Value::Takes("SIZE|never"),
        help: "Requests at least this large register their own buffer (dynMR), but for reads that fit in a staging slot; never: always copy",
        default: Some("928K"),
        set: |c, v| {
            c.session.dyn_threshold = match v {
                "never" => usize::MAX,
                size => parse_size(size)? as usize,
            };
            Ok(())
        },
    },
    MountOption {
        name: "polling",
        value: Value::Takes("MODE"),
        help: "Completion polling: busy, event, event-batch, adaptive[:MAX_POLL_WC:MAX_RETRY]",
        default: Some("adaptive"),
        set: |c, v| v.parse().map(|x| c.session.polling = x),
    },
    MountOption {
        name: "merge",
        value: Value::OnOff,
        help: "Merging of adjacent requests on/off",
        default: Some("on"),
        set: |c, v| on_off(v).map(|x| c.session.merge = x),
    },
    MountOption {
        name: "chain",
        value: Value::OnOff,
        help: "Doorbell chaining on/off",
        default: Some("on"),
        set: |c, v| on_off(v).map(|x| c.session.chain = x),
    },
];

/// Options that mount(8), fstab and FUSE mount helpers pass and that mean nothing to us (the
/// defaults, or mount(8)'s own business).
const IGNORED: &[&str] = &[
    "rw", "defaults", "auto", "noauto", "user", "nouser", "users", "_netdev", "nofail", "dev",
    "suid", "exec", "atime", "noatime", "relatime",
];

/// mount(8)'s remount, refused (never dropped as unknown: a mount stacked on the old one
/// would follow).
const REMOUNT: &str = "remount";

/// A kernel mount flag passed on to the FUSE mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFlag {
    ReadOnly,
    NoSuid,
    NoDev,
    NoExec,
}

const KERNEL_FLAGS: &[(&str, KernelFlag)] = &[
    ("ro", KernelFlag::ReadOnly),
    ("nosuid", KernelFlag::NoSuid),
    ("nodev", KernelFlag::NoDev),
    ("noexec", KernelFlag::NoExec),
];

fn option_name(opt: &str) -> &str {
    opt.split_once('=').map_or(opt, |(n, _)| n).trim()
}

/// Options for others: ours to ignore (x-systemd.* and the like are for other programs;
/// comment= is fstab's).
fn is_ignored(name: &str) -> bool {
    IGNORED.contains(&name) || name.starts_with("x-") || name == "comment"
}

/// The flag that sets `opt`.
fn flag_name(opt: &MountOption) -> String {
    opt.name.replace('_', "-")
}

impl MountConfig {
    /// How long the kernel caches attributes and names, given the metadata node's `lease`.
    /// Callbacks drop them the moment another mount changes them, so they can be kept long;
    /// the node waits a lease for a client that does not answer a callback (stopped, or its
    /// connection lost), and half of one leaves the other half for a reply in flight to reach
    /// the kernel, as chunk references are refetched at half the lease.
    pub fn kernel_cache_for(&self, lease: Duration) -> (Duration, Duration) {
        let default = lease / 2;
        (
            self.attr_timeout.unwrap_or(default),
            self.entry_timeout.unwrap_or(default),
        )
    }

    /// Whether the `-o` option `opt` (`name` or `name=value`) is one this client takes or
    /// knows to ignore, whatever its value.
    pub fn knows(opt: &str) -> bool {
        let name = option_name(opt);
        is_ignored(name)
            || name == REMOUNT
            || KERNEL_FLAGS.iter().any(|(n, _)| *n == name)
            || OPTIONS.iter().any(|o| o.name == name)
    }

    /// Applies one `-o` option, `name` or `name=value`.
    pub fn apply(&mut self, opt: &str) -> Result<(), String> {
        let name = option_name(opt);
        let value = opt.split_once('=').map(|(_, v)| v.trim());
        if is_ignored(name) {
            return Ok(());
        }
        if name == REMOUNT {
            return Err("remounting is not supported: unmount and mount again".into());
        }
        if let Some(&(_, flag)) = KERNEL_FLAGS.iter().find(|(n, _)| *n == name) {
            if !self.kernel_flags.contains(&flag) {
                self.kernel_flags.push(flag);
            }
            return Ok(());
        }
        let Some(o) = OPTIONS.iter().find(|o| o.name == name) else {
            return Err(format!("unknown mount option -o {name}"));
        };
        let value = match (value, o.value) {
            (Some(v), _) => v,
            (None, Value::Switch | Value::OnOff) => "on",
            (None, Value::Takes(_)) => return Err(format!("-o {name} needs a value")),
        };
        (o.set)(self, value).map_err(|e| format!("-o {name}: {e}"))
    }

    /// Applies a comma-separated `-o` list.
    pub fn apply_list(&mut self, list: &str) -> Result<(), String> {
        list.split(',')
            .filter(|o| !o.trim().is_empty())
            .try_for_each(|o| self.apply(o))
    }

    /// Checks the ranges and derives what follows from other settings.
    pub fn validate(&mut self) -> Result<(), String> {
        if !(4096..=(1 << 20)).contains(&self.max_write) {
            return Err(format!(
                "-o max_write must be between 4K and 1M, got {}",
                self.max_write
            ));
        }
        if !(1..=256).contains(&self.threads) {
            return Err("-o threads must be 1..=256".into());
        }
        if self.io_timeout < Duration::from_secs(1) {
            return Err("-o io_timeout must be at least 1 second".into());
        }
        if !(1..=rfs_proto::hello::MAX_QPS as usize).contains(&self.session.qps) {
            return Err(format!("-o qps must be 1..={}", rfs_proto::hello::MAX_QPS));
        }
        self.rpc.timeout = self.io_timeout * 2;
        Ok(())
    }

    /// Busy polling spins a thread per queue pair of every storage node: more than there are
    /// cores and they take the CPU FUSE, the application and the transport need (measured in the
    /// Soft-RoCE VM, 2 CPUs and 4 queue pairs: a 128 KiB read cost 2.6x the CPU of adaptive polling
    /// and 21x the context switches, and ran at 0.74x; see docs/performance.md, polling modes).
    pub fn warn_if_spinning_outnumbers_cores(&self) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if self.session.polling == rdmabox::PollMode::Busy && self.session.qps >= cores {
            log::warn!(
                "busy polling spins {} threads per storage node on {cores} cores: give -o qps=1, or \
                 use adaptive polling",
                self.session.qps
            );
        }
    }

    /// How the client reaches the nodes: a silent node fails after `io_timeout`.
    pub fn client_config(&self, secret: Option<Vec<u8>>) -> ClientConfig {
        let mut transport = TransportConfig::with_provider(self.transport);
        transport.tcp.dead_peer_timeout = self.io_timeout;
        transport.verbs.dead_peer_timeout = self.io_timeout;
        transport.verbs.device = self.device.clone();
        transport.verbs.gid_index = self.gid_index;
        ClientConfig {
            transport,
            secret,
            session: SessionConfig {
                io_timeout: Some(self.io_timeout),
                ..self.session.clone()
            },
            rpc: self.rpc,
            connect_timeout: self.io_timeout,
            encrypt: self.encrypt,
            hard: self.hard,
        }
    }

    /// The command-line flags of every option, for clap.
    pub fn flags() -> Vec<Arg> {
        OPTIONS
            .iter()
            .map(|o| {
                let help = match o.default {
                    Some(d) => format!("{} (-o {}) [default: {d}]", o.help, o.name),
                    None => format!("{} (-o {})", o.help, o.name),
                };
                let arg = Arg::new(o.name).long(flag_name(o)).help(help);
                match o.value {
                    Value::Switch => arg.action(ArgAction::SetTrue),
                    Value::OnOff => arg.value_name("on|off"),
                    Value::Takes(v) => arg.value_name(v),
                }
            })
            .collect()
    }

    /// The configuration the flags in `m` and then the `-o` lists give, validated.
    pub fn from_matches(m: &ArgMatches, lists: &[String]) -> Result<MountConfig, String> {
        let mut c = MountConfig::default();
        for o in OPTIONS {
            let value = match o.value {
                Value::Switch => m.get_flag(o.name).then(|| "on".to_string()),
                Value::OnOff | Value::Takes(_) => m.get_one::<String>(o.name).cloned(),
            };
            if let Some(v) = value {
                c.apply(&format!("{}={v}", o.name))?;
            }
        }
        for list in lists {
            c.apply_list(list)?;
        }
        c.validate()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmabox::{PollMode, WindowConfig};

    /// The mount options as the table in `docs/configuration.md` lists them: one row per option,
    /// in order (a test keeps the two the same).
    fn markdown_table() -> String {
        let mut t = String::from(
            "| `-o` option | flag | value | default | what |\n|---|---|---|---|---|\n",
        );
        for o in OPTIONS {
            let value = match o.value {
                Value::Switch => "switch".to_string(),
                Value::OnOff => "`on\\|off`".to_string(),
                Value::Takes(shape) => format!("`{}`", shape.replace('|', "\\|")),
            };
            let default = o.default.map_or(String::new(), |d| format!("`{d}`"));
            t += &format!(
                "| `{}` | `--{}` | {value} | {default} | {} |\n",
                o.name,
                flag_name(o),
                o.help
            );
        }
        t
    }

    /// docs/configuration.md lists the options as they are: edit the code, then copy what this
    /// test prints between the markers.
    #[test]
    fn the_documented_option_table_is_the_codes() {
        let doc = include_str!("../../docs/configuration.md");
        let (begin, end) = (
            "<!-- mount-options:begin -->\n",
            "<!-- mount-options:end -->",
        );
        let from = doc.find(begin).expect("the begin marker") + begin.len();
        let to = doc[from..].find(end).expect("the end marker") + from;
        let want = markdown_table();
        assert!(
            doc[from..to] == want,
            "docs/configuration.md's mount options are stale; between the markers put:\n{want}"
        );
    }

    fn parse(list: &str) -> Result<MountConfig, String> {
        let mut c = MountConfig::default();
        c.apply_list(list)?;
        c.validate()?;
        Ok(c)
    }

    /// The default each option states is the default it has: set on a default configuration,
    /// it changes nothing.
    #[test]
    fn stated_defaults_are_the_defaults() {
        let fresh = format!("{:?}", MountConfig::default());
        for o in OPTIONS {
            let Some(d) = o.default else { continue };
            let mut c = MountConfig::default();
            (o.set)(&mut c, d).unwrap_or_else(|e| panic!("{}={d}: {e}", o.name));
            assert_eq!(
                format!("{c:?}"),
                fresh,
                "{} says its default is {d}",
                o.name
            );
        }
    }

    #[test]
    fn kernel_caches_half_the_lease_unless_told() {
        let lease = Duration::from_secs(10);
        let c = parse("rw").unwrap();
        let half = Duration::from_secs(5);
        assert_eq!(c.kernel_cache_for(lease), (half, half));
        let c = parse("attr_timeout=0,entry_timeout=60").unwrap();
        assert_eq!(
            c.kernel_cache_for(lease),
            (Duration::ZERO, Duration::from_secs(60))
        );
    }

    #[test]
    fn options_parse() {
        let c = parse("allow_other,max_write=128K,writeback_cache=off,write_behind=4M,attr_timeout=2.5,threads=8,transport=tcp,qps=2,window=off,dyn_threshold=never,polling=busy,merge=0,chain=no,io_timeout=3,device=mlx5_1,gid_index=3,rw,_netdev,nofail,x-systemd.automount,comment=x,nosuid,nodev,nosuid,mount_timeout=7,log_file=syslog,metrics=127.0.0.1:9101")
            .unwrap();
        assert_eq!(c.kernel_flags, [KernelFlag::NoSuid, KernelFlag::NoDev]);
        assert_eq!(c.mount_timeout, Duration::from_secs(7));
        assert_eq!(c.log_file, Some(LogTarget::Syslog));
        assert_eq!(c.metrics, Some("127.0.0.1:9101".parse().unwrap()));
        assert!(c.allow_other);
        assert_eq!(c.max_write, 128 << 10);
        assert_eq!(c.attr_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(c.write_behind, 4 << 20);
        assert_eq!(parse("write_behind=off").unwrap().write_behind, 0);
        assert_eq!(c.threads, 8);
        assert_eq!(c.transport, ProviderKind::Tcp);
        assert_eq!(c.session.qps, 2);
        assert_eq!(c.session.window, WindowConfig::Off);
        assert_eq!(c.session.dyn_threshold, usize::MAX);
        assert_eq!(c.session.polling, PollMode::Busy);
        assert!(!c.session.merge && !c.session.chain);
        assert_eq!(c.rpc.timeout, Duration::from_secs(6), "follows io_timeout");
        let cc = c.client_config(None);
        assert_eq!(cc.transport.tcp.dead_peer_timeout, Duration::from_secs(3));
        assert_eq!(cc.connect_timeout, Duration::from_secs(3));
        assert_eq!(cc.transport.verbs.dead_peer_timeout, Duration::from_secs(3));
        assert_eq!(cc.transport.verbs.device.as_deref(), Some("mlx5_1"));
        assert_eq!(cc.transport.verbs.gid_index, Some(3));
        assert_eq!(
            cc.session.io_timeout,
            Some(Duration::from_secs(3)),
            "a data request's deadline"
        );
    }

    #[test]
    fn defaults_are_the_libraries_own() {
        let c = parse("").unwrap();
        let s = SessionConfig::default();
        assert_eq!(
            (c.session.qps, c.session.dyn_threshold, c.session.polling),
            (s.qps, s.dyn_threshold, s.polling)
        );
        assert_eq!(c.rpc.timeout, c.io_timeout * 2);
    }

    #[test]
    fn bad_options_say_what_is_wrong() {
        for (bad, needle) in [
            ("max_write=2M", "max_write"),
            ("max_write", "needs a value"),
            ("threads=0", "threads"),
            ("bogus", "unknown mount option"),
            ("transport=smoke", "transport"),
            ("merge=maybe", "merge"),
            ("io_timeout=0.1", "io_timeout"),
            ("attr_timeout=-1", "attr_timeout"),
            ("qps=65", "qps"),
            ("gid_index=256", "GID index"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }

    #[test]
    fn every_option_has_a_flag_and_flags_apply_before_o_lists() {
        let cmd = clap::Command::new("t").args(MountConfig::flags()).arg(
            Arg::new("o")
                .short('o')
                .action(ArgAction::Append)
                .value_name("OPTIONS"),
        );
        assert_eq!(cmd.get_arguments().count(), OPTIONS.len() + 1);
        let m = cmd
            .try_get_matches_from([
                "t",
                "--qps",
                "3",
                "--allow-other",
                "--merge",
                "off",
                "-o",
                "qps=5",
            ])
            .unwrap();
        let lists: Vec<String> = m.get_many::<String>("o").unwrap().cloned().collect();
        let c = MountConfig::from_matches(&m, &lists).unwrap();
        assert_eq!(c.session.qps, 5, "-o wins");
        assert!(c.allow_other);
        assert!(!c.session.merge);
    }
}
