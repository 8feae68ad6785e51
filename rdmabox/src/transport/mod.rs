//! The verbs model: protection domains, memory regions, completion queues and RC queue pairs,
//! written once and implemented by two providers.
//!
//! - [`verbs`]: libibverbs, for RDMA NICs (and Soft-RoCE).
//! - [`tcp`]: software RDMA over TCP with one-sided semantics, for hosts without a NIC.
//!
//! [`ProviderKind::Auto`] picks verbs when a device exists and tcp otherwise. Queue pairs are
//! connected by exchanging [`Endpoint`]s over a TCP control connection ([`exchange_endpoints`]);
//! [`connect_queue_pairs`] does the whole setup for a set of queue pairs.

mod binding;
mod connect;
mod deadline;
mod endpoint;
mod landing;
pub mod memory;
mod region;
pub mod tcp;
mod types;
pub mod verbs;

use std::fmt;
use std::io;
use std::os::fd::BorrowedFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

pub use binding::ControlBinding;
pub use connect::connect_queue_pairs;
pub use deadline::DeadlineStream;
pub use endpoint::{exchange_endpoints, Endpoint};
pub use landing::{ExternalMemory, Landing};
pub use memory::{MemoryRegion, Sge};
pub use region::{Access, RemoteAddr, RemoteRegion};
pub use tcp::{Arrivals, Authenticated, Dialer, InlineConsumer, QpRoute, TcpConfig, WireKeys};
pub use types::{
    Completion, PostError, QpCaps, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
};
pub use verbs::VerbsConfig;

/// Which provider implements the verbs model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ProviderKind {
    /// verbs when an RDMA device exists, tcp otherwise.
    #[default]
    Auto,
    /// libibverbs: an RDMA NIC (or Soft-RoCE); fails if there is none.
    Verbs,
    /// Software RDMA over TCP sockets, for hosts without a NIC.
    Tcp,
}

impl FromStr for ProviderKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(ProviderKind::Auto),
            "verbs" | "rdma" | "ib" => Ok(ProviderKind::Verbs),
            "tcp" => Ok(ProviderKind::Tcp),
            other => Err(format!(
                "unknown transport {other:?}: expected auto, verbs or tcp"
            )),
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProviderKind::Auto => "auto",
            ProviderKind::Verbs => "verbs",
            ProviderKind::Tcp => "tcp",
        })
    }
}

/// How to open a [`Context`].
#[derive(Clone, Debug, Default)]
pub struct TransportConfig {
    /// Which provider to open.
    pub provider: ProviderKind,
    /// verbs: the device, GID index and timeouts.
    pub verbs: VerbsConfig,
    /// tcp: the provider's listener and timeouts.
    pub tcp: TcpConfig,
}

impl TransportConfig {
    /// The defaults, with `provider` chosen.
    pub fn with_provider(provider: ProviderKind) -> TransportConfig {
        TransportConfig {
            provider,
            ..TransportConfig::default()
        }
    }
}

