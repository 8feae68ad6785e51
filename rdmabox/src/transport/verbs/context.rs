//! A device context: opening a device by name, its port and GID, and the objects made from it.

use super::*;

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

pub(super) struct CtxInner {
    pub(super) ctx: *mut ffi::ibv_context,
    name: String,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    pub(super) gid: [u8; 16],
    pub(super) lid: u16,
    pub(super) mtu: u8,
    pub(super) ack: AckTimeout,
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
    pub(super) inner: Arc<CtxInner>,
}

pub(super) fn os_err(what: &str) -> io::Error {
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
