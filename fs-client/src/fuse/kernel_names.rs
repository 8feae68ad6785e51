//! Dropping every name the kernel caches for the mount at once, after a lost metadata
//! connection: a notice written to our own descriptor of the FUSE connection.

/// The FUSE notice that drops every name the kernel caches at once (it looks each up again
/// before using it): FUSE_NOTIFY_INC_EPOCH, of Linux 6.16 (FUSE 7.44), which fuser does not
/// send.
const FUSE_NOTIFY_INC_EPOCH: i32 = 8;

/// Drops every name the kernel caches for our mount, through our own descriptor of the FUSE
/// connection.
pub struct KernelNames {
    device: std::fs::File,
    /// The kernel took the notice so far (older kernels refuse it).
    supported: std::sync::atomic::AtomicBool,
}

impl KernelNames {
    pub fn new(device: std::os::fd::OwnedFd) -> KernelNames {
        KernelNames {
            device: device.into(),
            supported: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Drops every cached name; a kernel before 6.16 keeps them until their entry timeout.
    pub fn drop_all(&self) -> std::io::Result<()> {
        use std::io::Write;
        use std::sync::atomic::Ordering::Relaxed;
        if !self.supported.load(Relaxed) {
            return Ok(());
        }
        // A notice is a fuse_out_header alone: its length, the notice's code where a reply
        // has its error, and no request.
        let mut notice = [0u8; 16];
        notice[..4].copy_from_slice(&16u32.to_ne_bytes());
        notice[4..8].copy_from_slice(&FUSE_NOTIFY_INC_EPOCH.to_ne_bytes());
        match (&self.device).write(&notice) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.supported.store(false, Relaxed);
                log::warn!(
                    "this kernel cannot drop all cached names at once (Linux 6.16 can): after a \
                     lost metadata connection, names another mount changed meanwhile may be \
                     served until the entry timeout"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
