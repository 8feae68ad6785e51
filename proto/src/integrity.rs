//! Frames no one on the path can forge, alter or move: each carries a MAC by the connection's
//! [`SessionKey`] over a label (what it is: a call, a reply, a callback, an answer to one), a
//! number binding it to its place (a call's sequence number; an answer, to what it answers),
//! and its bytes. Without a key (a node run with `--insecure`) the MAC is zeros and unchecked.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::handshake::SessionKey;

/// Bytes of MAC at the end of each frame.
pub const TAG: usize = 16;

/// A metadata call, bound to its sequence number.
pub const CALL: &[u8] = b"call";
/// The reply to the call with the same sequence number.
pub const REPLY: &[u8] = b"reply";
/// A callback of the metadata service.
pub const CALLBACK: &[u8] = b"callback";
/// The answer to the callback whose MAC starts with the number.
pub const ANSWER: &[u8] = b"answer";
/// A data node's pool descriptor, which names the data session.
pub const POOL: &[u8] = b"pool";
/// The metadata node's request to a data node (grants, revocations), numbered in turn.
pub const LINK: &[u8] = b"link";
/// The data node's answer to the request with the same number.
pub const LINK_ANSWER: &[u8] = b"link answer";

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

/// The number an answer to `frame` (a sealed frame) is bound to: the start of its MAC.
pub fn number_of(frame: &[u8]) -> u64 {
    let at = frame.len().saturating_sub(TAG);
    frame
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
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
        assert_ne!(number_of(&frame), 0);
    }
}
