//! Starting a child process that never holds a copy of this process's files on mounts, not
//! even while it execs.
//!
//! A child made by fork (or posix_spawn) starts with a copy of every descriptor of the test
//! process, and its execve closes them. Each close of a file open on a FUSE mount sends that
//! mount a flush, which commits, and a commit waits for the mount's metadata node: a mount
//! stopped by a test, or whose metadata node a test kills again and again, held a child of
//! another test inside its execve for as long (tens of seconds: a mount that "did not
//! appear"). `Command::spawn` returns before those closes, so the wait went unseen, and a test
//! that asked for no process to start ([`crate::no_children_started`]) could still see a
//! flush of one started just before.
//!
//! Here the child shares the descriptor table for a moment (`CLONE_FILES`), and trades it
//! for one of its own as it closes every descriptor from 3 up (`close_range` with
//! `CLOSE_RANGE_UNSHARE`). Linux copies only the first 64 slots for that (the table's first
//! word, below the range), and closes them in the copy; the files beyond are never copied,
//! so never closed. So this process keeps those 64 slots taken ([`hold_low_slots`]): its files,
//! on mounts or not, get descriptors from 64 up, which a child never closes. (A kernel that
//! copied more would cost time again, never correctness.) The child's standard streams are
//! then opened by name: /dev/null, a file, or our end of a pipe through /proc. `CLONE_VFORK`
//! holds the calling thread until the child has exec'd (or exited), so our pipe ends outlive
//! its opens.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::Duration;

/// Where a standard stream of a child goes.
pub enum Io {
    /// /dev/null.
    Null,
    /// A pipe to or from this process ([`Process::stdin`], [`Process::stdout`],
    /// [`Process::stderr`]).
    Piped,
    /// A file, appended to.
    Append(PathBuf),
}

/// A child process started by [`spawn`].
pub struct Process {
    pid: libc::pid_t,
    status: Option<ExitStatus>,
    pub stdin: Option<File>,
    pub stdout: Option<File>,
    pub stderr: Option<File>,
}

impl Process {
    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// SIGKILL, unless it was reaped already (its pid may be another process's now).
    pub fn kill(&mut self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        // SAFETY: a signal to our own child, not yet reaped.
        match unsafe { libc::kill(self.pid, libc::SIGKILL) } {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// Waits for it to exit.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(s) = self.reap(0)? {
                return Ok(s);
            }
        }
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.reap(libc::WNOHANG)
    }

    fn reap(&mut self, flags: libc::c_int) -> io::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut raw = 0;
        // SAFETY: waits for our own child; `raw` is a valid place for its status.
        match unsafe { libc::waitpid(self.pid, &mut raw, flags) } {
            0 => Ok(None),
            pid if pid == self.pid => {
                self.status = Some(ExitStatus::from_raw(raw));
                Ok(self.status)
            }
            _ => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::Interrupted => Ok(None),
                e => Err(e),
            },
        }
    }

    /// Waits for it to exit, reading what it writes to the pipes meanwhile.
    pub fn wait_with_output(mut self) -> io::Result<Output> {
        drop(self.stdin.take());
        let err = self.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut b = Vec::new();
                io::Read::read_to_end(&mut e, &mut b).map(|_| b)
            })
        });
        let mut stdout = Vec::new();
        if let Some(mut o) = self.stdout.take() {
            io::Read::read_to_end(&mut o, &mut stdout)?;
        }
        let stderr = match err {
            Some(t) => t
                .join()
                .map_err(|_| io::Error::other("stderr reader panicked"))??,
            None => Vec::new(),
        };
        Ok(Output {
            status: self.wait()?,
            stdout,
            stderr,
        })
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL"))
}

/// The file `program` names: itself if it has a slash, else the first executable of that
/// name on `path`.
fn resolve(program: &OsStr, path: Option<&OsStr>) -> io::Result<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return Ok(PathBuf::from(program));
    }
    let path = path.unwrap_or(OsStr::new("/usr/local/bin:/usr/bin:/bin"));
    std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} not found on PATH", program.to_string_lossy()),
            )
        })
}

/// The slots a child's `close_range(3, .., CLOSE_RANGE_UNSHARE)` copies (and then closes):
/// the first word of the descriptor table.
const COPIED_SLOTS: libc::c_int = 64;

