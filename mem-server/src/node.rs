//! A storage node: the registered pool, the listener, and per connection one of three roles
//! (metadata channel, data session, data-node join). The first node also runs the metadata
//! service ([`crate::meta`]); nodes started with `join` lend their pool to it ([`crate::join`]).

use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmabox::connect_links;
use rdmabox::rpc::RpcConfig;
use rdmabox::transport::{
    Access, Arrivals, CompletionQueue, Context, DeadlineStream, MemoryRegion, ProtectionDomain,
    ProviderKind, QpCaps, QpRoute, QueuePair, TransportConfig,
};
use rfs_proto::frame::send_frame;
use rfs_proto::handshake::{self, SessionKey};
use rfs_proto::hello::{Data, Hello, PoolDescriptor};
use rfs_proto::integrity;
use rfs_proto::metrics::Metric;
use rfs_proto::types::MAX_REPLICAS;

use crate::access::Policy;
use crate::admission::{self, Admission, Limits, RateLimitedLog, Ticket};
use crate::grants::Grants;
use crate::hangups::Hangups;
use crate::meta::MetaService;

/// From accept to an authenticated hello, and again for the queue-pair exchange: a peer that
/// takes longer is dropped, and whatever it pinned (a thread, queue pairs waiting) is freed.
pub const SETUP_DEADLINE: Duration = Duration::from_secs(5);
/// How long the accept loop pauses when the process is out of descriptors or memory.
const EXHAUSTED_BACKOFF: Duration = Duration::from_millis(100);

/// How a node runs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Where to listen for clients and nodes.
    pub listen: SocketAddr,
    /// Bytes of pool to lend.
    pub memory: u64,
    /// The unit of allocation.
    pub chunk_size: u64,
    /// Which provider, and its settings.
    pub transport: TransportConfig,
    /// The shared secret peers must prove they know; `None` only with `insecure`.
    pub secret: Option<Vec<u8>>,
    /// Run without authentication: anyone who reaches the node has every peer's reach.
    pub insecure: bool,
    /// Take only encrypted queue pairs, and encrypt this node's own (tcp).
    pub encrypt: bool,
    /// Join this metadata node as a data node instead of running the metadata service.
    pub join: Option<SocketAddr>,
    /// How long a joining node keeps trying to reach a metadata node that is not up yet.
    pub join_timeout: Duration,
    /// host:port clients use to reach this node (default: derived from the listen address).
    pub advertise: Option<String>,
    /// The metadata channels' buffers and deadline.
    pub rpc: RpcConfig,
    /// How long a client may take to answer a callback before its chunk references are taken
    /// as dropped (clients refetch maps older than this, less their I/O deadline).
    pub lease: Duration,
    /// How many connections the node takes, in total and per peer address.
    pub limits: Limits,
    /// How the metadata service treats callers (root squash).
    pub policy: Policy,
    /// Copies of each chunk, on distinct data nodes (the metadata node's choice).
    pub replicas: u32,
    /// Bytes per second that re-replication may copy.
    pub repair_rate: u64,
    /// Where the metadata node journals its state, to come back with it after a restart
    /// (none: the namespace lives in memory only).
    pub state_dir: Option<std::path::PathBuf>,
    /// Mode and owner given to the root directory at start (`--root-mode`, `--root-owner`):
    /// under root squash nobody else could make it writable.
    pub root_dir: rfs_proto::types::AttrChanges,
}

impl NodeConfig {
    /// A metadata node on `listen` lending `memory` bytes, with the defaults.
    pub fn new(listen: SocketAddr, memory: u64) -> NodeConfig {
        NodeConfig {
            listen,
            memory,
            chunk_size: 1 << 20,
            transport: TransportConfig::default(),
            secret: None,
            insecure: false,
            encrypt: false,
            join: None,
            join_timeout: Duration::from_secs(60),
            advertise: None,
            rpc: RpcConfig::default(),
            lease: Duration::from_secs(10),
            limits: Limits::default(),
            policy: Policy::default(),
            replicas: 1,
            repair_rate: 256 << 20,
            state_dir: None,
            root_dir: rfs_proto::types::AttrChanges::default(),
        }
    }

