//! Length-prefixed frames on a control connection (hello, pool descriptor, join verdict): a
//! little-endian u32 length, then the body. A frame over the receiver's limit is refused before
//! anything is allocated.

use std::io::{self, Read, Write};

/// Sends one frame.
pub fn send_frame(s: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut b = (body.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(body);
    s.write_all(&b)
}

/// Receives one frame of at most `max` bytes.
pub fn recv_frame(s: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n) as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes over {max}"),
        ));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let mut wire = Vec::new();
        send_frame(&mut wire, b"hello").unwrap();
        assert_eq!(recv_frame(&mut wire.as_slice(), 5).unwrap(), b"hello");
        let e = recv_frame(&mut wire.as_slice(), 4).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(recv_frame(&mut &wire[..6], 5).is_err(), "truncated body");
    }
}