/// Takes every free descriptor below [`COPIED_SLOTS`] with /dev/null (close-on-exec), for good:
/// no file this process opens later lands there (unless something closes one of the
/// descriptors it had there before: taken again at the next spawn).
fn hold_low_slots() {
    let null = c"/dev/null";
    loop {
        // SAFETY: a valid path; the descriptor is ours.
        let fd = unsafe { libc::open(null.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd >= COPIED_SLOTS {
            // SAFETY: the descriptor just opened, ours alone.
            unsafe { libc::close(fd) };
        }
        if !(0..COPIED_SLOTS).contains(&fd) {
            return;
        }
    }
}

/// A pipe, both ends close-on-exec: (read, write).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both were just made, and are ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Starts `cmd`'s program with its arguments, environment and directory (its own stdio,
/// uid and gid settings are not readable, and not applied: `stdin`, `stdout` and `stderr` say
/// where those go), holding no
/// descriptor of ours. Needs Linux 5.9 (close_range); the child exits with 126 on an older
/// kernel, and with 127 if the exec fails (saying why on its stderr).
pub fn spawn(cmd: &Command, stdin: Io, stdout: Io, stderr: Io) -> io::Result<Process> {
    let mut env: BTreeMap<OsString, OsString> = std::env::vars_os().collect();
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => env.insert(k.to_owned(), v.to_owned()),
            None => env.remove(k),
        };
    }
    let program = resolve(
        cmd.get_program(),
        env.get(OsStr::new("PATH")).map(|p| p.as_os_str()),
    )?;
    let program = cstring(program.as_os_str())?;
    let argv: Vec<CString> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(cstring)
        .collect::<io::Result<_>>()?;
    let envp: Vec<CString> = env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.clone();
            kv.push("=");
            kv.push(v);
            cstring(&kv)
        })
        .collect::<io::Result<_>>()?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let dir = cmd
        .get_current_dir()
        .map(|d| cstring(d.as_os_str()))
        .transpose()?;

    hold_low_slots();
    // What the child opens as 0, 1 and 2, and what we keep of the pipes.
    let me = std::process::id();
    let mut opens: Vec<(CString, libc::c_int)> = Vec::new();
    let mut ours: [Option<File>; 3] = [None, None, None];
    let mut theirs: Vec<OwnedFd> = Vec::new();
    for (n, io) in [stdin, stdout, stderr].into_iter().enumerate() {
        let writes = n > 0;
        let access = if writes {
            libc::O_WRONLY
        } else {
            libc::O_RDONLY
        };
        let open = match io {
            Io::Null => (cstring(OsStr::new("/dev/null"))?, access),
            Io::Append(path) => (cstring(path.as_os_str())?, access | libc::O_APPEND),
            Io::Piped => {
                let (r, w) = pipe()?;
                let (mine, child) = if writes { (r, w) } else { (w, r) };
                let path = format!("/proc/{me}/fd/{}", child.as_raw_fd());
                theirs.push(child);
                ours[n] = Some(File::from(mine));
                (cstring(OsStr::new(&path))?, access)
            }
        };
        opens.push(open);
    }
    // SAFETY: a zeroed sigset_t, emptied, is a valid empty set.
    let empty: libc::sigset_t = unsafe {
        let mut s = std::mem::zeroed();
        libc::sigemptyset(&mut s);
        s
    };

    // SAFETY: like fork (no CLONE_VM: the child has a copy of our memory and runs on its copy
    // of this stack), sharing the descriptor table until its first call unshares it. The child
    // calls only async-signal-safe functions on what was prepared above, then execs or exits;
    // CLONE_VFORK holds this thread until then.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_VFORK | libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid == 0 {
        // SAFETY: the child (see above).
        unsafe {
            child(
                &opens,
                dir.as_ref(),
                &empty,
                &program,
                &argv_ptrs,
                &envp_ptrs,
            )
        }
    }
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    drop(theirs);
    let [stdin, stdout, stderr] = ours;
    Ok(Process {
        pid: pid as libc::pid_t,
        status: None,
        stdin,
        stdout,
        stderr,
    })
}

