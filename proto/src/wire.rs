//! The encoding every message uses: little-endian integers, length-prefixed strings, tagged
//! options and counted lists. [`Wire`] puts and gets one value; [`wire_struct!`] writes a
//! struct's encoding and decoding from its one field list, so they cannot drift apart.
//!
//! Decoding checks every length and count against its limit before it takes anything (and
//! allocates nothing up front), and a message with trailing bytes is refused.

use std::fmt;

use crate::errno::Errno;

/// The protocol version every message starts with. 2: requests are structs, and a reply
/// carries its request's op and a status. 3: callbacks on a second queue pair, the lease in StatFs.
/// 7: chunk maps carry every replica of a chunk; DropReplicas (keep what a write reached);
/// callbacks say when a map was
/// remapped (replicas moved) rather than cut. 8: a joining node names its pool (a restarted
/// metadata node knows it again), Reclaim, the metadata node's own pool marked in node lists.
/// 9: calls that change a directory answer its attributes after the change. 10: ReleaseMany.
/// 11: attributes count a file's cuts, and a commit says the count its size was made with.
/// 12: a commit answers the attributes before it as well as after. 13: calls that look in or
/// change a directory say who makes them (the node checks the directory's mode bits).
/// 14: file locks (SetLock, GetLock, DropLocks). 15: lock waiters queue (SetLock.wait,
/// CancelWait, callbacks' locks_freed). 16: calls, replies, callbacks, their answers and pool
/// descriptors carry a MAC by the connection's session key ([`crate::integrity`]).
/// 18: statfs says the most inodes the namespace holds (`StatFs::inodes_max`).
/// 19: chunk maps carry the file's count of cuts ([`crate::types::FileMap`]), and the
/// metadata node zeroes the tail of the chunk a cut splits; `Drain` moves a node's copies off,
/// `Rebalance` evens the nodes' fill out. 20: a chunk's copy may hold a span of it
/// ([`crate::types::ChunkRef`]), and `Allocate` asks for bytes, not chunks. 21: queue pairs
/// are bound to their control connection (its MAC on the endpoints and in each tcp queue
/// pair's hello), and `Open` answers the first chunks of the map too
/// ([`crate::message::Opened`]). 22: `RemoveNode`. 23: extended attributes (`GetXattr`,
/// `ListXattr`, `SetXattr`, `RemoveXattr`), and metadata calls of up to 80 KiB (a 64 KiB value
/// with its name). 24: a new node's [`crate::types::Owner`] carries the creator's umask (the
/// metadata node applies it, or the parent's default ACL instead), and attributes say whether
/// the inode has an access ACL ([`crate::types::Attr::acl`]). 25: the cluster's status lists
/// chunks short of copies and the repair's progress, and each node's only copies
/// ([`crate::types::ClusterStatus`]).
pub const VERSION: u8 = 25;
/// Bounds what one list (readdir page, chunk map, node list) may carry: a message is at most
/// 80 KiB.
pub const MAX_LIST: u32 = 256;
/// The longest string a peer may send.
pub const MAX_STRING: usize = 4096;

/// Why bytes from a peer are not a valid message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Fails a decode with `why`.
pub fn bad<T>(why: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(why.into()))
}

/// A message being encoded.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// A message with the version byte and `op` written.
    pub fn message(op: u8) -> Writer {
        Writer(vec![VERSION, op])
    }

    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }

    /// Bytes counted by a u16 (strings, names); cut at 64 KiB, which no receiver accepts.
    pub(crate) fn counted(&mut self, b: &[u8]) {
        let b = &b[..b.len().min(u16::MAX as usize)];
        (b.len() as u16).put(self);
        self.bytes(b);
    }
}

/// A message being decoded.
pub struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// Reads `b`.
    pub fn new(b: &'a [u8]) -> Self {
        Reader(b)
    }

    /// Checks the version byte and returns the op code that follows it.
    pub fn header(&mut self) -> Result<u8, DecodeError> {
        let v = u8::get(self)?;
        if v != VERSION {
            return bad(format!("protocol version {v}, this node speaks {VERSION}"));
        }
        u8::get(self)
    }

    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The next `n` bytes (refused if fewer are left).
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
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

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// Bytes counted by a u16, refused over [`MAX_STRING`].
    pub(crate) fn counted(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = u16::get(self)? as usize;
        if n > MAX_STRING {
            return bad(format!("{n} bytes over the {MAX_STRING} limit"));
        }
        self.take(n)
    }

    /// Refuses trailing bytes.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            bad(format!("{} trailing bytes", self.0.len()))
        }
    }
}

/// A value with a wire encoding.
pub trait Wire: Sized {
    /// Appends the encoding of `self`.
    fn put(&self, w: &mut Writer);
    /// Takes one value, checking every length and count.
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError>;
}

