//! FUSE over io_uring through real mounts: requests that come through the rings mean what they
//! mean through /dev/fuse, and a kernel that does not offer the rings gets /dev/fuse.
//!
//! One test flips the kernel's global `enable_uring` switch, so every scenario lives in it
//! (tests run in parallel); the switch is put back as it was, even on failure.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rfs_e2e::{errno, MemServer, Mount};

const SWITCH: &str = "/sys/module/fuse/parameters/enable_uring";

/// Sets the kernel's switch and puts the old value back when dropped.
struct UringSwitch {
    before: String,
}

impl UringSwitch {
    /// None when this kernel has no FUSE over io_uring (or the switch cannot be written).
    fn take() -> Option<UringSwitch> {
        let before = fs::read_to_string(SWITCH).ok()?;
        fs::write(SWITCH, before.trim()).ok()?;
        Some(UringSwitch {
            before: before.trim().to_string(),
        })
    }

    fn set(&self, on: bool) {
        fs::write(SWITCH, if on { "1" } else { "0" }).expect("write enable_uring");
    }
}

impl Drop for UringSwitch {
    fn drop(&mut self) {
        let _ = fs::write(SWITCH, &self.before);
    }
}

fn possible_cpus() -> u64 {
    let list = fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    fs_client::uring::possible_cpus(&list).unwrap() as u64
}

/// Pins the calling thread to one CPU: the kernel picks a request's ring by the CPU its
/// caller runs on, so this spreads requests over the queues.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity take it by
    // pointer and only for the call.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Names, links, sizes and data, each checked against what it must be.
fn namespace_and_data(m: &Mount) {
    fs::create_dir(m.path("d")).unwrap();
    let a = m.path("d/a");
    fs::write(&a, b"hello").unwrap();
    assert_eq!(fs::read(&a).unwrap(), b"hello");
    let mut f = OpenOptions::new().write(true).open(&a).unwrap();
    f.seek(SeekFrom::Start(3)).unwrap();
    f.write_all(b"LO world").unwrap();
    drop(f);
    assert_eq!(fs::read(&a).unwrap(), b"helLO world");
    assert_eq!(fs::metadata(&a).unwrap().len(), 11);

    // A name that is not UTF-8, a symlink, a hard link and a rename.
    let odd = m.path("d").join(std::ffi::OsStr::from_bytes(b"caf\xe9"));
    fs::write(&odd, b"odd").unwrap();
    std::os::unix::fs::symlink("a", m.path("d/s")).unwrap();
    assert_eq!(fs::read_link(m.path("d/s")).unwrap(), PathBuf::from("a"));
    fs::hard_link(&a, m.path("d/h")).unwrap();
    fs::rename(m.path("d/h"), m.path("d/h2")).unwrap();
    let mut names: Vec<Vec<u8>> = fs::read_dir(m.path("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().as_bytes().to_vec())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            b"a".to_vec(),
            b"caf\xe9".to_vec(),
            b"h2".to_vec(),
            b"s".to_vec()
        ]
    );
    assert_eq!(fs::read(&odd).unwrap(), b"odd");
    assert_eq!(
        errno(&fs::read(m.path("d/nope")).unwrap_err()),
        libc::ENOENT
    );
    assert_eq!(
        errno(&fs::remove_dir(m.path("d")).unwrap_err()),
        libc::ENOTEMPTY
    );

    // Whole-buffer writes and reads (1 MiB requests fill a ring entry's payload), and a
    // truncate.
    let big = pattern(7, 8 << 20);
    fs::write(m.path("big"), &big).unwrap();
    assert!(
        fs::read(m.path("big")).unwrap() == big,
        "8 MiB file differs"
    );
    let f = OpenOptions::new().write(true).open(m.path("big")).unwrap();
    f.set_len(3 << 20).unwrap();
    drop(f);
    let mut back = Vec::new();
    File::open(m.path("big"))
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == big[..3 << 20], "truncated file differs");
    for n in ["d/a", "d/s", "d/h2"] {
        fs::remove_file(m.path(n)).unwrap();
    }
    fs::remove_file(&odd).unwrap();
    fs::remove_dir(m.path("d")).unwrap();
}