/// The child's side of [`spawn`]: never returns.
///
/// # Safety
/// Only in the child of `spawn`'s clone.
unsafe fn child(
    opens: &[(CString, libc::c_int)],
    dir: Option<&CString>,
    empty: &libc::sigset_t,
    program: &CString,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> ! {
    // SAFETY: see the function's own.
    unsafe {
        let fail = |what: &[u8], code| -> ! {
            libc::write(2, what.as_ptr().cast(), what.len());
            libc::_exit(code)
        };
        // A table of our own, with only the test process's standard streams: the shared one
        // (its files) is left as it is. Until this succeeds, every descriptor is the parent's
        // too: touch none.
        if libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_UNSHARE,
        ) != 0
        {
            // Its stderr is the test process's: say why there.
            fail(
                b"rfs-e2e: close_range(CLOSE_RANGE_UNSHARE) failed: Linux 5.9 or later needed\n",
                126,
            );
        }
        for (n, (path, flags)) in opens.iter().enumerate() {
            let fd = libc::open(path.as_ptr(), *flags);
            if fd < 0 || libc::dup2(fd, n as libc::c_int) < 0 {
                fail(b"rfs-e2e: opening a standard stream failed\n", 127);
            }
            libc::close(fd);
        }
        if let Some(d) = dir {
            if libc::chdir(d.as_ptr()) != 0 {
                fail(b"rfs-e2e: chdir failed\n", 127);
            }
        }
        libc::sigprocmask(libc::SIG_SETMASK, empty, std::ptr::null_mut());
        // Rust ignores SIGPIPE; a program it starts gets the default back.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
        fail(b"rfs-e2e: execve failed\n", 127)
    }
}

/// Runs `cmd` to its end, its output captured (stdin /dev/null), as [`Command::output`] does.
pub fn output(cmd: &Command) -> io::Result<Output> {
    spawn(cmd, Io::Null, Io::Piped, Io::Piped)?.wait_with_output()
}

/// What process `pid`, started to run `program`, is doing, in words, for a test that waited on
/// it in vain: each thread's state and where in the kernel it waits (its wait channel, or the
/// frames of its kernel stack, readable by root), or, if it has not finished its execve yet,
/// the files this test process holds open on mounts.
pub fn what_it_does(pid: u32, program: &str) -> String {
    let proc_file = |path: String| -> String {
        // Most of /proc/PID waits while the process is inside execve: never wait long here.
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::Builder::new().spawn({
            let path = path.clone();
            move || {
                let _ = tx.send(std::fs::read_to_string(&path));
            }
        });
        match reader.map(|_| rx.recv_timeout(Duration::from_secs(1))) {
            Ok(Ok(Ok(text))) => text.trim_end().to_string(),
            Ok(Ok(Err(e))) => format!("({path}: {e})"),
            _ => format!("({path}: no answer)"),
        }
    };
    let status = proc_file(format!("/proc/{pid}/status"));
    let field = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or("?")
            .to_string()
    };
    let name = field(&status, "Name");
    let comm: String = Path::new(program)
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(15).collect())
        .unwrap_or_default();
    let mut out = format!("pid {pid} ({name}, {})", field(&status, "State"));
    if name != comm {
        // Only status and comm answer meanwhile.
        out += &format!(
            " has not finished its execve of {program}. It closes the descriptors it \
             inherited then, and the close of a file open on a mount waits for a flush there \
             (see rfs_e2e::spawn). Open on mounts in this test process now: {:?}",
            files_open_on_mounts()
        );
        return out;
    }
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for t in tasks {
        let task = t.display();
        let stat = proc_file(format!("{task}/status"));
        // The kernel frames under the system call (root only): where it waits, and why.
        let stack = proc_file(format!("{task}/stack"));
        let frames: Vec<&str> = stack
            .lines()
            .map(|l| l.trim_start_matches("[<0>] "))
            .map(|l| l.split('+').next().unwrap_or(l))
            .take_while(|f| !f.starts_with("do_syscall") && !f.starts_with("__x64_sys"))
            .collect();
        out += &format!(
            "\n  thread {} {} ({}): {}",
            t.file_name().unwrap_or_default().to_string_lossy(),
            field(&stat, "Name"),
            field(&stat, "State"),
            if frames.is_empty() {
                proc_file(format!("{task}/wchan"))
            } else {
                frames.join(" < ")
            }
        );
    }
    out
}

/// The files this process holds open on FUSE mounts.
fn files_open_on_mounts() -> Vec<PathBuf> {
    let mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, kind) = (f.next()?, f.next()?, f.next()?);
            kind.starts_with("fuse").then(|| PathBuf::from(dir))
        })
        .collect();
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|p| mounts.iter().any(|m| p.starts_with(m)))
                .collect()
        })
        .unwrap_or_default()
}
