//! One application's ring: its shared memory, the files it registered, the thread that takes
//! its submissions, and the completions posted as transfers finish.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use rfs_io::layout::{op, Cqe, Layout, Sqe, CQ_HEAD, CQ_TAIL, SQ_HEAD, SQ_TAIL};
use rfs_io::shm::SharedMemory;
use rfs_io::wire::{self, Reply, Request, MAX_MESSAGE};
use rfs_proto::types::{Caller, FileAccess, Ino};
use rfs_proto::Errno;

use crate::fs::{Backend, Rfs};

/// The most bytes one request moves (FUSE's is 1 MiB).
const MAX_IO: u32 = 16 << 20;
/// The most bytes of one ring's requests in flight.
const MAX_BYTES_IN_FLIGHT: u64 = 256 << 20;
/// The largest shared buffer.
const MAX_BUFFER: u64 = 64 << 30;
/// The most files one ring registers.
const MAX_FILES: usize = 65536;
/// How long the submission thread sleeps when nothing wakes it (it looks whether the ring
/// ends), and when completions not reaped leave no room for more.
const IDLE: Duration = Duration::from_millis(100);
const FULL: Duration = Duration::from_millis(1);

/// A file registered on a ring: a handle of fs-client's own, opened as the application.
struct Registered {
    ino: Ino,
    fh: u64,
    read: bool,
    write: bool,
    /// Its requests in flight: it is released only once none is.
    in_flight: AtomicU32,
    wrote: AtomicBool,
}

struct Ring<B: Backend> {
    fs: Arc<Rfs<B>>,
    ring: SharedMemory,
    buffer: SharedMemory,
    layout: Layout,
    submitted: EventFd,
    completed: EventFd,
    files: Mutex<HashMap<u32, Arc<Registered>>>,
    next_file: AtomicU32,
    /// The completion ring's tail (ours to advance).
    cq_tail: Mutex<u32>,
    in_flight: AtomicU32,
    bytes_in_flight: AtomicU64,
    ending: AtomicBool,
}

/// Serves the ring of the application on `conn` (running as `caller`) until it hangs up; the
/// mount's device number is `mount_dev`.
pub(super) fn serve<B: Backend>(
    fs: Arc<Rfs<B>>,
    conn: OwnedFd,
    caller: Caller,
    mount_dev: u64,
) -> io::Result<()> {
    let mut buf = [0u8; MAX_MESSAGE];
    let (n, fds) = wire::recv(&conn, &mut buf)?;
    let ring = match welcome(fs, &buf[..n], fds) {
        Ok(ring) => Arc::new(ring),
        Err((errno, why)) => {
            let _ = wire::send(&conn, &Reply::Refused { errno }.encode(), &[]);
            return Err(io::Error::other(why));
        }
    };
    let welcome = Reply::Welcome { max_io: MAX_IO }.encode();
    let efds = [ring.submitted.as_raw_fd(), ring.completed.as_raw_fd()];
    wire::send(&conn, &welcome, &efds)?;
    let submitting = {
        let ring = ring.clone();
        std::thread::Builder::new()
            .name("ring-submit".into())
            .spawn(move || ring.take_submissions())?
    };
    let why = loop {
        let (n, fds) = match wire::recv(&conn, &mut buf) {
            Ok(got) => got,
            Err(e) => break e,
        };
        let reply = match Request::decode(&buf[..n]) {
            Ok(Request::Register { write }) => match fds.into_iter().next() {
                Some(fd) => ring.register(fd, write, &caller, mount_dev),
                None => Err(Errno::EBADF),
            }
            .map(|file| Reply::Registered { file }),
            Ok(Request::Unregister { file }) => ring.unregister(file).map(|()| Reply::Unregistered),
            Ok(Request::Hello { .. }) | Err(_) => Err(Errno::EPROTO),
        };
        let reply = reply.unwrap_or_else(|e| Reply::Refused { errno: e.raw() });
        if let Err(e) = wire::send(&conn, &reply.encode(), &[]) {
            break e;
        }
    };
    ring.ending.store(true, Ordering::Release);
    let _ = ring.submitted.write(1);
    let _ = submitting.join();
    ring.end();
    Err(why)
}

