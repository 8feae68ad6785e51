//! The `verbs` provider: real RDMA hardware (or Soft-RoCE) through libibverbs.
//!
//! The `ibverbs` crate's safe API has no READ/WRITE, chains or CQ events, so this module uses the
//! raw `ibverbs-sys` bindings behind owning types: each verbs object is destroyed in `Drop`, and
//! children hold their parents (QP -> PD, CQ -> context), so destruction order is always legal.
//! The inline C functions (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`) are reached
//! through the context's ops table, as `verbs.h` does.

mod convert;

use std::ffi::CStr;
use std::io;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use super::memory::{Backing, MemoryRegion, MrInner, Registration as AnyRegistration};
use super::types::{Access, Completion, PostError, QpCaps, QpState, RecvWr, SendWr};
pub use convert::{completion_from_wc, qp_state_from_raw};

/// What a peer needs to connect to one of our queue pairs (the fields of `ibv_qp_attr` that
/// RTR takes from the remote side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerbsEndpoint {
    /// The queue pair's number.
    pub qpn: u32,
    /// The first packet sequence number it sends (24 bits).
    pub psn: u32,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's GID at the chosen index (RoCE: the IP address, as a GID).
    pub gid: [u8; 16],
    /// `ibv_mtu` enum value (1 = 256 ... 5 = 4096).
    pub mtu: u8,
}

/// Settings of the verbs provider.
#[derive(Clone, Debug)]
pub struct VerbsConfig {
    /// The device to open (default: the first).
    pub device: Option<String>,
    /// The GID index (default: the last RoCE v2 GID, or 0 on InfiniBand).
    pub gid_index: Option<u8>,
    /// How long a request may go unacknowledged, retries included, before the NIC fails it
    /// with a retry-exceeded error: the queue pairs' ACK timeout and retry count follow from
    /// it (see [`AckTimeout`]).
    pub dead_peer_timeout: Duration,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            gid_index: None,
            dead_peer_timeout: Duration::from_secs(5),
        }
    }
}

/// The RC transport's retry settings: `retry_cnt` resends, each after `4.096 us * 2^exponent`
/// without an ACK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckTimeout {
    /// `ibv_qp_attr.timeout`.
    pub exponent: u8,
    /// `ibv_qp_attr.retry_cnt`.
    pub retry_cnt: u8,
}

impl AckTimeout {
    /// Six retries, never seven: 7 means "retry forever" to some providers (Soft-RoCE), so a
    /// dead peer would hang requests for good. The exponent is the largest whose seven tries
    /// fit in `total` (at least 1: 8 us per try).
    pub fn within(total: Duration) -> AckTimeout {
        const RETRY_CNT: u8 = 6;
        let per_try_ns = total.as_nanos() / (RETRY_CNT as u128 + 1);
        let units = per_try_ns / 4096;
        let exponent = (u128::BITS - 1).saturating_sub(units.max(1).leading_zeros()) as u8;
        AckTimeout {
            exponent: exponent.clamp(1, 31),
            retry_cnt: RETRY_CNT,
        }
    }

    /// The longest a request waits for its ACK, every try included.
    pub fn total(&self) -> Duration {
        Duration::from_nanos(4096 << self.exponent) * (self.retry_cnt as u32 + 1)
    }
}

/// Names of the RDMA devices present. A kernel without RDMA support answers ENOSYS, which
/// means "no devices", not an error.
pub fn device_names() -> io::Result<Vec<String>> {
    let mut n = 0i32;
    // SAFETY: plain call; the list is freed below and names are copied out before that.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::ENOENT) | Some(libc::ENODEV) => Ok(Vec::new()),
            _ => Err(e),
        };
    }
    let names = (0..n.max(0) as usize)
        // SAFETY: `list` holds `n` valid device pointers until freed.
        .map(|i| unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) })
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    // SAFETY: freeing the list we got; no device pointer from it is kept.
    unsafe { ffi::ibv_free_device_list(list) };
    Ok(names)
}

struct CtxInner {
    ctx: *mut ffi::ibv_context,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    mtu: u8,
    ack: AckTimeout,
}

// SAFETY: an ibv_context is thread-safe per the libibverbs documentation; we only read the
// other fields after construction.
unsafe impl Send for CtxInner {}
// SAFETY: see Send.
unsafe impl Sync for CtxInner {}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // SAFETY: every child object holds an Arc to us, so none is alive any more.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

