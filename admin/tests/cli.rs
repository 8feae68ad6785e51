//! The admin binary's answers to bad input: a clear message, a distinct exit status, no wait.
//! (What it prints for a live cluster is tested end to end in rfs-e2e's cluster tests.)

use std::io::Write;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn rfs(args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_rfs"))
        .args(args)
        .output()
        .expect("run rfs");
    (out, started.elapsed())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A secret file with the modes the secret rules accept.
fn secret_file() -> std::path::PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let path = std::env::temp_dir().join(format!("rfs-admin-cli-{}.secret", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .expect("create secret file");
    f.write_all(b"a secret for the admin cli tests\n")
        .expect("write secret");
    path
}

#[test]
fn a_node_that_refuses_the_connection_is_named_at_once() {
    let secret = secret_file();
    let (out, took) = rfs(&[
        "status",
        "127.0.0.1:1",
        "--transport",
        "tcp",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_file(&secret);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot reach 127.0.0.1:1"),
        "{}",
        stderr(&out)
    );
    assert!(out.stdout.is_empty(), "nothing on stdout for a failure");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn a_missing_secret_file_is_a_usage_error() {
    let (out, _) = rfs(&[
        "status",
        "127.0.0.1:1",
        "--secret-file",
        "/nonexistent/rfs-admin-secret",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("/nonexistent/rfs-admin-secret"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn unknown_commands_and_missing_addresses_are_usage_errors() {
    for args in [&["bogus"][..], &["status"][..], &[][..]] {
        let (out, _) = rfs(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains("Usage"), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn help_names_every_command() {
    let (out, _) = rfs(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("status"), "{text}");
}
