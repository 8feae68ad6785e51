//! The ring service beside the mount: applications on this host (through `rfs-io`) share a
//! buffer and a pair of rings with fs-client over a Unix socket, register files they opened
//! through the mount, and read and write them without a FUSE request per I/O.
//!
//! The socket is reached through the mount's `.rfs-ring` link. Who connects is known by
//! SO_PEERCRED: without `allow_other` only the mounting user may (as the kernel lets only
//! them use the mount), and every registration opens the file again as the connecting
//! process, so the metadata node checks its permissions. What the application shares is
//! checked before use ([`rfs_io::shm`]) and never trusted after: a hostile or dying
//! application can hurt only its own requests.

mod guard;
mod session;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    accept4, bind, getsockopt, listen, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    UnixAddr,
};
use rfs_io::wire::{self, Reply};
use rfs_proto::types::Caller;

use crate::fs::{Backend, Rfs};
use crate::options::RingPlace;

/// The most rings served at once, and per user (root aside).
const MAX_RINGS: usize = 256;
const MAX_RINGS_PER_USER: usize = 32;
/// The most bytes of requests in flight over every ring of the mount.
const MAX_BYTES_IN_FLIGHT: u64 = 1 << 30;
/// The most files registered over every ring of the mount.
const MAX_REGISTRATIONS: usize = 1 << 18;
/// How often the accepting thread looks whether the service is stopping.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// How long a refused connection stays open after its refusal, and how many may: its
/// application reads the refusal rather than a reset (its hello unread at close).
const LINGER: Duration = Duration::from_secs(1);
const MAX_LINGERING: usize = 64;

/// What the rings of a mount share: bounds over all of them, so that many rings cannot take
/// what one may not.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) bytes_in_flight: AtomicU64,
    registrations: AtomicUsize,
    /// Rings served, by user.
    rings: Mutex<HashMap<u32, usize>>,
}

impl Shared {
    /// Whether the mount's rings have room for more in flight, besides `taking` bytes.
    pub(crate) fn has_room_in_flight(&self, taking: u64) -> bool {
        self.bytes_in_flight.load(Ordering::Acquire) + taking < MAX_BYTES_IN_FLIGHT
    }

    /// Takes one registration of the mount's, if there is one left.
    pub(crate) fn take_registration(&self) -> bool {
        let taken = self.registrations.fetch_add(1, Ordering::AcqRel);
        if taken >= MAX_REGISTRATIONS {
            self.registrations.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    pub(crate) fn give_registration(&self) {
        self.registrations.fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes a ring for user `uid`: false past the mount's bound or the user's.
    fn take_ring(&self, uid: u32) -> bool {
        let mut rings = self.rings.lock().unwrap();
        let all: usize = rings.values().sum();
        let theirs = rings.entry(uid).or_default();
        if all >= MAX_RINGS || (uid != 0 && *theirs >= MAX_RINGS_PER_USER) {
            return false;
        }
        *theirs += 1;
        true
    }

    fn give_ring(&self, uid: u32) {
        let mut rings = self.rings.lock().unwrap();
        if let Some(n) = rings.get_mut(&uid) {
            *n -= 1;
            if *n == 0 {
                rings.remove(&uid);
            }
        }
    }
}

/// Who may use the rings: the mounting user, or anyone with `allow_other`.
#[derive(Clone, Copy, Debug)]
pub struct RingAccess {
    pub owner: u32,
    pub allow_other: bool,
}

impl RingAccess {
    fn admits(&self, uid: u32) -> bool {
        self.allow_other || uid == self.owner
    }
}

/// The service: its socket, and the thread accepting on it; stopped (the socket removed) when
/// dropped. Rings being served end when their applications hang up.
pub struct RingService {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accepting: Option<std::thread::JoinHandle<()>>,
}

impl RingService {
    /// Serves rings of `fs`, mounted with device number `mount_dev`, on a socket at `path`.
    pub fn start<B: Backend>(
        fs: Arc<Rfs<B>>,
        path: &Path,
        mount_dev: u64,
        access: RingAccess,
    ) -> io::Result<RingService> {
        if let Some(dir) = path.parent() {
            if !dir.exists() {
                std::fs::create_dir_all(dir)?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
            }
            // Not a directory someone else may swap the socket in: applications would hand an
            // impostor their memory and files. Ours or root's, written by no one else (or
            // sticky, as /tmp: nobody else may then remove or rename our socket).
            let meta = std::fs::symlink_metadata(dir)?;
            let owner = meta.uid();
            let trusted = owner == 0 || owner == nix::unistd::geteuid().as_raw();
            let sticky = meta.mode() & 0o1000 != 0;
            if !meta.is_dir() || !trusted || (meta.mode() & 0o022 != 0 && !sticky) {
                return Err(io::Error::other(format!(
                    "{} must be a directory of ours (or root's) that nobody else may change",
                    dir.display()
                )));
            }
        }
        // A socket left by a process that is gone; not one that is served, nor anything else.
        match std::fs::symlink_metadata(path) {
            Ok(m) if !m.file_type().is_socket() => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} is there and is not a socket", path.display()),
                ))
            }
            Ok(_) if UnixAddr::new(path).is_ok_and(|a| seqpacket_answers(&a)) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by another process", path.display()),
                ))
            }
            Ok(_) => std::fs::remove_file(path)?,
            Err(_) => {}
        }
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        bind(listener.as_raw_fd(), &UnixAddr::new(path)?)?;
        // The kernel checks who may connect first; SO_PEERCRED checks again.
        let mode = if access.allow_other { 0o666 } else { 0o600 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        listen(&listener, Backlog::new(64).map_err(io::Error::from)?)?;
        let stop = Arc::new(AtomicBool::new(false));
        let served = Served {
            fs,
            mount_dev,
            access,
            shared: Arc::new(Shared::default()),
        };
        let accepting = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("ring-accept".into())
                .spawn(move || served.accept_until(&listener, &stop))?
        };
        log::info!("ring service on {}", path.display());
        Ok(RingService {
            path: path.to_path_buf(),
            stop,
            accepting: Some(accepting),
        })
    }
}