/// An opened RDMA device, with the port, GID and MTU its queue pairs use.
pub struct Context {
    inner: Arc<CtxInner>,
}

fn os_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The GID index to use on `port`: for RoCE the last non-zero RoCE v2 entry among the first 16
/// (what rdma-core's tools pick), for InfiniBand 0.
fn default_gid_index(device: &str, port: u8) -> u8 {
    let base = format!("/sys/class/infiniband/{device}/ports/{port}");
    let mut best = 0;
    for i in 0..16u8 {
        let gid = std::fs::read_to_string(format!("{base}/gids/{i}")).unwrap_or_default();
        let ty = std::fs::read_to_string(format!("{base}/gid_attrs/types/{i}")).unwrap_or_default();
        if ty.trim() == "RoCE v2" && !gid.trim().chars().all(|c| c == '0' || c == ':') {
            best = i;
        }
    }
    best
}

impl Context {
    /// Opens `cfg.device` (or the first device) on port 1. Ok(None) when there is no device.
    pub fn open(cfg: &VerbsConfig) -> io::Result<Option<Context>> {
        let device = cfg.device.as_deref();
        let mut n = 0i32;
        // SAFETY: as in `device_names`.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: freeing our own list.
                unsafe { ffi::ibv_free_device_list(list) };
            }
            return Ok(None);
        }
        let mut chosen = None;
        for i in 0..n as usize {
            // SAFETY: `list` holds `n` valid devices.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a valid device has a NUL-terminated name.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if device.is_none_or(|d| d == name) {
                chosen = Some((dev, name));
                break;
            }
        }
        let Some((dev, name)) = chosen else {
            // SAFETY: freeing our own list.
            unsafe { ffi::ibv_free_device_list(list) };
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("RDMA device {device:?} not found"),
            ));
        };
        // SAFETY: `dev` comes from the live list; the context stays valid after the list is freed.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        // SAFETY: freeing our own list; only the opened context is kept.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(os_err(&format!("ibv_open_device({name})")));
        }
        let port = 1u8;
        // SAFETY: zeroed POD out-parameter; ibv_query_port fills the (compat) prefix of it.
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        if unsafe { ffi::ibv_query_port(ctx, port, (&mut attr as *mut ffi::ibv_port_attr).cast()) }
            != 0
        {
            let e = os_err("ibv_query_port");
            // SAFETY: closing the context we just opened.
            unsafe { ffi::ibv_close_device(ctx) };
            return Err(e);
        }
        let gid_index = cfg
            .gid_index
            .unwrap_or_else(|| default_gid_index(&name, port));
        // SAFETY: zeroed POD union.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        if unsafe { ffi::ibv_query_gid(ctx, port, gid_index as i32, &mut gid) } != 0 {
            let e = os_err("ibv_query_gid");
            // SAFETY: closing the context we just opened.
            unsafe { ffi::ibv_close_device(ctx) };
            return Err(e);
        }
        let inner = CtxInner {
            ctx,
            name,
            port,
            gid_index,
            // SAFETY: every bit pattern of the union is a valid byte array.
            gid: unsafe { gid.raw },
            lid: attr.lid,
            mtu: attr.active_mtu.clamp(1, 5) as u8,
            ack: AckTimeout::within(cfg.dead_peer_timeout),
        };
        log::info!(
            "verbs: device {} port {} gid index {} lid {} mtu {}, a silent peer fails requests \
             after {:?}",
            inner.name,
            port,
            gid_index,
            inner.lid,
            128u32 << inner.mtu,
            inner.ack.total()
        );
        Ok(Some(Context {
            inner: Arc::new(inner),
        }))
    }

    /// The device's name, e.g. `mlx5_0` or `rxe0`.
    pub fn device_name(&self) -> &str {
        &self.inner.name
    }

    /// A new protection domain on the device.
    pub fn alloc_pd(&self) -> io::Result<Pd> {
        // SAFETY: the context is open for as long as `self.inner` lives (closed only in its Drop).
        let pd = unsafe { ffi::ibv_alloc_pd(self.inner.ctx) };
        if pd.is_null() {
            return Err(os_err("ibv_alloc_pd"));
        }
        Ok(Pd {
            inner: Arc::new(PdInner {
                pd,
                _ctx: self.inner.clone(),
            }),
        })
    }

    /// A completion queue with its own (non-blocking) completion channel for events.
    pub fn create_cq(&self, capacity: usize) -> io::Result<Arc<Cq>> {
        // SAFETY: the context is open for as long as `self.inner` lives (closed only in its Drop).
        let channel = unsafe { ffi::ibv_create_comp_channel(self.inner.ctx) };
        if channel.is_null() {
            return Err(os_err("ibv_create_comp_channel"));
        }
        // SAFETY: the channel's fd is ours to configure; non-blocking so that
        // ibv_get_cq_event never blocks after our own poll(2) wait.
        unsafe {
            let fd = (*channel).fd;
            let flags = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        let cqe = capacity.clamp(1, i32::MAX as usize) as i32;
        // SAFETY: valid context and channel.
        let cq = unsafe { ffi::ibv_create_cq(self.inner.ctx, cqe, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = os_err("ibv_create_cq");
            // SAFETY: destroying the channel we just made; no CQ uses it.
            unsafe { ffi::ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        Ok(Arc::new(Cq {
            cq,
            channel,
            _ctx: self.inner.clone(),
        }))
    }

    /// An RC queue pair, moved to INIT, with a random starting PSN; connect it next.
    pub fn create_qp(
        &self,
        pd: &Pd,
        send_cq: Arc<Cq>,
        recv_cq: Arc<Cq>,
        caps: QpCaps,
    ) -> io::Result<PreparedQp> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.cq,
            recv_cq: recv_cq.cq,
            srq: ptr::null_mut(),
            // A responder-only queue pair still gets queues of one entry: not every NIC takes
            // a queue pair without them, and a NIC answers READs and WRITEs by itself anyway.
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr.max(1),
                max_recv_wr: caps.max_recv_wr.max(1),
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and CQs (kept alive by the Arcs stored below).
        let qp = unsafe { ffi::ibv_create_qp(pd.inner.pd, &mut init) };
        if qp.is_null() {
            return Err(os_err("ibv_create_qp"));
        }
        let granted = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        let prepared = PreparedQp {
            qp: Qp {
                qp,
                caps: granted,
                _pd: pd.inner.clone(),
                _send_cq: send_cq,
                _recv_cq: recv_cq,
                ctx: self.inner.clone(),
            },
            psn: (crate::random::u64() as u32) & 0x00ff_ffff,
        };
        prepared.to_init()?;
        Ok(prepared)
    }
}

struct PdInner {
    pd: *mut ffi::ibv_pd,
    _ctx: Arc<CtxInner>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for PdInner {}
// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc to us, so none is alive any more.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A protection domain on the device.
pub struct Pd {
    inner: Arc<PdInner>,
}

impl Pd {
    /// Registers `len` bytes at `addr` that `backing` keeps alive.
    pub(crate) fn register(
        &self,
        backing: Backing,
        addr: u64,
        len: usize,
        access: Access,
        pd_id: u64,
    ) -> Result<MemoryRegion, (io::Error, Backing)> {
        // SAFETY: the caller guarantees addr..addr+len is memory that outlives the MR.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.inner.pd,
                addr as *mut libc::c_void,
                len,
                access.bits() as i32,
            )
        };
        if mr.is_null() {
            return Err((os_err(&format!("ibv_reg_mr({len} bytes)")), backing));
        }
        // SAFETY: a registered MR's keys are plain fields.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                registration: AnyRegistration::Verbs(Registration {
                    mr,
                    _pd: self.inner.clone(),
                }),
                backing,
                addr,
                len,
                access,
                lkey,
                rkey,
                pd_id,
            }),
        })
    }
}

