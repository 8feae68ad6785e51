//! The client side of the protocol: an authenticated metadata channel with typed calls, and
//! data sessions to every data node, connected on first use. fs-client and the tests build on it.

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdmabox::rpc::RpcConfig;
use rdmabox::transport::{Context, ProtectionDomain, TransportConfig};
use rdmabox::{SessionConfig, Snapshot};

use crate::callback::Callback;
use crate::channel::{backoff, Channel};
use crate::clock;
use crate::data::DataSession;
use crate::errno::Errno;
use crate::integrity;
use crate::locks::FileLock;
use crate::message::{
    decode_reply, encode_call, seal, AttachData, Call, Envelope, ListNodes, Reclaim, RequestOp,
    SetLock,
};
use crate::types::Ino;
use crate::wire::DecodeError;
use crate::wire::MAX_LIST;

/// How a client reaches the nodes.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Which provider, and its settings.
    pub transport: TransportConfig,
    /// The shared secret, if the nodes require one.
    pub secret: Option<Vec<u8>>,
    /// The tunables of every data session.
    pub session: SessionConfig,
    /// The metadata channel's buffers and deadline.
    pub rpc: RpcConfig,
    /// How long a node may take to accept a connection.
    pub connect_timeout: Duration,
    /// Encrypt every queue pair's connection (tcp; needs the secret).
    pub encrypt: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            transport: TransportConfig::default(),
            secret: None,
            session: SessionConfig::default(),
            rpc: RpcConfig::default(),
            connect_timeout: Duration::from_secs(5),
            encrypt: false,
        }
    }
}

/// Why a call gave no answer.
#[derive(Debug)]
pub enum CallError {
    /// The service answered with an error number.
    Remote(Errno),
    /// The channel failed: connection lost, no reply in time.
    Transport(io::Error),
    /// The reply was not a valid answer to the call.
    Malformed(DecodeError),
    /// A data node is unknown, gone, or could not be reached.
    NoDataNode {
        /// The node's id.
        node: u32,
        /// Why.
        why: String,
    },
}

impl CallError {
    /// What the file system tells the application: the service's answer, or EIO.
    pub fn errno(&self) -> Errno {
        match self {
            CallError::Remote(e) => *e,
            _ => Errno::EIO,
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Remote(e) => write!(f, "{e}"),
            CallError::Transport(e) => write!(f, "metadata channel: {e}"),
            CallError::Malformed(e) => write!(f, "metadata reply: {e}"),
            CallError::NoDataNode { node, why } => write!(f, "data node {node}: {why}"),
        }
    }
}

impl std::error::Error for CallError {}

fn resolve(addr: &str) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("cannot resolve {addr}")))
}

/// What carries metadata calls: the RPC channel of a [`Client`], or a test's stand-in.
pub trait MetadataChannel {
    /// Sends one encoded request and returns the encoded reply.
    fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>>;

    /// One metadata call and its typed answer. Failures are the caller's to log, once.
    fn call<C: Call + fmt::Debug>(&self, req: C) -> Result<C::Reply, CallError>
    where
        Self: Sized,
    {
        let raw = self
            .exchange(&encode_call(&req))
            .map_err(|e| CallError::Transport(io::Error::new(e.kind(), format!("{req:?}: {e}"))))?;
        match decode_reply::<C>(&raw) {
            Ok(r) => r.map_err(CallError::Remote),
            Err(e) => Err(CallError::Malformed(DecodeError(format!(
                "reply to {req:?}: {}",
                e.0
            )))),
        }
    }
}

/// What the service's side of a session tells a client.
pub enum Notice {
    /// Something the client caches changed; answered when the handler returns.
    Callback(Callback),
    /// The metadata connection was lost and is back: callbacks sent meanwhile are lost, so
    /// whatever the client caches from the service is to be fetched again.
    Reconnected,
    /// A service that lost our session did not take these locks again (it did not restart,
    /// but ended the session, or its grace period was over): they are held no more.
    LocksLost(Vec<HeldLock>),
}

