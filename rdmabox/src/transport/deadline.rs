//! Reading from a socket against one deadline for a whole exchange, so that a peer dripping a
//! byte at a time cannot stretch a per-read timeout into forever.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Reads from `stream`, failing with `TimedOut` once `deadline` has passed; writes go straight
/// to the stream (the peer's receive window bounds them, and the kernel's timeouts).
pub struct DeadlineStream<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
    what: &'static str,
}

impl<'a> DeadlineStream<'a> {
    /// `what` names the exchange in the error.
    pub fn new(stream: &'a TcpStream, deadline: Instant, what: &'static str) -> Self {
        DeadlineStream {
            stream,
            deadline,
            what,
        }
    }

    fn timed_out(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("peer too slow: {} not done in time", self.what),
        )
    }
}

impl Write for DeadlineStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut s = self.stream;
        s.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for DeadlineStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.timed_out());
        }
        // A zero timeout means "none" to the socket: never ask for less than a millisecond.
        self.stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let mut s = self.stream;
        match s.read(buf) {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(self.timed_out())
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    #[test]
    fn a_dripping_peer_runs_out_of_time() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let drip = std::thread::spawn(move || {
            for _ in 0..20 {
                if c.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let start = Instant::now();
        let mut buf = [0u8; 20];
        let e = DeadlineStream::new(&s, start + Duration::from_millis(300), "test")
            .read_exact(&mut buf)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() < Duration::from_millis(600));
        drop(s);
        drip.join().unwrap();
    }
}
