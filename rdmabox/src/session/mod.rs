//! A session: everything one client keeps for one peer. N RC queue pairs (each with its own CQ
//! and poller thread), the peer's region descriptors, the read and write merge queues, the preMR
//! pool, the admission window and the counters. Requests are asynchronous: submit from any
//! thread, get the result through a callback (or a [`Pending`] handle) on a poller thread.
//!
//! This module is the API and the state it shares; the work is split by direction of travel:
//! - `request`: the request model (a request, its buffer, a work request in flight);
//! - `submit`: admission, draining, staging and posting;
//! - `complete`: the poller threads and answering completed requests;
//! - `gather`: reads of several ranges that come together in one slot.

mod complete;
mod gather;
mod request;
mod submit;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::batching::PlanConfig;
use crate::counters::{Counters, Snapshot};
use crate::merge_queue::MergeQueue;
use crate::mr_pool::{MrPool, Slot};
use crate::poller::PollMode;
use crate::transport::{
    Access, CompletionQueue, Landing, ProtectionDomain, QpCaps, QueuePair, RemoteAddr,
    RemoteRegion, WcStatus,
};
use crate::window::{AdmissionPolicy, WindowConfig};

use gather::{Gather, Store};
use request::{Buffer, Dir, Done, InFlight, Request};

/// The tunables of a session; the defaults are the paper's (measured on ConnectX-3).
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// RC queue pairs to the peer; chains are spread over them.
    pub qps: usize,
    /// Merge requests adjacent in remote memory into one work request.
    pub merge: bool,
    /// Chain work requests into one post call.
    pub chain: bool,
    /// Work requests one post call may carry.
    pub max_chain: usize,
    /// Bytes one merged work request may carry.
    pub max_merge_bytes: usize,
    /// Requests at least this large register their own buffer (dynMR) instead of being copied
    /// into a pre-registered one (preMR). `usize::MAX`: always copy (up to `slot_size`). Reads
    /// lent where they land ([`Session::read_borrowing`]) take a slot while one fits them and
    /// the pool has one to spare: they are copied nowhere either way.
    pub dyn_threshold: usize,
    /// Size of one pre-registered staging buffer; larger requests always use dynMR.
    pub slot_size: usize,
    /// Staging buffers in the preMR pool: at most this many staged work requests in flight.
    pub pool_slots: usize,
    /// Admission control: how many bytes may be in flight.
    pub window: WindowConfig,
    /// How the poller threads wait for completions.
    pub polling: PollMode,
    /// Queue depths and SGE limits of each queue pair (`connect_queue_pairs` creates them so).
    pub caps: QpCaps,
    /// Requests one drain pass takes from a queue.
    pub max_drain: usize,
    /// The longest a work request may stay unanswered once posted. Past it the peer is taken
    /// for dead: the queue pairs are moved to the error state (which flushes everything in
    /// flight, so no late transfer can touch a buffer after its request was answered) and
    /// every request fails with [`IoError::TimedOut`]. `None`: wait as long as the transport.
    pub io_timeout: Option<Duration>,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            qps: 4,
            merge: true,
            chain: true,
            max_chain: 32,
            max_merge_bytes: 1 << 20,
            dyn_threshold: 928 << 10,
            slot_size: 1 << 20,
            pool_slots: 64,
            window: WindowConfig::default(),
            polling: PollMode::default(),
            caps: QpCaps::default(),
            max_drain: 256,
            io_timeout: Some(Duration::from_secs(5)),
        }
    }
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoError {
    /// The remote range is not inside a region the peer lent us.
    OutOfBounds {
        /// Remote start address asked for.
        addr: u64,
        /// Bytes asked for.
        len: usize,
    },
    /// The session is closed, or broken by an earlier transport error.
    Closed,
    /// The transport failed the request (peer gone, access refused...).
    Transport(WcStatus),
    /// The buffer could not be registered.
    Registration(String),
    /// The peer left a work request unanswered past the session's `io_timeout`.
    TimedOut(Duration),
    /// The session was broken from outside ([`AbortHandle::abort`]): the peer is known gone.
    Aborted(String),
}

impl std::fmt::Display for IoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoError::OutOfBounds { addr, len } => {
                write!(
                    f,
                    "remote range {addr:#x}+{len} is outside the peer's regions"
                )
            }
            IoError::Closed => write!(f, "session closed"),
            IoError::Transport(s) => write!(f, "transport error: {s:?}"),
            IoError::Registration(e) => write!(f, "memory registration failed: {e}"),
            IoError::TimedOut(t) => write!(f, "no answer from the peer within {t:?}"),
            IoError::Aborted(why) => write!(f, "session aborted: {why}"),
        }
    }
}