/// What a client does with the service's notices.
pub type NoticeHandler = Box<dyn Fn(Notice) + Send + Sync>;

/// A file lock a client holds: the file, the owner, the lock.
pub type HeldLock = (Ino, u64, FileLock);

/// What a client holds at the service, taken again from one that restarted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Held {
    /// Open handles, as (inode, access).
    pub handles: Vec<(Ino, u8)>,
    pub locks: Vec<HeldLock>,
}

/// Lists what the client holds at the service.
pub type ListHeld = Box<dyn Fn() -> Held + Send + Sync>;

/// Calls under way, by sequence number: the service keeps the replies of those at or above
/// the lowest, in case they are resent.
#[derive(Default)]
struct Calls {
    next: u64,
    outstanding: BTreeSet<u64>,
}

/// A connection to the metadata service and the data sessions opened through it. A lost
/// metadata connection is dialled again (with backoff, within a call's deadline) under the
/// same client id, and calls that were under way are resent with their sequence numbers:
/// the service applies each once.
pub struct Client {
    cfg: ClientConfig,
    meta_addr: SocketAddr,
    ctx: Context,
    pd: Arc<ProtectionDomain>,
    client_id: u64,
    channel: Mutex<Option<Arc<Channel>>>,
    /// Held by the one thread that reconnects; the others wait for it.
    reconnecting: Mutex<()>,
    /// Set by `sever` until a call dials again: the idle redial leaves a connection severed
    /// on request down, as a partition that lasts until traffic would.
    severed_on_request: AtomicBool,
    /// Sessions the service lost (expired, or the service restarted): a call under way when
    /// that happens cannot be resent, since its reply is gone with the session.
    sessions_lost: AtomicU64,
    calls: Mutex<Calls>,
    /// How long a call may take, reconnections and resends included.
    call_timeout_ms: AtomicU64,
    data: Mutex<HashMap<u32, Arc<DataSession>>>,
    /// The counters of data sessions gone (broken, replaced), so that totals never go back.
    retired: Mutex<Snapshot>,
    /// Data nodes that just failed us (no answer in time, gone, unreachable), with when they
    /// may be tried again: until then a transfer to one fails at once instead of spending a
    /// whole `connect_timeout` each.
    down: Mutex<HashMap<u32, Instant>>,
    on_notice: Arc<OnceLock<NoticeHandler>>,
    held: OnceLock<ListHeld>,
    /// The thread telling the notice handler of a reconnection (set before the new connection
    /// is used): see [`Client::reconnection_settled`].
    revalidating: Mutex<Option<std::thread::ThreadId>>,
    revalidated: Condvar,
}

/// Puts the gate of [`Client::revalidating`] back as it was when dropped (the handler may
/// panic; a reconnection inside the handler's own calls leaves it closed for the handler).
struct Revalidated<'a> {
    client: &'a Client,
    before: Option<std::thread::ThreadId>,
}

impl Drop for Revalidated<'_> {
    fn drop(&mut self) {
        *self.client.revalidating.lock().unwrap() = self.before;
        self.client.revalidated.notify_all();
    }
}

impl MetadataChannel for Client {
    fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>> {
        let timeout = Duration::from_millis(self.call_timeout_ms.load(Ordering::Relaxed));
        let deadline = Instant::now() + timeout;
        let seq = self.begin_call();
        let result = self.exchange_until(seq, request, deadline);
        self.end_call(seq);
        result
    }
}

