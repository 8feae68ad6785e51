//! An epoll set as a safe type, for the threads that each watch many sockets (the tcp
//! provider's responder loops, a node's watcher of closing sessions): sockets are entered with
//! a number of the caller's, which comes back with their readiness.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// One epoll instance.
pub struct Epoll {
    fd: OwnedFd,
}

/// A readiness report: the number a socket was entered with, and its `EPOLL*` bits.
pub type Ready = (u64, u32);

impl Epoll {
    /// A new, empty set.
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; the descriptor is owned at once.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Epoll {
            // SAFETY: a fresh descriptor nobody else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Watches `fd` for `events` (`EPOLL*` bits), reported with `id`. The caller keeps `fd`
    /// open while it is in the set ([`Epoll::remove`] before closing it).
    pub fn add(&self, fd: RawFd, id: u64, events: u32) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, id, events)
    }

    /// Changes what `fd` is watched for.
    pub fn modify(&self, fd: RawFd, id: u64, events: u32) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, id, events)
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, id: u64, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: id };
        // SAFETY: an epoll_event on our stack for the call; the kernel only reads it.
        if unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout_ms` (-1: for ever) for readiness, and appends what is reported to
    /// `out` (at most 64 at a time). An interrupted wait reports nothing.
    pub fn wait(&self, timeout_ms: i32, out: &mut Vec<Ready>) -> io::Result<()> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: the array holds `events.len()` entries for the kernel to fill.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                timeout_ms,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(()),
                _ => Err(e),
            };
        }
        out.extend(events[..n as usize].iter().map(|e| (e.u64, e.events)));
        Ok(())
    }
}
