//! POSIX semantics through a real mount.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use std::process::Command;

use rfs_e2e::{errno, run_child, MemServer, Mount};

fn cpath(p: &std::path::Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn renameat2(from: &std::path::Path, to: &std::path::Path, flags: u32) -> std::io::Result<()> {
    let (from, to) = (cpath(from), cpath(to));
    // SAFETY: two valid NUL-terminated paths.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn files_directories_links_and_their_errors() {
    let server = MemServer::meta("64M", "1M");
    let m = Mount::new(&server, &[]);
    let a = m.path("a");
    fs::write(&a, b"hello").unwrap();
    assert_eq!(fs::read(&a).unwrap(), b"hello");
    // Append and overwrite in the middle.
    OpenOptions::new()
        .append(true)
        .open(&a)
        .unwrap()
        .write_all(b" world")
        .unwrap();
    let mut f = OpenOptions::new().write(true).open(&a).unwrap();
    f.seek(SeekFrom::Start(1)).unwrap();
    f.write_all(b"EL").unwrap();
    drop(f);
    assert_eq!(fs::read(&a).unwrap(), b"hELlo world");

    // Errors.
    assert_eq!(
        errno(&fs::read(m.path("missing")).unwrap_err()),
        libc::ENOENT
    );
    assert_eq!(
        errno(
            &OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&a)
                .unwrap_err()
        ),
        libc::EEXIST
    );
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/f"), b"x").unwrap();
    assert_eq!(
        errno(&fs::remove_dir(m.path("d")).unwrap_err()),
        libc::ENOTEMPTY
    );
    assert_eq!(
        errno(&fs::remove_file(m.path("d")).unwrap_err()),
        libc::EISDIR
    );
    assert_eq!(
        errno(&fs::write(m.path("a/x"), b"").unwrap_err()),
        libc::ENOTDIR
    );
    let long = "n".repeat(256);
    assert_eq!(
        errno(&fs::write(m.path(&long), b"").unwrap_err()),
        libc::ENAMETOOLONG
    );
    assert_eq!(
        errno(
            &File::open(m.path("d"))
                .and_then(|mut f| f.read(&mut [0; 4]))
                .unwrap_err()
        ),
        libc::EISDIR
    );

    // Hard links and symlinks.
    fs::hard_link(&a, m.path("d/a2")).unwrap();
    assert_eq!(fs::metadata(&a).unwrap().nlink(), 2);
    std::os::unix::fs::symlink("../a", m.path("d/sym")).unwrap();
    assert_eq!(
        fs::read_link(m.path("d/sym")).unwrap().to_str(),
        Some("../a")
    );
    assert_eq!(fs::read(m.path("d/sym")).unwrap(), b"hELlo world");
    fs::remove_file(&a).unwrap();
    assert_eq!(fs::read(m.path("d/a2")).unwrap(), b"hELlo world");
    assert_eq!(fs::metadata(m.path("d/a2")).unwrap().nlink(), 1);

    // Renames: over an existing file, a directory, NOREPLACE.
    fs::write(m.path("x"), b"old").unwrap();
    fs::write(m.path("y"), b"new").unwrap();
    fs::rename(m.path("y"), m.path("x")).unwrap();
    assert_eq!(fs::read(m.path("x")).unwrap(), b"new");
    assert!(!m.path("y").exists());
    fs::rename(m.path("d"), m.path("e")).unwrap();
    assert_eq!(fs::read(m.path("e/f")).unwrap(), b"x");
    fs::write(m.path("z"), b"z").unwrap();
    let e = renameat2(&m.path("z"), &m.path("x"), libc::RENAME_NOREPLACE).unwrap_err();
    assert_eq!(errno(&e), libc::EEXIST);
    renameat2(&m.path("z"), &m.path("x"), libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(m.path("z")).unwrap(), b"new");
    assert_eq!(fs::read(m.path("x")).unwrap(), b"z");
}

