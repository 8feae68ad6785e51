//! The seam under the file system: metadata calls and one-sided chunk I/O. [`Client`] is the
//! real one (RPC to the metadata node, rdmabox sessions to the data nodes); the tests use an
//! in-memory one, so that the file system's logic runs without processes or FUSE.

use rdmabox::Snapshot;
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
}

impl Backend for Client {
    fn read(&self, chunk: &ChunkRef, offset: u64, buf: Vec<u8>, done: DataDone) {
        let node = chunk.node;
        match self.data(node) {
            Ok(d) => d.session.read(
                chunk_addr(chunk, offset),
                buf,
                Box::new(move |r| done(r.map_err(|e| Error::data(node, &e)))),
            ),
            Err(e) => done(Err(e.into())),
        }
    }

    fn write(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: DataDone) {
        let node = chunk.node;
        match self.data(node) {
            Ok(d) => d.session.write(
                chunk_addr(chunk, offset),
                data,
                Box::new(move |r| done(r.map_err(|e| Error::data(node, &e)))),
            ),
            Err(e) => done(Err(e.into())),
        }
    }

    fn transport(&self) -> String {
        Client::transport(self)
    }

    fn counters(&self) -> Snapshot {
        Client::counters(self)
    }
}
