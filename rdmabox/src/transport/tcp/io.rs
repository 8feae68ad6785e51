//! Raw socket I/O for the tcp provider: gathered writes straight from registered memory and reads
//! straight into it, so payloads are never staged in an intermediate buffer.

use std::io;
use std::os::fd::RawFd;

use super::seal::{Opener, WireKeys};

/// Linux caps one `writev` at this many elements.
const IOV_MAX: usize = 1024;

/// Writes every byte the iovecs describe. Returns the number of `writev` calls it took: one for
/// a chain that fits the socket buffer, which is what "one doorbell" means on this provider.
///
/// # Safety
/// Every iovec must describe readable memory that stays valid for the duration of the call.
pub(crate) unsafe fn writev_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<u64> {
    let mut calls = 0;
    let mut iovs = iovs;
    while !iovs.is_empty() {
        let batch = iovs.len().min(IOV_MAX);
        // SAFETY: the caller guarantees the iovecs are valid; `batch` is within the slice.
        let n = unsafe { libc::writev(fd, iovs.as_ptr(), batch as libc::c_int) };
        calls += 1;
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                // A socket a loop serves is non-blocking: wait for room here instead.
                io::ErrorKind::WouldBlock => {
                    wait_writable(fd)?;
                    continue;
                }
                _ => return Err(e),
            }
        }
        let mut n = n as usize;
        // Skip what was written; shorten the first partly written element.
        while n > 0 && !iovs.is_empty() {
            if n >= iovs[0].iov_len {
                n -= iovs[0].iov_len;
                iovs = &mut iovs[1..];
            } else {
                // SAFETY: advancing within the same element.
                iovs[0].iov_base = unsafe { iovs[0].iov_base.cast::<u8>().add(n).cast() };
                iovs[0].iov_len -= n;
                n = 0;
            }
        }
        while !iovs.is_empty() && iovs[0].iov_len == 0 {
            iovs = &mut iovs[1..];
        }
    }
    Ok(calls)
}

/// Waits until `fd` can take more bytes, or has failed or been shut (the write then says so).
fn wait_writable(fd: RawFd) -> io::Result<()> {
    wait_for(fd, libc::POLLOUT)
}

/// Waits until `fd` is ready for `events` (or has failed, or ended).
fn wait_for(fd: RawFd, events: libc::c_short) -> io::Result<()> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: one pollfd, alive for the call.
        if unsafe { libc::poll(&mut p, 1, -1) } >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `sendmsg` without waiting, again when interrupted: the bytes the socket took.
///
/// # Safety
/// The iovecs must point at memory valid for reads during the call.
pub(crate) unsafe fn send_now(fd: RawFd, iovs: &[libc::iovec]) -> io::Result<usize> {
    loop {
        // SAFETY: a msghdr over the caller's iovecs; sendmsg never writes through them.
        let n = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iovs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = iovs.len();
            libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Appends to `out` what of the iovecs' bytes lies past the first `sent`; whether there was any.
///
/// # Safety
/// Every iovec must describe readable memory, valid for the duration of the call.
pub(crate) unsafe fn keep_unsent(iovs: &[libc::iovec], mut sent: usize, out: &mut Vec<u8>) -> bool {
    let mut kept = false;
    for v in iovs {
        if sent >= v.iov_len {
            sent -= v.iov_len;
            continue;
        }
        // SAFETY: the unsent part of a caller's iovec, valid per the caller.
        let rest = unsafe {
            std::slice::from_raw_parts(v.iov_base.cast::<u8>().add(sent), v.iov_len - sent)
        };
        out.extend_from_slice(rest);
        sent = 0;
        kept = true;
    }
    kept
}

/// An iovec for `len` bytes at `ptr`; building one is safe, using it is where validity counts.
pub(crate) fn iovec(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: len,
    }
}

/// A buffered reader over a socket that can also read a payload directly into raw memory.
pub(crate) struct FrameReader {
    fd: RawFd,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// On an encrypted connection, what the socket's bytes are opened with.
    opener: Option<Opener>,
}

/// Payloads at least this long bypass the buffer.
const DIRECT_READ_MIN: usize = 16 * 1024;

/// Whether the kernel could not write a payload where it was to go: a page of memory shared
/// with another process that cannot come back (that process punched it out, and memory is
/// short). Nothing was taken off the socket then; the bytes come through our buffer instead,
/// copied in user space, where the owner of that memory takes the fault (fs-client's guard)
/// and the connection stays in step.
fn refused_by_memory(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EFAULT)
}

