//! The metadata protocol: one struct per request, each tied by [`Call`] to the type of its
//! answer, so that neither side can send or expect the wrong reply. Every message's encoding is
//! its field list (see [`crate::wire`]); tests round-trip every message and feed garbage to
//! every decoder.
//!
//! A request is version, op, fields. A reply is version, the op of its request, a status byte
//! (0: ok, 1: failed), then the answer or an [`Errno`].

use crate::errno::Errno;
use crate::locks::FileLock;
use crate::types::{
    Attr, AttrChanges, Caller, ChunkRef, ClusterStatus, DirEntry, FileAccess, FileKind, FileMap,
    Ino, Name, NodeInfo, Owner, StatFs,
};
use crate::wire::{bad, DecodeError, Reader, Wire, Writer};
use crate::xattr::XattrValue;
use crate::{wire_enum, wire_struct};

wire_struct! {
    /// Looks a name up in a directory.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Lookup { pub parent: Ino, pub name: Name, pub caller: Caller }
}

wire_struct! {
    /// An inode's attributes.
    #[derive(Clone, Debug, PartialEq)]
    pub struct GetAttr { pub ino: Ino }
}

wire_struct! {
    /// chmod, chown, truncate, utimens, by `caller`: chmod and times need the owner (times: or
    /// write permission), chown needs root (chgrp: the owner, to one of its groups), truncate
    /// needs write permission or a handle of this session open for writing.
    #[derive(Clone, Debug, PartialEq)]
    pub struct SetAttr { pub ino: Ino, pub changes: AttrChanges, pub caller: Caller }
}

wire_struct! {
    /// Creates a file or a special node.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Mknod {
        pub parent: Ino,
        pub name: Name,
        pub kind: FileKind,
        /// Device number of a device node.
        pub rdev: u32,
        pub owner: Owner,
        pub caller: Caller,
    }
}

wire_struct! {
    /// Creates a directory.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Mkdir { pub parent: Ino, pub name: Name, pub owner: Owner, pub caller: Caller }
}

wire_struct! {
    /// Creates a symbolic link to `target`.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Symlink {
        pub parent: Ino,
        pub name: Name,
        pub target: Name,
        pub uid: u32,
        pub gid: u32,
        pub caller: Caller,
    }
}

wire_struct! {
    /// A symbolic link's target.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Readlink { pub ino: Ino }
}

wire_struct! {
    /// A hard link to `ino` as `newparent/newname`.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Link { pub ino: Ino, pub newparent: Ino, pub newname: Name, pub caller: Caller }
}

wire_struct! {
    /// Removes a non-directory name.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Unlink { pub parent: Ino, pub name: Name, pub caller: Caller }
}

wire_struct! {
    /// Removes an empty directory.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Rmdir { pub parent: Ino, pub name: Name, pub caller: Caller }
}

wire_struct! {
    /// rename(2), with renameat2's flags.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Rename {
        pub parent: Ino,
        pub name: Name,
        pub newparent: Ino,
        pub newname: Name,
        pub flags: u32,
        pub caller: Caller,
    }
}

wire_struct! {
    /// Up to `max` directory entries after `cookie` (0: from the start).
    #[derive(Clone, Debug, PartialEq)]
    pub struct ReadDir { pub ino: Ino, pub cookie: u64, pub max: u32, pub caller: Caller }
}

wire_struct! {
    /// Opens a handle on a file for `access` ([`crate::types::FileAccess::READ`], `FileAccess::WRITE`), if the
    /// file's mode lets `caller` have it: fresh attributes, the file lives while the handle
    /// does, and its chunk map may be fetched (written: allocated) while a handle is open.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Open { pub ino: Ino, pub access: FileAccess, pub caller: Caller }
}

wire_struct! {
    /// Creates a regular file and opens it for `access`, in one step (as open(O_CREAT) does:
    /// the creator's handle is not subject to the new file's mode).
    #[derive(Clone, Debug, PartialEq)]
    pub struct Create {
        pub parent: Ino,
        pub name: Name,
        pub owner: Owner,
        pub access: FileAccess,
        pub caller: Caller,
    }
}

