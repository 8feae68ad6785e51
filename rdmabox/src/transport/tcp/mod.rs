//! The `tcp` provider: software RDMA for hosts without an RDMA NIC.
//!
//! It keeps the semantics, not just the API. Each queue pair is one TCP connection (on a port of
//! its own, or through a node's one listening socket: `route`), encrypted if its peers say so
//! (`seal`). On the responder, an engine (two threads per QP; for a QP its side never posts on,
//! a responder loop shared by the process: `responder`) executes READ and WRITE directly against
//! registered memory (rkey, bounds and access checked like a NIC) without the application seeing
//! the request; a violation is answered with a NAK that completes the request with a
//! remote-access error and moves both QPs to the error state. A posted chain leaves as one
//! `writev`. A lost connection flushes every outstanding work request. SEND consumes a posted
//! RECV; when none is posted the engine waits up to `rnr_timeout` (the RNR retry window of a NIC)
//! and then fails the SEND with `RnrRetryExceeded`. Registration pins memory with `mlock` (best
//! effort).

mod cq;

pub use cq::InlineConsumer;
mod conn;
mod engine;
mod event_loop;
mod io;
mod qp;
mod route;
mod seal;
mod shared;
#[cfg(test)]
mod tests;
pub mod wire;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, Weak};
use std::time::Duration;

pub use cq::Cq;
pub use event_loop::loop_threads;
pub use qp::{configure_socket, PreparedQp, Qp};
pub use route::{Arrivals, Authenticated, Dialer, QpRoute};
pub use seal::WireKeys;

use super::memory::{Backing, MemoryRegion, MrInner, Registration as AnyRegistration};
use super::region::Access;
use super::types::QpCaps;

/// Settings of the tcp provider.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Address the listening sockets of queue pairs with a port of their own bind to.
    pub bind_ip: IpAddr,
    /// How long an incoming SEND waits for a RECV before failing (a NIC's RNR retry window).
    pub rnr_timeout: Duration,
    /// How long connecting a queue pair may take.
    pub connect_timeout: Duration,
    /// How long sent data may stay unacknowledged, or an idle peer silent, before the
    /// connection is declared dead (TCP_USER_TIMEOUT and keepalive).
    pub dead_peer_timeout: Duration,
    /// Queue pairs that post are served by the process's event loops too, instead of two
    /// threads each (passive ones always are): for a process with many of them, a storage
    /// node. Their completions always wake the poller (no inline consumer runs on a loop).
    pub served_by_loops: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            bind_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            rnr_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            dead_peer_timeout: Duration::from_secs(5),
            served_by_loops: false,
        }
    }
}

/// What a peer needs to connect to one of our queue pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// Where the queue pair listens for the peer's connection; port 0 where it has no port
    /// of its own (the peer dials the address it reached us at, or does not dial: see
    /// [`QpRoute`]).
    pub addr: SocketAddr,
    /// The queue pair's number.
    pub qpn: u32,
    /// Random per-QP secret that the dialing side must echo, so a stray connection to the
    /// listening port cannot become the queue pair.
    pub token: u64,
}

/// The opened tcp provider: its settings and the counters that number QPs and PDs.
pub struct Context {
    cfg: TcpConfig,
    next_qpn: AtomicU32,
    next_pd: AtomicU64,
}

impl Context {
    /// Opens the provider; nothing is bound until a queue pair is created.
    pub fn new(cfg: TcpConfig) -> Context {
        Context {
            cfg,
            next_qpn: AtomicU32::new(0x100),
            next_pd: AtomicU64::new(1),
        }
    }

    /// The settings the provider was opened with.
    pub fn config(&self) -> &TcpConfig {
        &self.cfg
    }

    /// A new protection domain with an empty rkey table.
    pub fn alloc_pd(&self) -> Pd {
        Pd {
            shared: Arc::new(PdShared {
                id: self.next_pd.fetch_add(1, Ordering::Relaxed),
                regions: RwLock::new(HashMap::new()),
                next_lkey: AtomicU32::new(1),
            }),
        }
    }

    /// A completion queue, shared by the queue pairs that complete into it.
    pub fn create_cq(&self, capacity: usize) -> std::io::Result<Arc<Cq>> {
        Cq::new(capacity).map(Arc::new)
    }

    /// A queue pair not yet connected, whose connection comes by `route`.
    pub fn create_qp(
        &self,
        pd: &Pd,
        cqs: (Arc<Cq>, Arc<Cq>),
        caps: QpCaps,
        route: &QpRoute,
    ) -> std::io::Result<PreparedQp> {
        let qpn = self.next_qpn.fetch_add(1, Ordering::Relaxed);
        PreparedQp::new(self.cfg.clone(), pd.shared.clone(), cqs, caps, qpn, route)
    }
}