impl FrameReader {
    /// A reader over `fd` with an empty 64 KiB buffer; it does not own the descriptor. With
    /// keys, the socket's bytes are opened with them.
    pub(crate) fn new(fd: RawFd, keys: Option<&WireKeys>) -> FrameReader {
        FrameReader {
            fd,
            buf: vec![0u8; 64 * 1024].into_boxed_slice(),
            start: 0,
            end: 0,
            opener: keys.map(Opener::new),
        }
    }

    /// `recv` with `flags`, again when interrupted; Ok(0) at the end of the stream.
    fn raw_read(&mut self, dst: *mut u8, len: usize, flags: libc::c_int) -> io::Result<usize> {
        if let Some(o) = self.opener.as_mut() {
            // SAFETY: callers pass memory valid for `len` bytes of writes.
            return unsafe { o.recv(self.fd, dst, len, flags) };
        }
        loop {
            // SAFETY: callers pass memory valid for `len` bytes of writes.
            let n = unsafe { libc::recv(self.fd, dst.cast(), len, flags) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    fn fill(&mut self) -> io::Result<()> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        let free = self.buf.len() - self.end;
        let dst = self.buf[self.end..].as_mut_ptr();
        let n = self.raw_read(dst, free, 0)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.end += n;
        Ok(())
    }

    /// The bytes read off the socket and not yet consumed.
    pub(crate) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The next header's bytes, or None on a clean end of stream at a frame boundary.
    pub(crate) fn read_header<const N: usize>(&mut self) -> io::Result<Option<[u8; N]>> {
        if self.start == self.end {
            match self.fill() {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
                r => r?,
            }
        }
        let mut out = [0u8; N];
        // SAFETY: `out` is a local array of N bytes.
        unsafe { self.read_into(out.as_mut_ptr(), N)? };
        Ok(Some(out))
    }

    /// Reads exactly `len` bytes into `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes for the duration of the call.
    pub(crate) unsafe fn read_into(&mut self, dst: *mut u8, len: usize) -> io::Result<()> {
        let mut done = 0;
        let mut direct = true;
        while done < len {
            let buffered = self.end - self.start;
            if buffered > 0 {
                let n = buffered.min(len - done);
                // SAFETY: source is within the buffer; destination within the caller's range.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.buf[self.start..].as_ptr(), dst.add(done), n)
                };
                self.start += n;
                done += n;
            } else if direct && len - done >= DIRECT_READ_MIN {
                // SAFETY: the remaining destination range is valid per the caller's promise.
                match self.raw_read(unsafe { dst.add(done) }, len - done, 0) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => done += n,
                    Err(e) if refused_by_memory(&e) => direct = false,
                    Err(e) => return Err(e),
                }
            } else {
                self.fill()?;
            }
        }
        Ok(())
    }

    /// Moves up to `len` bytes into `dst` without waiting: what is buffered, else what the
    /// socket has (a short payload fills the buffer first, taking the frames behind it along).
    /// Ok(0): nothing has arrived yet ([`Self::wait_readable`]).
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes for the duration of the call.
    pub(crate) unsafe fn read_now_into(&mut self, dst: *mut u8, len: usize) -> io::Result<usize> {
        if self.start == self.end && len < DIRECT_READ_MIN {
            self.start = 0;
            self.end = 0;
            let (dst, free) = (self.buf.as_mut_ptr(), self.buf.len());
            self.end = self.recv_now(dst, free)?;
        }
        let buffered = self.end - self.start;
        if buffered == 0 {
            match self.recv_now(dst, len) {
                Err(e) if refused_by_memory(&e) => {
                    let (ours, free) = (self.buf.as_mut_ptr(), self.buf.len());
                    (self.start, self.end) = (0, self.recv_now(ours, free)?);
                }
                r => return r,
            }
        }
        let n = (self.end - self.start).min(len);
        // SAFETY: source is within the buffer; destination within the caller's range.
        unsafe { std::ptr::copy_nonoverlapping(self.buf[self.start..].as_ptr(), dst, n) };
        self.start += n;
        Ok(n)
    }

