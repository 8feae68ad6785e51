//! The types both sides share: inode numbers, attributes, chunk references, node descriptions.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::wire::{bad, DecodeError, Reader, Wire, Writer};
use crate::wire_struct;

/// An inode number.
pub type Ino = u64;
/// The root directory's inode number (as FUSE expects).
pub const ROOT: Ino = 1;
/// The longest name a directory entry may have.
pub const NAME_MAX: usize = 255;
/// renameat2(2): fail if the new name exists.
pub const RENAME_NOREPLACE: u32 = 1;
/// renameat2(2): swap the two names.
pub const RENAME_EXCHANGE: u32 = 2;

/// A file name or a symbolic link's target: bytes, as Linux has them (not necessarily UTF-8).
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(pub Vec<u8>);

impl Name {
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Name {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<&[u8]> for Name {
    fn from(b: &[u8]) -> Name {
        Name(b.to_vec())
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Name {
        Name(s.as_bytes().to_vec())
    }
}

impl From<Vec<u8>> for Name {
    fn from(b: Vec<u8>) -> Name {
        Name(b)
    }
}

impl std::fmt::Debug for Name {
    /// As Rust writes a byte string: UTF-8 stays readable, other bytes are escaped.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "\"{}\"", self.0.escape_ascii())
    }
}

/// Names are counted like strings, without the UTF-8 check.
impl Wire for Name {
    fn put(&self, w: &mut Writer) {
        w.counted(&self.0);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Name(r.counted()?.to_vec()))
    }
}

/// A point in time: seconds since the epoch (negative before it) and nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Timestamp {
    /// Whole seconds since 1970-01-01 UTC.
    pub secs: i64,
    /// Nanoseconds past `secs`, below 10^9.
    pub nsecs: u32,
}

impl Timestamp {
    /// The current time.
    pub fn now() -> Timestamp {
        Timestamp::from(SystemTime::now())
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Timestamp {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp {
                secs: d.as_secs() as i64,
                nsecs: d.subsec_nanos(),
            },
            Err(e) => Timestamp {
                secs: -(e.duration().as_secs() as i64),
                nsecs: 0,
            },
        }
    }
}

impl Wire for Timestamp {
    fn put(&self, w: &mut Writer) {
        self.secs.put(w);
        self.nsecs.put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let secs = i64::get(r)?;
        let nsecs = u32::get(r)?;
        if nsecs >= 1_000_000_000 {
            return bad("nanoseconds out of range");
        }
        Ok(Timestamp { secs, nsecs })
    }
}

/// What an inode is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FileKind {
    /// A regular file: its data lives in chunks.
    RegularFile = 1,
    /// A directory.
    Directory = 2,
    /// A symbolic link.
    Symlink = 3,
    /// A FIFO.
    NamedPipe = 4,
    /// A character device node.
    CharDevice = 5,
    /// A block device node.
    BlockDevice = 6,
    /// A Unix socket node.
    Socket = 7,
}

impl Wire for FileKind {
    fn put(&self, w: &mut Writer) {
        (*self as u8).put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(match u8::get(r)? {
            1 => FileKind::RegularFile,
            2 => FileKind::Directory,
            3 => FileKind::Symlink,
            4 => FileKind::NamedPipe,
            5 => FileKind::CharDevice,
            6 => FileKind::BlockDevice,
            7 => FileKind::Socket,
            c => return bad(format!("unknown file kind {c}")),
        })
    }
}

wire_struct! {
    /// An inode's attributes, as stat(2) shows them.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Attr {
        /// Inode number.
        pub ino: Ino,
        /// File type.
        pub kind: FileKind,
        /// Permission bits (07777).
        pub perm: u16,
        /// Hard links.
        pub nlink: u32,
        /// Owner.
        pub uid: u32,
        /// Group.
        pub gid: u32,
        /// Device number of a device node.
        pub rdev: u32,
        /// Size in bytes.
        pub size: u64,
        /// Last access.
        pub atime: Timestamp,
        /// Last data change.
        pub mtime: Timestamp,
        /// Last attribute change.
        pub ctime: Timestamp,
        /// How many times the file was cut (truncated, or given back chunks past its size):
        /// only grows. Clients commit sizes with the count they had heard of, so that one that
        /// missed a cut's callback cannot grow the file back over it.
        pub cuts: u64,
        /// Whether the inode has an access ACL: without one, the question a kernel asks before
        /// it lets someone other than the owner in is answered without asking the node.
        pub acl: bool,
        /// Bytes of pool memory one copy of the file's data takes (each chunk's span, what is
        /// allocated ahead of a writer included): what `st_blocks` and du(1) count.
        pub held: u64,
    }
}