macro_rules! wire_int {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn put(&self, w: &mut Writer) {
                w.bytes(&self.to_le_bytes());
            }
            fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
                Ok(<$t>::from_le_bytes(r.array()?))
            }
        }
    )*};
}

wire_int!(u8, u16, u32, u64, i64);

impl Wire for bool {
    fn put(&self, w: &mut Writer) {
        (*self as u8).put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => bad("bad bool"),
        }
    }
}

impl Wire for () {
    fn put(&self, _: &mut Writer) {}
    fn get(_: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(())
    }
}

impl Wire for String {
    fn put(&self, w: &mut Writer) {
        w.counted(self.as_bytes());
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        String::from_utf8(r.counted()?.to_vec()).or_else(|_| bad("string is not UTF-8"))
    }
}

impl<T: Wire> Wire for Option<T> {
    fn put(&self, w: &mut Writer) {
        match self {
            None => 0u8.put(w),
            Some(x) => {
                1u8.put(w);
                x.put(w);
            }
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(None),
            1 => Ok(Some(T::get(r)?)),
            _ => bad("bad option tag"),
        }
    }
}

/// Lists are counted, and refused over [`MAX_LIST`] before anything is allocated.
impl<T: Wire> Wire for Vec<T> {
    fn put(&self, w: &mut Writer) {
        (self.len() as u32).put(w);
        for x in self {
            x.put(w);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = u32::get(r)?;
        if n > MAX_LIST {
            return bad(format!("list of {n} over the {MAX_LIST} limit"));
        }
        (0..n).map(|_| T::get(r)).collect()
    }
}

impl<A: Wire, B: Wire> Wire for (A, B) {
    fn put(&self, w: &mut Writer) {
        self.0.put(w);
        self.1.put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok((A::get(r)?, B::get(r)?))
    }
}

impl Wire for Errno {
    fn put(&self, w: &mut Writer) {
        (self.raw() as u32).put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Errno::from_raw(u32::get(r)? as i32))
    }
}

/// A struct whose wire encoding is its fields in order: the field list is written once, and
/// both directions follow from it.
#[macro_export]
macro_rules! wire_struct {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty),* $(,)? }) => {
        $(#[$m])*
        pub struct $name { $($(#[$fm])* pub $f: $t),* }

        impl $crate::wire::Wire for $name {
            fn put(&self, _w: &mut $crate::wire::Writer) {
                $($crate::wire::Wire::put(&self.$f, _w);)*
            }
            fn get(_r: &mut $crate::wire::Reader<'_>) -> Result<Self, $crate::wire::DecodeError> {
                Ok($name { $($f: $crate::wire::Wire::get(_r)?),* })
            }
        }
    };
}

/// A family of messages told apart by a `#[repr(u8)]` op code: the enum of op codes, the enum
/// of messages (one variant per message struct), `From` each struct, and the framed encoding
/// (version, op, fields).
#[macro_export]
macro_rules! wire_enum {
    ($(#[$m:meta])* pub enum $name:ident / $op:ident { $($code:literal => $variant:ident),* $(,)? }) => {
        #[doc = concat!("The op code of each [`", stringify!($name), "`].")]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum $op { $(#[doc = concat!("[`", stringify!($variant), "`]")] $variant = $code),* }

        impl $op {
            /// The op with this code, if there is one.
            pub fn from_code(code: u8) -> Option<$op> {
                match code {
                    $($code => Some($op::$variant),)*
                    _ => None,
                }
            }
        }

        $(#[$m])*
        pub enum $name { $(#[doc = concat!("See [`", stringify!($variant), "`].")] $variant($variant)),* }

        $(impl From<$variant> for $name {
            fn from(m: $variant) -> $name {
                $name::$variant(m)
            }
        })*

        impl $name {
            /// Which message this is.
            pub fn op(&self) -> $op {
                match self {
                    $($name::$variant(_) => $op::$variant,)*
                }
            }

            /// Version, op code, fields.
            pub fn encode(&self) -> Vec<u8> {
                let mut w = $crate::wire::Writer::message(self.op() as u8);
                match self {
                    $($name::$variant(m) => $crate::wire::Wire::put(m, &mut w),)*
                }
                w.0
            }

            /// The message in `b`, all of `b`.
            pub fn decode(b: &[u8]) -> Result<$name, $crate::wire::DecodeError> {
                let mut r = $crate::wire::Reader::new(b);
                let code = r.header()?;
                let m = match $op::from_code(code) {
                    $(Some($op::$variant) => $name::$variant($crate::wire::Wire::get(&mut r)?),)*
                    None => {
                        return $crate::wire::bad(format!(
                            "unknown {} {code}",
                            stringify!($name).to_lowercase()
                        ))
                    }
                };
                r.finish()?;
                Ok(m)
            }
        }
    };
}
