//! Grants: which chunks of a data node's pool one client's data session may reach. A data
//! session starts with no reach at all; the metadata node, which checked the opens, tells the
//! data node over the node's join connection (the grant channel) what each session may touch, and
//! takes it back when the file is closed, cut, unlinked, or its client goes. The data node
//! answers a grant with the remote key the client then uses; a revoked key fails with a
//! remote access error.
//!
//! A grant decided before a chunk was freed must not land after the free was revoked: every
//! free gets a sequence number, revocations carry it, and a grant decided before it (with an
//! older number) is refused for that chunk.

use crate::errno::Errno;
use crate::message::encode_reply;
use crate::wire::{bad, DecodeError, Reader, Wire, MAX_LIST};
use crate::{wire_enum, wire_struct};

/// The largest grant-channel frame: a list of MAX_LIST extents and a little more.
pub const MAX_GRANT_FRAME: usize = 64 + 12 * MAX_LIST as usize;

wire_struct! {
    /// Lets data session `session` reach the copies at `extents` (address, length: read, and
    /// write if `writable`), decided when the latest free was number `seq`. The reply holds
    /// one remote key per extent; 0 where it was refused (freed since, not in the pool, or no
    /// such session).
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct GrantChunks {
        pub session: u64,
        pub seq: u64,
        pub writable: bool,
        pub extents: Vec<(u64, u32)>,
    }
}

wire_struct! {
    /// Takes back what data session `session` was granted on the copies starting at `addrs`
    /// (whatever their length): only the writable grants if `writable_only` (its last
    /// writable handle closed).
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct RevokeChunks { pub session: u64, pub writable_only: bool, pub addrs: Vec<u64> }
}

wire_struct! {
    /// The `extents` (address, length) were freed by free number `seq`: every session's
    /// grants that reach into them go, and grants decided before `seq` of anything in the
    /// same chunks of the pool are refused from now on.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct RevokeFreed { pub seq: u64, pub extents: Vec<(u64, u32)> }
}

wire_struct! {
    /// The client behind data session `session` is gone: all its grants go.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct RevokeSession { pub session: u64 }
}

wire_struct! {
    /// The whole pool, readable and writable, for the metadata node's own session (it zeroes
    /// freed chunks); the reply is the remote key.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct GrantPool { pub session: u64 }
}

wire_enum! {
    /// What the metadata node asks of a data node over the grant channel.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum GrantRequest / GrantOp {
        1 => GrantChunks,
        2 => RevokeChunks,
        3 => RevokeFreed,
        4 => RevokeSession,
        5 => GrantPool,
    }
}

impl GrantRequest {
    /// The answer to this request in `b`: one remote key per granted address (none for a
    /// revocation), or why it failed.
    pub fn decode_answer(&self, b: &[u8]) -> Result<Result<Vec<u32>, Errno>, DecodeError> {
        decode_grant_reply(self.op(), b)
    }
}

/// Encodes the answer to a grant request of kind `op`.
pub fn encode_grant_reply(op: GrantOp, result: &Result<Vec<u32>, Errno>) -> Vec<u8> {
    encode_reply(op as u8, result)
}

fn decode_grant_reply(op: GrantOp, b: &[u8]) -> Result<Result<Vec<u32>, Errno>, DecodeError> {
    let mut r = Reader::new(b);
    let got = r.header()?;
    if got != op as u8 {
        return bad(format!("a grant reply to op {got} for a {op:?} request"));
    }
    let result = match u8::get(&mut r)? {
        0 => Ok(Vec::<u32>::get(&mut r)?),
        1 => Err(Errno::get(&mut r)?),
        s => return bad(format!("bad grant reply status {s}")),
    };
    r.finish()?;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_requests_and_replies_round_trip_and_garbage_is_refused() {
        let requests: Vec<GrantRequest> = vec![
            GrantChunks {
                session: 1,
                seq: 2,
                writable: true,
                extents: vec![(3 << 12, 4096), (4 << 12, 8192)],
            }
            .into(),
            RevokeChunks {
                session: 1,
                writable_only: true,
                addrs: vec![3],
            }
            .into(),
            RevokeFreed {
                seq: 9,
                extents: vec![],
            }
            .into(),
            RevokeSession { session: 7 }.into(),
            GrantPool { session: 7 }.into(),
        ];
        for m in requests {
            let b = m.encode();
            assert_eq!(GrantRequest::decode(&b).unwrap(), m);
            for cut in 0..b.len() {
                assert!(GrantRequest::decode(&b[..cut]).is_err());
            }
            for result in [Ok(vec![5, 0, 6]), Err(Errno::EIO)] {
                let reply = encode_grant_reply(m.op(), &result);
                assert_eq!(decode_grant_reply(m.op(), &reply).unwrap(), result);
            }
        }
        let reply = encode_grant_reply(GrantOp::GrantPool, &Ok(vec![1]));
        assert!(decode_grant_reply(GrantOp::GrantChunks, &reply).is_err());
        let too_many = GrantChunks {
            session: 1,
            seq: 0,
            writable: false,
            extents: vec![(0, 0); MAX_LIST as usize + 1],
        };
        assert!(GrantRequest::decode(&GrantRequest::from(too_many).encode()).is_err());
    }

    #[test]
    fn the_largest_request_fits_a_link_frame() {
        let m: GrantRequest = GrantChunks {
            session: 1,
            seq: 2,
            writable: true,
            extents: vec![(u64::MAX, u32::MAX); MAX_LIST as usize],
        }
        .into();
        assert!(m.encode().len() <= MAX_GRANT_FRAME);
    }
}
