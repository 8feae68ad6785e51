//! fs-client: mounts an rfs namespace.
//!
//!   fs-client HOST:PORT MOUNTPOINT [-o opt,...]   mount (foreground; --daemon to background)
//!   fs-client stats [--json] MOUNTPOINT           print the live statistics of a mount

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use nix::mount::{umount2, MntFlags};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::prctl::set_pdeathsig;
use nix::sys::signal::{SigSet, Signal};
use nix::unistd::{dup2_stderr, dup2_stdout};
use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use fs_client::fs::{stats_json, FsConfig, KernelInval, Rfs, STATS_NAME};
use fs_client::fuse::{KernelNames, RfsFuse};
use fs_client::kernel_mount::{self, MountRequest};
use fs_client::mount_helper::{self, HelperCall, HELPER_NAME};
use fs_client::mount_table;
use fs_client::options::{KernelFlag, MountConfig};
use fs_client::readahead;
use fuser::{INodeNo, MountOption, SessionACL};
use rfs_client::Client;
use rfs_daemon::logging::{self, LogTarget};
use rfs_daemon::patience::until_reachable;

/// Mount an rfs namespace: POSIX files whose data moves by one-sided RDMA to storage nodes.
/// Unmount with `fusermount3 -u MOUNTPOINT` (or SIGINT/SIGTERM). `fs-client stats MOUNTPOINT`
/// prints the live counters of a mount. Every option below is also an `-o` option. A lost
/// metadata connection is dialled again at once (SIGUSR1 severs it on purpose, as a partition
/// that lasts until the mount's next call, to test recovery).
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The metadata node, HOST:PORT.
    server: String,
    /// Where to mount.
    mountpoint: PathBuf,
    /// Mount options, comma separated (the flags below by their -o names, e.g.
    /// -o max_write=128K,qps=2,window=off).
    #[arg(short = 'o', value_name = "OPTIONS")]
    options: Vec<String>,
    /// Background once the mount is ready.
    #[arg(long)]
    daemon: bool,
}

/// The command line `argv` (after the program name): the arguments above and a flag per mount
/// option.
fn parse_args(argv: &[String]) -> (Args, Result<MountConfig, String>) {
    let matches = Args::command()
        .args(MountConfig::flags())
        .get_matches_from(std::iter::once("fs-client").chain(argv.iter().map(String::as_str)));
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let cfg = MountConfig::from_matches(&matches, &args.options);
    (args, cfg)
}

/// SIGINT and SIGTERM unmount; SIGUSR1 severs the metadata connection as a network partition
/// would, until the mount's next call: a fault to test recovery with; SIGHUP opens the log
/// file again (logrotate's way).
fn signals() -> SigSet {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGUSR1);
    set.add(Signal::SIGHUP);
    set
}

/// Blocks our signals in this thread and every thread it starts after, and takes them
/// synchronously on a thread of their own: they arrive on the returned channel.
fn take_signals() -> std::io::Result<Receiver<Signal>> {
    signals().thread_block()?;
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            match signals().wait() {
                Ok(sig) if tx.send(sig).is_ok() => {}
                Ok(_) => return,
                Err(e) => {
                    log::error!("waiting for signals: {e}");
                    return;
                }
            }
        })?;
    Ok(rx)
}

/// Waits up to `timeout` for one of our signals.
fn signalled(signals: &Receiver<Signal>, timeout: Duration) -> Option<Signal> {
    match signals.recv_timeout(timeout) {
        Ok(sig) => Some(sig),
        Err(RecvTimeoutError::Timeout) => None,
        Err(RecvTimeoutError::Disconnected) => {
            std::thread::sleep(timeout);
            None
        }
    }
}

/// `fs-client stats [--json] MOUNTPOINT`.
fn stats(mountpoint: &str, json: bool) -> ExitCode {
    match std::fs::read_to_string(PathBuf::from(mountpoint).join(STATS_NAME)) {
        Ok(s) if json => {
            println!("{}", stats_json(&s));
            ExitCode::SUCCESS
        }
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fs-client stats: {mountpoint}: {e} (is it an rfs mount?)");
            ExitCode::FAILURE
        }
    }
}

/// Starts the mount of `argv` in a child process and returns once it says it is ready. A
/// failure exits with `failed` (mount(8) wants 32 from its helpers).
fn daemonize(argv: &[String], failed: ExitCode) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let args: Vec<&String> = argv.iter().filter(|a| *a != "--daemon").collect();
    let mut child = match Command::new(std::env::current_exe().expect("own path"))
        .args(&args)
        .env(DAEMON_ENV, "1")
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fs-client: cannot start the daemon: {e}");
            return failed;
        }
    };
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
    if line.trim() == "ready" {
        println!("fs-client: mounted (pid {})", child.id());
        ExitCode::SUCCESS
    } else {
        let _ = child.wait();
        failed
    }
}

