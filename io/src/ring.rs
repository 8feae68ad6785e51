//! The application's side of a ring: connect to a mount, register files opened through it,
//! queue reads and writes against the shared buffer, submit them, reap their completions.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::Ordering;

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};

use crate::layout::{op, Cqe, Layout, Sqe, CQ_HEAD, CQ_TAIL, SQ_TAIL};
use crate::shm::SharedMemory;
use crate::wire::{self, Reply, Request, MAX_MESSAGE};

/// The name, in a mount's root, of the link to its ring socket, and the link's inode number
/// (fs-client answers for it; a file of that name in the namespace is never there).
pub const SOCKET_NAME: &str = ".rfs-ring";
pub const SOCKET_LINK_INO: u64 = u64::MAX - 2;

/// A ring of an rfs mount, with its shared buffer.
#[derive(Debug)]
pub struct Ring {
    sock: OwnedFd,
    ring: SharedMemory,
    buffer: SharedMemory,
    layout: Layout,
    submit: OwnedFd,
    complete: OwnedFd,
    /// The next submission slot to fill.
    sq_tail: u32,
    /// The next completion to reap.
    cq_head: u32,
    /// Queued or submitted, and not reaped yet.
    in_flight: u32,
    /// Queued since the last submit.
    queued: u32,
    max_io: u32,
    /// Tells this ring's registrations from another's.
    id: u64,
}

/// A file registered with a ring: requests on that ring name it.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct RegisteredFile {
    id: u32,
    ring: u64,
}

impl RegisteredFile {
    /// Its number on the ring (what a submission entry carries).
    pub fn id(&self) -> u32 {
        self.id
    }
}

/// A finished request.
#[derive(Debug)]
pub struct Completion {
    pub user_data: u64,
    /// Bytes moved (a read is short only at the end of the file), or why it failed.
    pub result: io::Result<u32>,
}

