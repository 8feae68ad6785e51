//! `.rfs-ring` in the mount's root: a symbolic link to the mount's ring socket (see
//! [`crate::ring`]), there once the ring service runs. An application names the mount, and
//! connecting to the link reaches that mount's fs-client (`rfs_io::Ring::connect`).

use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use rfs_proto::types::{Attr, FileKind, Timestamp};

use super::{Backend, Rfs};

/// The link's name and inode number (out of the namespace's range, as the stats file's is):
/// an application takes a link there with another number for someone else's.
pub use rfs_io::{SOCKET_LINK_INO as RING_INO, SOCKET_NAME as RING_NAME};

impl<B: Backend> Rfs<B> {
    /// The ring service listens at `socket` from now on: the link points there.
    pub fn ring_started(&self, socket: PathBuf) {
        let _ = self.ring_socket.set(socket);
    }

    /// Where the link points, once the ring service runs.
    pub(crate) fn ring_target(&self) -> Option<&[u8]> {
        self.ring_socket.get().map(|p| p.as_os_str().as_bytes())
    }

    /// The link's attributes, once the ring service runs.
    pub(crate) fn ring_link_attr(&self) -> Option<Attr> {
        let target = self.ring_target()?;
        let t = Timestamp::now();
        Some(Attr {
            ino: RING_INO,
            kind: FileKind::Symlink,
            perm: 0o777,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: target.len() as u64,
            atime: t,
            mtime: t,
            ctime: t,
            cuts: 0,
            acl: false,
            held: 0,
        })
    }
}
