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
use rdmabox::transport::Landing;
use rfs_io::layout::{op, Cqe, Layout, Sqe, CQ_HEAD, CQ_TAIL, SQ_HEAD, SQ_TAIL};
use rfs_io::shm::SharedMemory;
use rfs_io::wire::{self, Reply, Request, MAX_MESSAGE};
use rfs_proto::types::{Caller, FileAccess, Ino};
use rfs_proto::Errno;

use super::guard::GuardedMemory;
use super::Shared;
use crate::fs::{Backend, Rfs};

/// The most bytes one request moves (FUSE's is 1 MiB).
const MAX_IO: u32 = 16 << 20;
/// The most bytes of one ring's requests in flight.
const MAX_BYTES_IN_FLIGHT: u64 = 256 << 20;
/// The largest shared buffer.
const MAX_BUFFER: u64 = 64 << 30;
/// The most files one ring registers.
const MAX_FILES: usize = 65536;
/// How long a new connection has to say hello.
const HELLO_WITHIN: Duration = Duration::from_secs(5);
/// How long the submission thread sleeps when nothing wakes it (it looks whether the ring
/// ends), and when completions not reaped leave no room for more.
const IDLE: Duration = Duration::from_millis(100);
const FULL: Duration = Duration::from_millis(1);

/// The bytes request `sqe` moves (as bounded once checked): none for an fsync, whatever its
/// length field says.
fn moves(sqe: &Sqe) -> u64 {
    match sqe.op {
        op::READ | op::WRITE => u64::from(sqe.len.min(MAX_IO)),
        _ => 0,
    }
}

/// Whether request `next` continues `last`: a read or a write of the same file, its file and
/// buffer ranges right after the other's.
fn follows(last: &Sqe, next: &Sqe) -> bool {
    matches!(next.op, op::READ | op::WRITE)
        && next.op == last.op
        && next.file == last.file
        && next.len > 0
        && last.offset + last.len as u64 == next.offset
        && last.buf_off + last.len as u64 == next.buf_off
}

/// A file registered on a ring: a handle of fs-client's own, opened as the application.
struct Registered {
    ino: Ino,
    fh: u64,
    read: bool,
    write: bool,
    /// Its requests in flight: it is released only once none is.
    in_flight: AtomicU32,
    wrote: AtomicBool,
    /// Who registered it: their writes clear what a write clears (set-ID bits, capabilities).
    caller: Caller,
}

