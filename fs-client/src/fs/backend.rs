//! The seam under the file system: metadata calls and one-sided chunk I/O. [`Client`] is the
//! real one (RPC to the metadata node, rdmabox sessions to the data nodes); the tests use an
//! in-memory one, so that the file system's logic runs without processes or FUSE.

use rdmabox::session::Callback;
use rdmabox::{Session, Snapshot};
use rfs_proto::client::NoticeHandler;
use rfs_proto::data::chunk_addr;
use rfs_proto::types::ChunkRef;
use rfs_proto::{Client, MetadataChannel};

use super::error::Error;

/// Receives a transfer's result: the filled buffer of a read, the written buffer of a write.
pub type DataDone = Box<dyn FnOnce(Result<Vec<u8>, Error>) + Send>;

/// Where the file system's metadata and data go.
pub trait Backend: MetadataChannel + Send + Sync + 'static {
    /// Reads `buf.len()` bytes at `offset` of `chunk`.
    fn read(&self, chunk: &ChunkRef, offset: u64, buf: Vec<u8>, done: DataDone);
    /// Writes `data` at `offset` of `chunk`.
    fn write(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: DataDone);
    /// The transport, in words, for the stats file.
    fn transport(&self) -> String;
    /// The rdmabox counters, for the stats file.
    fn counters(&self) -> Snapshot;
    /// Where the metadata node's callbacks and reconnections are told.
    fn on_notice(&self, handler: NoticeHandler);
}

/// Starts a transfer on the session to `chunk`'s node, whose result becomes ours; a node that
/// cannot be reached fails the transfer at once.
fn one_sided(
    client: &Client,
    chunk: &ChunkRef,
    done: DataDone,
    start: impl FnOnce(&Session, Callback),
) {
    let node = chunk.node;
    match client.data(node) {
        Ok(d) => start(
            &d.session,
            Box::new(move |r| done(r.map_err(|e| Error::data(node, &e)))),
        ),
        Err(e) => done(Err(e.into())),
    }
}

impl Backend for Client {
    fn read(&self, chunk: &ChunkRef, offset: u64, buf: Vec<u8>, done: DataDone) {
        one_sided(self, chunk, done, |s, cb| {
            s.read(chunk_addr(chunk, offset), buf, cb)
        });
    }

    fn write(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: DataDone) {
        one_sided(self, chunk, done, |s, cb| {
            s.write(chunk_addr(chunk, offset), data, cb)
        });
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
}