impl std::error::Error for IoError {}

/// Receives a request's result: the filled buffer for a read, the caller's buffer back for a
/// write.
pub type Callback = Box<dyn FnOnce(Result<Vec<u8>, IoError>) + Send>;

/// Receives a write's result with the caller's buffer either way, so that a write that failed
/// can be sent again (to another replica, or once its cause is cured) without a copy kept
/// beside every write.
pub type KeepingCallback = Box<dyn FnOnce(Result<Vec<u8>, (IoError, Vec<u8>)>) + Send>;

/// Receives a read's bytes where they landed, for as long as the call lasts.
pub type BorrowingCallback = Box<dyn FnOnce(Result<&[u8], IoError>) + Send>;

/// Hears that a read is in the caller's memory (or why not).
pub type LandedCallback = Box<dyn FnOnce(Result<(), IoError>) + Send>;

/// One queue pair with its CQ and the work requests it has in flight, keyed by wr_id.
struct SessionQp {
    qp: QueuePair,
    cq: CompletionQueue,
    inflight: Mutex<InFlight>,
    /// Its poller is spinning: a lone request sent here is seen the moment it completes.
    spinning: AtomicBool,
    /// The peer refused one of its work requests, which took its queue pair to the error
    /// state: nothing more is posted here.
    refused: AtomicBool,
}

/// The state a session shares with its poller threads.
struct Inner {
    cfg: SessionConfig,
    plan: PlanConfig,
    pd: Arc<ProtectionDomain>,
    qps: Vec<SessionQp>,
    next_qp: AtomicUsize,
    /// Queue pairs no refusal has taken out of service yet.
    live_qps: AtomicUsize,
    /// The latest keys the peer refused, each for reads or for writes (a key may be good for
    /// one and not the other), at most [`REFUSED_KEYS`]: requests that carry one the same way
    /// fail without being sent, so that one stale key takes out one queue pair, not one per
    /// request that carried it.
    refused_keys: Mutex<std::collections::VecDeque<(u32, Dir)>>,
    queues: [MergeQueue<Request>; 2],
    pool: Arc<MrPool>,
    policy: Box<dyn AdmissionPolicy>,
    counters: Counters,
    remote: Vec<RemoteRegion>,
    closed: AtomicBool,
    /// Counts polls that finished work requests (so freed what they held), for drainers.
    freed: AtomicU64,
    /// Transport threads finishing completions inline right now.
    inline_running: AtomicUsize,
    /// Why the session was broken on purpose (deadline, abort): what flushed requests report.
    cause: OnceLock<IoError>,
    stopping: AtomicBool,
}

/// A session with one peer. Dropping it fails whatever is still queued or in flight.
pub struct Session {
    inner: Arc<Inner>,
    pollers: Vec<JoinHandle<()>>,
}

/// The result of one request, for callers that prefer to wait.
pub struct Pending(crossbeam_channel::Receiver<Result<Vec<u8>, IoError>>);

impl Pending {
    /// Blocks until the request completes; [`IoError::Closed`] if it was dropped unanswered.
    pub fn wait(self) -> Result<Vec<u8>, IoError> {
        self.0.recv().unwrap_or(Err(IoError::Closed))
    }

    /// Like [`Pending::wait`], giving up with [`IoError::TimedOut`] after `limit`: the request
    /// goes on (its buffer is its own until it completes), only nobody waits for it.
    pub fn wait_timeout(self, limit: std::time::Duration) -> Result<Vec<u8>, IoError> {
        match self.0.recv_timeout(limit) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(IoError::TimedOut(limit)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(IoError::Closed),
        }
    }
}