pub(crate) struct Registration {
    mr: *mut ffi::ibv_mr,
    _pd: Arc<PdInner>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Registration {}
// SAFETY: see Send.
unsafe impl Sync for Registration {}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: the MR is ours and deregistered once.
        if unsafe { ffi::ibv_dereg_mr(self.mr) } != 0 {
            log::error!("ibv_dereg_mr: {}", io::Error::last_os_error());
        }
    }
}

/// A device completion queue and its completion channel.
pub struct Cq {
    cq: *mut ffi::ibv_cq,
    channel: *mut ffi::ibv_comp_channel,
    _ctx: Arc<CtxInner>,
}

// SAFETY: a CQ may be polled from any thread; concurrent pollers are serialized by the
// provider library's own CQ lock.
unsafe impl Send for Cq {}
// SAFETY: see Send.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so none is alive; every event was
        // acknowledged in `wait_event`.
        unsafe {
            ffi::ibv_destroy_cq(self.cq);
            ffi::ibv_destroy_comp_channel(self.channel);
        }
    }
}

impl Cq {
    /// Moves up to `out.len()` completions into `out`, 32 per `ibv_poll_cq`; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> io::Result<usize> {
        const BATCH: usize = 32;
        let mut wc = [ffi::ibv_wc::default(); BATCH];
        let mut total = 0;
        while total < out.len() {
            let want = (out.len() - total).min(BATCH);
            // SAFETY: valid CQ; `wc` has room for `want` entries.
            let n = unsafe {
                (*(*self.cq).context).ops.poll_cq.expect("poll_cq op")(
                    self.cq,
                    want as i32,
                    wc.as_mut_ptr(),
                )
            };
            if n < 0 {
                return Err(io::Error::other(format!("ibv_poll_cq returned {n}")));
            }
            for (slot, w) in out[total..].iter_mut().zip(&wc[..n as usize]) {
                *slot = completion_from_wc(w);
            }
            total += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        Ok(total)
    }

