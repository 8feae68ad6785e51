//! How a tcp queue pair's connection is made: on a port of its own, or through the one
//! listening socket of a node.
//!
//! A node that listens for its peers already has a socket everyone reaches it at; its queue
//! pairs take their connections from that socket ([`QpRoute::Arrive`]) and the peer that
//! dialed the node dials its queue pairs too ([`QpRoute::Dial`]). So a firewall names one port
//! per node, no client listens at all, and no stray listener exists for a local user to
//! connect to first. Whoever dials may authenticate each connection before the queue pair's
//! own hello (the [`Dialer`]), and the node hands over a connection only once it has.
//!
//! Either way the queue pair's hello follows: the dialer names its token and ours, the other
//! side answers with both in turn, so a connection reaches the queue pair whose token it names
//! and only from the peer whose token it carries. Queue pairs set up on an authenticated
//! control connection carry a proof in each hello too ([`ControlBinding`]): a connection that
//! names the right tokens but was not made by that control connection's peer is turned away.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::{TcpEndpoint, WireKeys};
use crate::transport::binding::{ControlBinding, PROOF_LEN};

const HELLO_MAGIC: u32 = 0x5242_5150; // "RBQP"
/// Magic, two tokens, and the proof (zeros where the queue pairs are not bound).
const HELLO_LEN: usize = 20 + PROOF_LEN;
const PROOF_OF: &[u8] = b"queue pair";

/// A queue pair's connection once whatever comes before its hello is done.
pub struct Authenticated {
    /// The connection, its hello not yet said.
    pub stream: TcpStream,
    /// With keys, everything after the hello is encrypted with them.
    pub keys: Option<WireKeys>,
    /// A value only the two ends of this connection know (from its own authentication), which
    /// a bound queue pair's hello proves it holds; none for a connection not authenticated.
    pub channel: Option<[u8; 32]>,
}

/// Dials a peer's listening socket for one queue pair within the time given, doing whatever
/// the peer asks before the queue pair's hello (authentication, saying what it is for).
pub type Dialer = Arc<dyn Fn(SocketAddr, Duration) -> io::Result<Authenticated> + Send + Sync>;

/// How the queue pairs of one setup get their connections.
#[derive(Clone)]
pub enum QpRoute {
    /// Each queue pair listens on a port of its own and the side with the smaller token
    /// dials: for peers without a listening socket to share (tools, tests).
    OwnPort,
    /// We dial the peer's listening socket (where it was reached at), through the dialer;
    /// bound to the control connection if it was authenticated.
    Dial(Dialer, Option<ControlBinding>),
    /// The peer dials our listening socket; its connections come through the arrivals,
    /// bound to the control connection if it was authenticated.
    Arrive(Arc<Arrivals>, Option<ControlBinding>),
}

impl QpRoute {
    /// What ties these queue pairs to their control connection, if anything does.
    pub fn binding(&self) -> Option<&ControlBinding> {
        match self {
            QpRoute::OwnPort => None,
            QpRoute::Dial(_, b) | QpRoute::Arrive(_, b) => b.as_ref(),
        }
    }
}

/// A connection handed to a waiting queue pair, and what it holds while it lives.
pub(super) struct Arrival {
    stream: TcpStream,
    from: u64,
    keys: Option<WireKeys>,
    channel: Option<[u8; 32]>,
}

/// A queue pair waiting for its connection: where to hand it, and what it must prove.
struct Waiting {
    to: Sender<Arrival>,
    binding: Option<ControlBinding>,
}

/// The queue pairs of a node waiting for their peers' connections, by token: the node's
/// accept loop hands each queue-pair connection in ([`Arrivals::deliver`]).
#[derive(Default)]
pub struct Arrivals {
    waiting: Mutex<HashMap<u64, Waiting>>,
}

impl Arrivals {
    /// No queue pair waiting yet.
    pub fn new() -> Arc<Arrivals> {
        Arc::default()
    }

