//! What the metadata node journals: physical records of each change to the namespace and to
//! the registry of data nodes, applied in order to rebuild both after a restart (a snapshot is
//! the same records, written from the whole state). Physical, not the calls that caused them:
//! a call's outcome depends on the clock and on allocation, which a replay would not repeat.

use rfs_proto::types::{Attr, ChunkRef, Ino};
use rfs_proto::wire::{bad, DecodeError, Reader, Wire, Writer};

/// One change.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// What the state directory holds: refused on a restart with other chunks.
    Format { chunk_size: u64 },
    /// An inode came to be: a directory with its parent, a symbolic link with its target.
    Created {
        attr: Attr,
        parent: Ino,
        target: Vec<u8>,
    },
    /// An inode's attributes are now `attr`.
    Attr(Attr),
    /// Directory `dir` names `ino` as `name` (0: the name went).
    Entry { dir: Ino, name: Vec<u8>, ino: Ino },
    /// Directory `dir` moved under `parent`.
    Parent { dir: Ino, parent: Ino },
    /// Chunk `index` of `ino` is on `replicas` (none: the chunk went).
    Chunk {
        ino: Ino,
        index: u64,
        replicas: Vec<ChunkRef>,
    },
    /// Chunks from `from` on of `ino` went (truncated, or trimmed on close).
    Cut { ino: Ino, from: u64 },
    /// Inode `ino` went.
    Gone(Ino),
    /// Inode numbers from here on are unused.
    NextIno(Ino),
    /// Data node `id` lends the pool named `pool_id`: `count` chunks from `pool_addr`.
    Node {
        id: u32,
        pool_id: u64,
        addr: String,
        pool_addr: u64,
        count: u64,
    },
    /// Nothing at or past `upto` in node `node`'s pool was ever handed out (so it is still
    /// zero: it needs no zeroing after a restart).
    Fresh { node: u32, upto: u64 },
    /// Data node `node` was removed (`rfs remove`): its pool never comes back.
    Removed { node: u32 },
    /// Data node `node`'s pool is gone (a new node joined from its address): it never comes
    /// back, but stays listed until removed.
    Down { node: u32 },
    /// Inode `ino`'s extended attribute `name` is now `value` (None: it went).
    Xattr {
        ino: Ino,
        name: Vec<u8>,
        value: Option<Vec<u8>>,
    },
    /// Client `client` holds open handles (`holds`), or no more: after a restart, the grace for
    /// taking handles back ends as soon as every client that held some is back.
    Holding { client: u64, holds: bool },
}

/// Tags of the records with attributes. Those written before attributes counted cuts (protocol
/// 10) are still read, as files never cut.
const CREATED_BEFORE_CUTS: u8 = 2;
const ATTR_BEFORE_CUTS: u8 = 3;
const CREATED: u8 = 12;
const ATTR: u8 = 13;
const HOLDING: u8 = 14;
const REMOVED: u8 = 16;
const DOWN: u8 = 17;
const XATTR: u8 = 18;
/// Chunk records: before copies held spans (protocol 20) every copy was a whole chunk.
const CHUNK_WHOLE: u8 = 6;
const CHUNK: u8 = 15;

/// Copies as journaled before spans: node, address and key; their span (`len` 0 here) is the
/// whole chunk, which the replay knows.
fn whole_copies(r: &mut Reader<'_>) -> Result<Vec<ChunkRef>, DecodeError> {
    let n = u32::get(r)?;
    (0..n)
        .map(|_| {
            Ok(ChunkRef {
                node: Wire::get(r)?,
                addr: Wire::get(r)?,
                rkey: Wire::get(r)?,
                lo: 0,
                len: 0,
            })
        })
        .collect()
}

/// Attributes as journaled: every field but `acl` and `held`, in order. Whether an inode has
/// an ACL and what its chunks hold, the replay counts from its extended attributes' and its
/// chunks' records (as the live namespace does), not from this one.
fn put_attr(a: &Attr, w: &mut Writer) {
    let Attr {
        ino,
        kind,
        perm,
        nlink,
        uid,
        gid,
        rdev,
        size,
        atime,
        mtime,
        ctime,
        cuts,
        acl: _,
        held: _,
    } = a;
    ino.put(w);
    kind.put(w);
    perm.put(w);
    nlink.put(w);
    uid.put(w);
    gid.put(w);
    rdev.put(w);
    size.put(w);
    atime.put(w);
    mtime.put(w);
    ctime.put(w);
    cuts.put(w);
}

fn get_attr(r: &mut Reader<'_>) -> Result<Attr, DecodeError> {
    let before_cuts = attr_before_cuts(r)?;
    Ok(Attr {
        cuts: Wire::get(r)?,
        ..before_cuts
    })
}

