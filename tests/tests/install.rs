//! Installed as a network file system is: scripts/install.sh, `mount -t rfs` and an fstab line
//! through mount.rfs, `umount`, nodes and clients started in any order, logs to a file, and
//! systemd readiness.

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rfs_e2e::{bin, free_port, is_mounted, transport, MemServer};

/// A scratch directory for one test, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("rfs-install-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn install_to(dest: &Path) {
    let bins = bin("fs-client").parent().unwrap().to_path_buf();
    run(Command::new("bash")
        .arg(repo().join("scripts/install.sh"))
        .env("DESTDIR", dest)
        .env("RFS_BIN_DIR", bins));
}

/// The harness answers --help before it sets anything up: with nothing but a shell, a sed and
/// python on the PATH, setup (apt-get, cargo) would fail.
#[test]
fn the_harness_says_its_help_before_setting_anything_up() {
    let scratch = Scratch::new("harness-help");
    for tool in ["bash", "dirname", "sed"] {
        let found = run(Command::new("bash").args(["-c", &format!("command -v {tool}")]));
        let at = String::from_utf8_lossy(&found.stdout).trim().to_string();
        std::os::unix::fs::symlink(at, scratch.0.join(tool)).unwrap();
    }
    let out = run(Command::new("bash")
        .arg(repo().join("iozone/run.sh"))
        .arg("--help")
        .env("PATH", &scratch.0));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("--small-files"), "{said}");
}

#[test]
fn install_stages_the_binaries_the_mount_helper_and_valid_units() {
    let dest = Scratch::new("stage");
    install_to(&dest.0);
    for f in [
        "usr/local/bin/mem-server",
        "usr/local/bin/fs-client",
        "usr/local/bin/rfs",
    ] {
        assert!(dest.0.join(f).is_file(), "{f}");
    }
    assert_eq!(
        std::fs::read_link(dest.0.join("sbin/mount.rfs")).unwrap(),
        Path::new("/usr/local/bin/fs-client")
    );
    let unit = std::fs::read_to_string(dest.0.join("etc/systemd/system/rfs-node.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/local/bin/mem-server $RFS_NODE_ARGS"));
    assert!(unit.contains("Type=notify"));
    let env = dest.0.join("etc/rfs/node.env");
    assert!(std::fs::read_to_string(&env)
        .unwrap()
        .contains("RFS_NODE_ARGS="));
    // Installing again keeps the settings someone edited.
    std::fs::write(&env, "RFS_NODE_ARGS=--memory 2G\n").unwrap();
    install_to(&dest.0);
    assert_eq!(
        std::fs::read_to_string(&env).unwrap(),
        "RFS_NODE_ARGS=--memory 2G\n"
    );
    assert!(dest
        .0
        .join("usr/local/share/doc/rfs/examples/mnt-rfs.mount")
        .is_file());

    // systemd's own check of the units, where systemd is installed: the node unit pointed at
    // the binary just built (verify wants its ExecStart to exist).
    if Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        eprintln!("no systemd-analyze: units not verified");
        return;
    }
    let units = Scratch::new("units");
    let node_unit = unit
        .replace(
            "/usr/local/bin/mem-server",
            &bin("mem-server").to_string_lossy(),
        )
        .replace("/etc/rfs/node.env", &env.to_string_lossy());
    std::fs::write(units.0.join("rfs-node.service"), &node_unit).unwrap();
    let template = std::fs::read_to_string(dest.0.join("etc/systemd/system/rfs-node@.service"))
        .unwrap()
        .replace(
            "/usr/local/bin/mem-server",
            &bin("mem-server").to_string_lossy(),
        )
        .replace("/etc/rfs/node-%i.env", &env.to_string_lossy());
    std::fs::write(units.0.join("rfs-node@.service"), template).unwrap();
    std::fs::copy(
        repo().join("dist/systemd/mnt-rfs.mount"),
        units.0.join("mnt-rfs.mount"),
    )
    .unwrap();
    // Hardened: systemd's own exposure score (0 safest, 10 unsafe) is below 5 for the node.
    for u in ["rfs-node.service", "rfs-node@.service"] {
        let out = Command::new("systemd-analyze")
            .args(["security", "--offline=true"])
            .arg(units.0.join(u))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("unrecognized") {
            eprintln!("systemd-analyze too old for --offline (systemd 250): exposure not scored");
            break;
        }
        let score: f64 = said
            .lines()
            .find_map(|l| l.split("exposure level for ").nth(1))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no exposure level in {said}"));
        assert!(score < 5.0, "{u}: exposure {score}\n{said}");
    }
    for u in ["rfs-node.service", "rfs-node@.service", "mnt-rfs.mount"] {
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(units.0.join(u))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        // Only what concerns our units: the host's own units may have findings of their own.
        let ours: Vec<&str> = said
            .lines()
            .filter(|l| l.contains("rfs-node") || l.contains("mnt-rfs"))
            .collect();
        assert!(
            out.status.success() && ours.is_empty(),
            "systemd-analyze verify {u}: {}\n{said}",
            out.status
        );
    }
}