wire_struct! {
    /// What a call that adds a name answers: the inode the name leads to, and the directory's
    /// attributes after the change, which the caller may keep (the kernel asks for them next,
    /// and the directory's holders are told when it changes again).
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct Made { pub attr: Attr, pub dir: Attr }
}

wire_struct! {
    /// What an open answers: the file's attributes and the first [`OPEN_MAP_CHUNKS`] chunks of
    /// its map, granted to the caller's data sessions as [`ChunkMap`]'s are (none for a file
    /// whose chunks are frozen just then), so that reading a small file takes no second call.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Opened { pub attr: Attr, pub map: FileMap }
}

/// How many chunks of a file's map an open answers with: as many as a client maps ahead.
pub const OPEN_MAP_CHUNKS: u32 = 64;

wire_struct! {
    /// Closes a handle taken by [`Open`] or [`Create`] with `access`.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Release { pub ino: Ino, pub access: FileAccess }
}

wire_struct! {
    /// Where chunks `first..first+count` of a file are: holes are left out, and at most
    /// [`crate::wire::MAX_LIST`] chunks are answered (the first ones), whatever the span.
    #[derive(Clone, Debug, PartialEq)]
    pub struct ChunkMap { pub ino: Ino, pub first: u64, pub count: u32 }
}

wire_struct! {
    /// Backs bytes `offset..end` of a file with space (holes get spans sized to what is asked
    /// and the file, spans that do not cover what is asked grow), then answers like
    /// [`ChunkMap`] for the chunks those bytes are in (at most [`crate::wire::MAX_LIST`]).
    #[derive(Clone, Debug, PartialEq)]
    pub struct Allocate { pub ino: Ino, pub offset: u64, pub end: u64 }
}

wire_struct! {
    /// A write reached only `reached` of the replicas of chunk `index` of a file (the others'
    /// nodes failed or stopped): every other replica, which may miss it (a copy made meanwhile
    /// too), is dropped from the map before the write is answered, to be made again from one
    /// that has it. Answers how many were dropped; EIO if none of `reached` is in the map.
    #[derive(Clone, Debug, PartialEq)]
    pub struct DropReplicas { pub ino: Ino, pub index: u64, pub reached: Vec<ChunkRef> }
}

wire_struct! {
    /// Records a client's writes: the size grows to `size`, the mtime is set. `cuts` is the
    /// file's count of cuts ([`Attr::cuts`]) the client's size was made with: a commit made
    /// without hearing of a later cut would grow the file back over it, and is refused with
    /// ESTALE.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Commit {
        pub ino: Ino,
        pub size: u64,
        pub mtime: Option<crate::types::Timestamp>,
        pub cuts: u64,
    }
}

wire_struct! {
    /// What a commit answers: the file's attributes just before and just after it (NFS's
    /// weak cache consistency data). A client whose pages were of `before` knows that nobody
    /// else changed the file in between, so they are of `after` once they hold its writes.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub struct Committed { pub before: Attr, pub after: Attr }
}

wire_struct! {
    /// The file system's capacity.
    #[derive(Clone, Debug, PartialEq)]
    pub struct GetStatFs {}
}

wire_struct! {
    /// Every data node.
    #[derive(Clone, Debug, PartialEq)]
    pub struct ListNodes {}
}

wire_struct! {
    /// Says that this client's data session to `node` is named `session` (from the node's pool
    /// descriptor): chunks of that node are granted to it. Without one, chunk maps of the
    /// node come back with remote key 0, and the client connects, attaches and asks again.
    #[derive(Clone, Debug, PartialEq)]
    pub struct AttachData { pub node: u32, pub session: u64 }
}

wire_struct! {
    /// After the metadata node restarted (within its grace period): takes again the handles
    /// this client had open, each as (inode, access), without the permission checks they
    /// passed when they were opened. Answers how many files were still there.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Reclaim { pub handles: Vec<(Ino, FileAccess)> }
}

wire_struct! {
    /// Closes several handles, each as a [`Release`] of (inode, access) would, in order: a
    /// client sends its closes together, off the path of the close. Answers how many of them
    /// were open (a close of a handle not held is skipped, as a lone one fails with EBADF).
    #[derive(Clone, Debug, PartialEq)]
    pub struct ReleaseMany { pub handles: Vec<(Ino, FileAccess)> }
}