#[test]
fn attributes_truncate_fifos_statfs_and_stats() {
    let server = MemServer::meta("64M", "1M");
    let m = Mount::new(&server, &["attr_timeout=0", "entry_timeout=0"]);
    let f = m.path("f");
    fs::write(&f, vec![7u8; 3 << 20]).unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o600);
    std::os::unix::fs::chown(&f, Some(1234), Some(5678)).unwrap();
    let md = fs::metadata(&f).unwrap();
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
    File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_modified(when)
        .unwrap();
    assert_eq!(fs::metadata(&f).unwrap().mtime(), 1_000_000_000);

    // Truncate down inside a chunk, then up: the gap reads zeros, not the old bytes.
    File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(1000)
        .unwrap();
    assert_eq!(fs::metadata(&f).unwrap().len(), 1000);
    File::options()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(2 << 20)
        .unwrap();
    let back = fs::read(&f).unwrap();
    assert_eq!(back.len(), 2 << 20);
    assert!(back[..1000].iter().all(|&b| b == 7));
    assert!(
        back[1000..].iter().all(|&b| b == 0),
        "truncated bytes came back"
    );

    // Sparse: a write far out leaves a hole of zeros.
    let mut s = File::create(m.path("sparse")).unwrap();
    s.seek(SeekFrom::Start(5 << 20)).unwrap();
    s.write_all(b"end").unwrap();
    drop(s);
    let sp = fs::read(m.path("sparse")).unwrap();
    assert_eq!(sp.len(), (5 << 20) + 3);
    assert!(sp[..5 << 20].iter().all(|&b| b == 0));

    let fifo = cpath(&m.path("fifo"));
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(
        &fs::metadata(m.path("fifo")).unwrap().file_type()
    ));

    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(cpath(&m.dir).as_ptr(), &mut st) }, 0);
    assert_eq!(st.f_blocks * st.f_frsize, 64 << 20);
    assert!(st.f_bfree < st.f_blocks);

    let stats = fs::read_to_string(m.path(".rfs-stats")).unwrap();
    assert!(stats.contains("work_requests "), "{stats}");
    assert!(stats.contains("doorbells "), "{stats}");
    let out = std::process::Command::new(rfs_e2e::bin("fs-client"))
        .arg("stats")
        .arg(&m.dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("bytes_written "));
}

/// `df -i` shows the node's file limit, and a namespace at it refuses files and directories
/// with ENOSPC until something is removed.
#[test]
fn the_file_limit_shows_in_df_and_a_full_namespace_says_enospc() {
    let server = MemServer::start(&["--memory", "16M", "--max-files", "12"]);
    let m = Mount::new(&server, &[]);
    let inodes = || {
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(cpath(&m.dir).as_ptr(), &mut st) }, 0);
        (st.f_files, st.f_ffree)
    };
    assert_eq!(inodes(), (12, 11), "the root is one");
    for i in 0..11 {
        fs::write(m.path(&format!("f{i}")), b"x").unwrap();
    }
    assert_eq!(inodes(), (12, 0));
    let full = fs::write(m.path("one-more"), b"x").unwrap_err();
    assert_eq!(full.raw_os_error(), Some(libc::ENOSPC), "{full}");
    let full = fs::create_dir(m.path("dir")).unwrap_err();
    assert_eq!(full.raw_os_error(), Some(libc::ENOSPC), "{full}");
    fs::remove_file(m.path("f0")).unwrap();
    fs::write(m.path("one-more"), b"x").unwrap();
    assert_eq!(fs::read(m.path("one-more")).unwrap(), b"x");
}

#[test]
fn large_directories_list_completely() {
    let server = MemServer::meta("16M", "1M");
    let m = Mount::new(&server, &[]);
    fs::create_dir(m.path("big")).unwrap();
    for i in 0..1500 {
        File::create(m.path(&format!("big/file-{i:05}"))).unwrap();
    }
    let mut names: Vec<String> = fs::read_dir(m.path("big"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 1500);
    assert_eq!(names[0], "file-00000");
    assert_eq!(names[1499], "file-01499");
    for i in (0..1500).step_by(3) {
        fs::remove_file(m.path(&format!("big/file-{i:05}"))).unwrap();
    }
    assert_eq!(fs::read_dir(m.path("big")).unwrap().count(), 1000);
}

/// Linux names are bytes: a name that is not UTF-8 is created, listed, renamed, linked to and
/// removed like any other; long names fill readdir pages by bytes, not by count.
#[test]
fn names_are_bytes_and_long_names_list_and_remove() {
    use std::ffi::OsStr;
    use std::os::unix::fs::symlink;
    let server = MemServer::meta("16M", "1M");
    let m = Mount::new(&server, &[]);
    let latin1 = m.dir.join(OsStr::from_bytes(b"caf\xe9"));
    fs::write(&latin1, b"bytes").unwrap();
    let listed: Vec<Vec<u8>> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().as_bytes().to_vec())
        .filter(|n| n.as_slice() != b".rfs-stats")
        .collect();
    assert_eq!(listed, [b"caf\xe9".to_vec()]);
    assert_eq!(fs::read(&latin1).unwrap(), b"bytes");
    let target = OsStr::from_bytes(b"/nowhere/\xff");
    let link = m.dir.join(OsStr::from_bytes(b"l\xfe"));
    symlink(target, &link).unwrap();
    assert_eq!(fs::read_link(&link).unwrap().as_os_str(), target);
    let renamed = m.dir.join(OsStr::from_bytes(b"\x80\x81"));
    fs::rename(&latin1, &renamed).unwrap();
    fs::hard_link(&renamed, m.dir.join(OsStr::from_bytes(b"h\xc0"))).unwrap();
    assert_eq!(fs::metadata(&renamed).unwrap().nlink(), 2);

    // 500 names of 200 bytes: pages of 256 entries would not fit a 64 KiB message.
    let big = m.path("long");
    fs::create_dir(&big).unwrap();
    for i in 0..500 {
        File::create(big.join(format!("{i:03}{}", "n".repeat(197)))).unwrap();
    }
    assert_eq!(fs::read_dir(&big).unwrap().count(), 500);
    fs::remove_dir_all(&big).unwrap();
    assert!(!big.exists());
    for n in [&b"\x80\x81"[..], b"h\xc0", b"l\xfe"] {
        fs::remove_file(m.dir.join(OsStr::from_bytes(n))).unwrap();
    }
}

