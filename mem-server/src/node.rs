//! A storage node: the registered pool, the listener, and per connection one of three roles
//! (metadata channel, data session, data-node join). The first node also runs the metadata
//! service ([`crate::meta`]); nodes started with `join` lend their pool to it ([`crate::join`]).

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmabox::transport::{
    Access, Arrivals, Authenticated, Context, DeadlineStream, ProviderKind, QpCaps,
};
use rfs_daemon::metrics::Metric;
use rfs_proto::frame::send_frame;
use rfs_proto::handshake;
use rfs_proto::hello::{Data, Hello, PoolDescriptor};
use rfs_proto::integrity;
use rfs_proto::session_key::SessionKey;

use crate::admission::{self, Admission, RateLimitedLog, Ticket};
use crate::config::{invalid, NodeConfig};
use crate::grants::Grants;
use crate::hangups::Hangups;
use crate::meta::MetaService;
use crate::runtime::{Runtime, SETUP_DEADLINE};

/// How long the accept loop pauses when the process is out of descriptors or memory.
const EXHAUSTED_BACKOFF: Duration = Duration::from_millis(100);

/// What every connection of a node shares.
pub(crate) struct Shared {
    pub(crate) rt: Arc<Runtime>,
    /// Present on the metadata node only.
    meta: Option<Arc<MetaService>>,
    admission: Arc<Admission>,
    /// Ends data sessions whose clients go.
    hangups: Arc<Hangups>,
}

/// A running node.
pub struct Node {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    /// A data node's membership: the metadata node marks it dead when this closes.
    membership: Option<crate::join::Membership>,
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
        let grants = Arc::new(Grants::new(pool.clone(), cfg.chunk_size, cfg.max_grants));
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
        let rt = Arc::new(Runtime {
            cfg,
            ctx,
            pd,
            pool,
            grants,
            arrivals: Arrivals::new(),
            stop: AtomicBool::new(false),
        });
        let shared = Arc::new(Shared {
            rt: rt.clone(),
            meta,
            admission: Admission::new(limits),
            hangups: Hangups::start()?,
        });
        if let (Some(meta), Some(wait)) = (&shared.meta, zero_wait) {
            meta.start_zeroer(rt.clone(), wait)?;
            meta.start_quarantine()?;
            meta.start_growth()?;
            meta.start_compaction()?;
            meta.start_repair()?;
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
            membership: None,
        };
        if let Some(meta) = shared.rt.cfg.join {
            match crate::join::join(&shared.rt, meta, addr) {
                Ok(m) => node.membership = Some(m),
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
            let (grants, evicted) = s.rt.grants.counts();
            let mut m = vec![
                Metric::gauge("pool_bytes", "Bytes this node lends", s.rt.cfg.memory),
                Metric::gauge(
                    "connections",
                    "Control connections open (clients, data sessions, nodes)",
                    s.admission.in_use() as u64,
                ),
                Metric::gauge(
                    "grants",
                    "Chunk grants (registrations) held over every data session",
                    grants,
                ),
                Metric::counter(
                    "grants_evicted",
                    "Grants dropped because their session (or the node) held the most",
                    evicted,
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
        self.shared.rt.ctx.describe()
    }

    /// Bytes of pool the node lends.
    pub fn pool_bytes(&self) -> usize {
        self.shared.rt.cfg.memory as usize
    }

    /// A data node about to stop moves its copies to the other nodes first, for up to
    /// `patience` (see [`crate::leave`]); `interrupted(wait)` waits up to `wait` for a signal
    /// to stop at once. False when it stops with copies the metadata node still counts on
    /// (or could not tell); nothing to do on a metadata node, or with no patience.
    pub fn drain_before_stop(
        &self,
        patience: Duration,
        interrupted: impl FnMut(Duration) -> bool,
    ) -> bool {
        match &self.membership {
            Some(m) if !patience.is_zero() => crate::leave::drain_before_stop(
                &self.shared.rt,
                m.meta,
                &m.advertise,
                patience,
                interrupted,
            ),
            _ => true,
        }
    }

    /// Stops accepting; established sessions end with the process.
    pub fn shutdown(mut self) {
        self.shared.rt.stop.store(true, Ordering::Release);
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
            if self.rt.stop.load(Ordering::Acquire) {
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
            self.rt.cfg.secret.as_deref(),
            self.rt.cfg.encrypt,
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
        rdmabox::transport::tcp::configure_socket(&s, self.rt.cfg.transport.tcp.dead_peer_timeout)?;
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
                    (false, _) if self.rt.cfg.encrypt => {
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
                let conn = Authenticated {
                    stream: s,
                    keys,
                    channel: key.map(|k| k.channel()),
                };
                self.rt.arrivals.deliver(conn, deadline, move || drop(slot))
            }
            Hello::Data(Data { qps }) => self.serve_data(s, *qps as usize, key, slot),
            Hello::Metadata(m) => meta()?.serve(&self.rt, s, m.client_id, key, slot),
            Hello::Join(j) => crate::join::admit(&self.rt, meta()?, s, j, key),
        }
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
        let pd = Arc::new(self.rt.ctx.alloc_pd()?);
        // The node never posts on them: on tcp they cost it no threads of their own.
        let queue_pairs = self
            .rt
            .queue_pairs(&pd, &mut s, key.as_ref(), qps, QpCaps::RESPONDER)?;
        let session = self.rt.grants.open(pd);
        let pool = PoolDescriptor {
            addr: self.rt.pool.addr(),
            len: self.rt.pool.len() as u64,
            session,
        };
        let sealed = integrity::seal(key.as_ref(), integrity::POOL, 0, pool.encode());
        let grants = self.rt.grants.clone();
        let end: crate::hangups::End = Box::new(move || {
            drop(queue_pairs);
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
