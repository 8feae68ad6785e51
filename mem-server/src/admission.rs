//! Who gets a slot: limits on what peers hold of a node, in total and per peer address, so that
//! no peer, authenticated or not, can take every file descriptor or thread of a node.
//! A connection holds a [`Ticket`] until it ends. Once it has authenticated, the ticket holds a
//! slot for the connection ([`Ticket::authenticate`]), and once it has said what it is for, one
//! more for each queue pair it sets up ([`Ticket::reserve`]): those hold a descriptor or two of the node each for as long as the
//! connection lives, whatever becomes of their own connections (which, on tcp, come in
//! beside it, and are counted with it once handed over). Connections still authenticating
//! have a smaller budget of their own, so that peers without the secret never take the slots of
//! authenticated ones; and once one address's share of that budget is full, its oldest
//! connection still authenticating is closed to make room for the new one: a flood of silent
//! connections from a client's address (any local user of the client host, or a NAT) cannot
//! keep that client from connecting, since its own handshake is over long before the flood
//! has opened as many connections again. IPv6 peers count by /64, the block one host usually has.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::resource::{getrlimit, setrlimit, Resource};

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

/// Of the slots, how many may be authenticating at once: in total, and per peer.
const PENDING_SHARE: usize = 8;
const PENDING_PER_PEER_SHARE: usize = 32;

/// File descriptors one connection may need: its socket, and room for what else the node opens
/// as it serves it.
const FDS_PER_CONNECTION: u64 = 2;

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
    pending: usize,
    pending_per_peer: HashMap<IpAddr, usize>,
    /// Each address's connections still authenticating, oldest first, by ticket: what is
    /// closed to make room.
    authenticating: HashMap<IpAddr, VecDeque<(u64, TcpStream)>>,
    next_ticket: u64,
}

impl Counts {
    /// Forgets ticket `id` of `peer` among those still authenticating.
    fn done_authenticating(&mut self, peer: IpAddr, id: u64) {
        if let Some(q) = self.authenticating.get_mut(&peer) {
            q.retain(|(t, _)| *t != id);
            if q.is_empty() {
                self.authenticating.remove(&peer);
            }
        }
    }
}

/// The address a peer counts under: itself, or for IPv6 its /64.
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        IpAddr::V6(v6) => IpAddr::V4(v6.to_ipv4_mapped().expect("checked")),
        v4 => v4,
    }
}

fn decrement(map: &mut HashMap<IpAddr, usize>, key: IpAddr) {
    if let Some(n) = map.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            map.remove(&key);
        }
    }
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
    id: u64,
    pending: bool,
    /// Slots held since it authenticated ([`Ticket::reserve`]).
    reserved: usize,
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            counts: Mutex::default(),
        })
    }

    /// A slot for a connection from `peer`, still authenticating, or why there is none.
    /// `conn` (the connection's socket, or a handle of it) is closed if the peer's newer
    /// connections need its slot before it authenticates.
    pub fn admit(
        self: &Arc<Self>,
        peer: IpAddr,
        conn: Option<TcpStream>,
    ) -> Result<Ticket, String> {
        let key = peer_key(peer);
        let pending_total = (self.limits.total / PENDING_SHARE).max(1);
        let pending_per_peer = (self.limits.per_peer / PENDING_PER_PEER_SHARE).max(1);
        let mut c = self.counts.lock().unwrap();
        if c.total + c.pending >= self.limits.total {
            return Err(format!(
                "{} slots taken already (--max-connections)",
                c.total + c.pending
            ));
        }
        if c.pending >= pending_total {
            return Err(format!("{} connections still authenticating", c.pending));
        }
        let mine_pending = c.pending_per_peer.get(&key).copied().unwrap_or(0);
        if mine_pending >= pending_per_peer {
            // Its slot comes back when its thread sees the close; the new one is let in now.
            let oldest = c.authenticating.get_mut(&key).and_then(VecDeque::pop_front);
            let Some((_, oldest)) = oldest else {
                return Err(format!(
                    "{mine_pending} connections from {key} still authenticating"
                ));
            };
            let _ = oldest.shutdown(Shutdown::Both);
        }
        *c.pending_per_peer.entry(key).or_default() += 1;
        c.pending += 1;
        c.next_ticket += 1;
        let id = c.next_ticket;
        if let Some(conn) = conn {
            c.authenticating
                .entry(key)
                .or_default()
                .push_back((id, conn));
        }
        Ok(Ticket {
            admission: self.clone(),
            peer: key,
            id,
            pending: true,
            reserved: 0,
        })
    }

    /// Slots held now, by connections still authenticating too.
    pub fn in_use(&self) -> usize {
        let c = self.counts.lock().unwrap();
        c.total + c.pending
    }
}

