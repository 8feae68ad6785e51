//! The hidden read-only file in the root that shows live statistics: the client's own figures
//! and the rdmabox counters, `name value` per line.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use std::fmt::Write as _;

use rfs_daemon::metrics::Metric;
use rfs_proto::types::{Attr, FileKind, Timestamp};

use super::backend::Backend;
use super::Rfs;

/// The stats file's name, in the root.
pub const STATS_NAME: &str = ".rfs-stats";
/// The stats file's inode number, outside the range the metadata node hands out.
pub const STATS_INO: u64 = u64::MAX - 1;

/// The stats text (`name value` lines) as one JSON object: numbers as numbers, the rest
/// (the transport's name) as strings.
pub fn stats_json(text: &str) -> String {
    let fields: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(name, value)| match value.parse::<u64>() {
            Ok(n) => format!("{}:{n}", json_string(name)),
            Err(_) => format!("{}:{}", json_string(name), json_string(value)),
        })
        .collect();
    format!("{{{}}}", fields.join(","))
}

fn json_string(s: &str) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

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
    /// Handles closed and given back to the metadata node (sent together: see `closes`).
    pub(crate) handles_closed: AtomicU64,
    /// Commits made again after a fault kept them from the metadata node (see `owed`).
    pub(crate) commits_resent: AtomicU64,
    /// Cuts made elsewhere heard of late: a commit the metadata node refused for one, or a
    /// write whose map was read after one.
    pub(crate) commits_over_cuts: AtomicU64,
    /// Allocations short of space tried again once a release of ours gave chunks back.
    pub(crate) space_retries: AtomicU64,
    /// Extended attribute requests from the kernel (none are kept; it stops asking at the
    /// first answer).
    pub(crate) xattr_requests: AtomicU64,
    /// Locks that had to wait for another owner's (F_SETLKW, flock without LOCK_NB).
    pub(crate) lock_waits: AtomicU64,
    /// Requests taken from rings (`rfs-io`), the transfers they made (adjacent ones move
    /// together), and the rings served now.
    pub(crate) ring_requests: AtomicU64,
    pub(crate) ring_transfers: AtomicU64,
    pub(crate) rings: AtomicU64,
    /// Locks a metadata node that lost our session did not give back.
    pub(crate) locks_lost: AtomicU64,
    /// Metadata connections found lost: the kernel's names and attributes were dropped.
    pub(crate) connections_lost: AtomicU64,
    /// Metadata connections back after a loss: everything cached was dropped.
    pub(crate) reconnections: AtomicU64,
}

impl ClientStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

impl<B: Backend> Rfs<B> {
    /// A ring is served (`open`), or no more.
    pub(crate) fn ring_served(&self, open: bool) {
        match open {
            true => ClientStats::add(&self.stats.rings, 1),
            false => {
                self.stats.rings.fetch_sub(1, Relaxed);
            }
        }
    }

    /// A ring's `requests` were taken, and made `transfers` transfers.
    pub(crate) fn ring_counted(&self, requests: u64, transfers: u64) {
        ClientStats::add(&self.stats.ring_requests, requests);
        ClientStats::add(&self.stats.ring_transfers, transfers);
    }

