//! The client side of a node: authenticated connections, metadata RPCs, and data sessions to
//! every data node (one-sided chunk I/O through rdmabox). fs-client and the tests build on it.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmabox::rpc::{RpcClient, RpcConfig};
use rdmabox::transport::{Context, ProtectionDomain, RemoteAddr, RemoteRegion, TransportConfig};
use rdmabox::{connect_links, Session, SessionConfig, Snapshot};

use crate::auth;
use crate::proto::{decode_pool, ChunkRef, Hello, NodeInfo, Reply, Request};

#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub transport: TransportConfig,
    pub secret: Option<Vec<u8>>,
    pub session: SessionConfig,
    pub rpc: RpcConfig,
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

fn resolve(addr: &str) -> io::Result<SocketAddr> {
    addr.to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("cannot resolve {addr}")))
}

/// Connects, authenticates and says what the connection is for.
pub fn dial(
    addr: SocketAddr,
    secret: Option<&[u8]>,
    hello: &Hello,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| io::Error::new(e.kind(), format!("connecting to {addr}: {e}")))?;
    s.set_nodelay(true)?;
    auth::connect(&mut s, secret)?;
    auth::send_frame(&mut s, &hello.encode())?;
    Ok(s)
}

/// A data session to one node: its queue pairs, pool descriptor and control connection (the
/// node keeps its side while that connection is open).
pub struct DataSession {
    pub session: Session,
    pub pool: RemoteRegion,
    _control: TcpStream,
}

pub fn connect_data(
    ctx: &Context,
    pd: &Arc<ProtectionDomain>,
    addr: SocketAddr,
    secret: Option<&[u8]>,
    cfg: &SessionConfig,
    timeout: Duration,
) -> io::Result<DataSession> {
    let mut s = dial(
        addr,
        secret,
        &Hello::Data {
            qps: cfg.qps as u32,
        },
        timeout,
    )?;
    let links = connect_links(ctx, pd, &mut s, cfg.qps, cfg.caps)?;
    let frame = auth::recv_frame(&mut s, 64)?;
    let (addr, len, rkey) =
        decode_pool(&frame).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let pool = RemoteRegion { addr, len, rkey };
    let session = Session::new(pd.clone(), links, vec![pool], cfg.clone())?;
    Ok(DataSession {
        session,
        pool,
        _control: s,
    })
}

pub struct Client {
    cfg: ClientConfig,
    meta_addr: SocketAddr,
    ctx: Context,
    pd: Arc<ProtectionDomain>,
    rpc: RpcClient,
    _meta_control: TcpStream,
    data: Mutex<HashMap<u32, Arc<DataSession>>>,
}

/// What a failed call tells the file system: an errno.
pub type Errno = i32;

impl Client {
    pub fn connect(addr: &str, cfg: ClientConfig) -> io::Result<Client> {
        let meta_addr = resolve(addr)?;
        let ctx = Context::open(&cfg.transport)?;
        let pd = Arc::new(ctx.alloc_pd()?);
        let mut s = dial(
            meta_addr,
            cfg.secret.as_deref(),
            &Hello::Metadata,
            cfg.connect_timeout,
        )?;
        let mut links = connect_links(&ctx, &pd, &mut s, 1, cfg.session.caps)?;
        let (qp, cq) = links.pop().expect("one link");
        let rpc = RpcClient::new(&pd, qp, cq, cfg.rpc)?;
        Ok(Client {
            cfg,
            meta_addr,
            ctx,
            pd,
            rpc,
            _meta_control: s,
            data: Mutex::new(HashMap::new()),
        })
    }

    pub fn transport(&self) -> String {
        self.ctx.describe()
    }

    /// One metadata call; transport failures and garbage become EIO.
    pub fn call(&self, req: &Request) -> Result<Reply, Errno> {
        let raw = self.rpc.call(&req.encode()).map_err(|e| {
            log::warn!("metadata call {req:?} failed: {e}");
            libc::EIO
        })?;
        match Reply::decode(&raw) {
            Ok(Reply::Error(e)) => Err(e),
            Ok(r) => Ok(r),
            Err(e) => {
                log::warn!("metadata reply: {e}");
                Err(libc::EIO)
            }
        }
    }

    pub fn nodes(&self) -> Result<Vec<NodeInfo>, Errno> {
        match self.call(&Request::Nodes)? {
            Reply::Nodes(n) => Ok(n),
            _ => Err(libc::EIO),
        }
    }

    /// The data session to `node`, connected on first use.
    pub fn data(&self, node: u32) -> Result<Arc<DataSession>, Errno> {
        if let Some(d) = self.data.lock().unwrap().get(&node) {
            if d.session.is_open() {
                return Ok(d.clone());
            }
        }
        let info = self
            .nodes()?
            .into_iter()
            .find(|n| n.id == node)
            .ok_or(libc::EIO)?;
        if !info.alive {
            return Err(libc::EIO);
        }
        // The metadata node is reached the way we reached it; others as they advertise.
        let addr = if node == 0 {
            self.meta_addr
        } else {
            resolve(&info.addr).map_err(|_| libc::EIO)?
        };
        let d = connect_data(
            &self.ctx,
            &self.pd,
            addr,
            self.cfg.secret.as_deref(),
            &self.cfg.session,
            self.cfg.connect_timeout,
        )
        .map_err(|e| {
            log::warn!("data node {node} at {addr}: {e}");
            libc::EIO
        })?;
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

    /// Where byte `offset` of a chunk is, remotely.
    pub fn chunk_addr(chunk: &ChunkRef, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: chunk.addr + offset,
            rkey: chunk.rkey,
        }
    }

    /// The rdmabox counters of every data session, summed.
    pub fn counters(&self) -> Snapshot {
        let data = self.data.lock().unwrap();
        data.values().fold(Snapshot::default(), |acc, d| {
            acc.plus(&d.session.counters())
        })
    }
}
