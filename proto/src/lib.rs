//! The rfs protocol, shared by clients and nodes: what crosses the wire and how each
//! connection is set up. The client runtime over it is `rfs-client`; what both daemons share
//! around it (logging, metrics, the secret file) is `rfs-daemon`.
//!
//! - [`wire`]: the encoding, with one field list per message for both directions.
//! - [`types`]: what both sides talk about: attributes, chunk references, nodes.
//! - [`errno`]: the one error number type.
//! - [`message`]: metadata requests, each tied to the type of its reply, in an envelope.
//! - [`call`]: a metadata call and its typed answer, whatever carries it.
//! - [`clock`]: call deadlines the service holds without synchronized clocks.
//! - [`hello`]: what a control connection is for; the pool descriptor.
//! - [`frame`]: length-prefixed frames on control connections.
//! - [`handshake`]: shared-secret authentication, and dialing a node.
//! - [`session_key`]: the key each connection derives in its handshake.
//! - [`integrity`]: MACs by the connection's session key on every frame after the handshake.
//! - [`grant`]: what a data node lets each data session reach, as the metadata node says.
//! - [`callback`]: what the metadata service tells clients whose caches a change concerns.
//! - [`locks`]: byte-range file locks, held at the metadata node for every client.
//! - [`data`]: dialing a data session: a node's queue pairs and the pool it lends.

pub mod call;
pub mod callback;
pub mod clock;
pub mod data;
pub mod errno;
pub mod frame;
pub mod grant;
pub mod handshake;
pub mod hello;
pub mod integrity;
pub mod locks;
pub mod message;
pub mod session_key;
pub mod types;
pub mod wire;
pub mod xattr;

pub use call::{CallError, MetadataChannel};
pub use errno::Errno;