/// Attributes as journaled before they counted cuts: every field but `cuts`, in order.
fn attr_before_cuts(r: &mut Reader<'_>) -> Result<Attr, DecodeError> {
    Ok(Attr {
        ino: Wire::get(r)?,
        kind: Wire::get(r)?,
        perm: Wire::get(r)?,
        nlink: Wire::get(r)?,
        uid: Wire::get(r)?,
        gid: Wire::get(r)?,
        rdev: Wire::get(r)?,
        size: Wire::get(r)?,
        atime: Wire::get(r)?,
        mtime: Wire::get(r)?,
        ctime: Wire::get(r)?,
        cuts: 0,
        acl: false,
        held: 0,
    })
}

/// Bytes counted by a u32: journal records are this node's own, with no list limit.
fn put_bytes(b: &[u8], w: &mut Writer) {
    (b.len() as u32).put(w);
    w.0.extend_from_slice(b);
}

fn get_bytes(r: &mut Reader<'_>) -> Result<Vec<u8>, DecodeError> {
    let n = u32::get(r)?;
    Ok(r.take(n as usize)?.to_vec())
}

impl Record {
    /// Appends this record's encoding (a tag, then its fields).
    pub fn put(&self, w: &mut Writer) {
        match self {
            Record::Format { chunk_size } => {
                1u8.put(w);
                chunk_size.put(w);
            }
            Record::Created {
                attr,
                parent,
                target,
            } => {
                CREATED.put(w);
                put_attr(attr, w);
                parent.put(w);
                put_bytes(target, w);
            }
            Record::Attr(attr) => {
                ATTR.put(w);
                put_attr(attr, w);
            }
            Record::Entry { dir, name, ino } => {
                4u8.put(w);
                dir.put(w);
                put_bytes(name, w);
                ino.put(w);
            }
            Record::Parent { dir, parent } => {
                5u8.put(w);
                dir.put(w);
                parent.put(w);
            }
            Record::Chunk {
                ino,
                index,
                replicas,
            } => {
                CHUNK.put(w);
                ino.put(w);
                index.put(w);
                replicas.put(w);
            }
            Record::Cut { ino, from } => {
                7u8.put(w);
                ino.put(w);
                from.put(w);
            }
            Record::Gone(ino) => {
                8u8.put(w);
                ino.put(w);
            }
            Record::NextIno(ino) => {
                9u8.put(w);
                ino.put(w);
            }
            Record::Node {
                id,
                pool_id,
                addr,
                pool_addr,
                count,
            } => {
                10u8.put(w);
                id.put(w);
                pool_id.put(w);
                put_bytes(addr.as_bytes(), w);
                pool_addr.put(w);
                count.put(w);
            }
            Record::Fresh { node, upto } => {
                11u8.put(w);
                node.put(w);
                upto.put(w);
            }
            Record::Removed { node } => {
                REMOVED.put(w);
                node.put(w);
            }
            Record::Down { node } => {
                DOWN.put(w);
                node.put(w);
            }
            Record::Xattr { ino, name, value } => {
                XATTR.put(w);
                ino.put(w);
                put_bytes(name, w);
                value.is_some().put(w);
                if let Some(v) = value {
                    put_bytes(v, w);
                }
            }
            Record::Holding { client, holds } => {
                HOLDING.put(w);
                client.put(w);
                holds.put(w);
            }
        }
    }

    /// Takes one record.
    pub fn get(r: &mut Reader<'_>) -> Result<Record, DecodeError> {
        Ok(match u8::get(r)? {
            1 => Record::Format {
                chunk_size: Wire::get(r)?,
            },
            CREATED_BEFORE_CUTS => Record::Created {
                attr: attr_before_cuts(r)?,
                parent: Wire::get(r)?,
                target: get_bytes(r)?,
            },
            ATTR_BEFORE_CUTS => Record::Attr(attr_before_cuts(r)?),
            CREATED => Record::Created {
                attr: get_attr(r)?,
                parent: Wire::get(r)?,
                target: get_bytes(r)?,
            },
            ATTR => Record::Attr(get_attr(r)?),
            4 => Record::Entry {
                dir: Wire::get(r)?,
                name: get_bytes(r)?,
                ino: Wire::get(r)?,
            },
            5 => Record::Parent {
                dir: Wire::get(r)?,
                parent: Wire::get(r)?,
            },
            CHUNK_WHOLE => Record::Chunk {
                ino: Wire::get(r)?,
                index: Wire::get(r)?,
                replicas: whole_copies(r)?,
            },
            CHUNK => Record::Chunk {
                ino: Wire::get(r)?,
                index: Wire::get(r)?,
                replicas: Wire::get(r)?,
            },
            7 => Record::Cut {
                ino: Wire::get(r)?,
                from: Wire::get(r)?,
            },
            8 => Record::Gone(Wire::get(r)?),
            9 => Record::NextIno(Wire::get(r)?),
            10 => Record::Node {
                id: Wire::get(r)?,
                pool_id: Wire::get(r)?,
                addr: String::from_utf8(get_bytes(r)?).or_else(|_| bad("address not UTF-8"))?,
                pool_addr: Wire::get(r)?,
                count: Wire::get(r)?,
            },
            11 => Record::Fresh {
                node: Wire::get(r)?,
                upto: Wire::get(r)?,
            },
            REMOVED => Record::Removed {
                node: Wire::get(r)?,
            },
            DOWN => Record::Down {
                node: Wire::get(r)?,
            },
            HOLDING => Record::Holding {
                client: Wire::get(r)?,
                holds: Wire::get(r)?,
            },
            XATTR => Record::Xattr {
                ino: Wire::get(r)?,
                name: get_bytes(r)?,
                value: match bool::get(r)? {
                    true => Some(get_bytes(r)?),
                    false => None,
                },
            },
            t => return bad(format!("unknown journal record {t}")),
        })
    }

