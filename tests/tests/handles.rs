//! File handles (name_to_handle_at, open_by_handle_at: what an NFS or Samba export of a mount
//! hands its clients) stay good after the kernel forgot the inode, on another mount, and
//! across a metadata node restart; ESTALE once the file is gone.

use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rfs_e2e::{MemServer, Mount};

/// A file handle as the kernel makes it: its header (length, type) and bytes.
struct Handle(Vec<u32>);

const MAX_HANDLE: usize = 128;

fn handle_of(p: &Path) -> Handle {
    let mut raw = vec![0u32; 2 + MAX_HANDLE / 4];
    raw[0] = MAX_HANDLE as u32;
    let path = CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut mount_id = 0;
    // SAFETY: `raw` starts with a file_handle header whose handle_bytes says how many bytes
    // follow it, and has that room.
    let r = unsafe {
        libc::name_to_handle_at(
            libc::AT_FDCWD,
            path.as_ptr(),
            raw.as_mut_ptr().cast(),
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at: {}",
        std::io::Error::last_os_error()
    );
    Handle(raw)
}

/// Opens `h` through the mount at `mount` (read-only).
fn open_by(mount: &Path, h: &Handle) -> std::io::Result<File> {
    let dir = File::open(mount)?;
    let mut raw = h.0.clone();
    // SAFETY: a handle as name_to_handle_at filled it, and a descriptor of the mount.
    let fd = unsafe {
        libc::open_by_handle_at(dir.as_raw_fd(), raw.as_mut_ptr().cast(), libc::O_RDONLY)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, ours alone.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Has the kernel drop the dentries and inodes it caches that nothing holds.
fn forget_inodes() {
    std::fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
}

fn read_all(mut f: File) -> Vec<u8> {
    let mut v = Vec::new();
    f.read_to_end(&mut v).unwrap();
    v
}

#[test]
fn handles_outlive_the_kernels_cache_another_mount_and_a_restart() {
    let mut meta = MemServer::durable_meta("handles", &[]);
    let _data = MemServer::data(&meta, "32M", "1M");
    let a = Mount::new(&meta, &["io_timeout=2"]);
    let b = Mount::new(&meta, &["io_timeout=2"]);
    std::fs::create_dir_all(a.path("d/e")).unwrap();
    std::fs::write(a.path("d/e/f"), b"by handle").unwrap();
    std::fs::write(a.path("gone"), b"soon").unwrap();
    let file = handle_of(&a.path("d/e/f"));
    let dir = handle_of(&a.path("d/e"));
    let gone = handle_of(&a.path("gone"));
    forget_inodes();
    assert_eq!(read_all(open_by(&a.dir, &file).unwrap()), b"by handle");
    assert!(open_by(&a.dir, &dir).unwrap().metadata().unwrap().is_dir());
    // A handle made on one mount is good on another (the inode number is the node's).
    assert_eq!(read_all(open_by(&b.dir, &file).unwrap()), b"by handle");
    meta.restart();
    forget_inodes();
    for m in [&a, &b] {
        assert_eq!(read_all(open_by(&m.dir, &file).unwrap()), b"by handle");
    }
    std::fs::remove_file(a.path("gone")).unwrap();
    forget_inodes();
    for m in [&a, &b] {
        let e = open_by(&m.dir, &gone).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    }
}
