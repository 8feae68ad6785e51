//! A storage node: the registered pool, the listener, and per connection one of three roles
//! (metadata RPC, data session, data-node join). The first node also runs the metadata service;
//! nodes started with `join` lend their pool to it.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rdmabox::rpc::{self, RpcConfig};
use rdmabox::transport::{Access, Context, MemoryRegion, ProtectionDomain, TransportConfig};
use rdmabox::{connect_links, SessionConfig};

use crate::alloc::Allocator;
use crate::auth;
use crate::client::{connect_data, dial, DataSession};
use crate::namespace::{Namespace, Owner};
use crate::proto::{self, Hello, Reply, Request, StatFs, MAX_LIST};

#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub listen: SocketAddr,
    pub memory: u64,
    pub chunk_size: u64,
    pub transport: TransportConfig,
    pub secret: Option<Vec<u8>>,
    /// Accept peers from other hosts without a secret.
    pub insecure: bool,
    /// Join this metadata node as a data node instead of running the metadata service.
    pub join: Option<SocketAddr>,
    /// host:port clients use to reach this node (default: derived from the listen address).
    pub advertise: Option<String>,
    pub rpc: RpcConfig,
}

impl NodeConfig {
    pub fn new(listen: SocketAddr, memory: u64) -> NodeConfig {
        NodeConfig {
            listen,
            memory,
            chunk_size: 1 << 20,
            transport: TransportConfig::default(),
            secret: None,
            insecure: false,
            join: None,
            advertise: None,
            rpc: RpcConfig::default(),
        }
    }
}

/// The namespace and the allocator, under one lock: metadata operations are short.
struct MetaState {
    ns: Namespace,
    alloc: Allocator,
}

struct Meta {
    state: Mutex<MetaState>,
    /// Sessions to remote data nodes, used only to zero freed chunks one-sidedly.
    zero_sessions: Mutex<HashMap<u32, Arc<DataSession>>>,
    zero_kick: crossbeam_channel::Sender<()>,
}

struct Shared {
    cfg: NodeConfig,
    ctx: Context,
    pd: Arc<ProtectionDomain>,
    pool: MemoryRegion,
    meta: Option<Meta>,
    stop: AtomicBool,
}

