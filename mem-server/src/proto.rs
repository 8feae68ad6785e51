//! Every message between clients and nodes, with its encoding, decoding and validation in one
//! place. Messages are versioned and length-checked; decoding never trusts a length or a count
//! it has not checked against what is left, and rejects trailing bytes.

use std::fmt;

pub const VERSION: u8 = 1;
/// Bounds what one readdir or chunk-map reply may carry (a message is at most 64 KiB).
pub const MAX_LIST: u32 = 256;
const MAX_STRING: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

fn bad<T>(why: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(why.into()))
}

#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        let b = s.as_bytes();
        self.u16(b.len().min(u16::MAX as usize) as u16);
        self.0
            .extend_from_slice(&b[..b.len().min(u16::MAX as usize)]);
    }
    fn opt<T>(&mut self, v: &Option<T>, f: impl FnOnce(&mut Self, &T)) {
        match v {
            None => self.u8(0),
            Some(x) => {
                self.u8(1);
                f(self, x);
            }
        }
    }
}

pub struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader(b)
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return bad(format!(
                "truncated: wanted {n} bytes, {} left",
                self.0.len()
            ));
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return bad("string too long");
        }
        String::from_utf8(self.take(n)?.to_vec()).or_else(|_| bad("string is not UTF-8"))
    }
    fn opt<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, DecodeError>,
    ) -> Result<Option<T>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(f(self)?)),
            _ => bad("bad option tag"),
        }
    }
    fn count(&mut self) -> Result<usize, DecodeError> {
        let n = self.u32()?;
        if n > MAX_LIST {
            return bad(format!("list of {n} over the {MAX_LIST} limit"));
        }
        Ok(n as usize)
    }
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            bad(format!("{} trailing bytes", self.0.len()))
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Timestamp {
    pub secs: i64,
    pub nsecs: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    RegularFile,
    Directory,
    Symlink,
    NamedPipe,
    CharDevice,
    BlockDevice,
    Socket,
}

