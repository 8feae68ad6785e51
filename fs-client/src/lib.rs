//! rfs client: a POSIX file system over FUSE whose file data lives in storage nodes' memory.
//!
//! - [`fs`]: the operations, testable without FUSE (and without nodes: see its backend seam).
//! - [`fuse`]: the fuser adapter.
//! - [`options`]: mount options (flags and `-o`), written once.
//! - [`mount_helper`]: `mount.rfs`, for mount(8) and /etc/fstab.
//! - [`kernel_mount`]: the mount itself, as `fuse.rfs`, on directories only.
//! - [`mount_table`]: which mount is on top of a directory (unmount only our own).
//! - [`readahead`]: the kernel's readahead for the mount.
//! - [`ring`]: the ring service beside the mount, for `rfs-io`.

pub mod fs;
pub mod fuse;
pub mod host;
pub mod kernel_mount;
pub mod mount_helper;
pub mod mount_table;
pub mod options;
pub mod readahead;
pub mod ring;