/// The daemon, before anything else: it holds none of its starter's descriptors (a reader of
/// one, say `(mount ... 3>&1) | cat`, would wait for the unmount), and it dies with its
/// starter until it has mounted (a `timeout mount ...` or a Ctrl-C must not leave it trying).
fn become_daemon_child() {
    // SAFETY: closes descriptors that nothing here owns yet (no thread or file exists so
    // far: no OwnedFd is invalidated); it touches no memory. Neither std nor nix has it.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if let Err(e) = set_pdeathsig(Signal::SIGKILL) {
        // Logging starts later; the starter's stderr is still ours.
        eprintln!("fs-client: cannot die with the starter: {e}");
    }
    if std::os::unix::process::parent_id() == 1 {
        std::process::exit(1); // the starter went before the request took effect
    }
}

/// About to mount: from here the daemon outlives its starter (dying now would leave a dead
/// mount); a starter that is gone hears no "ready", and the daemon unmounts.
fn outlive_starter() {
    if let Err(e) = set_pdeathsig(None) {
        log::warn!("cannot outlive the starter: {e}");
    }
}

/// Tells the starter the mount is ready: true if it heard.
fn tell_ready() -> bool {
    let mut out = std::io::stdout();
    writeln!(out, "ready").and_then(|()| out.flush()).is_ok()
}

/// Whether the mount on top of `mountpoint` is still the one we made (`ours`, its id then,
/// served through `connection`). Mount ids are reused once a mount is gone, so the id alone
/// could name a mount made since: ours exists as long as its FUSE connection does, and
/// holds its id meanwhile. Without a mount table to read, the connection decides.
fn still_ours(mountpoint: &Path, ours: Option<u64>, connection: &OwnedFd) -> bool {
    connection_alive(connection)
        && (ours.is_none() || mount_table::top_mount_id(mountpoint) == ours)
}

/// Whether the kernel still serves the FUSE connection `device` (it reports an error on it
/// once the mount is gone and the connection ended).
fn connection_alive(device: &OwnedFd) -> bool {
    let mut watch = [PollFd::new(device.as_fd(), PollFlags::empty())];
    match poll(&mut watch, PollTimeout::ZERO) {
        Ok(0) => true,
        Ok(_) => watch[0]
            .revents()
            .is_some_and(|r| !r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP)),
        Err(_) => false,
    }
}

/// The result of a session the kernel ended. fuser's session, dropped, unmounts its mount point
/// by path, and takes a connection the kernel has ended for one still mounted: it would
/// unmount whatever was mounted on the directory since (a remount right after `fusermount3 -u`,
/// a file system that ours was stacked on). So the finished session is never dropped; what it
/// holds goes with the process, moments later.
fn ended(mut session: fuser::BackgroundSession) -> std::io::Result<()> {
    let placeholder = std::thread::Builder::new().spawn(|| Ok(()));
    let Ok(placeholder) = placeholder else {
        std::mem::forget(session);
        return Ok(()); // no thread to swap in: the session's own result stays unread
    };
    let finished = std::mem::replace(&mut session.guard, placeholder);
    std::mem::forget(session);
    finished
        .join()
        .map_err(|_| std::io::Error::other("the FUSE session thread panicked"))?
}

/// Unmounts `mountpoint` on a signal: at once, or, with files still open there, detached from
/// the tree and served until the last closes (an abrupt exit would leave a dead mount, its
/// open files failing with ENOTCONN). False if the kernel would not (then fuser unmounts).
fn unmount_on_signal(mountpoint: &Path) -> bool {
    match umount2(mountpoint, MntFlags::empty()) {
        Ok(()) => return true,
        Err(nix::errno::Errno::EBUSY) => {}
        Err(_) => return false,
    }
    log::warn!(
        "files are open on {}: detached, and served until they close",
        mountpoint.display()
    );
    detach(mountpoint).is_ok()
}

/// Unmounts and waits for the session to end: a mount of fuser's (through fusermount3) by
/// fuser, one made here by detaching it.
fn unmount_and_join(
    session: fuser::BackgroundSession,
    mountpoint: &Path,
    own_mount: bool,
) -> std::io::Result<()> {
    if !own_mount {
        return session.umount_and_join();
    }
    detach(mountpoint)?;
    ended(session)
}

