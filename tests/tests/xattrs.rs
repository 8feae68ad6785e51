//! Extended attributes through real mounts: xattr(7)'s semantics, who may reach which, two
//! mounts seeing each other's changes, a metadata node restart, `cp -a` to and from tmpfs, and
//! the set-ID bits the writeback cache leaves to the file system.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use rfs_e2e::{MemServer, Mount};

const NOBODY: u32 = 65534;

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

fn set(p: &Path, name: &str, value: &[u8], flags: i32) -> Result<(), i32> {
    let name = CString::new(name).unwrap();
    // SAFETY: valid NUL-terminated strings and a buffer of `value.len()` bytes.
    let r = unsafe {
        libc::lsetxattr(
            c(p).as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// The value of `name` read into a buffer of `room` bytes (0: its size, as an empty vector of
/// that length).
fn get_in(p: &Path, name: &str, room: usize) -> Result<Vec<u8>, i32> {
    let name = CString::new(name).unwrap();
    let mut buf = vec![0u8; room];
    // SAFETY: valid strings, and a buffer of `room` bytes (none when 0).
    let n = unsafe { libc::lgetxattr(c(p).as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), room) };
    if n < 0 {
        return Err(errno());
    }
    if room == 0 {
        return Ok(vec![0; n as usize]);
    }
    buf.truncate(n as usize);
    Ok(buf)
}

fn get(p: &Path, name: &str) -> Result<Vec<u8>, i32> {
    get_in(p, name, 1 << 17)
}

fn list(p: &Path) -> Vec<String> {
    let mut buf = vec![0u8; 1 << 17];
    // SAFETY: a valid path and a buffer of its length.
    let n = unsafe { libc::llistxattr(c(p).as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "listxattr: {}", errno());
    let mut names: Vec<String> = buf[..n as usize]
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    names.sort();
    names
}

fn remove(p: &Path, name: &str) -> Result<(), i32> {
    let name = CString::new(name).unwrap();
    // SAFETY: valid NUL-terminated strings.
    match unsafe { libc::lremovexattr(c(p).as_ptr(), name.as_ptr()) } {
        0 => Ok(()),
        _ => Err(errno()),
    }
}

#[test]
fn extended_attributes_keep_xattr7s_semantics() {
    let meta = MemServer::meta("32M", "1M");
    let m = Mount::new(&meta, &[]);
    let f = m.path("f");
    std::fs::write(&f, b"data").unwrap();
    assert_eq!(get(&f, "user.a"), Err(libc::ENODATA));
    assert_eq!(list(&f), Vec::<String>::new());
    set(&f, "user.a", b"1", 0).unwrap();
    assert_eq!(
        set(&f, "user.a", b"2", libc::XATTR_CREATE),
        Err(libc::EEXIST)
    );
    assert_eq!(
        set(&f, "user.b", b"2", libc::XATTR_REPLACE),
        Err(libc::ENODATA)
    );
    set(&f, "user.a", b"one", libc::XATTR_REPLACE).unwrap();
    // Values are bytes, up to 64 KiB; the caller sizes its buffer first.
    let value: Vec<u8> = (0..65536u32).map(|i| (i * 7 + 1) as u8).collect();
    set(&f, "user.big", &value, 0).unwrap();
    assert_eq!(get(&f, "user.big").unwrap(), value);
    assert_eq!(get_in(&f, "user.big", 0).unwrap().len(), 65536);
    assert_eq!(get_in(&f, "user.big", 100), Err(libc::ERANGE));
    assert_eq!(set(&f, "user.huge", &vec![0; 65537], 0), Err(libc::E2BIG));
    set(&f, "user.empty", b"", 0).unwrap();
    assert_eq!(get(&f, "user.empty").unwrap(), b"");
    set(&f, "trusted.t", b"root's", 0).unwrap();
    set(&f, "security.s", b"\xff\x00", 0).unwrap();
    assert_eq!(
        list(&f),
        [
            "security.s",
            "trusted.t",
            "user.a",
            "user.big",
            "user.empty"
        ]
    );
    assert_eq!(set(&f, "bogus.x", b"", 0), Err(libc::EOPNOTSUPP));
    // A hard link is the same inode; a rename keeps them; so does the data.
    std::fs::hard_link(&f, m.path("g")).unwrap();
    std::fs::rename(&f, m.path("h")).unwrap();
    assert_eq!(get(&m.path("g"), "user.a").unwrap(), b"one");
    assert_eq!(get(&m.path("h"), "security.s").unwrap(), b"\xff\x00");
    remove(&m.path("h"), "user.a").unwrap();
    assert_eq!(remove(&m.path("g"), "user.a"), Err(libc::ENODATA));
    assert_eq!(get(&m.path("g"), "user.a"), Err(libc::ENODATA));
    // Directories take them; a symbolic link takes no user ones.
    set(&m.dir, "user.dir", b"d", 0).unwrap();
    assert_eq!(get(&m.dir, "user.dir").unwrap(), b"d");
    std::os::unix::fs::symlink("h", m.path("l")).unwrap();
    assert_eq!(set(&m.path("l"), "user.a", b"x", 0), Err(libc::EPERM));
    assert_eq!(m.stat("io_errors"), 0);
}

/// Runs `python3 -c script PATH` as nobody; its stdout, or its stderr on failure.
fn as_nobody(script: &str, path: &Path) -> Result<String, String> {
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(path)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    match out.status.success() {
        true => Ok(text(&out.stdout)),
        false => Err(text(&out.stderr)),
    }
}

/// The mode bits decide `user.` attributes, `trusted.` ones are root's (and not listed for
/// anyone else), `security.` ones anyone reads and only root sets.
#[test]
fn a_user_reaches_only_the_attributes_the_rules_give_them() {
    let meta = MemServer::meta("32M", "1M");
    let m = Mount::new(&meta, &["allow_other"]);
    let f = m.path("f");
    std::fs::write(&f, b"data").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    set(&f, "user.a", b"1", 0).unwrap();
    set(&f, "trusted.t", b"2", 0).unwrap();
    set(&f, "security.s", b"3", 0).unwrap();
    let read = "import os,sys; print(os.getxattr(sys.argv[1], 'user.a'), \
                os.getxattr(sys.argv[1], 'security.s'), sorted(os.listxattr(sys.argv[1])))";
    assert_eq!(
        as_nobody(read, &f).unwrap(),
        "b'1' b'3' ['security.s', 'user.a']"
    );
    for (script, errno) in [
        (
            "import os,sys; os.setxattr(sys.argv[1], 'user.a', b'x')",
            "Permission denied",
        ),
        (
            "import os,sys; os.removexattr(sys.argv[1], 'user.a')",
            "Permission denied",
        ),
        (
            "import os,sys; os.setxattr(sys.argv[1], 'trusted.t', b'x')",
            "Operation not permitted",
        ),
        (
            "import os,sys; os.getxattr(sys.argv[1], 'trusted.t')",
            "No data available",
        ),
        (
            "import os,sys; os.setxattr(sys.argv[1], 'security.s', b'x')",
            "Operation not permitted",
        ),
    ] {
        let said = as_nobody(script, &f).unwrap_err();
        assert!(said.contains(errno), "{script}: {said}");
    }
    assert_eq!(get(&f, "user.a").unwrap(), b"1");
    assert_eq!(get(&f, "trusted.t").unwrap(), b"2");
    // Writable by anyone: anyone sets user attributes.
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o666)).unwrap();
    let write = "import os,sys; os.setxattr(sys.argv[1], 'user.a', b'nobody'); print('ok')";
    assert_eq!(as_nobody(write, &f).unwrap(), "ok");
    assert_eq!(get(&f, "user.a").unwrap(), b"nobody");
}

/// What one mount changes, another that read the attributes sees next (the metadata node's
/// callback drops its copy), and a restarted metadata node still has them all.
#[test]
fn mounts_see_each_others_changes_and_a_restart_keeps_them() {
    let mut meta = MemServer::durable_meta("xattrs", &[]);
    let _data = MemServer::data(&meta, "32M", "1M");
    let a = Mount::new(&meta, &["io_timeout=2"]);
    let b = Mount::new(&meta, &["io_timeout=2"]);
    std::fs::write(a.path("f"), b"data").unwrap();
    let (fa, fb) = (a.path("f"), b.path("f"));
    set(&fa, "user.v", b"first", 0).unwrap();
    assert_eq!(get(&fb, "user.v").unwrap(), b"first");
    assert_eq!(get(&fb, "user.none"), Err(libc::ENODATA));
    let calls = b.stat("metadata_ops");
    for _ in 0..20 {
        assert_eq!(get(&fb, "user.v").unwrap(), b"first");
        assert_eq!(get(&fb, "user.none"), Err(libc::ENODATA));
    }
    assert!(
        b.stat("metadata_ops") - calls < 5,
        "answered from what the mount kept"
    );
    for round in 0..20 {
        let v = format!("value {round}");
        set(&fa, "user.v", v.as_bytes(), 0).unwrap();
        set(&fa, "user.none", b"now", 0).unwrap();
        assert_eq!(get(&fb, "user.v").unwrap(), v.as_bytes(), "round {round}");
        assert_eq!(get(&fb, "user.none").unwrap(), b"now");
        remove(&fa, "user.none").unwrap();
        assert_eq!(get(&fb, "user.none"), Err(libc::ENODATA), "round {round}");
        assert_eq!(list(&fb), ["user.v"]);
    }
    set(&fa, "user.kept", &[9; 4096], 0).unwrap();
    meta.restart();
    for m in [&a, &b] {
        assert_eq!(get(&m.path("f"), "user.kept").unwrap(), [9; 4096]);
        assert_eq!(get(&m.path("f"), "user.v").unwrap(), b"value 19");
    }
    std::fs::remove_file(&fa).unwrap();
    std::fs::write(&fa, b"new").unwrap();
    assert_eq!(list(&fb), Vec::<String>::new(), "a new file has none");
}

/// `cp -a` carries them to the mount and back, as it does between local file systems.
#[test]
fn cp_a_carries_them_both_ways() {
    let meta = MemServer::meta("32M", "1M");
    let m = Mount::new(&meta, &[]);
    let local = std::env::temp_dir().join(format!("rfs-xattr-{}", std::process::id()));
    let tree = local.join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    std::fs::write(tree.join("sub/file"), b"bytes").unwrap();
    let names = [("user.one", b"1".to_vec()), ("user.bin", vec![0, 255, 10])];
    for (n, v) in &names {
        set(&tree.join("sub/file"), n, v, 0).unwrap();
        set(&tree.join("sub"), n, v, 0).unwrap();
    }
    let cp = |from: &Path, to: &Path| {
        let out = Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    cp(&tree, &m.path("tree"));
    cp(&m.path("tree"), &local.join("back"));
    for (n, v) in &names {
        for p in ["tree/sub/file", "tree/sub"] {
            assert_eq!(get(&m.path(p), n).as_ref(), Ok(v), "{p} {n} on the mount");
        }
        for p in ["back/sub/file", "back/sub"] {
            assert_eq!(get(&local.join(p), n).as_ref(), Ok(v), "{p} {n} back");
        }
    }
    let _ = std::fs::remove_dir_all(&local);
}

/// A valid `security.capability` value (version 2: CAP_NET_RAW permitted and effective).
const CAPABILITIES: [u8; 20] = [
    1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

/// With the kernel's writeback cache, clearing set-ID bits is the file system's: a truncate,
/// a fallocate and a write by a user, and a chown clear them (as Linux does, and as the kernel
/// does without it), and a user's write takes the file capabilities away.
#[test]
fn truncates_and_chowns_clear_set_id_bits_with_or_without_the_writeback_cache() {
    let meta = MemServer::meta("32M", "1M");
    for opts in [&["allow_other"][..], &["allow_other", "writeback_cache=on"]] {
        let m = Mount::new(&meta, opts);
        let f = m.path("suid");
        let mode = || std::fs::metadata(&f).unwrap().permissions().mode() & 0o7777;
        let chmod = |mode| std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode));
        std::fs::write(&f, b"#!/bin/sh\n").unwrap();
        chmod(0o6777).unwrap();
        let cut = "import os,sys; os.truncate(sys.argv[1], 3); print('ok')";
        assert_eq!(as_nobody(cut, &f).unwrap(), "ok");
        assert_eq!(mode(), 0o777, "{opts:?}: a user's truncate");
        chmod(0o4777).unwrap();
        let grow = "import os,sys; fd = os.open(sys.argv[1], os.O_WRONLY); \
                    os.posix_fallocate(fd, 0, 8192); print('ok')";
        assert_eq!(as_nobody(grow, &f).unwrap(), "ok");
        assert_eq!(mode(), 0o777, "{opts:?}: a user's fallocate");
        chmod(0o4755).unwrap();
        std::os::unix::fs::chown(&f, Some(NOBODY), None).unwrap();
        assert_eq!(mode(), 0o755, "{opts:?}: a chown");
        // A user's write (O_DIRECT: around the page cache, which the kernel leaves to us
        // either way) takes the capabilities away; and so does a buffered one.
        for flags in ["os.O_WRONLY | os.O_DIRECT", "os.O_WRONLY"] {
            std::os::unix::fs::chown(&f, Some(0), None).unwrap();
            chmod(0o666).unwrap();
            set(&f, "security.capability", &CAPABILITIES, 0).unwrap();
            assert_eq!(get(&f, "security.capability").unwrap(), CAPABILITIES);
            let write = format!(
                "import os,sys,mmap; fd = os.open(sys.argv[1], {flags}); \
                 b = mmap.mmap(-1, 4096); b.write(b'x' * 4096); os.write(fd, b); print('ok')"
            );
            assert_eq!(as_nobody(&write, &f).unwrap(), "ok", "{opts:?} {flags}");
            assert_eq!(
                get(&f, "security.capability"),
                Err(libc::ENODATA),
                "{opts:?} {flags}: a user's write"
            );
        }
        std::fs::remove_file(&f).unwrap();
    }
}

/// A mount whose connection to the metadata node was cut misses the callbacks meanwhile: what
/// it kept of the attributes goes, and it reads what another mount set while it was away.
#[test]
fn a_mount_that_lost_its_connection_does_not_serve_what_it_kept() {
    let meta = MemServer::meta("32M", "1M");
    let a = Mount::new(&meta, &[]);
    let b = Mount::new(&meta, &["io_timeout=2"]);
    std::fs::write(a.path("f"), b"data").unwrap();
    let (fa, fb) = (a.path("f"), b.path("f"));
    for round in 0..5 {
        set(&fa, "user.v", format!("before {round}").as_bytes(), 0).unwrap();
        assert_eq!(
            get(&fb, "user.v").unwrap(),
            format!("before {round}").as_bytes()
        );
        assert_eq!(get(&fb, "user.new"), Err(libc::ENODATA));
        let back = b.stat("reconnections");
        // SAFETY: a signal to our own child process: it severs its metadata connection.
        unsafe { libc::kill(b.pid(), libc::SIGUSR1) };
        // At once: the node's callbacks find the connection gone.
        set(&fa, "user.v", format!("after {round}").as_bytes(), 0).unwrap();
        set(&fa, "user.new", b"set while away", 0).unwrap();
        rfs_e2e::within(std::time::Duration::from_secs(20), "reconnected", || {
            b.stat("reconnections") > back
        });
        assert_eq!(
            get(&fb, "user.v").unwrap(),
            format!("after {round}").as_bytes()
        );
        assert_eq!(get(&fb, "user.new").unwrap(), b"set while away");
        remove(&fa, "user.new").unwrap();
    }
    assert_eq!(b.stat("io_errors"), 0);
}