/// Threads on every CPU, more of them than a queue has entries, each writing and reading its
/// own file with O_DIRECT against a model: requests queue in the kernel behind busy entries
/// and replies come from transport threads.
fn racing_direct_io(m: &Mount, threads: usize) {
    let cpus = possible_cpus() as usize;
    std::thread::scope(|s| {
        for t in 0..threads {
            let path = m.path(&format!("t{t}"));
            s.spawn(move || {
                pin_to(t % cpus);
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&path)
                    .unwrap();
                let blocks = 64u64;
                let mut model = vec![0u8; (blocks * 4096) as usize];
                f.set_len(blocks * 4096).unwrap();
                let mut buf = AlignedBlock::new();
                for i in 0..400u64 {
                    let b = (i * 37 + t as u64 * 11) % blocks;
                    let at = (b * 4096) as usize;
                    if i % 3 == 0 {
                        buf.0.copy_from_slice(&pattern(i + 1000 * t as u64, 4096));
                        f.write_all_at(&buf.0, b * 4096).unwrap();
                        model[at..at + 4096].copy_from_slice(&buf.0);
                    } else {
                        f.read_exact_at(&mut buf.0, b * 4096).unwrap();
                        assert!(
                            buf.0[..] == model[at..at + 4096],
                            "thread {t}: block {b} differs after {i} operations"
                        );
                    }
                }
            });
        }
    });
}

#[repr(C, align(4096))]
struct AlignedBlock([u8; 4096]);

impl AlignedBlock {
    fn new() -> Box<AlignedBlock> {
        Box::new(AlignedBlock([0; 4096]))
    }
}

fn settle_unmount(mut m: Mount, dir: &Path) {
    assert!(m.unmount(), "fs-client did not exit cleanly after unmount");
    assert!(!rfs_e2e::is_mounted(dir));
}

#[test]
fn requests_through_io_uring_mean_what_they_mean_through_dev_fuse() {
    let server = MemServer::meta("512M", "1M");
    let switch = UringSwitch::take();

    // Without the kernel's consent the option falls back to /dev/fuse.
    if let Some(s) = &switch {
        s.set(false);
    }
    let m = Mount::new(&server, &["io_uring"]);
    fs::write(m.path("plain"), b"through /dev/fuse").unwrap();
    assert_eq!(fs::read(m.path("plain")).unwrap(), b"through /dev/fuse");
    assert_eq!(m.stat("fuse_ring_entries"), 0);
    assert_eq!(m.stat("fuse_ring_requests"), 0);
    let dir = m.dir.clone();
    settle_unmount(m, &dir);
    let Some(switch) = switch else {
        eprintln!("this kernel has no FUSE over io_uring: only the fallback was tested");
        return;
    };

    switch.set(true);
    let depth = 4;
    let m = Mount::new(&server, &["io_uring", &format!("uring_depth={depth}")]);
    assert_eq!(
        m.stat("fuse_ring_entries"),
        possible_cpus() * depth,
        "every CPU's queue registered its entries"
    );
    let before = m.stat("fuse_ring_requests");
    assert_eq!(fs::read(m.path("plain")).unwrap(), b"through /dev/fuse");
    namespace_and_data(&m);
    racing_direct_io(&m, 4 * depth as usize);
    let served = m.stat("fuse_ring_requests") - before;
    assert!(
        served > 4 * depth * 400 / 2,
        "only {served} requests came through the rings"
    );
    // Nothing hangs while the kernel tears the rings down.
    let dir = m.dir.clone();
    let start = std::time::Instant::now();
    settle_unmount(m, &dir);
    assert!(start.elapsed() < Duration::from_secs(10));
}
