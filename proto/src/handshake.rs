//! Who may connect. With a shared secret: mutual challenge-response over the control connection
//! (HMAC-SHA256 over both nonces and ephemeral keys; the secret never crosses the wire). Without one (a node run
//! with --insecure): anyone.
//!
//! Greeting (server): magic, auth flag, 32-byte nonce, ephemeral X25519 public key. Answer
//! (client): its nonce, its public key and its MAC over both sides' nonces and keys. Verdict
//! (server): status byte and the server's MAC, which the client checks in turn. Both ends then
//! hold a [`SessionKey`] derived from the secret, the nonces and what the two ephemeral keys
//! agree on: nobody on the path can derive it, not even a holder of the secret who watched
//! (one who sits on the path and answers for both sides can: the secret is shared, so every
//! holder is trusted that far). What follows on the connection is authenticated with it
//! ([`crate::integrity`]).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmabox::transport::{Authenticated, DeadlineStream, QpRoute};

use hmac::Mac;
use ring::agreement;
use ring::rand::SystemRandom;

/// "RFS" and the generation of the handshake: 2 since what follows it is sealed with the
/// session key (protocol 16), 3 since the key comes from ephemeral keys too (protocol 21).
const MAGIC: &[u8; 4] = b"RFS3";
const NONCE: usize = 32;
/// An X25519 public key.
const PUBLIC: usize = 32;
/// How long the node waits for a node to answer its greeting.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

use crate::frame::send_frame;
use crate::hello::{Hello, QueuePair};
use crate::integrity;
use crate::session_key::{mac, SessionKey, MAC};

/// One side's ephemeral X25519 key of a handshake (with a secret; without one, no key is
/// derived and the public key sent is zeros).
struct Ephemeral {
    private: agreement::EphemeralPrivateKey,
    public: [u8; PUBLIC],
}

impl Ephemeral {
    fn new() -> io::Result<Ephemeral> {
        let failed = |_| io::Error::other("no ephemeral key from the system's random source");
        let private =
            agreement::EphemeralPrivateKey::generate(&agreement::X25519, &SystemRandom::new())
                .map_err(failed)?;
        let public = private.compute_public_key().map_err(failed)?;
        let public = public.as_ref().try_into().expect("an X25519 public key");
        Ok(Ephemeral { private, public })
    }

    /// What our key and the peer's public key agree on.
    fn agree(self, peer: &[u8]) -> io::Result<[u8; 32]> {
        let peer = agreement::UnparsedPublicKey::new(&agreement::X25519, peer);
        agreement::agree_ephemeral(self.private, &peer, |shared| {
            <[u8; 32]>::try_from(shared).expect("X25519 agrees on 32 bytes")
        })
        .map_err(|_| denied("the peer's ephemeral key is not a valid X25519 key"))
    }
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rdmabox::random::fill(&mut n);
    n
}

fn denied(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why.to_string())
}

/// The node's side. The session key (none without a secret) when the peer may proceed; the
/// peer must have answered by `deadline`.
pub fn accept(
    s: &mut TcpStream,
    secret: Option<&[u8]>,
    encrypted_only: bool,
    deadline: Instant,
) -> io::Result<Option<SessionKey>> {
    accept_over(
        &mut DeadlineStream::new(s, deadline, "authentication"),
        secret,
        encrypted_only,
    )
}

/// The greeting's flags: the node asks for the secret; it takes only encrypted queue pairs.
const NEEDS_AUTH: u8 = 1;
const ENCRYPTED_ONLY: u8 = 2;

