//! What both rfs daemons (`mem-server`, `fs-client`) share around the protocol:
//!
//! - [`logging`]: where they log: stderr, a file, or syslog.
//! - [`metrics`]: their counters for Prometheus, over HTTP.
//! - [`secret`]: where the shared secret lives, created by the first node.
//! - [`patience`]: trying to reach a node for a bounded time at start-up.
//! - [`backoff`]: pauses between tries that grow to a bound.

pub mod backoff;
pub mod logging;
pub mod metrics;
pub mod patience;
pub mod secret;
