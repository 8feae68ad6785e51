//! What a connection is for, said right after authentication on the control connection, and
//! the pool descriptor a data node answers a data session with.

use std::io::{self, Read};

use crate::frame::recv_frame;
use crate::integrity;
use crate::session_key::SessionKey;
use crate::wire::{bad, DecodeError, Reader, Wire, Writer};
use crate::{wire_enum, wire_struct};

/// The most queue pairs a data session may ask for.
pub const MAX_QPS: u32 = 64;
/// A metadata node's answer to a join of a pool that is not fresh and that it does not know:
/// the joiner wipes its pool and joins as a new node.
pub const UNKNOWN_POOL: &[u8] = b"unknown pool";
/// The largest hello a node reads.
const MAX_HELLO: usize = 4096;

wire_struct! {
    /// A client's metadata channel: calls on one queue pair, callbacks on a second. The
    /// client's id names its session, which outlives a lost connection for a grace period: a
    /// client that reconnects with the same id finds its handles, and the replies to calls it
    /// may resend.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Metadata { pub client_id: u64 }
}

wire_struct! {
    /// A client's data session: `qps` queue pairs, then the pool descriptor.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Data { pub qps: u32 }
}

wire_struct! {
    /// A data node joining the metadata node, describing the pool it lends.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct Join {
        /// host:port where clients reach the joining node.
        pub addr: String,
        pub pool_addr: u64,
        pub pool_len: u64,
        pub chunk_size: u64,
        /// Names the pool's contents: a node that joins again after losing its metadata node
        /// names the same pool, and a metadata node restarted from its journal knows it.
        pub pool_id: u64,
        /// Whether the pool is all zeros (never lent, or wiped): a pool that is not must be
        /// one the metadata node knows, or the join is refused with [`UNKNOWN_POOL`].
        pub fresh: bool,
    }
}

wire_struct! {
    /// One queue pair of a session set up on another connection (the tcp provider's hello,
    /// naming it by token, follows): every connection of a node comes to its one port.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct QueuePair {
        /// Everything after the queue pair's hello is encrypted, with keys derived from this
        /// connection's session key.
        pub encrypt: bool,
    }
}

wire_enum! {
    /// The first message on a connection.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Hello / HelloOp {
        1 => Metadata,
        2 => Data,
        3 => Join,
        4 => QueuePair,
    }
}

impl Hello {
    /// Decodes and checks a hello: all of it, and within the limits a node accepts.
    pub fn parse(b: &[u8]) -> Result<Hello, DecodeError> {
        let h = Hello::decode(b)?;
        if let Hello::Data(Data { qps }) = h {
            if !(1..=MAX_QPS).contains(&qps) {
                return bad(format!("queue pairs must be 1..={MAX_QPS}"));
            }
        }
        Ok(h)
    }

    /// Reads the peer's hello from the control connection.
    /// The hello on `s`, sealed with the connection's session `key` (what it says decides
    /// which session, node or pool the connection is for).
    pub fn receive(s: &mut impl Read, key: Option<&SessionKey>) -> io::Result<Hello> {
        let frame = recv_frame(s, MAX_HELLO + integrity::TAG)?;
        let hello = integrity::open(key, integrity::HELLO, 0, &frame).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                "a hello without the session's MAC",
            )
        })?;
        Hello::parse(hello).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

wire_struct! {
    /// The pool a data node lends (its address and length), and the data session's name,
    /// by which the metadata node grants it chunks ([`crate::grant`]). A session reaches
    /// nothing until granted, so the name is no key: it only says where grants go.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct PoolDescriptor { pub addr: u64, pub len: u64, pub session: u64 }
}

const POOL_OP: u8 = 1;

impl PoolDescriptor {
    /// Version, op, fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::message(POOL_OP);
        self.put(&mut w);
        w.0
    }

    /// The descriptor in `b`, all of `b`.
    pub fn decode(b: &[u8]) -> Result<PoolDescriptor, DecodeError> {
        let mut r = Reader::new(b);
        if r.header()? != POOL_OP {
            return bad("not a pool descriptor");
        }
        let p = PoolDescriptor::get(&mut r)?;
        r.finish()?;
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_and_pools_round_trip() {
        for h in [
            Hello::Metadata(Metadata { client_id: 1 }),
            Hello::Data(Data { qps: 4 }),
            Hello::Join(Join {
                addr: "h:1".into(),
                pool_addr: 1,
                pool_len: 2,
                chunk_size: 4,
                pool_id: u64::MAX,
                fresh: true,
            }),
        ] {
            assert_eq!(Hello::parse(&h.encode()).unwrap(), h);
        }
        let p = PoolDescriptor {
            addr: 1,
            len: 2,
            session: 3,
        };
        assert_eq!(PoolDescriptor::decode(&p.encode()).unwrap(), p);
        assert!(
            PoolDescriptor::decode(&Hello::Metadata(Metadata { client_id: 1 }).encode()).is_err()
        );
    }

    #[test]
    fn queue_pair_counts_are_bounded() {
        for qps in [0, MAX_QPS + 1, u32::MAX] {
            assert!(Hello::parse(&Hello::Data(Data { qps }).encode()).is_err());
        }
        assert!(Hello::parse(&Hello::Data(Data { qps: MAX_QPS }).encode()).is_ok());
    }
}
