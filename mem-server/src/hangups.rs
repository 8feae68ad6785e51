//! One thread that waits for the control connections of every data session to close, instead
//! of a thread per session: a data session needs nothing of the node once its queue pairs are
//! up (its peer reads and writes the pool one-sidedly, and a responder loop serves it), so a
//! thousand mounts cost the node no threads of their own. When a connection closes, fails or
//! says anything (the peer never writes on it after setup: a protocol error), its session's
//! end runs on this thread.

use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rdmabox::epoll::Epoll;

/// What ends a session: drops its queue pairs, takes its grants back, gives its slots back.
pub(crate) type End = Box<dyn FnOnce() + Send>;

pub(crate) struct Hangups {
    epoll: Epoll,
    watched: Mutex<HashMap<u64, (TcpStream, End)>>,
    next: AtomicU64,
}

impl Hangups {
    /// Starts the watching thread.
    pub(crate) fn start() -> io::Result<Arc<Hangups>> {
        let me = Arc::new(Hangups {
            epoll: Epoll::new()?,
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
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
        // Entered while the entry is held: its first report finds it.
        let added = {
            let mut watched = self.watched.lock().unwrap();
            let (s, _) = watched.entry(id).or_insert((s, end));
            self.epoll.add(&*s, id, events)
        };
        if let Err(e) = added {
            log::warn!("cannot watch a data session's connection: {e}; ending it");
            self.end(id);
        }
    }

    fn end(&self, id: u64) {
        let Some((s, end)) = self.watched.lock().unwrap().remove(&id) else {
            return;
        };
        // Out of the set while still open (it closes when `s` drops below).
        let _ = self.epoll.remove(&s);
        let _ = s.shutdown(std::net::Shutdown::Both);
        end();
    }

    fn run(&self) {
        let mut ready = Vec::new();
        loop {
            if let Err(e) = self.epoll.wait(-1, &mut ready) {
                log::error!("hangups: epoll_wait: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            for (id, _) in ready.drain(..) {
                self.end(id);
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
