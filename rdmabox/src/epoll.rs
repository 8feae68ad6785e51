//! An epoll set, for the threads that each watch many sockets (the tcp provider's responder
//! loops, a node's watcher of closing sessions): sockets are entered with a number of the
//! caller's, which comes back with their readiness.

use std::io;
use std::os::fd::AsFd;

use nix::errno::Errno;
use nix::sys::epoll::{self, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

/// One epoll instance.
pub struct Epoll(epoll::Epoll);

/// A readiness report: the number a socket was entered with, and its `EPOLL*` bits.
pub type Ready = (u64, u32);

fn event(id: u64, events: u32) -> EpollEvent {
    EpollEvent::new(EpollFlags::from_bits_retain(events as i32), id)
}

impl Epoll {
    /// A new, empty set.
    pub fn new() -> io::Result<Epoll> {
        Ok(Epoll(epoll::Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?))
    }

    /// Watches `fd` for `events` (`EPOLL*` bits), reported with `id`. The caller keeps `fd`
    /// open while it is in the set ([`Epoll::remove`] before closing it).
    pub fn add(&self, fd: impl AsFd, id: u64, events: u32) -> io::Result<()> {
        Ok(self.0.add(fd, event(id, events))?)
    }

    /// Changes what `fd` is watched for.
    pub fn modify(&self, fd: impl AsFd, id: u64, events: u32) -> io::Result<()> {
        Ok(self.0.modify(fd, &mut event(id, events))?)
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: impl AsFd) -> io::Result<()> {
        Ok(self.0.delete(fd)?)
    }

    /// Waits up to `timeout_ms` (-1: for ever) for readiness, and appends what is reported to
    /// `out` (at most 64 at a time). An interrupted wait reports nothing.
    pub fn wait(&self, timeout_ms: i32, out: &mut Vec<Ready>) -> io::Result<()> {
        let mut events = [EpollEvent::empty(); 64];
        let timeout = EpollTimeout::try_from(timeout_ms).unwrap_or(EpollTimeout::NONE);
        match self.0.wait(&mut events, timeout) {
            Ok(n) => {
                out.extend(
                    events[..n]
                        .iter()
                        .map(|e| (e.data(), e.events().bits() as u32)),
                );
                Ok(())
            }
            Err(Errno::EINTR) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