impl FileKind {
    fn code(self) -> u8 {
        match self {
            FileKind::RegularFile => 1,
            FileKind::Directory => 2,
            FileKind::Symlink => 3,
            FileKind::NamedPipe => 4,
            FileKind::CharDevice => 5,
            FileKind::BlockDevice => 6,
            FileKind::Socket => 7,
        }
    }
    fn from_code(c: u8) -> Result<FileKind, DecodeError> {
        Ok(match c {
            1 => FileKind::RegularFile,
            2 => FileKind::Directory,
            3 => FileKind::Symlink,
            4 => FileKind::NamedPipe,
            5 => FileKind::CharDevice,
            6 => FileKind::BlockDevice,
            7 => FileKind::Socket,
            _ => return bad(format!("unknown file kind {c}")),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: FileKind,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub size: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Timestamp>,
    pub mtime: Option<Timestamp>,
}

/// Where one chunk of a file lives: a data node and a range of its registered pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkRef {
    pub node: u32,
    pub addr: u64,
    pub rkey: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: u32,
    /// host:port where clients reach the node's data service.
    pub addr: String,
    pub alive: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub chunk_size: u64,
    pub chunks_total: u64,
    pub chunks_free: u64,
    pub inodes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    Lookup {
        parent: u64,
        name: String,
    },
    GetAttr {
        ino: u64,
    },
    SetAttr {
        ino: u64,
        set: SetAttr,
    },
    Mknod {
        parent: u64,
        name: String,
        kind: FileKind,
        perm: u16,
        uid: u32,
        gid: u32,
        rdev: u32,
    },
    Mkdir {
        parent: u64,
        name: String,
        perm: u16,
        uid: u32,
        gid: u32,
    },
    Symlink {
        parent: u64,
        name: String,
        target: String,
        uid: u32,
        gid: u32,
    },
    Readlink {
        ino: u64,
    },
    Link {
        ino: u64,
        newparent: u64,
        newname: String,
    },
    Unlink {
        parent: u64,
        name: String,
    },
    Rmdir {
        parent: u64,
        name: String,
    },
    Rename {
        parent: u64,
        name: String,
        newparent: u64,
        newname: String,
        flags: u32,
    },
    ReadDir {
        ino: u64,
        cookie: u64,
        max: u32,
    },
    Open {
        ino: u64,
    },
    Release {
        ino: u64,
    },
    ChunkMap {
        ino: u64,
        first: u64,
        count: u32,
    },
    Allocate {
        ino: u64,
        first: u64,
        count: u32,
    },
    Commit {
        ino: u64,
        size: u64,
        mtime: Option<Timestamp>,
    },
    StatFs,
    Nodes,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    Error(i32),
    Empty,
    Attr(Attr),
    Entries(Vec<(u64, String, Attr)>),
    Target(String),
    Chunks(Vec<(u64, ChunkRef)>),
    StatFs(StatFs),
    Nodes(Vec<NodeInfo>),
}

fn put_ts(w: &mut Writer, t: &Timestamp) {
    w.i64(t.secs);
    w.u32(t.nsecs);
}

fn get_ts(r: &mut Reader) -> Result<Timestamp, DecodeError> {
    let secs = r.i64()?;
    let nsecs = r.u32()?;
    if nsecs >= 1_000_000_000 {
        return bad("nanoseconds out of range");
    }
    Ok(Timestamp { secs, nsecs })
}

fn put_attr(w: &mut Writer, a: &Attr) {
    w.u64(a.ino);
    w.u8(a.kind.code());
    w.u16(a.perm);
    w.u32(a.nlink);
    w.u32(a.uid);
    w.u32(a.gid);
    w.u32(a.rdev);
    w.u64(a.size);
    put_ts(w, &a.atime);
    put_ts(w, &a.mtime);
    put_ts(w, &a.ctime);
}

fn get_attr(r: &mut Reader) -> Result<Attr, DecodeError> {
    Ok(Attr {
        ino: r.u64()?,
        kind: FileKind::from_code(r.u8()?)?,
        perm: r.u16()?,
        nlink: r.u32()?,
        uid: r.u32()?,
        gid: r.u32()?,
        rdev: r.u32()?,
        size: r.u64()?,
        atime: get_ts(r)?,
        mtime: get_ts(r)?,
        ctime: get_ts(r)?,
    })
}

fn put_chunk(w: &mut Writer, c: &ChunkRef) {
    w.u32(c.node);
    w.u64(c.addr);
    w.u32(c.rkey);
}

fn get_chunk(r: &mut Reader) -> Result<ChunkRef, DecodeError> {
    Ok(ChunkRef {
        node: r.u32()?,
        addr: r.u64()?,
        rkey: r.u32()?,
    })
}

fn header(w: &mut Writer, op: u8) {
    w.u8(VERSION);
    w.u8(op);
}

fn check_header(r: &mut Reader) -> Result<u8, DecodeError> {
    let v = r.u8()?;
    if v != VERSION {
        return bad(format!("protocol version {v}, this node speaks {VERSION}"));
    }
    r.u8()
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Request::Lookup { parent, name } => {
                header(&mut w, 1);
                w.u64(*parent);
                w.str(name);
            }
            Request::GetAttr { ino } => {
                header(&mut w, 2);
                w.u64(*ino);
            }
            Request::SetAttr { ino, set } => {
                header(&mut w, 3);
                w.u64(*ino);
                w.opt(&set.mode, |w, v| w.u32(*v));
                w.opt(&set.uid, |w, v| w.u32(*v));
                w.opt(&set.gid, |w, v| w.u32(*v));
                w.opt(&set.size, |w, v| w.u64(*v));
                w.opt(&set.atime, put_ts);
                w.opt(&set.mtime, put_ts);
            }
            Request::Mknod {
                parent,
                name,
                kind,
                perm,
                uid,
                gid,
                rdev,
            } => {
                header(&mut w, 4);
                w.u64(*parent);
                w.str(name);
                w.u8(kind.code());
                w.u16(*perm);
                w.u32(*uid);
                w.u32(*gid);
                w.u32(*rdev);
            }
            Request::Mkdir {
                parent,
                name,
                perm,
                uid,
                gid,
            } => {
                header(&mut w, 5);
                w.u64(*parent);
                w.str(name);
                w.u16(*perm);
                w.u32(*uid);
                w.u32(*gid);
            }
            Request::Symlink {
                parent,
                name,
                target,
                uid,
                gid,
            } => {
                header(&mut w, 6);
                w.u64(*parent);
                w.str(name);
                w.str(target);
                w.u32(*uid);
                w.u32(*gid);
            }
            Request::Readlink { ino } => {
                header(&mut w, 7);
                w.u64(*ino);
            }
            Request::Link {
                ino,
                newparent,
                newname,
            } => {
                header(&mut w, 8);
                w.u64(*ino);
                w.u64(*newparent);
                w.str(newname);
            }
            Request::Unlink { parent, name } => {
                header(&mut w, 9);
                w.u64(*parent);
                w.str(name);
            }
            Request::Rmdir { parent, name } => {
                header(&mut w, 10);
                w.u64(*parent);
                w.str(name);
            }
            Request::Rename {
                parent,
                name,
                newparent,
                newname,
                flags,
            } => {
                header(&mut w, 11);
                w.u64(*parent);
                w.str(name);
                w.u64(*newparent);
                w.str(newname);
                w.u32(*flags);
            }
            Request::ReadDir { ino, cookie, max } => {
                header(&mut w, 12);
                w.u64(*ino);
                w.u64(*cookie);
                w.u32(*max);
            }
            Request::Open { ino } => {
                header(&mut w, 13);
                w.u64(*ino);
            }
            Request::Release { ino } => {
                header(&mut w, 14);
                w.u64(*ino);
            }
            Request::ChunkMap { ino, first, count } => {
                header(&mut w, 15);
                w.u64(*ino);
                w.u64(*first);
                w.u32(*count);
            }
            Request::Allocate { ino, first, count } => {
                header(&mut w, 16);
                w.u64(*ino);
                w.u64(*first);
                w.u32(*count);
            }
            Request::Commit { ino, size, mtime } => {
                header(&mut w, 17);
                w.u64(*ino);
                w.u64(*size);
                w.opt(mtime, put_ts);
            }
            Request::StatFs => header(&mut w, 18),
            Request::Nodes => header(&mut w, 19),
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<Request, DecodeError> {
        let mut r = Reader::new(b);
        let op = check_header(&mut r)?;
        let req = match op {
            1 => Request::Lookup {
                parent: r.u64()?,
                name: r.str()?,
            },
            2 => Request::GetAttr { ino: r.u64()? },
            3 => Request::SetAttr {
                ino: r.u64()?,
                set: SetAttr {
                    mode: r.opt(|r| r.u32())?,
                    uid: r.opt(|r| r.u32())?,
                    gid: r.opt(|r| r.u32())?,
                    size: r.opt(|r| r.u64())?,
                    atime: r.opt(get_ts)?,
                    mtime: r.opt(get_ts)?,
                },
            },
            4 => Request::Mknod {
                parent: r.u64()?,
                name: r.str()?,
                kind: FileKind::from_code(r.u8()?)?,
                perm: r.u16()?,
                uid: r.u32()?,
                gid: r.u32()?,
                rdev: r.u32()?,
            },
            5 => Request::Mkdir {
                parent: r.u64()?,
                name: r.str()?,
                perm: r.u16()?,
                uid: r.u32()?,
                gid: r.u32()?,
            },
            6 => Request::Symlink {
                parent: r.u64()?,
                name: r.str()?,
                target: r.str()?,
                uid: r.u32()?,
                gid: r.u32()?,
            },
            7 => Request::Readlink { ino: r.u64()? },
            8 => Request::Link {
                ino: r.u64()?,
                newparent: r.u64()?,
                newname: r.str()?,
            },
            9 => Request::Unlink {
                parent: r.u64()?,
                name: r.str()?,
            },
            10 => Request::Rmdir {
                parent: r.u64()?,
                name: r.str()?,
            },
            11 => Request::Rename {
                parent: r.u64()?,
                name: r.str()?,
                newparent: r.u64()?,
                newname: r.str()?,
                flags: r.u32()?,
            },
            12 => Request::ReadDir {
                ino: r.u64()?,
                cookie: r.u64()?,
                max: r.u32()?.min(MAX_LIST),
            },
            13 => Request::Open { ino: r.u64()? },
            14 => Request::Release { ino: r.u64()? },
            15 => Request::ChunkMap {
                ino: r.u64()?,
                first: r.u64()?,
                count: r.u32()?.min(MAX_LIST),
            },
            16 => Request::Allocate {
                ino: r.u64()?,
                first: r.u64()?,
                count: r.u32()?.min(MAX_LIST),
            },
            17 => Request::Commit {
                ino: r.u64()?,
                size: r.u64()?,
                mtime: r.opt(get_ts)?,
            },
            18 => Request::StatFs,
            19 => Request::Nodes,
            _ => return bad(format!("unknown request {op}")),
        };
        r.finish()?;
        Ok(req)
    }
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Reply::Error(e) => {
                header(&mut w, 1);
                w.u32(*e as u32);
            }
            Reply::Empty => header(&mut w, 2),
            Reply::Attr(a) => {
                header(&mut w, 3);
                put_attr(&mut w, a);
            }
            Reply::Entries(es) => {
                header(&mut w, 4);
                w.u32(es.len() as u32);
                for (cookie, name, a) in es {
                    w.u64(*cookie);
                    w.str(name);
                    put_attr(&mut w, a);
                }
            }
            Reply::Target(t) => {
                header(&mut w, 5);
                w.str(t);
            }
            Reply::Chunks(cs) => {
                header(&mut w, 6);
                w.u32(cs.len() as u32);
                for (i, c) in cs {
                    w.u64(*i);
                    put_chunk(&mut w, c);
                }
            }
            Reply::StatFs(s) => {
                header(&mut w, 7);
                w.u64(s.chunk_size);
                w.u64(s.chunks_total);
                w.u64(s.chunks_free);
                w.u64(s.inodes);
            }
            Reply::Nodes(ns) => {
                header(&mut w, 8);
                w.u32(ns.len() as u32);
                for n in ns {
                    w.u32(n.id);
                    w.str(&n.addr);
                    w.u8(n.alive as u8);
                }
            }
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<Reply, DecodeError> {
        let mut r = Reader::new(b);
        let op = check_header(&mut r)?;
        let reply = match op {
            1 => Reply::Error(r.u32()? as i32),
            2 => Reply::Empty,
            3 => Reply::Attr(get_attr(&mut r)?),
            4 => {
                let n = r.count()?;
                let mut es = Vec::with_capacity(n);
                for _ in 0..n {
                    es.push((r.u64()?, r.str()?, get_attr(&mut r)?));
                }
                Reply::Entries(es)
            }
            5 => Reply::Target(r.str()?),
            6 => {
                let n = r.count()?;
                let mut cs = Vec::with_capacity(n);
                for _ in 0..n {
                    cs.push((r.u64()?, get_chunk(&mut r)?));
                }
                Reply::Chunks(cs)
            }
            7 => Reply::StatFs(StatFs {
                chunk_size: r.u64()?,
                chunks_total: r.u64()?,
                chunks_free: r.u64()?,
                inodes: r.u64()?,
            }),
            8 => {
                let n = r.count()?;
                let mut ns = Vec::with_capacity(n);
                for _ in 0..n {
                    ns.push(NodeInfo {
                        id: r.u32()?,
                        addr: r.str()?,
                        alive: match r.u8()? {
                            0 => false,
                            1 => true,
                            _ => return bad("bad bool"),
                        },
                    });
                }
                Reply::Nodes(ns)
            }
            _ => return bad(format!("unknown reply {op}")),
        };
        r.finish()?;
        Ok(reply)
    }
}

/// What a connection is for, said right after authentication on the control connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hello {
    /// A client's metadata channel (RPC over SEND/RECV on one queue pair).
    Metadata,
    /// A client's data session: `qps` queue pairs, then the pool descriptor.
    Data { qps: u32 },
    /// A data node joining the metadata node.
    Join {
        addr: String,
        pool_addr: u64,
        pool_len: u64,
        rkey: u32,
        chunk_size: u64,
    },
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Hello::Metadata => header(&mut w, 1),
            Hello::Data { qps } => {
                header(&mut w, 2);
                w.u32(*qps);
            }
            Hello::Join {
                addr,
                pool_addr,
                pool_len,
                rkey,
                chunk_size,
            } => {
                header(&mut w, 3);
                w.str(addr);
                w.u64(*pool_addr);
                w.u64(*pool_len);
                w.u32(*rkey);
                w.u64(*chunk_size);
            }
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<Hello, DecodeError> {
        let mut r = Reader::new(b);
        let h = match check_header(&mut r)? {
            1 => Hello::Metadata,
            2 => {
                let qps = r.u32()?;
                if !(1..=64).contains(&qps) {
                    return bad("queue pairs must be 1..=64");
                }
                Hello::Data { qps }
            }
            3 => Hello::Join {
                addr: r.str()?,
                pool_addr: r.u64()?,
                pool_len: r.u64()?,
                rkey: r.u32()?,
                chunk_size: r.u64()?,
            },
            op => return bad(format!("unknown hello {op}")),
        };
        r.finish()?;
        Ok(h)
    }
}

/// The pool descriptor a data node sends after a data session's queue pairs connect.
pub fn encode_pool(addr: u64, len: u64, rkey: u32) -> Vec<u8> {
    let mut w = Writer::default();
    header(&mut w, 1);
    w.u64(addr);
    w.u64(len);
    w.u32(rkey);
    w.0
}

pub fn decode_pool(b: &[u8]) -> Result<(u64, u64, u32), DecodeError> {
    let mut r = Reader::new(b);
    if check_header(&mut r)? != 1 {
        return bad("not a pool descriptor");
    }
    let v = (r.u64()?, r.u64()?, r.u32()?);
    r.finish()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr() -> Attr {
        Attr {
            ino: 5,
            kind: FileKind::Symlink,
            perm: 0o644,
            nlink: 2,
            uid: 1000,
            gid: 100,
            rdev: 0,
            size: 77,
            atime: Timestamp { secs: 1, nsecs: 2 },
            mtime: Timestamp { secs: 3, nsecs: 4 },
            ctime: Timestamp { secs: -5, nsecs: 6 },
        }
    }

    fn all_requests() -> Vec<Request> {
        let n = || "näme".to_string();
        vec![
            Request::Lookup {
                parent: 1,
                name: n(),
            },
            Request::GetAttr { ino: 2 },
            Request::SetAttr {
                ino: 3,
                set: SetAttr {
                    mode: Some(0o600),
                    uid: None,
                    gid: Some(7),
                    size: Some(1 << 40),
                    atime: None,
                    mtime: Some(Timestamp { secs: 9, nsecs: 10 }),
                },
            },
            Request::Mknod {
                parent: 1,
                name: n(),
                kind: FileKind::NamedPipe,
                perm: 0o644,
                uid: 1,
                gid: 2,
                rdev: 3,
            },
            Request::Mkdir {
                parent: 1,
                name: n(),
                perm: 0o755,
                uid: 1,
                gid: 2,
            },
            Request::Symlink {
                parent: 1,
                name: n(),
                target: "/a/b".into(),
                uid: 1,
                gid: 2,
            },
            Request::Readlink { ino: 4 },
            Request::Link {
                ino: 4,
                newparent: 1,
                newname: n(),
            },
            Request::Unlink {
                parent: 1,
                name: n(),
            },
            Request::Rmdir {
                parent: 1,
                name: n(),
            },
            Request::Rename {
                parent: 1,
                name: n(),
                newparent: 2,
                newname: "x".into(),
                flags: 1,
            },
            Request::ReadDir {
                ino: 1,
                cookie: 9,
                max: 100,
            },
            Request::Open { ino: 4 },
            Request::Release { ino: 4 },
            Request::ChunkMap {
                ino: 4,
                first: 10,
                count: 32,
            },
            Request::Allocate {
                ino: 4,
                first: 10,
                count: 32,
            },
            Request::Commit {
                ino: 4,
                size: 12345,
                mtime: None,
            },
            Request::StatFs,
            Request::Nodes,
        ]
    }

    fn all_replies() -> Vec<Reply> {
        vec![
            Reply::Error(libc::ENOENT),
            Reply::Empty,
            Reply::Attr(attr()),
            Reply::Entries(vec![(3, "a".into(), attr()), (4, "b".into(), attr())]),
            Reply::Target("/x".into()),
            Reply::Chunks(vec![(
                0,
                ChunkRef {
                    node: 1,
                    addr: 2,
                    rkey: 3,
                },
            )]),
            Reply::StatFs(StatFs {
                chunk_size: 1,
                chunks_total: 2,
                chunks_free: 3,
                inodes: 4,
            }),
            Reply::Nodes(vec![NodeInfo {
                id: 0,
                addr: "127.0.0.1:7470".into(),
                alive: true,
            }]),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for r in all_requests() {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
        for r in all_replies() {
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        }
        for h in [
            Hello::Metadata,
            Hello::Data { qps: 4 },
            Hello::Join {
                addr: "h:1".into(),
                pool_addr: 1,
                pool_len: 2,
                rkey: 3,
                chunk_size: 4,
            },
        ] {
            assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        }
        assert_eq!(decode_pool(&encode_pool(1, 2, 3)).unwrap(), (1, 2, 3));
    }

    #[test]
    fn garbage_is_rejected_never_panics() {
        // Every truncation and every single-byte corruption of every message must decode to an
        // error or to some valid message, never panic.
        let msgs: Vec<Vec<u8>> = all_requests()
            .iter()
            .map(|r| r.encode())
            .chain(all_replies().iter().map(|r| r.encode()))
            .collect();
        for m in &msgs {
            for cut in 0..m.len() {
                assert!(Request::decode(&m[..cut]).is_err() || Reply::decode(&m[..cut]).is_err());
            }
            for i in 0..m.len() {
                for v in [0u8, 1, 0x7f, 0xff] {
                    let mut x = m.clone();
                    x[i] = v;
                    let _ = Request::decode(&x);
                    let _ = Reply::decode(&x);
                    let _ = Hello::decode(&x);
                }
            }
            let mut longer = m.clone();
            longer.push(0);
            assert!(Request::decode(&longer).is_err() && Reply::decode(&longer).is_err());
        }
        assert!(Request::decode(&[2, 1]).is_err(), "wrong version");
        assert!(Request::decode(&[VERSION, 200]).is_err(), "unknown op");
        let mut huge = Writer::default();
        header(&mut huge, 4);
        huge.u32(u32::MAX);
        assert!(Reply::decode(&huge.0).is_err(), "count over the limit");
        assert!(Hello::decode(&Hello::Data { qps: 0 }.encode()).is_err());
    }
}
