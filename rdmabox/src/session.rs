//! A session: everything one client keeps for one peer. N RC queue pairs (each with its own CQ
//! and poller thread), the peer's region descriptors, the read and write merge queues, the preMR
//! pool, the admission window and the counters. Requests are asynchronous: submit from any
//! thread, get the result through a callback (or a [`Pending`] handle) on a poller thread.

use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use slab::Slab;

use crate::batching::{self, Chain, Desc, PlanConfig};
use crate::counters::{Counters, Snapshot};
use crate::merge_queue::MergeQueue;
use crate::mr_pool::{MrPool, Slot};
use crate::poller::{Next, PollMode, PollState};
use crate::transport::{
    exchange_endpoints, Access, Completion, CompletionQueue, Context, MemoryRegion, PostError,
    ProtectionDomain, QpCaps, QueuePair, RemoteAddr, RemoteRegion, SendOp, SendWr, Sge, WcStatus,
};
use crate::window::{admits, charge, AdmissionPolicy, WindowConfig};

/// The tunables of a session; the defaults are the paper's (measured on ConnectX-3).
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// RC queue pairs to the peer; chains are spread over them.
    pub qps: usize,
    /// Merge requests adjacent in remote memory into one work request.
    pub merge: bool,
    /// Chain work requests into one post call.
    pub chain: bool,
    pub max_chain: usize,
    /// Bytes one merged work request may carry.
    pub max_merge_bytes: usize,
    /// Requests at least this large register their own buffer (dynMR) instead of being copied
    /// into a pre-registered one (preMR). `usize::MAX`: always copy (up to `slot_size`).
    pub dyn_threshold: usize,
    /// Size of one pre-registered staging buffer; larger requests always use dynMR.
    pub slot_size: usize,
    pub pool_slots: usize,
    pub window: WindowConfig,
    pub polling: PollMode,
    pub caps: QpCaps,
    /// Requests one drain pass takes from a queue.
    pub max_drain: usize,
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
        }
    }
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IoError {
    /// The remote range is not inside a region the peer lent us.
    OutOfBounds { addr: u64, len: usize },
    /// The session is closed, or broken by an earlier transport error.
    Closed,
    /// The transport failed the request (peer gone, access refused...).
    Transport(WcStatus),
    /// The buffer could not be registered.
    Registration(String),
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
        }
    }
}

impl std::error::Error for IoError {}

/// Receives a request's result: the filled buffer for a read, the caller's buffer back for a
/// write.
pub type Callback = Box<dyn FnOnce(Result<Vec<u8>, IoError>) + Send>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Read = 0,
    Write = 1,
}

enum Buffer {
    Plain(Vec<u8>),
    Registered(Arc<MemoryRegion>),
}

struct Request {
    remote: RemoteAddr,
    len: usize,
    buf: Buffer,
    done: Callback,
}

/// Where a member of a work request is staged.
enum Staging {
    /// At this offset of the work request's pool slot.
    Pool(usize),
    /// In its own registered buffer.
    Dynamic,
}

struct InflightWr {
    dir: Dir,
    members: Vec<(Request, Staging)>,
    slot: Option<Slot>,
    cost: u64,
    bytes: u64,
    posted: Instant,
}

struct Link {
    qp: QueuePair,
    cq: CompletionQueue,
    inflight: Mutex<Slab<InflightWr>>,
}

struct Inner {
    cfg: SessionConfig,
    plan: PlanConfig,
    pd: Arc<ProtectionDomain>,
    links: Vec<Link>,
    next_link: AtomicUsize,
    queues: [MergeQueue<Request>; 2],
    pool: Arc<MrPool>,
    policy: Box<dyn AdmissionPolicy>,
    counters: Counters,
    remote: Vec<RemoteRegion>,
    closed: AtomicBool,
    stopping: AtomicBool,
}

/// A session with one peer. Dropping it fails whatever is still queued or in flight.
pub struct Session {
    inner: Arc<Inner>,
    pollers: Vec<JoinHandle<()>>,
}

/// Creates `n` queue pairs (each with its own CQ) and connects them to the peer's over a
/// control connection. Both sides call it with the same `n`.
pub fn connect_links(
    ctx: &Context,
    pd: &ProtectionDomain,
    control: &mut TcpStream,
    n: usize,
    caps: QpCaps,
) -> io::Result<Vec<(QueuePair, CompletionQueue)>> {
    let mut prepared = Vec::with_capacity(n);
    let mut local = Vec::with_capacity(n);
    for _ in 0..n {
        let cq = ctx.create_cq((caps.max_send_wr + caps.max_recv_wr) as usize)?;
        let qp = ctx.create_qp(pd, &cq, &cq, caps)?;
        local.push(qp.endpoint()?);
        prepared.push((qp, cq));
    }
    let remote = exchange_endpoints(control, &local)?;
    if remote.len() != n {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "peer offered {} queue pairs, we asked for {n}",
                remote.len()
            ),
        ));
    }
    prepared
        .into_iter()
        .zip(&remote)
        .map(|((qp, cq), r)| Ok((qp.connect(r)?, cq)))
        .collect()
}