/// /sbin/mount.rfs for the test: the installed one if it is this build's client, else a link
/// made for the test and removed after. `None` (and the test skips mount(8)) when another
/// client is installed there. The link is the machine's: a lock file keeps test runs of other
/// processes (two suites at once) from removing it under this one.
struct MountHelper {
    made: bool,
    _machine_wide: std::fs::File,
}

impl MountHelper {
    const PATH: &'static str = "/sbin/mount.rfs";

    fn get() -> Option<MountHelper> {
        use std::os::fd::AsRawFd;
        let lock = std::fs::File::create(std::env::temp_dir().join("rfs-e2e-mount-helper.lock"))
            .expect("the mount helper's lock file");
        // SAFETY: flock on a descriptor we own; it is released when the file closes.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        let ours = bin("fs-client");
        let made = match std::fs::canonicalize(Self::PATH) {
            Ok(p) if p == std::fs::canonicalize(&ours).unwrap() => false,
            Ok(_) => return None,
            Err(_) => {
                std::os::unix::fs::symlink(&ours, Self::PATH).ok()?;
                true
            }
        };
        Some(MountHelper {
            made,
            _machine_wide: lock,
        })
    }
}

impl Drop for MountHelper {
    fn drop(&mut self) {
        if self.made {
            let _ = std::fs::remove_file(Self::PATH);
        }
    }
}

/// Unmounts `dir` with umount(8) and waits for the client `pid` to be gone.
fn umount_and_wait(dir: &Path, pid: u32) {
    run(Command::new("umount").arg(dir));
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "fs-client {pid} outlived its unmount"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!is_mounted(dir));
}

/// The pid in "fs-client: mounted (pid N)".
fn mounted_pid(out: &Output) -> u32 {
    let said = String::from_utf8_lossy(&out.stdout);
    said.split("pid ")
        .nth(1)
        .and_then(|s| s.trim().trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no pid in {said:?}"))
}

/// Lazily unmounts what a failed test left mounted.
struct Unmount<'a>(&'a Path);

impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        if is_mounted(self.0) {
            let _ = Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
}

#[test]
fn mount_t_rfs_and_an_fstab_line_mount_and_umount_unmounts() {
    let Some(_helper) = MountHelper::get() else {
        eprintln!(
            "{} is another client: mount(8) not tested",
            MountHelper::PATH
        );
        return;
    };
    let node = MemServer::meta("64M", "1M");
    let scratch = Scratch::new("mount");
    let dir = scratch.0.join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let _cleanup = Unmount(&dir);
    let opts = format!(
        "_netdev,nofail,x-systemd.automount,transport={}",
        transport()
    );

    let out = run(Command::new("mount")
        .args(["-t", "rfs", &node.addr.to_string()])
        .arg(&dir)
        .args(["-o", &opts]));
    assert!(is_mounted(&dir));
    std::fs::write(dir.join("f"), b"through mount(8)").unwrap();
    umount_and_wait(&dir, mounted_pid(&out));

    // The same as an fstab line, mounted by its mount point.
    let fstab = scratch.0.join("fstab");
    std::fs::write(
        &fstab,
        format!("{}  {}  rfs  {opts}  0  0\n", node.addr, dir.display()),
    )
    .unwrap();
    let out = run(Command::new("mount").arg("--fstab").arg(&fstab).arg(&dir));
    assert_eq!(std::fs::read(dir.join("f")).unwrap(), b"through mount(8)");
    // mount -a knows it is mounted (the source shows as the fstab line has it).
    run(Command::new("mount")
        .args(["-a", "-t", "rfs", "--fstab"])
        .arg(&fstab));
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let target = format!(" {} ", dir.display());
    assert_eq!(mounts.matches(&target).count(), 1, "{mounts}");
    umount_and_wait(&dir, mounted_pid(&out));

    // Bad options are refused with the reason, and nothing is mounted.
    let out = Command::new("mount")
        .args(["-t", "rfs", &node.addr.to_string()])
        .arg(&dir)
        .args(["-o", "qps=lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("qps"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!is_mounted(&dir));
}

/// The kernel lists a mount as `fuse.rfs` (so `findmnt -t fuse.rfs` and `umount -a -t fuse.rfs`
/// find it), and fs-client refuses a mount point that is not a directory (the kernel would
/// take a file, and every stat there would fail with EIO) or that has an rfs mount already.
#[test]
fn mounts_are_fuse_rfs_on_directories_and_never_stacked() {
    let node = MemServer::start(&["--memory", "32M"]);
    let scratch = Scratch::new("stack");
    let dir = scratch.0.join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let file = scratch.0.join("file");
    std::fs::write(&file, b"x").unwrap();
    let _cleanup = Unmount(&dir);
    let out = run(Command::new(bin("fs-client"))
        .arg(node.addr.to_string())
        .arg(&dir)
        .args(["--daemon", "-o", &format!("transport={}", transport())]));
    let listed = run(Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE", "-t", "fuse.rfs"])
        .arg(&dir));
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), "fuse.rfs");
    std::fs::write(dir.join("f"), b"first mount").unwrap();
    for (point, why) in [
        (&dir, "an rfs mount is there already"),
        (&file, "not a directory"),
    ] {
        let refused = Command::new(bin("fs-client"))
            .arg(node.addr.to_string())
            .arg(point)
            .args(["--daemon", "-o", &format!("transport={}", transport())])
            .output()
            .unwrap();
        assert!(!refused.status.success());
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(said.contains(why), "{said}");
    }
    assert_eq!(std::fs::read(dir.join("f")).unwrap(), b"first mount");
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    umount_and_wait(&dir, mounted_pid(&out));
}