/// Waits until `fd` is readable; false on timeout.
pub(crate) fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    let timeout = timeout.map_or(PollTimeout::NONE, |t| {
        PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX)
    });
    loop {
        match poll(&mut [PollFd::new(fd, PollFlags::POLLIN)], timeout) {
            Ok(n) => return Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

fn no_device(named: Option<&str>) -> io::Error {
    let what = match named {
        Some(d) => format!("RDMA device {d:?} not found: this host has no RDMA device"),
        None => "no RDMA device found (is the NIC driver loaded?); use --transport tcp to run \
                 over TCP instead"
            .to_string(),
    };
    io::Error::new(io::ErrorKind::NotFound, what)
}

enum CtxImpl {
    Tcp(tcp::Context),
    Verbs(verbs::Context),
}

/// An opened provider: the root of every other verbs object.
pub struct Context {
    imp: CtxImpl,
}

static NEXT_PD: AtomicU64 = AtomicU64::new(1);

impl Context {
    /// Opens the provider `cfg` asks for; `Auto` falls back to tcp when no usable RDMA device
    /// exists, unless a device is named.
    pub fn open(cfg: &TransportConfig) -> io::Result<Context> {
        let tcp = || CtxImpl::Tcp(tcp::Context::new(cfg.tcp.clone()));
        // A device named explicitly is a requirement, as verbs is: no quiet fallback.
        let required = cfg.provider == ProviderKind::Verbs || cfg.verbs.device.is_some();
        let imp = match cfg.provider {
            ProviderKind::Tcp => tcp(),
            _ if required => match verbs::Context::open(&cfg.verbs)? {
                Some(c) => CtxImpl::Verbs(c),
                None => return Err(no_device(cfg.verbs.device.as_deref())),
            },
            _ => match verbs::Context::open(&cfg.verbs) {
                Ok(Some(c)) => CtxImpl::Verbs(c),
                Ok(None) => tcp(),
                Err(e) => {
                    log::warn!("RDMA device present but unusable ({e}); falling back to tcp");
                    tcp()
                }
            },
        };
        Ok(Context { imp })
    }

    /// The provider actually in use (never `Auto`).
    pub fn provider(&self) -> ProviderKind {
        match self.imp {
            CtxImpl::Tcp(_) => ProviderKind::Tcp,
            CtxImpl::Verbs(_) => ProviderKind::Verbs,
        }
    }

    /// "tcp" or "verbs (device)".
    pub fn describe(&self) -> String {
        match &self.imp {
            CtxImpl::Tcp(_) => "tcp".into(),
            CtxImpl::Verbs(c) => format!("verbs ({})", c.device_name()),
        }
    }

    /// A new protection domain, for regions and queue pairs used together.
    pub fn alloc_pd(&self) -> io::Result<ProtectionDomain> {
        let id = NEXT_PD.fetch_add(1, Ordering::Relaxed);
        let imp = match &self.imp {
            CtxImpl::Tcp(c) => PdImpl::Tcp(c.alloc_pd()),
            CtxImpl::Verbs(c) => PdImpl::Verbs(c.alloc_pd()?),
        };
        Ok(ProtectionDomain { imp, id })
    }

    /// A completion queue with room for at least `capacity` completions.
    pub fn create_cq(&self, capacity: usize) -> io::Result<CompletionQueue> {
        let imp = match &self.imp {
            CtxImpl::Tcp(c) => CqImpl::Tcp(c.create_cq(capacity)?),
            CtxImpl::Verbs(c) => CqImpl::Verbs(c.create_cq(capacity)?),
        };
        Ok(CompletionQueue { imp })
    }

    /// An RC queue pair in `pd`, completing into `send_cq` and `recv_cq`, not yet connected;
    /// on tcp its connection comes by `route` (verbs queue pairs need no connection of their
    /// own). All objects must come from this context's provider.
    pub fn create_qp(
        &self,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
        route: &QpRoute,
    ) -> io::Result<PreparedQueuePair> {
        let mismatch = || io::Error::new(io::ErrorKind::InvalidInput, "objects of two providers");
        let imp = match (&self.imp, &pd.imp, &send_cq.imp, &recv_cq.imp) {
            (CtxImpl::Tcp(c), PdImpl::Tcp(pd), CqImpl::Tcp(s), CqImpl::Tcp(r)) => {
                PreparedImpl::Tcp(c.create_qp(pd, (s.clone(), r.clone()), caps, route)?)
            }
            (CtxImpl::Verbs(c), PdImpl::Verbs(pd), CqImpl::Verbs(s), CqImpl::Verbs(r)) => {
                PreparedImpl::Verbs(c.create_qp(pd, s.clone(), r.clone(), caps)?)
            }
            _ => return Err(mismatch()),
        };
        Ok(PreparedQueuePair { imp })
    }
}

enum PdImpl {
    Tcp(tcp::Pd),
    Verbs(verbs::Pd),
}

/// A protection domain: regions and queue pairs of one PD may be used together.
pub struct ProtectionDomain {
    imp: PdImpl,
    id: u64,
}

impl ProtectionDomain {
    /// Registers `backing`; on failure it comes back with the error.
    fn register(
        &self,
        backing: memory::Backing,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, (io::Error, memory::Backing)> {
        match &self.imp {
            PdImpl::Tcp(pd) => pd.register(backing, addr, len, access),
            PdImpl::Verbs(pd) => pd.register(backing, addr, len, access, self.id),
        }
    }

    /// Allocates `len` zeroed bytes of library-owned memory (an anonymous mapping, huge pages
    /// where the kernel gives them) and registers them.
    pub fn alloc_region(&self, len: usize, access: Access) -> io::Result<MemoryRegion> {
        let backing = memory::Backing::mapped(len)?;
        let addr = match backing {
            memory::Backing::Mapped { ptr, .. } | memory::Backing::Vec { ptr, .. } => ptr as u64,
            _ => unreachable!("mapped() returns owned memory"),
        };
        self.register(backing, addr, len, access)
            .map_err(|(e, _)| e)
    }

    /// Registers a caller's vector; [`MemoryRegion::into_vec`] gives it back without a copy,
    /// and so does a failure.
    pub fn register_vec(
        &self,
        v: Vec<u8>,
        access: Access,
    ) -> Result<MemoryRegion, (io::Error, Vec<u8>)> {
        let backing = memory::Backing::from_vec(v);
        let (addr, len) = match backing {
            memory::Backing::Vec { ptr, len, .. } => (ptr as u64, len),
            _ => unreachable!("from_vec returns vector backing"),
        };
        self.register(backing, addr, len, access)
            .map_err(|(e, mut backing)| {
                let v = backing.take_vec().expect("vector backing");
                (e, v)
            })
    }

    /// Registers caller-owned memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay allocated, and must not be accessed through Rust references,
    /// until the returned region is dropped and every work request using it has completed.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> io::Result<MemoryRegion> {
        self.register(memory::Backing::Borrowed, ptr as u64, len, access)
            .map_err(|(e, _)| e)
    }

    /// Registers the memory a read lands in, for the transfer that lands there; the region
    /// keeps that memory alive.
    pub fn register_landing(&self, landing: &Landing, access: Access) -> io::Result<MemoryRegion> {
        let backing = memory::Backing::External {
            _memory: landing.memory(),
        };
        self.register(backing, landing.ptr() as u64, landing.len(), access)
            .map_err(|(e, _)| e)
    }

    /// Registers `len` bytes at `offset` of `parent` once more, in this domain, for no more
    /// than `access`: a key of its own over part of memory that is already registered, which
    /// is how a node grants one peer one range and takes it back (drop it) without touching
    /// the others. Holds `parent`'s memory alive; `parent` may belong to another domain.
    pub fn register_within(
        &self,
        parent: &MemoryRegion,
        offset: usize,
        len: usize,
        access: Access,
    ) -> io::Result<MemoryRegion> {
        let fits = offset
            .checked_add(len)
            .is_some_and(|end| end <= parent.len());
        if !fits || !parent.access().contains(access) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{len} bytes at {offset} with {access:?} is not within a {}-byte region with {:?}",
                    parent.len(),
                    parent.access()
                ),
            ));
        }
        let addr = parent.addr() + offset as u64;
        let backing = memory::Backing::Within {
            _parent: parent.inner.clone(),
        };
        self.register(backing, addr, len, access)
            .map_err(|(e, _)| e)
    }
}