/// Detaches the mount on `mountpoint` (lazily: files open there stay usable); whether it went.
fn detach(mountpoint: &Path) -> std::io::Result<()> {
    Ok(umount2(mountpoint, MntFlags::MNT_DETACH)?)
}

const DAEMON_ENV: &str = "RFS_DAEMON_CHILD";

/// Lets go of the output the daemon inherited (a terminal, or pipes whose reader, say a
/// `$(mount ...)`, would wait for them to close): stdout and stderr go to the log file, or
/// nowhere, and a panic is logged (to the file or syslog) instead of printed.
fn detach_output(log_file: Option<&LogTarget>) {
    point_output_at(log_file);
    let print = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        log::error!("{info}");
        print(info);
    }));
}

/// Points stdout and stderr at the log file (again, after a SIGHUP: logrotate moved the old
/// one away), or at /dev/null when logging goes elsewhere.
fn point_output_at(log_file: Option<&LogTarget>) {
    let sink = match log_file {
        Some(LogTarget::File(path)) => std::fs::OpenOptions::new().append(true).open(path),
        _ => std::fs::OpenOptions::new().write(true).open("/dev/null"),
    };
    match sink {
        Ok(f) => {
            let _ = dup2_stdout(&f);
            let _ = dup2_stderr(&f);
        }
        Err(e) => log::warn!("keeping the output as it was: {e}"),
    }
}

/// Passes the metadata node's invalidations on to the kernel, from a thread of their own (the
/// kernel may wait for a lock that one of our operations holds).
fn invalidate_kernel_caches(fs: &Rfs, notifier: fuser::Notifier, names: KernelNames) {
    let (tx, rx) = crossbeam_channel::unbounded();
    fs.notify_kernel(tx);
    let spawned = std::thread::Builder::new()
        .name("kernel-inval".into())
        .spawn(move || {
            for inval in rx {
                // ENOENT: the kernel does not cache it (any more); nothing to drop.
                let r = match &inval {
                    KernelInval::Inode { ino, data } => {
                        notifier.inval_inode(INodeNo(*ino), if *data { 0 } else { -1 }, 0)
                    }
                    KernelInval::Entry { parent, name } => {
                        notifier.inval_entry(INodeNo(*parent), OsStr::from_bytes(name.as_bytes()))
                    }
                    KernelInval::Names => names.drop_all(),
                    KernelInval::Done(done) => {
                        let _ = done.send(());
                        continue;
                    }
                };
                if let Err(e) = r {
                    log::debug!("kernel invalidation {inval:?}: {e}");
                }
            }
        });
    if let Err(e) = spawned {
        log::warn!("no kernel invalidations: {e}");
    }
}

/// Where this process logs: as asked, else stderr in the foreground and syslog (when there
/// is one) for a daemon, whose stderr goes away with the shell that started it.
fn start_logging(asked: Option<&LogTarget>, daemon_child: bool) -> Result<(), String> {
    let init = |t: &LogTarget| logging::init("fs-client", "warn,fuser::mnt=error", t);
    match asked {
        Some(t) => init(t).map_err(|e| e.to_string()),
        None if daemon_child => init(&LogTarget::Syslog).or_else(|e| {
            eprintln!(
                "fs-client: {e}: once mounted, the daemon's log goes nowhere (-o log_file=PATH \
                 keeps it)"
            );
            init(&LogTarget::Stderr).map_err(|e| e.to_string())
        }),
        None => init(&LogTarget::Stderr).map_err(|e| e.to_string()),
    }
}