    /// The records encoded in `b`, all of `b`.
    pub fn decode_all(b: &[u8]) -> Result<Vec<Record>, DecodeError> {
        let mut r = Reader::new(b);
        let mut out = Vec::new();
        while !r.is_empty() {
            out.push(Record::get(&mut r)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfs_proto::types::{FileKind, Timestamp};

    fn attr() -> Attr {
        let t = Timestamp { secs: 5, nsecs: 7 };
        Attr {
            ino: 9,
            kind: FileKind::RegularFile,
            perm: 0o640,
            nlink: 1,
            uid: 3,
            gid: 4,
            rdev: 0,
            size: 1 << 40,
            atime: t,
            mtime: t,
            ctime: t,
            cuts: 6,
            acl: false,
            held: 0,
        }
    }

    #[test]
    fn attributes_journaled_before_cuts_were_counted_read_as_never_cut() {
        let mut a = attr();
        let mut w = Writer::default();
        ATTR_BEFORE_CUTS.put(&mut w);
        put_attr(&a, &mut w);
        let old = w.0.len() - 8; // the same fields, without the count at the end
        let mut created = vec![CREATED_BEFORE_CUTS];
        created.extend_from_slice(&w.0[1..old]);
        let mut tail = Writer::default();
        1u64.put(&mut tail);
        put_bytes(b"t", &mut tail);
        created.extend_from_slice(&tail.0);
        let mut both = w.0[..old].to_vec();
        both.extend_from_slice(&created);
        a.cuts = 0;
        assert_eq!(
            Record::decode_all(&both).unwrap(),
            vec![
                Record::Attr(a),
                Record::Created {
                    attr: a,
                    parent: 1,
                    target: b"t".to_vec(),
                }
            ]
        );
    }

    /// Whether an inode has an ACL and what its chunks hold are not journaled with its
    /// attributes (the replay counts them from its extended attributes' and chunks' records):
    /// attributes are journaled as they were before both, so a journal written by an earlier
    /// build reads.
    #[test]
    fn attributes_are_journaled_without_the_acl_flag() {
        let a = Attr {
            acl: true,
            held: 0,
            ..attr()
        };
        let mut w = Writer::default();
        Record::Attr(a).put(&mut w);
        assert_eq!(w.0.len(), 1 + 8 + 1 + 2 + 4 * 4 + 8 + 3 * 12 + 8);
        let back = Record::decode_all(&w.0).unwrap();
        let journaled = Attr {
            acl: false,
            held: 0,
            ..a
        };
        assert_eq!(back, vec![Record::Attr(journaled)]);
    }

    #[test]
    fn every_record_round_trips_and_damage_is_refused() {
        let c = ChunkRef {
            node: 2,
            addr: 1 << 30,
            rkey: 0,
            lo: 8192,
            len: 4096,
        };
        let all = vec![
            Record::Format {
                chunk_size: 1 << 20,
            },
            Record::Created {
                attr: attr(),
                parent: 1,
                target: b"t\xff".to_vec(),
            },
            Record::Attr(attr()),
            Record::Entry {
                dir: 1,
                name: vec![0xfe; 255],
                ino: 9,
            },
            Record::Parent { dir: 4, parent: 1 },
            Record::Chunk {
                ino: 9,
                index: 3,
                replicas: vec![c, c],
            },
            Record::Cut { ino: 9, from: 2 },
            Record::Gone(9),
            Record::NextIno(10),
            Record::Node {
                id: 2,
                pool_id: u64::MAX,
                addr: "10.0.0.2:7471".into(),
                pool_addr: 1 << 44,
                count: 512,
            },
            Record::Fresh { node: 2, upto: 77 },
            Record::Removed { node: 2 },
            Record::Down { node: 3 },
            Record::Xattr {
                ino: 5,
                name: b"user.a".to_vec(),
                value: Some(vec![0; 65536]),
            },
            Record::Xattr {
                ino: 5,
                name: b"user.a".to_vec(),
                value: None,
            },
            Record::Holding {
                client: u64::MAX,
                holds: true,
            },
        ];
        let mut w = Writer::default();
        for r in &all {
            r.put(&mut w);
        }
        assert_eq!(Record::decode_all(&w.0).unwrap(), all);
        for cut in 1..w.0.len() {
            if let Ok(part) = Record::decode_all(&w.0[..cut]) {
                assert!(part.len() < all.len(), "a cut at {cut} decoded everything");
            }
        }
        assert!(Record::decode_all(&[99]).is_err());
    }
}
