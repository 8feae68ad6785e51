//! The rfs protocol, shared by clients (`fs-client`) and nodes (`mem-server`); neither depends
//! on the other.
//!
//! - [`wire`]: the encoding, with one field list per message for both directions.
//! - [`types`]: what both sides talk about: attributes, chunk references, nodes.
//! - [`errno`]: the one error number type.
//! - [`message`]: metadata requests, each tied to the type of its reply, in an envelope.
//! - [`clock`]: call deadlines the service holds without synchronized clocks.
//! - [`hello`]: what a control connection is for; the pool descriptor.
//! - [`frame`]: length-prefixed frames on control connections.
//! - [`handshake`]: shared-secret authentication, and dialing a node.
//! - [`integrity`]: MACs by the connection's session key on every frame after the handshake.
//! - [`secret`]: where the shared secret lives, created by the first node.
//! - [`grant`]: what a data node lets each data session reach, as the metadata node says.
//! - [`callback`]: what the metadata service tells clients whose caches a change concerns.
//! - [`locks`]: byte-range file locks, held at the metadata node for every client.
//! - [`client`] (over a reconnecting `channel`): the metadata client and its data sessions ([`data`]).
//! - [`patience`]: trying to reach a node for a bounded time at start-up.
//! - [`logging`]: where both binaries log: stderr, a file, or syslog.
//! - [`metrics`]: their counters for Prometheus, over HTTP.

pub mod backoff;
pub mod callback;
mod channel;
pub mod client;
pub mod clock;
pub mod data;
pub mod errno;
pub mod frame;
pub mod grant;
pub mod handshake;
pub mod hello;
pub mod integrity;
pub mod locks;
pub mod logging;
pub mod message;
pub mod metrics;
pub mod patience;
pub mod secret;
pub mod session_key;
pub mod types;
pub mod wire;

pub use client::{CallError, Client, ClientConfig, MetadataChannel};
pub use errno::Errno;
