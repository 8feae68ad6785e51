//! Who may use the file system: authentication on by default, and a local user without the
//! secret kept out.

use std::os::unix::process::CommandExt;
use std::process::Command;

use rfs_e2e::{bin, MemServer, Mount};

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
            .args(["-o", "transport=tcp"])
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
