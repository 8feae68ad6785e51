//! File locks across mounts: flock and fcntl locks taken on one mount keep processes on
//! another out, carry the data written under them to the next holder, end with the holder's
//! close or death, and outlive a metadata node restart.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::thread::JoinHandleExt;
use std::time::{Duration, Instant};

use rfs_e2e::{errno, within, MemServer, Mount};

fn flock(f: &File, op: i32) -> io::Result<()> {
    // SAFETY: flock on a descriptor we own; no memory is passed.
    match unsafe { libc::flock(f.as_raw_fd(), op) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// fcntl's `cmd` (F_SETLK, F_SETLKW, F_GETLK) with a lock of `kind` over `len` bytes at
/// `start`: the lock as the kernel left it (F_GETLK fills it in).
fn fcntl_lock(f: &File, cmd: i32, kind: i32, start: i64, len: i64) -> io::Result<libc::flock> {
    // SAFETY: an all-zero flock is a valid value of this plain C struct.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: fcntl reads and (F_GETLK) writes the flock we pass, which outlives the call.
    match unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut fl) } {
        -1 => Err(io::Error::last_os_error()),
        _ => Ok(fl),
    }
}

fn open_rw(path: impl AsRef<std::path::Path>) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap()
}

/// Two processes on two mounts append numbered lines to one file, each line under an
/// exclusive flock, through descriptors they keep open: every line is the one after the last
/// one the other wrote (no two held the lock at once, and each saw the other's lines).
#[test]
fn two_mounts_never_hold_one_flock_at_once_and_each_sees_what_the_other_wrote_under_it() {
    const ROUNDS: usize = 60;
    let server = MemServer::meta("32M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &[]);
    fs::write(a.path("counter"), b"").unwrap();
    let append = |m: &Mount, who: char| {
        let mut f = OpenOptions::new()
            .read(true)
            .append(true)
            .open(m.path("counter"))
            .unwrap();
        for _ in 0..ROUNDS {
            flock(&f, libc::LOCK_EX).unwrap();
            let mut text = String::new();
            f.seek(SeekFrom::Start(0)).unwrap();
            f.read_to_string(&mut text).unwrap();
            let next = text.lines().count();
            writeln!(f, "{next} {who}").unwrap();
            flock(&f, libc::LOCK_UN).unwrap();
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| append(&a, 'a'));
        s.spawn(|| append(&b, 'b'));
    });
    let text = fs::read_to_string(b.path("counter")).unwrap();
    let numbers = rfs_e2e::line_numbers(&text);
    assert_eq!(
        numbers,
        (0..2 * ROUNDS).collect::<Vec<_>>(),
        "every line follows the last one written, by either mount:\n{text}"
    );
    assert!(text.contains(" a\n") && text.contains(" b\n"));
}

/// Appends under a lock through O_RDWR|O_APPEND descriptors kept open on two mounts, with
/// nothing read in between: the kernel appends at the size it has cached without asking, so
/// each mount overwrote the other's lines (half of them lost); none is lost now.
#[test]
fn appends_under_a_lock_through_descriptors_that_also_read_lose_nothing() {
    const ROUNDS: usize = 40;
    let server = MemServer::meta("16M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &[]);
    fs::write(a.path("log"), b"").unwrap();
    let append = |m: &Mount, who: char| {
        let mut f = OpenOptions::new()
            .read(true)
            .append(true)
            .open(m.path("log"))
            .unwrap();
        for i in 0..ROUNDS {
            flock(&f, libc::LOCK_EX).unwrap();
            writeln!(f, "{who} {i}").unwrap();
            flock(&f, libc::LOCK_UN).unwrap();
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| append(&a, 'a'));
        s.spawn(|| append(&b, 'b'));
    });
    for (k, m) in [&a, &b].into_iter().enumerate() {
        let text = fs::read_to_string(m.path("log")).unwrap();
        for who in ['a', 'b'] {
            let lines: Vec<String> = (0..ROUNDS).map(|i| format!("{who} {i}")).collect();
            let mine: Vec<&str> = text.lines().filter(|l| l.starts_with(who)).collect();
            if mine != lines {
                // A mount that cached nothing tells a stale view from a lost line.
                let fresh = Mount::new(&server, &[]);
                let file = fs::read_to_string(fresh.path("log")).unwrap();
                panic!(
                    "mount {k}'s view lacks lines of {who}; the file, through a fresh mount, \
                     {}:\n{text}",
                    match file == text {
                        true => "is the same".to_string(),
                        false => format!("is:\n{file}"),
                    }
                );
            }
        }
    }
}