wire_struct! {
    /// A page of a file's chunk map (chunk index and replicas), and the count of cuts of the
    /// file when it was read: a client's write admitted before a later cut must not land
    /// through it.
    #[derive(Clone, Debug, PartialEq, Eq, Default)]
    pub struct FileMap {
        pub cuts: u64,
        pub chunks: Vec<(u64, Replicas)>,
    }
}

wire_struct! {
    /// Who makes a call: the user behind the file-system request, for the service's permission
    /// checks (trusted as NFS's AUTH_SYS is: the client proved it knows the secret).
    #[derive(Clone, Debug, PartialEq, Eq, Default)]
    pub struct Caller {
        pub uid: u32,
        pub gid: u32,
        /// Supplementary groups.
        pub groups: Vec<u32>,
    }
}

/// The most supplementary groups a caller may name (Linux's NGROUPS_MAX).
pub const MAX_GROUPS: usize = 65536;

bitflags::bitflags! {
    /// Access to a file, in access(2)'s bits: what an open asks for, a handle holds and a
    /// permission check wants. Bits the wire does not know make a request malformed (EPROTO).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct FileAccess: u8 {
        /// Reading (R_OK).
        const READ = 4;
        /// Writing (W_OK).
        const WRITE = 2;
        /// Executing (X_OK): an open by execve(2) needs the execute bit and not the read bit;
        /// on a directory, searching it.
        const EXEC = 1;
    }
}

impl Wire for FileAccess {
    fn put(&self, w: &mut Writer) {
        self.bits().put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let bits = u8::get(r)?;
        FileAccess::from_bits(bits)
            .map_or_else(|| bad(format!("unknown access bits {bits:#x}")), Ok)
    }
}

wire_struct! {
    /// The attributes a setattr changes (chmod, chown, truncate, utimens); `None` keeps one.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct AttrChanges {
        /// New mode (permission bits).
        pub mode: Option<u32>,
        /// New owner.
        pub uid: Option<u32>,
        /// New group.
        pub gid: Option<u32>,
        /// New size (truncate).
        pub size: Option<u64>,
        /// New access time.
        pub atime: Option<Timestamp>,
        /// New modification time.
        pub mtime: Option<Timestamp>,
        /// Clear what a write by someone without CAP_FSETID clears: the set-ID bits of
        /// [`setid_cleared_by_write`] and the file capabilities (`security.capability`), as
        /// the node holds them now (a chmod meanwhile is not undone). The owner's, or a
        /// writer's, to ask.
        pub kill_setid: bool,
    }
}

/// The set-ID bits of `perm` that a write by someone without CAP_FSETID clears: set-user-ID,
/// and set-group-ID on a group-executable file (without group execute it marks mandatory
/// locking, and stays).
pub fn setid_cleared_by_write(perm: u32) -> u32 {
    let mut bits = perm & 0o4000;
    if perm & 0o2010 == 0o2010 {
        bits |= 0o2000;
    }
    bits
}

wire_struct! {
    /// Who creates a node, and with which permission bits.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Owner {
        /// Permission bits, as the creator asked for them.
        pub perm: u16,
        /// The creator's user.
        pub uid: u32,
        /// The creator's group.
        pub gid: u32,
        /// The creator's umask: the node takes it out of `perm` unless the parent directory
        /// has a default ACL, which decides instead (as on a local file system with ACLs).
        pub umask: u16,
    }
}

wire_struct! {
    /// One entry of a directory listing; `cookie` resumes the listing after this entry.
    #[derive(Clone, Debug, PartialEq)]
    pub struct DirEntry {
        /// Where the next page starts.
        pub cookie: u64,
        /// The entry's name.
        pub name: Name,
        /// The entry's attributes (readdirplus).
        pub attr: Attr,
    }
}

wire_struct! {
    /// Where one chunk of a file lives: a data node and a range of its registered pool.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct ChunkRef {
        /// The data node's id.
        pub node: u32,
        /// The chunk's first byte in the node's pool.
        pub addr: u64,
        /// The key this client's data session reaches the chunk by (granted at the data node
        /// for this session only); 0: not granted, the session is to be attached first.
        pub rkey: u32,
        /// The span of the chunk this copy holds: `[lo, lo + len)` of the chunk is at `addr`
        /// on; the rest of the chunk is a hole (reads zeros, writes allocate first).
        pub lo: u32,
        pub len: u32,
    }
}