    /// Counts an extended attribute request from the kernel.
    pub fn xattr_asked(&self) {
        ClientStats::add(&self.stats.xattr_requests, 1);
    }

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
            cuts: 0,
            acl: false,
            held: 0,
        }
    }

    /// The live figures: the client's, then its data sessions' (rdmabox's).
    pub fn stats_metrics(&self) -> Vec<Metric> {
        let s = &self.stats;
        let n = |c: &AtomicU64| c.load(Relaxed);
        let mut m = vec![
            Metric::counter("reads", "File reads", n(&s.reads)),
            Metric::counter("writes", "File writes", n(&s.writes)),
            Metric::counter("file_bytes_read", "Bytes of files read", n(&s.bytes_read)),
            Metric::counter(
                "file_bytes_written",
                "Bytes of files written",
                n(&s.bytes_written),
            ),
            Metric::counter(
                "metadata_ops",
                "Calls to the metadata node",
                n(&s.metadata_ops),
            ),
            Metric::counter(
                "io_errors",
                "Transfers that failed with EIO",
                n(&s.io_errors),
            ),
            Metric::counter(
                "failovers",
                "Reads that went on to another replica",
                n(&s.failovers),
            ),
            Metric::counter(
                "replicas_dropped",
                "Replicas dropped from maps after a write missed them",
                n(&s.replicas_dropped),
            ),
            Metric::counter(
                "retries",
                "Transfers sent again with a fresh chunk map",
                n(&s.retries),
            ),
            Metric::counter(
                "bytes_copied",
                "Bytes copy_file_range moved between chunks",
                n(&s.bytes_copied),
            ),
            Metric::counter(
                "handles_closed",
                "Handles closed and given back to the metadata node",
                n(&s.handles_closed),
            ),
            Metric::counter(
                "commits_resent",
                "Commits made again after a fault kept them from the metadata node",
                n(&s.commits_resent),
            ),
            Metric::counter(
                "commits_over_cuts",
                "Cuts made elsewhere heard of late: a commit refused for one, or a write mapped after one",
                n(&s.commits_over_cuts),
            ),
            Metric::counter(
                "lock_waits",
                "Locks that waited for another owner's",
                n(&s.lock_waits),
            ),
            Metric::counter(
                "locks_lost",
                "Locks the metadata node did not give back after losing the session",
                n(&s.locks_lost),
            ),
            Metric::counter(
                "space_retries",
                "Allocations short of space tried again once a release of this mount gave chunks back",
                n(&s.space_retries),
            ),
            Metric::gauge(
                "commits_owed",
                "Closed files whose size the metadata node has not taken yet",
                self.owed.len() as u64,
            ),
            Metric::counter(
                "xattr_requests",
                "Extended attribute requests from the kernel",
                n(&s.xattr_requests),
            ),
            Metric::counter(
                "connections_lost",
                "Metadata connections found lost (the kernel's names and attributes dropped)",
                n(&s.connections_lost),
            ),
            Metric::counter(
                "reconnections",
                "Metadata connections back after a loss (everything cached dropped)",
                n(&s.reconnections),
            ),
            Metric::gauge(
                "metadata_connected",
                "1 while the metadata connection is up (a lost one is replaced at the next call)",
                u64::from(self.backend.metadata_connected()),
            ),
            Metric::gauge("open_files", "Files open", self.open_file_count() as u64),
            Metric::counter(
                "ring_requests",
                "Requests taken from rings beside the mount",
                n(&s.ring_requests),
            ),
            Metric::counter(
                "ring_transfers",
                "Transfers the rings' requests made (adjacent ones move together)",
                n(&s.ring_transfers),
            ),
            Metric::gauge("rings", "Rings served", n(&s.rings)),
            Metric::gauge(
                "cached_chunks",
                "Chunk references cached",
                self.chunks.len() as u64,
            ),
            Metric::gauge("chunk_size", "Bytes per chunk", self.chunk_size),
        ];
        m.extend(
            self.backend
                .counters()
                .fields()
                .into_iter()
                .map(Metric::from),
        );
        m
    }

    /// The live statistics: `name value` lines.
    pub fn stats_text(&self) -> String {
        let mut text = format!("transport {}\n", self.backend.transport());
        for m in self.stats_metrics() {
            let _ = writeln!(text, "{} {}", m.name, m.value);
        }
        text
    }

    /// The stats file's bytes `offset..offset+len`.
    pub(crate) fn stats_read(&self, offset: u64, len: usize) -> Vec<u8> {
        let text = self.stats_text().into_bytes();
        let start = (offset as usize).min(text.len());
        let end = (start + len).min(text.len());
        text[start..end].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_turn_into_json() {
        assert_eq!(
            stats_json("transport verbs (mlx5_0 \"x\")\nreads 3\nopen_files 0\n"),
            r#"{"transport":"verbs (mlx5_0 \"x\")","reads":3,"open_files":0}"#
        );
        assert_eq!(stats_json(""), "{}");
    }
}
