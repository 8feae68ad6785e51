//! FUSE over io_uring (`-o io_uring`, Linux 6.14 and later).
//!
//! The kernel hands requests over in buffers we registered, through one ring per possible CPU,
//! and takes each reply together with the fetch of the next request in one io_uring command,
//! instead of a read and a write of /dev/fuse per request. Forgets and interrupts stay on
//! /dev/fuse, so fuser's threads keep running beside the rings.
//!
//! Two kernel rules shape this module:
//! - The kernel copies a request into an entry from the task that submitted the entry's
//!   command; if that task has exited, the request is stuck until unmount. So only the queue's
//!   own long-lived thread submits, and replies made on other threads (completions of remote
//!   reads) are handed to it.
//! - Once FUSE_INIT granted `FUSE_OVER_IO_URING`, every request waits until each queue has
//!   registered an entry, while a refused REGISTER turns the ring off for the connection (back
//!   to /dev/fuse). So the rings are set up before mounting, the flag is asked for only if that
//!   worked, and registering is the first thing each queue does.

use std::cell::Cell;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use fuser::{RawDispatcher, ReplySink};
use io_uring::{opcode, squeue, types, IoUring};

use crate::fs::RingStats;
use crate::fuse::RfsFuse;

/// `struct fuse_uring_req_header`: the request's or reply's header, the op's own header, and
/// the entry's bookkeeping (`struct fuse_uring_ent_in_out`).
#[repr(C, align(8))]
struct ReqHeader {
    in_out: [u8; 128],
    op_in: [u8; 128],
    ent_in_out: [u8; 32],
}

/// `struct fuse_in_header` and `struct fuse_out_header`.
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
/// Where `payload_sz` sits in `fuse_uring_ent_in_out` (after flags and commit_id).
const PAYLOAD_SZ_AT: usize = 16;
/// Room before each payload: a request's two headers are laid out there so that fuser parses
/// one contiguous request without the payload (a write's data) being copied.
const GAP: usize = 256;
/// The kernel's smallest payload buffer (FUSE_MIN_READ_BUFFER).
const MIN_PAYLOAD: usize = 8192;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// The completion of the wake-up eventfd's read; entries complete with their index.
const WAKE: u64 = u64::MAX;

thread_local! {
    /// The queue whose thread this is: its own replies need no wake-up.
    static QUEUE_OF_THIS_THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The number of CPUs the kernel may run on (one queue each), from a list like `0-3,8`.
pub fn possible_cpus(list: &str) -> Option<usize> {
    let last = list
        .trim()
        .split(',')
        .filter_map(|r| r.split('-').next_back())
        .next_back()?;
    last.trim().parse::<usize>().ok().map(|n| n + 1)
}

/// The payload buffer each entry needs: the kernel refuses smaller ones (max_pages is
/// max_write in pages, as fuser asks).
pub fn payload_size(max_write: u32) -> usize {
    let page = 4096;
    ((max_write as usize).div_ceil(page) * page).max(MIN_PAYLOAD)
}

/// One entry's buffers. They are allocated once and never freed: the kernel keeps their
/// addresses after registration and may write a request into them from our thread's task work
/// until the connection is torn down, which can outlast the ring.
struct EntryMem {
    header: *mut ReqHeader,
    /// `GAP` bytes, then the payload.
    buf: *mut u8,
    payload_len: usize,
    iov: *mut [libc::iovec; 2],
}

// SAFETY: the pointers are to leaked allocations that live as long as the process. Who may
// touch an entry's memory is handed along with the entry: the kernel between a command's
// submission and its completion; then the queue thread, which parses the request and makes the
// entry's one reply sink; the sink's writer until it hands the entry back over the queue's
// channel (a release/acquire pair); then the queue thread again, which submits.
unsafe impl Send for EntryMem {}
// SAFETY: as for Send: accesses through a shared EntryMem follow that hand-over, never at once.
unsafe impl Sync for EntryMem {}

impl EntryMem {
    fn new(payload_len: usize) -> io::Result<EntryMem> {
        let layout = std::alloc::Layout::from_size_align(GAP + payload_len, 4096)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let buf = unsafe { std::alloc::alloc_zeroed(layout) };
        if buf.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        let header = Box::into_raw(Box::new(ReqHeader {
            in_out: [0; 128],
            op_in: [0; 128],
            ent_in_out: [0; 32],
        }));
        let iov = Box::into_raw(Box::new([
            libc::iovec {
                iov_base: header.cast(),
                iov_len: std::mem::size_of::<ReqHeader>(),
            },
            libc::iovec {
                // SAFETY: GAP is inside the allocation.
                iov_base: unsafe { buf.add(GAP) }.cast(),
                iov_len: payload_len,
            },
        ]));
        Ok(EntryMem {
            header,
            buf,
            payload_len,
            iov,
        })
    }

    fn payload(&self) -> *mut u8 {
        // SAFETY: GAP is inside the allocation.
        unsafe { self.buf.add(GAP) }
    }

    /// Writes the reply's header into the entry (the caller holds the entry).
    fn set_out_header(&self, out: &[u8]) {
        let n = out.len().min(OUT_HEADER);
        // SAFETY: the caller holds the entry (see EntryMem's Send); in_out has 128 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_ptr(), (*self.header).in_out.as_mut_ptr(), n)
        }
    }

    /// Copies a reply's body into the payload and records its size (the caller holds the
    /// entry, and no request slice over the payload is alive).
    fn set_payload(&self, body: &[IoSlice<'_>]) {
        let mut at = 0;
        for part in body {
            // SAFETY: the caller checked that the body fits the payload.
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), self.payload().add(at), part.len())
            };
            at += part.len();
        }
        let size = (at as u32).to_ne_bytes();
        // SAFETY: as above; ent_in_out has 32 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                size.as_ptr(),
                (*self.header).ent_in_out.as_mut_ptr().add(PAYLOAD_SZ_AT),
                4,
            )
        }
    }
}