    /// What the socket has, up to `len` bytes into `dst`, without waiting (Ok(0): nothing).
    fn recv_now(&mut self, dst: *mut u8, len: usize) -> io::Result<usize> {
        match self.raw_read(dst, len, libc::MSG_DONTWAIT) {
            Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            r => r,
        }
    }

    /// Waits until the socket has bytes (or its end, or an error) to read, unless what it
    /// sent is already here to be opened.
    pub(crate) fn wait_readable(&self) -> io::Result<()> {
        if self.opener.as_ref().is_some_and(Opener::has_buffered) {
            return Ok(());
        }
        wait_for(self.fd, libc::POLLIN)
    }

    /// Reads and drops `len` bytes.
    pub(crate) fn discard(&mut self, mut len: usize) -> io::Result<()> {
        while len > 0 {
            if self.start == self.end {
                self.fill()?;
            }
            let n = (self.end - self.start).min(len);
            self.start += n;
            len -= n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

    /// The memfd the test's SIGBUS handler grows back, and how often it did.
    static SHRUNK: AtomicI32 = AtomicI32::new(-1);
    static FAULTS: AtomicUsize = AtomicUsize::new(0);
    const PAGES: usize = 8;

    /// Grows the memfd back, so that the faulting copy goes on (as fs-client's guard puts a
    /// page in place).
    extern "C" fn grow_back(_: libc::c_int) {
        FAULTS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: ftruncate is async-signal-safe; the descriptor is the test's memfd.
        unsafe { libc::ftruncate(SHRUNK.load(Ordering::SeqCst), (PAGES * 4096) as i64) };
    }

    /// A payload whose memory the kernel cannot write (a page that cannot come back: here,
    /// past the end of its file) comes through the buffer, copied in user space, and the
    /// stream stays in step: the frame behind it reads whole.
    #[test]
    fn memory_the_kernel_cannot_write_is_filled_through_the_buffer() {
        let fd = nix::sys::memfd::memfd_create(c"efault", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .unwrap();
        nix::unistd::ftruncate(&fd, (PAGES * 4096) as i64).unwrap();
        // SAFETY: a new shared mapping of a memfd of ours, reached by raw pointers only.
        let map = unsafe {
            nix::sys::mman::mmap(
                None,
                std::num::NonZeroUsize::new(PAGES * 4096).unwrap(),
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .unwrap()
        .as_ptr()
        .cast::<u8>();
        nix::unistd::ftruncate(&fd, 0).unwrap();
        SHRUNK.store(fd.as_raw_fd(), Ordering::SeqCst);
        // SAFETY: a plain handler; restored below.
        let before = unsafe { libc::signal(libc::SIGBUS, grow_back as *const () as usize) };

        let (mut tx, rx) = UnixStream::pair().unwrap();
        let payload: Vec<u8> = (0..PAGES * 4096).map(|i| (i * 7) as u8).collect();
        let writer = std::thread::spawn(move || {
            tx.write_all(&payload).unwrap();
            tx.write_all(b"next").unwrap();
            payload
        });
        let mut r = FrameReader::new(rx.as_raw_fd(), None);
        // SAFETY: the mapping is PAGES pages long; past the file's end until the handler
        // grows it back.
        unsafe { r.read_into(map, PAGES * 4096).unwrap() };
        let next = r.read_header::<4>().unwrap().unwrap();
        let payload = writer.join().unwrap();
        // SAFETY: restores what was there before.
        unsafe { libc::signal(libc::SIGBUS, before) };
        assert_eq!(&next, b"next", "the stream is in step");
        assert!(
            FAULTS.load(Ordering::SeqCst) > 0,
            "the user-space copy faulted"
        );
        let mut back = vec![0u8; PAGES * 4096];
        nix::sys::uio::pread(&fd, &mut back, 0).unwrap();
        assert!(back == payload, "every byte landed");
    }
}
