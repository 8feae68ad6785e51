//! What the parts of a running node share: its configuration, transport, pool and grants,
//! and the way its queue pairs get their connections (through the node's one port). Below
//! both the node, which accepts connections, and the metadata service, which serves some of
//! them, so that neither reaches into the other.

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use rdmabox::connect_queue_pairs;
use rdmabox::transport::{
    Arrivals, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCaps, QpRoute, QueuePair,
};

use rfs_proto::session_key::SessionKey;

use crate::config::NodeConfig;
use crate::grants::Grants;

/// From accept to an authenticated hello, and again for the queue-pair exchange: a peer that
/// takes longer is dropped, and whatever it pinned (a thread, queue pairs waiting) is freed.
pub(crate) const SETUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

pub(crate) struct Runtime {
    pub(crate) cfg: NodeConfig,
    pub(crate) ctx: Context,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) pool: Arc<MemoryRegion>,
    /// What each data session may reach of the pool.
    pub(crate) grants: Arc<Grants>,
    /// Queue pairs waiting for their peers' connections, which come to the node's one port.
    pub(crate) arrivals: Arc<Arrivals>,
    pub(crate) stop: AtomicBool,
}

impl Runtime {
    /// Connects `n` queue pairs in `pd` with the peer on the control connection `s` (whose
    /// session key is `key`, which binds them to it), within the setup deadline.
    pub(crate) fn queue_pairs(
        &self,
        pd: &ProtectionDomain,
        s: &mut TcpStream,
        key: Option<&SessionKey>,
        n: usize,
        caps: QpCaps,
    ) -> io::Result<Vec<(QueuePair, CompletionQueue)>> {
        s.set_read_timeout(Some(SETUP_DEADLINE))?;
        let binding = key.map(|k| k.control_binding(false));
        let route = QpRoute::Arrive(self.arrivals.clone(), binding);
        let qps = connect_queue_pairs(&self.ctx, pd, s, n, caps, &route)?;
        s.set_read_timeout(None)?;
        Ok(qps)
    }
}

/// Whether the peer closed the control connection (or sent anything: a protocol error),
/// waiting a moment for it: when a client goes, its queue pairs and its control connection
/// close together, and either may be seen first.
pub(crate) fn closed_by_peer(s: &TcpStream) -> bool {
    let _ = s.set_read_timeout(Some(std::time::Duration::from_millis(200)));
    let mut b = [0u8; 1];
    (&*s).read(&mut b).is_ok()
}