    /// Requests an event at the next completion (`ibv_req_notify_cq`, any completion).
    pub fn arm(&self) -> io::Result<()> {
        // SAFETY: the CQ lives as long as `self`; req_notify_cq is the context's own op for it.
        let rc = unsafe {
            (*(*self.cq).context)
                .ops
                .req_notify_cq
                .expect("req_notify_cq op")(self.cq, 0)
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// The completion channel's descriptor, readable when an event is pending.
    pub fn event_fd(&self) -> i32 {
        // SAFETY: the channel lives as long as self.
        unsafe { (*self.channel).fd }
    }

    /// Waits for an event (true, taken and acknowledged) or `timeout` (false).
    pub fn wait_event(&self, timeout: Option<Duration>) -> io::Result<bool> {
        if !super::poll_readable(self.event_fd(), timeout)? {
            return Ok(false);
        }
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        // SAFETY: valid channel; the fd is non-blocking, so this returns at once.
        if unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } != 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(false)
            } else {
                Err(e)
            };
        }
        // SAFETY: acknowledging the one event just received on our own CQ.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

/// A connected RC queue pair on the device.
pub struct Qp {
    qp: *mut ffi::ibv_qp,
    caps: QpCaps,
    ctx: Arc<CtxInner>,
    // `Drop` destroys the QP before these fields release its PD and CQs.
    _pd: Arc<PdInner>,
    _send_cq: Arc<Cq>,
    _recv_cq: Arc<Cq>,
}

// SAFETY: posting to a QP from several threads is allowed; the provider library locks its
// work queues.
unsafe impl Send for Qp {}
// SAFETY: see Send.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP is ours and destroyed once, before its PD and CQs (held in fields).
        unsafe { ffi::ibv_destroy_qp(self.qp) };
    }
}

/// A queue pair in INIT, waiting for its peer's endpoint.
pub struct PreparedQp {
    qp: Qp,
    psn: u32,
}