/// fcntl's byte-range locks: a conflicting range is refused on the other mount, F_GETLK names
/// the lock in the way, a range beside it is free, shared locks go together, and a close
/// drops the process's locks on the file.
#[test]
fn byte_range_locks_of_two_mounts_exclude_each_other_and_a_close_drops_them() {
    let server = MemServer::meta("16M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &[]);
    fs::write(a.path("ranges"), vec![0u8; 4096]).unwrap();
    let fa = open_rw(a.path("ranges"));
    let fb = open_rw(b.path("ranges"));
    fcntl_lock(&fa, libc::F_SETLK, libc::F_WRLCK, 100, 10).unwrap();
    let refused = fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 105, 10).unwrap_err();
    assert!(
        [libc::EAGAIN, libc::EACCES].contains(&errno(&refused)),
        "{refused}"
    );
    let seen = fcntl_lock(&fb, libc::F_GETLK, libc::F_RDLCK, 0, 0).unwrap();
    assert_eq!(
        (seen.l_type as i32, seen.l_start, seen.l_len),
        (libc::F_WRLCK, 100, 10),
        "F_GETLK names a's lock"
    );
    fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();
    fcntl_lock(&fb, libc::F_SETLK, libc::F_RDLCK, 200, 10).unwrap();
    fcntl_lock(&fa, libc::F_SETLK, libc::F_RDLCK, 200, 10).expect("shared with b");
    // a lets its write lock go by shrinking it, then closes the file.
    fcntl_lock(&fa, libc::F_SETLK, libc::F_UNLCK, 100, 5).unwrap();
    fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 100, 5).unwrap();
    assert!(fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 105, 5).is_err());
    drop(fa);
    fcntl_lock(&fb, libc::F_SETLK, libc::F_WRLCK, 105, 100).expect("a's close dropped them");
    let free = fcntl_lock(&fb, libc::F_GETLK, libc::F_WRLCK, 0, 0).unwrap();
    assert_eq!(free.l_type as i32, libc::F_UNLCK, "only b's own locks");
}

extern "C" fn ignore(_: libc::c_int) {}

/// A lock that must wait (flock without LOCK_NB, F_SETLKW) is taken once the other mount's
/// holder lets go (before the holder can take it back), and a signal ends the wait with EINTR
/// as it would on one machine.
#[test]
fn a_waiting_lock_is_taken_when_the_other_mount_lets_go_and_a_signal_ends_the_wait() {
    let server = MemServer::meta("16M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &[]);
    fs::write(a.path("queue"), b"").unwrap();
    let fa = open_rw(a.path("queue"));
    flock(&fa, libc::LOCK_EX).unwrap();

    let fb = open_rw(b.path("queue"));
    let started = Instant::now();
    let waiter =
        std::thread::spawn(move || flock(&fb, libc::LOCK_EX).map(|()| (started.elapsed(), fb)));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiter.is_finished(), "b waits while a holds it");
    flock(&fa, libc::LOCK_UN).unwrap();
    let e = flock(&fa, libc::LOCK_EX | libc::LOCK_NB).unwrap_err();
    assert_eq!(
        errno(&e),
        libc::EWOULDBLOCK,
        "b waited first: it is kept for b"
    );
    let (waited, fb) = waiter.join().unwrap().expect("taken once a let go");
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(
        flock(&fa, libc::LOCK_EX | libc::LOCK_NB).is_err(),
        "b holds it"
    );

    // A handler without SA_RESTART: the signal interrupts the wait.
    // SAFETY: installs a handler that does nothing, for a signal nothing else here uses.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = ignore as *const () as usize;
        assert_eq!(
            libc::sigaction(libc::SIGUSR2, &act, std::ptr::null_mut()),
            0
        );
    }
    let fa2 = open_rw(a.path("queue"));
    let interrupted = std::thread::spawn(move || flock(&fa2, libc::LOCK_EX));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!interrupted.is_finished(), "a waits while b holds it");
    // SAFETY: the thread is alive (not finished, not joined) while we signal it.
    assert_eq!(
        unsafe { libc::pthread_kill(interrupted.as_pthread_t(), libc::SIGUSR2) },
        0
    );
    let e = interrupted.join().unwrap().unwrap_err();
    assert_eq!(errno(&e), libc::EINTR, "{e}");
    assert!(
        flock(&fa, libc::LOCK_EX | libc::LOCK_NB).is_err(),
        "the interrupted wait took nothing; b still holds it"
    );
    // The kernel sends the release that lets a flock go after close(2) returns.
    drop(fb);
    within(Duration::from_secs(2), "b's last close let it go", || {
        flock(&fa, libc::LOCK_EX | libc::LOCK_NB).is_ok()
    });
}