#[test]
fn a_client_started_before_its_node_waits_for_it_and_logs_to_its_file() {
    let scratch = Scratch::new("early");
    let dir = scratch.0.join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let _cleanup = Unmount(&dir);
    let log = scratch.0.join("client.log");
    let listen = format!("127.0.0.1:{}", free_port());
    let opts = format!(
        "transport={},mount_timeout=30,log_file={}",
        transport(),
        log.display()
    );
    let mut client = Command::new(bin("fs-client"))
        .arg(&listen)
        .arg(&dir)
        .args(["--daemon", "-o", &opts])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let _node = MemServer::start_on(&listen, &["--memory", "64M"]);
    let status = client.wait().unwrap();
    assert!(status.success(), "the mount gave up: {status}");
    assert!(is_mounted(&dir));
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(logged.contains("trying again"), "{logged}");
    assert!(logged.contains("reached after"), "{logged}");
    run(Command::new("umount").arg(&dir));

    // With nobody there at all, the wait is bounded and says so.
    let start = Instant::now();
    let out = Command::new(bin("fs-client"))
        .arg(format!("127.0.0.1:{}", free_port()))
        .arg(&dir)
        .arg("-o")
        .arg(format!("transport={},mount_timeout=1", transport()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("tried for"), "{said}");
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(!is_mounted(&dir));
}

#[test]
fn a_data_node_started_before_the_metadata_node_joins_it() {
    let listen = format!("127.0.0.1:{}", free_port());
    let join = listen.clone();
    let early = std::thread::spawn(move || {
        MemServer::start(&["--memory", "32M", "--join", &join, "--join-timeout", "30"])
    });
    std::thread::sleep(Duration::from_millis(800));
    let meta = MemServer::start_on(&listen, &["--memory", "32M"]);
    let data = early.join().expect("the data node joined");
    assert_ne!(data.addr, meta.addr);

    // A node the metadata node refuses (it cannot be reached where it says) gives up at
    // once, saying why, instead of trying for its whole timeout.
    let start = Instant::now();
    let out = Command::new(bin("mem-server"))
        .args(["--listen", "127.0.0.1:0", "--memory", "16M", "--transport"])
        .arg(transport())
        .args([
            "--join",
            &listen,
            "--advertise",
            "127.0.0.1:1",
            "--join-timeout",
            "60",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("cannot reach it at 127.0.0.1:1"), "{said}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );

    // A node with nobody to join gives up after its timeout, saying why.
    let out = Command::new(bin("mem-server"))
        .args(["--listen", "127.0.0.1:0", "--memory", "16M", "--transport"])
        .arg(transport())
        .args(["--join", &format!("127.0.0.1:{}", free_port())])
        .args(["--join-timeout", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("tried for"), "{said}");
}

/// logrotate's way: the log files are moved away and both daemons get SIGHUP; each opens its
/// file again by name and goes on (SIGHUP killed both, the node with its pool).
#[test]
fn sighup_opens_log_files_again_and_kills_neither_daemon() {
    let scratch = Scratch::new("hup");
    let (node_log, client_log) = (scratch.0.join("node.log"), scratch.0.join("client.log"));
    let node = MemServer::start(&["--memory", "32M", "--log-file", node_log.to_str().unwrap()]);
    let dir = scratch.0.join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let _cleanup = Unmount(&dir);
    // Named relative to where it started: the daemon works from / and must still find it.
    let opts = format!("transport={},log_file=client.log", transport());
    let out = run(Command::new(bin("fs-client"))
        .arg(node.addr.to_string())
        .arg(&dir)
        .args(["--daemon", "-o", &opts])
        .current_dir(&scratch.0)
        .env("RUST_LOG", "info"));
    let client = mounted_pid(&out);
    std::fs::write(dir.join("before"), b"1").unwrap();
    for (log, pid) in [(&node_log, node.pid()), (&client_log, client)] {
        std::fs::rename(log, log.with_extension("log.1")).unwrap();
        run(Command::new("kill").args(["-HUP", &pid.to_string()]));
    }
    let start = Instant::now();
    while !(node_log.exists() && client_log.exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no new log files"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        Path::new(&format!("/proc/{}", node.pid())).exists(),
        "the node died"
    );
    assert!(
        Path::new(&format!("/proc/{client}")).exists(),
        "the client died"
    );
    std::fs::write(dir.join("after"), b"2").unwrap();
    assert_eq!(std::fs::read(dir.join("before")).unwrap(), b"1");
    umount_and_wait(&dir, client);
}

/// A pool the machine cannot back is refused at start (it was taken, and the node killed by
/// the kernel later, its files with it); a share of what is available is taken.
#[test]
fn a_pool_the_machine_cannot_back_is_refused_and_a_share_is_taken() {
    let out = Command::new(bin("mem-server"))
        .args(["--listen", "127.0.0.1:0", "--memory", "100T", "--insecure"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("more than this machine can back"), "{said}");
    let bad = Command::new(bin("mem-server"))
        .args(["--listen", "127.0.0.1:0", "--memory", "120%", "--insecure"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let _node = MemServer::start(&["--memory", "1%"]);
}

#[test]
fn a_node_logs_to_its_file_and_tells_systemd_when_it_is_ready() {
    let scratch = Scratch::new("notify");
    let socket = scratch.0.join("notify");
    let notify = UnixDatagram::bind(&socket).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let log = scratch.0.join("node.log");
    let mut node = Command::new(bin("mem-server"))
        .args(["--listen", "127.0.0.1:0", "--memory", "64M", "--transport"])
        .arg(transport())
        .arg("--log-file")
        .arg(&log)
        .env("NOTIFY_SOCKET", &socket)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(node.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    let mut got = [0u8; 64];
    let n = notify.recv(&mut got);
    let _ = node.kill();
    let _ = node.wait();
    assert!(banner.contains("listening"), "{banner}");
    assert_eq!(&got[..n.expect("a readiness notice")], b"READY=1");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("INFO"),
        "nothing logged to the file: {logged:?}"
    );

    // A log file that cannot be opened is refused before anything starts.
    let out = Command::new(bin("mem-server"))
        .args(["--listen", "127.0.0.1:0", "--memory", "16M", "--log-file"])
        .arg(scratch.0.join("no/such/dir/log"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("log file"));
}

use rfs_e2e::scrape;

#[test]
fn counters_as_json_and_for_prometheus_on_both_binaries() {
    let node_metrics = format!("127.0.0.1:{}", free_port());
    let node = MemServer::start(&["--memory", "64M", "--metrics", &node_metrics]);
    let client_metrics = format!("127.0.0.1:{}", free_port());
    let m = rfs_e2e::Mount::new(&node, &[&format!("metrics={client_metrics}")]);
    std::fs::write(m.path("f"), vec![7u8; 100_000]).unwrap();
    assert_eq!(std::fs::read(m.path("f")).unwrap().len(), 100_000);

    let json = run(Command::new(bin("fs-client"))
        .args(["stats", "--json"])
        .arg(&m.dir));
    let json = String::from_utf8(json.stdout).unwrap();
    assert!(json.starts_with("{\"transport\":\""), "{json}");
    assert!(json.contains("\"file_bytes_written\":100000,"), "{json}");

    let client = scrape(&client_metrics);
    assert!(client.contains("# TYPE rfs_client_file_bytes_written_total counter\n"));
    assert!(
        client.contains("\nrfs_client_file_bytes_written_total 100000\n"),
        "{client}"
    );
    assert!(client.contains("\nrfs_client_open_files 0\n"), "{client}");
    assert!(
        client.contains("\nrfs_client_work_requests_total "),
        "rdmabox's too"
    );

    let served = scrape(&node_metrics);
    assert!(
        served.contains("\nrfs_node_pool_bytes 67108864\n"),
        "{served}"
    );
    assert!(
        served.contains("\nrfs_node_space_bytes 67108864\n"),
        "{served}"
    );
    assert!(
        served.contains("\nrfs_node_data_nodes_alive 1\n"),
        "{served}"
    );
    let free: u64 = served
        .lines()
        .find_map(|l| l.strip_prefix("rfs_node_free_bytes "))
        .and_then(|v| v.parse().ok())
        .expect("free_bytes");
    assert!(free < 64 << 20, "the file took space: {free} free");
    for gauge in ["rfs_node_allocatable_bytes ", "rfs_node_inodes_max "] {
        assert!(served.contains(gauge), "{gauge} in {served}");
    }
    // What freeing costs: the file's chunks are zeroed before reuse, and counted.
    std::fs::remove_file(m.path("f")).unwrap();
    let start = Instant::now();
    let zeroed = loop {
        let zeroed: u64 = scrape(&node_metrics)
            .lines()
            .find_map(|l| l.strip_prefix("rfs_node_zeroed_bytes_total "))
            .and_then(|v| v.parse().ok())
            .expect("zeroed_bytes");
        if zeroed >= 100_000 || start.elapsed() > Duration::from_secs(30) {
            break zeroed;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Its pages, not a whole chunk.
    assert!(
        (100_000..=256 << 10).contains(&zeroed),
        "{zeroed} bytes zeroed after a 100 KB file went"
    );

    // An address already taken is refused before anything starts.
    let out = Command::new(bin("mem-server"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--memory",
            "16M",
            "--metrics",
            &node_metrics,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("metrics on"));
}

/// The pids of processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn a_background_mount_whose_starter_is_gone_gives_up_and_holds_nothing_of_it() {
    let scratch = Scratch::new("starter");
    let dir = scratch.0.join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let _cleanup = Unmount(&dir);
    let listen = format!("127.0.0.1:{}", free_port());
    let opts = format!("transport={},mount_timeout=30", transport());
    // The starter is killed (a `timeout mount ...`, a Ctrl-C) while its daemon waits for the
    // node: the daemon goes too, and nothing is mounted once the node is up.
    let mut starter = Command::new(bin("fs-client"))
        .arg(&listen)
        .arg(&dir)
        .args(["--daemon", "-o", &opts])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    starter.kill().unwrap();
    starter.wait().unwrap();
    let node = MemServer::start_on(&listen, &["--memory", "64M"]);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!is_mounted(&dir), "a mount nobody waits for");
    let daemon = format!("{listen}\0{}", dir.display());
    assert!(
        processes_with(&daemon).is_empty(),
        "the daemon outlived its starter"
    );

    // A daemon holds none of its starter's descriptors: a reader of the starter's output
    // (here through descriptor 3) sees it end when the starter exits, not at the unmount.
    let shell = format!(
        "exec 3>&1; {} {} {} --daemon -o {opts} >/dev/null 2>&1",
        bin("fs-client").display(),
        node.addr,
        dir.display()
    );
    let mut reader = Command::new("sh")
        .args(["-c", &shell])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = reader.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = std::io::Read::read_to_end(&mut pipe, &mut all);
        let _ = tx.send(());
    });
    assert!(reader.wait().unwrap().success());
    assert!(is_mounted(&dir));
    assert!(
        rx.recv_timeout(Duration::from_secs(5)).is_ok(),
        "the daemon held the starter's descriptor 3"
    );
    run(Command::new("umount").arg(&dir));
}

#[test]
fn a_signalled_client_with_files_open_serves_them_until_they_close() {
    let node = MemServer::meta("64M", "1M");
    let mut m = rfs_e2e::Mount::new(&node, &[]);
    let mut held = std::fs::File::create(m.path("held")).unwrap();
    std::io::Write::write_all(&mut held, b"before").unwrap();
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(m.pid(), libc::SIGTERM) };
    let start = Instant::now();
    while is_mounted(&m.dir) {
        assert!(start.elapsed() < Duration::from_secs(10), "not detached");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Detached from the tree, and the open file still works.
    std::io::Write::write_all(&mut held, b" and after").unwrap();
    held.sync_all().unwrap();
    assert!(
        m.wait_exit(Duration::from_millis(500)).is_none(),
        "it serves the open file"
    );
    drop(held);
    let status = m.wait_exit(Duration::from_secs(10));
    assert!(
        status.is_some_and(|s| s.success()),
        "the client ends once the file is closed: {status:?}"
    );
}
