//! The rfs client runtime: an authenticated metadata channel with typed calls (reconnecting
//! under the same client id, over [`channel`]), and data sessions to every data node, connected
//! on first use. fs-client and the tests build on it; the protocol it speaks is `rfs-proto`.

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdmabox::rpc::RpcConfig;
use rdmabox::transport::{Context, ProtectionDomain, TransportConfig};
use rdmabox::{SessionConfig, Snapshot};

use rfs_daemon::backoff::Backoff;
use rfs_proto::callback::Callback;
use rfs_proto::clock;
use rfs_proto::data::DataSession;
use rfs_proto::integrity;
use rfs_proto::locks::FileLock;
use rfs_proto::message::{
    decode_reply, encode_call, seal, AttachData, Envelope, ListNodes, Reclaim, RequestOp, SetLock,
};
use rfs_proto::types::{FileAccess, Ino};
use rfs_proto::wire::MAX_LIST;
pub use rfs_proto::{CallError, MetadataChannel};

use crate::channel::Channel;

mod channel;
mod config;
mod data;
mod metadata;

pub use config::{ClientConfig, Held, HeldLock, ListHeld, Notice, NoticeHandler};

fn resolve(addr: &str) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("cannot resolve {addr}")))
}

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
        let seq = self.begin_call();
        let session = self.sessions_lost.load(Ordering::Acquire);
        let mut waited = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut told = false;
        let mut used = None;
        let result = loop {
            let deadline = Instant::now() + timeout;
            match self.exchange_until(seq, request, deadline, session, &mut used) {
                // Hard: the same call again (the node never applies one twice), over a new
                // connection, until a node answers.
                Err(e)
                    if self.cfg.hard
                        && is_outage(&e)
                        && !self.lost_session_of(request, session) =>
                {
                    if !std::mem::replace(&mut told, true) {
                        log::warn!(
                            "metadata node {}: {e}; waiting for it (hard mount)",
                            self.meta_addr
                        );
                    }
                    if let Some(c) = &used {
                        self.abandon_channel(c);
                    }
                    std::thread::sleep(waited.next_pause());
                }
                r => break r,
            }
        };
        self.end_call(seq);
        result
    }
}

/// Whether a call failed for want of a node (it went silent, refused or dropped the
/// connection), not for what it asked.
pub(crate) fn is_outage(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        TimedOut
            | WouldBlock
            | ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | NotConnected
            | BrokenPipe
            | UnexpectedEof
            | HostUnreachable
            | NetworkUnreachable
    )
}

impl Client {
    /// Connects to the metadata service at `addr` (HOST:PORT).
    pub fn connect(addr: &str, cfg: ClientConfig) -> io::Result<Client> {
        let meta_addr = resolve(addr)?;
        let ctx = Context::open(&cfg.transport)?;
        let pd = Arc::new(ctx.alloc_pd()?);
        let client_id = rdmabox::random::u64();
        let on_notice = Arc::<OnceLock<NoticeHandler>>::default();
        let start = Instant::now();
        let channel = Channel::open(&ctx, &pd, meta_addr, &cfg, client_id, &on_notice)?;
        log::info!(
            "connected to the metadata node {meta_addr} as client {client_id:016x} in {:.0?}",
            start.elapsed()
        );
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

    /// The transport in use, in words.
    pub fn transport(&self) -> String {
        self.ctx.describe()
    }
}
