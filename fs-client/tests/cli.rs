//! The command line: bad input gets a message and a non-zero exit, never a mount.

use std::process::Command;

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