wire_struct! {
    /// Sets, changes or removes (kind [`crate::locks::LockKind::Unlock`]) a lock of `owner` (one of the
    /// caller's: fcntl's lock owner, or the open file of a flock) on `ino`, which the session
    /// has open. Answers `None` once done, or a lock of another owner that conflicts (nothing
    /// changed): one held, or one that a caller who asked before with `wait` waits for (locks
    /// are taken in the order they were waited for). A caller with `wait` keeps its place by
    /// asking again within a second, and is told (`Callback::locks_freed`) when a lock of the
    /// file goes. EAGAIN while the node's grace period after a restart lets clients take their
    /// locks again (`reclaim`, refused with EPERM after it): the caller asks again later.
    /// ENOLCK past the ranges a session may hold.
    #[derive(Clone, Debug, PartialEq)]
    pub struct SetLock {
        pub ino: Ino,
        pub owner: u64,
        pub lock: FileLock,
        pub wait: bool,
        pub reclaim: bool,
    }
}

wire_struct! {
    /// A lock of another owner than `owner` that would keep it from taking `lock` on `ino`
    /// (`None`: it could take it). EAGAIN during the grace period, as for [`SetLock`].
    #[derive(Clone, Debug, PartialEq)]
    pub struct GetLock { pub ino: Ino, pub owner: u64, pub lock: FileLock }
}

wire_struct! {
    /// Removes every lock of `owner` on `ino`: a close of the file by a process (fcntl's
    /// locks), or the last close of an open file (its flock).
    #[derive(Clone, Debug, PartialEq)]
    pub struct DropLocks { pub ino: Ino, pub owner: u64 }
}

wire_struct! {
    /// `owner` no longer waits for locks of `ino` (its wait was interrupted, or failed): the
    /// places it kept in the queue go.
    #[derive(Clone, Debug, PartialEq)]
    pub struct CancelWait { pub ino: Ino, pub owner: u64 }
}

wire_struct! {
    /// The state of the cluster, for its operators (`rfs status`): every data node, every
    /// client session, what is short of copies. Only root may ask (`caller`, as the node
    /// treats it: a squashed root may not).
    #[derive(Clone, Debug, PartialEq)]
    pub struct Status { pub caller: Caller }
}

wire_struct! {
    /// Starts (`on`) or ends draining data node `node`: it takes no new chunks, and the
    /// metadata node moves every copy it holds to other nodes, after which it can be stopped
    /// losing nothing (`rfs drain`). Root only, as [`Status`]; ENOENT for an unknown node.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Drain { pub caller: Caller, pub node: u32, pub on: bool }
}

wire_struct! {
    /// Moves copies from the fullest data nodes to the emptiest until every live node's fill
    /// (copies held over its pool) is within a tenth of the mean (`rfs rebalance`). Root only.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Rebalance { pub caller: Caller }
}

wire_struct! {
    /// Forgets data node `node` (`rfs remove`): it is no longer listed, and its pool, were it
    /// to come back, is taken as a new one. Root only, as [`Status`]. ENOENT for an unknown
    /// node, EBUSY for one that is up (stop it first: a data node's SIGTERM drains it),
    /// ENOTEMPTY for one whose copies the maps still name, unless `force` (those chunks then
    /// stay unreadable).
    #[derive(Clone, Debug, PartialEq)]
    pub struct RemoveNode { pub caller: Caller, pub node: u32, pub force: bool }
}

wire_struct! {
    /// The value of `ino`'s extended attribute `name`, if `caller` may read it (ENODATA: none;
    /// see [`crate::xattr::XattrClass`] for who may read what).
    #[derive(Clone, Debug, PartialEq)]
    pub struct GetXattr { pub ino: Ino, pub name: Name, pub caller: Caller }
}

wire_struct! {
    /// The names of `ino`'s extended attributes that `caller` may see (trusted ones: root), as
    /// listxattr(2) hands them out: each ended by a NUL, at most 64 KiB.
    #[derive(Clone, Debug, PartialEq)]
    pub struct ListXattr { pub ino: Ino, pub caller: Caller }
}

