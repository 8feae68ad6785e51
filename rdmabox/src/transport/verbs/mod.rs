//! The `verbs` provider: real RDMA hardware (or Soft-RoCE) through libibverbs.
//!
//! The `ibverbs` crate's safe API has no READ/WRITE, chains or CQ events, so this module uses the
//! raw `ibverbs-sys` bindings behind owning types: each verbs object is destroyed in `Drop`, and
//! children hold their parents (QP -> PD, CQ -> context), so destruction order is always legal.
//! The inline C functions (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`) are reached
//! through the context's ops table, as `verbs.h` does.

mod context;
mod convert;
mod cq;
mod pd;
mod qp;

use std::ffi::CStr;
use std::io;
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use super::memory::{Backing, MemoryRegion, MrInner, Registration as AnyRegistration};
use super::region::Access;
use super::types::{Completion, PostError, QpCaps, QpState, RecvWr, SendWr};
pub use context::{device_names, Context};
use context::{os_err, CtxInner};
pub use convert::{completion_from_wc, qp_state_from_raw};
pub use cq::Cq;
pub use pd::Pd;
use pd::PdInner;
pub use qp::{PreparedQp, Qp};

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
