//! The metadata service's figures, for the metrics endpoint.

use std::sync::atomic::Ordering;

use rfs_daemon::metrics::Metric;

use super::MetaService;

impl MetaService {
    /// The metadata service's figures, for the metrics endpoint.
    pub(crate) fn metrics(&self) -> Vec<Metric> {
        let st = self.state.lock();
        let (space, free) = st.alloc.totals();
        let (alive, nodes) = st.alloc.node_counts();
        let (zeroing, inodes) = (st.alloc.zeroing(), st.ns.inode_count());
        let (allocatable, inodes_max) = (st.alloc.allocatable_bytes(), st.ns.max_inodes());
        let locks = st.locks.count() as u64;
        let (xattr_bytes, xattr_bytes_max) = st.ns.xattr_bytes();
        drop(st);
        vec![
            Metric::gauge("space_bytes", "Bytes every data node lends", space),
            Metric::gauge("free_bytes", "Bytes free (some being zeroed)", free),
            Metric::gauge(
                "zeroing_bytes",
                "Bytes freed and not yet allocatable",
                zeroing,
            ),
            Metric::gauge("data_nodes_alive", "Data nodes up", alive as u64),
            Metric::gauge("data_nodes", "Data nodes ever joined", nodes as u64),
            Metric::gauge(
                "allocatable_bytes",
                "Bytes that can be allocated now",
                allocatable,
            ),
            Metric::gauge("inodes", "Files, directories and links", inodes),
            Metric::gauge(
                "inodes_max",
                "The most inodes the namespace holds",
                inodes_max,
            ),
            Metric::gauge("file_locks", "File locks held, over every client", locks),
            Metric::gauge(
                "xattr_bytes",
                "What every file's extended attributes cost the node",
                xattr_bytes,
            ),
            Metric::gauge(
                "xattr_bytes_max",
                "The most extended attributes may cost the node",
                xattr_bytes_max,
            ),
            Metric::counter(
                "zeroed_bytes",
                "Bytes of freed space zeroed before reuse (a new file must read zeros)",
                self.zeroer.zeroed_bytes(),
            ),
            Metric::counter(
                "compaction_chunks_made",
                "Whole chunks made again by moving small spans out of a fragmented window",
                self.compaction.chunks_made.load(Ordering::Relaxed),
            ),
            Metric::counter(
                "compaction_moved_bytes",
                "Bytes of spans moved out of windows being emptied",
                self.compaction.bytes_moved.load(Ordering::Relaxed),
            ),
            Metric::gauge(
                "chunks_short_of_replicas",
                "Chunks with fewer copies than --replicas",
                self.repair.short(),
            ),
        ]
    }
}