#[test]
fn unlinked_open_files_keep_their_data_and_unmount_is_clean() {
    let server = MemServer::meta("16M", "1M");
    let mut m = Mount::new(&server, &[]);
    let p = m.path("tmp");
    fs::write(&p, vec![5u8; 2 << 20]).unwrap();
    let mut f = File::open(&p).unwrap();
    fs::remove_file(&p).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    assert_eq!(back, vec![5u8; 2 << 20]);
    drop(f);
    assert!(m.unmount(), "fusermount3 -u and a clean exit");
}

/// A tmpfs mounted by a test, unmounted when it goes (also when the test fails).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path) -> Tmpfs {
        let out = run_child(
            Command::new("mount")
                .args(["-t", "tmpfs", "rfs-test"])
                .arg(dir),
        );
        assert!(out.unwrap().status.success(), "mount -t tmpfs");
        Tmpfs(dir.to_path_buf())
    }

    fn is_on_top(&self) -> bool {
        let path = cpath(&self.0);
        // SAFETY: a zeroed statfs is a valid buffer, the path NUL-terminated.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::statfs(path.as_ptr(), &mut st) };
        rc == 0 && st.f_type == libc::TMPFS_MAGIC
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = run_child(Command::new("umount").arg("-l").arg(&self.0));
    }
}

#[test]
fn a_mount_made_on_the_directory_after_an_unmount_stays() {
    let server = MemServer::meta("16M", "1M");
    let mut m = Mount::new(&server, &[]);
    fs::write(m.path("f"), b"x").unwrap();
    let out = run_child(Command::new("fusermount3").arg("-u").arg(&m.dir)).unwrap();
    assert!(out.status.success(), "fusermount3 -u: {out:?}");
    // At once, before the daemon has gone: what a remount, or a script, does.
    let tmpfs = Tmpfs::mount(&m.dir);
    let exit = m.wait_exit(std::time::Duration::from_secs(10));
    assert!(
        exit.is_some_and(|s| s.success()),
        "fs-client exits: {exit:?}"
    );
    assert!(
        tmpfs.is_on_top(),
        "the file system mounted since is still there"
    );
}

#[test]
fn ioctls_answer_enotty() {
    use std::os::fd::AsRawFd;
    let server = MemServer::meta("8M", "1M");
    let m = Mount::new(&server, &[]);
    let f = File::create(m.path("f")).unwrap();
    let mut termios = [0u8; 64];
    // SAFETY: TCGETS writes a termios (under 64 bytes) into the buffer.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::TCGETS, termios.as_mut_ptr()) };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
}

/// The kernel asks for a file's security.capability before a write through its page cache, to
/// drop it: the mount takes clearing set-ID bits and capabilities on itself
/// (HANDLE_KILLPRIV_V2), so the kernel asks at most once per file, not once per write (a round
/// trip through the daemon each), with or without the writeback cache, on handles that write
/// through the page cache (read-write) and around it (write-only).
#[test]
fn writes_do_not_ask_for_extended_attributes_each_time() {
    use std::os::unix::fs::FileExt;
    let server = MemServer::meta("8M", "1M");
    for opts in [&[][..], &["writeback_cache=on"]] {
        let m = Mount::new(&server, opts);
        for (name, read) in [("rw", true), ("w", false)] {
            let f = OpenOptions::new()
                .read(read)
                .write(true)
                .create(true)
                .truncate(true)
                .open(m.path(name))
                .unwrap();
            let asked = m.stat("xattr_requests");
            for i in 0..100u64 {
                f.write_all_at(&[b'x'; 4096], i * 4096).unwrap();
            }
            let asked = m.stat("xattr_requests") - asked;
            assert!(
                asked <= 1,
                "{opts:?} {name}: {asked} requests for 100 writes"
            );
        }
    }
}

