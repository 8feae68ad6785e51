//! rfs storage node: lends a registered memory pool for one-sided I/O and, on the first node,
//! runs the metadata service (namespace, chunk maps, chunk allocation across nodes). The
//! protocol it speaks lives in `rfs-proto`.
//!
//! - [`node`]: the node (listener, connection roles, data sessions); [`hangups`]: one thread
//!   that ends the data sessions whose clients go.
//! - [`runtime`]: what the node and the metadata service share (configuration, transport,
//!   pool, grants, queue-pair setup); [`config`]: the node's configuration.
//! - [`meta`]: the metadata service: one RPC channel per client, operations by family, grant
//!   channels, freeing, recovery, coherence, sessions, repair and the zeroer.
//! - [`in_process`]: the metadata service in process, for tests.
//! - [`namespace`]: POSIX namespace semantics, pure.
//! - [`meta::lock_table`]: every client's file locks.
//! - [`access`]: permission checks of the metadata service (mode bits, ACLs, root squash);
//!   [`acl`]: POSIX ACLs, as Linux keeps and evaluates them.
//! - [`admission`]: limits on connections, in total and per peer.
//! - [`alloc`]: chunk allocation across nodes, each node's free space as [`extents`].
//! - [`join`]: data nodes joining the metadata node, both halves.
//! - [`grants`]: what each data session may reach of a node's pool; [`grant_channel`]: how the
//!   metadata node says so.
//! - [`journal`]: the state directory (journal of [`record`]s, snapshots, replay).

pub mod access;
pub mod acl;
pub mod admission;
pub mod alloc;
pub mod config;
mod extents;
mod grant_channel;
mod grants;
mod hangups;
pub mod in_process;
mod join;
pub mod journal;
mod leave;
mod meta;
pub mod namespace;
pub mod node;
pub mod record;
mod runtime;
pub mod spans;