    /// Reads a queue-pair connection's hello (by `deadline`) and hands the connection to the
    /// queue pair it names; `named` runs once it is known whose it is and that it proved
    /// itself, before the queue pair (and so its peer) can see it (a node gives back what it
    /// held for the connection). Fails, closing the connection, when no queue pair of ours
    /// waits for it or it lacks the proof its queue pair asks for.
    pub fn deliver(
        &self,
        conn: Authenticated,
        deadline: Instant,
        named: impl FnOnce(),
    ) -> io::Result<()> {
        let Authenticated {
            mut stream,
            keys,
            channel,
        } = conn;
        stream.set_read_timeout(Some(remaining(deadline)?))?;
        let mut got = [0u8; HELLO_LEN];
        stream.read_exact(&mut got)?;
        let (from, to) = parse_hello(&got)?;
        let waiting = self
            .waiting
            .lock()
            .unwrap()
            .get(&to)
            .map(|w| (w.to.clone(), w.binding.clone()));
        let Some((qp, binding)) = waiting else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "a queue-pair connection for no queue pair of ours (finished, or never made)",
            ));
        };
        if let Some(b) = &binding {
            if !proven(b, channel.as_ref(), &got) {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "a queue-pair connection that did not prove it comes from the peer of the \
                     control connection its queue pair was set up on",
                ));
            }
        }
        named();
        qp.try_send(Arrival {
            stream,
            from,
            keys,
            channel,
        })
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a second connection for one queue pair",
            )
        })
    }

    fn expect(self: &Arc<Self>, token: u64, binding: Option<ControlBinding>) -> Awaiting {
        let (tx, rx) = crossbeam_channel::bounded(4);
        let waiting = Waiting { to: tx, binding };
        self.waiting.lock().unwrap().insert(token, waiting);
        Awaiting {
            arrivals: self.clone(),
            token,
            rx,
        }
    }
}

/// A queue pair's place among the arrivals, given up when it is connected or dropped.
pub(super) struct Awaiting {
    arrivals: Arc<Arrivals>,
    token: u64,
    rx: Receiver<Arrival>,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.arrivals.waiting.lock().unwrap().remove(&self.token);
    }
}

/// A queue pair's connection, and the keys that encrypt it (if they do).
pub(super) type Connected = (TcpStream, Option<WireKeys>);

/// A prepared queue pair's way to its connection.
pub(super) enum Setup {
    OwnPort(TcpListener),
    Dial(Dialer, Option<ControlBinding>),
    Arrive(Awaiting, Option<ControlBinding>),
}

impl Setup {
    pub(super) fn new(route: &QpRoute, bind_ip: IpAddr, token: u64) -> io::Result<Setup> {
        Ok(match route {
            QpRoute::OwnPort => Setup::OwnPort(TcpListener::bind(SocketAddr::new(bind_ip, 0))?),
            QpRoute::Dial(d, b) => Setup::Dial(d.clone(), b.clone()),
            QpRoute::Arrive(a, b) => Setup::Arrive(a.expect(token, b.clone()), b.clone()),
        })
    }

    /// The address the peer is told: our own port's, or none (port 0) where the peer reaches
    /// us at the address it dialed (or never dials us).
    pub(super) fn addr(&self) -> io::Result<SocketAddr> {
        match self {
            Setup::OwnPort(l) => l.local_addr(),
            Setup::Dial(..) | Setup::Arrive(..) => {
                Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
            }
        }
    }