impl Ticket {
    /// The peer proved it knows the secret: its connection leaves the authenticating budget
    /// for a slot of its own, if the limits leave one.
    pub fn authenticate(&mut self) -> Result<(), String> {
        self.leave_pending();
        self.reserve(1)
    }

    fn leave_pending(&mut self) {
        if std::mem::take(&mut self.pending) {
            let mut c = self.admission.counts.lock().unwrap();
            c.pending -= 1;
            decrement(&mut c.pending_per_peer, self.peer);
            c.done_authenticating(self.peer, self.id);
        }
    }
}

impl Ticket {
    /// Holds `n` slots more, for the queue pairs the authenticated connection sets up;
    /// refused past the limits.
    pub fn reserve(&mut self, n: usize) -> Result<(), String> {
        let mut c = self.admission.counts.lock().unwrap();
        let limits = self.admission.limits;
        if c.total + n > limits.total {
            return Err(format!(
                "{} connections and queue pairs already, {n} more asked (--max-connections)",
                c.total
            ));
        }
        let mine = c.per_peer.get(&self.peer).copied().unwrap_or(0);
        if mine + n > limits.per_peer {
            return Err(format!(
                "{mine} connections and queue pairs from {} already, {n} more asked \
                 (--max-connections-per-peer)",
                self.peer
            ));
        }
        c.total += n;
        *c.per_peer.entry(self.peer).or_default() += n;
        self.reserved += n;
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.leave_pending();
        let mut c = self.admission.counts.lock().unwrap();
        for _ in 0..self.reserved {
            c.total -= 1;
            decrement(&mut c.per_peer, self.peer);
        }
    }
}

