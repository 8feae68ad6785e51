//! The harness's own promises, where a broken one showed as a flaky test elsewhere.

use std::fs::File;
use std::io::Write;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rfs_e2e::{MemServer, Mount};

/// A mount starts while this process holds a file open on another mount that answers nothing
/// (its fs-client stopped; a mount whose metadata node a test kills again and again answers as
/// late). A child started by fork got a copy of the file, and its execve closed that copy: the
/// close sent the stuck mount a flush and waited for it, so the new mount "did not appear"
/// (the crash tests' reading mount, started while the other crash test's writers held files
/// open on a mount whose node was down).
#[test]
fn a_mount_starts_while_a_file_is_open_on_a_mount_that_answers_nothing() {
    let meta = MemServer::meta("16M", "1M");
    // Its own node: a change in the stuck mount's namespace would wait for its callbacks.
    let elsewhere = MemServer::meta("16M", "1M");
    let stuck = Mount::new(&meta, &[]);
    let mut held = File::create(stuck.path("held")).unwrap();
    held.write_all(b"not committed yet").unwrap();
    let pid = stuck.pid() as u32;
    rfs_e2e::stop(pid);
    // Resumed in any case, so that a failure below fails the test rather than hanging it.
    let (done, resume_by) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let _ = resume_by.recv_timeout(Duration::from_secs(40));
        rfs_e2e::resume(pid);
    });
    let start = Instant::now();
    let other = Mount::new(&elsewhere, &[]);
    std::fs::write(other.path("f"), b"x").unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "the mount took {:?}",
        start.elapsed()
    );
    let _ = done.send(());
    watchdog.join().unwrap();
    drop(held);
    assert_eq!(
        std::fs::read(stuck.path("held")).unwrap(),
        b"not committed yet"
    );
}
