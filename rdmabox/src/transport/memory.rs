//! Memory regions: memory a provider may read and write on a peer's behalf, with the keys that
//! name it locally (lkey) and remotely (rkey).
//!
//! Registered memory is shared with the network the way an `mmap(MAP_SHARED)` mapping is shared
//! with other processes: a peer may write it at any moment. So this module never hands out `&[u8]`
//! or `&mut [u8]` over it; data moves in and out by copies through raw pointers (`read_at`,
//! `write_at`), and providers DMA (or `readv`/`writev`) to raw addresses. The one exception is
//! the session's staging pool (`mr_pool`): registered for local access only, so no peer can
//! write it, and private to the session, which lends a slot's bytes to a read's callback only
//! once the transfer into it is over.

use std::fmt;
use std::io;
use std::sync::Arc;

use super::region::{Access, RemoteRegion};

/// Where a region's bytes come from; dropped after the registration that covers them.
pub(crate) enum Backing {
    /// Anonymous mapping owned by the region (`ProtectionDomain::alloc_region`).
    Mapped { ptr: *mut u8, len: usize },
    /// A caller's vector, owned by the region until `into_vec` (`register_vec`).
    Vec {
        ptr: *mut u8,
        len: usize,
        cap: usize,
    },
    /// Caller-owned memory (`register_raw`): the caller keeps it alive.
    Borrowed,
    /// Part of another region (`register_within`), kept alive by holding it.
    Within { _parent: Arc<MrInner> },
    /// Memory owned outside the library (`register_landing`), kept alive by holding it.
    External {
        _memory: Arc<dyn super::landing::ExternalMemory>,
    },
    /// Already handed back by `into_vec`.
    Taken,
}

impl Backing {
    pub(crate) fn mapped(len: usize) -> io::Result<Backing> {
        if len == 0 {
            return Ok(Backing::Vec {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len: 0,
                cap: 0,
            });
        }
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if len >= 2 << 20 {
            // SAFETY: advice on the mapping just created; failure only means no huge pages.
            unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        }
        Ok(Backing::Mapped {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(crate) fn from_vec(v: Vec<u8>) -> Backing {
        let mut v = std::mem::ManuallyDrop::new(v);
        Backing::Vec {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            cap: v.capacity(),
        }
    }

    pub(crate) fn take_vec(&mut self) -> Option<Vec<u8>> {
        let Backing::Vec { ptr, len, cap } = *self else {
            return None;
        };
        // SAFETY: overwrite without dropping the old value: its vector is the one we return.
        unsafe { std::ptr::write(self, Backing::Taken) };
        // SAFETY: ptr/len/cap came from a Vec<u8> in `from_vec` and were never freed.
        Some(unsafe { Vec::from_raw_parts(ptr, len, cap) })
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        match *self {
            // SAFETY: the mapping was created in `mapped` with this length and is unmapped once.
            Backing::Mapped { ptr, len } => unsafe {
                libc::munmap(ptr.cast(), len);
            },
            // SAFETY: ptr/len/cap came from a Vec<u8> in `from_vec` and were never freed.
            Backing::Vec { ptr, len, cap } => unsafe { drop(Vec::from_raw_parts(ptr, len, cap)) },
            Backing::Borrowed
            | Backing::Within { .. }
            | Backing::External { .. }
            | Backing::Taken => {}
        }
    }
}

/// A provider's record of a registration: dropping it deregisters.
pub(crate) trait Registration: Send + Sync {
    /// The region is dropped: from now on no peer's access may reach it, even while transfers
    /// under way still hold its memory (verbs: nothing to do, only our own work requests hold
    /// it and `ibv_dereg_mr` at the drop is enough).
    fn revoke(&self, _region: &MrInner) {}
}

pub(crate) struct MrInner {
    // Field order matters: the registration is dropped (deregistered) before the memory is freed.
    pub(crate) registration: Box<dyn Registration>,
    pub(crate) backing: Backing,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) access: Access,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    /// Identifies the protection domain, so that a provider can refuse foreign regions.
    pub(crate) pd_id: u64,
}

// SAFETY: MrInner owns (or, for `register_raw`, was promised) memory that outlives it, and all
// access to that memory goes through raw-pointer copies (or a staging slot's bytes lent while
// nothing can write them: see the module comment); nothing in it is tied to a thread.
unsafe impl Send for MrInner {}
// SAFETY: see Send; shared access is by raw-pointer copies, as with shared memory.
unsafe impl Sync for MrInner {}

impl MrInner {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
}

/// A registered memory region. Dropping it deregisters it: from then on the peer's accesses with
/// its rkey fail, and none touches its memory (an access under way stops where it is).
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // Providers that hold the region for transfers under way must stop using it now, not
        // when the last of them lets go.
        self.inner.registration.revoke(&self.inner);
    }
}

