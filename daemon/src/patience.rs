//! Patience at start-up: a client or data node started before the node it needs (at boot,
//! or while that node still prepares its pool) keeps trying for a bounded time, saying so once,
//! instead of failing at the first "connection refused".

use crate::backoff::Backoff;
use std::io;
use std::time::{Duration, Instant};

/// The first pause between tries; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// Whether `e` may go away by itself: nobody listens yet, the peer is busy starting (its
/// kernel queued the connection, it did not answer in time), or the network is not up yet.
/// Everything else (a refused secret, a bad address, a version mismatch) fails at once.
pub fn is_transient(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | NotConnected
            | TimedOut
            | WouldBlock
            | UnexpectedEof
            | HostUnreachable
            | NetworkUnreachable
            | AddrNotAvailable
    )
}

/// Runs `attempt` until it succeeds, fails for good, or `patience` has passed (a try under
/// way then ends in its own time); between tries it pauses (100 ms, doubling to 2 s). The first transient failure is logged as a warning
/// naming `what`; the error after the last try says how long it was tried.
pub fn until_reachable<T>(
    what: &str,
    patience: Duration,
    mut attempt: impl FnMut() -> io::Result<T>,
) -> io::Result<T> {
    let start = Instant::now();
    let deadline = start + patience;
    let mut backoff = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
    let mut waited = false;
    loop {
        match attempt() {
            Ok(v) => {
                if waited {
                    log::warn!(
                        "{what}: reached after {:.1} s",
                        start.elapsed().as_secs_f64()
                    );
                }
                return Ok(v);
            }
            Err(e) if is_transient(&e) && Instant::now() < deadline => {
                if !waited {
                    log::warn!(
                        "{what}: {e}; trying again for up to {} s",
                        patience.as_secs_f64()
                    );
                    waited = true;
                }
                // The last try is at the deadline.
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(backoff.next_pause().min(left));
            }
            Err(e) if waited => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("{e} (tried for {:.1} s)", start.elapsed().as_secs_f64()),
                ))
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_peer_that_starts_late_is_reached() {
        // A port nobody listens on yet: bind, note it, close, and listen there a bit later.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let l = TcpListener::bind(addr).unwrap();
            let _ = l.accept();
        });
        let mut tries = 0;
        let r = until_reachable("late peer", Duration::from_secs(10), || {
            tries += 1;
            TcpStream::connect(addr)
        });
        assert!(r.is_ok(), "{r:?}");
        assert!(tries > 1, "the first try must have been refused");
        late.join().unwrap();
    }

    #[test]
    fn patience_is_bounded_and_the_error_says_how_long() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let start = Instant::now();
        let e = until_reachable("nobody", Duration::from_millis(500), || {
            TcpStream::connect(addr)
        })
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        assert!(e.to_string().contains("tried for"), "{e}");
        assert!(
            start.elapsed() >= Duration::from_millis(500),
            "tried for all the patience given: {:?}",
            start.elapsed()
        );
        assert!(start.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn lasting_errors_fail_at_once() {
        let mut tries = 0;
        let e = until_reachable("wrong secret", Duration::from_secs(10), || {
            tries += 1;
            Err::<(), _>(io::Error::new(io::ErrorKind::PermissionDenied, "refused"))
        })
        .unwrap_err();
        assert_eq!(tries, 1);
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
    }
}
