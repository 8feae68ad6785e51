//! The C ABI (`io/include/rfs_io.h`): the same calls as [`Ring`], over an opaque handle, with
//! errors as negated errnos. The Python module (`io/python/rfs_io.py`) is built on it.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, CStr};
use std::io;
use std::os::fd::BorrowedFd;

use crate::{Completion, RegisteredFile, Ring};

/// What C holds: the ring, its registrations by number, and completions reaped but not yet
/// handed out (a wait may reap more than the caller has room for).
pub struct RfsRing {
    ring: Ring,
    files: HashMap<u32, RegisteredFile>,
    reaped: VecDeque<Completion>,
}

/// A completion as C sees it.
#[repr(C)]
pub struct RfsCompletion {
    pub user_data: u64,
    /// Bytes moved, or a negated errno.
    pub result: i64,
}

/// The negated errno of `e` (of its kind, where it has none of its own).
fn errno(e: &io::Error) -> i64 {
    let raw = e.raw_os_error().unwrap_or(match e.kind() {
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::InvalidData => libc::EPROTO,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::ResourceBusy => libc::EBUSY,
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::UnexpectedEof => libc::ECONNRESET,
        _ => libc::EIO,
    });
    -(raw as i64)
}

/// The ring behind `ring`, if it is one of ours.
///
/// # Safety
/// `ring` is null or a pointer `rfs_ring_open` returned and `rfs_ring_close` did not take.
unsafe fn handle<'a>(ring: *mut RfsRing) -> Option<&'a mut RfsRing> {
    // SAFETY: as the caller promises; C calls one ring from one thread at a time.
    unsafe { ring.as_mut() }
}

/// Connects a ring to the mount at `mount` with a buffer of `buffer_len` bytes and `entries`
/// requests in flight (a power of two); null with errno set if it cannot.
///
/// # Safety
/// `mount` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_open(
    mount: *const c_char,
    buffer_len: usize,
    entries: u32,
) -> *mut RfsRing {
    if mount.is_null() {
        nix::errno::Errno::set_raw(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: a NUL-terminated string, as the caller promises.
    let mount = unsafe { CStr::from_ptr(mount) };
    let path = std::path::Path::new(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(mount.to_bytes()),
    );
    match Ring::connect(path, buffer_len, entries) {
        Ok(ring) => Box::into_raw(Box::new(RfsRing {
            ring,
            files: HashMap::new(),
            reaped: VecDeque::new(),
        })),
        Err(e) => {
            nix::errno::Errno::set_raw(-errno(&e) as i32);
            std::ptr::null_mut()
        }
    }
}

/// Ends the ring (requests in flight complete into memory the mount still holds).
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`, not used again.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_close(ring: *mut RfsRing) {
    if !ring.is_null() {
        // SAFETY: ours from `rfs_ring_open`, given back once.
        drop(unsafe { Box::from_raw(ring) });
    }
}

/// The shared buffer's first byte (null for no ring).
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_buffer(ring: *mut RfsRing) -> *mut u8 {
    // SAFETY: as the caller promises.
    unsafe { handle(ring) }.map_or(std::ptr::null_mut(), |r| r.ring.buffer_ptr())
}

/// The shared buffer's length.
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_buffer_len(ring: *mut RfsRing) -> usize {
    // SAFETY: as the caller promises.
    unsafe { handle(ring) }.map_or(0, |r| r.ring.buffer_len())
}

/// Registers the file open on descriptor `fd` (through the mount): its number, or a negated
/// errno.
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`; `fd` is open for the call's length.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_register(ring: *mut RfsRing, fd: c_int) -> i64 {
    // SAFETY: as the caller promises.
    let Some(r) = (unsafe { handle(ring) }) else {
        return -(libc::EINVAL as i64);
    };
    if fd < 0 {
        return -(libc::EBADF as i64);
    }
    // SAFETY: the caller keeps `fd` open for the call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    match r.ring.register(&fd) {
        Ok(file) => {
            let id = file.id();
            r.files.insert(id, file);
            id as i64
        }
        Err(e) => errno(&e),
    }
}

/// Gives registration `file` back: 0, or a negated errno.
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_unregister(ring: *mut RfsRing, file: u32) -> c_int {
    // SAFETY: as the caller promises.
    let Some(r) = (unsafe { handle(ring) }) else {
        return -libc::EINVAL;
    };
    let Some(f) = r.files.remove(&file) else {
        return -libc::EBADF;
    };
    match r.ring.unregister(f) {
        Ok(()) => 0,
        Err(e) => errno(&e) as c_int,
    }
}

/// Queues request `op` (1 read, 2 write, 3 fsync) on `file`: 0, or a negated errno (EAGAIN:
/// the ring is full, reap first).
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_prep(
    ring: *mut RfsRing,
    op: u8,
    file: u32,
    offset: u64,
    len: u32,
    buf_off: u64,
    user_data: u64,
) -> c_int {
    // SAFETY: as the caller promises.
    let Some(r) = (unsafe { handle(ring) }) else {
        return -libc::EINVAL;
    };
    let Some(f) = r.files.get(&file) else {
        return -libc::EBADF;
    };
    let queued = match op {
        crate::layout::op::READ => r.ring.prep_read(f, offset, len, buf_off, user_data),
        crate::layout::op::WRITE => r.ring.prep_write(f, offset, len, buf_off, user_data),
        crate::layout::op::FSYNC => r.ring.prep_fsync(f, user_data),
        _ => return -libc::EINVAL,
    };
    match queued {
        Ok(()) => 0,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => -libc::EAGAIN,
        Err(e) => errno(&e) as c_int,
    }
}

/// Submits what is queued, waits for at least `min` completions (at most those in flight),
/// and fills up to `max` of `out`: how many, or a negated errno.
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`; `out` has room for `max` completions.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_wait(
    ring: *mut RfsRing,
    min: usize,
    out: *mut RfsCompletion,
    max: usize,
) -> i64 {
    // SAFETY: as the caller promises.
    let Some(r) = (unsafe { handle(ring) }) else {
        return -(libc::EINVAL as i64);
    };
    if out.is_null() && max > 0 {
        return -(libc::EINVAL as i64);
    }
    let want = min.min(max);
    if r.reaped.len() < want {
        let wait_for = want - r.reaped.len();
        match r.ring.wait(wait_for) {
            Ok(done) => r.reaped.extend(done),
            Err(e) => return errno(&e),
        }
    } else {
        // Nothing to wait for: what completed by now.
        match r.ring.submit().and_then(|_| r.ring.peek()) {
            Ok(done) => r.reaped.extend(done),
            Err(e) => return errno(&e),
        }
    }
    let n = r.reaped.len().min(max);
    for (k, c) in r.reaped.drain(..n).enumerate() {
        let result = match c.result {
            Ok(bytes) => bytes as i64,
            Err(e) => errno(&e),
        };
        // SAFETY: `out` has room for `max` completions, and k < n <= max.
        unsafe {
            out.add(k).write(RfsCompletion {
                user_data: c.user_data,
                result,
            })
        };
    }
    n as i64
}

/// Requests queued or submitted and not yet handed out by `rfs_ring_wait`.
///
/// # Safety
/// `ring` is null or from `rfs_ring_open`.
#[no_mangle]
pub unsafe extern "C" fn rfs_ring_in_flight(ring: *mut RfsRing) -> u32 {
    // SAFETY: as the caller promises.
    unsafe { handle(ring) }.map_or(0, |r| r.ring.in_flight() + r.reaped.len() as u32)
}