/// A reply handed back to the queue thread.
struct Answered {
    entry: u16,
    /// The body, when it could not be written into the payload at once (see [`EntryReply`]).
    staged: Option<Vec<u8>>,
}

/// What a queue's thread shares with the sinks of its entries.
struct QueueShared {
    /// This ring's number in the process; several rings may serve one kernel queue (`qid`).
    id: usize,
    qid: u16,
    entries: Vec<EntryMem>,
    answered: Sender<Answered>,
    /// Wakes the queue thread for replies made on other threads, while it sleeps.
    wake: OwnedFd,
    sleeping: AtomicBool,
}

impl QueueShared {
    fn hand_back(&self, answered: Answered) {
        // The queue thread holds the receiver for as long as it runs: after it has gone (the
        // connection is torn down), the reply has nowhere to go.
        let _ = self.answered.send(answered);
        // Pairs with the queue thread's fence between saying it sleeps and looking for
        // replies: either it sees this reply, or this sees it asleep.
        std::sync::atomic::fence(Ordering::SeqCst);
        if QUEUE_OF_THIS_THREAD.get() != Some(self.id) && self.sleeping.load(Ordering::Relaxed) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
            let _ = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }

    fn answer_error(&self, entry: u16, unique: u64, errno: i32) {
        let e = &self.entries[entry as usize];
        e.set_out_header(&out_header(unique, -errno, 0));
        e.set_payload(&[]);
        self.hand_back(Answered {
            entry,
            staged: None,
        });
    }
}

fn out_header(unique: u64, error: i32, body_len: usize) -> [u8; OUT_HEADER] {
    let mut h = [0u8; OUT_HEADER];
    h[0..4].copy_from_slice(&((OUT_HEADER + body_len) as u32).to_ne_bytes());
    h[4..8].copy_from_slice(&error.to_ne_bytes());
    h[8..16].copy_from_slice(&unique.to_ne_bytes());
    h
}

/// The one reply of one request in one entry.
///
/// `direct`: the request had no payload, so fuser's view of it ends before the payload and the
/// reply's body can be written there at once, on whatever thread replies. A request with a
/// payload (a write's data, a name) may still be borrowed by the file system while it replies,
/// so its (small) reply is staged and copied in by the queue thread.
struct EntryReply {
    queue: Arc<QueueShared>,
    entry: u16,
    unique: u64,
    direct: bool,
    sent: AtomicBool,
}