    /// The connection to the peer's queue pair, its hello exchanged, and the keys that
    /// encrypt what follows (if it is).
    pub(super) fn connect(
        self,
        qpn: u32,
        token: u64,
        remote: &TcpEndpoint,
        deadline: Instant,
    ) -> io::Result<Connected> {
        match self {
            Setup::OwnPort(listener) if (token, qpn) < (remote.token, remote.qpn) => {
                drop(listener);
                let s = TcpStream::connect_timeout(&remote.addr, remaining(deadline)?)?;
                let plain = Authenticated {
                    stream: s,
                    keys: None,
                    channel: None,
                };
                say_hello(plain, token, remote.token, None, deadline)
            }
            Setup::OwnPort(listener) => {
                Ok((accept_own(&listener, qpn, token, remote, deadline)?, None))
            }
            Setup::Dial(dial, binding) => {
                if remote.addr.port() == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "the peer's queue pair has no address to dial",
                    ));
                }
                let conn = dial(remote.addr, remaining(deadline)?)?;
                say_hello(conn, token, remote.token, binding.as_ref(), deadline)
            }
            Setup::Arrive(awaiting, binding) => loop {
                let a = awaiting
                    .rx
                    .recv_timeout(remaining(deadline)?)
                    .map_err(|_| timed_out())?;
                if a.from != remote.token {
                    log::warn!("queue pair {qpn}: dropped a connection from another peer");
                    continue;
                }
                let mut s = a.stream;
                s.write_all(&bound_hello(
                    token,
                    remote.token,
                    binding.as_ref(),
                    a.channel,
                ))?;
                s.set_read_timeout(None)?;
                return Ok((s, a.keys));
            },
        }
    }
}

/// Dialer's side of the hello: ours first, then the peer's answer (which must prove itself
/// as ours does, where the queue pairs are bound).
fn say_hello(
    conn: Authenticated,
    token: u64,
    remote: u64,
    binding: Option<&ControlBinding>,
    deadline: Instant,
) -> io::Result<Connected> {
    let Authenticated {
        stream: mut s,
        keys,
        channel,
    } = conn;
    s.set_read_timeout(Some(remaining(deadline)?))?;
    s.write_all(&bound_hello(token, remote, binding, channel))?;
    let mut reply = [0u8; HELLO_LEN];
    s.read_exact(&mut reply)?;
    let tokens_right = reply[..20] == hello(remote, token)[..20];
    if !tokens_right || !binding.is_none_or(|b| proven(b, channel.as_ref(), &reply)) {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "queue pair handshake: the peer answered with the wrong tokens or proof",
        ));
    }
    s.set_read_timeout(None)?;
    Ok((s, keys))
}

fn accept_own(
    listener: &TcpListener,
    qpn: u32,
    token: u64,
    remote: &TcpEndpoint,
    deadline: Instant,
) -> io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        let wait = remaining(deadline)?;
        if !crate::transport::poll_readable(listener.as_fd(), Some(wait))? {
            continue;
        }
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(remaining(deadline)?))?;
        let mut got = [0u8; HELLO_LEN];
        // A stray connection that does not say the right thing is dropped; keep waiting.
        if s.read_exact(&mut got).is_err() || got != hello(remote.token, token) {
            log::warn!("queue pair {qpn}: dropped a connection with a bad handshake");
            continue;
        }
        s.write_all(&hello(token, remote.token))?;
        s.set_read_timeout(None)?;
        return Ok(s);
    }
}

/// A hello without a proof: for queue pairs that are not bound.
pub(super) fn hello(from: u64, to: u64) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&from.to_le_bytes());
    b[12..20].copy_from_slice(&to.to_le_bytes());
    b
}

/// A hello with our proof over the tokens and the connection's channel value, where the
/// queue pairs are bound and the connection was authenticated.
fn bound_hello(
    from: u64,
    to: u64,
    binding: Option<&ControlBinding>,
    channel: Option<[u8; 32]>,
) -> [u8; HELLO_LEN] {
    let mut b = hello(from, to);
    if let (Some(binding), Some(channel)) = (binding, channel) {
        let proof = binding.prove(PROOF_OF, &[&channel, &b[4..20]]);
        b[20..].copy_from_slice(&proof);
    }
    b
}

