//! Callbacks: the metadata service telling a client that something it caches changed under
//! it, on the second queue pair of the metadata connection (the service calls, the client
//! answers). A client answers a callback once it no longer uses the chunk references it names
//! (every transfer through them has completed) and has handed the rest to its kernel caches;
//! chunks freed by truncate, unlink or trimming are reused only after every holder answered,
//! or its lease ran out.

use rdmabox::rpc::RpcConfig;

use crate::types::{Attr, Ino, Name};
use crate::wire::{bad, DecodeError, Reader, Wire, Writer, MAX_LIST};
use crate::wire_struct;

wire_struct! {
    /// What changed of one inode.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Invalidation {
        pub ino: Ino,
        /// The file's chunks from this index on are no longer its own (truncated, trimmed or
        /// freed): drop their references and finish the transfers through them first. Set
        /// with every size cut, with `data`, so holders also cut the sizes they keep; without
        /// `data`, only chunks past the size went back (allocated ahead, trimmed at the last
        /// close) and nothing of the file changed.
        pub chunks_from: Option<u64>,
        /// The attributes now; None: the inode is gone.
        pub attr: Option<Attr>,
        /// The contents changed (a commit or a truncate): cached pages go too.
        pub data: bool,
        /// The file's chunk map changed (a replica was dropped or added): drop every
        /// reference and finish the transfers through them; sizes and contents are as they were.
        pub remapped: bool,
    }
}

wire_struct! {
    /// A name in a directory that no longer leads where it did (removed, renamed, replaced).
    #[derive(Clone, Debug, PartialEq)]
    pub struct EntryChange { pub parent: Ino, pub name: Name }
}

wire_struct! {
    /// One callback: any number of changes, answered together.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct Callback {
        pub inodes: Vec<Invalidation>,
        pub entries: Vec<EntryChange>,
        /// Files a lock of went, which the session waits to take one of: ask again now.
        pub locks_freed: Vec<Ino>,
    }
}

const CALLBACK: u8 = 1;
const ACK: u8 = 2;

/// The callback channel's sizing, the same on both sides; its deadline is the service's lease.
pub const CALLBACK_RPC: RpcConfig = RpcConfig {
    slots: 4,
    max_msg: 64 << 10,
    timeout: std::time::Duration::from_secs(10),
};

/// Changes per callback message: a list's limit, and a byte budget that names up to NAME_MAX
/// cannot overrun.
const BUDGET: usize = CALLBACK_RPC.max_msg / 2;

impl Callback {
    /// Whether there is nothing to say.
    pub fn is_empty(&self) -> bool {
        self.inodes.is_empty() && self.entries.is_empty() && self.locks_freed.is_empty()
    }

    /// Whether `other` still fits into this message.
    pub fn has_room_for(&self, other: &Callback) -> bool {
        self.inodes.len() + other.inodes.len() <= MAX_LIST as usize
            && self.entries.len() + other.entries.len() <= MAX_LIST as usize
            && self.locks_freed.len() + other.locks_freed.len() <= MAX_LIST as usize
            && self.wire_len() + other.wire_len() <= BUDGET
    }

    /// This callback in messages that each fit (a session that ends may free hundreds of
    /// files at once).
    pub fn split(self) -> Vec<Callback> {
        let mut parts = vec![Callback::default()];
        let pieces = self
            .inodes
            .into_iter()
            .map(|i| Callback {
                inodes: vec![i],
                ..Callback::default()
            })
            .chain(self.entries.into_iter().map(|e| Callback {
                entries: vec![e],
                ..Callback::default()
            }))
            .chain(self.locks_freed.into_iter().map(|ino| Callback {
                locks_freed: vec![ino],
                ..Callback::default()
            }));
        for piece in pieces {
            let last = parts.last_mut().expect("one part at least");
            if last.has_room_for(&piece) {
                last.merge(piece);
            } else {
                parts.push(piece);
            }
        }
        parts.retain(|p| !p.is_empty());
        parts
    }

    /// Appends `other`'s changes.
    pub fn merge(&mut self, other: Callback) {
        self.inodes.extend(other.inodes);
        self.entries.extend(other.entries);
        self.locks_freed.extend(other.locks_freed);
    }

    fn wire_len(&self) -> usize {
        let mut w = Writer::default();
        self.put(&mut w);
        w.0.len()
    }

    /// Version, op, fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::message(CALLBACK);
        self.put(&mut w);
        w.0
    }

    /// The callback in `b`, all of it.
    pub fn decode(b: &[u8]) -> Result<Callback, DecodeError> {
        let mut r = Reader::new(b);
        if r.header()? != CALLBACK {
            return bad("not a callback");
        }
        let c = Callback::get(&mut r)?;
        r.finish()?;
        Ok(c)
    }
}

/// A client's answer to a callback.
pub fn encode_ack() -> Vec<u8> {
    Writer::message(ACK).0
}

/// Whether `b` is a well-formed answer to a callback.
pub fn is_ack(b: &[u8]) -> bool {
    let mut r = Reader::new(b);
    matches!(r.header(), Ok(ACK)) && r.finish().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callbacks_round_trip_and_garbage_is_rejected() {
        let cb = Callback {
            inodes: vec![Invalidation {
                ino: 7,
                chunks_from: Some(3),
                attr: None,
                data: true,
                remapped: true,
            }],
            entries: vec![EntryChange {
                parent: 1,
                name: Name::from(&b"caf\xe9"[..]),
            }],
            locks_freed: vec![7, 9],
        };
        let b = cb.encode();
        assert_eq!(Callback::decode(&b).unwrap(), cb);
        for cut in 0..b.len() {
            assert!(Callback::decode(&b[..cut]).is_err());
        }
        assert!(is_ack(&encode_ack()));
        assert!(!is_ack(&b));
        assert!(Callback::decode(&encode_ack()).is_err());
    }

    #[test]
    fn merged_callbacks_stay_within_a_message() {
        let big = Callback {
            entries: vec![EntryChange {
                parent: 1,
                name: Name(vec![b'x'; 255]),
            }],
            ..Callback::default()
        };
        let mut batch = Callback::default();
        let mut n = 0;
        while batch.has_room_for(&big) {
            batch.merge(big.clone());
            n += 1;
        }
        assert!(n > 1);
        assert!(batch.encode().len() <= CALLBACK_RPC.max_msg);
        // One callback too large for a message goes as several that each fit and decode.
        let mut huge = Callback::default();
        for _ in 0..3 * n {
            huge.merge(big.clone());
        }
        huge.inodes = (0..600)
            .map(|ino| Invalidation {
                ino,
                chunks_from: Some(0),
                attr: None,
                data: true,
                remapped: false,
            })
            .collect();
        huge.locks_freed = (0..300).collect();
        let parts = huge.split();
        assert!(parts.len() >= 3);
        let (mut inodes, mut entries, mut freed) = (0, 0, 0);
        for p in parts {
            let b = p.encode();
            assert!(b.len() <= CALLBACK_RPC.max_msg);
            let back = Callback::decode(&b).unwrap();
            inodes += back.inodes.len();
            entries += back.entries.len();
            freed += back.locks_freed.len();
        }
        assert_eq!((inodes, entries, freed), (600, 3 * n, 300));
    }
}