/// The ring a hello describes, or why not (an errno for the application, and a reason for the
/// log).
fn welcome<B: Backend>(
    fs: Arc<Rfs<B>>,
    hello: &[u8],
    fds: Vec<OwnedFd>,
) -> Result<Ring<B>, (i32, String)> {
    let Ok(Request::Hello { layout, buffer_len }) = Request::decode(hello) else {
        return Err((libc::EPROTO, "no hello".into()));
    };
    let [ring_fd, buffer_fd]: [OwnedFd; 2] = fds
        .try_into()
        .map_err(|_| (libc::EBADF, "a hello without its two memfds".to_string()))?;
    if buffer_len == 0 || buffer_len > MAX_BUFFER {
        return Err((libc::EINVAL, format!("a buffer of {buffer_len} bytes")));
    }
    let shared = |fd, len| SharedMemory::map(fd, len).map_err(|e| (libc::EINVAL, e.to_string()));
    let ring = shared(ring_fd, layout.bytes())?;
    let buffer = shared(buffer_fd, buffer_len as usize)?;
    let eventfd = || {
        EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| (libc::ENOMEM, e.to_string()))
    };
    // Counters as the application starts them, whatever it left there.
    for at in [SQ_HEAD, SQ_TAIL, CQ_HEAD, CQ_TAIL] {
        ring.counter(at).store(0, Ordering::Release);
    }
    Ok(Ring {
        fs,
        ring,
        buffer,
        layout,
        submitted: eventfd()?,
        completed: eventfd()?,
        files: Mutex::new(HashMap::new()),
        next_file: AtomicU32::new(1),
        cq_tail: Mutex::new(0),
        in_flight: AtomicU32::new(0),
        bytes_in_flight: AtomicU64::new(0),
        ending: AtomicBool::new(false),
    })
}

