//! The metadata service in process: the real service with a small pool of its own, called as a
//! client's connection calls it (calls numbered and sealed in their envelopes), with no socket,
//! queue pair or other process. For tests that want the service's own semantics: the metadata
//! operations' tests, and fs-client's in-memory fake, which is checked against it.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use rdmabox::transport::{Access, Context, MemoryRegion, ProviderKind, TransportConfig};
use rfs_proto::clock;
use rfs_proto::message::{seal, Envelope};
use rfs_proto::MetadataChannel;

use crate::config::NodeConfig;
use crate::grants::Grants;
use crate::meta::sessions::Attached;
use crate::meta::MetaService;

/// How long an in-process call may take before the service takes it for abandoned.
const CALL_BUDGET_MS: u32 = 10_000;

/// A metadata service whose only data node is its own pool of `chunks` chunks. Freed chunks
/// are quarantined and revoked as on a node, but no zeroer runs: they are not allocated again.
pub struct InProcessService {
    pub(crate) meta: Arc<MetaService>,
    grants: Arc<Grants>,
    pool: Arc<MemoryRegion>,
    ctx: Context,
    _zeroer_kicks: Receiver<()>,
}

impl InProcessService {
    /// A service over a pool of `chunks` chunks of `chunk_size` bytes, with a lease of `lease`.
    pub fn new(chunk_size: u64, chunks: u64, lease: Duration) -> io::Result<InProcessService> {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp))?;
        let pd = ctx.alloc_pd()?;
        let pool = Arc::new(pd.alloc_region((chunks * chunk_size) as usize, Access::ALL)?);
        let grants = Arc::new(Grants::new(
            pool.clone(),
            chunk_size,
            crate::config::DEFAULT_MAX_GRANTS,
        ));
        let any_port = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let mut cfg = NodeConfig::new(any_port, chunks * chunk_size);
        cfg.chunk_size = chunk_size;
        cfg.insecure = true;
        cfg.lease = lease;
        let (meta, kicks) = MetaService::new(&cfg, "in-process".into(), &pool, chunks, &grants)?;
        meta.start_quarantine()?;
        meta.start_growth()?;
        meta.start_compaction()?;
        Ok(InProcessService {
            meta,
            grants,
            pool,
            ctx,
            _zeroer_kicks: kicks,
        })
    }

    /// A new data session at the service's own pool (in a protection domain of its own), by
    /// the name a client attaches it with (`AttachData`): chunk maps are granted to it then.
    pub fn data_session(&self) -> io::Result<u64> {
        let pd = Arc::new(self.ctx.alloc_pd()?);
        Ok(self.grants.open(pd))
    }

    /// `len` bytes of the pool at address `addr` (a chunk's, as maps give them, plus an
    /// offset): what one-sided transfers would read there.
    pub fn pool_bytes(&self, addr: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0; len];
        self.pool.read_at(self.pool_offset(addr)?, &mut out)?;
        Ok(out)
    }

    /// Writes `bytes` into the pool at address `addr`, as a one-sided write would.
    pub fn write_pool(&self, addr: u64, bytes: &[u8]) -> io::Result<()> {
        self.pool.write_at(self.pool_offset(addr)?, bytes)
    }

    fn pool_offset(&self, addr: u64) -> io::Result<usize> {
        addr.checked_sub(self.pool.addr())
            .map(|o| o as usize)
            .ok_or_else(|| io::Error::other(format!("{addr:#x} is not in the pool")))
    }

    /// The data node id of the service's own pool.
    pub fn own_node(&self) -> u32 {
        self.meta.local
    }

    /// The session of client `id`, as a connection of that client attaches it.
    pub fn client(&self, id: u64) -> InProcessClient<'_> {
        let attached =
            self.meta
                .sessions
                .attach(id, Arc::new(AtomicBool::new(false)), "in process".into());
        InProcessClient {
            service: self,
            attached,
            seq: AtomicU64::new(0),
        }
    }
}

/// One client's session with an [`InProcessService`]: each call is the next of the session,
/// answered in time.
pub struct InProcessClient<'a> {
    pub(crate) service: &'a InProcessService,
    pub(crate) attached: Attached,
    seq: AtomicU64,
}

impl InProcessClient<'_> {
    /// Hands the service `call` (a sealed call: envelope and request) and returns its reply.
    pub(crate) fn handle(&self, call: &[u8]) -> Vec<u8> {
        self.service.meta.handle(&self.attached, call)
    }

    /// Numbers `request` as the session's next call, due now.
    fn sealed(&self, request: &[u8]) -> Vec<u8> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let envelope = Envelope {
            seq,
            oldest: seq,
            sent_ms: clock::now_ms(),
            budget_ms: CALL_BUDGET_MS,
        };
        seal(&envelope, request)
    }
}

impl MetadataChannel for InProcessClient<'_> {
    fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>> {
        let call = self.sealed(request);
        Ok(self.handle(&call))
    }
}
