//! The tcp provider's frames: a fixed 32-byte header, then the payload for the kinds that carry
//! one. Requests flow from a requester to the peer's engine; responses (ACK, NAK, READ response)
//! flow back on the same connection, in request order.

/// Header size on the wire.
pub const HEADER_LEN: usize = 32;
/// The largest message RC allows (2^31), so a hostile length cannot make us allocate or wait
/// for more.
pub const MAX_MESSAGE: u32 = 1 << 31;

/// What a frame is; the first header byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Request: write the payload at `remote_addr` under `rkey`.
    Write = 1,
    /// Request: a write that also consumes a receive and delivers `imm`.
    WriteWithImm = 2,
    /// Request: send back `len` bytes from `remote_addr` under `rkey`.
    ReadRequest = 3,
    /// Request: deliver the payload into the next posted receive.
    Send = 4,
    /// Request: a send that also delivers `imm`.
    SendWithImm = 5,
    /// Response: the request with this PSN was carried out.
    Ack = 6,
    /// Response: the request with this PSN was refused; `imm` holds the [`NakReason`].
    Nak = 7,
    /// Response: the data a READ asked for.
    ReadResponse = 8,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Write,
            2 => Kind::WriteWithImm,
            3 => Kind::ReadRequest,
            4 => Kind::Send,
            5 => Kind::SendWithImm,
            6 => Kind::Ack,
            7 => Kind::Nak,
            8 => Kind::ReadResponse,
            _ => return None,
        })
    }
    /// Whether `len` payload bytes follow the header.
    pub fn carries_payload(self) -> bool {
        matches!(
            self,
            Kind::Write | Kind::WriteWithImm | Kind::Send | Kind::SendWithImm | Kind::ReadResponse
        )
    }
}

/// Why a responder refused a request (carried by NAK in `imm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum NakReason {
    /// Bad rkey, range outside the region, or rights missing.
    RemoteAccess = 1,
    /// A request the responder does not accept.
    InvalidRequest = 2,
    /// No receive was posted within the RNR window.
    ReceiverNotReady = 3,
    /// The responder could not carry it out (a SEND longer than the receive buffer).
    RemoteOperation = 4,
}

impl NakReason {
    /// The reason a NAK's `imm` carries, or `None` for an unknown value.
    pub fn from_u32(v: u32) -> Option<NakReason> {
        Some(match v {
            1 => NakReason::RemoteAccess,
            2 => NakReason::InvalidRequest,
            3 => NakReason::ReceiverNotReady,
            4 => NakReason::RemoteOperation,
            _ => return None,
        })
    }

    /// How the refused request completes at its requester.
    pub fn status(self) -> crate::transport::types::WcStatus {
        use crate::transport::types::WcStatus;
        match self {
            NakReason::RemoteAccess => WcStatus::RemoteAccessError,
            NakReason::InvalidRequest => WcStatus::RemoteInvalidRequest,
            NakReason::ReceiverNotReady => WcStatus::RnrRetryExceeded,
            NakReason::RemoteOperation => WcStatus::RemoteOperationError,
        }
    }
}

/// A frame header, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// Sequence number of the request (a response carries its request's).
    pub psn: u32,
    /// Target address of a WRITE or READ in the responder's memory.
    pub remote_addr: u64,
    /// Key of the responder's region for a WRITE or READ.
    pub rkey: u32,
    /// Payload length, or the length a READ asks for.
    pub len: u32,
    /// Immediate data, or the NAK reason.
    pub imm: u32,
}

impl Header {
    /// A header of `kind` and `psn` with every other field zero.
    pub fn new(kind: Kind, psn: u32) -> Header {
        Header {
            kind,
            psn,
            remote_addr: 0,
            rkey: 0,
            len: 0,
            imm: 0,
        }
    }

    /// The 32 wire bytes, little-endian, reserved bytes zero.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind as u8;
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..16].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b[20..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.imm.to_le_bytes());
        b
    }

    /// Parses and validates a header; a bad one is a protocol violation by the peer.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let kind = Kind::from_u8(b[0]).ok_or_else(|| format!("unknown frame kind {}", b[0]))?;
        if b[1..4] != [0, 0, 0] || b[28..32] != [0, 0, 0, 0] {
            return Err("reserved header bytes set".into());
        }
        let h = Header {
            kind,
            psn: u32_at(4),
            remote_addr: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            rkey: u32_at(16),
            len: u32_at(20),
            imm: u32_at(24),
        };
        if h.len > MAX_MESSAGE {
            return Err(format!("frame length {} over the 2^31 limit", h.len));
        }
        if matches!(kind, Kind::Ack | Kind::Nak) && h.len != 0 {
            return Err(format!("{kind:?} with a length"));
        }
        if kind == Kind::Nak && NakReason::from_u32(h.imm).is_none() {
            return Err(format!("NAK with unknown reason {}", h.imm));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            kind: Kind::WriteWithImm,
            psn: 0xdead_beef,
            remote_addr: 0x1234_5678_9abc,
            rkey: 77,
            len: 4096,
            imm: 9,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn garbage_is_rejected() {
        let mut b = Header::new(Kind::Write, 1).encode();
        b[0] = 99;
        assert!(Header::decode(&b).is_err());
        let mut b = Header::new(Kind::Write, 1).encode();
        b[2] = 1;
        assert!(Header::decode(&b).is_err());
        let mut h = Header::new(Kind::Write, 1);
        h.len = MAX_MESSAGE + 1;
        assert!(Header::decode(&h.encode()).is_err());
        let mut h = Header::new(Kind::Nak, 1);
        h.imm = 42;
        assert!(Header::decode(&h.encode()).is_err());
        let mut h = Header::new(Kind::Ack, 1);
        h.len = 5;
        assert!(Header::decode(&h.encode()).is_err());
    }
}