impl Client {
    /// Connects to the metadata service at `addr` (HOST:PORT).
    pub fn connect(addr: &str, cfg: ClientConfig) -> io::Result<Client> {
        let meta_addr = resolve(addr)?;
        let ctx = Context::open(&cfg.transport)?;
        let pd = Arc::new(ctx.alloc_pd()?);
        let client_id = rdmabox::random::u64();
        let on_notice = Arc::<OnceLock<NoticeHandler>>::default();
        let channel = Channel::open(&ctx, &pd, meta_addr, &cfg, client_id, &on_notice)?;
        let call_timeout_ms = cfg.rpc.timeout.as_millis() as u64;
        Ok(Client {
            cfg,
            meta_addr,
            ctx,
            pd,
            client_id,
            channel: Mutex::new(Some(Arc::new(channel))),
            reconnecting: Mutex::new(()),
            severed_on_request: AtomicBool::new(false),
            sessions_lost: AtomicU64::new(0),
            calls: Mutex::default(),
            call_timeout_ms: AtomicU64::new(call_timeout_ms),
            data: Mutex::new(HashMap::new()),
            retired: Mutex::default(),
            down: Mutex::new(HashMap::new()),
            on_notice,
            held: OnceLock::new(),
            revalidating: Mutex::new(None),
            revalidated: Condvar::new(),
        })
    }

    /// Says how to list the handles and locks this client holds (once): a service that
    /// restarted (or lost the session) is asked for them again before any other call, so that
    /// open files stay usable and locks stay held.
    pub fn on_reclaim(&self, held: ListHeld) {
        if self.held.set(held).is_err() {
            log::warn!("a list of what is held was already set");
        }
    }

    /// Says what to do with the service's notices (once; until then callbacks are answered at
    /// once, since nothing is cached before the file system exists).
    pub fn on_notice(&self, handler: NoticeHandler) {
        if self.on_notice.set(handler).is_err() {
            log::warn!("a notice handler was already set");
        }
    }