impl Drop for RingService {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.accepting.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What the accepting thread hands each ring.
struct Served<B: Backend> {
    fs: Arc<Rfs<B>>,
    mount_dev: u64,
    access: RingAccess,
    shared: Arc<Shared>,
}

impl<B: Backend> Served<B> {
    fn accept_until(&self, listener: &OwnedFd, stop: &AtomicBool) {
        let mut lingering: Vec<(OwnedFd, std::time::Instant)> = Vec::new();
        while !stop.load(Ordering::Acquire) {
            lingering.retain(|(conn, since)| {
                drain(conn);
                since.elapsed() < LINGER
            });
            let mut fds = [PollFd::new(
                std::os::fd::AsFd::as_fd(listener),
                PollFlags::POLLIN,
            )];
            let timeout = PollTimeout::try_from(STOP_CHECK).unwrap_or(PollTimeout::NONE);
            if !matches!(poll(&mut fds, timeout), Ok(n) if n > 0) {
                continue;
            }
            let conn = match accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                // SAFETY: accept4 just made this descriptor for us alone.
                Ok(fd) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) },
                Err(e) => {
                    log::warn!("ring service: accepting: {e}");
                    continue;
                }
            };
            if let Err(e) = self.admit(conn, &mut lingering) {
                log::warn!("ring service: {e}");
            }
        }
    }

    /// Checks who connected, and serves their ring on a thread of its own.
    fn admit(
        &self,
        conn: OwnedFd,
        lingering: &mut Vec<(OwnedFd, std::time::Instant)>,
    ) -> io::Result<()> {
        let cred = getsockopt(&conn, sockopt::PeerCredentials)?;
        let (pid, uid, gid) = (cred.pid() as u32, cred.uid(), cred.gid());
        let mut refuse = |errno: i32| {
            drain(&conn);
            let _ = wire::send(&conn, &refusal(errno), &[]);
            let _ = nix::sys::socket::shutdown(conn.as_raw_fd(), nix::sys::socket::Shutdown::Write);
            if lingering.len() < MAX_LINGERING {
                if let Ok(c) = conn.try_clone() {
                    lingering.push((c, std::time::Instant::now()));
                }
            }
        };
        if !self.access.admits(uid) {
            refuse(libc::EACCES);
            return Err(io::Error::other(format!(
                "process {pid} (uid {uid}) refused: the mount is not allow_other"
            )));
        }
        if !self.shared.take_ring(uid) {
            refuse(libc::EMFILE);
            return Err(io::Error::other(format!(
                "process {pid} (uid {uid}) refused: {MAX_RINGS} rings served, or \
                 {MAX_RINGS_PER_USER} of theirs"
            )));
        }
        let caller = match peer_groups(&conn) {
            Ok(groups) => Caller { uid, gid, groups },
            Err(e) => {
                refuse(libc::EACCES);
                return Err(io::Error::other(format!(
                    "process {pid} (uid {uid}) refused: its groups: {e}"
                )));
            }
        };
        let (fs, dev, shared) = (self.fs.clone(), self.mount_dev, self.shared.clone());
        let spawned = std::thread::Builder::new()
            .name("ring".into())
            .spawn(move || {
                // It serves until the application hangs up (or breaks the ring).
                if let Err(why) = session::serve(fs, shared.clone(), conn, caller, dev) {
                    match why.kind() {
                        io::ErrorKind::UnexpectedEof => log::debug!("ring of process {pid}: ended"),
                        _ => log::info!("ring of process {pid}: {why}"),
                    }
                }
                shared.give_ring(uid);
            });
        if let Err(e) = spawned {
            self.shared.give_ring(uid);
            return Err(e);
        }
        Ok(())
    }
}