#[derive(Clone)]
enum CqImpl {
    Tcp(Arc<tcp::Cq>),
    Verbs(Arc<verbs::Cq>),
}

/// A completion queue. Cheap to clone (shared handle).
///
/// Event mode: [`arm`](Self::arm) asks for one event on the next completion; the event shows
/// on [`event_fd`](Self::event_fd) (usable with poll/epoll) and is consumed by
/// [`wait_event`](Self::wait_event). To never miss a completion that races the re-arm, poll
/// once more after arming and before sleeping.
#[derive(Clone)]
pub struct CompletionQueue {
    imp: CqImpl,
}

impl CompletionQueue {
    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> io::Result<usize> {
        match &self.imp {
            CqImpl::Tcp(c) => Ok(c.poll(out)),
            CqImpl::Verbs(c) => c.poll(out),
        }
    }

    /// Where the provider has a thread of its own that produces completions (tcp: the QP's
    /// engine), has that thread run `consumer` for what it completes while the CQ is armed,
    /// instead of firing the event: the waiter sleeps on, and a completion costs no wake-up.
    /// False where completions come from a NIC (verbs), or a consumer was set already.
    ///
    /// The consumer runs on a transport thread: it must not wait for another completion of
    /// the same QP, which that thread would deliver.
    pub fn complete_inline(&self, consumer: InlineConsumer) -> bool {
        match &self.imp {
            CqImpl::Tcp(c) => c.set_inline(consumer),
            CqImpl::Verbs(_) => false,
        }
    }

    /// Asks for one event at the next completion (completions already queued do not fire it).
    pub fn arm(&self) -> io::Result<()> {
        match &self.imp {
            CqImpl::Tcp(c) => {
                c.arm();
                Ok(())
            }
            CqImpl::Verbs(c) => c.arm(),
        }
    }

    /// The descriptor that turns readable when an armed event fires, for poll/epoll.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        match &self.imp {
            CqImpl::Tcp(c) => c.event_fd(),
            CqImpl::Verbs(c) => c.event_fd(),
        }
    }

    /// Sleeps until an armed event fires (true) or `timeout` passes (false); consumes the event.
    pub fn wait_event(&self, timeout: Option<Duration>) -> io::Result<bool> {
        match &self.imp {
            CqImpl::Tcp(c) => c.wait_event(timeout),
            CqImpl::Verbs(c) => c.wait_event(timeout),
        }
    }
}

enum PreparedImpl {
    Tcp(tcp::PreparedQp),
    Verbs(verbs::PreparedQp),
}

/// A queue pair that is created but not connected: exchange its [`Endpoint`] with the peer,
/// then [`connect`](Self::connect). Nothing can be posted before.
pub struct PreparedQueuePair {
    imp: PreparedImpl,
}