/// The result of one request, for callers that prefer to wait.
pub struct Pending(crossbeam_channel::Receiver<Result<Vec<u8>, IoError>>);

impl Pending {
    pub fn wait(self) -> Result<Vec<u8>, IoError> {
        self.0.recv().unwrap_or(Err(IoError::Closed))
    }
}

impl Session {
    /// Starts a session over connected queue pairs. `remote` are the regions the peer lent us;
    /// requests outside them are refused before they reach the wire.
    pub fn new(
        pd: Arc<ProtectionDomain>,
        links: Vec<(QueuePair, CompletionQueue)>,
        remote: Vec<RemoteRegion>,
        cfg: SessionConfig,
    ) -> io::Result<Session> {
        if links.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a session needs a queue pair",
            ));
        }
        let max_sge = links
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
            links: links
                .into_iter()
                .map(|(qp, cq)| Link {
                    qp,
                    cq,
                    inflight: Mutex::new(Slab::new()),
                })
                .collect(),
            next_link: AtomicUsize::new(0),
            queues: [MergeQueue::default(), MergeQueue::default()],
            pool,
            counters: Counters::default(),
            remote,
            closed: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            cfg,
        });
        let pollers = (0..inner.links.len())
            .map(|i| {
                let inner = inner.clone();
                std::thread::Builder::new()
                    .name(format!("rdmabox-poll{i}"))
                    .spawn(move || inner.poll_loop(i))
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Session { inner, pollers })
    }

    pub fn config(&self) -> &SessionConfig {
        &self.inner.cfg
    }

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

    /// Reads `buf.len()` bytes at `remote` into `buf`; `done` gets the filled buffer.
    pub fn read(&self, remote: RemoteAddr, buf: Vec<u8>, done: Callback) {
        self.inner.submit(Dir::Read, remote, buf, done);
    }

    /// Writes `data` at `remote`; `done` gets the buffer back.
    pub fn write(&self, remote: RemoteAddr, data: Vec<u8>, done: Callback) {
        self.inner.submit(Dir::Write, remote, data, done);
    }

    pub fn read_pending(&self, remote: RemoteAddr, buf: Vec<u8>) -> Pending {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.read(remote, buf, Box::new(move |r| drop(tx.send(r))));
        Pending(rx)
    }

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
        inner.stopping.store(true, Ordering::Release);
        for l in &inner.links {
            l.qp.set_error();
        }
        for p in self.pollers.drain(..) {
            let _ = p.join();
        }
        // Anything a provider failed to flush in time still gets its answer.
        for l in &inner.links {
            let left: Vec<_> = l.inflight.lock().unwrap().drain().collect();
            for w in left {
                inner.finish(w, WcStatus::WrFlushError);
            }
        }
    }
}

/// The requests of a chain that could not be posted, by batch index.
struct Unposted(Vec<usize>);

