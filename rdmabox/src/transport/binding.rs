//! Ties the queue pairs set up on an authenticated control connection to that connection.
//!
//! The control connection's handshake gives both ends a key nobody else holds. A key derived
//! from it MACs the endpoint exchange (so a relay cannot swap a queue pair's number, address or
//! token for its own) and, on tcp, each queue pair's own connection proves with it that it
//! comes from the control connection's peer: its hello carries a MAC over the two tokens and
//! over a value only the two ends of *that* queue-pair connection know (from its own
//! handshake). So a token seen on the path is of no use to another peer, even one holding the
//! cluster's secret, and a proof seen on the path is of no use on another connection.

use std::sync::Arc;

use ring::hmac;

/// Bytes of a proof (HMAC-SHA256).
pub(crate) const PROOF_LEN: usize = 32;

/// The binding key of one control connection, as one of its two ends holds it.
#[derive(Clone)]
pub struct ControlBinding {
    /// Shared: every queue pair of the connection holds it while it waits.
    key: Arc<hmac::Key>,
    dialer: bool,
}

impl std::fmt::Debug for ControlBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlBinding")
            .field("dialer", &self.dialer)
            .finish_non_exhaustive()
    }
}

impl ControlBinding {
    /// `key`: derived from the control connection's session key (never that key itself);
    /// `dialer`: whether we dialed the control connection. Each side's proofs name its role,
    /// so a proof reflected back to its sender is refused.
    pub fn new(key: [u8; 32], dialer: bool) -> ControlBinding {
        ControlBinding {
            key: Arc::new(hmac::Key::new(hmac::HMAC_SHA256, &key)),
            dialer,
        }
    }

    /// Our proof of `parts`, for what `what` names.
    pub(crate) fn prove(&self, what: &[u8], parts: &[&[u8]]) -> [u8; PROOF_LEN] {
        let tag = hmac::sign(&self.key, &message(self.role(), what, parts));
        tag.as_ref().try_into().expect("HMAC-SHA256 is 32 bytes")
    }

    /// Whether `proof` is the peer's proof of `parts` (compared in constant time).
    pub(crate) fn verify(&self, what: &[u8], parts: &[&[u8]], proof: &[u8]) -> bool {
        let peer: &[u8] = if self.dialer { b"node" } else { b"dialer" };
        hmac::verify(&self.key, &message(peer, what, parts), proof).is_ok()
    }

    fn role(&self) -> &'static [u8] {
        if self.dialer {
            b"dialer"
        } else {
            b"node"
        }
    }
}

/// Role, purpose and parts, each length-prefixed so that no two lists read the same.
fn message(role: &[u8], what: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut m = Vec::new();
    for p in [role, what].into_iter().chain(parts.iter().copied()) {
        m.extend_from_slice(&(p.len() as u32).to_le_bytes());
        m.extend_from_slice(p);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_for_the_peer_only_and_for_its_parts_only() {
        let (dialer, node) = (
            ControlBinding::new([9; 32], true),
            ControlBinding::new([9; 32], false),
        );
        let proof = dialer.prove(b"queue pair", &[b"ab", b"c"]);
        assert!(node.verify(b"queue pair", &[b"ab", b"c"], &proof));
        assert!(
            !dialer.verify(b"queue pair", &[b"ab", b"c"], &proof),
            "reflected"
        );
        assert!(
            !node.verify(b"queue pair", &[b"a", b"bc"], &proof),
            "parts moved"
        );
        assert!(
            !node.verify(b"endpoints", &[b"ab", b"c"], &proof),
            "other purpose"
        );
        let other = ControlBinding::new([8; 32], false);
        assert!(
            !other.verify(b"queue pair", &[b"ab", b"c"], &proof),
            "other key"
        );
    }
}