impl MemoryRegion {
    /// Start of the region in this process's address space (also its address for peers).
    pub fn addr(&self) -> u64 {
        self.inner.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// The key our own work requests name it by in their SGEs.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }
    /// The key a peer names it by in one-sided READs and WRITEs.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }
    /// What the region was registered to allow.
    pub fn access(&self) -> Access {
        self.inner.access
    }
    /// The descriptor a peer needs to READ/WRITE this whole region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }
    /// The whole region as one scatter/gather element.
    pub fn sge(&self) -> super::Sge<'_> {
        super::Sge {
            mr: self,
            offset: 0,
            len: self.len(),
        }
    }
    /// `len` bytes at `offset`, or None when the range leaves the region.
    pub fn slice(&self, offset: usize, len: usize) -> Option<super::Sge<'_>> {
        super::Sge::new(self, offset, len)
    }

    fn check(&self, offset: usize, len: usize) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("range {offset}+{len} outside a {}-byte region", self.len()),
            )),
        }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> io::Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: bounds checked above; the region's memory lives as long as `self.inner`;
        // `src` cannot overlap it: the only references into region memory are a staging
        // slot's bytes lent to a read's callback (mr_pool), which no caller can write back
        // into a region (writes are submitted as vectors of their own).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.inner.ptr().add(offset), src.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` of the region into `dst`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: as in `write_at`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.inner.ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> io::Result<()> {
        self.check(offset, len)?;
        // SAFETY: as in `write_at`.
        unsafe { std::ptr::write_bytes(self.inner.ptr().add(offset), byte, len) };
        Ok(())
    }

    /// Copies the region's bytes out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v).expect("whole region is in bounds");
        v
    }

    /// Deregisters a region made by `register_vec` and returns the vector without a copy. Gives
    /// the region back unchanged when it is not vector-backed or a provider still uses it.
    pub fn into_vec(self) -> Result<Vec<u8>, MemoryRegion> {
        if !matches!(self.inner.backing, Backing::Vec { .. }) {
            return Err(self);
        }
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped or used again, so the Arc is moved out exactly once.
        let inner = unsafe { std::ptr::read(&this.inner) };
        match Arc::try_unwrap(inner) {
            Ok(inner) => {
                let MrInner {
                    registration,
                    mut backing,
                    ..
                } = inner;
                drop(registration);
                Ok(backing.take_vec().expect("checked vector backing"))
            }
            Err(inner) => Err(MemoryRegion { inner }),
        }
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .finish()
    }
}

/// One scatter/gather element: a byte range of a local registered region. Built only through
/// [`Sge::new`], so it is always inside its region.
#[derive(Clone, Copy)]
pub struct Sge<'a> {
    pub(crate) mr: &'a MemoryRegion,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl<'a> Sge<'a> {
    /// `len` bytes at `offset` of `mr`; None when the range leaves the region.
    pub fn new(mr: &'a MemoryRegion, offset: usize, len: usize) -> Option<Sge<'a>> {
        let end = offset.checked_add(len)?;
        (end <= mr.len() && len <= u32::MAX as usize).then_some(Sge { mr, offset, len })
    }
    /// Bytes in the element.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the element has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The virtual address this element starts at (what a NIC would DMA from).
    pub fn addr(&self) -> u64 {
        self.mr.addr() + self.offset as u64
    }
}

impl fmt::Debug for Sge<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Sge(lkey {:#x} +{} len {})",
            self.mr.lkey(),
            self.offset,
            self.len
        )
    }
}