/// Whether a hello carries the peer's proof for this connection.
fn proven(binding: &ControlBinding, channel: Option<&[u8; 32]>, got: &[u8; HELLO_LEN]) -> bool {
    channel.is_some_and(|c| binding.verify(PROOF_OF, &[c, &got[4..20]], &got[20..]))
}

/// (from, to) of a dialer's hello.
fn parse_hello(b: &[u8; HELLO_LEN]) -> io::Result<(u64, u64)> {
    if b[..4] != HELLO_MAGIC.to_le_bytes() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a queue-pair hello",
        ));
    }
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    Ok((word(4), word(12)))
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "queue pair connection timed out: is the peer running and reachable?",
    )
}

pub(super) fn remaining(deadline: Instant) -> io::Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(timed_out)
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{bound_hello, hello, Arrivals, Authenticated, QpRoute};
    use crate::transport::binding::ControlBinding;
    use crate::transport::{
        connect_queue_pairs, Access, Context, ProviderKind, QpCaps, RemoteAddr, SendOp, SendWr,
        Sge, TransportConfig, WcStatus,
    };

    /// The control connection's binding key in these tests.
    const KEY: [u8; 32] = [6; 32];

    /// A queue-pair connection as if authenticated: both ends of it know the same channel
    /// value (a handshake would give each connection its own).
    fn channel(stream: TcpStream, keys: Option<crate::transport::WireKeys>) -> Authenticated {
        Authenticated {
            stream,
            keys,
            channel: Some([5; 32]),
        }
    }

    /// A bound queue pair takes only a connection that proves, with its control connection's
    /// key, that it holds this connection's channel value: not one with the right tokens but
    /// another control connection's key (another peer holding the cluster's secret that saw
    /// the tokens), not a proof replayed on another connection, not one with no proof.
    #[test]
    fn a_bound_queue_pair_takes_only_its_control_peers_connection() {
        let arrivals = Arrivals::new();
        let awaiting = arrivals.expect(77, Some(ControlBinding::new(KEY, false)));
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let ours = ControlBinding::new(KEY, true);
        let theirs = ControlBinding::new([7; 32], true);
        let tries: [(&str, [u8; super::HELLO_LEN], [u8; 32]); 4] = [
            (
                "another control key",
                bound_hello(3, 77, Some(&theirs), Some([5; 32])),
                [5; 32],
            ),
            (
                "a proof from another connection",
                bound_hello(3, 77, Some(&ours), Some([4; 32])),
                [5; 32],
            ),
            ("no proof", hello(3, 77), [5; 32]),
            (
                "its own",
                bound_hello(3, 77, Some(&ours), Some([5; 32])),
                [5; 32],
            ),
        ];
        for (what, greeting, chan) in tries {
            let mut c = TcpStream::connect(addr).unwrap();
            let (s, _) = l.accept().unwrap();
            use std::io::Write;
            c.write_all(&greeting).unwrap();
            let conn = Authenticated {
                stream: s,
                keys: None,
                channel: Some(chan),
            };
            let got = arrivals.deliver(conn, Instant::now() + Duration::from_secs(2), || ());
            match what {
                "its own" => {
                    got.unwrap();
                    assert_eq!(awaiting.rx.try_recv().unwrap().from, 3);
                }
                _ => {
                    let e = got.unwrap_err();
                    assert_eq!(
                        e.kind(),
                        std::io::ErrorKind::PermissionDenied,
                        "{what}: {e}"
                    );
                    assert!(awaiting.rx.is_empty(), "{what} was handed over");
                }
            }
        }
    }

    /// A node's listening socket: the control connection and then every queue-pair
    /// connection come to it; the accept loop hands the latter to the arrivals.
    fn node(
        arrivals: Arc<Arrivals>,
    ) -> (std::net::SocketAddr, std::sync::mpsc::Receiver<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut first = true;
            for s in l.incoming() {
                let s = s.unwrap();
                if first {
                    first = false;
                    tx.send(s).unwrap();
                    continue;
                }
                let arrivals = arrivals.clone();
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(2);
                    let _ = arrivals.deliver(channel(s, None), deadline, || ());
                });
            }
        });
        (addr, rx)
    }

    /// What a client that dialed the node at `addr` keeps: its provider, domain, `n` queue
    /// pairs dialled through `dial`, and the control connection.
    type Client = (
        Context,
        crate::transport::ProtectionDomain,
        Vec<(
            crate::transport::QueuePair,
            crate::transport::CompletionQueue,
        )>,
        TcpStream,
    );

    fn client(
        addr: std::net::SocketAddr,
        n: usize,
        dial: super::Dialer,
    ) -> std::thread::JoinHandle<Client> {
        std::thread::spawn(move || {
            let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let mut s = TcpStream::connect(addr).unwrap();
            let route = QpRoute::Dial(dial, Some(ControlBinding::new(KEY, true)));
            let qps = connect_queue_pairs(&ctx, &pd, &mut s, n, QpCaps::default(), &route).unwrap();
            (ctx, pd, qps, s)
        })
    }

    /// Queue pairs set up through one listening socket carry one-sided traffic, and a
    /// connection that names a token nobody waits for is turned away.
    #[test]
    fn queue_pairs_come_through_the_node_socket() {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let arrivals = Arrivals::new();
        let (addr, controls) = node(arrivals.clone());
        let dial: super::Dialer = Arc::new(|addr, timeout| {
            Ok(channel(TcpStream::connect_timeout(&addr, timeout)?, None))
        });
        let client = client(addr, 2, dial);
        let pd = ctx.alloc_pd().unwrap();
        let mem = pd.alloc_region(4096, Access::ALL).unwrap();
        let mut control = controls.recv().unwrap();
        let _node_links = connect_queue_pairs(
            &ctx,
            &pd,
            &mut control,
            2,
            QpCaps::default(),
            &QpRoute::Arrive(arrivals.clone(), Some(ControlBinding::new(KEY, false))),
        )
        .unwrap();
        let (_ctx, cpd, links, _s) = client.join().unwrap();
        assert!(
            arrivals.waiting.lock().unwrap().is_empty(),
            "none left waiting"
        );

        let src = cpd.alloc_region(64, Access::ALL).unwrap();
        src.write_at(0, &[7u8; 64]).unwrap();
        let sge = [Sge::new(&src, 0, 64).unwrap()];
        let to = RemoteAddr {
            addr: mem.addr() + 100,
            rkey: mem.rkey(),
        };
        for (qp, cq) in &links {
            qp.post_send(&[SendWr::new(1, SendOp::Write(to), &sge)])
                .unwrap();
            let mut wc = [crate::transport::Completion::EMPTY; 1];
            let deadline = Instant::now() + Duration::from_secs(5);
            while cq.poll(&mut wc).unwrap() == 0 {
                assert!(Instant::now() < deadline, "no completion");
            }
            assert_eq!(wc[0].status, WcStatus::Success);
        }
        assert_eq!(mem.to_vec()[100..164], [7u8; 64]);

        let mut stray = TcpStream::connect(addr).unwrap();
        use std::io::{Read, Write};
        stray.write_all(&hello(1, 2)).unwrap();
        stray
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(stray.read(&mut [0u8; 1]).unwrap_or(0), 0, "turned away");
    }

    /// Bytes that pass through a relay from its port to `to`, client to node, recorded.
    fn relay(to: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<std::sync::Mutex<Vec<u8>>>) {
        use std::io::{Read, Write};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                let mut n = TcpStream::connect(to).unwrap();
                let (mut c2, mut n2) = (c.try_clone().unwrap(), n.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut n2, &mut c2);
                });
                let record = record.clone();
                std::thread::spawn(move || {
                    let mut b = [0u8; 65536];
                    while let Ok(k) = c.read(&mut b) {
                        if k == 0 || n.write_all(&b[..k]).is_err() {
                            break;
                        }
                        record.lock().unwrap().extend_from_slice(&b[..k]);
                    }
                });
            }
        });
        (addr, seen)
    }

    /// With keys, a queue pair's connection carries WRITEs and READs whole, to a node's
    /// engine and to its responder loop, and what crosses the wire is not the file's bytes.
    #[test]
    fn encrypted_queue_pairs_carry_data_and_show_none_of_it() {
        use crate::transport::WireKeys;
        let client_keys = WireKeys {
            send: [3; 32],
            receive: [4; 32],
        };
        let node_keys = WireKeys {
            send: client_keys.receive,
            receive: client_keys.send,
        };
        for caps in [QpCaps::default(), QpCaps::RESPONDER] {
            let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
            let arrivals = Arrivals::new();
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let node_addr = l.local_addr().unwrap();
            let (relay_addr, seen) = relay(node_addr);
            let (controls_tx, controls) = std::sync::mpsc::channel();
            {
                let arrivals = arrivals.clone();
                std::thread::spawn(move || {
                    let mut first = true;
                    for s in l.incoming() {
                        let s = s.unwrap();
                        if std::mem::take(&mut first) {
                            controls_tx.send(s).unwrap();
                            continue;
                        }
                        let deadline = Instant::now() + Duration::from_secs(2);
                        let _ = arrivals.deliver(channel(s, Some(node_keys)), deadline, || ());
                    }
                });
            }
            let dial: super::Dialer = Arc::new(move |_, timeout| {
                let s = TcpStream::connect_timeout(&relay_addr, timeout)?;
                Ok(channel(s, Some(client_keys)))
            });
            let client = client(node_addr, 1, dial);
            let pd = ctx.alloc_pd().unwrap();
            let mem = pd.alloc_region(1 << 20, Access::ALL).unwrap();
            let mut control = controls.recv().unwrap();
            let _node = connect_queue_pairs(
                &ctx,
                &pd,
                &mut control,
                1,
                caps,
                &QpRoute::Arrive(arrivals, Some(ControlBinding::new(KEY, false))),
            )
            .unwrap();
            let (_ctx, cpd, links, _s) = client.join().unwrap();
            let (qp, cq) = &links[0];
            let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let src = cpd
                .register_vec(data.clone(), Access::ALL)
                .map_err(|e| e.0)
                .unwrap();
            let back = cpd.alloc_region(data.len(), Access::ALL).unwrap();
            let to = RemoteAddr {
                addr: mem.addr() + 4096,
                rkey: mem.rkey(),
            };
            let wait = |id: u64| {
                let mut wc = [crate::transport::Completion::EMPTY; 1];
                let deadline = Instant::now() + Duration::from_secs(10);
                while cq.poll(&mut wc).unwrap() == 0 {
                    assert!(Instant::now() < deadline, "no completion");
                }
                assert_eq!((wc[0].wr_id, wc[0].status), (id, WcStatus::Success));
            };
            let whole = [Sge::new(&src, 0, data.len()).unwrap()];
            qp.post_send(&[SendWr::new(1, SendOp::Write(to), &whole)])
                .unwrap();
            wait(1);
            let into = [Sge::new(&back, 0, data.len()).unwrap()];
            qp.post_send(&[SendWr::new(2, SendOp::Read(to), &into)])
                .unwrap();
            wait(2);
            assert!(back.to_vec() == data, "{caps:?}: read back");
            assert!(
                mem.to_vec()[4096..4096 + data.len()] == data[..],
                "{caps:?}: landed"
            );
            let seen = seen.lock().unwrap();
            assert!(
                seen.len() > data.len(),
                "the payload went through the relay"
            );
            assert!(
                !seen.windows(32).any(|w| w == &data[1000..1032]),
                "{caps:?}: file bytes in the clear on the wire"
            );
        }
    }
}