    fn validate(&self) -> io::Result<()> {
        if self.chunk_size < 4096 || !self.chunk_size.is_power_of_two() {
            return Err(invalid(format!(
                "chunk size {} must be a power of two of at least 4 KiB",
                self.chunk_size
            )));
        }
        if self.lease < Duration::from_millis(100) {
            return Err(invalid(format!(
                "lease {:?} is too short (at least 100 ms)",
                self.lease
            )));
        }
        if self.secret.is_none() && !self.insecure {
            return Err(invalid(
                "no shared secret: give one, or run insecure on purpose".into(),
            ));
        }
        if self.encrypt && self.secret.is_none() {
            return Err(invalid(
                "encryption needs the shared secret: its keys come from it".into(),
            ));
        }
        if self.limits.total == 0 || self.limits.per_peer == 0 {
            return Err(invalid("connection limits must be at least 1".into()));
        }
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(invalid(format!(
                "{} replicas: between 1 and {MAX_REPLICAS}",
                self.replicas
            )));
        }
        if self.repair_rate < self.chunk_size {
            return Err(invalid(format!(
                "repair rate {} B/s is below one chunk a second",
                self.repair_rate
            )));
        }
        if self.memory == 0 && self.join.is_some() {
            return Err(invalid("a data node must lend some memory".into()));
        }
        if self.memory != 0 && self.memory < self.chunk_size {
            return Err(invalid(format!(
                "memory {} is smaller than one chunk ({})",
                self.memory, self.chunk_size
            )));
        }
        Ok(())
    }
}

/// What every connection of a node shares.
pub(crate) struct Shared {
    pub(crate) cfg: NodeConfig,
    pub(crate) ctx: Context,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) pool: Arc<MemoryRegion>,
    /// What each data session may reach of the pool.
    pub(crate) grants: Arc<Grants>,
    /// Present on the metadata node only.
    meta: Option<Arc<MetaService>>,
    admission: Arc<Admission>,
    /// Queue pairs waiting for their peers' connections, which come to the node's one port.
    arrivals: Arc<Arrivals>,
    /// Ends data sessions whose clients go.
    hangups: Arc<Hangups>,
    pub(crate) stop: AtomicBool,
}

/// A running node.
pub struct Node {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    /// A data node's membership: the metadata node marks it dead when this closes.
    _join: Option<crate::join::Membership>,
}

pub(crate) fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl Node {
    /// Allocates and registers the pool, listens, and joins the metadata node if asked to.
    pub fn start(cfg: NodeConfig) -> io::Result<Node> {
        cfg.validate()?;
        // Listen before the pool is made: pre-faulting a large pool takes seconds, and peers
        // that connect meanwhile wait in the kernel's backlog (and retry) instead of being
        // refused.
        let listener = TcpListener::bind(cfg.listen)
            .map_err(|e| io::Error::new(e.kind(), format!("listening on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr()?;
        let chunks = cfg.memory / cfg.chunk_size;
        let ctx = Context::open(&cfg.transport)?;
        if cfg.encrypt && ctx.provider() != ProviderKind::Tcp {
            return Err(invalid(format!(
                "--encrypt is for the tcp transport, and this node uses {}: an RDMA NIC moves \
                 file data without us (use the network's own encryption, IPsec or MACsec)",
                ctx.describe()
            )));
        }
        let pd = Arc::new(ctx.alloc_pd()?);
        log::info!(
            "listening on {addr}; preparing a pool of {} MiB",
            cfg.memory >> 20
        );
        // A metadata node that lends nothing (--memory 0) still has a pool of one chunk to
        // serve sessions with; none of it is allocated.
        let pool = pd
            .alloc_region((chunks.max(1) * cfg.chunk_size) as usize, Access::ALL)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("allocating {} bytes of pool: {e}", cfg.memory),
                )
            })?;
        let pool = Arc::new(pool);
        let grants = Arc::new(Grants::new(pool.clone(), cfg.chunk_size));
        let nofile = admission::raise_fd_limit();
        let limits = cfg.limits.within_fd_limit(nofile);
        if limits != cfg.limits {
            log::info!(
                "{nofile} open files allowed: taking at most {} connections ({} per peer)",
                limits.total,
                limits.per_peer
            );
        }
        let (meta, zero_wait) = match cfg.join {
            Some(_) => (None, None),
            None => {
                let advertise = cfg.advertise.clone().unwrap_or_else(|| addr.to_string());
                let (meta, wait) = MetaService::new(&cfg, advertise, &pool, chunks, &grants)?;
                (Some(meta), Some(wait))
            }
        };
        let shared = Arc::new(Shared {
            cfg,
            ctx,
            pd,
            pool,
            grants,
            meta,
            admission: Admission::new(limits),
            arrivals: Arrivals::new(),
            hangups: Hangups::start()?,
            stop: AtomicBool::new(false),
        });
        if let (Some(meta), Some(wait)) = (&shared.meta, zero_wait) {
            meta.start_zeroer(shared.clone(), wait)?;
            meta.start_quarantine()?;
            meta.start_repair(shared.clone())?;
            meta.start_grace()?;
        }
        // Accept before joining: the metadata node connects back to us while it admits us.
        let accept = {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("accept".into())
                .spawn(move || s.accept_loop(listener))?
        };
        let mut node = Node {
            shared: shared.clone(),
            addr,
            accept: Some(accept),
            _join: None,
        };
        if let Some(meta) = shared.cfg.join {
            match crate::join::join(&shared, meta, addr) {
                Ok(m) => node._join = Some(m),
                Err(e) => {
                    node.shutdown();
                    return Err(io::Error::new(e.kind(), format!("joining {meta}: {e}")));
                }
            }
        }
        Ok(node)
    }

    /// What gives the node's figures, for its metrics endpoint.
    pub fn metrics(&self) -> impl Fn() -> Vec<Metric> + Send + 'static {
        let s = self.shared.clone();
        move || {
            let mut m = vec![
                Metric::gauge("pool_bytes", "Bytes this node lends", s.cfg.memory),
                Metric::gauge(
                    "connections",
                    "Control connections open (clients, data sessions, nodes)",
                    s.admission.in_use() as u64,
                ),
            ];
            if let Some(meta) = &s.meta {
                m.extend(meta.metrics());
            }
            m
        }
    }

    /// Where the node listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The transport in use, in words.
    pub fn transport(&self) -> String {
        self.shared.ctx.describe()
    }

    /// Bytes of pool the node lends.
    pub fn pool_bytes(&self) -> usize {
        self.shared.cfg.memory as usize
    }

    /// Stops accepting; established sessions end with the process.
    pub fn shutdown(mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Unblock accept() with a connection of our own.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
    }
}