impl ChunkRef {
    /// A copy of the whole of a chunk of `chunk_size` bytes at `addr` of node `node`.
    pub fn whole(node: u32, addr: u64, chunk_size: u64) -> ChunkRef {
        ChunkRef {
            node,
            addr,
            rkey: 0,
            lo: 0,
            len: chunk_size as u32,
        }
    }

    /// Where the copy's bytes are, as (node, first address): what names it, whatever its key
    /// and however its span grew in place.
    pub fn place(&self) -> (u32, u64) {
        (self.node, self.addr)
    }

    /// The span's end within the chunk.
    pub fn hi(&self) -> u64 {
        self.lo as u64 + self.len as u64
    }

    /// Whether `[offset, offset + len)` of the chunk lies in the span.
    pub fn holds(&self, offset: u64, len: u64) -> bool {
        offset >= self.lo as u64 && offset + len <= self.hi()
    }

    /// The pool address of byte `offset` of the chunk (within the span).
    pub fn addr_of(&self, offset: u64) -> u64 {
        self.addr + offset - self.lo as u64
    }
}

/// Where one chunk of a file lives: one reference per replica, each on a different data node
/// (as many as the file system's replica count, fewer while a lost one is being replaced).
pub type Replicas = Vec<ChunkRef>;

/// The most replicas a file system may keep of each chunk.
pub const MAX_REPLICAS: u32 = 4;

wire_struct! {
    /// A data node as `rfs status` shows it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct NodeStatus {
        pub id: u32,
        pub addr: String,
        /// "up"; "draining" (up, taking no new chunks, its copies moving elsewhere); "away"
        /// (not up, and may come back with its pool: it left, or is known from before a
        /// restart of the metadata node); "down" (its pool is gone: a new node joined from its
        /// address). `rfs remove` takes a node that is not up off the list.
        pub state: String,
        /// Whether it is the metadata node's own pool.
        pub meta: bool,
        pub pool_bytes: u64,
        /// What can be allocated there now, and the whole chunks of it.
        pub free_bytes: u64,
        pub free_chunks: u64,
        /// Copies of chunks there that file maps name: none left, it can be stopped losing
        /// nothing.
        pub copies: u64,
        /// Chunks whose only copies are there: what is lost with it.
        pub only_copies: u64,
    }
}

wire_struct! {
    /// A client session as `rfs status` shows it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct ClientStatus {
        /// The id the client chose.
        pub client: u64,
        /// Where its connection comes from (its last one, while it is away).
        pub addr: String,
        /// Whether a connection carries the session now (else the grace period runs).
        pub connected: bool,
        /// Seconds since the session began.
        pub age_secs: u64,
        /// Files it holds open; None when its session was busy with a call just then.
        pub open_files: Option<u32>,
        /// Byte-range locks it holds.
        pub locks: u32,
    }
}

wire_struct! {
    /// The cluster, as the metadata node sees it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct ClusterStatus {
        pub nodes: Vec<NodeStatus>,
        pub clients: Vec<ClientStatus>,
        pub replicas: u32,
        /// Chunks with fewer copies than `replicas`, waiting to be copied again.
        pub chunks_short: u64,
        /// Of those, at most [`SHORT_LISTED`], file by file.
        pub short: Vec<ShortChunk>,
        /// Copies the repair thread made since the metadata node started, and their bytes.
        pub repaired_chunks: u64,
        pub repaired_bytes: u64,
        pub chunk_size: u64,
        pub inodes: u64,
        pub inodes_max: u64,
        /// Whether copies are moving to even out the nodes' fill (`rfs rebalance`).
        pub rebalancing: bool,
    }
}

/// Chunks short of copies that a status lists by name.
pub const SHORT_LISTED: usize = 100;

wire_struct! {
    /// A chunk with fewer copies than the file system keeps.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct ShortChunk {
        pub ino: u64,
        /// Its index in the file.
        pub index: u64,
        /// Copies on nodes that count (up, or away while the metadata node awaits them).
        pub copies: u32,
    }
}