impl ReplySink for EntryReply {
    fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        if self.sent.swap(true, Ordering::AcqRel) {
            return Err(io::Error::other("a second reply to one request"));
        }
        let e = &self.queue.entries[self.entry as usize];
        let (head, body) = match data.split_first() {
            Some((head, body)) if head.len() == OUT_HEADER => (head, body),
            _ => {
                self.queue.answer_error(self.entry, self.unique, libc::EIO);
                return Err(io::Error::other("a reply without its header"));
            }
        };
        let len: usize = body.iter().map(|b| b.len()).sum();
        if len > e.payload_len {
            self.queue.answer_error(self.entry, self.unique, libc::EIO);
            return Err(io::Error::other(format!(
                "a {len}-byte reply exceeds the {}-byte ring buffer",
                e.payload_len
            )));
        }
        e.set_out_header(head);
        let staged = if self.direct {
            e.set_payload(body);
            None
        } else {
            Some(body.iter().flat_map(|b| b.iter().copied()).collect())
        };
        self.queue.hand_back(Answered {
            entry: self.entry,
            staged,
        });
        Ok(())
    }
}

impl Drop for EntryReply {
    fn drop(&mut self) {
        // fuser answers EIO for a reply object dropped unanswered; a request it could not even
        // parse leaves only this, and an entry never answered would be lost with its caller.
        if !self.sent.load(Ordering::Acquire) {
            self.queue.answer_error(self.entry, self.unique, libc::EIO);
        }
    }
}

/// One queue: its ring and entries, made before mounting.
struct Queue {
    ring: IoUring<squeue::Entry128>,
    shared: Arc<QueueShared>,
    answered: Receiver<Answered>,
    /// The wake-up read's target; leaked like the entries, as the kernel writes it.
    wake_buf: *mut u64,
}

// SAFETY: wake_buf points to a leaked 8-byte buffer that only the ring (while a read is in
// flight) and nothing else writes; the rest is Send by itself.
unsafe impl Send for Queue {}

/// Rings set up before mounting: FUSE_INIT asks for FUSE over io_uring only if these exist.
pub struct FuseRing {
    queues: Vec<Queue>,
    stats: Arc<RingStats>,
}

impl FuseRing {
    /// `depth` entries per possible CPU, for payloads of `payload_len`, served by up to
    /// `threads` threads per CPU: a call that blocks (a metadata round trip, an fsync) holds up
    /// only its own thread's entries, as it holds up one of fuser's threads on /dev/fuse.
    pub fn prepare(
        cpus: usize,
        threads: usize,
        depth: usize,
        payload_len: usize,
        stats: Arc<RingStats>,
    ) -> io::Result<FuseRing> {
        let threads = threads.clamp(1, depth.max(1));
        let per_thread = (depth / threads).max(1);
        let mut queues = Vec::with_capacity(cpus * threads);
        for (qid, _) in (0..cpus).flat_map(|q| (0..threads).map(move |t| (q, t))) {
            let qid = u16::try_from(qid).map_err(|_| io::Error::other("too many CPUs"))?;
            let ring = IoUring::<squeue::Entry128>::builder()
                .build((per_thread as u32 + 1).next_power_of_two())?;
            let entries = (0..per_thread)
                .map(|_| EntryMem::new(payload_len))
                .collect::<io::Result<Vec<_>>>()?;
            // SAFETY: plain eventfd creation; the result is checked.
            let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if wake < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: eventfd returned a new descriptor that nothing else owns.
            let wake = unsafe { OwnedFd::from_raw_fd(wake) };
            let (tx, rx) = crossbeam_channel::unbounded();
            queues.push(Queue {
                ring,
                shared: Arc::new(QueueShared {
                    id: queues.len(),
                    qid,
                    entries,
                    answered: tx,
                    wake,
                    sleeping: AtomicBool::new(false),
                }),
                answered: rx,
                wake_buf: Box::into_raw(Box::new(0u64)),
            });
        }
        Ok(FuseRing { queues, stats })
    }

