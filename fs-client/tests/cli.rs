//! The command line: bad input gets a message and a non-zero exit, never a mount.

use std::io::Write;
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fs-client"))
        .args(args)
        .output()
        .expect("run fs-client");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_options_are_refused_with_a_message() {
    let dir = std::env::temp_dir();
    let d = dir.to_str().unwrap();
    for (args, needle) in [
        (vec!["127.0.0.1:1", d, "-o", "max_write=4M"], "max_write"),
        (
            vec!["127.0.0.1:1", d, "-o", "nonsense"],
            "unknown mount option",
        ),
        (vec!["127.0.0.1:1", d, "--qps", "0"], "qps"),
        (vec!["127.0.0.1:1", d, "--window", "huge"], "window"),
        (vec!["stats"], "usage"),
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn an_unreachable_server_fails_cleanly() {
    let d = std::env::temp_dir();
    let (code, err) = run(&[
        "127.0.0.1:1",
        d.to_str().unwrap(),
        "-o",
        "transport=tcp,io_timeout=1",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot reach"), "{err}");
}

#[test]
fn stats_of_a_directory_that_is_not_a_mount_fails() {
    let d = std::env::temp_dir();
    let (code, err) = run(&["stats", d.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("rfs mount"), "{err}");
}

/// Another service on the port (here one that answers like a web server and closes) is told
/// apart at once, not tried again for the whole mount timeout.
#[test]
fn a_port_that_is_not_an_rfs_node_fails_at_once_and_says_so() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let _ = s.and_then(|mut s| s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n"));
        }
    });
    let d = std::env::temp_dir();
    let start = Instant::now();
    let (code, err) = run(&[&addr, d.to_str().unwrap(), "-o", "transport=tcp"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not an rfs node"), "{err}");
    assert!(err.contains("HTTP/1.1 400"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "it kept trying");
}

#[test]
fn help_says_the_defaults_and_stats_has_help() {
    let help = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_fs-client"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let main = help(&["--help"]);
    for said in ["(-o max_write) [default: 1M]", "(-o qps) [default: 4]"] {
        assert!(main.contains(said), "{said} in {main}");
    }
    assert!(help(&["stats", "--help"]).contains("Usage: fs-client stats [--json] MOUNTPOINT"));
}