impl<B: Backend> Ring<B> {
    /// Opens the file behind `fd` (a descriptor of the application's, on this mount) again,
    /// as the application, for what `fd` allows; its number on the ring.
    fn register(
        &self,
        fd: OwnedFd,
        write: bool,
        caller: &Caller,
        mount_dev: u64,
    ) -> Result<u32, Errno> {
        let st = nix::sys::stat::fstat(&fd).map_err(|e| Errno::from_raw(e as i32))?;
        if st.st_dev != mount_dev {
            return Err(Errno::from_raw(libc::EXDEV));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Errno::EINVAL);
        }
        let flags =
            OFlag::from_bits_retain(fcntl(&fd, FcntlArg::F_GETFL).map_err(|_| Errno::EBADF)?);
        // An O_PATH descriptor opens nothing: it reads and writes nothing either.
        if flags.contains(OFlag::O_PATH) {
            return Err(Errno::EBADF);
        }
        let mode = flags & OFlag::O_ACCMODE;
        let read = mode != OFlag::O_WRONLY;
        if write && mode == OFlag::O_RDONLY {
            return Err(Errno::EBADF);
        }
        let mut access = FileAccess::empty();
        if read {
            access |= FileAccess::READ;
        }
        if write {
            access |= FileAccess::WRITE;
        }
        if access.is_empty() {
            return Err(Errno::EBADF);
        }
        if self.files.lock().unwrap().len() >= MAX_FILES {
            return Err(Errno::from_raw(libc::EMFILE));
        }
        let (fh, _) = self
            .fs
            .open(st.st_ino, access, caller)
            .map_err(|e| e.errno())?;
        let id = self.next_file.fetch_add(1, Ordering::Relaxed);
        let file = Arc::new(Registered {
            ino: st.st_ino,
            fh,
            read,
            write,
            in_flight: AtomicU32::new(0),
            wrote: AtomicBool::new(false),
        });
        self.files.lock().unwrap().insert(id, file);
        Ok(id)
    }

    /// Takes registration `id` back: no new request reaches it, and once those in flight are
    /// done its handle is released (its writes committed, as a close commits them).
    fn unregister(&self, id: u32) -> Result<(), Errno> {
        let file = self.files.lock().unwrap().remove(&id).ok_or(Errno::EBADF)?;
        self.release(&file);
        Ok(())
    }

    fn release(&self, file: &Registered) {
        while file.in_flight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(FULL);
        }
        if let Err(e) = self.fs.release(file.fh) {
            log::warn!("ring: releasing inode {}: {e}", file.ino);
        }
        if file.wrote.load(Ordering::Acquire) {
            // The mount's readers see what the ring wrote at their next open.
            self.fs.pages_left_stale(file.ino);
        }
    }

    /// The application hung up: once its requests in flight are done, every file it left
    /// registered is released.
    fn end(&self) {
        while self.in_flight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(FULL);
        }
        let files: Vec<_> = self.files.lock().unwrap().drain().collect();
        for (_, file) in files {
            self.release(&file);
        }
    }

    /// Takes submissions as the application makes them, until the ring ends.
    fn take_submissions(self: Arc<Self>) {
        let mut head: u32 = 0;
        while !self.ending.load(Ordering::Acquire) {
            let tail = self.ring.counter(SQ_TAIL).load(Ordering::Acquire);
            if tail.wrapping_sub(head) > self.layout.sq_entries {
                log::warn!(
                    "ring: the application's submission tail {tail} is {} past our head: \
                     no more submissions taken",
                    tail.wrapping_sub(head)
                );
                return;
            }
            let mut full = false;
            while head != tail {
                if !self.room_for_one() {
                    full = true;
                    break;
                }
                let sqe: Sqe = self.ring.read(self.layout.sqe_at(head));
                head = head.wrapping_add(1);
                self.ring.counter(SQ_HEAD).store(head, Ordering::Release);
                self.start(sqe);
            }
            let wait = if full { FULL } else { IDLE };
            let mut fds = [PollFd::new(self.submitted.as_fd(), PollFlags::POLLIN)];
            let timeout = PollTimeout::try_from(wait).unwrap_or(PollTimeout::NONE);
            if matches!(poll(&mut fds, timeout), Ok(n) if n > 0) {
                let _ = self.submitted.read();
            }
        }
    }

    /// Whether one more request may start: its completion has room in the completion ring
    /// (counting those in flight and those posted but not reaped), and the bytes in flight
    /// are within bounds.
    fn room_for_one(&self) -> bool {
        let reaped = self.ring.counter(CQ_HEAD).load(Ordering::Acquire);
        let posted = *self.cq_tail.lock().unwrap();
        let unreaped = posted.wrapping_sub(reaped);
        let in_flight = self.in_flight.load(Ordering::Acquire);
        unreaped <= self.layout.cq_entries
            && unreaped + in_flight < self.layout.cq_entries
            && self.bytes_in_flight.load(Ordering::Acquire) < MAX_BYTES_IN_FLIGHT
    }

    /// Starts the request `sqe` asks for; a bad one completes at once with its errno.
    fn start(self: &Arc<Self>, sqe: Sqe) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let file = match self.check(&sqe) {
            Ok(file) => file,
            Err(e) => return self.complete(None, sqe.user_data, -(e.raw() as i64), 0),
        };
        file.in_flight.fetch_add(1, Ordering::AcqRel);
        let len = sqe.len as u64;
        self.bytes_in_flight.fetch_add(len, Ordering::AcqRel);
        let me = self.clone();
        let done_file = file.clone();
        let user_data = sqe.user_data;
        match sqe.op {
            op::READ => {
                let at = sqe.buf_off;
                self.fs.read(
                    file.ino,
                    sqe.offset,
                    sqe.len as usize,
                    Box::new(move |r: crate::fs::Result<&[u8]>| {
                        let result = match r {
                            Ok(data) if me.buffer.copy_in(at, data) => data.len() as i64,
                            Ok(_) => -(libc::EFAULT as i64),
                            Err(e) => -(e.errno().raw() as i64),
                        };
                        me.complete(Some(&done_file), user_data, result, len);
                    }),
                );
            }
            op::WRITE => {
                let mut data = vec![0u8; sqe.len as usize];
                if !self.buffer.copy_out(sqe.buf_off, &mut data) {
                    return self.complete(Some(&file), user_data, -(libc::EFAULT as i64), len);
                }
                file.wrote.store(true, Ordering::Release);
                self.fs.write(
                    file.ino,
                    sqe.offset,
                    &data,
                    Box::new(move |r: crate::fs::Result<u32>| {
                        let result = match r {
                            Ok(n) => n as i64,
                            Err(e) => -(e.errno().raw() as i64),
                        };
                        me.complete(Some(&done_file), user_data, result, len);
                    }),
                );
            }
            _ => {
                let result = match self.fs.commit(file.ino) {
                    Ok(()) => 0,
                    Err(e) => -(e.errno().raw() as i64),
                };
                self.complete(Some(&file), user_data, result, len);
            }
        }
    }

    /// The registered file a request names, if the request is well formed.
    fn check(&self, sqe: &Sqe) -> Result<Arc<Registered>, Errno> {
        let file = self
            .files
            .lock()
            .unwrap()
            .get(&sqe.file)
            .cloned()
            .ok_or(Errno::EBADF)?;
        match sqe.op {
            op::READ | op::WRITE => {
                let allowed = match sqe.op {
                    op::READ => file.read,
                    _ => file.write,
                };
                if !allowed {
                    return Err(Errno::EBADF);
                }
                if sqe.len > MAX_IO
                    || sqe
                        .offset
                        .checked_add(sqe.len as u64)
                        .is_none_or(|end| end > i64::MAX as u64)
                {
                    return Err(Errno::EINVAL);
                }
                if !self.buffer.holds(sqe.buf_off, sqe.len as u64) {
                    return Err(Errno::from_raw(libc::EFAULT));
                }
                Ok(file)
            }
            op::FSYNC => Ok(file),
            _ => Err(Errno::EINVAL),
        }
    }

    /// Posts a request's completion and wakes the application.
    fn complete(&self, file: Option<&Registered>, user_data: u64, result: i64, len: u64) {
        {
            let mut tail = self.cq_tail.lock().unwrap();
            self.ring
                .write(self.layout.cqe_at(*tail), Cqe { user_data, result });
            *tail = tail.wrapping_add(1);
            self.ring.counter(CQ_TAIL).store(*tail, Ordering::Release);
        }
        if let Some(f) = file {
            f.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.bytes_in_flight.fetch_sub(len, Ordering::AcqRel);
        }
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        // Non-blocking: a counter the application filled wakes it all the same.
        let _ = self.completed.write(1);
    }
}
