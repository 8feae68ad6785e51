//! The key both ends of an authenticated connection derive in the handshake
//! ([`crate::handshake`]), and what is derived from it: the MACs of what crosses the
//! connection ([`crate::integrity`]) and the keys that encrypt a queue pair's connection.

use hmac::{Hmac, Mac};
use rdmabox::transport::{ControlBinding, WireKeys};
use sha2::Sha256;

/// Bytes of a key and of a MAC (HMAC-SHA256).
pub(crate) const MAC: usize = 32;

pub(crate) fn mac(secret: &[u8], role: &[u8], a: &[u8], b: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(role);
    m.update(a);
    m.update(b);
    m
}

/// A key both ends of an authenticated connection derive from the secret, both nonces and
/// their ephemeral keys' agreement: one per connection, never sent.
#[derive(Clone)]
pub struct SessionKey(pub(crate) [u8; MAC]);

impl SessionKey {
    /// From the secret, both nonces and the secret both ends' ephemeral keys agree on
    /// (`shared`): someone who holds the secret and saw the handshake still cannot derive it.
    pub(crate) fn derive(
        secret: &[u8],
        server_nonce: &[u8],
        client_nonce: &[u8],
        shared: &[u8],
    ) -> SessionKey {
        let mut m = mac(secret, b"session", server_nonce, client_nonce);
        m.update(shared);
        SessionKey(m.finalize().into_bytes().into())
    }

    /// What ties the queue pairs set up on the connection of this key to it, as the side that
    /// dialed it (`dialer`) or the node holds it.
    pub fn control_binding(&self, dialer: bool) -> ControlBinding {
        ControlBinding::new(self.derived(b"queue pairs of this connection"), dialer)
    }

    /// The value only the two ends of this key's connection know, which a queue pair's hello
    /// on it proves with its control connection's binding (never the key itself).
    pub fn channel(&self) -> [u8; MAC] {
        self.derived(b"channel")
    }

    fn derived(&self, what: &[u8]) -> [u8; MAC] {
        mac(&self.0, what, &[], &[]).finalize().into_bytes().into()
    }

    /// The keys that encrypt a queue pair's connection authenticated with this key, as the
    /// side that dialed it (`dialer`) or the node sees them: one key each way.
    pub fn wire_keys(&self, dialer: bool) -> WireKeys {
        let key = |direction: &[u8]| -> [u8; 32] {
            mac(&self.0, b"wire", direction, &[])
                .finalize()
                .into_bytes()
                .into()
        };
        let (up, down) = (key(b"dialer to node"), key(b"node to dialer"));
        if dialer {
            WireKeys {
                send: up,
                receive: down,
            }
        } else {
            WireKeys {
                send: down,
                receive: up,
            }
        }
    }
}

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}
