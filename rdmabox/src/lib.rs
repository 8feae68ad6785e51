//! rdmabox: an RDMABox-style RDMA core.
//!
//! - [`transport`]: the verbs model with its two providers (libibverbs and software tcp), and
//!   queue-pair setup over a control connection ([`connect_queue_pairs`]); the "vanilla verbs" layer,
//!   usable on its own.
//! - [`session`]: the request API over one peer's connected queue pairs, on top of the mechanisms
//!   below; split into the API, submission (admission, staging, posting) and completion (the
//!   poller threads).
//! - [`merge_queue`]: the shared read and write queues and their first-thread-drains protocol.
//! - [`batching`]: merging-on-MR and doorbell chaining decisions.
//! - [`mr_pool`]: preMR staging buffers (dynMR is registration of the caller's buffer).
//! - [`window`]: admission control by in-flight bytes, with pluggable policies.
//! - [`poller`]: busy, event, event-batch and adaptive completion polling, and the poll loop that
//!   the session's pollers and the RPC pumps share.
//! - [`counters`]: live counters and snapshots.
//! - [`epoll`]: an epoll set, for threads that each watch many sockets.
//! - [`rpc`]: request/response messaging over SEND/RECV, for control and metadata.
//! - [`random`] and [`size`]: kernel random bytes (keys, tokens, nonces) and "64K"-style sizes.

#![warn(missing_docs)]

pub mod batching;
pub mod counters;
pub mod epoll;
pub mod merge_queue;
pub mod mr_pool;
pub mod poller;
pub mod random;
pub mod rpc;
pub mod session;
pub mod size;
pub mod transport;
pub mod window;
pub mod workers;

pub use counters::Snapshot;
pub use poller::PollMode;
pub use session::{
    AbortHandle, IoError, KeepingCallback, LandedCallback, Pending, Session, SessionConfig,
};
pub use transport::connect_queue_pairs;
pub use window::WindowConfig;