    /// Starts each queue's thread: it registers its entries with the FUSE connection behind
    /// `dev` and then serves requests through `dispatcher` until the connection ends.
    pub fn start(self, dev: &OwnedFd, dispatcher: RawDispatcher<RfsFuse>) -> io::Result<()> {
        let dispatcher = Arc::new(dispatcher);
        let entries = self
            .queues
            .iter()
            .map(|q| q.shared.entries.len())
            .sum::<usize>();
        self.stats.entries.store(entries as u64, Ordering::Relaxed);
        for q in self.queues {
            let dev = dev.try_clone()?;
            let dispatcher = dispatcher.clone();
            let stats = self.stats.clone();
            std::thread::Builder::new()
                .name(format!("rfs-uring-{}", q.shared.id))
                .spawn(move || q.serve(dev, &dispatcher, &stats))?;
        }
        Ok(())
    }
}

/// An io_uring command on the FUSE device; REGISTER passes the entry's two buffers.
fn fuse_command(dev: RawFd, op: u32, qid: u16, entry: u16, commit_id: u64) -> squeue::Entry128 {
    let mut cmd = [0u8; 80];
    // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    opcode::UringCmd80::new(types::Fd(dev), op)
        .cmd(cmd)
        .build()
        .user_data(entry as u64)
}

fn register_command(dev: RawFd, qid: u16, entry: u16, mem: &EntryMem) -> squeue::Entry128 {
    let mut sqe = opcode::UringCmd80::new(types::Fd(dev), CMD_REGISTER)
        .cmd({
            let mut cmd = [0u8; 80];
            cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
            cmd
        })
        .addr(Some(mem.iov as u64))
        .build()
        .user_data(entry as u64);
    set_sqe_len(&mut sqe, 2);
    sqe
}

/// Sets `len` in a submission entry, which the io-uring crate's URING_CMD builder leaves 0
/// (FUSE reads the number of iovecs there).
fn set_sqe_len(sqe: &mut squeue::Entry128, len: u32) {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is #[repr(C)] and starts with the kernel's `struct io_uring_sqe`, whose
    // `__u32 len` is at byte 24 in the stable uapi layout; this writes those four bytes of a
    // value we own, as liburing's io_uring_prep_rw does.
    unsafe {
        (sqe as *mut squeue::Entry128)
            .cast::<u8>()
            .add(24)
            .cast::<u32>()
            .write_unaligned(len)
    }
}

/// Lays a request out as fuser parses it, from what the kernel put in the entry: the
/// `fuse_in_header`, the op's header and the payload, contiguous and 8-byte aligned.
/// Returns (unique, offset of the request in the entry's buffer, its length, payload size).
fn lay_out(mem: &EntryMem) -> Result<(u64, usize, usize, usize), (u64, &'static str)> {
    // SAFETY: the kernel completed the entry's command, so the queue thread holds the entry,
    // and no sink exists for it yet.
    let h = unsafe { &*mem.header };
    let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().unwrap());
    let unique = u64::from_ne_bytes(h.in_out[8..16].try_into().unwrap());
    let len = u32_at(&h.in_out, 0) as usize;
    let payload = u32_at(&h.ent_in_out, PAYLOAD_SZ_AT) as usize;
    if payload > mem.payload_len {
        return Err((unique, "a payload larger than its buffer"));
    }
    // The kernel gives the op header's size nowhere but in the total.
    let op_in = match len.checked_sub(IN_HEADER + payload) {
        Some(n) if n <= h.op_in.len() && (IN_HEADER + n).is_multiple_of(8) => n,
        _ => return Err((unique, "a request whose sizes do not add up")),
    };
    let start = GAP - IN_HEADER - op_in;
    // SAFETY: start..GAP lies in the gap before the payload, which only this thread writes,
    // and the sources are the header's own arrays.
    unsafe {
        std::ptr::copy_nonoverlapping(h.in_out.as_ptr(), mem.buf.add(start), IN_HEADER);
        std::ptr::copy_nonoverlapping(h.op_in.as_ptr(), mem.buf.add(start + IN_HEADER), op_in);
    }
    Ok((unique, start, len, payload))
}