    /// Lets calls take up to `timeout`: a call that the service makes wait for other clients
    /// (up to its lease) must not be given up on while the service still applies it.
    pub fn set_call_timeout(&self, timeout: Duration) {
        self.call_timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    /// Breaks the metadata connection as a network partition would, until the next call
    /// dials again (`redial` leaves it down): a fault to test recovery with, deterministic
    /// because nothing reconnects behind the test's back.
    pub fn sever(&self) {
        if let Some(c) = self.channel.lock().unwrap().as_ref() {
            log::warn!("severing the metadata connection on request");
            self.severed_on_request.store(true, Ordering::Release);
            c.sever();
        }
    }

    /// Sends call `seq` until it is answered, resending it over new connections if the
    /// connection breaks, until `deadline`.
    fn exchange_until(&self, seq: u64, request: &[u8], deadline: Instant) -> io::Result<Vec<u8>> {
        let session = self.sessions_lost.load(Ordering::Acquire);
        let repeatable = request
            .get(1)
            .and_then(|&op| RequestOp::from_code(op))
            .is_some_and(RequestOp::repeatable);
        loop {
            let channel = self.channel(deadline)?;
            if self.sessions_lost.load(Ordering::Acquire) != session && !repeatable {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the metadata node lost this client's session while the call was under way \
                     (it may or may not have been applied)",
                ));
            }
            match self.send_on(&channel, seq, request, deadline) {
                Err(e) if channel.is_broken() && Instant::now() < deadline => {
                    log::debug!("call {seq}: {e}; resending over a new connection");
                }
                r => return r,
            }
        }
    }

    /// Sends call `seq` over `channel` once, and waits for its answer until `deadline`.
    fn send_on(
        &self,
        channel: &Channel,
        seq: u64,
        request: &[u8],
        deadline: Instant,
    ) -> io::Result<Vec<u8>> {
        let oldest = self.calls.lock().unwrap().outstanding.first().copied();
        let left = deadline.saturating_duration_since(Instant::now());
        let envelope = Envelope {
            seq,
            oldest: oldest.unwrap_or(seq),
            sent_ms: clock::now_ms(),
            budget_ms: left.as_millis().min(u32::MAX as u128) as u32,
        };
        let key = channel.key.as_ref();
        let sealed = integrity::seal(key, integrity::CALL, seq, seal(&envelope, request));
        let reply = channel.rpc.call_within(&sealed, left)?;
        integrity::open(key, integrity::REPLY, seq, &reply)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| {
                // Not the node's: the connection is no one's to trust any more.
                channel.sever();
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a reply without the session's MAC: altered on the path",
                )
            })
    }

    /// A sequence number for a new call, counted as under way until [`Client::end_call`].
    fn begin_call(&self) -> u64 {
        let mut c = self.calls.lock().unwrap();
        c.next += 1;
        let seq = c.next;
        c.outstanding.insert(seq);
        seq
    }

    fn end_call(&self, seq: u64) {
        self.calls.lock().unwrap().outstanding.remove(&seq);
    }

    /// Takes this client's open handles and locks again on `channel`, a new session, before
    /// anything else is sent on it; what cannot be taken is logged (those files fail with
    /// EBADF). Answers the locks not taken again.
    fn reclaim(&self, channel: &Channel, deadline: Instant) -> Vec<HeldLock> {
        let Some(Held { handles, locks }) = self.held.get().map(|list| list()) else {
            return Vec::new();
        };
        if !handles.is_empty() {
            self.reclaim_handles(channel, &handles, deadline);
        }
        let lost: Vec<HeldLock> = locks
            .into_iter()
            .filter(|&(ino, owner, lock)| {
                let req = SetLock {
                    ino,
                    owner,
                    lock,
                    wait: false,
                    reclaim: true,
                };
                let seq = self.begin_call();
                let answer = self.send_on(channel, seq, &encode_call(&req), deadline);
                self.end_call(seq);
                // Lost only when the node says so (it refused, or someone holds it now): on
                // a channel that broke meanwhile, the locks are asked again at the next dial.
                answer
                    .ok()
                    .and_then(|raw| decode_reply::<SetLock>(&raw).ok())
                    .is_some_and(|r| r != Ok(None))
            })
            .collect();
        if !lost.is_empty() {
            log::error!(
                "{} file locks not taken again: the metadata node ended this client's session \
                 (or was past its grace period), and others may have taken them since",
                lost.len()
            );
        }
        lost
    }

    fn reclaim_handles(&self, channel: &Channel, handles: &[(Ino, u8)], deadline: Instant) {
        let mut taken = 0;
        for part in handles.chunks(MAX_LIST as usize) {
            let seq = self.begin_call();
            let req = Reclaim {
                handles: part.to_vec(),
            };
            let answer = self.send_on(channel, seq, &encode_call(&req), deadline);
            self.end_call(seq);
            let taken_now =
                answer.map_err(|e| e.to_string()).and_then(|raw| {
                    match decode_reply::<Reclaim>(&raw).map_err(|e| e.to_string())? {
                        Ok(n) => Ok(n),
                        Err(e) => Err(e.to_string()),
                    }
                });
            match taken_now {
                Ok(n) => taken += n as usize,
                Err(e) => log::warn!("reclaiming open files: {e}"),
            }
        }
        if taken == handles.len() {
            log::warn!("{taken} open handles taken again");
        } else {
            log::warn!(
                "{taken} of {} open handles taken again: the others' files are gone, or the \
                 metadata node forgot them (no state directory, or past its grace period)",
                handles.len()
            );
        }
    }

    /// The live channel, reconnecting if it broke (until `deadline`).
    /// Whether the metadata connection is up: not lost, or lost and already replaced (a
    /// lost one is noticed at once, replaced at the next call).
    pub fn metadata_connected(&self) -> bool {
        self.channel
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|c| !c.is_broken())
    }

    /// Dials the metadata service now if the connection is lost (within a call's deadline),
    /// taking our handles back and telling the notice handler, as the next call would: an
    /// idle client must not wait for a call to find a restarted node, whose grace period for
    /// our handles may be over by then. A connection severed on request stays down.
    pub fn redial(&self) -> io::Result<()> {
        if self.metadata_connected() || self.severed_on_request.load(Ordering::Acquire) {
            return Ok(());
        }
        let timeout = Duration::from_millis(self.call_timeout_ms.load(Ordering::Relaxed));
        self.channel(Instant::now() + timeout).map(drop)
    }

    /// Waits (up to `limit`) while another thread tells the notice handler of a
    /// reconnection: an answer on the new connection (a lock granted, a file opened) must not
    /// reach the application before what was cached under the old one is dropped. Called with
    /// nothing held that the handler may need: calls themselves never wait for it.
    pub fn reconnection_settled(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let me = std::thread::current().id();
        let mut r = self.revalidating.lock().unwrap();
        while r.is_some_and(|t| t != me) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            r = self.revalidated.wait_timeout(r, left).unwrap().0;
        }
    }

    fn channel(&self, deadline: Instant) -> io::Result<Arc<Channel>> {
        let live = |c: &Option<Arc<Channel>>| c.as_ref().filter(|c| !c.is_broken()).cloned();
        if let Some(c) = live(&self.channel.lock().unwrap()) {
            return Ok(c);
        }
        let mut locks_lost = Vec::new();
        let (c, broken, _gate) = {
            let _one = self.reconnecting.lock().unwrap();
            if let Some(c) = live(&self.channel.lock().unwrap()) {
                return Ok(c); // another thread reconnected meanwhile
            }
            let broken = self.channel.lock().unwrap().take();
            if let Some(b) = &broken {
                // Closed at once: a restarted service cannot listen on its port again while
                // its side of our old connection waits for us to close ours.
                b.sever();
                log::warn!(
                    "metadata connection to {} lost; reconnecting",
                    self.meta_addr
                );
            }
            let c = Arc::new(self.reconnect(deadline)?);
            self.severed_on_request.store(false, Ordering::Release);
            if !c.resumed {
                // Before any call can use the new channel.
                self.sessions_lost.fetch_add(1, Ordering::AcqRel);
                locks_lost = self.reclaim(&c, deadline);
            }
            let gate = Revalidated {
                client: self,
                before: *self.revalidating.lock().unwrap(),
            };
            if self.on_notice.get().is_some() {
                *self.revalidating.lock().unwrap() = Some(std::thread::current().id());
            }
            *self.channel.lock().unwrap() = Some(c.clone());
            (c, broken, gate)
        };
        // Outside the lock: the old channel's callback thread may still be busy, and the
        // handler may take a while; neither should hold up calls on the new channel.
        drop(broken);
        if c.resumed {
            log::warn!("metadata connection to {} re-established", self.meta_addr);
        } else {
            log::warn!(
                "metadata connection to {} re-established in a new session (the node \
                 restarted, or had ended this client's session)",
                self.meta_addr
            );
        }
        if let Some(handle) = self.on_notice.get() {
            handle(Notice::Reconnected);
            if !locks_lost.is_empty() {
                handle(Notice::LocksLost(locks_lost));
            }
        }
        Ok(c)
    }

    /// Dials the service again, with backoff, until `deadline`.
    fn reconnect(&self, deadline: Instant) -> io::Result<Channel> {
        let mut wait = Duration::ZERO;
        loop {
            let opened = Channel::open(
                &self.ctx,
                &self.pd,
                self.meta_addr,
                &self.cfg,
                self.client_id,
                &self.on_notice,
            );
            match opened {
                Ok(c) => return Ok(c),
                Err(e) => {
                    wait = backoff(wait);
                    if Instant::now() + wait >= deadline {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("metadata node {} unreachable: {e}", self.meta_addr),
                        ));
                    }
                    log::debug!("reconnecting to {}: {e}", self.meta_addr);
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// The transport in use, in words.
    pub fn transport(&self) -> String {
        self.ctx.describe()
    }

    /// The data session to `node` if it is connected: never a metadata call.
    pub fn connected(&self, node: u32) -> Option<Arc<DataSession>> {
        let data = self.data.lock().unwrap();
        data.get(&node).filter(|d| serves_well(d)).cloned()
    }

    /// The data session to `node`, connected on first use, and attached to this client's
    /// metadata session (again: the metadata node may have lost the attachment with the
    /// session), so that chunk maps of the node come granted to it.
    pub fn data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        let d = self.connect_data(node)?;
        self.call(AttachData {
            node,
            session: d.name,
        })?;
        Ok(d)
    }

    fn connect_data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        if let Some(d) = self.connected(node) {
            return Ok(d);
        }
        let gone = |why: String| CallError::NoDataNode { node, why };
        self.note_broken(node);
        if let Some(left) = self.down_for(node) {
            return Err(gone(format!(
                "failed moments ago; tried again in {} ms",
                left.as_millis()
            )));
        }
        self.dial_data(node)
    }

    /// Whether `node` failed moments ago (see [`Client::data`]): connecting to it would fail
    /// at once.
    pub fn is_down(&self, node: u32) -> bool {
        self.note_broken(node);
        self.down_for(node).is_some()
    }

    /// A session to `node` that broke because the node stopped answering or went away marks
    /// the node down; it is forgotten either way.
    fn note_broken(&self, node: u32) {
        let broken = {
            let mut data = self.data.lock().unwrap();
            let broken = match data.get(&node) {
                Some(d) if !d.session.is_open() => data.remove(&node),
                _ => None,
            };
            // Under the table's lock: a total read meanwhile sees the session in one place.
            if let Some(d) = &broken {
                self.retire(d);
            }
            broken
        };
        let dead = broken.and_then(|d| d.session.broken_by()).is_some_and(|e| {
            matches!(
                e,
                rdmabox::IoError::TimedOut(_) | rdmabox::IoError::Aborted(_)
            )
        });
        if dead {
            self.mark_down(node);
        }
    }

    fn mark_down(&self, node: u32) {
        let until = Instant::now() + self.cfg.connect_timeout;
        self.down.lock().unwrap().insert(node, until);
    }

    /// How long `node` stays down, if it is.
    fn down_for(&self, node: u32) -> Option<Duration> {
        let mut down = self.down.lock().unwrap();
        let left = down
            .get(&node)
            .and_then(|until| until.checked_duration_since(Instant::now()));
        if left.is_none() {
            down.remove(&node);
        }
        left
    }

    fn dial_data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        let gone = |why: String| CallError::NoDataNode { node, why };
        // A node the metadata node counts out is down for us too: transfers there fail at
        // once (a read goes to another replica) instead of dialling it again each time.
        let info = self
            .call(ListNodes {})?
            .into_iter()
            .find(|n| n.id == node)
            .filter(|n| n.alive)
            .ok_or_else(|| {
                self.mark_down(node);
                gone("the node left".into())
            })?;
        // The metadata node is reached the way we reached it; others as they advertise.
        let addr = if info.meta {
            self.meta_addr
        } else {
            resolve(&info.addr).map_err(|e| gone(format!("{}: {e}", info.addr)))?
        };
        let d = DataSession::connect(
            &self.ctx,
            &self.pd,
            addr,
            self.cfg.secret.as_deref(),
            self.cfg.encrypt,
            &self.cfg.session,
            self.cfg.connect_timeout,
        )
        .map_err(|e| {
            self.mark_down(node);
            gone(format!("{addr}: {e}"))
        })?;
        // Another thread may have connected meanwhile: keep the first live session, since
        // dropping a session fails the requests in flight on it.
        let mut data = self.data.lock().unwrap();
        if let Some(existing) = data.get(&node).filter(|e| serves_well(e)) {
            return Ok(existing.clone());
        }
        let d = Arc::new(d);
        if let Some(old) = data.insert(node, d.clone()) {
            self.retire(&old);
        }
        Ok(d)
    }

    /// A data session left the table: its counts go on counting in the totals.
    fn retire(&self, gone: &DataSession) {
        let mut retired = self.retired.lock().unwrap();
        *retired = retired.plus(&gone.session.counters().settled());
    }

    /// The rdmabox counters of every data session, summed, those gone included.
    pub fn counters(&self) -> Snapshot {
        let data = self.data.lock().unwrap();
        let retired = *self.retired.lock().unwrap();
        data.values()
            .fold(retired, |acc, d| acc.plus(&d.session.counters()))
    }
}

/// Whether a data session is worth using: open, and not left with fewer than half its queue
/// pairs by refused transfers (then a new one is dialled, and the old one serves what it has
/// until it goes).
fn serves_well(d: &DataSession) -> bool {
    d.session.is_open() && !d.session.is_degraded()
}