/// The node's side over any stream (the fuzzer's, a socket's). A node that takes only
/// encrypted queue pairs says so in its greeting, so that a peer that would not encrypt
/// learns why before it is refused.
pub fn accept_over(
    s: &mut (impl Read + Write),
    secret: Option<&[u8]>,
    encrypted_only: bool,
) -> io::Result<Option<SessionKey>> {
    let ephemeral = secret.map(|_| Ephemeral::new()).transpose()?;
    // Our nonce and public key: what our MACs and the peer's cover of our side.
    let mut ours = nonce().to_vec();
    ours.extend_from_slice(&ephemeral.as_ref().map_or([0; PUBLIC], |e| e.public));
    let mut greeting = MAGIC.to_vec();
    let flags = if secret.is_some() { NEEDS_AUTH } else { 0 }
        | if encrypted_only { ENCRYPTED_ONLY } else { 0 };
    greeting.push(flags);
    greeting.extend_from_slice(&ours);
    s.write_all(&greeting)?;
    let mut answer = [0u8; NONCE + PUBLIC + MAC];
    s.read_exact(&mut answer)?;
    let (theirs, client_mac) = answer.split_at(NONCE + PUBLIC);
    let mut verdict = vec![0u8; 1 + MAC];
    let ok = match secret {
        None => true,
        Some(k) => mac(k, b"client", &ours, theirs)
            .verify_slice(client_mac)
            .is_ok(),
    };
    if ok {
        verdict[0] = 1;
        if let Some(k) = secret {
            verdict[1..].copy_from_slice(&mac(k, b"server", theirs, &ours).finalize().into_bytes());
        }
    }
    s.write_all(&verdict)?;
    if !ok {
        return Err(denied("peer failed authentication (wrong secret)"));
    }
    match (secret, ephemeral) {
        (Some(k), Some(e)) => {
            let shared = e.agree(&theirs[NONCE..])?;
            Ok(Some(SessionKey::derive(
                k,
                &ours[..NONCE],
                &theirs[..NONCE],
                &shared,
            )))
        }
        _ => Ok(None),
    }
}

/// The connecting side; the node must have answered by `deadline`. The session key, and
/// whether the node takes only encrypted queue pairs.
pub fn connect(
    s: &mut TcpStream,
    secret: Option<&[u8]>,
    deadline: Instant,
) -> io::Result<(Option<SessionKey>, bool)> {
    let key = connect_over(
        &mut DeadlineStream::new(s, deadline, "authentication"),
        secret,
    )?;
    s.set_read_timeout(None)?;
    Ok(key)
}