fn fallocate(f: &File, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor; fallocate touches no memory of ours.
    let rc = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, len as i64) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// copy_file_range until `len` bytes are copied or the source ends: how many were.
fn copy_file_range(from: &File, at: u64, to: &File, to_at: u64, len: usize) -> usize {
    use std::os::fd::AsRawFd;
    let (mut off_in, mut off_out) = (at as i64, to_at as i64);
    let mut copied = 0;
    while copied < len {
        // SAFETY: valid descriptors and offsets that live across the call.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                len - copied,
                0,
            )
        };
        assert!(
            n >= 0,
            "copy_file_range: {}",
            std::io::Error::last_os_error()
        );
        if n == 0 {
            break;
        }
        copied += n as usize;
    }
    copied
}

#[test]
fn fallocate_and_copy_file_range_move_no_data_through_fuse() {
    let node = MemServer::meta("64M", "1M");
    let m = Mount::new(&node, &[]);
    let data: Vec<u8> = (0..(6 << 20) + 777u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    fs::write(m.path("src"), &data).unwrap();
    let src = File::open(m.path("src")).unwrap();
    let dst = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("dst"))
        .unwrap();
    let written_before = m.stat("file_bytes_written");
    // More than there is, from inside the source to an unaligned place in the destination.
    let n = copy_file_range(&src, 1000, &dst, 4097, data.len());
    assert_eq!(n, data.len() - 1000);
    assert_eq!(
        m.stat("bytes_copied"),
        n as u64,
        "copied by the client itself"
    );
    assert_eq!(
        m.stat("file_bytes_written") - written_before,
        n as u64,
        "written once, by the copy (no write through FUSE besides)"
    );
    let mut got = Vec::new();
    (&dst).read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), 4097 + n);
    assert!(got[..4097].iter().all(|&b| b == 0));
    assert!(got[4097..] == data[1000..], "the copy differs");

    // fallocate: mode 0 extends and reads zeros; KEEP_SIZE keeps the size.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("falloc"))
        .unwrap();
    fallocate(&f, 0, 0, 5 << 20).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 5 << 20);
    fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 5 << 20, 2 << 20).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 5 << 20);
    let mut model = data[..5 << 20].to_vec();
    (&f).write_all(&model).unwrap();
    // A punched hole reads zeros, the size stays; a zeroed range past the end extends.
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        (1 << 20) + 5,
        2 << 20,
    )
    .unwrap();
    model[(1 << 20) + 5..(3 << 20) + 5].fill(0);
    fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, (4 << 20) + 1, 2 << 20).unwrap();
    model.truncate((4 << 20) + 1);
    model.resize((6 << 20) + 1, 0);
    assert_eq!(f.metadata().unwrap().len(), model.len() as u64);
    drop(f);
    drop(dst);
    // Another mount sees what the first committed.
    let other = Mount::new(&node, &[]);
    assert!(
        fs::read(other.path("falloc")).unwrap() == model,
        "fallocate's result differs"
    );
    let f = OpenOptions::new()
        .write(true)
        .open(other.path("falloc"))
        .unwrap();
    let e = fallocate(&f, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 1 << 20).unwrap_err();
    assert_eq!(errno(&e), libc::EOPNOTSUPP);
    assert_eq!(m.stat("io_errors"), 0);
}