impl Queue {
    fn serve(mut self, dev: OwnedFd, dispatcher: &RawDispatcher<RfsFuse>, stats: &RingStats) {
        let qid = self.shared.qid;
        QUEUE_OF_THIS_THREAD.set(Some(self.shared.id));
        let fd = dev.as_raw_fd();
        let n = self.shared.entries.len();
        let mut commit_ids = vec![0u64; n];
        for (i, mem) in self.shared.entries.iter().enumerate() {
            let sqe = register_command(fd, qid, i as u16, mem);
            // SAFETY: the iovecs and buffers the command names are leaked (never freed).
            if unsafe { self.ring.submission().push(&sqe) }.is_err() {
                log::error!("FUSE ring {qid}: submission queue full while registering");
                return;
            }
        }
        self.arm_wake();
        let mut live = n;
        let mut completions = Vec::with_capacity(n + 1);
        while live > 0 {
            while let Ok(a) = self.answered.try_recv() {
                self.commit(fd, a, &commit_ids);
            }
            self.shared.sleeping.store(true, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
            if !self.answered.is_empty() {
                self.shared.sleeping.store(false, Ordering::Relaxed);
                continue;
            }
            let waited = self.ring.submit_and_wait(1);
            self.shared.sleeping.store(false, Ordering::Relaxed);
            match waited {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    log::error!("FUSE ring {qid}: io_uring_enter: {e}");
                    return;
                }
            }
            completions.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for (tag, res) in completions.drain(..) {
                if tag == WAKE {
                    self.arm_wake();
                } else if res < 0 {
                    live -= 1;
                    let err = io::Error::from_raw_os_error(-res);
                    match -res {
                        // The connection ends (unmount, abort) or our ring goes.
                        libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED | libc::ENODEV => {
                            log::debug!("FUSE ring {qid} entry {tag}: {err}")
                        }
                        _ => log::warn!("FUSE ring {qid} entry {tag}: {err}"),
                    }
                } else {
                    stats.requests.fetch_add(1, Ordering::Relaxed);
                    self.dispatch(tag as u16, dispatcher, &mut commit_ids);
                }
            }
        }
        log::debug!("FUSE ring {qid}: connection gone");
    }

    fn dispatch(&self, entry: u16, dispatcher: &RawDispatcher<RfsFuse>, commit_ids: &mut [u64]) {
        let mem = &self.shared.entries[entry as usize];
        let (unique, start, len, payload) = match lay_out(mem) {
            Ok(x) => x,
            Err((unique, why)) => {
                log::error!("FUSE ring {}: {why}; answering EIO", self.shared.qid);
                commit_ids[entry as usize] = unique;
                self.shared.answer_error(entry, unique, libc::EIO);
                return;
            }
        };
        commit_ids[entry as usize] = unique;
        let sink = Arc::new(EntryReply {
            queue: self.shared.clone(),
            entry,
            unique,
            direct: payload == 0,
            sent: AtomicBool::new(false),
        });
        // SAFETY: lay_out put the request at start..start+len, inside the allocation; until
        // the sink hands the entry back, only the sink writes the entry, and it writes the
        // payload (which this slice covers only when `direct` is false) only then.
        let request = unsafe { std::slice::from_raw_parts(mem.buf.add(start), len) };
        if let Err(e) = dispatcher.dispatch(request, sink) {
            // The dropped sink answered EIO.
            log::error!("FUSE ring {}: {e}", self.shared.qid);
        }
    }

    fn commit(&mut self, fd: RawFd, a: Answered, commit_ids: &[u64]) {
        let mem = &self.shared.entries[a.entry as usize];
        if let Some(body) = a.staged {
            // The sink checked the size; the request's slice died with its dispatch.
            mem.set_payload(&[IoSlice::new(&body)]);
        }
        let sqe = fuse_command(
            fd,
            CMD_COMMIT_AND_FETCH,
            self.shared.qid,
            a.entry,
            commit_ids[a.entry as usize],
        );
        // SAFETY: the command names no memory but the registered (leaked) buffers. The queue
        // has a slot per entry plus the wake-up read, and each holds at most one command.
        if unsafe { self.ring.submission().push(&sqe) }.is_err() {
            log::error!("FUSE ring {}: submission queue full", self.shared.qid);
        }
    }

