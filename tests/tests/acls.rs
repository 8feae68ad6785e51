//! POSIX ACLs through real mounts, side by side with tmpfs: the same `setfacl` script leaves
//! the same `getfacl` output and mode bits on both, the same users are let in and refused, a
//! second mount sees a change at once, a restarted metadata node keeps them, and `cp -a` and
//! `rsync -aAX` carry them to the mount and back.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rfs_e2e::{within, MemServer, Mount};

/// A tmpfs of its own (it keeps ACLs as a local file system does), unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn new(name: &str) -> Tmpfs {
        let dir = std::env::temp_dir().join(format!("rfs-acl-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        sh(&dir, "mount -t tmpfs -o size=16m,mode=0755 tmpfs .").unwrap();
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Runs `script` with `sh -e` in `dir`; its stdout, or its stderr on failure.
fn sh(dir: &Path, script: &str) -> Result<String, String> {
    let out = Command::new("sh")
        .args(["-ec", script])
        .current_dir(dir)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    match out.status.success() {
        true => Ok(text(&out.stdout)),
        false => Err(text(&out.stderr)),
    }
}

/// Runs `script` in `dir` as `uid` (its own group, and `groups` besides): whether it worked.
fn as_user(dir: &Path, uid: u32, groups: &str, script: &str) -> bool {
    let groups = match groups {
        "" => "--clear-groups".to_string(),
        g => format!("--groups={g}"),
    };
    let run = format!("setpriv --reuid={uid} --regid={uid} {groups} sh -c '{script}' 2>/dev/null");
    sh(dir, &run).is_ok()
}

/// ACLs on files and directories as a project directory shares them: named users and groups,
/// a mask moved by chmod, default ACLs inherited (the umask ignored under them), entries
/// removed, a minimal ACL folded into the mode, set-group-ID cleared for a non-member.
const SCRIPT: &str = "
umask 022
mkdir -p shared/sub
echo data > shared/f
echo data > plain
setfacl -m u:2000:rw,g:3000:r,u:4000:- shared/f
chmod 640 shared/f
setfacl -m d:u:2000:rwx,d:g:3000:rx,d:o::- shared
setfacl -m u:2000:rx shared
umask 077
echo new > shared/new
mkdir shared/newdir
echo deep > shared/newdir/deep
mkfifo shared/fifo
umask 022
setfacl -m m::rwx shared/new
setfacl -x g:3000 shared/f
echo min > minimal
setfacl -m u::rwx,g::r-x,o::r-- minimal
echo gone > gone
setfacl -m u:2000:rw gone
setfacl -b gone
echo zero > zero
setfacl -m u:2000:rw,u:3000:- zero
chmod 604 zero
setfacl -k zero
setfacl -x u:9999 plain
chmod 2775 shared/sub
chgrp 5000 shared/sub
setfacl -m u:2000:rwx shared/sub
";

/// What the script leaves: every file's ACL as getfacl prints it, and its mode bits.
fn state(dir: &Path) -> String {
    sh(
        dir,
        "find . -print0 | sort -z | xargs -0 getfacl -n -p; find . -printf '%m %p\\n' | sort",
    )
    .unwrap()
}

/// Who may do what there: one line per (user, action), "yes" or "no".
fn decisions(dir: &Path) -> Vec<String> {
    let users = [(2000, ""), (3000, "3000"), (4000, ""), (6000, "5000")];
    let actions = [
        "cat shared/f",
        "echo x >> shared/f",
        "cat shared/new",
        "echo x >> shared/new",
        "ls shared",
        "cat shared/newdir/deep",
        "touch shared/made-by-user",
        "cat plain",
        "cat gone",
        "echo x >> gone",
        "touch shared/sub/x",
        "cat zero",
        "echo x >> zero",
    ];
    let mut out = Vec::new();
    for (uid, groups) in users {
        for a in actions {
            let ok = as_user(dir, uid, groups, a);
            out.push(format!("{uid} {a}: {}", if ok { "yes" } else { "no" }));
        }
    }
    out
}

#[test]
fn acls_read_and_decide_as_on_tmpfs() {
    let meta = MemServer::meta("32M", "1M");
    let m = Mount::new(&meta, &["allow_other"]);
    let tmpfs = Tmpfs::new("same");
    // Below the roots: the mount's has names of its own (its statistics).
    let (local, mounted) = (tmpfs.0.join("t"), m.path("t"));
    for dir in [&local, &mounted] {
        std::fs::create_dir(dir).unwrap();
        sh(dir, SCRIPT).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    let want = state(&local);
    assert!(want.contains("user:2000:rw-"), "{want}");
    assert_eq!(state(&mounted), want);
    let want = decisions(&local);
    assert!(want.iter().any(|d| d.ends_with("yes")) && want.iter().any(|d| d.ends_with("no")));
    assert_eq!(decisions(&mounted), want);
    // What users made under the default ACL, both sides alike.
    assert_eq!(state(&mounted), state(&local));
    // Only the owner sets an ACL; anyone reads it.
    assert!(!as_user(
        &mounted,
        2000,
        "",
        "setfacl -m u:2000:rwx shared/f"
    ));
    assert!(as_user(&mounted, 2000, "", "getfacl shared/f"));
    assert_eq!(m.stat("io_errors"), 0);
}

/// A change made on one mount holds on the other at once (the other's kernel forgets the
/// ACL it checked with), and a restarted metadata node has every ACL it answered.
#[test]
fn a_second_mount_decides_by_the_acl_as_it_is_now_and_a_restart_keeps_them() {
    let mut meta = MemServer::durable_meta("acls", &[]);
    let _data = MemServer::data(&meta, "32M", "1M");
    let a = Mount::new(&meta, &["allow_other", "io_timeout=2"]);
    let b = Mount::new(&meta, &["allow_other", "io_timeout=2"]);
    sh(&a.dir, "echo data > f; chmod 600 f; mkdir d; chmod 700 d").unwrap();
    let reads = |m: &Mount| as_user(&m.dir, 2000, "", "cat f");
    let lists = |m: &Mount| as_user(&m.dir, 2000, "", "ls d");
    assert!(!reads(&b));
    for round in 0..5 {
        sh(&a.dir, "setfacl -m u:2000:r f; setfacl -m u:2000:rx d").unwrap();
        assert!(reads(&b), "round {round}: granted on a");
        assert!(lists(&b), "round {round}");
        sh(&a.dir, "chmod 600 f").unwrap();
        assert!(!reads(&b), "round {round}: the mask moved on a");
        sh(&a.dir, "setfacl -x u:2000 f; setfacl -x u:2000 d").unwrap();
        assert!(!reads(&b), "round {round}: taken away on a");
        assert!(!lists(&b), "round {round}");
    }
    sh(
        &a.dir,
        "setfacl -m u:2000:r f; setfacl -m u:2000:x,d:u:2000:rw d",
    )
    .unwrap();
    let before = sh(&b.dir, "getfacl -n f d").unwrap();
    meta.restart();
    for m in [&a, &b] {
        assert_eq!(sh(&m.dir, "getfacl -n f d").unwrap(), before);
        assert!(reads(m));
    }
    sh(&b.dir, "umask 077; touch d/new").unwrap();
    assert!(as_user(&a.dir, 2000, "", "echo x >> d/new"), "inherited");
}

/// `cp -a` and `rsync -aAX` carry ACLs to the mount and back, as between local file systems.
#[test]
fn cp_a_and_rsync_carry_them_both_ways() {
    let meta = MemServer::meta("32M", "1M");
    let m = Mount::new(&meta, &[]);
    let local = Tmpfs::new("copy");
    sh(&local.0, &format!("mkdir src; cd src; {SCRIPT}")).unwrap();
    let want = state(&local.0.join("src"));
    let mount = m.dir.display();
    let here = local.0.display();
    sh(
        &local.0,
        &format!("cp -a src {mount}/by-cp; rsync -aAX src/ {mount}/by-rsync/"),
    )
    .unwrap();
    for copy in ["by-cp", "by-rsync"] {
        assert_eq!(state(&m.path(copy)), want, "{copy} on the mount");
    }
    sh(
        &m.dir,
        &format!("cp -a by-cp {here}/back-cp; rsync -aAX by-rsync/ {here}/back-rsync/"),
    )
    .unwrap();
    for back in ["back-cp", "back-rsync"] {
        assert_eq!(state(&local.0.join(back)), want, "{back}");
    }
}

/// A mount whose metadata connection was cut (SIGUSR1) missed the callbacks meanwhile: an ACL
/// entry taken away, or one given, on another mount holds on it too once it is back, within
/// the half lease that bounds what such a mount may serve (the kernel's own copy).
#[test]
fn a_mount_that_lost_its_connection_decides_by_the_acl_as_it_is_now() {
    let meta = MemServer::meta("32M", "1M");
    let a = Mount::new(&meta, &["allow_other"]);
    let b = Mount::new(&meta, &["allow_other", "io_timeout=2"]);
    sh(&a.dir, "echo data > f; chmod 640 f").unwrap();
    let reads = |m: &Mount| as_user(&m.dir, 2000, "", "cat f");
    for round in 0..3 {
        sh(&a.dir, "setfacl -m u:2000:r f").unwrap();
        assert!(reads(&b), "round {round}: granted");
        let back = b.stat("reconnections");
        // SAFETY: a signal to our own child process: it severs its metadata connection.
        unsafe { libc::kill(b.pid(), libc::SIGUSR1) };
        sh(&a.dir, "setfacl -x u:2000 f").unwrap();
        within(Duration::from_secs(20), "reconnected", || {
            b.stat("reconnections") > back
        });
        let since = Instant::now();
        within(
            Duration::from_secs(6),
            "taken away while b was cut off",
            || !reads(&b),
        );
        eprintln!(
            "round {round}: refused {:?} after the reconnection",
            since.elapsed()
        );
        let back = b.stat("reconnections");
        // SAFETY: as above.
        unsafe { libc::kill(b.pid(), libc::SIGUSR1) };
        sh(&a.dir, "setfacl -m u:2000:r f").unwrap();
        within(Duration::from_secs(20), "reconnected", || {
            b.stat("reconnections") > back
        });
        within(Duration::from_secs(6), "given while b was cut off", || {
            reads(&b)
        });
        sh(&a.dir, "setfacl -x u:2000 f").unwrap();
        assert!(!reads(&b), "round {round}: taken away with b connected");
    }
    assert_eq!(b.stat("io_errors"), 0);
}