struct Ring<B: Backend> {
    fs: Arc<Rfs<B>>,
    /// What every ring of the mount shares (its bounds).
    shared: Arc<Shared>,
    /// The connection, shut down when the application breaks the ring (its `wait` wakes).
    conn: OwnedFd,
    ring: GuardedMemory,
    /// Where reads land and writes are taken from: a page the application takes away that
    /// cannot come back spoils it (see `guard`), and the ring ends.
    buffer: Arc<GuardedMemory>,
    /// Whether the ring was told to end for a spoilt mapping.
    spoilt: AtomicBool,
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
    shared: Arc<Shared>,
    conn: OwnedFd,
    caller: Caller,
    mount_dev: u64,
) -> io::Result<()> {
    let mut buf = [0u8; MAX_MESSAGE];
    // A connection that never says hello must not hold its slot.
    let timeout = |t: Option<Duration>| {
        let tv = nix::sys::time::TimeVal::from(libc::timeval {
            tv_sec: t.map_or(0, |t| t.as_secs() as libc::time_t),
            tv_usec: 0,
        });
        nix::sys::socket::setsockopt(&conn, nix::sys::socket::sockopt::ReceiveTimeout, &tv)
    };
    timeout(Some(HELLO_WITHIN))?;
    let (n, fds) = wire::recv(&conn, &mut buf)?;
    timeout(None)?;
    let ring = match welcome(fs, shared, conn.try_clone()?, &buf[..n], fds) {
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
    ring.fs.ring_served(true);
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
    ring.fs.ring_served(false);
    Err(why)
}

/// The ring a hello describes, or why not (an errno for the application, and a reason for the
/// log).
fn welcome<B: Backend>(
    fs: Arc<Rfs<B>>,
    shared: Arc<Shared>,
    conn: OwnedFd,
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
    let refused = |e: io::Error| (libc::EINVAL, e.to_string());
    let guarded = |fd, len| {
        let memory = SharedMemory::map(fd, len).map_err(refused)?;
        GuardedMemory::new(memory).map_err(|e| (libc::ENOMEM, e.to_string()))
    };
    let ring = guarded(ring_fd, layout.bytes())?;
    let buffer = Arc::new(guarded(buffer_fd, buffer_len as usize)?);
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
        shared,
        conn,
        ring,
        buffer,
        spoilt: AtomicBool::new(false),
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
        if self.files.lock().unwrap().len() >= MAX_FILES || !self.shared.take_registration() {
            return Err(Errno::from_raw(libc::EMFILE));
        }
        let (fh, _) = match self.fs.open(st.st_ino, access, caller) {
            Ok(opened) => opened,
            Err(e) => {
                self.shared.give_registration();
                return Err(e.errno());
            }
        };
        let file = Arc::new(Registered {
            ino: st.st_ino,
            fh,
            read,
            write,
            in_flight: AtomicU32::new(0),
            wrote: AtomicBool::new(false),
            caller: caller.clone(),
        });
        let mut files = self.files.lock().unwrap();
        // Numbers wrap after 2^32 registrations: never onto one still registered.
        let id = loop {
            let id = self.next_file.fetch_add(1, Ordering::Relaxed);
            if !files.contains_key(&id) {
                break id;
            }
        };
        files.insert(id, file);
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
        self.written_elsewhere(file);
        self.shared.give_registration();
    }

    /// What the ring wrote is not in the mount's page cache (the kernel did not see it): the
    /// pages the kernel has of the file go, and its next open on the mount does not keep any.
    fn written_elsewhere(&self, file: &Registered) {
        if file.wrote.load(Ordering::Acquire) {
            self.fs.pages_left_stale(file.ino);
        }
    }

    /// Says the application broke the ring: its connection ends (so does its `wait`).
    fn broken(&self, why: &str) {
        log::warn!("ring: {why}: the ring ends");
        let _ = nix::sys::socket::shutdown(self.conn.as_raw_fd(), nix::sys::socket::Shutdown::Both);
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
                let ahead = tail.wrapping_sub(head);
                self.broken(&format!("the submission tail is {ahead} past the head"));
                return;
            }
            let mut full = false;
            let (mut batch, mut taking) = (Vec::new(), 0u64);
            while head != tail {
                if !self.room_for_one(taking) {
                    full = true;
                    break;
                }
                let sqe: Sqe = self.ring.read(self.layout.sqe_at(head));
                taking += moves(&sqe);
                batch.push(sqe);
                self.in_flight.fetch_add(1, Ordering::AcqRel);
                head = head.wrapping_add(1);
            }
            self.ring.counter(SQ_HEAD).store(head, Ordering::Release);
            if self.ring.spoilt() {
                // What was read there may be the spare page's bytes, not the application's.
                for _ in &batch {
                    self.in_flight.fetch_sub(1, Ordering::AcqRel);
                }
                self.broken("a page of its ring could not come back");
                return;
            }
            self.fs.ring_counted(batch.len() as u64, 0);
            self.start_all(batch);
            let wait = if full { FULL } else { IDLE };
            let mut fds = [PollFd::new(self.submitted.as_fd(), PollFlags::POLLIN)];
            let timeout = PollTimeout::try_from(wait).unwrap_or(PollTimeout::NONE);
            if matches!(poll(&mut fds, timeout), Ok(n) if n > 0) {
                let _ = self.submitted.read();
            }
        }
    }

    /// Whether one more request may start: its completion has room in the completion ring
    /// (counting those in flight and those posted but not reaped), and the bytes in flight,
    /// with `taking` bytes of requests taken but not started yet, are within bounds.
    fn room_for_one(&self, taking: u64) -> bool {
        let reaped = self.ring.counter(CQ_HEAD).load(Ordering::Acquire);
        // Under the completion lock, a request is either in flight or posted, never neither.
        let posted = self.cq_tail.lock().unwrap();
        let unreaped = posted.wrapping_sub(reaped);
        let in_flight = self.in_flight.load(Ordering::Acquire);
        drop(posted);
        unreaped <= self.layout.cq_entries
            && unreaped + in_flight < self.layout.cq_entries
            && self.bytes_in_flight.load(Ordering::Acquire) + taking < MAX_BYTES_IN_FLIGHT
            && self.shared.has_room_in_flight(taking)
    }

    /// Starts the requests of `batch` (taken together, each counted in flight): a bad one
    /// completes at once with its errno, and a run of reads (or writes) of one file whose
    /// file and buffer ranges follow each other moves as one transfer.
    fn start_all(self: &Arc<Self>, batch: Vec<Sqe>) {
        let mut run: Vec<(Sqe, Arc<Registered>)> = Vec::new();
        let mut run_len = 0u64;
        for sqe in batch {
            let file = match self.check(&sqe) {
                Ok(file) => file,
                Err(e) => {
                    self.complete(None, sqe.user_data, -(e.raw() as i64), 0);
                    continue;
                }
            };
            let len = moves(&sqe);
            self.bytes_in_flight.fetch_add(len, Ordering::AcqRel);
            self.shared.bytes_in_flight.fetch_add(len, Ordering::AcqRel);
            if let Some((last, _)) = run.last() {
                if !follows(last, &sqe) || run_len + len > MAX_IO as u64 {
                    self.transfer(std::mem::take(&mut run));
                    run_len = 0;
                }
            }
            run_len += len;
            run.push((sqe, file));
        }
        if !run.is_empty() {
            self.transfer(run);
        }
    }

    /// Moves a run of requests (one, or reads or writes that follow each other) as one
    /// transfer, and completes each with its share.
    fn transfer(self: &Arc<Self>, run: Vec<(Sqe, Arc<Registered>)>) {
        self.fs.ring_counted(0, 1);
        let (first, file) = (run[0].0, run[0].1.clone());
        let total: u64 = run.iter().map(|(s, _)| s.len as u64).sum();
        let me = self.clone();
        // Each request's share of what moved (`moved` bytes from the run's start), or the
        // run's errno; nothing moved right through a spoilt buffer.
        let finish = move |moved: Result<u64, i32>| {
            let moved = match me.buffer.spoilt() {
                true => Err(libc::EFAULT),
                false => moved,
            };
            let mut at = 0u64;
            for (sqe, f) in &run {
                let result = match moved {
                    Ok(n) => n.saturating_sub(at).min(sqe.len as u64) as i64,
                    Err(errno) => -(errno as i64),
                };
                at += sqe.len as u64;
                me.complete(Some(f), sqe.user_data, result, moves(sqe));
            }
        };
        match first.op {
            op::READ => {
                let memory: Arc<dyn rdmabox::transport::ExternalMemory> = self.buffer.clone();
                let into = Landing::new(memory, first.buf_off as usize, total as usize)
                    .expect("checked against the buffer when taken");
                self.fs.read_into(
                    file.ino,
                    first.offset,
                    into,
                    Box::new(move |r: crate::fs::Result<usize>| {
                        finish(r.map(|n| n as u64).map_err(|e| e.errno().raw()))
                    }),
                );
            }
            op::WRITE => {
                let mut data = vec![0u8; total as usize];
                if !self.buffer.copy_out(first.buf_off, &mut data) || self.buffer.spoilt() {
                    return finish(Err(libc::EFAULT));
                }
                // The kernel sees none of these writes: what a write by someone without
                // CAP_FSETID clears is ours to clear (root is taken to have it).
                if file.caller.uid != 0 {
                    match self.fs.write_clears_setid(file.ino, &file.caller) {
                        // The kernel, which cached the mode, heard of none of it.
                        Ok(true) => self.fs.kernel_attrs_changed(file.ino),
                        Ok(false) => {}
                        Err(e) => return finish(Err(e.errno().raw())),
                    }
                }
                file.wrote.store(true, Ordering::Release);
                // An open on the mount meanwhile must not keep pages from before it.
                self.fs.pages_changed(file.ino);
                self.fs.write_owned(
                    file.ino,
                    first.offset,
                    data,
                    Box::new(move |r: crate::fs::Result<u32>| {
                        finish(r.map(u64::from).map_err(|e| e.errno().raw()))
                    }),
                );
            }
            _ => {
                // A registration for reading has nothing to commit, and must not take the
                // failure of another writer's write, which that writer's fsync reports.
                let result = match file.write {
                    true => self.fs.commit(file.ino),
                    false => Ok(()),
                };
                // After the commit, which takes the kernel's pages for ours.
                self.written_elsewhere(&file);
                finish(result.map(|()| 0).map_err(|e| e.errno().raw()))
            }
        }
    }

    /// The registered file a request names, if the request is well formed; counted in
    /// flight on it (under the lock an unregistration takes it away with, so that it waits
    /// for this request).
    fn check(&self, sqe: &Sqe) -> Result<Arc<Registered>, Errno> {
        let files = self.files.lock().unwrap();
        let file = files.get(&sqe.file).cloned().ok_or(Errno::EBADF)?;
        self.well_formed(sqe, &file)?;
        file.in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(file)
    }

    fn well_formed(&self, sqe: &Sqe, file: &Registered) -> Result<(), Errno> {
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
                Ok(())
            }
            op::FSYNC => Ok(()),
            _ => Err(Errno::EINVAL),
        }
    }

    /// Posts a request's completion and wakes the application.
    fn complete(&self, file: Option<&Registered>, user_data: u64, result: i64, len: u64) {
        if let Some(f) = file {
            f.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.bytes_in_flight.fetch_sub(len, Ordering::AcqRel);
            self.shared.bytes_in_flight.fetch_sub(len, Ordering::AcqRel);
        }
        {
            let mut tail = self.cq_tail.lock().unwrap();
            self.ring
                .write(self.layout.cqe_at(*tail), Cqe { user_data, result });
            *tail = tail.wrapping_add(1);
            self.ring.counter(CQ_TAIL).store(*tail, Ordering::Release);
            // Posted and no longer in flight at once, for `room_for_one`: a request that
            // seemed neither would let one too many in, and both would hold a submitter
            // that resubmits the moment it reaps.
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        // Non-blocking: a counter the application filled wakes it all the same.
        let _ = self.completed.write(1);
        let spoilt = self.ring.spoilt() || self.buffer.spoilt();
        if spoilt && !self.spoilt.swap(true, Ordering::AcqRel) {
            self.broken("a page of its shared memory could not come back");
        }
    }
}