impl PreparedQueuePair {
    /// The queue pair's number, unique within its provider and host.
    pub fn qp_num(&self) -> u32 {
        match &self.imp {
            PreparedImpl::Tcp(q) => q.qp_num(),
            PreparedImpl::Verbs(q) => q.qp_num(),
        }
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        match &self.imp {
            PreparedImpl::Tcp(q) => Ok(Endpoint::Tcp(q.endpoint()?)),
            PreparedImpl::Verbs(q) => Ok(Endpoint::Verbs(q.endpoint())),
        }
    }

    /// Connects to the peer's queue pair at `remote`, which must be of the same provider.
    pub fn connect(self, remote: &Endpoint) -> io::Result<QueuePair> {
        let imp = match (self.imp, remote) {
            (PreparedImpl::Tcp(q), Endpoint::Tcp(r)) => QpImpl::Tcp(q.connect(r)?),
            (PreparedImpl::Verbs(q), Endpoint::Verbs(r)) => QpImpl::Verbs(q.connect(r)?),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the peer uses another transport provider: start both sides with the same \
                     --transport",
                ))
            }
        };
        Ok(QueuePair { imp })
    }
}

enum QpImpl {
    Tcp(tcp::Qp),
    Verbs(verbs::Qp),
}

/// A connected RC queue pair. Posting from several threads at once is allowed.
pub struct QueuePair {
    imp: QpImpl,
}

impl QueuePair {
    /// Posts a chain of work requests with one call (one doorbell).
    pub fn post_send(&self, chain: &[SendWr<'_>]) -> Result<(), PostError> {
        match &self.imp {
            QpImpl::Tcp(q) => q.post_send(chain),
            QpImpl::Verbs(q) => q.post_send(chain),
        }
    }

    /// Posts receive buffers for the peer's SENDs, in order, with one call.
    pub fn post_recv(&self, chain: &[RecvWr<'_>]) -> Result<(), PostError> {
        match &self.imp {
            QpImpl::Tcp(q) => q.post_recv(chain),
            QpImpl::Verbs(q) => q.post_recv(chain),
        }
    }

    /// The connection state; `Error` once the peer is gone or [`QueuePair::set_error`] ran.
    pub fn state(&self) -> QpState {
        match &self.imp {
            QpImpl::Tcp(q) => q.state(),
            QpImpl::Verbs(q) => q.state(),
        }
    }

    /// The queue pair's number, as completions report it.
    pub fn qp_num(&self) -> u32 {
        match &self.imp {
            QpImpl::Tcp(q) => q.qp_num(),
            QpImpl::Verbs(q) => q.qp_num(),
        }
    }

    /// Whether the provider serves the queue pair with threads of its own (tcp: an engine on
    /// each side) that sleep while it has nothing to do: work sent to a busy queue pair costs
    /// no wake-up, to an idle one a wake-up on each side. A NIC serves verbs queue pairs.
    pub fn served_by_threads(&self) -> bool {
        matches!(self.imp, QpImpl::Tcp(_))
    }

    /// The queue sizes the provider granted.
    pub fn caps(&self) -> QpCaps {
        match &self.imp {
            QpImpl::Tcp(q) => q.caps(),
            QpImpl::Verbs(q) => q.caps(),
        }
    }

    /// Moves the QP to the error state: every outstanding request completes with a flush
    /// error.
    pub fn set_error(&self) {
        match &self.imp {
            QpImpl::Tcp(q) => q.set_error(),
            QpImpl::Verbs(q) => q.set_error(),
        }
    }

    /// tcp only: (post calls, socket writes). None on verbs, where the NIC rings its own
    /// doorbell once per post call.
    pub fn wire_writes(&self) -> Option<(u64, u64)> {
        match &self.imp {
            QpImpl::Tcp(q) => Some(q.doorbells()),
            QpImpl::Verbs(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_device_that_is_not_there_fails_instead_of_falling_back_to_tcp() {
        for provider in [ProviderKind::Auto, ProviderKind::Verbs] {
            let mut cfg = TransportConfig::with_provider(provider);
            cfg.verbs.device = Some("no-such-rdma-device".into());
            let e = Context::open(&cfg).err().expect("refused");
            assert_eq!(e.kind(), io::ErrorKind::NotFound, "{provider}: {e}");
            assert!(e.to_string().contains("no-such-rdma-device"), "{e}");
        }
        // Without a name, auto still falls back when there is no device.
        if verbs::device_names().unwrap_or_default().is_empty() {
            let cfg = TransportConfig::with_provider(ProviderKind::Auto);
            assert_eq!(Context::open(&cfg).unwrap().provider(), ProviderKind::Tcp);
        }
    }
}