/// A running node.
pub struct Node {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    /// A data node's membership: the metadata node marks it dead when this closes.
    _join: Option<TcpStream>,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl Node {
    pub fn start(cfg: NodeConfig) -> io::Result<Node> {
        if cfg.chunk_size < 4096 || !cfg.chunk_size.is_power_of_two() {
            return Err(invalid(format!(
                "chunk size {} must be a power of two of at least 4 KiB",
                cfg.chunk_size
            )));
        }
        if cfg.memory < cfg.chunk_size {
            return Err(invalid(format!(
                "memory {} is smaller than one chunk ({})",
                cfg.memory, cfg.chunk_size
            )));
        }
        let chunks = cfg.memory / cfg.chunk_size;
        let ctx = Context::open(&cfg.transport)?;
        let pd = Arc::new(ctx.alloc_pd()?);
        let pool = pd
            .alloc_region((chunks * cfg.chunk_size) as usize, Access::ALL)
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("allocating {} bytes of pool: {e}", cfg.memory),
                )
            })?;
        let listener = TcpListener::bind(cfg.listen)
            .map_err(|e| io::Error::new(e.kind(), format!("listening on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr()?;
        let (zero_kick, zero_wait) = crossbeam_channel::bounded(1);
        let meta = cfg.join.is_none().then(|| {
            let mut alloc = Allocator::default();
            let advertise = cfg.advertise.clone().unwrap_or_else(|| addr.to_string());
            alloc.add_node(advertise, pool.addr(), pool.rkey(), cfg.chunk_size, chunks);
            Meta {
                state: Mutex::new(MetaState {
                    ns: Namespace::new(cfg.chunk_size),
                    alloc,
                }),
                zero_sessions: Mutex::new(HashMap::new()),
                zero_kick,
            }
        });
        let shared = Arc::new(Shared {
            cfg,
            ctx,
            pd,
            pool,
            meta,
            stop: AtomicBool::new(false),
        });
        if shared.meta.is_some() {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("zeroer".into())
                .spawn(move || s.zero_loop(zero_wait))?;
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
            match shared.join(meta, addr) {
                Ok(s) => node._join = Some(s),
                Err(e) => {
                    node.shutdown();
                    return Err(io::Error::new(e.kind(), format!("joining {meta}: {e}")));
                }
            }
        }
        Ok(node)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn transport(&self) -> String {
        self.shared.ctx.describe()
    }

    pub fn pool_bytes(&self) -> usize {
        self.shared.pool.len()
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

impl Shared {
    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for conn in listener.incoming() {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let s = match conn {
                Ok(s) => s,
                Err(e) => {
                    log::warn!("accept: {e}");
                    continue;
                }
            };
            let me = self.clone();
            let _ = std::thread::Builder::new()
                .name("conn".into())
                .spawn(move || {
                    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    match me.serve_connection(s) {
                        Ok(()) => {}
                        // Port probes and peers that hang up before saying anything.
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                            log::debug!("connection from {peer} closed early")
                        }
                        Err(e) => log::info!("connection from {peer} ended: {e}"),
                    }
                });
        }
    }

    fn serve_connection(&self, mut s: TcpStream) -> io::Result<()> {
        let peer = s.peer_addr()?;
        if self.cfg.secret.is_none() && !self.cfg.insecure && !peer.ip().is_loopback() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("refused {peer}: without --secret-file only loopback peers are allowed (or use --insecure)"),
            ));
        }
        s.set_nodelay(true)?;
        auth::accept(&mut s, self.cfg.secret.as_deref())?;
        s.set_read_timeout(Some(auth::HANDSHAKE_TIMEOUT))?;
        let hello = Hello::decode(&auth::recv_frame(&mut s, 4096)?)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        s.set_read_timeout(None)?;
        log::debug!("{peer}: {hello:?}");
        match hello {
            Hello::Data { qps } => self.serve_data(s, qps as usize),
            Hello::Metadata => match &self.meta {
                Some(meta) => self.serve_metadata(meta, s),
                None => Err(invalid("metadata requested from a data node".into())),
            },
            Hello::Join {
                addr,
                pool_addr,
                pool_len,
                rkey,
                chunk_size,
            } => match &self.meta {
                Some(meta) => self.serve_join(meta, s, addr, pool_addr, pool_len, rkey, chunk_size),
                None => Err(invalid("join requested from a data node".into())),
            },
        }
    }

    /// One-sided service: connect the queue pairs, hand over the pool descriptor, then stay out
    /// of the way until the client goes.
    fn serve_data(&self, mut s: TcpStream, qps: usize) -> io::Result<()> {
        let links = connect_links(
            &self.ctx,
            &self.pd,
            &mut s,
            qps,
            SessionConfig::default().caps,
        )?;
        auth::send_frame(
            &mut s,
            &proto::encode_pool(self.pool.addr(), self.pool.len() as u64, self.pool.rkey()),
        )?;
        wait_for_close(&mut s);
        drop(links);
        Ok(())
    }

    fn serve_metadata(&self, meta: &Meta, mut s: TcpStream) -> io::Result<()> {
        let mut links = connect_links(
            &self.ctx,
            &self.pd,
            &mut s,
            1,
            SessionConfig::default().caps,
        )?;
        let (qp, cq) = links.pop().expect("one link");
        // The client's open handles, released when it leaves however it leaves.
        let mut open: HashMap<u64, u32> = HashMap::new();
        let stop = AtomicBool::new(false);
        let closer = {
            let mut watch = s.try_clone()?;
            std::thread::spawn(move || wait_for_close(&mut watch))
        };
        let result = rpc::serve(&self.pd, qp, cq, self.cfg.rpc, &stop, |body| {
            let reply = match Request::decode(body) {
                Ok(req) => self.handle(meta, &mut open, req),
                Err(e) => {
                    log::warn!("malformed metadata request: {e}");
                    Reply::Error(libc::EPROTO)
                }
            };
            reply.encode()
        });
        let mut st = meta.state.lock().unwrap();
        let mut freed = Vec::new();
        for (ino, n) in open {
            for _ in 0..n {
                freed.extend(st.ns.release(ino));
            }
        }
        st.alloc.release(freed);
        drop(st);
        let _ = meta.zero_kick.try_send(());
        drop(s);
        let _ = closer.join();
        result
    }

    fn handle(&self, meta: &Meta, open: &mut HashMap<u64, u32>, req: Request) -> Reply {
        let mut st = meta.state.lock().unwrap();
        let MetaState { ns, alloc } = &mut *st;
        let mut freed = Vec::new();
        let attr = |r: Result<proto::Attr, i32>| r.map_or_else(Reply::Error, Reply::Attr);
        let reply = match req {
            Request::Lookup { parent, name } => attr(ns.lookup(parent, &name)),
            Request::GetAttr { ino } => attr(ns.getattr(ino)),
            Request::SetAttr { ino, set } => match ns.setattr(ino, &set) {
                Ok((a, f)) => {
                    freed = f;
                    Reply::Attr(a)
                }
                Err(e) => Reply::Error(e),
            },
            Request::Mknod {
                parent,
                name,
                kind,
                perm,
                uid,
                gid,
                rdev,
            } => attr(ns.mknod(parent, &name, kind, rdev, Owner { perm, uid, gid })),
            Request::Mkdir {
                parent,
                name,
                perm,
                uid,
                gid,
            } => attr(ns.mkdir(parent, &name, Owner { perm, uid, gid })),
            Request::Symlink {
                parent,
                name,
                target,
                uid,
                gid,
            } => attr(ns.symlink(parent, &name, &target, uid, gid)),
            Request::Readlink { ino } => ns.readlink(ino).map_or_else(Reply::Error, Reply::Target),
            Request::Link {
                ino,
                newparent,
                newname,
            } => attr(ns.link(ino, newparent, &newname)),
            Request::Unlink { parent, name } => match ns.unlink(parent, &name) {
                Ok(f) => {
                    freed = f;
                    Reply::Empty
                }
                Err(e) => Reply::Error(e),
            },
            Request::Rmdir { parent, name } => ns
                .rmdir(parent, &name)
                .map_or_else(Reply::Error, |_| Reply::Empty),
            Request::Rename {
                parent,
                name,
                newparent,
                newname,
                flags,
            } => match ns.rename(parent, &name, newparent, &newname, flags) {
                Ok(f) => {
                    freed = f;
                    Reply::Empty
                }
                Err(e) => Reply::Error(e),
            },
            Request::ReadDir { ino, cookie, max } => {
                match ns.readdir(ino, cookie, max.min(MAX_LIST) as usize) {
                    Ok(es) => {
                        Reply::Entries(es.into_iter().map(|e| (e.cookie, e.name, e.attr)).collect())
                    }
                    Err(e) => Reply::Error(e),
                }
            }
            Request::Open { ino } => match ns.open(ino) {
                Ok(a) => {
                    *open.entry(ino).or_default() += 1;
                    Reply::Attr(a)
                }
                Err(e) => Reply::Error(e),
            },
            Request::Release { ino } => match open.get_mut(&ino) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    if *n == 0 {
                        open.remove(&ino);
                    }
                    freed = ns.release(ino);
                    Reply::Empty
                }
                _ => Reply::Error(libc::EBADF),
            },
            Request::ChunkMap { ino, first, count } => ns
                .chunk_map(ino, first, count as u64)
                .map_or_else(Reply::Error, Reply::Chunks),
            Request::Allocate { ino, first, count } => {
                let count = count as u64;
                match ns.missing_chunks(ino, first, count) {
                    Err(e) => Reply::Error(e),
                    Ok(missing) => match alloc.alloc(missing.len()) {
                        Err(e) => Reply::Error(e),
                        Ok(chunks) => {
                            let new: Vec<_> = missing.into_iter().zip(chunks).collect();
                            match ns.add_chunks(ino, &new) {
                                Ok(()) => ns
                                    .chunk_map(ino, first, count)
                                    .map_or_else(Reply::Error, Reply::Chunks),
                                Err(e) => {
                                    freed = new.into_iter().map(|(_, c)| c).collect();
                                    Reply::Error(e)
                                }
                            }
                        }
                    },
                }
            }
            Request::Commit { ino, size, mtime } => attr(ns.commit(ino, size, mtime)),
            Request::StatFs => {
                let (total, free) = alloc.totals();
                Reply::StatFs(StatFs {
                    chunk_size: ns.chunk_size(),
                    chunks_total: total,
                    chunks_free: free,
                    inodes: ns.inode_count(),
                })
            }
            Request::Nodes => Reply::Nodes(alloc.nodes()),
        };
        if !freed.is_empty() {
            alloc.release(freed);
            let _ = meta.zero_kick.try_send(());
        }
        reply
    }

    #[allow(clippy::too_many_arguments)]
    fn serve_join(
        &self,
        meta: &Meta,
        mut s: TcpStream,
        addr: String,
        pool_addr: u64,
        pool_len: u64,
        rkey: u32,
        chunk_size: u64,
    ) -> io::Result<()> {
        if chunk_size != self.cfg.chunk_size {
            auth::send_frame(&mut s, b"chunk size mismatch")?;
            return Err(invalid(format!(
                "node {addr} uses {chunk_size}-byte chunks, this namespace {}",
                self.cfg.chunk_size
            )));
        }
        // Our own session to the node, to zero its freed chunks one-sidedly.
        let target: SocketAddr = addr
            .parse()
            .map_err(|_| invalid(format!("joining node advertises a bad address {addr:?}")))?;
        let zero_cfg = SessionConfig {
            qps: 1,
            pool_slots: 2,
            ..SessionConfig::default()
        };
        let session = connect_data(
            &self.ctx,
            &self.pd,
            target,
            self.cfg.secret.as_deref(),
            &zero_cfg,
            Duration::from_secs(5),
        )?;
        if session.pool.addr != pool_addr
            || session.pool.len != pool_len
            || session.pool.rkey != rkey
        {
            return Err(invalid(format!(
                "node {addr} described its pool inconsistently"
            )));
        }
        let id = meta.state.lock().unwrap().alloc.add_node(
            addr.clone(),
            pool_addr,
            rkey,
            chunk_size,
            pool_len / chunk_size,
        );
        meta.zero_sessions
            .lock()
            .unwrap()
            .insert(id, Arc::new(session));
        auth::send_frame(&mut s, b"ok")?;
        log::info!(
            "data node {id} joined from {addr}: {} chunks",
            pool_len / chunk_size
        );
        wait_for_close(&mut s);
        log::warn!("data node {id} at {addr} left; its chunks are unavailable");
        meta.state.lock().unwrap().alloc.set_alive(id, false);
        meta.zero_sessions.lock().unwrap().remove(&id);
        Ok(())
    }

    /// Joins the metadata node at `meta` as a data node; returns the connection that keeps the
    /// membership alive.
    fn join(&self, meta: SocketAddr, listen: SocketAddr) -> io::Result<TcpStream> {
        let advertise = match &self.cfg.advertise {
            Some(a) => a.clone(),
            None if !listen.ip().is_unspecified() => listen.to_string(),
            None => {
                // Reachable the way we reach the metadata node.
                let probe = TcpStream::connect_timeout(&meta, Duration::from_secs(5))?;
                SocketAddr::new(probe.local_addr()?.ip(), listen.port()).to_string()
            }
        };
        let hello = Hello::Join {
            addr: advertise,
            pool_addr: self.pool.addr(),
            pool_len: self.pool.len() as u64,
            rkey: self.pool.rkey(),
            chunk_size: self.cfg.chunk_size,
        };
        let mut s = dial(
            meta,
            self.cfg.secret.as_deref(),
            &hello,
            Duration::from_secs(5),
        )?;
        // The metadata node connects back to us (a zeroing session) before it answers.
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let answer = auth::recv_frame(&mut s, 64)?;
        if answer != b"ok" {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!(
                    "metadata node refused the join: {}",
                    String::from_utf8_lossy(&answer)
                ),
            ));
        }
        s.set_read_timeout(None)?;
        Ok(s)
    }

    /// Zeroes freed chunks (locally by memset, remotely by one-sided writes of zeros) and
    /// makes them allocatable again.
    fn zero_loop(&self, kick: crossbeam_channel::Receiver<()>) {
        let meta = self.meta.as_ref().expect("only the metadata node zeroes");
        let chunk = self.cfg.chunk_size as usize;
        while kick.recv().is_ok() {
            let dirty = meta.state.lock().unwrap().alloc.take_dirty();
            for (node, addrs) in dirty {
                let taken = addrs.len();
                let mut done = Vec::with_capacity(taken);
                if node == 0 {
                    for a in addrs {
                        let off = (a - self.pool.addr()) as usize;
                        if self.pool.fill(off, chunk, 0).is_ok() {
                            done.push(a);
                        }
                    }
                } else if let Some(d) = meta.zero_sessions.lock().unwrap().get(&node).cloned() {
                    let pending: Vec<_> = addrs
                        .iter()
                        .map(|&a| {
                            let at = rdmabox::transport::RemoteAddr {
                                addr: a,
                                rkey: d.pool.rkey,
                            };
                            (a, d.session.write_pending(at, vec![0u8; chunk]))
                        })
                        .collect();
                    for (a, p) in pending {
                        match p.wait() {
                            Ok(_) => done.push(a),
                            Err(e) => log::warn!("zeroing a chunk on node {node}: {e}"),
                        }
                    }
                }
                let failed = taken - done.len();
                meta.state.lock().unwrap().alloc.zeroed(node, done, failed);
            }
        }
    }
}

/// Blocks until the peer closes the control connection (or sends anything: a protocol error).
fn wait_for_close(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    let _ = s.read(&mut b);
}
