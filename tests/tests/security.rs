//! Who may use the file system: authentication on by default, and a local user without the
//! secret kept out.

use std::os::unix::process::CommandExt;
use std::process::Command;

use rfs_e2e::{bin, transport, MemServer, Mount};

const NOBODY: u32 = 65534;

#[test]
fn a_user_without_the_secret_is_refused() {
    let node = MemServer::meta("16M", "1M");
    // root, reading the node's secret at the default path, mounts.
    let m = Mount::new(&node, &[]);
    std::fs::write(m.path("private"), b"root's data").unwrap();
    let dir = std::env::temp_dir().join(format!("rfs-nobody-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let attempt = |opts: &[&str]| {
        let mut c = Command::new(bin("fs-client"));
        c.arg(node.addr.to_string())
            .arg(&dir)
            .args(["-o", &format!("transport={}", transport())])
            .args(opts)
            .env("HOME", &dir)
            .env_remove("XDG_CONFIG_HOME")
            .uid(NOBODY)
            .gid(NOBODY);
        c.output().unwrap()
    };
    // Its own default path holds no secret: the node refuses it and says how to get one.
    let out = attempt(&[]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("requires its shared secret"), "{said}");
    // root's secret is not readable to it.
    let out = attempt(&["-o", "secret_file=/etc/rfs/secret"]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("ermission denied"), "{said}");
    // A secret of its own making is the wrong one.
    let own = dir.join("guess");
    std::fs::write(&own, "guess\n").unwrap();
    std::os::unix::fs::chown(&own, Some(NOBODY), Some(NOBODY)).unwrap();
    std::fs::set_permissions(&own, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = attempt(&["-o", &format!("secret_file={}", own.display())]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("refused our secret"), "{said}");
    assert_eq!(std::fs::read(m.path("private")).unwrap(), b"root's data");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `sh -c script` as uid/gid 65534; (success, stderr).
fn as_nobody(script: &str) -> (bool, String) {
    as_user(NOBODY, script)
}

fn as_user(uid: u32, script: &str) -> (bool, String) {
    let out = Command::new("sh")
        .args(["-c", script])
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn another_user_gets_what_the_mode_bits_give_as_on_a_local_file_system() {
    let node = MemServer::meta("16M", "1M");
    let m = Mount::new(&node, &["allow_other"]);
    let secret = m.path("secret");
    let shared = m.path("shared");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::write(&shared, b"everyone reads").unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let (s, p) = (secret.display(), shared.display());
    let (ok, err) = as_nobody(&format!("cat {s}"));
    assert!(!ok && err.contains("Permission denied"), "{err}");
    let (ok, err) = as_nobody(&format!("cat {p}"));
    assert!(ok, "{err}");
    for write in [
        format!("echo x >> {p}"),
        format!("truncate -s 0 {p}"),
        format!("chmod 666 {p}"),
    ] {
        let (ok, err) = as_nobody(&write);
        assert!(!ok, "{write} succeeded");
        assert!(
            err.contains("Permission denied") || err.contains("not permitted"),
            "{write}: {err}"
        );
    }
    assert_eq!(std::fs::read(&shared).unwrap(), b"everyone reads");
    assert_eq!(std::fs::read(&secret).unwrap(), b"root only");
    // Made writable for everyone, it is.
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let (ok, err) = as_nobody(&format!("echo more >> {p}"));
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(&shared).unwrap(), b"everyone readsmore\n");
    // A program others may run but not read (0711) runs, as on a local file system.
    let tool = m.path("tool");
    std::fs::copy("/bin/true", &tool).unwrap();
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    let t = tool.display();
    let (ok, err) = as_nobody(&format!("{t}"));
    assert!(ok, "running it: {err}");
    let (ok, _) = as_nobody(&format!("cat {t} > /dev/null"));
    assert!(!ok, "reading it");
}

/// Under root squash a client's root is nobody at the metadata node, but its kernel still lets
/// root through every directory: the node checks the directory's bits. Before, squashed root
/// listed, made, removed and moved files in another user's 0700 directory.
#[test]
fn squashed_root_neither_lists_makes_removes_nor_moves_in_a_directory_closed_to_nobody() {
    // Squashed root could not open the root directory up: the node does at start.
    let node = MemServer::start(&["--memory", "16M", "--root-squash", "--root-mode", "1777"]);
    let m = Mount::new(&node, &["allow_other"]);
    let d = m.path("d");
    let (ok, err) = as_user(
        1000,
        &format!(
            "mkdir {0} && chmod 700 {0} && echo a > {0}/a && echo b > {0}/b",
            d.display()
        ),
    );
    assert!(ok, "{err}");
    let denied = |what: &str, r: std::io::Result<()>| {
        let e = r.expect_err(what);
        assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{what}: {e}");
    };
    let listed = std::fs::read_dir(&d).and_then(|names| names.collect::<Result<Vec<_>, _>>());
    denied("list", listed.map(drop));
    denied("create", std::fs::write(d.join("planted"), b"x"));
    denied("mkdir", std::fs::create_dir(d.join("sub")));
    denied("symlink", std::os::unix::fs::symlink("a", d.join("l")));
    denied("unlink", std::fs::remove_file(d.join("b")));
    denied("rename", std::fs::rename(d.join("a"), m.path("taken")));
    let (ok, err) = as_user(1000, &format!("cat {0}/a {0}/b && ls {0}", d.display()));
    assert!(ok, "the owner still has both: {err}");
    // What squashed root makes in the open root directory is nobody's.
    std::fs::write(m.path("mine"), b"x").unwrap();
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(m.path("mine")).unwrap());
    assert_eq!(owner, NOBODY);
}

#[test]
fn another_users_write_truncate_or_fallocate_clears_the_set_id_bits() {
    use std::os::unix::fs::PermissionsExt;
    let node = MemServer::meta("16M", "1M");
    let m = Mount::new(&node, &["allow_other"]);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    // How another user changes the file: write-only descriptors go around the page cache.
    let changes = [
        (
            "dd of={} bs=1 count=1 conv=notrunc status=none < /dev/zero",
            "write-only",
        ),
        ("echo more >> {}", "write-only O_APPEND"),
        ("printf x 1<> {}", "read-write"),
        ("truncate -s 1 {}", "truncate"),
        ("fallocate -l 8192 {}", "fallocate"),
    ];
    for (n, (how, what)) in changes.iter().enumerate() {
        // Set-group-ID without group execute marks mandatory locking: it stays, as on Linux.
        for (before, after) in [(0o4777, 0o777), (0o6777, 0o777), (0o6767, 0o2767)] {
            let f = m.path(&format!("f{n}-{before:o}"));
            std::fs::write(&f, b"data").unwrap();
            std::fs::set_permissions(&f, PermissionsExt::from_mode(before)).unwrap();
            let script = how.replace("{}", &f.display().to_string());
            let (ok, err) = as_nobody(&script);
            assert!(ok, "{what}: {err}");
            assert_eq!(
                mode(&f),
                after,
                "{what} by another user of a {before:o} file"
            );
            std::fs::remove_file(&f).unwrap();
        }
    }
    // root (CAP_FSETID) keeps them.
    let f = m.path("root-writes");
    std::fs::write(&f, b"data").unwrap();
    std::fs::set_permissions(&f, PermissionsExt::from_mode(0o6777)).unwrap();
    let (ok, err) = as_user(0, &format!("echo more >> {}", f.display()));
    assert!(ok, "{err}");
    assert_eq!(mode(&f), 0o6777);
}

/// The TCP sockets process `pid` holds, from /proc/net/tcp{,6}: (local port, remote port,
/// listening).
fn tcp_sockets(pid: u32) -> Vec<(u16, u16, bool)> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if inodes.contains(f[9]) {
                out.push((port(f[1]), port(f[2]), f[3] == "0A"));
            }
        }
    }
    out
}