wire_struct! {
    /// Sets `ino`'s extended attribute `name` to `value`, with setxattr(2)'s `flags`
    /// ([`crate::xattr::XATTR_CREATE`], [`crate::xattr::XATTR_REPLACE`]); answers the
    /// attributes after (the change time moves).
    #[derive(Clone, Debug, PartialEq)]
    pub struct SetXattr {
        pub ino: Ino,
        pub name: Name,
        pub value: XattrValue,
        pub flags: u32,
        pub caller: Caller,
    }
}

wire_struct! {
    /// Removes `ino`'s extended attribute `name` (ENODATA: none); answers the attributes after.
    #[derive(Clone, Debug, PartialEq)]
    pub struct RemoveXattr { pub ino: Ino, pub name: Name, pub caller: Caller }
}

wire_enum! {
    /// A metadata request, as the service receives it.
    #[derive(Clone, Debug, PartialEq)]
    pub enum Request / RequestOp {
        1 => Lookup,
        2 => GetAttr,
        3 => SetAttr,
        4 => Mknod,
        5 => Mkdir,
        6 => Symlink,
        7 => Readlink,
        8 => Link,
        9 => Unlink,
        10 => Rmdir,
        11 => Rename,
        12 => ReadDir,
        13 => Open,
        14 => Release,
        15 => ChunkMap,
        16 => Allocate,
        17 => Commit,
        18 => GetStatFs,
        19 => ListNodes,
        20 => Create,
        21 => AttachData,
        22 => DropReplicas,
        23 => Reclaim,
        24 => ReleaseMany,
        25 => SetLock,
        26 => GetLock,
        27 => DropLocks,
        28 => CancelWait,
        29 => Status,
        30 => Drain,
        31 => Rebalance,
        32 => RemoveNode,
        33 => GetXattr,
        34 => ListXattr,
        35 => SetXattr,
        36 => RemoveXattr,
    }
}

impl RequestOp {
    /// Whether sending the call again gives what sending it once gives, even after the
    /// service lost the session (and its record of the call: it restarted, or the session
    /// expired): those are resent then; the others fail, as they may have been applied.
    pub fn repeatable(self) -> bool {
        !matches!(
            self,
            RequestOp::Mknod
                | RequestOp::Mkdir
                | RequestOp::Symlink
                | RequestOp::Link
                | RequestOp::Unlink
                | RequestOp::Rmdir
                | RequestOp::Rename
                | RequestOp::Create
                | RequestOp::Reclaim
                | RequestOp::RemoveNode
                | RequestOp::SetXattr
                | RequestOp::RemoveXattr
        )
    }
}

/// A request and the type of its answer.
pub trait Call: Wire + Into<Request> {
    /// This request's op.
    const OP: RequestOp;
    /// What a successful call returns.
    type Reply: Wire;
}

macro_rules! calls {
    ($($req:ident => $reply:ty),* $(,)?) => {$(
        impl Call for $req {
            const OP: RequestOp = RequestOp::$req;
            type Reply = $reply;
        }
    )*};
}

calls! {
    Lookup => Attr,
    GetAttr => Attr,
    SetAttr => Attr,
    Mknod => Made,
    Mkdir => Made,
    Symlink => Made,
    Readlink => Name,
    Link => Made,
    // The directory's attributes after the change; a rename's: the old and the new one's.
    Unlink => Attr,
    Rmdir => Attr,
    Rename => (Attr, Attr),
    ReadDir => Vec<DirEntry>,
    Open => Opened,
    Release => (),
    ChunkMap => FileMap,
    Allocate => FileMap,
    Commit => Committed,
    GetStatFs => StatFs,
    ListNodes => Vec<NodeInfo>,
    Create => Made,
    AttachData => (),
    DropReplicas => u32,
    Reclaim => u32,
    ReleaseMany => u32,
    SetLock => Option<FileLock>,
    GetLock => Option<FileLock>,
    DropLocks => (),
    CancelWait => (),
    Status => ClusterStatus,
    Drain => (),
    Rebalance => (),
    RemoveNode => (),
    GetXattr => XattrValue,
    ListXattr => XattrValue,
    SetXattr => Attr,
    RemoveXattr => Attr,
}

