//! rfs-io: reads and writes of files on an rfs mount through a ring in shared memory, beside
//! the mount (as 3FS's USRBIO beside its FUSE mount): no FUSE request per I/O, many requests in
//! flight, the bytes moved straight between the storage nodes and a buffer this process
//! shares with the mount's fs-client.
//!
//! - [`layout`]: the rings in shared memory, as both sides see them.
//! - [`shm`]: shared memory (a sealed memfd) and sound access to it.
//! - [`wire`]: the control messages on the ring's Unix socket, with the descriptors they carry.
//! - [`Ring`]: the application's side.
//! - [`ffi`]: the same as a C ABI (`io/include/rfs_io.h`), which the Python module uses.

pub mod ffi;
pub mod layout;
mod ring;
pub mod shm;
pub mod wire;

pub use ring::{Completion, RegisteredFile, Ring, SOCKET_LINK_INO, SOCKET_NAME};