impl Ring {
    /// A ring of the mount at `mount` with a buffer of `buffer_len` bytes and room for
    /// `entries` requests in flight (a power of two).
    pub fn connect(mount: impl AsRef<Path>, buffer_len: usize, entries: u32) -> io::Result<Ring> {
        let layout = Layout::new(entries, entries).map_err(invalid)?;
        let sock = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        // ENOENT: not an rfs mount (or one without a ring); EACCES: another user's mount.
        // The link must be the mount's own, and the socket is reached at its target (which
        // fits a socket address however long the mount's path).
        let link = mount.as_ref().join(SOCKET_NAME);
        let meta = std::fs::symlink_metadata(&link)?;
        if std::os::unix::fs::MetadataExt::ino(&meta) != SOCKET_LINK_INO {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        let target = std::fs::read_link(&link)?;
        connect(sock.as_raw_fd(), &UnixAddr::new(&target)?)?;
        let name = |what: &str| {
            let name = format!("rfs-{what}-{}", mount.as_ref().display());
            CString::new(name.as_bytes()).unwrap_or_else(|_| c"rfs-ring".into())
        };
        let ring = SharedMemory::create(&name("ring"), layout.bytes())?;
        let buffer = SharedMemory::create(&name("buffer"), buffer_len)?;
        let hello = Request::Hello {
            layout,
            buffer_len: buffer_len as u64,
        };
        let fds = [ring.as_raw_fd(), buffer.as_raw_fd()];
        let sent = wire::send(&sock, &hello.encode(), &fds);
        // A ring refused at once (too many) is said before the hello is read, and closed.
        let (reply, fds) = match (sent, answer(&sock)) {
            (_, Ok(answered)) => answered,
            (Err(e), Err(_)) | (Ok(()), Err(e)) => return Err(e),
        };
        let Reply::Welcome { max_io } = reply else {
            return Err(refused(reply));
        };
        let [submit, complete]: [OwnedFd; 2] = fds
            .try_into()
            .map_err(|_| invalid("a welcome without its two eventfds"))?;
        Ok(Ring {
            sock,
            ring,
            buffer,
            layout,
            submit,
            complete,
            sq_tail: 0,
            cq_head: 0,
            in_flight: 0,
            queued: 0,
            max_io,
            id: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
        })
    }

    /// The most bytes one request may move.
    pub fn max_io(&self) -> u32 {
        self.max_io
    }

    /// Requests queued or submitted and not yet reaped.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Registers `file`, opened through the mount: for reading, and for writing too if it
    /// was opened for writing. fs-client opens it again as this process (its permissions
    /// are checked again).
    pub fn register(&mut self, file: &impl AsFd) -> io::Result<RegisteredFile> {
        let flags = OFlag::from_bits_truncate(fcntl(file, FcntlArg::F_GETFL)?);
        let write = (flags & OFlag::O_ACCMODE) != OFlag::O_RDONLY;
        let request = Request::Register { write };
        wire::send(&self.sock, &request.encode(), &[file.as_fd().as_raw_fd()])?;
        match answer(&self.sock)?.0 {
            Reply::Registered { file } => Ok(RegisteredFile {
                id: file,
                ring: self.id,
            }),
            other => Err(refused(other)),
        }
    }

    /// Gives a registration back (its writes committed first, as a close does). Its requests
    /// still in flight complete with EBADF or as they went.
    pub fn unregister(&mut self, file: RegisteredFile) -> io::Result<()> {
        self.ours(&file)?;
        let request = Request::Unregister { file: file.id };
        wire::send(&self.sock, &request.encode(), &[])?;
        match answer(&self.sock)?.0 {
            Reply::Unregistered => Ok(()),
            other => Err(refused(other)),
        }
    }

    /// Queues a read of `len` bytes at `offset` of `file` into the buffer at `buf_off`.
    pub fn prep_read(
        &mut self,
        file: &RegisteredFile,
        offset: u64,
        len: u32,
        buf_off: u64,
        user_data: u64,
    ) -> io::Result<()> {
        self.queue(op::READ, file, offset, len, buf_off, user_data)
    }

    /// Queues a write of `len` bytes from the buffer at `buf_off` to `offset` of `file`.
    pub fn prep_write(
        &mut self,
        file: &RegisteredFile,
        offset: u64,
        len: u32,
        buf_off: u64,
        user_data: u64,
    ) -> io::Result<()> {
        self.queue(op::WRITE, file, offset, len, buf_off, user_data)
    }

    /// Queues an fsync of `file`: its writes completed before it are committed.
    pub fn prep_fsync(&mut self, file: &RegisteredFile, user_data: u64) -> io::Result<()> {
        self.queue(op::FSYNC, file, 0, 0, 0, user_data)
    }

    fn queue(
        &mut self,
        op: u8,
        file: &RegisteredFile,
        offset: u64,
        len: u32,
        buf_off: u64,
        user_data: u64,
    ) -> io::Result<()> {
        self.ours(file)?;
        if self.in_flight >= self.layout.sq_entries {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "the ring is full: reap completions first",
            ));
        }
        let sqe = Sqe {
            op,
            file: file.id,
            len,
            offset,
            buf_off,
            user_data,
            ..Sqe::default()
        };
        self.ring.write(self.layout.sqe_at(self.sq_tail), sqe);
        self.sq_tail = self.sq_tail.wrapping_add(1);
        self.in_flight += 1;
        self.queued += 1;
        Ok(())
    }

    fn ours(&self, file: &RegisteredFile) -> io::Result<()> {
        match file.ring == self.id {
            true => Ok(()),
            false => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }

    /// Hands the queued requests to fs-client; how many.
    pub fn submit(&mut self) -> io::Result<u32> {
        let queued = std::mem::take(&mut self.queued);
        if queued == 0 {
            return Ok(0);
        }
        self.ring
            .counter(SQ_TAIL)
            .store(self.sq_tail, Ordering::Release);
        // Non-blocking: a counter that is full already wakes fs-client all the same.
        let _ = nix::unistd::write(&self.submit, &1u64.to_ne_bytes());
        Ok(queued)
    }

    /// The completions there are now, without waiting.
    pub fn peek(&mut self) -> io::Result<Vec<Completion>> {
        let tail = self.ring.counter(CQ_TAIL).load(Ordering::Acquire);
        let ready = tail.wrapping_sub(self.cq_head);
        if ready > self.in_flight {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{ready} completions for {} requests in flight",
                    self.in_flight
                ),
            ));
        }
        let mut out = Vec::with_capacity(ready as usize);
        for _ in 0..ready {
            let cqe: Cqe = self.ring.read(self.layout.cqe_at(self.cq_head));
            self.cq_head = self.cq_head.wrapping_add(1);
            out.push(Completion {
                user_data: cqe.user_data,
                result: match cqe.result {
                    n if n >= 0 => Ok(n as u32),
                    e => Err(io::Error::from_raw_os_error(-e as i32)),
                },
            });
        }
        self.in_flight -= ready;
        self.ring
            .counter(CQ_HEAD)
            .store(self.cq_head, Ordering::Release);
        Ok(out)
    }

    /// Submits what is queued and waits for at least `min` completions (at most those in
    /// flight). If the ring ends meanwhile (fs-client went, or ended it), hands out what
    /// completed, and fails once nothing has.
    pub fn wait(&mut self, min: usize) -> io::Result<Vec<Completion>> {
        self.submit()?;
        let min = min.min(self.in_flight as usize);
        let mut out = self.peek()?;
        while out.len() < min {
            // fs-client says nothing on the socket unasked: anything there is its end.
            let mut fds = [
                PollFd::new(self.complete.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.sock.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
            let ended = fds[1].any().unwrap_or(true);
            if ended && self.ring.counter(CQ_TAIL).load(Ordering::Acquire) == self.cq_head {
                if !out.is_empty() {
                    return Ok(out);
                }
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    format!("the ring ended with {} requests in flight", self.in_flight),
                ));
            }
            let mut count = [0u8; 8];
            let _ = nix::unistd::read(&self.complete, &mut count);
            out.extend(self.peek()?);
        }
        Ok(out)
    }

    /// Copies `data` into the buffer at `at`.
    pub fn copy_to_buffer(&self, at: u64, data: &[u8]) -> io::Result<()> {
        match self.buffer.copy_in(at, data) {
            true => Ok(()),
            false => Err(invalid("outside the buffer")),
        }
    }

    /// Copies bytes of the buffer at `at` into `out`.
    pub fn copy_from_buffer(&self, at: u64, out: &mut [u8]) -> io::Result<()> {
        match self.buffer.copy_out(at, out) {
            true => Ok(()),
            false => Err(invalid("outside the buffer")),
        }
    }

    /// The shared buffer, while no request is in flight (none may land in it meanwhile).
    pub fn buffer_mut(&mut self) -> io::Result<&mut [u8]> {
        if self.in_flight > 0 {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                "requests in flight may write the buffer",
            ));
        }
        // SAFETY: the mapping lives as long as `self`, which this borrow holds exclusively
        // (nothing can be submitted meanwhile), and with nothing in flight fs-client neither
        // reads nor writes it.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.buffer.as_ptr(), self.buffer.len()) })
    }

    /// The shared buffer's first byte, for those who hand its memory on (C, NumPy): a byte
    /// under a read in flight may change until the read completes.
    pub fn buffer_ptr(&self) -> *mut u8 {
        self.buffer.as_ptr()
    }

    pub fn buffer_len(&self) -> usize {
        self.buffer.len()
    }

    /// Reads up to `len` bytes at `offset` of `file` (through the start of the buffer),
    /// waiting for them; nothing else may be in flight.
    pub fn read_at(&mut self, file: &RegisteredFile, offset: u64, len: u32) -> io::Result<Vec<u8>> {
        let n = self.one(|r| r.prep_read(file, offset, len, 0, 0))?;
        let mut out = vec![0u8; n as usize];
        self.copy_from_buffer(0, &mut out)?;
        Ok(out)
    }

    /// Writes `data` at `offset` of `file` (through the start of the buffer), waiting for it;
    /// nothing else may be in flight.
    pub fn write_at(&mut self, file: &RegisteredFile, offset: u64, data: &[u8]) -> io::Result<u32> {
        self.copy_to_buffer(0, data)?;
        let len = u32::try_from(data.len()).map_err(invalid)?;
        self.one(|r| r.prep_write(file, offset, len, 0, 0))
    }

    /// Commits the writes to `file`, waiting for it; nothing else may be in flight.
    pub fn fsync(&mut self, file: &RegisteredFile) -> io::Result<()> {
        self.one(|r| r.prep_fsync(file, 0)).map(drop)
    }

    fn one(&mut self, prep: impl FnOnce(&mut Ring) -> io::Result<()>) -> io::Result<u32> {
        if self.in_flight > 0 {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                "other requests are in flight",
            ));
        }
        prep(self)?;
        let done = self.wait(1)?;
        done.into_iter().next().expect("one completion").result
    }
}

/// The answer to a control request.
fn answer(sock: &OwnedFd) -> io::Result<(Reply, Vec<OwnedFd>)> {
    let mut buf = [0u8; MAX_MESSAGE];
    let (n, fds) = wire::recv(sock, &mut buf)?;
    let reply = Reply::decode(&buf[..n]).map_err(invalid)?;
    Ok((reply, fds))
}

fn refused(reply: Reply) -> io::Error {
    match reply {
        Reply::Refused { errno } => io::Error::from_raw_os_error(errno),
        other => invalid(format!("an unexpected answer {other:?}")),
    }
}

fn invalid(why: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why.to_string())
}
