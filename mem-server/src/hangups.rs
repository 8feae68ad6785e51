//! One thread that waits for the control connections of every data session to close, instead
//! of a thread per session: a data session needs nothing of the node once its queue pairs are
//! up (its peer reads and writes the pool one-sidedly, and a responder loop serves it), so a
//! thousand mounts cost the node no threads of their own. When a connection closes, fails or
//! says anything (the peer never writes on it after setup: a protocol error), its session's
//! end runs on this thread.

use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What ends a session: drops its queue pairs, takes its grants back, gives its slots back.
pub(crate) type End = Box<dyn FnOnce() + Send>;

pub(crate) struct Hangups {
    epoll: OwnedFd,
    watched: Mutex<HashMap<u64, (TcpStream, End)>>,
    next: AtomicU64,
}

impl Hangups {
    /// Starts the watching thread.
    pub(crate) fn start() -> io::Result<Arc<Hangups>> {
        // SAFETY: plain syscall; the descriptor is owned at once.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let me = Arc::new(Hangups {
            // SAFETY: a fresh descriptor nobody else owns.
            epoll: unsafe { OwnedFd::from_raw_fd(fd) },
            watched: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        });
        let run = me.clone();
        std::thread::Builder::new()
            .name("hangups".into())
            .spawn(move || run.run())?;
        Ok(me)
    }

    /// Runs `end` once `s` closes, fails or says anything. If it cannot be watched, `end`
    /// runs at once.
    pub(crate) fn watch(&self, s: TcpStream, end: End) {
        let fd = s.as_raw_fd();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.watched.lock().unwrap().insert(id, (s, end));
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            u64: id,
        };
        // SAFETY: an epoll_event on our stack; the socket stays open while it is watched.
        let added =
            unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if added != 0 {
            log::warn!(
                "cannot watch a data session's connection: {}; ending it",
                io::Error::last_os_error()
            );
            self.end(id);
        }
    }

    fn end(&self, id: u64) {
        let Some((s, end)) = self.watched.lock().unwrap().remove(&id) else {
            return;
        };
        // SAFETY: deregisters our own socket, still open (closed when `s` drops below).
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                s.as_raw_fd(),
                std::ptr::null_mut(),
            )
        };
        let _ = s.shutdown(std::net::Shutdown::Both);
        end();
    }

    fn run(&self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: the buffer holds `events.len()` entries for the kernel to fill.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    -1,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    log::error!("hangups: epoll_wait: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                continue;
            }
            for ev in &events[..n as usize] {
                self.end(ev.u64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A close, and a byte, each end their session; a silent open connection does not.
    #[test]
    fn a_close_or_a_word_ends_the_session_and_silence_does_not() {
        let hangups = Hangups::start().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (tx, rx) = mpsc::channel();
        let mut peers = Vec::new();
        for i in 0..3 {
            peers.push(TcpStream::connect(l.local_addr().unwrap()).unwrap());
            let (s, _) = l.accept().unwrap();
            let tx = tx.clone();
            hangups.watch(s, Box::new(move || tx.send(i).unwrap()));
        }
        drop(peers.remove(0));
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(0));
        peers[0].write_all(b"x").unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(1));
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "silence"
        );
        assert_eq!(hangups.watched.lock().unwrap().len(), 1);
    }
}