impl Inner {
    fn submit(&self, dir: Dir, remote: RemoteAddr, buf: Vec<u8>, done: Callback) {
        Counters::add(&self.counters.requests, 1);
        let len = buf.len();
        if self.closed.load(Ordering::Acquire) {
            Counters::add(&self.counters.requests_failed, 1);
            return done(Err(IoError::Closed));
        }
        if len == 0 {
            return done(Ok(buf));
        }
        let inside = self.remote.iter().any(|r| {
            r.rkey == remote.rkey
                && remote.addr >= r.addr
                && remote
                    .addr
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= r.addr + r.len)
        });
        if !inside || len > i32::MAX as usize {
            Counters::add(&self.counters.requests_failed, 1);
            return done(Err(IoError::OutOfBounds {
                addr: remote.addr,
                len,
            }));
        }
        self.queues[dir as usize].push(Request {
            remote,
            len,
            buf: Buffer::Plain(buf),
            done,
        });
        self.drain(dir);
    }

    fn drain(&self, dir: Dir) {
        self.queues[dir as usize].drain_with(|q| self.drain_pass(dir, q), |q| self.can_progress(q));
    }

    fn is_dynamic(&self, r: &Request) -> bool {
        matches!(r.buf, Buffer::Registered(_))
            || r.len >= self.cfg.dyn_threshold
            || r.len > self.cfg.slot_size
    }

    fn link_room(&self, n: usize) -> Option<usize> {
        let links = self.links.len();
        let start = self.next_link.fetch_add(1, Ordering::Relaxed);
        (0..links).map(|k| (start + k) % links).find(|&i| {
            self.links[i].inflight.lock().unwrap().len() + n
                <= self.links[i].qp.caps().max_send_wr as usize
        })
    }

    /// Whether the head of the queue could be posted now.
    fn can_progress(&self, q: &MergeQueue<Request>) -> bool {
        let pending = q.pending();
        let Some(front) = pending.front() else {
            return false;
        };
        if self.closed.load(Ordering::Acquire) {
            return true;
        }
        let inflight = self.counters.inflight_bytes.load(Ordering::Relaxed);
        admits(inflight, charge(front.len), self.policy.limit())
            && (self.is_dynamic(front) || self.pool.available() > 0)
            && self
                .links
                .iter()
                .any(|l| l.inflight.lock().unwrap().len() < l.qp.caps().max_send_wr as usize)
    }

    fn fail(&self, r: Request, e: IoError) {
        Counters::add(&self.counters.requests_failed, 1);
        (r.done)(Err(e));
    }

    fn drain_pass(&self, dir: Dir, q: &MergeQueue<Request>) {
        if self.closed.load(Ordering::Acquire) {
            let all: Vec<_> = q.pending().drain(..).collect();
            for r in all {
                self.fail(r, IoError::Closed);
            }
            return;
        }
        let limit = self.policy.limit();
        let inflight = self.counters.inflight_bytes.load(Ordering::Relaxed);
        let mut batch = Vec::new();
        let mut cost = 0;
        {
            let mut pending = q.pending();
            while batch.len() < self.cfg.max_drain {
                let Some(front) = pending.front() else { break };
                let c = charge(front.len);
                if !admits(inflight + cost, c, limit) {
                    Counters::add(&self.counters.window_stalls, 1);
                    break;
                }
                cost += c;
                batch.push(pending.pop_front().expect("front exists"));
            }
        }
        if batch.is_empty() {
            return;
        }
        self.counters.admit(cost);
        let mut ready: Vec<Option<Request>> = Vec::with_capacity(batch.len());
        for mut r in batch {
            if self.is_dynamic(&r) {
                if let Buffer::Plain(v) = std::mem::replace(&mut r.buf, Buffer::Plain(Vec::new())) {
                    match self.pd.register_vec(v, Access::LOCAL_WRITE) {
                        Ok(mr) => {
                            Counters::add(&self.counters.dynmr_registrations, 1);
                            r.buf = Buffer::Registered(Arc::new(mr));
                        }
                        Err(e) => {
                            self.counters.retire(charge(r.len));
                            self.fail(r, IoError::Registration(e.to_string()));
                            continue;
                        }
                    }
                }
            }
            ready.push(Some(r));
        }
        let descs: Vec<Desc> = ready
            .iter()
            .map(|r| {
                let r = r.as_ref().expect("all present before planning");
                Desc {
                    rkey: r.remote.rkey,
                    addr: r.remote.addr,
                    len: r.len,
                    dynamic: matches!(r.buf, Buffer::Registered(_)),
                }
            })
            .collect();
        let chains = batching::plan(&descs, &self.plan);
        let mut stalled: Vec<usize> = Vec::new();
        for chain in chains {
            if !stalled.is_empty() {
                stalled.extend(chain.into_iter().flatten());
                continue;
            }
            if let Err(Unposted(rest)) = self.post_chain(dir, chain, &mut ready) {
                stalled = rest;
            }
        }
        if !stalled.is_empty() {
            // Back to the head of the queue in submission order, where they may still merge.
            stalled.sort_unstable();
            let back: Vec<Request> = stalled
                .into_iter()
                .map(|i| ready[i].take().expect("unposted requests are still here"))
                .collect();
            self.counters
                .retire(back.iter().map(|r| charge(r.len)).sum());
            q.requeue_front(back.into_iter());
        }
    }

    /// Stages and posts one chain on one queue pair.
    fn post_chain(
        &self,
        dir: Dir,
        chain: Chain,
        ready: &mut [Option<Request>],
    ) -> Result<(), Unposted> {
        let Some(li) = self.link_room(chain.len()) else {
            return Err(Unposted(chain.concat()));
        };
        let link = &self.links[li];
        let chained = chain.len() > 1;
        let mut wrs: Vec<InflightWr> = Vec::with_capacity(chain.len());
        let mut groups = chain.into_iter();
        let mut unposted = Vec::new();
        for group in groups.by_ref() {
            let staged = group
                .iter()
                .any(|&i| matches!(ready[i].as_ref().map(|r| &r.buf), Some(Buffer::Plain(_))));
            let slot = if staged {
                match self.pool.try_get() {
                    Some(s) => Some(s),
                    None => {
                        Counters::add(&self.counters.pool_stalls, 1);
                        unposted.extend(group);
                        break;
                    }
                }
            } else {
                None
            };
            let mut members = Vec::with_capacity(group.len());
            let mut offset = 0;
            let mut bytes = 0u64;
            let mut cost = 0u64;
            for &i in &group {
                let r = ready[i].take().expect("each request is planned once");
                bytes += r.len as u64;
                cost += charge(r.len);
                let staging = match &r.buf {
                    Buffer::Registered(_) => Staging::Dynamic,
                    Buffer::Plain(data) => {
                        let slot = slot.as_ref().expect("staged groups have a slot");
                        if dir == Dir::Write {
                            slot.write_at(offset, data);
                            Counters::add(&self.counters.premr_copies, 1);
                        }
                        offset += r.len;
                        Staging::Pool(offset - r.len)
                    }
                };
                members.push((r, staging));
            }
            let c = &self.counters;
            if members.len() > 1 {
                Counters::add(&c.requests_merged, members.len() as u64);
            } else if chained {
                Counters::add(&c.requests_chained, 1);
            } else {
                Counters::add(&c.requests_single, 1);
            }
            wrs.push(InflightWr {
                dir,
                members,
                slot,
                cost,
                bytes,
                posted: Instant::now(),
            });
        }
        unposted.extend(groups.flatten());
        if wrs.is_empty() {
            return Err(Unposted(unposted));
        }
        // Scatter/gather lists, built from Arc clones so that the completion may arrive (and the
        // slab entry go) before this function returns.
        let keep: Vec<Vec<SgeSource>> = wrs.iter().map(sge_sources).collect();
        let remotes: Vec<RemoteAddr> = wrs.iter().map(|w| w.members[0].0.remote).collect();
        let keys: Vec<usize> = {
            let mut slab = link.inflight.lock().unwrap();
            wrs.into_iter().map(|w| slab.insert(w)).collect()
        };
        let sges: Vec<Vec<Sge<'_>>> = keep
            .iter()
            .map(|srcs| srcs.iter().map(|s| s.sge(&self.pool)).collect())
            .collect();
        let send: Vec<SendWr<'_>> = keys
            .iter()
            .zip(&sges)
            .zip(&remotes)
            .map(|((&k, sg), &remote)| {
                let op = match dir {
                    Dir::Read => SendOp::Read(remote),
                    Dir::Write => SendOp::Write(remote),
                };
                SendWr::new(k as u64, op, sg)
            })
            .collect();
        let result = link.qp.post_send(&send);
        drop(send);
        drop(sges);
        drop(keep);
        let posted = match &result {
            Ok(()) => keys.len(),
            Err(e) => e.posted(),
        };
        Counters::add(&self.counters.work_requests, posted as u64);
        if posted > 0 {
            Counters::add(&self.counters.doorbells, 1);
        }
        if let Err(e) = result {
            let mut slab = link.inflight.lock().unwrap();
            let back: Vec<InflightWr> = keys[posted..].iter().map(|&k| slab.remove(k)).collect();
            drop(slab);
            for w in back {
                self.counters.retire(w.cost);
                match e {
                    PostError::QueueFull { .. } => {
                        // Cannot happen while we keep within max_send_wr; requeue if it does.
                        self.queues[dir as usize]
                            .requeue_front(w.members.into_iter().map(|(r, _)| r));
                    }
                    _ => {
                        log::error!("post failed: {e}");
                        for (r, _) in w.members {
                            self.fail(r, IoError::Transport(WcStatus::LocalQpOperationError));
                        }
                    }
                }
            }
        }
        if unposted.is_empty() {
            Ok(())
        } else {
            Err(Unposted(unposted))
        }
    }

    fn poll_loop(&self, li: usize) {
        let link = &self.links[li];
        let mode = self.cfg.polling;
        let mut state = PollState::new(mode);
        let mut wc = vec![Completion::EMPTY; mode.batch()];
        let mut stop_deadline: Option<Instant> = None;
        loop {
            if self.stopping.load(Ordering::Acquire) {
                let deadline =
                    *stop_deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(5));
                if link.inflight.lock().unwrap().is_empty() || Instant::now() > deadline {
                    return;
                }
            }
            let n = self.poll_once(link, &mut wc);
            match state.after_poll(n) {
                Next::Poll => {
                    if n == 0 {
                        // Busy polling on a shared core: give way if someone else can run.
                        std::thread::yield_now();
                    }
                }
                Next::ArmAndSleep => {
                    if let Err(e) = link.cq.arm() {
                        log::error!("arming CQ failed: {e}");
                    }
                    if self.poll_once(link, &mut wc) > 0 {
                        continue;
                    }
                    // A bounded sleep, so that shutdown is noticed.
                    match link.cq.wait_event(Some(Duration::from_millis(100))) {
                        Ok(true) => Counters::add(&self.counters.event_wakeups, 1),
                        Ok(false) => {}
                        Err(e) => log::error!("waiting for a CQ event failed: {e}"),
                    }
                }
            }
        }
    }

    fn poll_once(&self, link: &Link, wc: &mut [Completion]) -> usize {
        let n = match link.cq.poll(wc) {
            Ok(n) => n,
            Err(e) => {
                log::error!("polling CQ failed: {e}");
                0
            }
        };
        if n == 0 {
            Counters::add(&self.counters.polls_empty, 1);
            return 0;
        }
        Counters::add(&self.counters.polls_nonempty, 1);
        for c in &wc[..n] {
            let w = link.inflight.lock().unwrap().try_remove(c.wr_id as usize);
            match w {
                Some(w) => self.finish(w, c.status),
                None => log::error!("completion for unknown work request {}", c.wr_id),
            }
        }
        self.drain(Dir::Read);
        self.drain(Dir::Write);
        n
    }

    fn finish(&self, w: InflightWr, status: WcStatus) {
        let c = &self.counters;
        c.retire(w.cost);
        Counters::add(&c.completions, 1);
        if !status.is_ok() {
            if !self.closed.swap(true, Ordering::AcqRel) {
                log::warn!("session broken by a transport error: {status:?}");
            }
            for (r, _) in w.members {
                self.fail(r, IoError::Transport(status));
            }
            return;
        }
        self.policy.on_completion(w.bytes, w.posted.elapsed());
        match w.dir {
            Dir::Read => Counters::add(&c.bytes_read, w.bytes),
            Dir::Write => Counters::add(&c.bytes_written, w.bytes),
        }
        for (r, staging) in w.members {
            let data = match (r.buf, staging) {
                (Buffer::Plain(mut v), Staging::Pool(off)) => {
                    if w.dir == Dir::Read {
                        w.slot
                            .as_ref()
                            .expect("staged members have a slot")
                            .read_at(off, &mut v);
                    }
                    v
                }
                (Buffer::Registered(mr), _) => match Arc::try_unwrap(mr) {
                    Ok(mr) => mr.into_vec().unwrap_or_else(|mr| mr.to_vec()),
                    // The poster still holds its clone for an instant: copy rather than wait.
                    Err(mr) => mr.to_vec(),
                },
                (Buffer::Plain(v), Staging::Dynamic) => v,
            };
            (r.done)(Ok(data));
        }
    }
}

