//! rdmabox: an RDMABox-style RDMA core.
//!
//! [`transport`] is the verbs model with its two providers (libibverbs and software tcp).

pub mod transport;