fn main() -> ExitCode {
    let mut argv: Vec<String> = std::env::args().collect();
    let program = argv.remove(0);
    let mut fake = false;
    let helper = Path::new(&program).file_name() == Some(OsStr::new(HELPER_NAME));
    if helper {
        argv = match mount_helper::client_args(&argv) {
            Ok(HelperCall::Mount(a)) => a,
            Ok(HelperCall::Fake(a)) => {
                fake = true;
                a
            }
            Err(e) => {
                eprintln!("{HELPER_NAME}: {e}");
                return ExitCode::from(2);
            }
        };
    }
    if argv.first().map(String::as_str) == Some("stats") {
        return match &argv[1..] {
            [h] if h == "--help" || h == "-h" => {
                println!(
                    "Prints the live counters of an rfs mount (from its .rfs-stats file): \
                     as text, or as JSON with --json.\n\nUsage: fs-client stats [--json] MOUNTPOINT"
                );
                ExitCode::SUCCESS
            }
            [m] if m != "--json" => stats(m, false),
            [json, m] | [m, json] if json == "--json" && m != "--json" => stats(m, true),
            _ => {
                eprintln!("usage: fs-client stats [--json] MOUNTPOINT");
                ExitCode::from(2)
            }
        };
    }
    let (args, cfg) = parse_args(&argv);
    let mut cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fs-client: {e}");
            return ExitCode::from(2);
        }
    };
    // The daemon works from / (it holds no directory busy): a log file is named from here.
    if let Some(LogTarget::File(path)) = &mut cfg.log_file {
        if let Ok(absolute) = std::path::absolute(&*path) {
            *path = absolute;
        }
    }
    if fake {
        return ExitCode::SUCCESS;
    }
    if args.daemon {
        let failed = if helper {
            ExitCode::from(32)
        } else {
            ExitCode::FAILURE
        };
        return daemonize(&argv, failed);
    }
    let daemon_child = std::env::var_os(DAEMON_ENV).is_some();
    if daemon_child {
        become_daemon_child();
    }
    let mountpoint = match std::fs::canonicalize(&args.mountpoint) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("fs-client: mount point {}: {e}", args.mountpoint.display());
            return ExitCode::FAILURE;
        }
    };
    if let Some(why) = kernel_mount::refuse(&mountpoint) {
        eprintln!(
            "fs-client: mount point {}: {why}",
            args.mountpoint.display()
        );
        return ExitCode::FAILURE;
    }
    if let Err(e) = start_logging(cfg.log_file.as_ref(), daemon_child) {
        eprintln!("fs-client: {e}");
        return ExitCode::from(2);
    }
    let secret = match rfs_daemon::secret::for_peer(cfg.secret_file.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fs-client: {e}");
            return ExitCode::from(2);
        }
    };
    // Before any other thread starts, so that every thread inherits the mask.
    let signals = match take_signals() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fs-client: taking signals: {e}");
            return ExitCode::FAILURE;
        }
    };

    let what = format!("reaching the metadata node {}", args.server);
    let client = match until_reachable(&what, cfg.mount_timeout, || {
        Client::connect(&args.server, cfg.client_config(secret.clone()))
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fs-client: cannot reach {}: {e}", args.server);
            return ExitCode::FAILURE;
        }
    };
    let fs_cfg = FsConfig {
        write_behind: cfg.write_behind,
        writeback_cache: cfg.writeback_cache,
        rpc_timeout: cfg.rpc.timeout,
        io_timeout: cfg.io_timeout,
        hard: cfg.hard,
    };
    let fs = match Rfs::new(client, fs_cfg) {
        Ok(f) => Arc::new(f),
        Err(e) => {
            eprintln!("fs-client: {}: {e}", args.server);
            return ExitCode::FAILURE;
        }
    };
    fs.attach();
    cfg.warn_if_spinning_outnumbers_cores();
    if cfg.writeback_cache {
        log::warn!(
            "writeback_cache is on: the kernel keeps file sizes itself, and this mount does not \
             see other mounts' writes past the size it knows"
        );
    }
    if cfg.io_timeout > fs.lease() / 2 {
        log::warn!(
            "io_timeout {:?} is over half the metadata node's {:?} lease: a transfer that \
             outlives a missed recall could reach a reused chunk; raise the node's --lease",
            cfg.io_timeout,
            fs.lease()
        );
    }
    if let Some(addr) = cfg.metrics {
        let stats = fs.clone();
        let served = rfs_daemon::metrics::serve(addr, move || {
            rfs_daemon::metrics::render("rfs_client", &stats.stats_metrics())
        });
        if let Err(e) = served {
            eprintln!("fs-client: {e}");
            return ExitCode::FAILURE;
        }
    }
    let request = MountRequest {
        source: &args.server,
        flags: &cfg.kernel_flags,
        allow_other: cfg.allow_other,
    };
    let mut fuse_cfg = fuser::Config::default();
    fuse_cfg.mount_options = vec![
        // The source as given, as NFS shows it: mount -a then knows an fstab line is mounted.
        MountOption::FSName(args.server.clone()),
        MountOption::Subtype("rfs".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
    ];
    fuse_cfg
        .mount_options
        .extend(cfg.kernel_flags.iter().map(|f| match f {
            KernelFlag::ReadOnly => MountOption::RO,
            KernelFlag::NoSuid => MountOption::NoSuid,
            KernelFlag::NoDev => MountOption::NoDev,
            KernelFlag::NoExec => MountOption::NoExec,
        }));
    if cfg.allow_other {
        fuse_cfg
            .mount_options
            .push(MountOption::CUSTOM("allow_other".into()));
        fuse_cfg.acl = SessionACL::All;
    }
    fuse_cfg.n_threads = Some(cfg.threads);
    fuse_cfg.clone_fd = true;
    if daemon_child {
        outlive_starter();
    }
    // Ours to unmount when mounted here; fuser's (fusermount3's) otherwise.
    let mut own_mount = false;
    let session = kernel_mount::mount(&mountpoint, &request)
        .and_then(|device| {
            let served = RfsFuse::new(fs.clone(), cfg.clone());
            match device {
                Some(device) => {
                    own_mount = true;
                    let acl = fuse_cfg.acl;
                    fuser::Session::from_fd(served, device, acl, fuse_cfg)
                }
                None => fuser::Session::new(served, &mountpoint, &fuse_cfg),
            }
        })
        .and_then(|session| {
            // Our own descriptor of the connection, for the notices fuser does not send.
            let device = session.as_fd().try_clone_to_owned()?;
            let connection = session.as_fd().try_clone_to_owned()?;
            Ok((session.spawn()?, device, connection))
        });
    let (session, device, connection) = match session {
        Ok(s) => s,
        Err(e) => {
            if own_mount {
                // Mounted, but nothing serves it: no dead mount may stay behind.
                let _ = detach(&mountpoint);
            }
            eprintln!(
                "fs-client: mounting on {}: {e} (does it exist? is fuse3 installed?)",
                args.mountpoint.display()
            );
            return ExitCode::FAILURE;
        }
    };
    let ours = mount_table::top_mount_id(&mountpoint);
    invalidate_kernel_caches(&fs, session.notifier(), KernelNames::new(device));
    let _ring = fs_client::ring::start_for_mount(&fs, &cfg.ring, &mountpoint, cfg.allow_other);
    if let Err(e) = readahead::set(&mountpoint, cfg.max_readahead) {
        // Unprivileged mounts cannot write sysfs: the kernel's 128 KiB stays.
        log::info!("kernel readahead left as it is: {e}");
    }
    if daemon_child {
        if !tell_ready() {
            // The starter gave up (a timeout, Ctrl-C) and reported a failure: no mount.
            let _ = unmount_and_join(session, &mountpoint, own_mount);
            return ExitCode::FAILURE;
        }
        detach_output(cfg.log_file.as_ref());
        // Hold no directory of the starter's busy.
        let _ = std::env::set_current_dir("/");
    } else {
        eprintln!(
            "fs-client: {} mounted on {}",
            args.server,
            args.mountpoint.display()
        );
    }
    let code = loop {
        let sig = signalled(&signals, Duration::from_millis(200));
        if sig == Some(Signal::SIGUSR1) {
            fs.backend().sever();
        } else if sig == Some(Signal::SIGHUP) {
            logging::reopen();
            if daemon_child {
                point_output_at(cfg.log_file.as_ref());
            }
        } else if sig.is_some() {
            if !still_ours(&mountpoint, ours, &connection) {
                // Unmounted (or detached) already: the session ends once the kernel lets go,
                // and what is mounted there now is not ours to unmount.
                log::info!(
                    "signal: {} no longer holds this mount",
                    mountpoint.display()
                );
                continue;
            }
            log::info!("signal: unmounting");
            if unmount_on_signal(&mountpoint) {
                continue; // the session ends once the kernel lets go
            }
            break match unmount_and_join(session, &mountpoint, own_mount) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fs-client: unmount: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        if session.guard.is_finished() {
            // Unmounted from outside (fusermount3 -u), or by us above.
            // Whether the kernel still lists our mount (the connection may be gone either way).
            let listed = ours.is_some() && mount_table::top_mount_id(&mountpoint) == ours;
            let mounted = still_ours(&mountpoint, ours, &connection);
            if mounted {
                // The session ended while still mounted (an error of the FUSE loop): a dead
                // mount would answer ENOTCONN to everyone until unmounted by hand.
                log::error!("the FUSE session ended while mounted: detaching the mount");
                let _ = detach(&mountpoint);
            }
            break match ended(session) {
                Ok(()) => ExitCode::SUCCESS,
                // The kernel may abort the connection as the last user of an unmounted (or
                // detached) mount lets go, rather than close it: an end all the same. Not
                // while the mount is still there (an abort through fusectl).
                Err(e) if !listed && e.raw_os_error() == Some(libc::ECONNABORTED) => {
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("fs-client: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    // Writes answered before they landed are not dropped with the process, nor commits that
    // a fault held back, nor closes.
    fs.writes_landed();
    fs.commits_owed_sent();
    fs.closes_sent();
    code
}