/// The sizing of the metadata protocol's RPC channel, the same on both sides: a call carries
/// up to a 64 KiB attribute value with its name, so messages are up to 80 KiB.
pub const METADATA_RPC: rdmabox::rpc::RpcConfig = rdmabox::rpc::RpcConfig {
    slots: 16,
    max_msg: 80 << 10,
    timeout: std::time::Duration::from_secs(10),
};

/// The bytes of reply that a readdir page may fill, in messages of `max_msg` bytes: what is
/// left after the reply's header (version, op, status), the entry count and the MAC every
/// reply is sealed with ([`crate::integrity`]).
pub fn readdir_budget(max_msg: usize) -> usize {
    max_msg.saturating_sub(3 + 4 + crate::integrity::TAG)
}

/// Bytes before every call: its sequence number in the client's session, the lowest sequence
/// number whose reply the client still waits for (the service forgets the replies below it),
/// and when it was sent with how long the caller waits (see [`crate::clock`]). A call resent
/// after a reconnection keeps its number, so the service answers it from its reply cache
/// instead of applying it twice.
pub const ENVELOPE: usize = 28;

/// What the envelope of a call says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The call's number in the client's session.
    pub seq: u64,
    /// The client's oldest call still unanswered.
    pub oldest: u64,
    /// The client's monotonic clock when it sent the call, in milliseconds.
    pub sent_ms: u64,
    /// How long the client waits for the reply from then, in milliseconds.
    pub budget_ms: u32,
}

/// `call` in its envelope.
pub fn seal(e: &Envelope, call: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(ENVELOPE + call.len());
    b.extend_from_slice(&e.seq.to_le_bytes());
    b.extend_from_slice(&e.oldest.to_le_bytes());
    b.extend_from_slice(&e.sent_ms.to_le_bytes());
    b.extend_from_slice(&e.budget_ms.to_le_bytes());
    b.extend_from_slice(call);
    b
}

/// The envelope and the call of a sealed call.
pub fn unseal(b: &[u8]) -> Option<(Envelope, &[u8])> {
    let u64_at = |at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?));
    let e = Envelope {
        seq: u64_at(0)?,
        oldest: u64_at(8)?,
        sent_ms: u64_at(16)?,
        budget_ms: u32::from_le_bytes(b.get(24..28)?.try_into().ok()?),
    };
    Some((e, &b[ENVELOPE..]))
}

/// Encodes a call as the client sends it.
pub fn encode_call<C: Call>(call: &C) -> Vec<u8> {
    let mut w = Writer::message(C::OP as u8);
    call.put(&mut w);
    w.0
}

const OK: u8 = 0;
const FAILED: u8 = 1;

/// The reply to a request with op code `op`: the answer, or why there is none.
pub fn encode_reply<R: Wire>(op: u8, result: &Result<R, Errno>) -> Vec<u8> {
    let mut w = Writer::message(op);
    match result {
        Ok(r) => {
            OK.put(&mut w);
            r.put(&mut w);
        }
        Err(e) => {
            FAILED.put(&mut w);
            e.put(&mut w);
        }
    }
    w.0
}