impl Session {
    /// Starts a session over connected queue pairs. `remote` are the regions the peer lent us;
    /// requests outside them are refused before they reach the wire.
    pub fn new(
        pd: Arc<ProtectionDomain>,
        qps: Vec<(QueuePair, CompletionQueue)>,
        remote: Vec<RemoteRegion>,
        cfg: SessionConfig,
    ) -> io::Result<Session> {
        if qps.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a session needs a queue pair",
            ));
        }
        let max_sge = qps
            .iter()
            .map(|(qp, _)| qp.caps().max_send_sge as usize)
            .min()
            .unwrap_or(1)
            .max(1);
        let pool = MrPool::new(&pd, cfg.pool_slots, cfg.slot_size)?;
        let plan = PlanConfig {
            merge: cfg.merge,
            chain: cfg.chain,
            max_chain: cfg.max_chain,
            max_merge_bytes: cfg.max_merge_bytes,
            max_staged_bytes: cfg.slot_size,
            max_sge,
        };
        let inner = Arc::new(Inner {
            plan,
            policy: cfg.window.build(),
            pd,
            qps: qps
                .into_iter()
                .map(|(qp, cq)| SessionQp {
                    qp,
                    cq,
                    inflight: Mutex::default(),
                    spinning: AtomicBool::new(false),
                    refused: AtomicBool::new(false),
                })
                .collect(),
            next_qp: AtomicUsize::new(0),
            live_qps: AtomicUsize::new(0),
            refused_keys: Mutex::default(),
            queues: [MergeQueue::default(), MergeQueue::default()],
            pool,
            counters: Counters::default(),
            remote,
            closed: AtomicBool::new(false),
            freed: AtomicU64::new(0),
            inline_running: AtomicUsize::new(0),
            cause: OnceLock::new(),
            stopping: AtomicBool::new(false),
            cfg,
        });
        inner.live_qps.store(inner.qps.len(), Ordering::Release);
        if inner.cfg.polling.sleeps() {
            inner.complete_inline();
        }
        let pollers = (0..inner.qps.len())
            .map(|i| {
                let inner = inner.clone();
                std::thread::Builder::new()
                    .name(format!("rdmabox-poll{i}"))
                    .spawn(move || inner.poll_loop(i))
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Session { inner, pollers })
    }

    /// The settings the session was started with.
    pub fn config(&self) -> &SessionConfig {
        &self.inner.cfg
    }

    /// A copy of the live counters, read effects before causes (see [`crate::counters`]).
    pub fn counters(&self) -> Snapshot {
        self.inner.counters.snapshot()
    }

    /// The window policy in force, in words.
    pub fn window(&self) -> String {
        self.inner.policy.describe()
    }

    /// False once a transport error broke the session or it was closed.
    pub fn is_open(&self) -> bool {
        !self.inner.closed.load(Ordering::Acquire)
    }

    /// Whether refused transfers (stale keys) took more than half of its queue pairs: it
    /// still works, over the rest, but a new session would serve better.
    pub fn is_degraded(&self) -> bool {
        let qps = self.inner.qps.len();
        let refused = qps - self.inner.live_qps.load(Ordering::Acquire);
        refused * 2 > qps
    }

    /// Why the session was broken on purpose (its deadline passed, it was aborted), if it was.
    pub fn broken_by(&self) -> Option<IoError> {
        self.inner.cause.get().cloned()
    }

    /// A handle that breaks the session from elsewhere (a watcher of the peer's control
    /// connection), without keeping it alive.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(Arc::downgrade(&self.inner))
    }

    /// Reads `buf.len()` bytes at `remote` into `buf`; `done` gets the filled buffer.
    pub fn read(&self, remote: RemoteAddr, buf: Vec<u8>, done: Callback) {
        let len = buf.len();
        self.inner.submit(
            Dir::Read,
            remote,
            len,
            Buffer::Plain(buf),
            Done::Result(done),
        );
    }

    /// Reads `len` bytes at `remote`; `done` borrows them where they landed: a staging slot,
    /// so that a caller who only passes them on (a FUSE reply) makes no buffer of its own,
    /// neither zeroed nor copied into. Above the dynMR threshold too, while the pool has a slot
    /// to spare: a read lent where it landed is copied nowhere either way, and a slot needs no
    /// buffer allocated and registered. Without one it lands in a registered buffer (dynMR).
    pub fn read_borrowing(&self, remote: RemoteAddr, len: usize, done: BorrowingCallback) {
        if self.inner.is_dynamic_len(len) {
            return self.read_gathered(&[(remote, len)], done);
        }
        self.inner.submit(
            Dir::Read,
            remote,
            len,
            Buffer::Plain(Vec::new()),
            Done::Borrowing(done),
        );
    }

    /// Reads `into.len()` bytes at `remote` into the caller's memory `into`. At the dynMR
    /// threshold and above that memory is registered for the transfer, which lands there and
    /// nowhere else; below it the bytes are staged in a pool slot and copied in, as any small
    /// read's are (a copy costs less than a registration).
    pub fn read_into(&self, remote: RemoteAddr, into: Landing, done: LandedCallback) {
        let len = into.len();
        if !self.inner.is_dynamic_len(len) {
            return self.read_borrowing(
                remote,
                len,
                Box::new(move |r| {
                    done(r.and_then(|bytes| match into.copy_in(0, bytes) {
                        true if bytes.len() == into.len() => Ok(()),
                        _ => Err(IoError::Transport(WcStatus::LocalLengthError)),
                    }))
                }),
            );
        }
        match self.inner.pd.register_landing(&into, Access::LOCAL_WRITE) {
            Ok(mr) => {
                Counters::add(&self.inner.counters.dynmr_registrations, 1);
                self.inner.submit(
                    Dir::Read,
                    remote,
                    len,
                    Buffer::Registered(Arc::new(mr)),
                    Done::Landed(done),
                )
            }
            Err(e) => {
                Counters::add(&self.inner.counters.requests, 1);
                Counters::add(&self.inner.counters.requests_failed, 1);
                done(Err(IoError::Registration(e.to_string())))
            }
        }
    }

    /// Reads the remote ranges `pieces` side by side; `done` borrows their bytes as one run,
    /// or gets the first failure. They land in one staging slot where they fit in one and one
    /// is free (the way a FUSE read crossing a chunk boundary is answered without a buffer of
    /// its own); otherwise each piece is copied into a buffer of the gather's own.
    pub fn read_gathered(&self, pieces: &[(RemoteAddr, usize)], done: BorrowingCallback) {
        match pieces {
            [] => return done(Ok(&[])),
            [(remote, len)] if !self.inner.is_dynamic_len(*len) => {
                return self.read_borrowing(*remote, *len, done)
            }
            _ => {}
        }
        let len: usize = pieces.iter().map(|p| p.1).sum();
        // A gather holds its slot while its pieces wait in the queue, maybe behind a staged
        // request that needs one: gathers leave one slot to the rest, which then always find
        // one free when nothing is in flight.
        let slot = (len <= self.inner.pool.slot_size())
            .then(|| self.inner.pool.try_get_sparing(1))
            .flatten();
        match (slot, pieces) {
            (Some(slot), _) => self.gather_in_slot(slot, pieces, len, done),
            (None, &[(remote, len)]) => self.inner.submit(
                Dir::Read,
                remote,
                len,
                Buffer::Plain(vec![0; len]),
                Done::Borrowing(done),
            ),
            (None, _) => self.gather_copied(pieces, len, done),
        }
    }

    /// Lands each piece at its place in `slot`; the last one lends the slot to `done`.
    fn gather_in_slot(
        &self,
        slot: Slot,
        pieces: &[(RemoteAddr, usize)],
        len: usize,
        done: BorrowingCallback,
    ) {
        let base = slot.offset();
        let gather = Arc::new(Gather::new(Store::Slot(slot), len, pieces.len(), done));
        let mut at = 0;
        for &(remote, n) in pieces {
            let pool_offset = base + at;
            self.inner.submit(
                Dir::Read,
                remote,
                n,
                Buffer::Gathered { pool_offset },
                Done::Gathered(gather.clone()),
            );
            at += n;
        }
        // If every piece was answered already (inline, or failed at submission), the slot goes
        // back here, outside any completion: a request waiting for a slot must hear of it.
        if let Some(last) = Arc::into_inner(gather) {
            drop(last);
            self.inner.freed.fetch_add(1, Ordering::SeqCst);
            self.inner.drain(Dir::Read);
            self.inner.drain(Dir::Write);
        }
    }

    /// Reads each piece on its own and copies it to its place in a buffer of the gather's.
    fn gather_copied(&self, pieces: &[(RemoteAddr, usize)], len: usize, done: BorrowingCallback) {
        Counters::add(&self.inner.counters.premr_copies, pieces.len() as u64);
        let store = Store::Copied(Mutex::new(vec![0; len]));
        let gather = Arc::new(Gather::new(store, len, pieces.len(), done));
        let mut at = 0;
        for &(remote, n) in pieces {
            let g = gather.clone();
            self.read_borrowing(
                remote,
                n,
                Box::new(move |r| match r {
                    Ok(bytes) => {
                        g.copy_in(at, bytes);
                        g.piece_done(None)
                    }
                    Err(e) => g.piece_done(Some(e)),
                }),
            );
            at += n;
        }
    }

    /// Writes `data` at `remote`; `done` gets the buffer back.
    ///
    /// Requests outstanding together are not ordered with one another, as on several queue
    /// pairs: they may go over different ones, and a drain posts in address order. Whoever
    /// needs one write to land before an overlapping one, or a read to see it, waits for its
    /// completion first (fs-client's write-behind does).
    pub fn write(&self, remote: RemoteAddr, data: Vec<u8>, done: Callback) {
        let len = data.len();
        self.inner.submit(
            Dir::Write,
            remote,
            len,
            Buffer::Plain(data),
            Done::Result(done),
        );
    }

    /// [`Session::write`], whose `done` gets the buffer back on failure too.
    pub fn write_keeping(&self, remote: RemoteAddr, data: Vec<u8>, done: KeepingCallback) {
        let len = data.len();
        self.inner.submit(
            Dir::Write,
            remote,
            len,
            Buffer::Plain(data),
            Done::Keeping(done),
        );
    }

    /// [`Session::read`], with a handle to wait on instead of a callback.
    pub fn read_pending(&self, remote: RemoteAddr, buf: Vec<u8>) -> Pending {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.read(remote, buf, Box::new(move |r| drop(tx.send(r))));
        Pending(rx)
    }

    /// [`Session::write`], with a handle to wait on instead of a callback.
    pub fn write_pending(&self, remote: RemoteAddr, data: Vec<u8>) -> Pending {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.write(remote, data, Box::new(move |r| drop(tx.send(r))));
        Pending(rx)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.closed.store(true, Ordering::Release);
        inner.drain(Dir::Read);
        inner.drain(Dir::Write);
        inner.stopping.store(true, Ordering::SeqCst);
        for l in &inner.qps {
            l.qp.set_error();
        }
        // A transport thread inside an inline completion takes requests out of the in-flight
        // tables and answers them: the pollers would see nothing left and end while it does.
        let start = std::time::Instant::now();
        while inner.inline_running.load(Ordering::SeqCst) > 0
            && start.elapsed() < std::time::Duration::from_secs(5)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for p in self.pollers.drain(..) {
            let _ = p.join();
        }
        // What a drainer that was busy when the session closed left queued.
        inner.drain(Dir::Read);
        inner.drain(Dir::Write);
        // Anything a provider failed to flush in time still gets its answer.
        for l in &inner.qps {
            let left = l.inflight.lock().unwrap().drain();
            for w in left {
                inner.finish(w, WcStatus::WrFlushError);
            }
        }
    }
}