/// How long a new connection has to answer the greeting.
const AUTH_ANSWER_WAIT: Duration = Duration::from_secs(3);

impl Shared {
    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        let mut exhausted = RateLimitedLog::new(Duration::from_secs(10));
        let mut refused = RateLimitedLog::new(Duration::from_secs(10));
        loop {
            let conn = listener.accept();
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let (s, peer) = match conn {
                Ok(c) => c,
                Err(e) if admission::is_exhaustion(&e) => {
                    exhausted.warn(format_args!("accept: {e}; pausing new connections"));
                    std::thread::sleep(EXHAUSTED_BACKOFF);
                    continue;
                }
                Err(e) => {
                    log::warn!("accept: {e}");
                    continue;
                }
            };
            let ticket = match self.admission.admit(peer.ip(), s.try_clone().ok()) {
                Ok(t) => t,
                Err(why) => {
                    refused.warn(format_args!("refused a connection from {peer}: {why}"));
                    continue;
                }
            };
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("conn".into())
                .spawn(move || match me.serve_connection(s, ticket) {
                    Ok(()) => {}
                    // Port probes and peers that hang up before saying anything.
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                        ) =>
                    {
                        log::debug!("connection from {peer} closed early")
                    }
                    Err(e) => log::info!("connection from {peer} ended: {e}"),
                });
            if let Err(e) = spawned {
                exhausted.warn(format_args!("no thread for a connection from {peer}: {e}"));
                std::thread::sleep(EXHAUSTED_BACKOFF);
            }
        }
    }

    fn serve_connection(&self, mut s: TcpStream, mut slot: Ticket) -> io::Result<()> {
        let deadline = Instant::now() + SETUP_DEADLINE;
        let peer = s.peer_addr()?;
        s.set_nodelay(true)?;
        // A peer with the secret answers the greeting at once: one that stays silent holds a
        // slot still authenticating for moments, not the whole setup deadline.
        let answer_by = deadline.min(Instant::now() + AUTH_ANSWER_WAIT);
        let key = handshake::accept(
            &mut s,
            self.cfg.secret.as_deref(),
            self.cfg.encrypt,
            answer_by,
        )?;
        // From here the connection holds a slot of its own: a peer with the secret that then
        // says nothing (or, for a queue pair, names none of ours) counts against its limits.
        let refused =
            |why: String| io::Error::new(io::ErrorKind::ResourceBusy, format!("refused: {why}"));
        slot.authenticate().map_err(refused)?;
        let hello = Hello::receive(
            &mut DeadlineStream::new(&s, deadline, "hello"),
            key.as_ref(),
        )?;
        s.set_read_timeout(None)?;
        // The connection lives as long as the session; a peer host that dies without a word
        // must not hold its slot (and queue pairs) forever.
        rdmabox::transport::tcp::configure_socket(&s, self.cfg.transport.tcp.dead_peer_timeout)?;
        log::debug!("{peer}: {hello:?}");
        let meta = || {
            self.meta
                .as_ref()
                .ok_or_else(|| invalid(format!("{:?} sent to a data node", hello.op())))
        };
        // The queue pairs a connection sets up hold a slot each as long as it lives; a queue
        // pair's own connection gives its slot back once handed over: it is counted with them.
        let queue_pairs = match &hello {
            Hello::Data(Data { qps }) => *qps as usize,
            Hello::Metadata(_) => 2,
            Hello::Join(_) | Hello::QueuePair(_) => 0,
        };
        slot.reserve(queue_pairs).map_err(refused)?;
        match &hello {
            Hello::QueuePair(q) => {
                let keys = match (q.encrypt, &key) {
                    (true, Some(key)) => Some(key.wire_keys(false)),
                    (true, None) => {
                        return Err(invalid(
                            "an encrypted queue pair asked of a node without a secret".into(),
                        ))
                    }
                    (false, _) if self.cfg.encrypt => {
                        return Err(invalid(
                            "an unencrypted queue pair: this node takes only encrypted ones \
                             (--encrypt); mount with -o encrypt"
                                .into(),
                        ))
                    }
                    (false, _) => None,
                };
                // Counted with its session once handed over: its slot goes back first, so
                // that the peer's next queue pair never finds it still held.
                self.arrivals.deliver(s, deadline, keys, move || drop(slot))
            }
            Hello::Data(Data { qps }) => self.serve_data(s, *qps as usize, key, slot),
            Hello::Metadata(m) => meta()?.serve(self, s, m.client_id, key),
            Hello::Join(j) => crate::join::admit(self, meta()?, s, j, key),
        }
    }

    /// Connects `n` queue pairs in `pd` with the peer on the control connection `s`, within
    /// the setup deadline.
    pub(crate) fn links(
        &self,
        pd: &ProtectionDomain,
        s: &mut TcpStream,
        n: usize,
        caps: QpCaps,
    ) -> io::Result<Vec<(QueuePair, CompletionQueue)>> {
        s.set_read_timeout(Some(SETUP_DEADLINE))?;
        let route = QpRoute::Arrive(self.arrivals.clone());
        let links = connect_links(&self.ctx, pd, s, n, caps, &route)?;
        s.set_read_timeout(None)?;
        Ok(links)
    }

    /// One-sided service: connect the queue pairs in a domain of the session's own (where it
    /// reaches only what it is granted), name the session, then stay out of the way until
    /// the client goes (the hangups thread ends it then, holding `slot` till that).
    fn serve_data(
        &self,
        mut s: TcpStream,
        qps: usize,
        key: Option<SessionKey>,
        slot: Ticket,
    ) -> io::Result<()> {
        let pd = Arc::new(self.ctx.alloc_pd()?);
        // The node never posts on them: on tcp they cost it no threads of their own.
        let links = self.links(&pd, &mut s, qps, QpCaps::RESPONDER)?;
        let session = self.grants.open(pd);
        let pool = PoolDescriptor {
            addr: self.pool.addr(),
            len: self.pool.len() as u64,
            session,
        };
        let sealed = integrity::seal(key.as_ref(), integrity::POOL, 0, pool.encode());
        let grants = self.grants.clone();
        let end: crate::hangups::End = Box::new(move || {
            drop(links);
            grants.close(session);
            drop(slot);
        });
        match send_frame(&mut s, &sealed) {
            Ok(()) => {
                self.hangups.watch(s, end);
                Ok(())
            }
            Err(e) => {
                end();
                Err(e)
            }
        }
    }
}

/// Blocks until the peer closes the control connection (or sends anything: a protocol error).
pub(crate) fn wait_for_close(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    let _ = s.read(&mut b);
}