/// The connecting process's supplementary groups as the kernel recorded them when it
/// connected (SO_PEERGROUPS), not read later from /proc, where a process that changed them
/// since, or a new one with the same pid, would answer.
fn peer_groups(conn: &OwnedFd) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let room = std::mem::size_of_val(groups.as_slice());
        let mut len = room as libc::socklen_t;
        // SAFETY: `groups` has `len` bytes of room for the kernel to write gids into.
        let r = unsafe {
            libc::getsockopt(
                conn.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let e = io::Error::last_os_error();
        match r {
            0 => {
                groups.truncate(len as usize / size_of::<libc::gid_t>());
                return Ok(groups);
            }
            _ if e.raw_os_error() == Some(libc::ERANGE) && len as usize > room => {
                groups.resize(len as usize / size_of::<libc::gid_t>(), 0);
            }
            _ => return Err(e),
        }
    }
}

/// Whether a process accepts on the SOCK_SEQPACKET socket at `addr`.
fn seqpacket_answers(addr: &UnixAddr) -> bool {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .is_ok_and(|s| {
        // A full backlog (EAGAIN) is a server all the same.
        matches!(
            nix::sys::socket::connect(s.as_raw_fd(), addr),
            Ok(()) | Err(nix::errno::Errno::EAGAIN)
        )
    })
}

/// Reads and drops whatever a connection sent (its descriptors closed with it), without
/// waiting: closed with unread messages, it would reset its peer.
/// At most so many messages at a time: a peer that keeps sending cannot hold the accepting
/// thread (what is left when it closes resets it, which is its own doing).
fn drain(conn: &OwnedFd) {
    let mut sink = [0u8; 64];
    for _ in 0..64 {
        let got = nix::sys::socket::recv(
            conn.as_raw_fd(),
            &mut sink,
            nix::sys::socket::MsgFlags::MSG_DONTWAIT,
        );
        if !matches!(got, Ok(n) if n > 0) {
            return;
        }
    }
}

fn refusal(errno: i32) -> Vec<u8> {
    Reply::Refused { errno }.encode()
}

/// Starts the ring service of `fs`, mounted at `mountpoint`, where `place` says; a failure is
/// logged (the mount serves without a ring).
pub fn start_for_mount<B: Backend>(
    fs: &Arc<Rfs<B>>,
    place: &RingPlace,
    mountpoint: &Path,
    allow_other: bool,
) -> Option<RingService> {
    let path = match place {
        RingPlace::Off => return None,
        RingPlace::Default => default_socket(),
        RingPlace::At(p) => p.clone(),
    };
    let access = RingAccess {
        owner: nix::unistd::geteuid().as_raw(),
        allow_other,
    };
    let started = std::fs::metadata(mountpoint).and_then(|m| {
        let dev = std::os::unix::fs::MetadataExt::dev(&m);
        RingService::start(fs.clone(), &path, dev, access)
    });
    match started {
        Ok(service) => {
            fs.ring_started(path);
            Some(service)
        }
        Err(e) => {
            log::warn!("no ring service at {}: {e}", path.display());
            None
        }
    }
}

/// Where a mount's ring socket goes by default: under /run/rfs as root, else under the user's
/// runtime directory (or the temporary one); named for this process.
pub fn default_socket() -> PathBuf {
    let name = format!("ring-{}.sock", std::process::id());
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/run/rfs").join(name);
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("rfs").join(name),
        None => std::env::temp_dir()
            .join(format!("rfs-{}", nix::unistd::geteuid()))
            .join(name),
    }
}