/// The connecting side over any stream.
pub fn connect_over(
    s: &mut (impl Read + Write),
    secret: Option<&[u8]>,
) -> io::Result<(Option<SessionKey>, bool)> {
    let mut greeting = [0u8; 4 + 1 + NONCE + PUBLIC];
    // The first bytes tell another service at once (an ssh banner, an HTTP error), even one
    // that then closes or says no more: that is no reason to try again.
    let mut got = 0;
    while got < greeting.len() {
        let n = match s.read(&mut greeting[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        got += n;
        let seen = got.min(MAGIC.len());
        if greeting[..seen] != MAGIC[..seen] {
            let why = if seen == MAGIC.len() && greeting[..3] == MAGIC[..3] {
                "the node runs another version of rfs: upgrade the nodes and clients together"
                    .to_string()
            } else {
                let said = String::from_utf8_lossy(&greeting[..got]);
                format!("not an rfs node (it said {said:?})")
            };
            return Err(io::Error::new(io::ErrorKind::InvalidData, why));
        }
    }
    let needs_auth = greeting[4] & NEEDS_AUTH != 0;
    let encrypted_only = greeting[4] & ENCRYPTED_ONLY != 0;
    let theirs = &greeting[5..];
    if !needs_auth && secret.is_some() {
        // Else anyone on the path could pose as the node: nothing after it would be sealed.
        return Err(denied(
            "the node asks for no secret, and we hold one: a node run with --insecure (its \
             peers must hold no secret), or someone on the path posing as the node",
        ));
    }
    if needs_auth && secret.is_none() {
        return Err(denied(
            "the node requires its shared secret: copy the node's secret file to this host \
             (mode 0600; by default /etc/rfs/secret for root, $XDG_CONFIG_HOME/rfs/secret or \
             ~/.config/rfs/secret for others) \
             or pass --secret-file",
        ));
    }
    let secret = secret.filter(|_| needs_auth);
    let ephemeral = secret.map(|_| Ephemeral::new()).transpose()?;
    let mut ours = nonce().to_vec();
    ours.extend_from_slice(&ephemeral.as_ref().map_or([0; PUBLIC], |e| e.public));
    let mut answer = ours.clone();
    match secret {
        Some(k) => {
            answer.extend_from_slice(&mac(k, b"client", theirs, &ours).finalize().into_bytes())
        }
        None => answer.extend_from_slice(&[0u8; MAC]),
    }
    s.write_all(&answer)?;
    let mut verdict = [0u8; 1 + MAC];
    s.read_exact(&mut verdict)?;
    if verdict[0] != 1 {
        return Err(denied("the node refused our secret"));
    }
    match (secret, ephemeral) {
        (Some(k), Some(e)) => {
            mac(k, b"server", &ours, theirs)
                .verify_slice(&verdict[1..])
                .map_err(|_| denied("the node could not prove it knows the secret"))?;
            let shared = e.agree(&theirs[NONCE..])?;
            let key = SessionKey::derive(k, &theirs[..NONCE], &ours[..NONCE], &shared);
            Ok((Some(key), encrypted_only))
        }
        _ => Ok((None, encrypted_only)),
    }
}

/// Connects, authenticates and says what the connection is for: the connection, and its
/// session key (none without a secret).
pub fn dial(
    addr: SocketAddr,
    secret: Option<&[u8]>,
    hello: &Hello,
    timeout: Duration,
) -> io::Result<(TcpStream, Option<SessionKey>)> {
    // One deadline for connecting and authenticating: a stopped node accepts connections
    // (its kernel does) and then says nothing.
    let deadline = Instant::now() + timeout;
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| io::Error::new(e.kind(), format!("connecting to {addr}: {e}")))?;
    s.set_nodelay(true)?;
    let (key, encrypted_only) = connect(&mut s, secret, deadline)?;
    if encrypted_only && matches!(hello, Hello::QueuePair(QueuePair { encrypt: false })) {
        return Err(denied(
            "the node takes only encrypted connections (--encrypt): mount with -o encrypt",
        ));
    }
    send_frame(
        &mut s,
        &integrity::seal(key.as_ref(), integrity::HELLO, 0, hello.encode()),
    )?;
    Ok((s, key))
}

/// The route of the queue pairs of a connection we dialed (whose key is `control`): each
/// dials the node's one port too, authenticated like any connection, says it is a queue pair,
/// and proves it was set up on that control connection; with `encrypt`, everything on it
/// after the queue pair's hello is encrypted with keys of its own.
pub fn queue_pair_route(
    secret: Option<&[u8]>,
    encrypt: bool,
    control: Option<&SessionKey>,
) -> io::Result<QpRoute> {
    if encrypt && secret.is_none() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "encryption needs the shared secret: its keys come from it",
        ));
    }
    let secret: Option<Arc<[u8]>> = secret.map(Arc::from);
    let hello = Hello::QueuePair(QueuePair { encrypt });
    let dialer: rdmabox::transport::Dialer = Arc::new(move |addr, timeout| {
        let (stream, key) = dial(addr, secret.as_deref(), &hello, timeout)?;
        Ok(Authenticated {
            stream,
            keys: key.as_ref().filter(|_| encrypt).map(|k| k.wire_keys(true)),
            channel: key.map(|k| k.channel()),
        })
    });
    Ok(QpRoute::Dial(
        dialer,
        control.map(|k| k.control_binding(true)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    type Keyed = io::Result<Option<SessionKey>>;

    fn run(server: Option<&'static [u8]>, client: Option<&'static [u8]>) -> (Keyed, Keyed) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, server, false, Instant::now() + HANDSHAKE_TIMEOUT)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let cr = connect(&mut c, client, Instant::now() + HANDSHAKE_TIMEOUT).map(|(k, _)| k);
        (t.join().unwrap(), cr)
    }

    #[test]
    fn matching_secrets_pass_both_ways_with_one_new_key_each_time() {
        let (s, c) = run(Some(b"k1"), Some(b"k1"));
        let (s, c) = (s.unwrap().unwrap(), c.unwrap().unwrap());
        assert_eq!(s.0, c.0, "both ends derive the same key");
        let (again, _) = run(Some(b"k1"), Some(b"k1"));
        assert_ne!(again.unwrap().unwrap().0, s.0, "fresh nonces, a fresh key");
    }

    /// A holder of the secret who recorded a handshake (both nonces, both public keys, both
    /// MACs) cannot derive its key from them: it also takes what the ephemeral keys agree on.
    /// And a public key swapped on the path fails the MACs (both ends refuse).
    #[test]
    fn the_key_is_not_derived_from_what_crosses_the_wire() {
        use std::io::{Read, Write};
        for tamper in [false, true] {
            let node = TcpListener::bind("127.0.0.1:0").unwrap();
            let node_addr = node.local_addr().unwrap();
            let t = std::thread::spawn(move || {
                let (mut s, _) = node.accept().unwrap();
                accept(
                    &mut s,
                    Some(b"k"),
                    false,
                    Instant::now() + HANDSHAKE_TIMEOUT,
                )
            });
            // A relay that records both directions, and may alter the node's public key.
            let relay = TcpListener::bind("127.0.0.1:0").unwrap();
            let relay_addr = relay.local_addr().unwrap();
            let recorder = std::thread::spawn(move || {
                let (mut c, _) = relay.accept().unwrap();
                let mut n = TcpStream::connect(node_addr).unwrap();
                let mut greeting = [0u8; 5 + NONCE + PUBLIC];
                n.read_exact(&mut greeting).unwrap();
                if tamper {
                    greeting[5 + NONCE] ^= 1;
                }
                c.write_all(&greeting).unwrap();
                let mut answer = [0u8; NONCE + PUBLIC + MAC];
                c.read_exact(&mut answer).unwrap();
                n.write_all(&answer).unwrap();
                let mut verdict = [0u8; 1 + MAC];
                let _ = n.read_exact(&mut verdict);
                let _ = c.write_all(&verdict);
                (greeting, answer)
            });
            let mut c = TcpStream::connect(relay_addr).unwrap();
            let client = connect(&mut c, Some(b"k"), Instant::now() + HANDSHAKE_TIMEOUT);
            let node_side = t.join().unwrap();
            let (greeting, answer) = recorder.join().unwrap();
            if tamper {
                assert!(
                    node_side.is_err() && client.is_err(),
                    "a swapped key is refused"
                );
                continue;
            }
            let key = client.unwrap().0.unwrap();
            assert_eq!(node_side.unwrap().unwrap().0, key.0);
            let (server_nonce, client_nonce) = (&greeting[5..5 + NONCE], &answer[..NONCE]);
            let (server_public, client_public) =
                (&greeting[5 + NONCE..], &answer[NONCE..NONCE + PUBLIC]);
            for guess in [&[][..], server_public, client_public] {
                let k = SessionKey::derive(b"k", server_nonce, client_nonce, guess);
                assert_ne!(k.0, key.0, "derived from the transcript");
            }
        }
    }

    #[test]
    fn a_wrong_secret_is_refused() {
        let (s, c) = run(Some(b"k1"), Some(b"k2"));
        assert!(s.is_err() && c.is_err());
    }

    #[test]
    fn a_client_without_the_secret_is_told_what_to_do() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(
                &mut s,
                Some(b"k"),
                false,
                Instant::now() + HANDSHAKE_TIMEOUT,
            )
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let e = connect(&mut c, None, Instant::now() + HANDSHAKE_TIMEOUT).unwrap_err();
        assert!(e.to_string().contains("--secret-file"));
        drop(c);
        assert!(t.join().unwrap().is_err());
    }

    #[test]
    fn a_peer_holding_a_secret_refuses_a_node_that_asks_for_none() {
        let (_, c) = run(None, Some(b"k1"));
        let e = c.unwrap_err();
        assert!(e.to_string().contains("posing as the node"), "{e}");
    }

    /// A node that takes only encrypted queue pairs says so, and a peer dialing a queue pair
    /// it would not encrypt is told what to do instead of being cut off.
    #[test]
    fn a_node_taking_only_encrypted_queue_pairs_says_so() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = l.accept().unwrap();
                let _ = accept(&mut s, Some(b"k"), true, Instant::now() + HANDSHAKE_TIMEOUT);
            }
        });
        let clear = Hello::QueuePair(QueuePair { encrypt: false });
        let e = dial(addr, Some(b"k"), &clear, HANDSHAKE_TIMEOUT).unwrap_err();
        assert!(e.to_string().contains("-o encrypt"), "{e}");
        let sealed = Hello::QueuePair(QueuePair { encrypt: true });
        assert!(dial(addr, Some(b"k"), &sealed, HANDSHAKE_TIMEOUT).is_ok());
    }

    #[test]
    fn no_secret_on_either_side_passes_without_a_key() {
        let (s, c) = run(None, None);
        assert!(s.unwrap().is_none() && c.unwrap().is_none());
    }
}