/// Breaks a session whose peer is known to be gone; see [`Session::abort_handle`].
#[derive(Clone)]
pub struct AbortHandle(Weak<Inner>);

impl AbortHandle {
    /// Fails everything queued and in flight with [`IoError::Aborted`] and every later request
    /// with [`IoError::Closed`]. Nothing if the session is already gone or broken.
    pub fn abort(&self, why: &str) {
        if let Some(inner) = self.0.upgrade() {
            inner.break_with(IoError::Aborted(why.to_string()));
        }
    }
}

/// Refused keys a session remembers.
const REFUSED_KEYS: usize = 64;

impl Inner {
    /// Remembers that the peer refused `rkey` for `dir`.
    fn key_refused(&self, rkey: u32, dir: Dir) {
        let mut keys = self.refused_keys.lock().unwrap();
        if !keys.contains(&(rkey, dir)) {
            if keys.len() == REFUSED_KEYS {
                keys.pop_front();
            }
            keys.push_back((rkey, dir));
        }
    }

    /// Whether the peer refused `rkey` for `dir` lately. Asked of every request: costs a
    /// load until a queue pair was refused (keys are remembered only then).
    fn is_refused(&self, rkey: u32, dir: Dir) -> bool {
        self.live_qps.load(Ordering::Acquire) < self.qps.len()
            && self.refused_keys.lock().unwrap().contains(&(rkey, dir))
    }

    /// Breaks the session on purpose: records why (what flushed requests will report), closes
    /// it to new requests and moves every queue pair to the error state, which flushes what
    /// is in flight through the pollers. The first cause wins.
    fn break_with(&self, cause: IoError) {
        if self.cause.set(cause.clone()).is_err() {
            return;
        }
        log::warn!("session broken: {cause}");
        self.closed.store(true, Ordering::Release);
        for l in &self.qps {
            l.qp.set_error();
        }
        self.drain(Dir::Read);
        self.drain(Dir::Write);
    }

    /// Answers a request with an error and counts it as failed.
    fn fail(&self, r: Request, e: IoError) {
        Counters::add(&self.counters.requests_failed, 1);
        r.done.fail(e, r.buf);
    }
}
