//! What names a registered region: the rights it was registered with, and the address and key
//! by which a peer reaches it.

use std::fmt;

/// Access rights of a memory region, as `ibv_access_flags`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// The local side may write it: receives and READ results land in it.
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may WRITE into it.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may READ from it.
    pub const REMOTE_READ: Access = Access(4);
    /// What a region lent to remote peers for one-sided I/O needs.
    pub const ALL: Access = Access(1 | 2 | 4);

    /// The flags as `ibv_access_flags` bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Whether every right in `other` is granted.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// The rights among `bits` that the model knows; other bits are dropped.
    pub const fn from_bits_truncate(bits: u32) -> Access {
        Access(bits & 7)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Access::LOCAL_WRITE, "LOCAL_WRITE"),
            (Access::REMOTE_WRITE, "REMOTE_WRITE"),
            (Access::REMOTE_READ, "REMOTE_READ"),
        ];
        let set: Vec<_> = names
            .iter()
            .filter(|(a, _)| self.contains(*a))
            .map(|(_, n)| *n)
            .collect();
        write!(f, "Access({})", set.join("|"))
    }
}

/// Where a one-sided operation lands in the peer's memory: a virtual address inside one of its
/// registered regions and that region's rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Virtual address in the peer's address space.
    pub addr: u64,
    /// Key of the peer's region that contains it.
    pub rkey: u32,
}

/// A peer's registered region as it is advertised over the control connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Start of the region in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The key one-sided operations on it must carry.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The remote address `offset` bytes into this region, or None past its end.
    pub fn at(&self, offset: u64) -> Option<RemoteAddr> {
        (offset <= self.len).then(|| RemoteAddr {
            addr: self.addr + offset,
            rkey: self.rkey,
        })
    }
}
