//! The seam under the file system: metadata calls and one-sided chunk I/O. [`Client`] is the
//! real one (RPC to the metadata node, rdmabox sessions to the data nodes); the tests use an
//! in-memory one, so that the file system's logic runs without processes or FUSE.

use std::sync::Arc;

use rdmabox::transport::{Landing, WcStatus};
use rdmabox::{IoError, Snapshot};
use rfs_client::Client;
use rfs_client::{ListHeld, NoticeHandler};
use rfs_proto::data::chunk_addr;
use rfs_proto::data::DataSession;
use rfs_proto::types::ChunkRef;
use rfs_proto::{Errno, MetadataChannel};

use super::error::Error;

/// Receives a read's result: its bytes, lent where they landed for the call.
pub type DataDone = Box<dyn FnOnce(Result<&[u8], Error>) + Send>;
/// Hears that a read is in the caller's memory (or why not).
pub type LandedDone = Box<dyn FnOnce(Result<(), Error>) + Send>;
/// Receives a write's result, and its buffer either way (to send again after a failure).
pub type WriteBack = Box<dyn FnOnce(Result<(), Error>, Vec<u8>) + Send>;

/// Where the file system's metadata and data go.
pub trait Backend: MetadataChannel + Send + Sync + 'static {
    /// Whether transfers to `node` can start at once (no metadata call on the way).
    fn is_connected(&self, node: u32) -> bool;
    /// Whether `node` failed moments ago: transfers to it fail at once for a while.
    fn is_down(&self, node: u32) -> bool;
    /// Connects the data session to `node` (may ask the metadata node where it is).
    fn connect(&self, node: u32) -> Result<(), Error>;
    /// Reads `len` bytes at `offset` of `chunk`.
    fn read(&self, chunk: &ChunkRef, offset: u64, len: usize, done: DataDone);
    /// Reads `into.len()` bytes at `offset` of `chunk` into the caller's memory `into`.
    fn read_into(&self, chunk: &ChunkRef, offset: u64, into: Landing, done: LandedDone) {
        let node = chunk.node;
        self.read(
            chunk,
            offset,
            into.len(),
            Box::new(move |r| {
                done(r.and_then(|bytes| match into.copy_in(0, bytes) {
                    true if bytes.len() == into.len() => Ok(()),
                    _ => Err(Error::data(
                        node,
                        &IoError::Transport(WcStatus::LocalLengthError),
                    )),
                }))
            }),
        )
    }
    /// Reads the pieces (chunk, offset in it, length), all on one node, side by side: `done`
    /// gets them as one run of bytes.
    fn read_gathered(&self, pieces: &[(ChunkRef, u64, usize)], done: DataDone);
    /// Writes `data` at `offset` of `chunk`.
    fn write(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: WriteBack);
    /// The transport, in words, for the stats file.
    fn transport(&self) -> String;
    /// The rdmabox counters, for the stats file.
    fn counters(&self) -> Snapshot;
    /// Where the metadata node's callbacks and reconnections are told.
    fn on_notice(&self, handler: NoticeHandler);
    /// How to list our open handles and locks, for a metadata node that lost them (it
    /// restarted).
    fn on_reclaim(&self, held: ListHeld);
    /// Whether the metadata connection is up (its callbacks arrive).
    fn metadata_connected(&self) -> bool;
    /// Dials the metadata node again now if the connection is lost (nothing if it is up).
    fn redial(&self) -> std::io::Result<()>;
    /// Waits (briefly) while a reconnection's notice is being handled on another thread.
    fn reconnection_settled(&self) {}
    /// Lets metadata calls take up to `timeout` before they are given up on.
    fn set_call_timeout(&self, _timeout: std::time::Duration) {}
}

/// How long a lock granted, or a file opened, just after a reconnection waits for what was
/// cached before it to be dropped: the handler's own calls are bounded by their deadlines, so
/// this only caps a handler held up by a node that is lost again.
const RECONNECTION_SETTLES: std::time::Duration = std::time::Duration::from_secs(5);

/// The session to `chunk`'s node, or why a transfer cannot start. The session is connected
/// beforehand ([`Backend::connect`]): a transfer holds its chunk references, and must not wait
/// on a metadata call that may be waiting for them to be let go.
fn session_of(client: &Client, chunk: &ChunkRef) -> Result<Arc<DataSession>, Error> {
    let node = chunk.node;
    client.connected(node).ok_or_else(|| {
        if client.is_down(node) {
            Error::new(Errno::EIO, format!("data node {node}: failed moments ago"))
        } else {
            Error::unreachable(node, "session lost")
        }
    })
}

impl Backend for Client {
    fn is_connected(&self, node: u32) -> bool {
        self.connected(node).is_some()
    }

    fn is_down(&self, node: u32) -> bool {
        Client::is_down(self, node)
    }

    fn connect(&self, node: u32) -> Result<(), Error> {
        self.data(node).map(drop).map_err(Error::from)
    }

    fn read(&self, chunk: &ChunkRef, offset: u64, len: usize, done: DataDone) {
        let node = chunk.node;
        match session_of(self, chunk) {
            Ok(d) => d.session.read_borrowing(
                chunk_addr(chunk, offset),
                len,
                Box::new(move |r| done(r.map_err(|e| Error::data(node, &e)))),
            ),
            Err(e) => done(Err(e)),
        }
    }

    fn read_into(&self, chunk: &ChunkRef, offset: u64, into: Landing, done: LandedDone) {
        let node = chunk.node;
        match session_of(self, chunk) {
            Ok(d) => d.session.read_into(
                chunk_addr(chunk, offset),
                into,
                Box::new(move |r| done(r.map_err(|e| Error::data(node, &e)))),
            ),
            Err(e) => done(Err(e)),
        }
    }

    fn read_gathered(&self, pieces: &[(ChunkRef, u64, usize)], done: DataDone) {
        let Some((first, ..)) = pieces.first() else {
            return done(Ok(&[]));
        };
        let node = first.node;
        match session_of(self, first) {
            Ok(d) => {
                let remote: Vec<_> = pieces
                    .iter()
                    .map(|(c, offset, len)| (chunk_addr(c, *offset), *len))
                    .collect();
                d.session.read_gathered(
                    &remote,
                    Box::new(move |r| done(r.map_err(|e| Error::data(node, &e)))),
                )
            }
            Err(e) => done(Err(e)),
        }
    }

    fn write(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: WriteBack) {
        let node = chunk.node;
        match session_of(self, chunk) {
            Ok(d) => d.session.write_keeping(
                chunk_addr(chunk, offset),
                data,
                Box::new(move |r| match r {
                    Ok(data) => done(Ok(()), data),
                    Err((e, data)) => done(Err(Error::data(node, &e)), data),
                }),
            ),
            Err(e) => done(Err(e), data),
        }
    }

    fn transport(&self) -> String {
        Client::transport(self)
    }

    fn counters(&self) -> Snapshot {
        Client::counters(self)
    }

    fn on_notice(&self, handler: NoticeHandler) {
        Client::on_notice(self, handler)
    }

    fn metadata_connected(&self) -> bool {
        Client::metadata_connected(self)
    }

    fn redial(&self) -> std::io::Result<()> {
        Client::redial(self)
    }

    fn reconnection_settled(&self) {
        Client::reconnection_settled(self, RECONNECTION_SETTLES)
    }

    fn on_reclaim(&self, held: ListHeld) {
        Client::on_reclaim(self, held)
    }

    fn set_call_timeout(&self, timeout: std::time::Duration) {
        Client::set_call_timeout(self, timeout)
    }
}
