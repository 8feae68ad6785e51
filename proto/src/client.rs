//! The client side of the protocol: an authenticated metadata channel with typed calls, and
//! data sessions to every data node, connected on first use. fs-client and the tests build on it.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rdmabox::rpc::{self, RpcClient, RpcConfig};
use rdmabox::transport::{Context, ProtectionDomain, TransportConfig};
use rdmabox::{connect_links, SessionConfig, Snapshot};

use crate::callback::{encode_ack, Callback, CALLBACK_RPC};
use crate::data::DataSession;
use crate::errno::Errno;
use crate::handshake::dial;
use crate::hello::{Hello, Metadata};
use crate::message::{decode_reply, encode_call, Call, ListNodes};
use crate::wire::DecodeError;

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
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            transport: TransportConfig::default(),
            secret: None,
            session: SessionConfig::default(),
            rpc: RpcConfig::default(),
            connect_timeout: Duration::from_secs(5),
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

/// What a client does with a callback; the callback is answered when this returns.
pub type CallbackHandler = Box<dyn Fn(Callback) + Send + Sync>;

/// A connection to the metadata service and the data sessions opened through it.
pub struct Client {
    cfg: ClientConfig,
    meta_addr: SocketAddr,
    ctx: Context,
    pd: Arc<ProtectionDomain>,
    rpc: RpcClient,
    _meta_control: std::net::TcpStream,
    data: Mutex<HashMap<u32, Arc<DataSession>>>,
    on_callback: Arc<OnceLock<CallbackHandler>>,
    callbacks_stop: Arc<AtomicBool>,
    callbacks: Option<JoinHandle<()>>,
}

impl MetadataChannel for Client {
    fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>> {
        self.rpc.call(request)
    }
}

impl Client {
    /// Connects to the metadata service at `addr` (HOST:PORT).
    pub fn connect(addr: &str, cfg: ClientConfig) -> io::Result<Client> {
        let meta_addr = resolve(addr)?;
        let ctx = Context::open(&cfg.transport)?;
        let pd = Arc::new(ctx.alloc_pd()?);
        let hello = Hello::Metadata(Metadata {});
        let mut s = dial(
            meta_addr,
            cfg.secret.as_deref(),
            &hello,
            cfg.connect_timeout,
        )?;
        // Calls on the first queue pair, the service's callbacks on the second.
        let mut links = connect_links(&ctx, &pd, &mut s, 2, cfg.session.caps)?;
        let (cb_qp, cb_cq) = links.pop().expect("two links");
        let (qp, cq) = links.pop().expect("two links");
        let rpc = RpcClient::new(&pd, qp, cq, cfg.rpc)?;
        let on_callback = Arc::<OnceLock<CallbackHandler>>::default();
        let callbacks_stop = Arc::new(AtomicBool::new(false));
        let callbacks = {
            let (pd, on, stop) = (pd.clone(), on_callback.clone(), callbacks_stop.clone());
            std::thread::Builder::new()
                .name("rfs-callbacks".into())
                .spawn(move || {
                    let served = rpc::serve(&pd, cb_qp, cb_cq, CALLBACK_RPC, &stop, |body| {
                        match Callback::decode(body) {
                            Ok(cb) => {
                                if let Some(handle) = on.get() {
                                    handle(cb);
                                }
                            }
                            Err(e) => log::warn!("callback dropped: {e}"),
                        }
                        encode_ack()
                    });
                    if let Err(e) = served {
                        log::warn!("callback channel ended: {e}");
                    }
                })?
        };
        Ok(Client {
            cfg,
            meta_addr,
            ctx,
            pd,
            rpc,
            _meta_control: s,
            data: Mutex::new(HashMap::new()),
            on_callback,
            callbacks_stop,
            callbacks: Some(callbacks),
        })
    }

    /// Says what to do with the service's callbacks (once; until then they are answered at
    /// once, since nothing is cached before the file system exists).
    pub fn on_callback(&self, handler: CallbackHandler) {
        if self.on_callback.set(handler).is_err() {
            log::warn!("a callback handler was already set");
        }
    }

    /// The transport in use, in words.
    pub fn transport(&self) -> String {
        self.ctx.describe()
    }

    /// The data session to `node`, connected on first use.
    pub fn data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        if let Some(d) = self.data.lock().unwrap().get(&node) {
            if d.session.is_open() {
                return Ok(d.clone());
            }
        }
        let gone = |why: String| CallError::NoDataNode { node, why };
        let info = self
            .call(ListNodes {})?
            .into_iter()
            .find(|n| n.id == node)
            .ok_or_else(|| gone("not in the node list".into()))?;
        if !info.alive {
            return Err(gone("the node left".into()));
        }
        // The metadata node is reached the way we reached it; others as they advertise.
        let addr = if node == 0 {
            self.meta_addr
        } else {
            resolve(&info.addr).map_err(|e| gone(format!("{}: {e}", info.addr)))?
        };
        let d = DataSession::connect(
            &self.ctx,
            &self.pd,
            addr,
            self.cfg.secret.as_deref(),
            &self.cfg.session,
            self.cfg.connect_timeout,
        )
        .map_err(|e| gone(format!("{addr}: {e}")))?;
        // Another thread may have connected meanwhile: keep the first live session, since
        // dropping a session fails the requests in flight on it.
        let mut data = self.data.lock().unwrap();
        if let Some(existing) = data.get(&node).filter(|e| e.session.is_open()) {
            return Ok(existing.clone());
        }
        let d = Arc::new(d);
        data.insert(node, d.clone());
        Ok(d)
    }

    /// The rdmabox counters of every data session, summed.
    pub fn counters(&self) -> Snapshot {
        let data = self.data.lock().unwrap();
        data.values().fold(Snapshot::default(), |acc, d| {
            acc.plus(&d.session.counters())
        })
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.callbacks_stop.store(true, Ordering::Release);
        if let Some(t) = self.callbacks.take() {
            let _ = t.join();
        }
    }
}