/// Raises the soft limit on open files to the hard limit; returns the limit in force.
pub fn raise_fd_limit() -> u64 {
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return 1024;
    };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return hard;
    }
    soft
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

    fn admitted(a: &Arc<Admission>, ip: &str) -> Ticket {
        let mut t = a.admit(ip.parse().unwrap(), None).unwrap();
        t.authenticate().unwrap();
        t
    }

    /// Whether a peer at `ip` that authenticates gets a slot.
    fn authenticates(a: &Arc<Admission>, ip: &str) -> Result<Ticket, String> {
        let mut t = a.admit(ip.parse().unwrap(), None)?;
        t.authenticate().map(|()| t)
    }

    #[test]
    fn slots_are_bounded_per_peer_and_in_total_and_come_back() {
        let a = Admission::new(Limits {
            total: 3,
            per_peer: 2,
        });
        let t1 = admitted(&a, "10.0.0.1");
        let _t2 = admitted(&a, "10.0.0.1");
        let refused = authenticates(&a, "10.0.0.1").err().unwrap();
        assert!(refused.contains("per-peer"), "{refused}");
        let _t3 = admitted(&a, "10.0.0.2");
        let full = a.admit("10.0.0.2".parse().unwrap(), None).err().unwrap();
        assert!(full.contains("--max-connections"), "{full}");
        drop(t1);
        assert_eq!(a.in_use(), 2);
        assert!(a.admit("10.0.0.1".parse().unwrap(), None).is_ok());
    }

    /// A session's queue pairs hold slots of its connection's, for as long as it lives.
    #[test]
    fn queue_pairs_hold_slots_of_their_connections() {
        let a = Admission::new(Limits {
            total: 64,
            per_peer: 10,
        });
        let mut data = admitted(&a, "10.0.0.1");
        data.reserve(4).unwrap();
        let mut meta = admitted(&a, "10.0.0.1");
        meta.reserve(2).unwrap();
        assert_eq!(a.in_use(), 8);
        let refused = admitted(&a, "10.0.0.1").reserve(4).unwrap_err();
        assert!(refused.contains("per-peer"), "{refused}");
        drop(data);
        assert_eq!(a.in_use(), 3);
        admitted(&a, "10.0.0.1").reserve(4).unwrap();
    }

    #[test]
    fn peers_still_authenticating_cannot_take_the_authenticated_slots() {
        let a = Admission::new(Limits {
            total: 64,
            per_peer: 64,
        });
        // 64 / 32: two at a time from one peer, 64 / 8 = 8 in all.
        let lurkers: Vec<Ticket> = (0..2)
            .map(|_| a.admit("10.0.0.9".parse().unwrap(), None).unwrap())
            .collect();
        let refused = a.admit("10.0.0.9".parse().unwrap(), None).err().unwrap();
        assert!(refused.contains("authenticating"), "{refused}");
        let more: Vec<Ticket> = (1..=6)
            .map(|i| {
                a.admit(format!("10.0.1.{i}").parse().unwrap(), None)
                    .unwrap()
            })
            .collect();
        assert!(
            a.admit("10.0.2.1".parse().unwrap(), None).is_err(),
            "8 in all"
        );
        // Once authenticated, a connection makes room for the next one to authenticate.
        let mut first = more.into_iter().next().unwrap();
        first.authenticate().unwrap();
        assert!(a.admit("10.0.2.1".parse().unwrap(), None).is_ok());
        drop(lurkers);
    }

    #[test]
    fn a_peers_oldest_connection_still_authenticating_makes_room_for_its_newest() {
        use std::io::Read;
        let a = Admission::new(Limits {
            total: 64,
            per_peer: 64,
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let peer: IpAddr = "127.0.0.1".parse().unwrap();
        // Two may authenticate at once from one address (64 / 32).
        let (mut ours, mut theirs, mut served) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            let dialled = TcpStream::connect(addr).unwrap();
            let (accepted, _) = listener.accept().unwrap();
            ours.push(a.admit(peer, Some(accepted.try_clone().unwrap())).unwrap());
            theirs.push(dialled);
            served.push(accepted);
        }
        theirs[0]
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(theirs[0].read(&mut b).unwrap(), 0, "the oldest was closed");
        // Its thread ends; the two newest hold the address's share.
        drop(ours.remove(0));
        ours[0].authenticate().unwrap();
        let dialled = TcpStream::connect(addr).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let _fourth = a.admit(peer, Some(accepted)).unwrap();
        theirs[1]
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        assert!(
            theirs[1].read(&mut b).is_err(),
            "an authenticated connection is never closed for room"
        );
        assert_eq!(a.in_use(), 3);
        drop(dialled);
    }

    #[test]
    fn ipv6_peers_count_by_their_64() {
        let a = Admission::new(Limits {
            total: 100,
            per_peer: 1,
        });
        let _t = admitted(&a, "2001:db8:1:2::1");
        assert!(authenticates(&a, "2001:db8:1:2::ffff").is_err());
        assert!(authenticates(&a, "2001:db8:1:3::1").is_ok());
        let _v4 = admitted(&a, "::ffff:10.0.0.1");
        assert!(authenticates(&a, "10.0.0.1").is_err(), "mapped v4 is v4");
    }

    #[test]
    fn limits_fit_the_descriptor_limit() {
        let l = Limits::default().within_fd_limit(1024);
        assert_eq!(l.total, 512);
        assert_eq!(l.per_peer, 512);
        assert_eq!(
            Limits::default().within_fd_limit(1 << 20),
            Limits::default()
        );
    }

    #[test]
    fn the_fd_limit_is_raised_to_the_hard_limit() {
        let got = raise_fd_limit();
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(got, soft);
        assert_eq!(soft, hard);
    }
}