/// Where one SGE of a work request points.
enum SgeSource {
    Pool { slot_offset: usize, len: usize },
    Own(Arc<MemoryRegion>),
}

impl SgeSource {
    fn sge<'a>(&'a self, pool: &'a MrPool) -> Sge<'a> {
        match self {
            SgeSource::Pool { slot_offset, len } => pool.sge_at(*slot_offset, *len),
            SgeSource::Own(mr) => mr.sge(),
        }
    }
}

/// One SGE per dynamic member, one per run of members staged next to each other.
fn sge_sources(w: &InflightWr) -> Vec<SgeSource> {
    let mut out: Vec<SgeSource> = Vec::new();
    let base = w.slot.as_ref().map_or(0, |s| s.offset());
    for (r, staging) in &w.members {
        match (staging, &r.buf) {
            (Staging::Pool(off), _) => {
                if let Some(SgeSource::Pool { slot_offset, len }) = out.last_mut() {
                    if *slot_offset + *len == base + off {
                        *len += r.len;
                        continue;
                    }
                }
                out.push(SgeSource::Pool {
                    slot_offset: base + off,
                    len: r.len,
                });
            }
            (Staging::Dynamic, Buffer::Registered(mr)) => out.push(SgeSource::Own(mr.clone())),
            (Staging::Dynamic, Buffer::Plain(_)) => unreachable!("dynamic members are registered"),
        }
    }
    out
}
