//! Frames no one on the path can forge, alter or move: each carries a MAC by the connection's
//! [`SessionKey`] over a label (what it is: a call, a reply, a callback, an answer to one), a
//! number binding it to its place (a call's sequence number; an answer, to what it answers),
//! and its bytes. Without a key (a node run with `--insecure`) the MAC is zeros and unchecked.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::session_key::SessionKey;

/// Bytes of MAC at the end of each frame.
pub const TAG: usize = 16;

/// What a connection is for, right after the handshake.
pub const HELLO: &[u8] = b"hello";
/// The metadata node's answer to a join.
pub const JOIN_ANSWER: &[u8] = b"join answer";
/// A metadata call, bound to its sequence number.
pub const CALL: &[u8] = b"call";
/// The reply to the call with the same sequence number.
pub const REPLY: &[u8] = b"reply";
/// A callback of the metadata service, numbered in turn on its connection.
pub const CALLBACK: &[u8] = b"callback";
/// The answer to the callback with the same number.
pub const ANSWER: &[u8] = b"answer";
/// A data node's pool descriptor, which names the data session.
pub const POOL: &[u8] = b"pool";
/// The metadata node's request to a data node (grants, revocations), numbered in turn.
pub const GRANT_CALL: &[u8] = b"link";
/// The data node's answer to the request with the same number.
pub const GRANT_ANSWER: &[u8] = b"link answer";

fn tag(key: &SessionKey, label: &[u8], number: u64, body: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(&key.0).expect("HMAC takes any key length");
    m.update(&(label.len() as u32).to_le_bytes());
    m.update(label);
    m.update(&number.to_le_bytes());
    m.update(body);
    m
}

/// `body` with its MAC appended.
pub fn seal(key: Option<&SessionKey>, label: &[u8], number: u64, mut body: Vec<u8>) -> Vec<u8> {
    let mac = match key {
        Some(k) => {
            let full = tag(k, label, number, &body).finalize().into_bytes();
            let mut t = [0u8; TAG];
            t.copy_from_slice(&full[..TAG]);
            t
        }
        None => [0u8; TAG],
    };
    body.extend_from_slice(&mac);
    body
}

/// The body of `frame` if its MAC is right for `label` and `number`.
pub fn open<'a>(
    key: Option<&SessionKey>,
    label: &[u8],
    number: u64,
    frame: &'a [u8],
) -> Option<&'a [u8]> {
    let at = frame.len().checked_sub(TAG)?;
    let (body, mac) = frame.split_at(at);
    match key {
        Some(k) => tag(k, label, number, body)
            .verify_truncated_left(mac)
            .ok()
            .map(|()| body),
        None => Some(body),
    }
}

/// `body` after its `number` (which the receiver cannot know otherwise), sealed with it.
pub fn seal_numbered(
    key: Option<&SessionKey>,
    label: &[u8],
    number: u64,
    body: Vec<u8>,
) -> Vec<u8> {
    let mut numbered = number.to_le_bytes().to_vec();
    numbered.extend_from_slice(&body);
    seal(key, label, number, numbered)
}

/// The number and the body of a frame made by [`seal_numbered`], if its MAC is right: the
/// caller checks that the number is one it expects (above the last, say).
pub fn open_numbered<'a>(
    key: Option<&SessionKey>,
    label: &[u8],
    frame: &'a [u8],
) -> Option<(u64, &'a [u8])> {
    let number = u64::from_le_bytes(frame.get(..8)?.try_into().ok()?);
    let numbered = open(key, label, number, frame)?;
    Some((number, &numbered[8..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> SessionKey {
        SessionKey([b; 32])
    }

    #[test]
    fn a_frame_opens_only_with_its_key_label_and_number() {
        let k = key(1);
        let frame = seal(Some(&k), CALL, 7, b"chmod 0666".to_vec());
        assert_eq!(open(Some(&k), CALL, 7, &frame), Some(&b"chmod 0666"[..]));
        assert!(
            open(Some(&key(2)), CALL, 7, &frame).is_none(),
            "another key"
        );
        assert!(open(Some(&k), REPLY, 7, &frame).is_none(), "another label");
        assert!(open(Some(&k), CALL, 8, &frame).is_none(), "another number");
        for i in 0..frame.len() {
            let mut bad = frame.clone();
            bad[i] ^= 0x40;
            assert!(
                open(Some(&k), CALL, 7, &bad).is_none(),
                "a bit flipped at {i}"
            );
        }
        assert!(open(Some(&k), CALL, 7, &frame[1..]).is_none());
        assert!(
            open(Some(&k), CALL, 7, &[0; 3]).is_none(),
            "shorter than a MAC"
        );
        // Without a key nothing is checked: the node said so at the handshake.
        let plain = seal(None, CALL, 7, b"x".to_vec());
        assert_eq!(open(None, CALL, 9, &plain), Some(&b"x"[..]));
        // A numbered frame carries its number, and opens only with it.
        let numbered = seal_numbered(Some(&k), CALLBACK, 42, b"cb".to_vec());
        assert_eq!(
            open_numbered(Some(&k), CALLBACK, &numbered),
            Some((42, &b"cb"[..]))
        );
        let mut renumbered = numbered.clone();
        renumbered[0] = 43;
        assert!(open_numbered(Some(&k), CALLBACK, &renumbered).is_none());
        assert!(open_numbered(Some(&k), CALLBACK, &numbered[..7]).is_none());
    }
}