/// Bytes that differ from one `seed` to the next.
fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A handle that only writes goes around the page cache (see fs-client's `page_cache_use`):
/// readers on the same mount, by read or through a mapping made before the write, see what
/// it wrote, at unaligned offsets too, and a read-write handle's cached pages as well.
#[test]
fn writes_through_a_write_only_handle_reach_the_mounts_cached_readers() {
    use std::os::unix::fs::FileExt;
    let server = MemServer::meta("64M", "1M");
    let m = Mount::new(&server, &[]);
    let p = m.path("f");
    let mut expected = bytes(3 << 20, 1);
    fs::write(&p, &expected).unwrap(); // a create that only writes
                                       // Opened after the file changed: nothing of it is cached here now.
    let reader = File::open(&p).unwrap();
    // The whole file, unmapped below; it is not truncated while it is mapped.
    let map = rfs_e2e::map_shared(&reader, expected.len());
    let len = expected.len();
    let cached_pages = || {
        let mut resident = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `map` is a live mapping of `len` bytes, and `resident` has a byte per page.
        assert_eq!(unsafe { libc::mincore(map, len, resident.as_mut_ptr()) }, 0);
        resident.iter().filter(|&&r| r & 1 != 0).count()
    };
    let writer = OpenOptions::new().write(true).open(&p).unwrap();
    let new = bytes(1 << 20, 5);
    writer.write_all_at(&new, 1 << 20).unwrap();
    expected[1 << 20..2 << 20].copy_from_slice(&new);
    // Only where the kernel drops the pages a direct write overlaps (6.6 on; fs-client keeps
    // the page cache on older kernels).
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut version = release.split(|c: char| !c.is_ascii_digit());
    let major: u32 = version.next().unwrap().parse().unwrap();
    let minor: u32 = version.next().unwrap().parse().unwrap();
    if (major, minor) >= (6, 6) {
        assert_eq!(cached_pages(), 0, "the write went around the page cache");
    }
    let mut back = vec![0; expected.len()];
    reader.read_exact_at(&mut back, 0).unwrap();
    assert!(back == expected, "read back");
    assert!(cached_pages() > 0, "the read filled the cache");
    let both = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    both.read_exact_at(&mut back, 0).unwrap();
    // A copy each time: the kernel changes the mapped pages under us.
    let mapped = || {
        let mut copy = vec![0u8; len];
        // SAFETY: the mapping is `copy.len()` readable bytes, alive until munmap below; no
        // reference into it is kept.
        unsafe { std::ptr::copy_nonoverlapping(map as *const u8, copy.as_mut_ptr(), copy.len()) };
        copy
    };
    assert!(mapped() == expected, "mapped");
    for (at, len, seed) in [(4096 + 100, 300_000, 2u8), (0, 7, 3), (2 << 20, 1 << 20, 4)] {
        let new = bytes(len, seed);
        writer.write_all_at(&new, at as u64).unwrap();
        expected[at..at + len].copy_from_slice(&new);
        reader.read_exact_at(&mut back, 0).unwrap();
        assert!(back == expected, "read after a write at {at}");
        both.read_exact_at(&mut back, 0).unwrap();
        assert!(back == expected, "read-write handle after a write at {at}");
        assert!(mapped() == expected, "mapping after a write at {at}");
    }
    // SAFETY: unmaps the mapping made above, not used after this.
    assert_eq!(unsafe { libc::munmap(map, expected.len()) }, 0);
    drop(writer);
    assert!(fs::read(&p).unwrap() == expected, "after the close");
}

/// lseek's SEEK_DATA and SEEK_HOLE find a sparse file's data and holes (by the chunks
/// allocated, 1 MiB here), so that cp --sparse, tar and qemu-img skip the holes.
#[test]
fn seek_data_and_seek_hole_find_a_sparse_files_holes() {
    const MIB: i64 = 1 << 20;
    let server = MemServer::meta("32M", "1M");
    let m = Mount::new(&server, &[]);
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(m.path("sparse"))
        .unwrap();
    f.write_all(b"head").unwrap();
    f.set_len(8 * MIB as u64).unwrap();
    f.seek(SeekFrom::Start(5 * MIB as u64)).unwrap();
    f.write_all(b"middle").unwrap();
    drop(f);
    let f = File::open(m.path("sparse")).unwrap();
    let seek = |at: i64, whence| {
        // SAFETY: lseek on a descriptor we own.
        match unsafe { libc::lseek(std::os::unix::io::AsRawFd::as_raw_fd(&f), at, whence) } {
            -1 => Err(errno(&std::io::Error::last_os_error())),
            o => Ok(o),
        }
    };
    assert_eq!(seek(0, libc::SEEK_DATA), Ok(0));
    assert_eq!(
        seek(0, libc::SEEK_HOLE),
        Ok(MIB),
        "chunk 1 was never written"
    );
    assert_eq!(seek(MIB, libc::SEEK_DATA), Ok(5 * MIB));
    assert_eq!(seek(8 * MIB, libc::SEEK_DATA), Err(libc::ENXIO), "the end");
    let hole = seek(5 * MIB, libc::SEEK_HOLE).unwrap();
    assert!((6 * MIB..=8 * MIB).contains(&hole), "{hole}");
    let mut back = vec![0u8; 6];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 5 * MIB as u64).unwrap();
    assert_eq!(&back, b"middle");
}
