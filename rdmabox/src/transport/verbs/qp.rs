//! Queue pairs: creation, the INIT -> RTR -> RTS transitions, and posting work requests.

use super::*;

/// A connected RC queue pair on the device.
pub struct Qp {
    pub(super) qp: *mut ffi::ibv_qp,
    pub(super) caps: QpCaps,
    pub(super) ctx: Arc<CtxInner>,
    // `Drop` destroys the QP before these fields release its PD and CQs.
    pub(super) _pd: Arc<PdInner>,
    pub(super) _send_cq: Arc<Cq>,
    pub(super) _recv_cq: Arc<Cq>,
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
    pub(super) qp: Qp,
    pub(super) psn: u32,
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
    pub(super) fn to_init(&self) -> io::Result<()> {
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
        crate::transport::types::check_send_chain(chain, &self.caps)?;
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
        crate::transport::types::check_recv_chain(chain, &self.caps)?;
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