/// The reply to `C`; a reply to another op is malformed.
pub fn decode_reply<C: Call>(b: &[u8]) -> Result<Result<C::Reply, Errno>, DecodeError> {
    let mut r = Reader::new(b);
    let op = r.header()?;
    if op != C::OP as u8 {
        return bad(format!("a reply to op {op} for a {:?} request", C::OP));
    }
    let result = match u8::get(&mut r)? {
        OK => Ok(C::Reply::get(&mut r)?),
        FAILED => Err(Errno::get(&mut r)?),
        s => return bad(format!("bad reply status {s}")),
    };
    r.finish()?;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Timestamp;
    use crate::wire::VERSION;

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
            cuts: 7,
            acl: true,
            held: 0,
        }
    }

    const OWNER: Owner = Owner {
        perm: 0o644,
        uid: 1,
        gid: 2,
        umask: 0,
    };

    fn all_requests() -> Vec<Request> {
        let n = || Name::from("näme");
        vec![
            Lookup {
                parent: 1,
                name: n(),
                caller: Caller::default(),
            }
            .into(),
            GetAttr { ino: 2 }.into(),
            SetAttr {
                ino: 3,
                changes: AttrChanges {
                    mode: Some(0o600),
                    uid: None,
                    gid: Some(7),
                    size: Some(1 << 40),
                    atime: None,
                    mtime: Some(Timestamp { secs: 9, nsecs: 10 }),
                    kill_setid: true,
                },
                caller: Caller::default(),
            }
            .into(),
            Mknod {
                parent: 1,
                name: n(),
                kind: FileKind::NamedPipe,
                rdev: 3,
                owner: OWNER,
                caller: Caller::default(),
            }
            .into(),
            Mkdir {
                parent: 1,
                name: n(),
                owner: OWNER,
                caller: Caller::default(),
            }
            .into(),
            Symlink {
                parent: 1,
                name: n(),
                target: "/a/b".into(),
                uid: 1,
                gid: 2,
                caller: Caller::default(),
            }
            .into(),
            Readlink { ino: 4 }.into(),
            Link {
                ino: 4,
                newparent: 1,
                newname: n(),
                caller: Caller::default(),
            }
            .into(),
            Unlink {
                parent: 1,
                name: n(),
                caller: Caller::default(),
            }
            .into(),
            Rmdir {
                parent: 1,
                name: n(),
                caller: Caller::default(),
            }
            .into(),
            Rename {
                parent: 1,
                name: n(),
                newparent: 2,
                newname: "x".into(),
                flags: 1,
                caller: Caller::default(),
            }
            .into(),
            ReadDir {
                ino: 1,
                cookie: 9,
                max: 100,
                caller: Caller::default(),
            }
            .into(),
            Open {
                ino: 4,
                access: FileAccess::READ | FileAccess::WRITE,
                caller: Caller {
                    uid: 1,
                    gid: 2,
                    groups: vec![3, 4],
                },
            }
            .into(),
            Release {
                ino: 4,
                access: FileAccess::READ,
            }
            .into(),
            ChunkMap {
                ino: 4,
                first: 10,
                count: 32,
            }
            .into(),
            Allocate {
                ino: 4,
                offset: 10 << 20,
                end: (42 << 20) + 17,
            }
            .into(),
            Commit {
                ino: 4,
                size: 12345,
                mtime: None,
                cuts: 3,
            }
            .into(),
            GetStatFs {}.into(),
            ListNodes {}.into(),
            Create {
                parent: 1,
                name: n(),
                owner: OWNER,
                access: FileAccess::WRITE,
                caller: Caller::default(),
            }
            .into(),
            AttachData {
                node: 3,
                session: u64::MAX,
            }
            .into(),
            DropReplicas {
                ino: 4,
                index: 2,
                reached: vec![ChunkRef::whole(2, 1 << 20, 1 << 20)],
            }
            .into(),
            Reclaim {
                handles: vec![
                    (4, FileAccess::EXEC),
                    (u64::MAX, FileAccess::WRITE | FileAccess::EXEC),
                ],
            }
            .into(),
            ReleaseMany {
                handles: vec![(4, FileAccess::READ), (5, FileAccess::all())],
            }
            .into(),
            SetLock {
                ino: 4,
                owner: u64::MAX,
                lock: LOCK,
                wait: true,
                reclaim: true,
            }
            .into(),
            GetLock {
                ino: 4,
                owner: 9,
                lock: LOCK,
            }
            .into(),
            DropLocks { ino: 4, owner: 9 }.into(),
            CancelWait { ino: 4, owner: 9 }.into(),
            Status {
                caller: Caller::default(),
            }
            .into(),
            Drain {
                caller: Caller::default(),
                node: 3,
                on: true,
            }
            .into(),
            Rebalance {
                caller: Caller::default(),
            }
            .into(),
            RemoveNode {
                caller: Caller::default(),
                node: 3,
                force: true,
            }
            .into(),
            GetXattr {
                ino: 4,
                name: "user.x".into(),
                caller: Caller::default(),
            }
            .into(),
            ListXattr {
                ino: 4,
                caller: Caller::default(),
            }
            .into(),
            SetXattr {
                ino: 4,
                name: "user.x".into(),
                value: XattrValue(vec![1; 65536]),
                flags: crate::xattr::XATTR_CREATE,
                caller: Caller::default(),
            }
            .into(),
            RemoveXattr {
                ino: 4,
                name: "user.x".into(),
                caller: Caller::default(),
            }
            .into(),
        ]
    }

    const LOCK: FileLock = FileLock {
        start: 1,
        end: crate::locks::TO_END,
        kind: crate::locks::LockKind::Write,
        pid: 42,
    };

    fn all_replies() -> Vec<Vec<u8>> {
        let chunk = ChunkRef {
            node: 1,
            addr: 2,
            rkey: 3,
            lo: 4096,
            len: 8192,
        };
        vec![
            encode_reply::<Attr>(1, &Err(Errno::ENOENT)),
            encode_reply(9, &Ok(())),
            encode_reply(2, &Ok(attr())),
            encode_reply(
                12,
                &Ok(vec![
                    DirEntry {
                        cookie: 3,
                        name: "a".into(),
                        attr: attr(),
                    },
                    DirEntry {
                        cookie: 4,
                        name: "b".into(),
                        attr: attr(),
                    },
                ]),
            ),
            encode_reply(7, &Ok(Name::from("/x"))),
            encode_reply(15, &Ok(vec![(0u64, vec![chunk, chunk])])),
            encode_reply(
                18,
                &Ok(StatFs {
                    chunk_size: 1,
                    bytes_total: 2 << 20,
                    bytes_free: 3 << 20,
                    inodes: 4,
                    inodes_max: 7,
                    lease_ms: 5,
                    replicas: 2,
                    chunks_short: 6,
                }),
            ),
            encode_reply(
                19,
                &Ok(vec![NodeInfo {
                    id: 0,
                    addr: "127.0.0.1:7470".into(),
                    alive: true,
                    meta: true,
                }]),
            ),
            encode_reply(
                RequestOp::Commit as u8,
                &Ok(Committed {
                    before: attr(),
                    after: Attr { size: 9, ..attr() },
                }),
            ),
            encode_reply(RequestOp::SetLock as u8, &Ok(Some(LOCK))),
            encode_reply(RequestOp::GetLock as u8, &Ok(None::<FileLock>)),
            encode_reply(
                RequestOp::GetXattr as u8,
                &Ok(XattrValue(b"value".to_vec())),
            ),
            encode_reply(
                RequestOp::ListXattr as u8,
                &Ok(XattrValue(b"user.a\0security.b\0".to_vec())),
            ),
        ]
    }

    #[test]
    fn every_request_round_trips_and_keeps_its_op() {
        let all = all_requests();
        assert_eq!(all.len(), 36, "one of each");
        for (i, r) in all.iter().enumerate() {
            assert_eq!(r.op() as usize, i + 1);
            assert_eq!(Request::decode(&r.encode()).unwrap(), *r);
        }
        let typed = Lookup {
            parent: 1,
            name: "a".into(),
            caller: Caller::default(),
        };
        assert_eq!(encode_call(&typed), Request::from(typed).encode());
    }

    #[test]
    fn envelopes_round_trip_and_short_ones_are_refused() {
        let e = Envelope {
            seq: 7,
            oldest: 3,
            sent_ms: 1 << 40,
            budget_ms: 5000,
        };
        let b = seal(&e, b"call");
        assert_eq!(unseal(&b), Some((e, &b"call"[..])));
        assert_eq!(unseal(&b[..ENVELOPE - 1]), None);
        assert_eq!(unseal(&b[..ENVELOPE]), Some((e, &b""[..])));
    }

    #[test]
    fn replies_round_trip_for_their_own_call_only() {
        let a = encode_reply(RequestOp::GetAttr as u8, &Ok(attr()));
        assert_eq!(decode_reply::<GetAttr>(&a).unwrap(), Ok(attr()));
        assert!(decode_reply::<Lookup>(&a).is_err(), "another op's reply");
        let e = encode_reply::<()>(RequestOp::Unlink as u8, &Err(Errno::ENOTEMPTY));
        assert_eq!(decode_reply::<Unlink>(&e).unwrap(), Err(Errno::ENOTEMPTY));
        let page = &all_replies()[3];
        assert_eq!(decode_reply::<ReadDir>(page).unwrap().unwrap().len(), 2);
        let nodes = &all_replies()[7];
        assert_eq!(decode_reply::<ListNodes>(nodes).unwrap().unwrap()[0].id, 0);
        let committed = decode_reply::<Commit>(&all_replies()[8]).unwrap().unwrap();
        assert_eq!((committed.before, committed.after.size), (attr(), 9));
        let conflict = decode_reply::<SetLock>(&all_replies()[9]).unwrap();
        assert_eq!(conflict, Ok(Some(LOCK)));
        assert!(decode_reply::<GetLock>(&all_replies()[9]).is_err());
    }

    #[test]
    fn garbage_is_rejected_never_panics() {
        // Every truncation and every single-byte corruption of every message must decode to an
        // error or to some valid message, never panic.
        let msgs: Vec<Vec<u8>> = all_requests()
            .iter()
            .map(Request::encode)
            .chain(all_replies())
            .collect();
        let decode_all = |x: &[u8]| {
            let _ = Request::decode(x);
            let _ = decode_reply::<ReadDir>(x);
            let _ = decode_reply::<ChunkMap>(x);
            let _ = decode_reply::<ListNodes>(x);
            let _ = decode_reply::<GetAttr>(x);
            let _ = decode_reply::<SetLock>(x);
            let _ = crate::hello::Hello::decode(x);
        };
        for m in &msgs {
            for cut in 0..m.len() {
                decode_all(&m[..cut]);
                assert!(
                    Request::decode(&m[..cut]).is_err() || m[..cut].len() < m.len(),
                    "a cut message is never the whole"
                );
            }
            for i in 0..m.len() {
                for v in [0u8, 1, 0x7f, 0xff] {
                    let mut x = m.clone();
                    x[i] = v;
                    decode_all(&x);
                }
            }
            let mut longer = m.clone();
            longer.push(0);
            assert!(Request::decode(&longer).is_err());
        }
        for r in all_requests() {
            let m = r.encode();
            for cut in 0..m.len() {
                assert!(Request::decode(&m[..cut]).is_err(), "{r:?} cut at {cut}");
            }
        }
        assert!(Request::decode(&[VERSION + 1, 1]).is_err(), "wrong version");
        assert!(Request::decode(&[VERSION, 200]).is_err(), "unknown op");
        let mut huge = Writer::message(RequestOp::ReadDir as u8);
        OK.put(&mut huge);
        u32::MAX.put(&mut huge);
        assert!(
            decode_reply::<ReadDir>(&huge.0).is_err(),
            "count over the limit"
        );
    }

    /// Writes the fuzz seeds of requests, replies and callbacks from the messages above, so
    /// that they follow the protocol: `cargo test -p rfs-proto -- --ignored fuzz_seeds`.
    #[test]
    #[ignore]
    fn fuzz_seeds() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/messages");
        let envelope = Envelope {
            seq: 7,
            oldest: 3,
            sent_ms: 1_000,
            budget_ms: 10_000,
        };
        for (i, r) in all_requests().iter().enumerate() {
            std::fs::write(
                dir.join(format!("request-{i}")),
                seal(&envelope, &r.encode()),
            )
            .unwrap();
        }
        for (i, r) in all_replies().iter().enumerate() {
            std::fs::write(dir.join(format!("reply-{i}")), r).unwrap();
        }
        let cb = crate::callback::Callback {
            inodes: vec![crate::callback::Invalidation {
                ino: 7,
                chunks_from: Some(2),
                attr: Some(attr()),
                data: true,
                remapped: true,
            }],
            entries: vec![crate::callback::EntryChange {
                parent: 1,
                name: "a".into(),
            }],
            locks_freed: vec![7],
        };
        std::fs::write(dir.join("callback"), cb.encode()).unwrap();
    }
}