fn modify(
    qp: *mut ffi::ibv_qp,
    attr: &mut ffi::ibv_qp_attr,
    mask: ffi::ibv_qp_attr_mask,
) -> io::Result<()> {
    // SAFETY: valid QP and attribute struct; the mask names only fields we set.
    let rc = unsafe { ffi::ibv_modify_qp(qp, attr, mask.0 as i32) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

impl PreparedQp {
    fn to_init(&self) -> io::Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: ibv_qp_attr is plain C data, for which all-zero bytes are a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = self.qp.ctx.port;
        a.qp_access_flags = Access::ALL.bits();
        modify(
            self.qp.qp,
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
        )
        .map_err(|e| io::Error::new(e.kind(), format!("QP to INIT: {e}")))
    }

    /// The queue pair's number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is live until `self.qp` drops; qp_num is a plain field.
        unsafe { (*self.qp.qp).qp_num }
    }

    /// What the peer needs to connect: our QPN, PSN and port address.
    pub fn endpoint(&self) -> VerbsEndpoint {
        VerbsEndpoint {
            qpn: self.qp_num(),
            psn: self.psn,
            lid: self.qp.ctx.lid,
            gid: self.qp.ctx.gid,
            mtu: self.qp.ctx.mtu,
        }
    }

    /// INIT -> RTR -> RTS against the peer's endpoint.
    pub fn connect(self, remote: &VerbsEndpoint) -> io::Result<Qp> {
        use ffi::ibv_qp_attr_mask as M;
        let ctx = &self.qp.ctx;
        // SAFETY: ibv_qp_attr is plain C data, for which all-zero bytes are a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ctx.mtu.min(remote.mtu).max(1) as ffi::ibv_mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = ctx.port;
        a.ah_attr.dlid = remote.lid;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = ctx.gid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        modify(
            self.qp.qp,
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )
        .map_err(|e| io::Error::new(e.kind(), format!("QP to RTR: {e}")))?;
        // SAFETY: ibv_qp_attr is plain C data, for which all-zero bytes are a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        let ack = self.qp.ctx.ack;
        a.timeout = ack.exponent;
        a.retry_cnt = ack.retry_cnt;
        // Receiver-not-ready is answered by a live peer, so retrying it forever cannot hang on
        // a dead one; the RPC layer bounds its own waits.
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 16;
        modify(
            self.qp.qp,
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
        .map_err(|e| io::Error::new(e.kind(), format!("QP to RTS: {e}")))?;
        Ok(self.qp)
    }
}

impl Qp {
    /// The queue pair's number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is live until `self` drops; qp_num is a plain field.
        unsafe { (*self.qp).qp_num }
    }

    /// The queue sizes the device granted.
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The state the device reports (`Other(u32::MAX)` if the query fails).
    pub fn state(&self) -> QpState {
        // SAFETY: plain C data out-parameter, for which all-zero bytes are a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: plain C data out-parameter, for which all-zero bytes are a valid value.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid QP and out-pointers.
        let rc = unsafe {
            ffi::ibv_query_qp(
                self.qp,
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        if rc != 0 {
            return QpState::Other(u32::MAX);
        }
        qp_state_from_raw(attr.qp_state)
    }

    /// Moves the QP to ERR, so that everything outstanding is flushed.
    pub fn set_error(&self) {
        // SAFETY: ibv_qp_attr is plain C data, for which all-zero bytes are a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        if let Err(e) = modify(self.qp, &mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE) {
            log::error!("QP {} to ERR: {e}", self.qp_num());
        }
    }

    /// Posts the chain as one linked `ibv_send_wr` list: one doorbell.
    pub fn post_send(&self, chain: &[SendWr<'_>]) -> Result<(), PostError> {
        super::types::check_send_chain(chain, &self.caps)?;
        if chain.is_empty() {
            return Ok(());
        }
        let mut built = convert::SendChain::build(chain);
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the chain's WRs and SGE arrays live in `built` for the call.
        let rc = unsafe {
            (*(*self.qp).context).ops.post_send.expect("post_send op")(
                self.qp,
                built.head(),
                &mut bad,
            )
        };
        post_result(rc, built.index_of(bad))
    }

    /// Posts the receives as one linked `ibv_recv_wr` list.
    pub fn post_recv(&self, chain: &[RecvWr<'_>]) -> Result<(), PostError> {
        super::types::check_recv_chain(chain, &self.caps)?;
        if chain.is_empty() {
            return Ok(());
        }
        let mut built = convert::RecvChain::build(chain);
        let mut bad = ptr::null_mut();
        // SAFETY: as in post_send.
        let rc = unsafe {
            (*(*self.qp).context).ops.post_recv.expect("post_recv op")(
                self.qp,
                built.head(),
                &mut bad,
            )
        };
        post_result(rc, built.index_of(bad))
    }
}

/// `posted`: the index of `bad_wr`, i.e. how many requests before it went out.
fn post_result(rc: i32, posted: usize) -> Result<(), PostError> {
    match rc {
        0 => Ok(()),
        libc::ENOMEM => Err(PostError::QueueFull { posted }),
        rc => Err(PostError::Os {
            posted,
            error: io::Error::from_raw_os_error(rc),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_timeouts_fit_the_deadline_and_never_retry_forever() {
        for secs in [1, 2, 5, 10, 60] {
            let total = Duration::from_secs(secs);
            let a = AckTimeout::within(total);
            assert_eq!(a.retry_cnt, 6, "7 retries forever on Soft-RoCE");
            assert!(a.total() <= total, "{a:?} over {total:?}");
            let doubled = AckTimeout {
                exponent: a.exponent + 1,
                ..a
            };
            assert!(doubled.total() > total, "{a:?}: the largest that fits");
        }
        assert_eq!(AckTimeout::within(Duration::from_secs(5)).exponent, 17);
        assert_eq!(AckTimeout::within(Duration::ZERO).exponent, 1);
        assert_eq!(
            AckTimeout::within(Duration::from_secs(1 << 40)).exponent,
            31
        );
    }
}
