//! Queue-pair endpoints and their exchange over a TCP control connection.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::binding::{ControlBinding, PROOF_LEN};
use super::deadline::DeadlineStream;

use super::tcp::TcpEndpoint;
use super::verbs::VerbsEndpoint;

/// What a peer needs to connect to one of our queue pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A software queue pair: where its provider listens, and which QP.
    Tcp(TcpEndpoint),
    /// An RDMA NIC's queue pair: its number, starting PSN and address.
    Verbs(VerbsEndpoint),
}

const TAG_TCP: u8 = 1;
const TAG_VERBS: u8 = 2;
const MAGIC: &[u8; 4] = b"RBXE";
const VERSION: u16 = 2;
const PROOF_OF: &[u8] = b"endpoints";
/// More queue pairs than any session uses; bounds what a hostile peer can make us read.
const MAX_ENDPOINTS: usize = 256;

impl Endpoint {
    /// The wire form: a provider tag, then that provider's fixed-size fields, little-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40);
        match self {
            Endpoint::Tcp(t) => {
                b.push(TAG_TCP);
                let ip = match t.addr.ip() {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                b.extend_from_slice(&ip.octets());
                b.extend_from_slice(&t.addr.port().to_le_bytes());
                b.extend_from_slice(&t.qpn.to_le_bytes());
                b.extend_from_slice(&t.token.to_le_bytes());
            }
            Endpoint::Verbs(v) => {
                b.push(TAG_VERBS);
                b.extend_from_slice(&v.qpn.to_le_bytes());
                b.extend_from_slice(&v.psn.to_le_bytes());
                b.extend_from_slice(&v.lid.to_le_bytes());
                b.extend_from_slice(&v.gid);
                b.push(v.mtu);
            }
        }
        b
    }

    /// Parses [`Endpoint::encode`]'s output; anything else (wrong tag, length or MTU) is
    /// `InvalidData`, since it comes from the peer.
    pub fn decode(b: &[u8]) -> io::Result<Endpoint> {
        let bad =
            |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("endpoint: {why}"));
        let (&tag, rest) = b.split_first().ok_or_else(|| bad("empty"))?;
        let u32_at = |i: usize| u32::from_le_bytes(rest[i..i + 4].try_into().unwrap());
        match tag {
            TAG_TCP if rest.len() == 30 => {
                let ip6 = Ipv6Addr::from(<[u8; 16]>::try_from(&rest[..16]).unwrap());
                let ip = ip6
                    .to_ipv4_mapped()
                    .map(IpAddr::V4)
                    .unwrap_or(IpAddr::V6(ip6));
                let port = u16::from_le_bytes([rest[16], rest[17]]);
                Ok(Endpoint::Tcp(TcpEndpoint {
                    addr: SocketAddr::new(ip, port),
                    qpn: u32_at(18),
                    token: u64::from_le_bytes(rest[22..30].try_into().unwrap()),
                }))
            }
            TAG_VERBS if rest.len() == 27 => {
                let mtu = rest[26];
                if !(1..=5).contains(&mtu) {
                    return Err(bad("MTU out of range"));
                }
                Ok(Endpoint::Verbs(VerbsEndpoint {
                    qpn: u32_at(0),
                    psn: u32_at(4) & 0x00ff_ffff,
                    lid: u16::from_le_bytes([rest[8], rest[9]]),
                    gid: rest[10..26].try_into().unwrap(),
                    mtu,
                }))
            }
            TAG_TCP | TAG_VERBS => Err(bad("wrong length")),
            _ => Err(bad("unknown provider tag")),
        }
    }
}

