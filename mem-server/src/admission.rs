//! Who gets a connection slot: limits on control connections in total and per peer address,
//! so that no peer, authenticated or not, can take every file descriptor or thread of a node.
//! A connection holds its slot (a [`Ticket`]) until it ends; unauthenticated ones also end at
//! the setup deadline, so a flood of silent peers drains by itself.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How many control connections a node takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// In total.
    pub total: usize,
    /// From one peer address.
    pub per_peer: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            total: 4096,
            per_peer: 1024,
        }
    }
}

/// File descriptors one connection may need: its control socket, and on the tcp provider one
/// socket per queue pair plus its listener while it connects.
const FDS_PER_CONNECTION: u64 = 8;

impl Limits {
    /// The limits, lowered where the process's descriptor limit could not serve them.
    pub fn within_fd_limit(self, nofile: u64) -> Limits {
        let fit = (nofile / FDS_PER_CONNECTION).max(1) as usize;
        Limits {
            total: self.total.min(fit),
            per_peer: self.per_peer.min(fit),
        }
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// The node's connection slots.
pub struct Admission {
    limits: Limits,
    counts: Mutex<Counts>,
}

/// One admitted connection's slot, given back on drop.
pub struct Ticket {
    admission: Arc<Admission>,
    peer: IpAddr,
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            counts: Mutex::default(),
        })
    }

    /// A slot for a connection from `peer`, or why there is none.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Ticket, String> {
        let mut c = self.counts.lock().unwrap();
        if c.total >= self.limits.total {
            return Err(format!(
                "{} connections already (--max-connections)",
                c.total
            ));
        }
        let mine = c.per_peer.entry(peer).or_default();
        if *mine >= self.limits.per_peer {
            return Err(format!(
                "{mine} connections from {peer} already (--max-connections-per-peer)"
            ));
        }
        *mine += 1;
        c.total += 1;
        Ok(Ticket {
            admission: self.clone(),
            peer,
        })
    }

    /// Connections holding a slot now.
    pub fn in_use(&self) -> usize {
        self.counts.lock().unwrap().total
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.admission.counts.lock().unwrap();
        c.total -= 1;
        if let Some(n) = c.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.per_peer.remove(&self.peer);
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit; returns the limit in force.
pub fn raise_fd_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the rlimit struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r = want;
            }
        }
    }
    r.rlim_cur
}

/// Whether an accept error means the process or system is out of a resource (descriptors,
/// buffers, memory): retrying at once would only spin.
pub fn is_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Logs a recurring condition at most once per interval, with how often it happened between.
pub struct RateLimitedLog {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    pub fn new(interval: Duration) -> RateLimitedLog {
        RateLimitedLog {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// Logs `msg` at warn, unless one was logged less than the interval ago.
    pub fn warn(&mut self, msg: impl std::fmt::Display) {
        let now = Instant::now();
        if self.last.is_some_and(|t| now - t < self.interval) {
            self.suppressed += 1;
            return;
        }
        match std::mem::take(&mut self.suppressed) {
            0 => log::warn!("{msg}"),
            n => log::warn!("{msg} (and {n} more like it since the last report)"),
        }
        self.last = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_per_peer_and_in_total_and_come_back() {
        let a = Admission::new(Limits {
            total: 3,
            per_peer: 2,
        });
        let one: IpAddr = "10.0.0.1".parse().unwrap();
        let two: IpAddr = "10.0.0.2".parse().unwrap();
        let t1 = a.admit(one).unwrap();
        let _t2 = a.admit(one).unwrap();
        assert!(a.admit(one).err().unwrap().contains("per-peer"));
        let _t3 = a.admit(two).unwrap();
        assert!(a.admit(two).err().unwrap().contains("--max-connections"));
        drop(t1);
        assert_eq!(a.in_use(), 2);
        assert!(a.admit(one).is_ok());
    }

    #[test]
    fn limits_fit_the_descriptor_limit() {
        let l = Limits::default().within_fd_limit(1024);
        assert_eq!(l.total, 128);
        assert_eq!(l.per_peer, 128);
        assert_eq!(
            Limits::default().within_fd_limit(1 << 20),
            Limits::default()
        );
    }

    #[test]
    fn the_fd_limit_is_raised_to_the_hard_limit() {
        let got = raise_fd_limit();
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_fd_limit.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
        assert_eq!(got, r.rlim_cur);
        assert_eq!(r.rlim_cur, r.rlim_max);
    }
}
