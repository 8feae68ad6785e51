//! Translation between the verbs model and libibverbs structs, kept free of device calls so it
//! is unit-tested on hosts without RDMA hardware.

use ibverbs_sys as ffi;

use crate::transport::memory::Sge;
use crate::transport::types::{Completion, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus};

fn sge(s: &Sge<'_>) -> ffi::ibv_sge {
    ffi::ibv_sge {
        addr: s.addr(),
        length: s.len() as u32,
        lkey: s.mr.lkey(),
    }
}

/// A chain of `ibv_send_wr` linked through `next`, with the SGE arrays they point into.
pub(crate) struct SendChain {
    wrs: Vec<ffi::ibv_send_wr>,
    sges: Vec<Vec<ffi::ibv_sge>>,
}

impl SendChain {
    /// Converts the chain (not yet linked: see [`SendChain::head`]).
    pub(crate) fn build(chain: &[SendWr<'_>]) -> SendChain {
        let sges: Vec<Vec<ffi::ibv_sge>> = chain
            .iter()
            .map(|wr| wr.sges.iter().map(sge).collect())
            .collect();
        let wrs = chain
            .iter()
            .map(|wr| {
                // SAFETY: ibv_send_wr is POD; all-zero is its documented initial state.
                let mut w: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
                w.wr_id = wr.wr_id;
                w.num_sge = wr.sges.len() as i32;
                let mut flags = 0;
                if wr.signaled {
                    flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                if wr.inline {
                    flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
                }
                w.send_flags = flags;
                let rdma = |w: &mut ffi::ibv_send_wr, addr: u64, rkey: u32| {
                    w.wr.rdma.remote_addr = addr;
                    w.wr.rdma.rkey = rkey;
                };
                match wr.op {
                    SendOp::Write(r) => {
                        w.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                        rdma(&mut w, r.addr, r.rkey);
                    }
                    SendOp::WriteWithImm(r, imm) => {
                        w.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                        rdma(&mut w, r.addr, r.rkey);
                        w.__bindgen_anon_1.imm_data = imm.to_be();
                    }
                    SendOp::Read(r) => {
                        w.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
                        rdma(&mut w, r.addr, r.rkey);
                    }
                    SendOp::Send => w.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND,
                    SendOp::SendWithImm(imm) => {
                        w.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                        w.__bindgen_anon_1.imm_data = imm.to_be();
                    }
                }
                w
            })
            .collect();
        SendChain { wrs, sges }
    }

    /// Links the requests and returns the first. The pointers stay valid while `self` lives
    /// and is not modified.
    pub(crate) fn head(&mut self) -> *mut ffi::ibv_send_wr {
        for (w, s) in self.wrs.iter_mut().zip(self.sges.iter_mut()) {
            w.sg_list = if s.is_empty() {
                std::ptr::null_mut()
            } else {
                s.as_mut_ptr()
            };
        }
        let base = self.wrs.as_mut_ptr();
        for i in 0..self.wrs.len().saturating_sub(1) {
            // SAFETY: i + 1 is within the vector.
            self.wrs[i].next = unsafe { base.add(i + 1) };
        }
        base
    }

    /// Position of `bad` (as returned by a failed post) in the chain; 0 when unknown.
    pub(crate) fn index_of(&self, bad: *mut ffi::ibv_send_wr) -> usize {
        self.wrs
            .iter()
            .position(|w| std::ptr::eq(w, bad))
            .unwrap_or(0)
    }
}

/// A chain of `ibv_recv_wr`, as [`SendChain`].
pub(crate) struct RecvChain {
    wrs: Vec<ffi::ibv_recv_wr>,
    sges: Vec<Vec<ffi::ibv_sge>>,
}

impl RecvChain {
    /// Converts the chain (not yet linked: see [`RecvChain::head`]).
    pub(crate) fn build(chain: &[RecvWr<'_>]) -> RecvChain {
        RecvChain {
            wrs: chain
                .iter()
                .map(|wr| ffi::ibv_recv_wr {
                    wr_id: wr.wr_id,
                    next: std::ptr::null_mut(),
                    sg_list: std::ptr::null_mut(),
                    num_sge: wr.sges.len() as i32,
                })
                .collect(),
            sges: chain
                .iter()
                .map(|wr| wr.sges.iter().map(sge).collect())
                .collect(),
        }
    }

    /// Links the requests and returns the first, as [`SendChain::head`].
    pub(crate) fn head(&mut self) -> *mut ffi::ibv_recv_wr {
        for (w, s) in self.wrs.iter_mut().zip(self.sges.iter_mut()) {
            w.sg_list = if s.is_empty() {
                std::ptr::null_mut()
            } else {
                s.as_mut_ptr()
            };
        }
        let base = self.wrs.as_mut_ptr();
        for i in 0..self.wrs.len().saturating_sub(1) {
            // SAFETY: i + 1 is within the vector.
            self.wrs[i].next = unsafe { base.add(i + 1) };
        }
        base
    }

    /// Position of `bad` (as returned by a failed post) in the chain; 0 when unknown.
    pub(crate) fn index_of(&self, bad: *mut ffi::ibv_recv_wr) -> usize {
        self.wrs
            .iter()
            .position(|w| std::ptr::eq(w, bad))
            .unwrap_or(0)
    }
}

/// The model's status for an `ibv_wc_status` value.
pub(crate) fn status_from_raw(s: u32) -> WcStatus {
    use ffi::ibv_wc_status as S;
    match s {
        S::IBV_WC_SUCCESS => WcStatus::Success,
        S::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLengthError,
        S::IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperationError,
        S::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtectionError,
        S::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushError,
        S::IBV_WC_BAD_RESP_ERR => WcStatus::BadResponse,
        S::IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalAccessError,
        S::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequest,
        S::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccessError,
        S::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperationError,
        S::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        S::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        other => WcStatus::Other(other),
    }
}

/// The model's opcode for an `ibv_wc_opcode` value.
pub(crate) fn opcode_from_raw(op: u32) -> WcOpcode {
    use ffi::ibv_wc_opcode as O;
    match op {
        O::IBV_WC_SEND => WcOpcode::Send,
        O::IBV_WC_RDMA_WRITE => WcOpcode::Write,
        O::IBV_WC_RDMA_READ => WcOpcode::Read,
        O::IBV_WC_RECV => WcOpcode::Recv,
        O::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvWithImm,
        other => WcOpcode::Other(other),
    }
}

/// The model's completion for an `ibv_wc`; a receive that carried an immediate is reported as
/// [`WcOpcode::RecvWithImm`] whatever the device's opcode says.
pub fn completion_from_wc(wc: &ffi::ibv_wc) -> Completion {
    let status = match wc.error() {
        None => WcStatus::Success,
        Some((s, _vendor)) => status_from_raw(s),
    };
    let mut opcode = opcode_from_raw(wc.opcode());
    let imm = wc.imm_data().map(u32::from_be);
    if opcode == WcOpcode::Recv && imm.is_some() {
        opcode = WcOpcode::RecvWithImm;
    }
    Completion {
        wr_id: wc.wr_id(),
        status,
        opcode,
        byte_len: wc.len() as u32,
        imm,
        qp_num: wc.qp_num,
    }
}

/// The model's state for an `ibv_qp_state` value.
pub fn qp_state_from_raw(s: u32) -> QpState {
    use ffi::ibv_qp_state as Q;
    match s {
        Q::IBV_QPS_RESET => QpState::Reset,
        Q::IBV_QPS_INIT => QpState::Init,
        Q::IBV_QPS_RTR => QpState::ReadyToReceive,
        Q::IBV_QPS_RTS => QpState::ReadyToSend,
        Q::IBV_QPS_ERR => QpState::Error,
        other => QpState::Other(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Access, Context, ProviderKind, RemoteAddr, TransportConfig};

    fn region() -> (Context, crate::transport::MemoryRegion) {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.alloc_region(8192, Access::ALL).unwrap();
        (ctx, mr)
    }

    #[test]
    fn send_chain_is_linked_with_opcodes_flags_and_sges() {
        let (_ctx, mr) = region();
        let a = [mr.slice(0, 100).unwrap(), mr.slice(4096, 100).unwrap()];
        let b = [mr.slice(200, 32).unwrap()];
        let r = RemoteAddr {
            addr: 0x1000,
            rkey: 0x42,
        };
        let chain = [
            SendWr::new(1, SendOp::Write(r), &a).unsignaled(),
            SendWr::new(2, SendOp::WriteWithImm(r, 0x0102_0304), &b).inline(),
            SendWr::new(3, SendOp::Read(r), &a),
            SendWr::new(4, SendOp::Send, &[]),
        ];
        let mut built = SendChain::build(&chain);
        let head = built.head();
        // SAFETY: walking the chain just built; it lives in `built`.
        unsafe {
            let w0 = &*head;
            assert_eq!(w0.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE);
            assert_eq!(w0.send_flags, 0);
            assert_eq!(w0.num_sge, 2);
            assert_eq!((*w0.sg_list.add(1)).addr, mr.addr() + 4096);
            assert_eq!((*w0.sg_list).lkey, mr.lkey());
            assert_eq!(w0.wr.rdma.rkey, 0x42);
            let w1 = &*w0.next;
            assert_eq!(w1.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
            assert_eq!(
                w1.send_flags,
                (ffi::ibv_send_flags::IBV_SEND_SIGNALED | ffi::ibv_send_flags::IBV_SEND_INLINE).0
            );
            assert_eq!(w1.__bindgen_anon_1.imm_data, 0x0102_0304u32.to_be());
            let w2 = &*w1.next;
            assert_eq!(w2.opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_READ);
            let w3 = &*w2.next;
            assert_eq!(w3.opcode, ffi::ibv_wr_opcode::IBV_WR_SEND);
            assert!(w3.sg_list.is_null());
            assert!(w3.next.is_null());
            assert_eq!(w3.wr_id, 4);
        }
    }

    #[test]
    fn recv_chain_is_linked() {
        let (_ctx, mr) = region();
        let s = [mr.slice(0, 64).unwrap()];
        let chain = [RecvWr { wr_id: 7, sges: &s }, RecvWr { wr_id: 8, sges: &s }];
        let mut built = RecvChain::build(&chain);
        let head = built.head();
        // SAFETY: as above.
        unsafe {
            assert_eq!((*head).wr_id, 7);
            assert_eq!((*(*head).next).wr_id, 8);
            assert_eq!((*(*head).sg_list).length, 64);
            assert!((*(*head).next).next.is_null());
        }
    }

    #[test]
    fn statuses_and_states_map() {
        use ffi::ibv_wc_status as S;
        assert_eq!(status_from_raw(S::IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(
            status_from_raw(S::IBV_WC_REM_ACCESS_ERR),
            WcStatus::RemoteAccessError
        );
        assert_eq!(
            status_from_raw(S::IBV_WC_WR_FLUSH_ERR),
            WcStatus::WrFlushError
        );
        assert_eq!(status_from_raw(9999), WcStatus::Other(9999));
        assert_eq!(
            opcode_from_raw(ffi::ibv_wc_opcode::IBV_WC_RDMA_READ),
            WcOpcode::Read
        );
        assert_eq!(
            qp_state_from_raw(ffi::ibv_qp_state::IBV_QPS_ERR),
            QpState::Error
        );
    }

    #[test]
    fn no_kernel_support_means_no_devices() {
        // On hosts without RDMA this is the ENOSYS path; with a device it lists it. Either way
        // it must not be an error.
        let names = super::super::device_names().expect("listing devices never fails here");
        let sysfs = std::path::Path::new("/sys/class/infiniband");
        if !sysfs.exists() {
            assert!(names.is_empty());
        }
    }
}
