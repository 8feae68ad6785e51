//! What the mount asks of the kernel when FUSE starts: sizes, and the capabilities each
//! feature needs (a kernel that lacks one is logged, and the mount goes on without it).

use fuser::{InitFlags, KernelConfig};

use crate::options::MountConfig;

pub(super) fn negotiate(cfg: &MountConfig, config: &mut KernelConfig) {
    if let Err(max) = config.set_max_write(cfg.max_write) {
        log::warn!("kernel limits max_write to {max}");
        let _ = config.set_max_write(max);
    }
    let _ = config.set_max_readahead(cfg.max_readahead);
    let _ = config.set_max_background(64);
    let mut want = InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_READDIRPLUS_AUTO;
    if cfg.writeback_cache {
        want |= InitFlags::FUSE_WRITEBACK_CACHE;
    }
    if let Err(missing) = config.add_capabilities(want) {
        log::warn!("kernel lacks FUSE capabilities {missing:?}");
    }
    // With the writeback cache, clearing set-ID bits is then ours (`fs::setid`): without it,
    // the kernel asks for security.capability before every write.
    let killpriv = InitFlags::FUSE_HANDLE_KILLPRIV_V2;
    if cfg.writeback_cache && config.add_capabilities(killpriv).is_err() {
        log::warn!("kernel lacks {killpriv:?}: each write asks for security.capability");
    }
    // Locks go to the metadata node, flock's as whole-file ones (as NFS has them).
    let locks = InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS;
    if let Err(missing) = config.add_capabilities(locks) {
        log::warn!("kernel lacks {missing:?}: file locks stay local to this mount");
    }
    // File handles (name_to_handle_at, an NFS or Samba export of the mount) stay good after
    // the kernel forgot the inode: it looks the inode number up as "." (see `fs::lookup`).
    if let Err(missing) = config.add_capabilities(InitFlags::FUSE_EXPORT_SUPPORT) {
        log::warn!("kernel lacks {missing:?}: file handles go stale once the kernel forgets them");
    }
}