/// Every connection of a node comes to its one listen port, a node's own links to another
/// node included, and a mount listens on nothing: a firewall names one port per node, and no
/// listener exists for a local user to connect to before the peer it waits for.
#[test]
fn every_connection_goes_to_a_nodes_one_port_and_a_mount_listens_on_nothing() {
    let meta = MemServer::meta("8M", "1M");
    let data = MemServer::data(&meta, "8M", "1M");
    let m = Mount::new(&meta, &[]);
    // Chunks on both nodes: a data session to each.
    let bytes: Vec<u8> = (0..6 << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(m.path("f"), &bytes).unwrap();
    assert!(std::fs::read(m.path("f")).unwrap() == bytes);
    let ports = [meta.addr.port(), data.addr.port()];
    let mount = tcp_sockets(m.pid() as u32);
    assert!(mount.iter().all(|s| !s.2), "the mount listens: {mount:?}");
    assert!(
        mount.iter().all(|s| ports.contains(&s.1)),
        "a mount's connection goes elsewhere than a node's port: {mount:?} (ports {ports:?})"
    );
    if transport() == "tcp" {
        assert!(
            mount.len() >= 3 + 2 * 2,
            "queue pairs of their own: {mount:?}"
        );
    }
    for node in [&meta, &data] {
        let socks = tcp_sockets(node.pid());
        let listening: Vec<_> = socks.iter().filter(|s| s.2).collect();
        assert_eq!(listening.len(), 1, "node {}: {socks:?}", node.addr);
        assert_eq!(listening[0].0, node.addr.port());
        assert!(
            socks
                .iter()
                .all(|s| s.2 || ports.contains(&s.0) || ports.contains(&s.1)),
            "node {}: a connection to neither node's port: {socks:?}",
            node.addr
        );
    }
}

/// A node run with --encrypt serves a mount that encrypts (a file through a data node of its
/// own too: the node's own queue pairs to it are encrypted as well), and a mount that would
/// not is refused with what to do. On verbs the node refuses --encrypt at start.
#[test]
fn an_encrypting_node_serves_encrypting_mounts_and_tells_others_what_to_do() {
    if transport() != "tcp" {
        return;
    }
    let meta = MemServer::start(&["--memory", "4M", "--chunk-size", "1M", "--encrypt"]);
    let m = meta.addr.to_string();
    let _data = MemServer::start(&[
        "--memory",
        "8M",
        "--chunk-size",
        "1M",
        "--join",
        &m,
        "--encrypt",
    ]);
    let mount = Mount::new(&meta, &["encrypt"]);
    let bytes: Vec<u8> = (0..9 << 20).map(|i| (i * 31 % 253) as u8).collect();
    std::fs::write(mount.path("f"), &bytes).unwrap();
    assert!(std::fs::read(mount.path("f")).unwrap() == bytes);

    let dir = std::env::temp_dir().join(format!("rfs-clear-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(bin("fs-client"))
        .arg(&m)
        .arg(&dir)
        .args(["-o", &format!("transport={},mount_timeout=2", transport())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("-o encrypt"), "{said}");
    let _ = std::fs::remove_dir(&dir);
}

/// An encrypted mount through its failure paths: its metadata connection severed (SIGUSR1)
/// every 0.3 s and the metadata node killed and restarted mid-way, while a writer makes,
/// writes and fsyncs files: every file whose fsync was answered reads back whole, through a
/// fresh encrypted mount.
#[test]
fn an_encrypted_mount_keeps_every_fsynced_file_through_severs_and_a_restart() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    if transport() != "tcp" {
        return;
    }
    const FILES: usize = 150;
    let mut meta = MemServer::durable_meta("encrypted-severs", &["--encrypt"]);
    let m = meta.addr.to_string();
    let _data = MemServer::start(&[
        "--memory",
        "256M",
        "--chunk-size",
        "1M",
        "--join",
        &m,
        "--encrypt",
    ]);
    let mount = Mount::new(&meta, &["encrypt"]);
    let content =
        |i: usize| -> Vec<u8> { (0..4096 * (1 + i % 9)).map(|b| (b * 7 + i) as u8).collect() };
    let done = AtomicBool::new(false);
    let (kept, severs) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut kept = Vec::new();
            for i in 0..FILES {
                let path = mount.path(&format!("f{i}"));
                let written = std::fs::File::create(path).and_then(|mut f| {
                    f.write_all(&content(i))?;
                    f.sync_all()
                });
                if written.is_ok() {
                    kept.push(i);
                }
                // Spread over the severs and the restart.
                std::thread::sleep(Duration::from_millis(40));
            }
            done.store(true, Ordering::Relaxed);
            kept
        });
        let mut severs = 0;
        while !done.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: a signal to our own child process: it severs its metadata connection.
            unsafe { libc::kill(mount.pid(), libc::SIGUSR1) };
            severs += 1;
            if severs == 8 {
                meta.restart();
            }
        }
        (writer.join().unwrap(), severs)
    });
    assert!(
        severs > 8,
        "the writer was done after {severs} severs, before the restart"
    );
    assert!(
        kept.len() >= FILES / 2,
        "only {} of {FILES} files written",
        kept.len()
    );
    let fresh = Mount::new(&meta, &["encrypt"]);
    for i in kept {
        let got = std::fs::read(fresh.path(&format!("f{i}"))).unwrap();
        assert!(got == content(i), "f{i}: {} bytes back", got.len());
    }
}
