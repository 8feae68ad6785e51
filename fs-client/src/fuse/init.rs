//! What the mount asks of the kernel when FUSE starts: sizes, and the capabilities each
//! feature needs (a kernel that lacks one is logged, and the mount goes on without it).

use fuser::{InitFlags, KernelConfig};

use crate::options::MountConfig;

/// Whether the kernel leaves clearing set-ID bits and capabilities to the file system (it
/// took FUSE_HANDLE_KILLPRIV_V2).
pub(super) fn negotiate(cfg: &MountConfig, config: &mut KernelConfig) -> bool {
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
    // Clearing set-ID bits and capabilities is then ours (`fs::setid`): without it, the
    // kernel asks for security.capability before every write through its page cache.
    let killpriv = InitFlags::FUSE_HANDLE_KILLPRIV_V2;
    let leaves_setid = config.add_capabilities(killpriv).is_ok();
    if !leaves_setid {
        log::warn!("kernel lacks {killpriv:?}: each write asks for security.capability");
    }
    // Locks go to the metadata node, flock's as whole-file ones (as NFS has them).
    let locks = InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS;
    if let Err(missing) = config.add_capabilities(locks) {
        log::warn!("kernel lacks {missing:?}: file locks stay local to this mount");
    }
    // POSIX ACLs: the kernel checks them (fetching them as `system.posix_acl_*` attributes)
    // and hands them over to be set; the metadata node keeps them in step with the mode bits
    // and applies a new node's umask itself, or the parent's default ACL instead.
    if let Err(missing) = config.add_capabilities(InitFlags::FUSE_POSIX_ACL) {
        log::warn!("kernel lacks {missing:?}: POSIX ACLs are not checked by this mount's kernel");
    }
    if let Err(missing) = config.add_capabilities(InitFlags::FUSE_DONT_MASK) {
        log::warn!("kernel lacks {missing:?}: it applies the umask under default ACLs too");
    }
    // File handles (name_to_handle_at, an NFS or Samba export of the mount) stay good after
    // the kernel forgot the inode: it looks the inode number up as "." (see `fs::lookup`).
    if let Err(missing) = config.add_capabilities(InitFlags::FUSE_EXPORT_SUPPORT) {
        log::warn!("kernel lacks {missing:?}: file handles go stale once the kernel forgets them");
    }
    leaves_setid
}
