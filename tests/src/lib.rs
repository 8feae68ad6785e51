//! The end-to-end harness: starts real `mem-server` processes and real `fs-client` mounts, each
//! on its own ephemeral port and mount point, and tears them down (unmount, kill by PID, remove
//! the directory) when dropped, also when a test fails.
//!
//! The binaries come from the workspace's target directory: `cargo test --workspace` builds them
//! (mem-server, fs-client and rfs-admin have integration tests of their own, and cargo builds a
//! package's binaries only for those).
//!
//! Nodes and mounts use the tcp provider, or the one `RFS_E2E_TRANSPORT` names (`verbs` in the
//! Soft-RoCE VM of tests/rxe).

pub mod model;
pub mod rng;
pub mod spawn;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockWriteGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub use spawn::what_it_does;
use spawn::{Io, Process};

/// A binary of this workspace, next to the running test's own profile directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("target layout")
        .join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace` first",
        path.display()
    );
    path
}

/// Held shared while this test process starts a child, and exclusively by a test that needs
/// no child started for a while. A child the harness starts holds no descriptor of this
/// process ([`spawn`]), but one started otherwise (`Command`) gets a copy of every one, and
/// its exec closes them: each close of a file open through a mount sends FLUSH, which commits
/// (and reconnects a severed mount), so "nothing calls the node now" would not hold while
/// other tests of the binary start processes.
static STARTING_CHILDREN: RwLock<()> = RwLock::new(());

/// Runs `start` (which starts a child process) while no test holds [`no_children_started`].
fn starting_child<T>(start: impl FnOnce() -> T) -> T {
    let _shared = STARTING_CHILDREN
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    start()
}

/// The numbers the lines of `text` start with ("N who"): a file that writers append to in
/// turn, each numbering its line after the last.
pub fn line_numbers(text: &str) -> Vec<usize> {
    text.lines()
        .map(|l| l.split(' ').next().unwrap().parse().unwrap())
        .collect()
}

/// Runs `cmd` to its end, its output captured (stdin /dev/null), as a test that starts
/// processes must ([`no_children_started`]): it holds no descriptor of this process. Only the
/// command's program, arguments, environment and directory are taken (see [`spawn::spawn`]):
/// a command run as another user (`uid`, `gid`) goes through `Command` itself.
pub fn run_child(cmd: &mut Command) -> std::io::Result<std::process::Output> {
    starting_child(|| spawn::output(cmd))
}

/// Until the guard goes, no other test of this binary starts a process (they wait). Start
/// none while holding it, and drop no [`Mount`] (its unmount starts one).
pub fn no_children_started() -> RwLockWriteGuard<'static, ()> {
    STARTING_CHILDREN
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The provider every node, mount and test client uses.
pub fn transport() -> String {
    let t = std::env::var("RFS_E2E_TRANSPORT").unwrap_or_else(|_| "tcp".into());
    if let Err(e) = t.parse::<rdmabox::transport::ProviderKind>() {
        panic!("RFS_E2E_TRANSPORT: {e}");
    }
    t
}

/// An empty directory for a metadata node's state, named for the test (`name`) and process.
fn state_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rfs-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The secret the first node created at the default path (every test node uses it).
pub fn secret() -> Option<Vec<u8>> {
    Some(
        rfs_daemon::secret::for_peer(None)
            .unwrap()
            .expect("a node created the secret"),
    )
}

/// How protocol-level test clients connect: the tests' provider, the default secret, two queue
/// pairs per data session.
pub fn client_config() -> rfs_client::ClientConfig {
    let provider = transport().parse().expect("checked by transport()");
    let mut cfg = rfs_client::ClientConfig {
        transport: rdmabox::transport::TransportConfig::with_provider(provider),
        secret: secret(),
        ..rfs_client::ClientConfig::default()
    };
    cfg.session.qps = 2;
    cfg
}

/// A protocol-level client of `node`.
pub fn client(node: &MemServer) -> rfs_client::Client {
    rfs_client::Client::connect(&node.addr.to_string(), client_config()).expect("client connects")
}

/// A child's log (its stderr). With `RFS_E2E_LOG_DIR=DIR` (and `RUST_LOG`), a file of its own
/// there, kept, for a test being debugged. Otherwise a temporary file, printed if the test
/// fails (the warnings, errors and panics in it are what explains a rare failure) and removed.
struct ChildLog {
    path: PathBuf,
    keep: bool,
}

/// How much of a failed test's child log is printed: its end.
const LOG_LINES_SHOWN: usize = 80;

impl ChildLog {
    /// What was logged so far.
    fn text(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    /// A fresh log for `program`, and the stderr that writes it.
    fn new(program: &str) -> (ChildLog, Io) {
        static NEXT_LOG: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT_LOG.fetch_add(1, Ordering::Relaxed);
        let name = format!("{program}-{}-{n}.log", std::process::id());
        let (path, keep) = match std::env::var_os("RFS_E2E_LOG_DIR") {
            Some(dir) => (PathBuf::from(dir).join(name), true),
            None => (std::env::temp_dir().join(format!("rfs-e2e-{name}")), false),
        };
        match std::fs::File::create(&path) {
            Ok(_) => (
                ChildLog {
                    path: path.clone(),
                    keep,
                },
                Io::Append(path),
            ),
            Err(e) => panic!("log file {}: {e}", path.display()),
        }
    }
}

impl Drop for ChildLog {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            if !lines.is_empty() {
                let shown = &lines[lines.len().saturating_sub(LOG_LINES_SHOWN)..];
                eprintln!(
                    "--- the end of {} ---\n{}\n---",
                    self.path.display(),
                    shown.join("\n")
                );
            }
        }
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The body of `GET /metrics` at `addr`.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out
}

/// The value of metric `name` (unlabelled) in a scrape.
pub fn metric(scraped: &str, name: &str) -> Option<u64> {
    scraped
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Runs the admin tool `rfs` with `args`, on the tests' transport.
pub fn rfs(args: &[&str]) -> std::process::Output {
    Command::new(bin("rfs"))
        .args(args)
        .args(["--transport", &transport()])
        .output()
        .expect("run rfs")
}

/// A port nobody listens on, below the ephemeral range: one a node can take later (an
/// ephemeral port may meanwhile be the local end of some connection). Never handed out twice
/// in one test process, so another test cannot take it meanwhile.
pub fn free_port() -> u16 {
    static TRIED: AtomicU32 = AtomicU32::new(0);
    (0..1000)
        .map(|_| {
            let n = TRIED.fetch_add(1, Ordering::Relaxed);
            (20000 + (std::process::id() * 97 + n * 13) % 12000) as u16
        })
        .find(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// A mem-server process.
pub struct MemServer {
    child: Process,
    pub addr: SocketAddr,
    args: Vec<String>,
    /// A restartable node's successor, waiting to become it (see [`Standby`]).
    standby: Option<Standby>,
    /// Its logs, one per life (restarts), oldest first.
    logs: Vec<ChildLog>,
    /// Its state directory, removed with it (see [`MemServer::durable_meta`]).
    state: Option<PathBuf>,
}

/// A shell that execs mem-server once told to, started while the node it replaces is up: a
/// restart then only waits for the node to get ready.
struct Standby {
    shell: Process,
    _log: ChildLog,
}

impl Standby {
    fn spawn(listen: &str, args: &[String]) -> Standby {
        let (log, stderr) = ChildLog::new("mem-server");
        let mut command = Command::new("sh");
        command
            .args(["-c", "read -r _ && exec \"$0\" \"$@\""])
            .arg(bin("mem-server"))
            .args(["--listen", listen, "--transport", &transport()])
            .args(args);
        let shell = starting_child(|| spawn::spawn(&command, Io::Piped, Io::Piped, stderr))
            .expect("start a standby shell");
        Standby { shell, _log: log }
    }

    /// The mem-server the shell becomes now, and its log.
    fn become_node(mut self) -> (Process, ChildLog) {
        use std::io::Write;
        let mut go = self.shell.stdin.take().expect("piped");
        go.write_all(b"go\n").expect("the standby shell waits");
        (self.shell, self._log)
    }
}

impl MemServer {
    pub fn start(args: &[&str]) -> MemServer {
        MemServer::start_on("127.0.0.1:0", args)
    }

    /// The durable metadata node docs/semantics.md describes, restartable: it lends nothing, keeps
    /// its state in a directory of its own (named for the test, `name`, and removed with the
    /// node), and takes `extra` arguments; 1 MiB chunks.
    pub fn durable_meta(name: &str, extra: &[&str]) -> MemServer {
        let dir = state_dir(name);
        let dir_arg = dir.to_string_lossy().to_string();
        let mut args = vec![
            "--memory",
            "0",
            "--chunk-size",
            "1M",
            "--state-dir",
            &dir_arg,
        ];
        args.extend_from_slice(extra);
        let mut node = MemServer::start_restartable(&args);
        node.state = Some(dir);
        node
    }

    /// Like [`MemServer::start`], on a [`free_port`]: one a restart can take again.
    pub fn start_restartable(args: &[&str]) -> MemServer {
        let mut node = MemServer::start_on(&format!("127.0.0.1:{}", free_port()), args);
        node.standby = Some(Standby::spawn(&node.addr.to_string(), &node.args));
        node
    }

    /// Kills the node (SIGKILL) and starts it again with the same arguments on the same
    /// address.
    pub fn restart(&mut self) {
        self.restart_after(Duration::ZERO);
    }

    /// Kills the node (SIGKILL), waits `pause`, and starts it again with the same arguments on
    /// the same address.
    pub fn restart_after(&mut self, pause: Duration) {
        let standby = self
            .standby
            .take()
            .expect("started with MemServer::start_restartable");
        self.kill();
        std::thread::sleep(pause);
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let (child, log) = standby.become_node();
        let mut node = MemServer::ready(child, log, &args);
        node.standby = Some(Standby::spawn(&self.addr.to_string(), &self.args));
        // The node's earlier lives' logs go with it, printed first if the test fails.
        node.logs.splice(..0, std::mem::take(&mut self.logs));
        node.state = self.state.take();
        *self = node;
    }

    /// A node listening on `listen` (HOST:PORT).
    pub fn start_on(listen: &str, args: &[&str]) -> MemServer {
        let (log, stderr) = ChildLog::new("mem-server");
        let mut command = Command::new(bin("mem-server"));
        command
            .args(["--listen", listen, "--transport", &transport()])
            .args(args);
        let child = starting_child(|| spawn::spawn(&command, Io::Null, Io::Piped, stderr))
            .expect("start mem-server");
        MemServer::ready(child, log, args)
    }

    /// The node `child` (logging to `log`) is, once its banner says where it listens.
    fn ready(mut child: Process, log: ChildLog, args: &[&str]) -> MemServer {
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("mem-server banner");
        let addr = line
            .split_whitespace()
            .nth(3)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected mem-server banner {line:?}"));
        MemServer {
            child,
            addr,
            args: args.iter().map(|a| a.to_string()).collect(),
            standby: None,
            logs: vec![log],
            state: None,
        }
    }

    /// A metadata node lending `memory` with `chunk` chunks.
    pub fn meta(memory: &str, chunk: &str) -> MemServer {
        MemServer::start(&["--memory", memory, "--chunk-size", chunk])
    }

    /// A data node joining `meta`.
    /// A data node joined to `meta`: returned once `meta` lists it, so that nodes started one
    /// after the other get their ids in that order (a test kills "node 2").
    pub fn data(meta: &MemServer, memory: &str, chunk: &str) -> MemServer {
        use rfs_proto::message::ListNodes;
        use rfs_proto::MetadataChannel;
        let m = meta.addr.to_string();
        let node = MemServer::start(&["--memory", memory, "--chunk-size", chunk, "--join", &m]);
        let c = client(meta);
        let start = Instant::now();
        let me = node.addr.to_string();
        while !c
            .call(ListNodes {})
            .unwrap()
            .iter()
            .any(|n| n.alive && n.addr == me)
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "data node {me} has not joined {m}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        node
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// What it logged, over all its lives.
    pub fn log_text(&self) -> String {
        self.logs.iter().map(ChildLog::text).collect()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the node exited, if it did within `limit` (after a signal of the test's).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        exited_within(&mut self.child, limit)
    }
}

/// How `child` exited, if it did within `limit`.
fn exited_within(child: &mut Process, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl Drop for MemServer {
    fn drop(&mut self) {
        self.kill();
        if let Some(mut s) = self.standby.take() {
            // Its stdin closes with it: the shell exits without exec.
            let _ = s.shell.kill();
            let _ = s.shell.wait();
        }
        if let Some(dir) = self.state.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

static NEXT_MOUNT: AtomicU32 = AtomicU32::new(0);

/// The log filter of a mount's fs-client where `RUST_LOG` does not name one.
const FS_CLIENT_LOG: &str = "warn,fs_client=info,rfs_proto=info,fuser::mnt=error";

/// Whether something is mounted on `dir`.
pub fn is_mounted(dir: &Path) -> bool {
    let target = dir.to_string_lossy();
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(&target))
}

/// An fs-client mount in a fresh directory.
pub struct Mount {
    child: Process,
    pub dir: PathBuf,
    _log: ChildLog,
}

impl Mount {
    pub fn new(server: &MemServer, opts: &[&str]) -> Mount {
        let n = NEXT_MOUNT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("rfs-e2e-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mount point");
        // The ring socket beside the mount point, gone with it (not left in /run/rfs).
        let ring = dir.with_extension("ring");
        let mut o = vec![
            format!("transport={}", transport()),
            format!("ring={}", ring.display()),
        ];
        o.extend(opts.iter().map(|s| s.to_string()));
        let (log, stderr) = ChildLog::new("fs-client");
        let mut command = Command::new(bin("fs-client"));
        command
            .arg(server.addr.to_string())
            .arg(&dir)
            .args(["-o", &o.join(",")]);
        if std::env::var_os("RUST_LOG").is_none() {
            // Warnings, and the few steps of its start and recovery (connected, mounted): a
            // mount that does not appear says how far it got.
            command.env("RUST_LOG", FS_CLIENT_LOG);
        }
        let child = starting_child(|| spawn::spawn(&command, Io::Null, Io::Null, stderr))
            .expect("start fs-client");
        let mut m = Mount {
            child,
            dir,
            _log: log,
        };
        let start = Instant::now();
        while !is_mounted(&m.dir) {
            if let Ok(Some(status)) = m.child.try_wait() {
                panic!("fs-client exited before mounting: {status}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "mount did not appear: {}",
                what_it_does(m.child.id(), "fs-client")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        m.wait_ready();
        m
    }

    fn wait_ready(&mut self) {
        // The first stat goes through the new mount (and proves it answers).
        let start = Instant::now();
        while std::fs::metadata(&self.dir).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "mount does not answer: {}",
                what_it_does(self.child.id(), "fs-client")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// A counter of the mount's stats file.
    pub fn stat(&self, name: &str) -> u64 {
        let text = std::fs::read_to_string(self.path(".rfs-stats")).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }

    /// What its fs-client logged.
    pub fn log_text(&self) -> String {
        self._log.text()
    }

    /// The fs-client process, to stop or kill in a test.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Kills fs-client (SIGKILL), as a crash would; the mount is left to `Drop`.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// How fs-client exited, if it did within `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        exited_within(&mut self.child, limit)
    }

    /// Unmounts with fusermount3 and waits (up to 10 s) for fs-client to exit; returns its
    /// exit success.
    pub fn unmount(&mut self) -> bool {
        self.unmount_within(Duration::from_secs(10))
    }

    /// [`Mount::unmount`], waiting up to `limit` for fs-client to finish the calls it has
    /// under way (each bounded by its deadline).
    ///
    /// A mount still busy (a close of a file is still flushing: the kernel holds the file
    /// until then) is unmounted again, as a user would, until `limit`.
    pub fn unmount_within(&mut self, limit: Duration) -> bool {
        let start = Instant::now();
        let ok = loop {
            let mut command = Command::new("fusermount3");
            command.arg("-u").arg(&self.dir);
            let out = starting_child(|| spawn::output(&command)).expect("fusermount3 runs");
            if out.status.success() {
                break true;
            }
            let why = String::from_utf8_lossy(&out.stderr);
            if !why.contains("busy") || start.elapsed() >= limit {
                eprintln!("fusermount3 -u {}: {why}", self.dir.display());
                break false;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return ok && status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.dir) {
            // Lazy unmount: never hang a failing test on a busy mount.
            let mut command = Command::new("fusermount3");
            command.args(["-u", "-z"]).arg(&self.dir);
            let _ = starting_child(|| spawn::spawn(&command, Io::Null, Io::Null, Io::Null))
                .and_then(|mut p| p.wait());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_file(self.dir.with_extension("ring"));
    }
}

/// Waits up to `limit` for `check` to hold, failing the test with `what` past it.
pub fn within(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The errno of an I/O error (0 when it has none).
pub fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Stops process `pid` (SIGSTOP) and returns once it is stopped: the signal is asynchronous,
/// and a test that races it may see the process answer "while stopped".
pub fn stop(pid: u32) {
    kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).expect("SIGSTOP");
    let start = Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the parenthesized command name.
        if stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T'))
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{pid} never stopped"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lets a process [`stop`] stopped run again (SIGCONT).
pub fn resume(pid: u32) {
    kill(Pid::from_raw(pid as i32), Signal::SIGCONT).expect("SIGCONT");
}

/// A read-only shared mapping of the first `len` bytes of `f`, for the test to read (the file
/// must not shrink below `len` while it is mapped) and `libc::munmap`. Panics with the errno if
/// the kernel refuses it.
pub fn map_shared(f: &std::fs::File, len: usize) -> *mut libc::c_void {
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh mapping at an address the kernel picks: it overlaps no memory of ours.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        map,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    map
}

/// `path` opened with O_DIRECT (no page cache: every read and write goes to the nodes), for
/// reading and, with `write`, writing.
pub fn open_direct(path: impl AsRef<std::path::Path>, write: bool) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap()
}

/// Writes `data` (4 KiB) at `offset` of a file opened with O_DIRECT, from an aligned buffer.
pub fn direct_write(f: &std::fs::File, offset: u64, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut raw = vec![0u8; 8192];
    let at = raw.as_ptr().align_offset(4096);
    raw[at..at + data.len()].copy_from_slice(data);
    f.write_all_at(&raw[at..at + data.len()], offset)
}

/// 4 KiB at `offset` of a file opened with O_DIRECT (no page cache): (the result, how long it
/// took).
pub fn direct_read(f: &std::fs::File, offset: u64) -> (std::io::Result<Vec<u8>>, Duration) {
    use std::os::unix::fs::FileExt;
    let mut raw = vec![0u8; 8192];
    let at = raw.as_ptr().align_offset(4096);
    let start = Instant::now();
    let r = f.read_at(&mut raw[at..at + 4096], offset);
    (r.map(|n| raw[at..at + n].to_vec()), start.elapsed())
}

/// Waits (up to `limit`) until the metadata node `meta` counts node `dead` dead and no chunk
/// short of copies; how long that took.
pub fn wait_until_whole(meta: &MemServer, dead: u32, limit: Duration) -> Duration {
    use rfs_proto::message::{GetStatFs, ListNodes};
    use rfs_proto::MetadataChannel;
    let c = client(meta);
    let start = Instant::now();
    loop {
        let nodes = c.call(ListNodes {}).unwrap();
        let gone = nodes.iter().any(|n| n.id == dead && !n.alive);
        let short = c.call(GetStatFs {}).unwrap().chunks_short;
        if gone && short == 0 {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{short} chunks still short of copies after {limit:?} (node {dead} dead: {gone})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
