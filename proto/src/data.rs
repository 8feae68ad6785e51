//! A data session: the queue pairs to one data node and the pool it lends, over which the
//! client (or the metadata node's zeroer) moves bytes one-sidedly.

use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdmabox::transport::{Context, ProtectionDomain, RemoteAddr, RemoteRegion};
use rdmabox::{connect_queue_pairs, AbortHandle, Session, SessionConfig};

use crate::frame::recv_frame;
use crate::handshake::{dial, queue_pair_route};
use crate::hello::{Data, Hello, PoolDescriptor};
use crate::integrity;
use crate::types::ChunkRef;

/// The largest pool descriptor frame.
const MAX_POOL_FRAME: usize = 64;

/// A data session to one node: its queue pairs, pool and control connection (the node keeps
/// its side while that connection is open). The node closing the control connection breaks
/// the session at once: over verbs nothing else would tell a dead node's queue pairs apart
/// from slow ones until the NIC's retries run out.
pub struct DataSession {
    /// The rdmabox session over the node's queue pairs.
    pub session: Session,
    /// The region the node lends (its key is 0: chunks are reached by the keys granted).
    pub pool: RemoteRegion,
    /// The session's name at the node, by which the metadata node grants it chunks.
    pub name: u64,
    control: TcpStream,
    /// Set when we close the control connection ourselves: its end is then no news.
    leaving: Arc<AtomicBool>,
}

impl DataSession {
    /// Connects `cfg.qps` queue pairs to the node at `addr` (encrypted with `encrypt`) and
    /// learns its pool.
    pub fn connect(
        ctx: &Context,
        pd: &Arc<ProtectionDomain>,
        addr: SocketAddr,
        secret: Option<&[u8]>,
        encrypt: bool,
        cfg: &SessionConfig,
        timeout: Duration,
    ) -> io::Result<DataSession> {
        let hello = Hello::Data(Data {
            qps: cfg.qps as u32,
        });
        let (mut s, key) = dial(addr, secret, &hello, timeout)?;
        // A node that goes silent during setup fails the connect instead of hanging it.
        s.set_read_timeout(Some(timeout))?;
        let route = queue_pair_route(secret, encrypt, key.as_ref())?;
        let qps = connect_queue_pairs(ctx, pd, &mut s, cfg.qps, cfg.caps, &route)?;
        let sealed = recv_frame(&mut s, MAX_POOL_FRAME + integrity::TAG)?;
        let frame =
            integrity::open(key.as_ref(), integrity::POOL, 0, &sealed).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a pool descriptor without the session's MAC: altered on the path",
                )
            })?;
        s.set_read_timeout(None)?;
        // A host that vanishes without a FIN ends the connection too.
        rdmabox::transport::tcp::configure_socket(&s, timeout)?;
        let PoolDescriptor {
            addr: pool_addr,
            len,
            session: session_name,
        } = PoolDescriptor::decode(frame)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let pool = RemoteRegion {
            addr: pool_addr,
            len,
            rkey: 0,
        };
        let session = Session::new(pd.clone(), qps, vec![pool], cfg.clone())?;
        let leaving = Arc::new(AtomicBool::new(false));
        watch_control(
            s.try_clone()?,
            session.abort_handle(),
            addr,
            leaving.clone(),
        )?;
        Ok(DataSession {
            session,
            pool,
            name: session_name,
            control: s,
            leaving,
        })
    }
}

impl Drop for DataSession {
    /// Ends the watcher's read, and tells the node at once.
    fn drop(&mut self) {
        self.leaving.store(true, Ordering::Release);
        let _ = self.control.shutdown(Shutdown::Both);
    }
}

/// Breaks the session when the node's side of the control connection closes or fails. The
/// node never writes on it after setup: whatever it sends is ignored.
fn watch_control(
    mut s: TcpStream,
    session: AbortHandle,
    node: SocketAddr,
    leaving: Arc<AtomicBool>,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name("rfs-data-watch".into())
        .spawn(move || {
            let mut buf = [0u8; 64];
            let why = loop {
                match s.read(&mut buf) {
                    Ok(0) => break "closed its control connection".to_string(),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => break format!("control connection failed: {e}"),
                }
            };
            if !leaving.load(Ordering::Acquire) {
                session.abort(&format!("data node {node} {why}"));
            }
        })?;
    Ok(())
}

/// Where byte `offset` of a chunk is, remotely (within the span of `chunk`, the copy).
pub fn chunk_addr(chunk: &ChunkRef, offset: u64) -> RemoteAddr {
    RemoteAddr {
        addr: chunk.addr_of(offset),
        rkey: chunk.rkey,
    }
}