/// Sends our endpoints and receives the peer's over a connected control stream. Both sides call
/// it; each writes before it reads (the messages are tiny, so neither blocks the other).
///
/// A tcp endpoint listening on the unspecified address is reachable at whatever address the
/// peer used to reach us, so it is rewritten to the control connection's peer address; one with
/// no port of its own (port 0) is reached where the control connection was, so its whole
/// address becomes the control connection's peer address.
///
/// With a binding, each side's message carries its MAC: endpoints altered on the path (a
/// relay naming queue pairs of its own) fail the exchange.
///
/// When the stream has a read timeout, it bounds the whole exchange, not each read: a server
/// sets one so that a peer that goes silent (or drips) cannot pin its queue pairs.
pub fn exchange_endpoints(
    stream: &mut TcpStream,
    local: &[Endpoint],
    binding: Option<&ControlBinding>,
) -> io::Result<Vec<Endpoint>> {
    let budget = stream.read_timeout()?;
    if local.len() > MAX_ENDPOINTS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many endpoints",
        ));
    }
    let mut msg = Vec::with_capacity(8 + local.len() * 40);
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&VERSION.to_le_bytes());
    msg.extend_from_slice(&(local.len() as u16).to_le_bytes());
    for e in local {
        let b = e.encode();
        msg.push(b.len() as u8);
        msg.extend_from_slice(&b);
    }
    if let Some(binding) = binding {
        let proof = binding.prove(PROOF_OF, &[&msg]);
        msg.extend_from_slice(&proof);
    }
    stream.write_all(&msg)?;

    let deadline = Instant::now() + budget.unwrap_or(Duration::from_secs(365 * 24 * 3600));
    let mut input = DeadlineStream::new(stream, deadline, "endpoint exchange");
    let mut head = [0u8; 8];
    input.read_exact(&mut head)?;
    if &head[..4] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "peer is not speaking the rdmabox endpoint exchange",
        ));
    }
    let version = u16::from_le_bytes([head[4], head[5]]);
    if version != VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer speaks endpoint exchange version {version}, we speak {VERSION}"),
        ));
    }
    let count = u16::from_le_bytes([head[6], head[7]]) as usize;
    if count > MAX_ENDPOINTS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "peer sent too many endpoints",
        ));
    }
    let peer = stream.peer_addr()?;
    let mut received = head.to_vec();
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let mut len = [0u8; 1];
        input.read_exact(&mut len)?;
        let mut b = vec![0u8; len[0] as usize];
        input.read_exact(&mut b)?;
        received.push(len[0]);
        received.extend_from_slice(&b);
        let mut e = Endpoint::decode(&b)?;
        if let Endpoint::Tcp(t) = &mut e {
            if t.addr.port() == 0 {
                t.addr = peer;
            } else if t.addr.ip().is_unspecified() {
                t.addr.set_ip(peer.ip());
            }
        }
        out.push(e);
    }
    if let Some(binding) = binding {
        let mut proof = [0u8; PROOF_LEN];
        input.read_exact(&mut proof)?;
        if !binding.verify(PROOF_OF, &[&received], &proof) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "endpoint exchange: the peer's endpoints lack the control connection's MAC \
                 (altered on the path)",
            ));
        }
    }
    stream.set_read_timeout(budget)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip() {
        let t = Endpoint::Tcp(TcpEndpoint {
            addr: "10.1.2.3:4567".parse().unwrap(),
            qpn: 9,
            token: 0xfeed_f00d_dead_beef,
        });
        let v = Endpoint::Verbs(VerbsEndpoint {
            qpn: 0x11,
            psn: 0x123456,
            lid: 3,
            gid: [7; 16],
            mtu: 3,
        });
        assert_eq!(Endpoint::decode(&t.encode()).unwrap(), t);
        assert_eq!(Endpoint::decode(&v.encode()).unwrap(), v);
    }

    #[test]
    fn garbage_endpoints_are_rejected() {
        assert!(Endpoint::decode(&[]).is_err());
        assert!(Endpoint::decode(&[9, 1, 2]).is_err());
        assert!(Endpoint::decode(&[TAG_TCP, 1, 2]).is_err());
        let mut v = Endpoint::Verbs(VerbsEndpoint {
            qpn: 1,
            psn: 1,
            lid: 0,
            gid: [0; 16],
            mtu: 3,
        })
        .encode();
        *v.last_mut().unwrap() = 9;
        assert!(Endpoint::decode(&v).is_err());
    }

    #[test]
    fn exchange_fills_in_unspecified_addresses() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mine = Endpoint::Tcp(TcpEndpoint {
            addr: "0.0.0.0:1000".parse().unwrap(),
            qpn: 1,
            token: 5,
        });
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            exchange_endpoints(&mut s, &[mine], None).unwrap()
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let got = exchange_endpoints(&mut c, &[mine, mine], None).unwrap();
        let server_got = server.join().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(server_got.len(), 2);
        match got[0] {
            Endpoint::Tcp(t) => assert_eq!(t.addr, "127.0.0.1:1000".parse().unwrap()),
            _ => panic!("wrong kind"),
        }
    }

    /// Bound to the control connection, endpoints pass whole, and an endpoint altered on the
    /// way (a relay naming a token of its own) fails the exchange on the side that reads it.
    #[test]
    fn bound_endpoints_pass_whole_and_altered_ones_fail() {
        use crate::transport::ControlBinding;
        let mine = |token| {
            Endpoint::Tcp(TcpEndpoint {
                addr: "127.0.0.1:1000".parse().unwrap(),
                qpn: 1,
                token,
            })
        };
        for alter in [false, true] {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let node = std::thread::spawn(move || {
                let (mut s, _) = l.accept().unwrap();
                let b = ControlBinding::new([1; 32], false);
                exchange_endpoints(&mut s, &[mine(7)], Some(&b))
            });
            // A relay in the middle that, when told to, changes the dialer's token.
            let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let relay_addr = relay.local_addr().unwrap();
            std::thread::spawn(move || {
                let (mut c, _) = relay.accept().unwrap();
                let mut n = TcpStream::connect(addr).unwrap();
                let mut msg = vec![0u8; 8 + 1 + 31 + PROOF_LEN];
                c.read_exact(&mut msg).unwrap();
                if alter {
                    msg[8 + 1 + 23] ^= 1;
                }
                n.write_all(&msg).unwrap();
                let mut back = Vec::new();
                let _ = n.read_to_end(&mut back);
                let _ = c.write_all(&back);
            });
            let mut c = TcpStream::connect(relay_addr).unwrap();
            let b = ControlBinding::new([1; 32], true);
            let got = exchange_endpoints(&mut c, &[mine(5)], Some(&b));
            let node_got = node.join().unwrap();
            if alter {
                let e = node_got.unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            } else {
                assert_eq!(node_got.unwrap(), vec![mine(5)]);
                assert_eq!(got.unwrap(), vec![mine(7)]);
            }
        }
    }
}