impl ClusterStatus {
    /// The data node `name` names: its id, or its address (the newest node there: one that
    /// left and joined again has a new id).
    pub fn node(&self, name: &str) -> Option<&NodeStatus> {
        self.nodes
            .iter()
            .filter(|n| n.addr == name || name.parse() == Ok(n.id))
            .max_by_key(|n| (n.state != "down", n.id))
    }
}

wire_struct! {
    /// A data node as the metadata service knows it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct NodeInfo {
        /// The node's id (0: the metadata node).
        pub id: u32,
        /// host:port where clients reach the node's data service.
        pub addr: String,
        /// False once the node left.
        pub alive: bool,
        /// The metadata node's own pool: reached at the metadata node's address.
        pub meta: bool,
    }
}

wire_struct! {
    /// The file system's capacity, for statfs(2).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct StatFs {
        /// Bytes per chunk.
        pub chunk_size: u64,
        /// Bytes across every node (as files see them: a byte of every copy counts once).
        pub bytes_total: u64,
        /// Bytes that can be allocated now (or once freed space is zeroed).
        pub bytes_free: u64,
        /// Inodes in use.
        pub inodes: u64,
        /// The most inodes the namespace holds (`df -i`): creates past it fail with ENOSPC.
        pub inodes_max: u64,
        /// How long the service waits for a client to answer a callback before it takes the
        /// client's chunk references as dropped; clients refetch chunk maps older than this
        /// (less their I/O deadline), in milliseconds.
        pub lease_ms: u64,
        /// Copies the file system keeps of each chunk.
        pub replicas: u32,
        /// Chunks with fewer copies than that, waiting to be copied again (0: all whole).
        pub chunks_short: u64,
    }
}

/// Bytes an [`Attr`] takes on the wire (every field has a fixed size; a test holds this to its
/// encoding).
const ATTR_WIRE_LEN: usize = 8 + 1 + 2 + 4 + 4 + 4 + 4 + 8 + 3 * 12 + 8 + 1 + 8;

impl DirEntry {
    /// Bytes this entry takes in a readdir reply, so that a page can be cut to fit a message.
    pub fn wire_len(&self) -> usize {
        8 + 2 + self.name.0.len() + ATTR_WIRE_LEN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dir_entry_says_its_size_on_the_wire() {
        let attr = Attr {
            ino: 1,
            kind: FileKind::RegularFile,
            perm: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            atime: Timestamp::default(),
            mtime: Timestamp::default(),
            ctime: Timestamp::default(),
            cuts: 0,
            acl: true,
            held: 4096,
        };
        let e = DirEntry {
            cookie: 3,
            name: Name(b"name".to_vec()),
            attr,
        };
        let mut w = Writer::default();
        e.put(&mut w);
        assert_eq!(e.wire_len(), w.0.len());
    }

    #[test]
    fn access_bits_are_access2s_and_no_others_decode() {
        assert_eq!(
            (
                FileAccess::READ.bits(),
                FileAccess::WRITE.bits(),
                FileAccess::EXEC.bits()
            ),
            (libc::R_OK as u8, libc::W_OK as u8, libc::X_OK as u8)
        );
        for bits in 0..=u8::MAX {
            let got = FileAccess::get(&mut Reader::new(&[bits]));
            assert_eq!(got.is_ok(), bits < 8, "{bits:#x}: {got:?}");
        }
        let mut w = Writer(Vec::new());
        (FileAccess::READ | FileAccess::EXEC).put(&mut w);
        assert_eq!(w.0, [5]);
    }

    #[test]
    fn names_are_bytes_and_entries_know_their_size() {
        let e = DirEntry {
            cookie: 3,
            name: Name(vec![b'c', b'a', b'f', 0xe9, 0xff]),
            attr: Attr {
                ino: 9,
                kind: FileKind::RegularFile,
                perm: 0o644,
                nlink: 1,
                uid: 0,
                gid: 0,
                rdev: 0,
                size: 0,
                atime: Timestamp::default(),
                mtime: Timestamp::default(),
                ctime: Timestamp::default(),
                cuts: 0,
                acl: false,
                held: 0,
            },
        };
        let mut w = Writer::default();
        e.put(&mut w);
        assert_eq!(w.0.len(), e.wire_len());
        let back = DirEntry::get(&mut Reader::new(&w.0)).unwrap();
        assert_eq!(back, e, "bytes that are not UTF-8 survive");
        assert_eq!(format!("{:?}", e.name), "\"caf\\xe9\\xff\"");
    }
}
