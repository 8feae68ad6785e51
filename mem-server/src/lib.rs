//! rfs storage node: lends a registered memory pool for one-sided I/O and, on the first node,
//! runs the metadata service (namespace, chunk maps, chunk allocation across nodes).
//!
//! - [`server`]: the node (pool, listener, connection roles, join, zeroing).
//! - [`namespace`]: POSIX namespace semantics, pure.
//! - [`alloc`]: chunk allocation across nodes.
//! - [`proto`]: every message, with its validation.
//! - [`auth`]: shared-secret challenge-response.
//! - [`client`]: the client library (metadata RPCs, data sessions).

pub mod alloc;
pub mod auth;
pub mod client;
pub mod namespace;
pub mod proto;
pub mod server;
