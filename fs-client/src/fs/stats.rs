//! The hidden read-only file in the root that shows live statistics: the client's own figures
//! and the rdmabox counters, `name value` per line.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use rfs_proto::types::{Attr, FileKind, Timestamp};

use super::backend::Backend;
use super::Rfs;

/// The stats file's name, in the root.
pub const STATS_NAME: &str = ".rfs-stats";
/// The stats file's inode number, outside the range the metadata node hands out.
pub const STATS_INO: u64 = u64::MAX - 1;

/// The client's own figures.
#[derive(Default)]
pub(crate) struct ClientStats {
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) metadata_ops: AtomicU64,
    pub(crate) io_errors: AtomicU64,
    /// Reads that went on to another replica after one failed.
    pub(crate) failovers: AtomicU64,
    /// Replicas dropped from maps because a write could not reach them.
    pub(crate) replicas_dropped: AtomicU64,
    /// Transfers sent again with a fresh chunk map after a node refused a stale reference
    /// (its grants went with a metadata node that restarted).
    pub(crate) retries: AtomicU64,
    /// Bytes copy_file_range moved between chunks (never through FUSE).
    pub(crate) bytes_copied: AtomicU64,
}

impl ClientStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

impl<B: Backend> Rfs<B> {
    /// The stats file's attributes: its size is the current text's.
    pub fn stats_attr(&self) -> Attr {
        let t = Timestamp::now();
        Attr {
            ino: STATS_INO,
            kind: FileKind::RegularFile,
            perm: 0o444,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: self.stats_text().len() as u64,
            atime: t,
            mtime: t,
            ctime: t,
        }
    }

    /// The live statistics.
    pub fn stats_text(&self) -> String {
        let s = &self.stats;
        format!(
            "transport {}\nreads {}\nwrites {}\nfile_bytes_read {}\nfile_bytes_written {}\nmetadata_ops {}\nio_errors {}\nfailovers {}\nreplicas_dropped {}\nretries {}\nbytes_copied {}\nopen_files {}\ncached_chunks {}\nchunk_size {}\n{}",
            self.backend.transport(),
            s.reads.load(Relaxed),
            s.writes.load(Relaxed),
            s.bytes_read.load(Relaxed),
            s.bytes_written.load(Relaxed),
            s.metadata_ops.load(Relaxed),
            s.io_errors.load(Relaxed),
            s.failovers.load(Relaxed),
            s.replicas_dropped.load(Relaxed),
            s.retries.load(Relaxed),
            s.bytes_copied.load(Relaxed),
            self.open_file_count(),
            self.chunks.len(),
            self.chunk_size,
            self.backend.counters(),
        )
    }

    /// The stats file's bytes `offset..offset+len`.
    pub(crate) fn stats_read(&self, offset: u64, len: usize) -> Vec<u8> {
        let text = self.stats_text().into_bytes();
        let start = (offset as usize).min(text.len());
        let end = (start + len).min(text.len());
        text[start..end].to_vec()
    }
}