    fn arm_wake(&mut self) {
        let read = opcode::Read::new(
            types::Fd(self.shared.wake.as_raw_fd()),
            self.wake_buf.cast(),
            8,
        )
        .build()
        .user_data(WAKE);
        // SAFETY: wake_buf is a leaked 8-byte buffer.
        if unsafe { self.ring.submission().push(&read.into()) }.is_err() {
            log::error!("FUSE ring {}: submission queue full", self.shared.qid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn possible_cpus_come_from_the_kernels_list() {
        assert_eq!(possible_cpus("0-1\n"), Some(2));
        assert_eq!(possible_cpus("0"), Some(1));
        assert_eq!(possible_cpus("0-3,8-11"), Some(12));
        assert_eq!(possible_cpus("0,5"), Some(6));
        assert_eq!(possible_cpus(""), None);
        assert_eq!(possible_cpus("x"), None);
    }

    fn header(mem: &EntryMem) -> &ReqHeader {
        // SAFETY: the test holds the entry; nothing else touches it.
        unsafe { &*mem.header }
    }

    /// Fills an entry as the kernel does: the in header, the op header, the payload.
    fn kernel_fills(mem: &EntryMem, unique: u64, op_in: &[u8], payload: &[u8], len: u32) {
        // SAFETY: the test holds the entry; the sizes fit the arrays and the payload buffer.
        unsafe {
            let h = &mut *mem.header;
            h.in_out[0..4].copy_from_slice(&len.to_ne_bytes());
            h.in_out[4..8].copy_from_slice(&16u32.to_ne_bytes());
            h.in_out[8..16].copy_from_slice(&unique.to_ne_bytes());
            h.op_in[..op_in.len()].copy_from_slice(op_in);
            h.ent_in_out[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4]
                .copy_from_slice(&(payload.len() as u32).to_ne_bytes());
            std::ptr::copy_nonoverlapping(payload.as_ptr(), mem.payload(), payload.len());
        }
    }

    #[test]
    fn a_request_is_laid_out_whole_and_aligned_before_its_payload() {
        let mem = EntryMem::new(MIN_PAYLOAD).unwrap();
        let op_in: Vec<u8> = (0..40).collect();
        kernel_fills(&mem, 77, &op_in, b"abcde", 85);
        let (unique, start, len, payload) = lay_out(&mem).unwrap();
        assert_eq!((unique, start, len, payload), (77, GAP - 80, 85, 5));
        // SAFETY: lay_out placed 85 bytes at start, inside the allocation.
        let request = unsafe { std::slice::from_raw_parts(mem.buf.add(start), len) };
        assert_eq!(
            request.as_ptr() as usize % 8,
            0,
            "fuser needs the header aligned"
        );
        assert_eq!(&request[..40], &header(&mem).in_out[..40]);
        assert_eq!(&request[40..80], &op_in[..]);
        assert_eq!(&request[80..], b"abcde");
    }

    #[test]
    fn a_request_whose_sizes_do_not_add_up_is_refused() {
        let mem = EntryMem::new(MIN_PAYLOAD).unwrap();
        // Shorter than its header and payload.
        kernel_fills(&mem, 1, &[], b"abcde", 40);
        assert_eq!(lay_out(&mem).unwrap_err().0, 1);
        // An op header longer than its 128 bytes.
        kernel_fills(&mem, 2, &[], b"", 40 + 136);
        assert_eq!(lay_out(&mem).unwrap_err().0, 2);
        // An op header that would leave the request unaligned.
        kernel_fills(&mem, 3, &[0; 12], b"", 52);
        assert_eq!(lay_out(&mem).unwrap_err().0, 3);
        // A payload larger than the buffer.
        kernel_fills(&mem, 4, &[], b"", 40);
        // SAFETY: the test holds the entry.
        unsafe {
            (&mut (*mem.header).ent_in_out)[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4]
                .copy_from_slice(&(MIN_PAYLOAD as u32 + 1).to_ne_bytes())
        };
        assert_eq!(lay_out(&mem).unwrap_err().0, 4);
    }

    fn queue() -> (Arc<QueueShared>, Receiver<Answered>) {
        // SAFETY: plain eventfd creation; checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        let (tx, rx) = crossbeam_channel::unbounded();
        let shared = QueueShared {
            id: 0,
            qid: 0,
            entries: vec![EntryMem::new(MIN_PAYLOAD).unwrap()],
            answered: tx,
            // SAFETY: a new descriptor nothing else owns.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            sleeping: AtomicBool::new(true),
        };
        (Arc::new(shared), rx)
    }

    fn reply(queue: &Arc<QueueShared>, direct: bool) -> EntryReply {
        EntryReply {
            queue: queue.clone(),
            entry: 0,
            unique: 9,
            direct,
            sent: AtomicBool::new(false),
        }
    }

    fn payload_sz(mem: &EntryMem) -> u32 {
        let b = &header(mem).ent_in_out[PAYLOAD_SZ_AT..PAYLOAD_SZ_AT + 4];
        u32::from_ne_bytes(b.try_into().unwrap())
    }

    fn woken(queue: &QueueShared) -> u64 {
        let mut n = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer from our eventfd; it was written, so the
        // read does not block.
        let r = unsafe { libc::read(queue.wake.as_raw_fd(), n.as_mut_ptr().cast(), 8) };
        assert_eq!(r, 8);
        u64::from_ne_bytes(n)
    }

    #[test]
    fn a_reply_to_a_request_without_payload_goes_straight_into_the_entry() {
        let (q, rx) = queue();
        let head = out_header(9, 0, 6);
        reply(&q, true)
            .send(&[
                IoSlice::new(&head),
                IoSlice::new(b"abc"),
                IoSlice::new(b"def"),
            ])
            .unwrap();
        let a = rx.try_recv().unwrap();
        assert_eq!((a.entry, a.staged), (0, None));
        let mem = &q.entries[0];
        assert_eq!(&header(mem).in_out[..16], &head);
        assert_eq!(payload_sz(mem), 6);
        // SAFETY: the reply was handed back; the test holds the entry.
        let body = unsafe { std::slice::from_raw_parts(mem.payload(), 6) };
        assert_eq!(body, b"abcdef");
        assert_eq!(woken(&q), 1, "a reply from another thread wakes the queue");
    }

    #[test]
    fn a_reply_to_a_request_with_payload_is_staged_for_the_queue_thread() {
        let (q, rx) = queue();
        // SAFETY: the test holds the entry.
        unsafe { std::ptr::copy_nonoverlapping(b"data".as_ptr(), q.entries[0].payload(), 4) };
        let head = out_header(9, 0, 8);
        reply(&q, false)
            .send(&[IoSlice::new(&head), IoSlice::new(&[1; 8])])
            .unwrap();
        let a = rx.try_recv().unwrap();
        assert_eq!(a.staged.as_deref(), Some(&[1u8; 8][..]));
        // SAFETY: as above.
        let body = unsafe { std::slice::from_raw_parts(q.entries[0].payload(), 4) };
        assert_eq!(body, b"data", "the request's payload is left alone");
    }

    #[test]
    fn every_request_gets_exactly_one_reply() {
        let (q, rx) = queue();
        let head = out_header(9, 0, 0);
        let r = reply(&q, true);
        r.send(&[IoSlice::new(&head)]).unwrap();
        assert!(r.send(&[IoSlice::new(&head)]).is_err());
        drop(r);
        assert!(rx.try_recv().is_ok());
        assert!(
            rx.try_recv().is_err(),
            "one reply, not two, and none at drop"
        );

        // Dropped unanswered (fuser could not parse it): EIO.
        drop(reply(&q, true));
        rx.try_recv().unwrap();
        let error = i32::from_ne_bytes(header(&q.entries[0]).in_out[4..8].try_into().unwrap());
        assert_eq!(error, -libc::EIO);

        // Larger than the entry's buffer: EIO, not an overflow.
        let big = vec![0u8; MIN_PAYLOAD + 1];
        let r = reply(&q, true);
        assert!(r
            .send(&[
                IoSlice::new(&out_header(9, 0, big.len())),
                IoSlice::new(&big)
            ])
            .is_err());
        rx.try_recv().unwrap();
        let error = i32::from_ne_bytes(header(&q.entries[0]).in_out[4..8].try_into().unwrap());
        assert_eq!(error, -libc::EIO);
        assert_eq!(payload_sz(&q.entries[0]), 0);
    }

    #[test]
    fn payloads_hold_the_largest_write_in_whole_pages() {
        assert_eq!(payload_size(1 << 20), 1 << 20);
        assert_eq!(payload_size(128 << 10), 128 << 10);
        assert_eq!(payload_size(4096), MIN_PAYLOAD);
        assert_eq!(payload_size(5000), MIN_PAYLOAD);
        assert_eq!(payload_size(9000), 12288);
    }
}
