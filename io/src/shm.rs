//! Memory shared between an application and fs-client: a memfd, sealed against shrinking (so
//! that no side can make the other's accesses fault), mapped by both ([`SharedMemory`]).
//! Huge-page memfds are refused: a hole in one may not fault back in. (A page the other side
//! punches out of a small-page memfd faults back in, but may fail to where memory is short:
//! fs-client guards its mappings against that.)
//!
//! The other process may write any byte at any moment, so nothing here hands out references
//! into the mapping: bytes are copied in and out through raw pointers, entries read and
//! written whole, counters touched only as atomics.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use crate::layout::Pod;

/// A mapping of shared memory, unmapped when dropped.
#[derive(Debug)]
pub struct SharedMemory {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is only touched through raw-pointer copies and atomics (never through
// references), so threads may share it as processes do.
unsafe impl Send for SharedMemory {}
// SAFETY: as for Send.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// New zeroed shared memory of `len` bytes, named `name` (as /proc shows it).
    pub fn create(name: &CStr, len: usize) -> io::Result<SharedMemory> {
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
        nix::unistd::ftruncate(&fd, len as libc::off_t)?;
        fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL),
        )?;
        SharedMemory::map_fd(fd, len)
    }

    /// Maps `len` bytes of the memfd `fd` another process made: refused unless
    /// [`check_shared`] takes it.
    pub fn map(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        check_shared(&fd, len as u64)?;
        SharedMemory::map_fd(fd, len)
    }

    fn map_fd(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        let Some(length) = std::num::NonZeroUsize::new(len) else {
            return Err(invalid("empty shared memory"));
        };
        // SAFETY: a new shared mapping of a file we hold, placed by the kernel: it aliases no
        // memory of ours. Its contents are only reached through this type.
        let ptr = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }?;
        Ok(SharedMemory {
            ptr: ptr.cast(),
            len,
            fd,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, to pass to the other process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The mapping's first byte, for callers that hand its memory on (a NumPy view, a C
    /// caller): what they do there is theirs to make sound.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether `len` bytes at `at` are inside.
    pub fn holds(&self, at: u64, len: u64) -> bool {
        at.checked_add(len)
            .is_some_and(|end| end <= self.len as u64)
    }

    /// The counter at `at` (4-byte aligned, inside).
    pub fn counter(&self, at: usize) -> &AtomicU32 {
        assert!(
            at.is_multiple_of(4) && self.holds(at as u64, 4),
            "counter at {at}"
        );
        // SAFETY: inside the mapping (checked) and aligned (the mapping is page-aligned and
        // `at` a multiple of 4); an AtomicU32 has u32's layout, and atomics are sound across
        // processes sharing the memory. The reference lives no longer than `self`'s mapping.
        unsafe { &*self.ptr.as_ptr().add(at).cast::<AtomicU32>() }
    }

    /// The entry at `at`, copied out whole.
    pub fn read<T: Pod>(&self, at: usize) -> T {
        assert!(
            self.holds(at as u64, size_of::<T>() as u64),
            "entry at {at}"
        );
        // SAFETY: inside the mapping (checked); a volatile read of plain data (any bit pattern
        // is a valid T) that the other process may be writing meanwhile: we get some value.
        unsafe { self.ptr.as_ptr().add(at).cast::<T>().read_volatile() }
    }

    /// Writes the entry at `at` whole.
    pub fn write<T: Pod>(&self, at: usize, value: T) {
        assert!(
            self.holds(at as u64, size_of::<T>() as u64),
            "entry at {at}"
        );
        // SAFETY: as for `read`; nothing of ours holds a reference into the mapping.
        unsafe { self.ptr.as_ptr().add(at).cast::<T>().write_volatile(value) }
    }

    /// Copies `out.len()` bytes at `at` into `out`; false if they are not all inside.
    pub fn copy_out(&self, at: u64, out: &mut [u8]) -> bool {
        if !self.holds(at, out.len() as u64) {
            return false;
        }
        // SAFETY: the source is inside the mapping (checked) and cannot overlap `out`, which
        // is our own memory; bytes the other process changes meanwhile come out as some bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(at as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        true
    }

    /// Copies `data` to `at`; false if it does not fit inside.
    pub fn copy_in(&self, at: u64, data: &[u8]) -> bool {
        if !self.holds(at, data.len() as u64) {
            return false;
        }
        // SAFETY: as for `copy_out`, the other way.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.as_ptr().add(at as usize),
                data.len(),
            )
        };
        true
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping, of `len` bytes; no reference into it outlives `self`.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

impl AsRawFd for SharedMemory {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// Whether `fd` is shared memory another process may hand us: a memfd sealed against
/// shrinking, not of huge pages, at least `len` bytes long.
pub fn check_shared(fd: &OwnedFd, len: u64) -> io::Result<()> {
    let seals =
        fcntl(fd, FcntlArg::F_GET_SEALS).map_err(|_| invalid("shared memory must be a memfd"))?;
    if !SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
        return Err(invalid("shared memory must be sealed against shrinking"));
    }
    if nix::sys::statfs::fstatfs(fd)?.filesystem_type() == nix::sys::statfs::HUGETLBFS_MAGIC {
        return Err(invalid("shared memory of huge pages is not taken"));
    }
    let size = nix::sys::stat::fstat(fd)?.st_size;
    if size < 0 || (size as u64) < len {
        return Err(invalid(format!(
            "shared memory of {size} bytes, {len} announced"
        )));
    }
    Ok(())
}

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Cqe;

    #[test]
    fn both_mappings_see_the_same_bytes_and_bounds_hold() {
        let a = SharedMemory::create(c"test", 8192).unwrap();
        let b = SharedMemory::map(a.fd().try_clone_to_owned().unwrap(), 8192).unwrap();
        assert!(a.copy_in(100, b"hello"));
        let mut out = [0u8; 5];
        assert!(b.copy_out(100, &mut out));
        assert_eq!(&out, b"hello");
        a.write(
            64,
            Cqe {
                user_data: 7,
                result: -5,
            },
        );
        assert_eq!(b.read::<Cqe>(64).result, -5);
        a.counter(4).store(9, std::sync::atomic::Ordering::Release);
        assert_eq!(b.counter(4).load(std::sync::atomic::Ordering::Acquire), 9);
        assert!(!a.copy_in(8190, b"abc"));
        assert!(!a.copy_out(u64::MAX, &mut out));
        assert!(!a.holds(u64::MAX - 1, 4));
    }

    #[test]
    fn memory_that_could_shrink_or_is_short_is_refused() {
        let a = SharedMemory::create(c"test", 4096).unwrap();
        assert!(SharedMemory::map(a.fd().try_clone_to_owned().unwrap(), 8192).is_err());
        let unsealed = memfd_create(c"x", MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&unsealed, 4096).unwrap();
        assert!(SharedMemory::map(unsealed, 4096).is_err());
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert!(SharedMemory::map(file.into(), 10).is_err());
    }

    #[test]
    fn huge_page_memory_is_refused() {
        let Ok(fd) = memfd_create(
            c"huge",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING | MFdFlags::MFD_HUGETLB,
        ) else {
            return; // no hugetlbfs here: nothing to refuse
        };
        if nix::unistd::ftruncate(&fd, 2 << 20).is_err() {
            return; // no huge pages configured
        }
        fcntl(&fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK)).unwrap();
        // Refused for its pages, not for a missing seal or a short size.
        let refused = check_shared(&fd, 4096).unwrap_err();
        assert!(refused.to_string().contains("huge pages"), "{refused}");
    }
}