/// A protection domain: the table the engines look rkeys up in.
pub struct Pd {
    shared: Arc<PdShared>,
}

pub(crate) struct PdShared {
    pub(crate) id: u64,
    regions: RwLock<HashMap<u32, Weak<MrInner>>>,
    next_lkey: AtomicU32,
}

impl PdShared {
    /// The live region an rkey names, as a NIC's MR table lookup.
    pub(crate) fn lookup(&self, rkey: u32) -> Option<Arc<MrInner>> {
        self.regions.read().unwrap().get(&rkey)?.upgrade()
    }

    /// Runs `f` (a copy into or out of `mr`) if `mr` is still registered, holding off its
    /// deregistration until `f` is done: once a region is deregistered, no engine touches it
    /// again, however long the transfer it was looked up for goes on (a NIC stops at once).
    pub(crate) fn while_registered<R>(
        &self,
        mr: &Arc<MrInner>,
        f: impl FnOnce() -> R,
    ) -> Option<R> {
        self.hold_registrations().contains(mr).then(f)
    }

    /// Holds off every deregistration in this domain while the guard lives, for an engine
    /// that touches several regions at once. Hold it only across calls that cannot block: a
    /// deregistration waits for it.
    pub(crate) fn hold_registrations(&self) -> Registrations<'_> {
        Registrations(self.regions.read().unwrap())
    }
}

/// The rkey table, held so that no region leaves it (see [`PdShared::hold_registrations`]).
pub(crate) struct Registrations<'a>(RwLockReadGuard<'a, HashMap<u32, Weak<MrInner>>>);

impl Registrations<'_> {
    /// Whether `mr` itself (not a later region under its rkey) is registered.
    pub(crate) fn contains(&self, mr: &Arc<MrInner>) -> bool {
        self.0
            .get(&mr.rkey)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(mr)))
    }
}

impl Pd {
    /// Identifies the domain; regions record it so that mixing domains is caught.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Registers `len` bytes at `addr` held by `backing`: pins them and enters them in the
    /// rkey table.
    pub(crate) fn register(
        &self,
        backing: Backing,
        addr: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, (std::io::Error, Backing)> {
        // A region within another is pinned by it (mlock does not nest: our munlock would
        // unpin the other's pages). External memory is another process's to pin or not: no
        // NIC reads it here, and mlock of a part of its mapping would split the mapping.
        let pin = len > 0 && !matches!(backing, Backing::Within { .. } | Backing::External { .. });
        // SAFETY: mlock only changes residency of pages we were handed; failure is harmless
        // (not enough RLIMIT_MEMLOCK), the region then works unpinned.
        let pinned = pin && unsafe { libc::mlock(addr as *const libc::c_void, len) } == 0;
        if pin && !pinned {
            log::debug!(
                "mlock of {len} bytes failed ({}); region stays unpinned",
                std::io::Error::last_os_error()
            );
        }
        let mut regions = self.shared.regions.write().unwrap();
        let rkey = loop {
            let k = crate::random::u64() as u32;
            if k != 0 && !regions.contains_key(&k) {
                break k;
            }
        };
        // lkeys are a different number space than rkeys, so that mixing them up fails.
        let lkey = self.shared.next_lkey.fetch_add(1, Ordering::Relaxed) | 0x8000_0000;
        let inner = Arc::new(MrInner {
            registration: Box::new(Registration {
                pd: self.shared.clone(),
                rkey,
                pinned: pinned.then_some((addr, len)),
            }),
            backing,
            addr,
            len,
            access,
            lkey,
            rkey,
            pd_id: self.shared.id,
        });
        regions.insert(rkey, Arc::downgrade(&inner));
        Ok(MemoryRegion { inner })
    }
}

/// Removes the rkey from the table (when the region is dropped, even while an engine still
/// holds it for a transfer under way) and unpins when the memory goes.
pub(crate) struct Registration {
    pd: Arc<PdShared>,
    rkey: u32,
    pinned: Option<(u64, usize)>,
}

impl AnyRegistration for Registration {
    /// Takes `inner` (this registration's region) out of the rkey table, waiting for copies
    /// under way ([`PdShared::while_registered`]).
    fn revoke(&self, inner: &MrInner) {
        let mut regions = self.pd.regions.write().unwrap();
        let ours = regions
            .get(&self.rkey)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), inner));
        if ours {
            regions.remove(&self.rkey);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Normally gone already (`revoke`); the key may since name another region.
        let mut regions = self.pd.regions.write().unwrap();
        if regions
            .get(&self.rkey)
            .is_some_and(|w| w.strong_count() == 0)
        {
            regions.remove(&self.rkey);
        }
        drop(regions);
        if let Some((addr, len)) = self.pinned {
            // SAFETY: undoes our own mlock of this range.
            unsafe { libc::munlock(addr as *const libc::c_void, len) };
        }
    }
}
