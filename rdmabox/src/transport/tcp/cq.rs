//! The tcp provider's completion queue: a locked queue plus an eventfd that fires once per arm,
//! like a completion channel.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use crate::transport::types::Completion;

/// A tcp completion queue, filled by the engines and polled by the application.
pub struct Cq {
    state: Mutex<CqState>,
    eventfd: OwnedFd,
}

struct CqState {
    queue: VecDeque<Completion>,
    armed: bool,
}

impl Cq {
    /// An empty, unarmed queue with room reserved for `capacity` completions.
    pub fn new(capacity: usize) -> io::Result<Cq> {
        // SAFETY: plain syscall; the fd is owned right below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Cq {
            state: Mutex::new(CqState {
                queue: VecDeque::with_capacity(capacity),
                armed: false,
            }),
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Adds one completion; fires the event if the queue was armed.
    pub fn push(&self, c: Completion) {
        self.push_all(std::iter::once(c));
    }

    /// Adds completions; fires the event if the queue was armed.
    pub fn push_all(&self, cs: impl IntoIterator<Item = Completion>) {
        let mut st = self.state.lock().unwrap();
        let before = st.queue.len();
        st.queue.extend(cs);
        if st.queue.len() > before && st.armed {
            st.armed = false;
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to our own eventfd. It cannot fail for want of
            // room: the counter is drained by every wait.
            unsafe { libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Moves up to `out.len()` completions into `out`, oldest first; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> usize {
        let mut st = self.state.lock().unwrap();
        let n = out.len().min(st.queue.len());
        for (slot, c) in out.iter_mut().zip(st.queue.drain(..n)) {
            *slot = c;
        }
        n
    }

    /// Asks for one event on the next completion (completions already queued do not fire it).
    pub fn arm(&self) {
        self.state.lock().unwrap().armed = true;
    }

    /// The eventfd that turns readable when an armed event fires.
    pub fn event_fd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Sleeps until an armed event fires (true, consumed) or `timeout` passes (false).
    pub fn wait_event(&self, timeout: Option<Duration>) -> io::Result<bool> {
        if !super::super::poll_readable(self.event_fd(), timeout)? {
            return Ok(false);
        }
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a local from our own non-blocking eventfd.
        let n = unsafe { libc::read(self.eventfd.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        Ok(n == 8)
    }
}