/// A mount that dies holding a lock loses it once the metadata node ends its session (twice
/// the lease), not before: its process may only be slow.
#[test]
fn a_killed_mounts_locks_go_with_its_session() {
    let server = MemServer::start(&["--memory", "16M", "--chunk-size", "1M", "--lease", "1"]);
    let a = Mount::new(&server, &[]);
    let mut b = Mount::new(&server, &[]);
    fs::write(a.path("held"), b"").unwrap();
    let fb = open_rw(b.path("held"));
    flock(&fb, libc::LOCK_EX).unwrap();
    let fa = open_rw(a.path("held"));
    let start = Instant::now();
    b.kill();
    std::mem::forget(fb); // its mount is gone: a close would only fail
    assert!(flock(&fa, libc::LOCK_EX | libc::LOCK_NB).is_err());
    within(
        Duration::from_secs(15),
        "the lock is free after the grace",
        || flock(&fa, libc::LOCK_EX | libc::LOCK_NB).is_ok(),
    );
    let freed = start.elapsed();
    assert!(
        freed >= Duration::from_millis(1500),
        "freed before the grace: {freed:?}"
    );
}

/// A metadata node that restarts knows no locks; the mounts that held them take them again
/// within its grace period, during which nobody else may take one.
#[test]
fn locks_outlive_a_metadata_node_restart() {
    let mut meta = MemServer::durable_meta("locks", &["--lease", "2"]);
    let _data = MemServer::data(&meta, "32M", "1M");
    let a = Mount::new(&meta, &["io_timeout=1"]);
    let b = Mount::new(&meta, &["io_timeout=1"]);
    // flock and fcntl locks of one file are one kind here, as on NFS: two files.
    fs::write(a.path("flocked"), b"x").unwrap();
    fs::write(a.path("ranged"), b"x").unwrap();
    let (fa, ra) = (open_rw(a.path("flocked")), open_rw(a.path("ranged")));
    let (fb, rb) = (open_rw(b.path("flocked")), open_rw(b.path("ranged")));
    flock(&fa, libc::LOCK_EX).unwrap();
    fcntl_lock(&ra, libc::F_SETLK, libc::F_WRLCK, 0, 1).unwrap();
    meta.restart_after(Duration::from_millis(300));
    let e = flock(&fb, libc::LOCK_EX | libc::LOCK_NB).unwrap_err();
    assert_eq!(errno(&e), libc::EWOULDBLOCK, "a took its flock again: {e}");
    assert!(fcntl_lock(&rb, libc::F_SETLK, libc::F_WRLCK, 0, 1).is_err());
    flock(&fa, libc::LOCK_UN).unwrap();
    flock(&fb, libc::LOCK_EX | libc::LOCK_NB).expect("a let it go");
    drop(ra);
    fcntl_lock(&rb, libc::F_SETLK, libc::F_WRLCK, 0, 1).expect("a's close dropped it");
    assert_eq!(a.stat("locks_lost"), 0);
}

/// A process that locks and unlocks in a loop does not starve a process on another mount that
/// waits for the same lock: waiters take it in the order they asked, and are told at once when
/// it goes.
#[test]
fn a_mount_locking_in_a_loop_does_not_starve_another_mounts_waiter() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let server = MemServer::meta("16M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &[]);
    fs::write(a.path("busy"), b"").unwrap();
    let stop = AtomicBool::new(false);
    let turns = |m: &Mount| {
        let f = open_rw(m.path("busy"));
        let mut n = 0u32;
        while !stop.load(Ordering::Relaxed) {
            flock(&f, libc::LOCK_EX).unwrap();
            std::thread::sleep(Duration::from_millis(2));
            flock(&f, libc::LOCK_UN).unwrap();
            n += 1;
        }
        n
    };
    let (na, nb) = std::thread::scope(|s| {
        let ta = s.spawn(|| turns(&a));
        let tb = s.spawn(|| turns(&b));
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        (ta.join().unwrap(), tb.join().unwrap())
    });
    println!("turns in 3 s: a {na}, b {nb}");
    assert!(
        na.min(nb) >= 10 && na.min(nb) * 3 >= na.max(nb),
        "both mounts take turns: a {na}, b {nb}"
    );
}
