//! The mount itself. With the right to mount (root), fs-client calls mount(2) as file system
//! type `fuse.rfs`, so that `findmnt -t fuse.rfs`, `umount -a -t fuse.rfs` and `df -t fuse.rfs`
//! find it (fuser's own mount says plain `fuse`); without it, fuser goes through fusermount3,
//! which takes the subtype as an option. Either way the directory must be a directory that is
//! not an rfs mount already.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::MsFlags;
use nix::unistd::{getgid, getuid};

use crate::mount_table;
use crate::options::KernelFlag;

/// The file system type the kernel lists an rfs mount as.
pub const FS_TYPE: &str = "fuse.rfs";

/// Why a directory cannot take an rfs mount, if it cannot: it is not a directory, or an rfs
/// mount is on it already (stacking a second would hide the first, as mount(8) refuses for NFS).
pub fn refuse(mountpoint: &Path) -> Option<String> {
    match std::fs::metadata(mountpoint) {
        Ok(m) if !m.is_dir() => Some("not a directory".into()),
        Err(e) => Some(e.to_string()),
        Ok(_) if mount_table::top_mount_type(mountpoint).as_deref() == Some(FS_TYPE) => {
            Some(format!(
                "an rfs mount is there already (unmount it first: umount {})",
                mountpoint.display()
            ))
        }
        Ok(_) => None,
    }
}

/// What the kernel is asked for at the mount.
pub struct MountRequest<'a> {
    /// What the mount table shows as its source (the metadata node's address).
    pub source: &'a str,
    pub flags: &'a [KernelFlag],
    /// Let every user in (`allow_other`), the kernel checking permissions.
    pub allow_other: bool,
}

/// Mounts `/dev/fuse` on `mountpoint` as [`FS_TYPE`]: the device to serve, or None where this
/// process may not mount (fusermount3 then does).
pub fn mount(mountpoint: &Path, req: &MountRequest<'_>) -> io::Result<Option<OwnedFd>> {
    let device: File = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| io::Error::new(e.kind(), format!("/dev/fuse: {e} (is fuse loaded?)")))?;
    // Started with stdin, stdout or stderr closed, it could be one of them, which the daemon
    // later points at its log: a copy is taken from 3 up.
    let device = if device.as_raw_fd() <= 2 {
        device.try_clone()?
    } else {
        device
    };
    let root_mode = std::fs::metadata(mountpoint)?.mode();
    let mut data = format!(
        "fd={},rootmode={:o},user_id={},group_id={},default_permissions",
        device.as_raw_fd(),
        root_mode & libc::S_IFMT,
        getuid(),
        getgid()
    );
    if req.allow_other {
        data.push_str(",allow_other");
    }
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME;
    for f in req.flags {
        flags |= match f {
            KernelFlag::ReadOnly => MsFlags::MS_RDONLY,
            KernelFlag::NoSuid => MsFlags::MS_NOSUID,
            KernelFlag::NoDev => MsFlags::MS_NODEV,
            KernelFlag::NoExec => MsFlags::MS_NOEXEC,
        };
    }
    match nix::mount::mount(
        Some(req.source),
        mountpoint,
        Some(FS_TYPE),
        flags,
        Some(data.as_str()),
    ) {
        Ok(()) => Ok(Some(device.into())),
        Err(Errno::EPERM) => Ok(None),
        Err(e) => Err(io::Error::new(
            io::Error::from(e).kind(),
            format!("mount(2) of {FS_TYPE}: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_directories_take_a_mount() {
        let dir = std::env::temp_dir().join(format!("rfs-kernel-mount-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(refuse(&dir), None);
        assert_eq!(refuse(&file).as_deref(), Some("not a directory"));
        assert!(refuse(&dir.join("missing")).is_some());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
