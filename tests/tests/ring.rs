//! The ring beside the mount (rfs-io): reads and writes through shared memory, the same file
//! as the mount's, and every bad request or registration refused without harm.

use std::fs;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rfs_e2e::{MemServer, Mount};
use rfs_io::Ring;

/// A ring of `m` once its service is up (it starts just after the mount).
fn ring(m: &Mount, buffer: usize, entries: u32) -> Ring {
    let start = Instant::now();
    loop {
        match Ring::connect(&m.dir, buffer, entries) {
            Ok(r) => return r,
            Err(e) if start.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("no ring at {}: {e}", m.dir.display()),
        }
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761) ^ seed) as u8)
        .collect()
}

/// Reads through the ring, one at a time and 64 in flight at random offsets, give the bytes
/// the mount wrote; what the ring writes (and commits) the mount and another mount read.
#[test]
fn the_ring_reads_and_writes_the_same_file_as_the_mount() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let other = Mount::new(&meta, &["attr_timeout=0", "entry_timeout=0"]);
    let data = pattern(3 << 20, 7);
    fs::write(m.path("f"), &data).unwrap();

    let mut r = ring(&m, 8 << 20, 64);
    let f = r.register(&fs::File::open(m.path("f")).unwrap()).unwrap();
    assert!(r.read_at(&f, 0, 3 << 20).unwrap() == data);
    assert_eq!(
        r.read_at(&f, (3 << 20) - 10, 100).unwrap(),
        data[(3 << 20) - 10..]
    );
    assert!(
        r.read_at(&f, 5 << 20, 100).unwrap().is_empty(),
        "past the end"
    );

    let offsets: Vec<u64> = (0..64u64)
        .map(|i| (i * 7919 * 4096 + i * 13) % ((3 << 20) - 4096))
        .collect();
    for (i, &off) in offsets.iter().enumerate() {
        r.prep_read(&f, off, 4096, i as u64 * 4096, i as u64)
            .unwrap();
    }
    let done = r.wait(64).unwrap();
    assert_eq!(done.len(), 64);
    for c in done {
        assert_eq!(c.result.unwrap(), 4096);
        let i = c.user_data as usize;
        let mut got = vec![0u8; 4096];
        r.copy_from_buffer(i as u64 * 4096, &mut got).unwrap();
        let off = offsets[i] as usize;
        assert!(got == data[off..off + 4096], "read {i} at {off}");
    }
    r.unregister(f).unwrap();

    // Written through the ring, committed, read through both mounts.
    let new = pattern(1 << 20, 99);
    let w = r
        .register(
            &fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(m.path("f"))
                .unwrap(),
        )
        .unwrap();
    assert_eq!(r.write_at(&w, 4096, &new).unwrap(), 1 << 20);
    r.fsync(&w).unwrap();
    let mut expect = data.clone();
    expect[4096..4096 + (1 << 20)].copy_from_slice(&new);
    for mount in [&m, &other] {
        assert!(fs::read(mount.path("f")).unwrap() == expect);
    }
    // Written through the other mount, read through the ring.
    let f2 = fs::OpenOptions::new()
        .write(true)
        .open(other.path("f"))
        .unwrap();
    f2.write_all_at(b"from the other mount", 100).unwrap();
    drop(f2);
    assert_eq!(r.read_at(&w, 100, 20).unwrap(), b"from the other mount");
    r.unregister(w).unwrap();
    assert_eq!(m.stat("io_errors"), 0);
}

/// Reads land in the application's buffer where it asked: large ones straight from the wire
/// (a registration of the buffer, no copy on the way), holes and the parts of a chunk no
/// write reached as zeros over whatever the buffer held, and nothing past what the file has.
#[test]
fn reads_land_in_the_buffer_with_the_holes_zeroed() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let f = fs::File::create(m.path("sparse")).unwrap();
    f.write_all_at(&pattern(100, 1), 0).unwrap();
    f.write_all_at(&pattern(3 << 19, 2), (1 << 20) + (64 << 10) + 300)
        .unwrap();
    f.set_len(4 << 20).unwrap();
    drop(f);
    fs::write(m.path("small"), pattern(100, 3)).unwrap();
    let want = fs::read(m.path("sparse")).unwrap();

    let mut r = ring(&m, 8 << 20, 16);
    let sparse = r
        .register(&fs::File::open(m.path("sparse")).unwrap())
        .unwrap();
    let small = r
        .register(&fs::File::open(m.path("small")).unwrap())
        .unwrap();
    let stale = vec![0xffu8; 8 << 20];
    let registered = m.stat("dynmr_registrations");
    for (offset, len, at) in [
        (0u64, 4u32 << 20, 0u64),
        (50, 3 << 20, 4096 + 7),
        ((5 << 19) + 100, 8192, 1 << 20),
        ((1 << 20) - 10, 20, 5),
    ] {
        r.copy_to_buffer(0, &stale).unwrap();
        r.prep_read(&sparse, offset, len, at, 0).unwrap();
        let n = r.wait(1).unwrap().remove(0).result.unwrap() as usize;
        assert_eq!(n, len as usize);
        let mut got = vec![0u8; 8 << 20];
        r.copy_from_buffer(0, &mut got).unwrap();
        let (o, a) = (offset as usize, at as usize);
        assert!(got[a..a + n] == want[o..o + n], "{offset}+{len} at {at}");
        assert!(
            got[..a].iter().chain(&got[a + n..]).all(|&b| b == 0xff),
            "{offset}+{len} at {at}: only where asked"
        );
    }
    assert!(
        m.stat("dynmr_registrations") > registered,
        "large reads registered the buffer"
    );
    r.copy_to_buffer(0, &stale).unwrap();
    r.prep_read(&small, 0, 1 << 20, 64, 0).unwrap();
    assert_eq!(r.wait(1).unwrap().remove(0).result.unwrap(), 100);
    let mut got = vec![0u8; 300];
    r.copy_from_buffer(0, &mut got).unwrap();
    assert!(got[64..164] == pattern(100, 3)[..]);
    assert!(got[..64].iter().chain(&got[164..]).all(|&b| b == 0xff));
    assert_eq!(m.stat("io_errors"), 0);
}

/// A ring spoken by hand, to send what rfs-io never would.
mod raw {
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};
    use std::path::Path;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    use rfs_io::layout::{Cqe, Layout, Sqe, CQ_HEAD, CQ_TAIL, SQ_TAIL};
    use rfs_io::shm::SharedMemory;
    use rfs_io::wire::{self, Reply, Request, MAX_MESSAGE};

    pub struct RawRing {
        pub sock: OwnedFd,
        pub ring: SharedMemory,
        pub buffer: SharedMemory,
        pub layout: Layout,
        pub submitted: OwnedFd,
        pub completed: OwnedFd,
        pub tail: u32,
        pub head: u32,
    }

    pub fn dial(mount: &Path) -> OwnedFd {
        let sock = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let addr = UnixAddr::new(&mount.join(rfs_io::SOCKET_NAME)).unwrap();
        connect(sock.as_raw_fd(), &addr).unwrap();
        sock
    }

    pub fn answer(sock: &OwnedFd) -> (Reply, Vec<OwnedFd>) {
        let mut buf = [0u8; MAX_MESSAGE];
        let (n, fds) = wire::recv(sock, &mut buf).unwrap();
        (Reply::decode(&buf[..n]).unwrap(), fds)
    }

    impl RawRing {
        pub fn connect(mount: &Path, buffer_len: usize, entries: u32) -> RawRing {
            let sock = dial(mount);
            let layout = Layout::new(entries, entries).unwrap();
            let ring = SharedMemory::create(c"raw-ring", layout.bytes()).unwrap();
            let buffer = SharedMemory::create(c"raw-buffer", buffer_len).unwrap();
            let hello = Request::Hello {
                layout,
                buffer_len: buffer_len as u64,
            };
            wire::send(
                &sock,
                &hello.encode(),
                &[ring.as_raw_fd(), buffer.as_raw_fd()],
            )
            .unwrap();
            let (reply, fds) = answer(&sock);
            assert!(matches!(reply, Reply::Welcome { .. }), "{reply:?}");
            let [submitted, completed]: [OwnedFd; 2] = fds.try_into().unwrap();
            RawRing {
                sock,
                ring,
                buffer,
                layout,
                submitted,
                completed,
                tail: 0,
                head: 0,
            }
        }

        /// Registers `f` (asking for writing if `write`): its number, or the errno refused.
        pub fn register(&self, f: &impl AsRawFd, write: bool) -> Result<u32, i32> {
            let req = Request::Register { write }.encode();
            wire::send(&self.sock, &req, &[f.as_raw_fd()]).unwrap();
            match answer(&self.sock).0 {
                Reply::Registered { file } => Ok(file),
                Reply::Refused { errno } => Err(errno),
                other => panic!("{other:?}"),
            }
        }

        pub fn submit(&mut self, sqes: &[Sqe]) {
            for &sqe in sqes {
                self.ring.write(self.layout.sqe_at(self.tail), sqe);
                self.tail = self.tail.wrapping_add(1);
            }
            self.ring
                .counter(SQ_TAIL)
                .store(self.tail, Ordering::Release);
            let _ = nix::unistd::write(&self.submitted, &1u64.to_ne_bytes());
        }

        /// Up to `n` completions, waiting at most `limit` for them.
        pub fn reap(&mut self, n: usize, limit: Duration) -> Vec<Cqe> {
            let start = Instant::now();
            let mut out = Vec::new();
            while out.len() < n && start.elapsed() < limit {
                let tail = self.ring.counter(CQ_TAIL).load(Ordering::Acquire);
                while self.head != tail {
                    out.push(self.ring.read(self.layout.cqe_at(self.head)));
                    self.head = self.head.wrapping_add(1);
                }
                self.ring
                    .counter(CQ_HEAD)
                    .store(self.head, Ordering::Release);
                let mut fds = [nix::poll::PollFd::new(
                    self.completed.as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(10u8));
                let _ = nix::unistd::read(&self.completed, &mut [0u8; 8]);
            }
            out
        }
    }
}

use raw::RawRing;
use rfs_io::layout::{op, Sqe};

fn read_sqe(file: u32, offset: u64, len: u32, buf_off: u64, user_data: u64) -> Sqe {
    Sqe {
        op: op::READ,
        file,
        len,
        offset,
        buf_off,
        user_data,
        ..Sqe::default()
    }
}

/// Requests rfs-io would never send complete with their errno, one by one, and the ring goes
/// on; registrations of what the application may not use through the mount are refused; a
/// submission counter run far ahead stops that ring only.
#[test]
fn bad_requests_and_registrations_are_refused_and_the_ring_goes_on() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let data = pattern(1 << 20, 3);
    fs::write(m.path("f"), &data).unwrap();
    let _ = ring(&m, 4096, 1); // the service is up
    let mut r = RawRing::connect(&m.dir, 1 << 20, 16);
    let read_only = fs::File::open(m.path("f")).unwrap();
    let f = r.register(&read_only, false).unwrap();
    let (eb, ei, ef) = (
        -libc::EBADF as i64,
        -libc::EINVAL as i64,
        -libc::EFAULT as i64,
    );
    let cases = [
        (read_sqe(f + 1000, 0, 4096, 0, 1), eb), // not registered
        (
            Sqe {
                op: op::WRITE,
                ..read_sqe(f, 0, 4096, 0, 2)
            },
            eb,
        ), // registered read-only
        (read_sqe(f, 0, 4096, (1 << 20) - 100, 3), ef), // past the buffer
        (read_sqe(f, 0, 4096, u64::MAX - 10, 4), ef), // wraps
        (read_sqe(f, 0, 64 << 20, 0, 5), ei),    // over max_io
        (
            Sqe {
                op: 9,
                ..read_sqe(f, 0, 4096, 0, 6)
            },
            ei,
        ), // no such op
        (read_sqe(f, u64::MAX - 100, 4096, 0, 7), ei), // offset wraps
        (read_sqe(f, 4096, 4096, 8192, 8), 4096), // and a good one
    ];
    r.submit(&cases.iter().map(|c| c.0).collect::<Vec<_>>());
    let mut done = r.reap(cases.len(), Duration::from_secs(10));
    done.sort_by_key(|c| c.user_data);
    let got: Vec<(u64, i64)> = done.iter().map(|c| (c.user_data, c.result)).collect();
    let want: Vec<(u64, i64)> = cases.iter().map(|c| (c.0.user_data, c.1)).collect();
    assert_eq!(got, want);
    let mut back = vec![0u8; 4096];
    assert!(r.buffer.copy_out(8192, &mut back));
    assert!(back == data[4096..8192]);

    // Registrations.
    let eb = libc::EBADF;
    assert_eq!(
        r.register(&read_only, true),
        Err(eb),
        "writing through a read-only fd"
    );
    let elsewhere = fs::File::open("/proc/self/status").unwrap();
    assert_eq!(r.register(&elsewhere, false), Err(libc::EXDEV));
    assert_eq!(
        r.register(&fs::File::open(&m.dir).unwrap(), false),
        Err(libc::EINVAL)
    );
    let path_only = nix::fcntl::open(
        &m.path("f"),
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    assert_eq!(
        r.register(&path_only, false),
        Err(eb),
        "O_PATH opens nothing"
    );

    // Hellos with memory that could shrink under fs-client, or is too short, are refused.
    let sock = raw::dial(&m.dir);
    let unsealed =
        nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    nix::unistd::ftruncate(&unsealed, 1 << 20).unwrap();
    let layout = rfs_io::layout::Layout::new(4, 4).unwrap();
    let ring_mem = rfs_io::shm::SharedMemory::create(c"r", layout.bytes()).unwrap();
    use std::os::fd::AsRawFd;
    let hello = rfs_io::wire::Request::Hello {
        layout,
        buffer_len: 1 << 20,
    };
    rfs_io::wire::send(
        &sock,
        &hello.encode(),
        &[ring_mem.as_raw_fd(), unsealed.as_raw_fd()],
    )
    .unwrap();
    assert!(matches!(
        raw::answer(&sock).0,
        rfs_io::wire::Reply::Refused {
            errno: libc::EINVAL
        }
    ));
    let sock = raw::dial(&m.dir);
    let short = rfs_io::shm::SharedMemory::create(c"s", 4096).unwrap();
    rfs_io::wire::send(
        &sock,
        &hello.encode(),
        &[ring_mem.as_raw_fd(), short.as_raw_fd()],
    )
    .unwrap();
    assert!(matches!(
        raw::answer(&sock).0,
        rfs_io::wire::Reply::Refused {
            errno: libc::EINVAL
        }
    ));

    // Without a ring, nobody can put a link of theirs where applications look for it.
    let off = Mount::new(&meta, &["ring=off"]);
    let planted = std::os::unix::fs::symlink("/tmp/elsewhere.sock", off.path(rfs_io::SOCKET_NAME));
    assert_eq!(planted.unwrap_err().raw_os_error(), Some(libc::EACCES));
    let none = Ring::connect(&off.dir, 4096, 1).unwrap_err();
    assert_eq!(none.raw_os_error(), Some(libc::ENOENT));

    // A submission counter far past what was taken: that ring takes no more; others go on.
    r.tail = r.tail.wrapping_add(1000);
    r.submit(&[read_sqe(f, 0, 4096, 0, 9)]);
    assert!(r.reap(1, Duration::from_millis(500)).is_empty());
    let mut good = ring(&m, 1 << 20, 8);
    let g = good
        .register(&fs::File::open(m.path("f")).unwrap())
        .unwrap();
    assert!(good.read_at(&g, 0, 1 << 20).unwrap() == data);
    assert_eq!(m.stat("io_errors"), 0);
}

/// Runs `ring-child` doing `what` on `file` (as `uid` if given); what it printed.
fn child(what: &str, m: &Mount, file: fs::File, uid: Option<u32>) -> String {
    child_in(what, m, file, uid.map(|u| (u, &[][..])))
}

/// [`child`] as `uid` (its gid the same) with the supplementary `groups`.
fn child_in(what: &str, m: &Mount, file: fs::File, user: Option<(u32, &[u32])>) -> String {
    use std::os::unix::process::CommandExt;
    let mut c = std::process::Command::new(rfs_e2e::bin("ring-child"));
    c.arg(what).arg(&m.dir).stdin(file);
    if let Some((uid, groups)) = user {
        let groups: Vec<libc::gid_t> = groups.to_vec();
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            c.pre_exec(move || {
                let fail = || Err(std::io::Error::last_os_error());
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(uid) != 0
                    || libc::setuid(uid) != 0
                {
                    return fail();
                }
                Ok(())
            })
        };
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "ring-child: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const NOBODY: u32 = 65534;

/// Registering opens the file again as the process: a user who was handed a descriptor of a
/// file they could not open gets EACCES; without allow_other another user cannot even connect.
#[test]
fn a_process_registers_only_what_it_could_open_itself() {
    let meta = MemServer::meta("64M", "1M");
    let shared = Mount::new(&meta, &["allow_other"]);
    fs::write(shared.path("secret"), b"root only").unwrap();
    fs::set_permissions(
        shared.path("secret"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    fs::write(shared.path("public"), b"anyone").unwrap();
    let _ = ring(&shared, 4096, 1);
    let secret = || fs::File::open(shared.path("secret")).unwrap();
    let public = || fs::File::open(shared.path("public")).unwrap();
    assert_eq!(
        child("register", &shared, secret(), None),
        "Ok(())",
        "root may"
    );
    assert_eq!(
        child("register", &shared, secret(), Some(NOBODY)),
        format!("Err(Some({}))", libc::EACCES),
        "a descriptor handed over is not a permission"
    );
    assert_eq!(child("register", &shared, public(), Some(NOBODY)), "Ok(())");
    // A group the process is in (a supplementary one, as the kernel recorded it when the
    // process connected) lets it in; without that group, the same user is refused.
    fs::write(shared.path("group"), b"group only").unwrap();
    std::os::unix::fs::chown(shared.path("group"), Some(0), Some(4242)).unwrap();
    fs::set_permissions(
        shared.path("group"),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
    let group = || fs::File::open(shared.path("group")).unwrap();
    let member = Some((NOBODY, &[4242][..]));
    assert_eq!(child_in("register", &shared, group(), member), "Ok(())");
    assert_eq!(
        child_in("register", &shared, group(), Some((NOBODY, &[4243][..]))),
        format!("Err(Some({}))", libc::EACCES),
        "not in the file's group"
    );

    let own = Mount::new(&meta, &[]);
    let _ = ring(&own, 4096, 1);
    let file = fs::File::open(own.path("public")).unwrap();
    assert_eq!(
        child("register", &own, file, Some(NOBODY)),
        format!("Err(Some({}))", libc::EACCES),
        "not allow_other: only the mounting user"
    );
}

/// A user's write through the ring clears what a write of theirs through the mount clears
/// (set-ID bits, file capabilities): the kernel sees none of these writes.
#[test]
fn a_users_ring_write_clears_set_id_bits() {
    use std::os::unix::fs::PermissionsExt;
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &["allow_other"]);
    let _ = ring(&m, 4096, 1);
    fs::write(m.path("suid"), vec![0u8; 8192]).unwrap();
    fs::set_permissions(m.path("suid"), fs::Permissions::from_mode(0o6777)).unwrap();
    let open = || {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path("suid"))
            .unwrap()
    };
    assert_eq!(
        child("write", &m, open(), None),
        "Ok(())",
        "root keeps them"
    );
    let mode = || fs::metadata(m.path("suid")).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(), 0o6777);
    assert_eq!(child("write", &m, open(), Some(NOBODY)), "Ok(())");
    assert_eq!(mode(), 0o777, "a user's write");
    assert_eq!(fs::read(m.path("suid")).unwrap()[..4096], [b'r'; 4096]);
}

/// A process that dies with reads in flight into its buffer harms nobody: its handle is
/// released once they are done, and the mount and other rings go on.
#[test]
fn a_process_dying_with_requests_in_flight_leaves_nothing_behind() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let data = pattern(16 << 20, 5);
    fs::write(m.path("f"), &data).unwrap();
    let _ = ring(&m, 4096, 1);
    let open_before = m.stat("open_files");
    for _ in 0..5 {
        let file = fs::File::open(m.path("f")).unwrap();
        assert_eq!(child("die", &m, file, None), "submitted");
    }
    rfs_e2e::within(
        Duration::from_secs(20),
        "the dead rings' handles released",
        || m.stat("open_files") == open_before,
    );
    let mut r = ring(&m, 16 << 20, 16);
    let f = r.register(&fs::File::open(m.path("f")).unwrap()).unwrap();
    assert!(r.read_at(&f, 0, 16 << 20).unwrap() == data);
    assert!(fs::read(m.path("f")).unwrap() == data);
    assert_eq!(m.stat("io_errors"), 0);
}

/// Writes through the ring are what the mount reads next, even where its page cache held the
/// file. An unregistration right after a submission either finds the write not taken yet
/// (EBADF: the file keeps what it had) or waits for it and commits it; never half of that.
/// An fsync drops the mount's pages of the file.
#[test]
fn the_mounts_page_cache_follows_ring_writes_and_unregister_waits_for_them() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let mut had = pattern(1 << 20, 1);
    fs::write(m.path("f"), &had).unwrap();
    let mut r = ring(&m, 1 << 20, 4);
    let (mut taken, mut not_taken) = (0, 0);
    for round in 0..30u64 {
        // Cached by the mount.
        assert!(fs::read(m.path("f")).unwrap() == had);
        let new = pattern(1 << 20, 100 + round);
        let rw = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(m.path("f"));
        let w = r.register(&rw.unwrap()).unwrap();
        r.copy_to_buffer(0, &new).unwrap();
        r.prep_write(&w, 0, 1 << 20, 0, round).unwrap();
        r.submit().unwrap();
        let done = match round % 3 {
            2 => {
                let done = r.wait(1).unwrap();
                r.fsync(&w).unwrap();
                r.unregister(w).unwrap();
                done
            }
            pause => {
                std::thread::sleep(Duration::from_micros(500 * pause));
                r.unregister(w).unwrap();
                r.wait(1).unwrap()
            }
        };
        match &done[0].result {
            Ok(n) => {
                assert_eq!(*n, 1 << 20);
                had = new;
                taken += 1;
            }
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EBADF), "round {round}");
                not_taken += 1;
            }
        }
        assert!(fs::read(m.path("f")).unwrap() == had, "round {round}");
    }
    println!("{taken} writes taken before their unregistration, {not_taken} not");
    let mut r2 = ring(&m, 4096, 1);
    let f = r.register(&fs::File::open(m.path("f")).unwrap()).unwrap();
    let e = r2.prep_read(&f, 0, 10, 0, 0).unwrap_err();
    assert_eq!(
        e.kind(),
        std::io::ErrorKind::InvalidInput,
        "another ring's file"
    );
}

/// Connections that never say hello give their slots back: 256 silent ones fill the mount's
/// rings for a moment, then a ring is served again. A ring whose fs-client is gone fails its
/// wait rather than hanging.
#[test]
fn silent_connections_time_out_and_a_dead_fs_client_fails_a_wait() {
    let meta = MemServer::meta("64M", "1M");
    let mut m = Mount::new(&meta, &[]);
    fs::write(m.path("f"), pattern(4096, 1)).unwrap();
    let _ = ring(&m, 4096, 1);
    let silent: Vec<_> = (0..256).map(|_| raw::dial(&m.dir)).collect();
    std::thread::sleep(Duration::from_millis(200));
    let refused = Ring::connect(&m.dir, 4096, 1).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EMFILE), "{refused}");
    let start = Instant::now();
    let mut r = ring(&m, 4096, 1);
    println!("served again after {:?}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(9));
    drop(silent);
    let f = r.register(&fs::File::open(m.path("f")).unwrap()).unwrap();
    assert_eq!(r.read_at(&f, 0, 4096).unwrap(), pattern(4096, 1));

    m.kill();
    let waited = std::thread::spawn(move || {
        r.prep_read(&f, 0, 4096, 0, 0).unwrap();
        r.wait(1).map(drop)
    });
    let start = Instant::now();
    while !waited.is_finished() {
        assert!(start.elapsed() < Duration::from_secs(10), "a wait hangs");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(waited.join().unwrap().is_err());
}

/// The C ABI and the Python module over it reach the ring: the C example copies a file
/// exactly; the Python data loader reads random samples from many files, and the checkpoint
/// writer's file reads back through the mount as written.
#[test]
fn c_and_python_use_the_ring() {
    use std::process::Command;
    let meta = MemServer::meta("128M", "1M");
    let m = Mount::new(&meta, &[]);
    let _ = ring(&m, 4096, 1);
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let lib = rfs_e2e::bin("librfs_io.so");
    let lib_dir = lib.parent().unwrap();

    let data = pattern((5 << 20) + 123, 9);
    fs::write(m.path("f"), &data).unwrap();
    let exe = std::env::temp_dir().join(format!("rfs-ring-cat-{}", std::process::id()));
    let built = Command::new("cc")
        .arg("-I")
        .arg(repo.join("io/include"))
        .arg(repo.join("io/examples/c/cat.c"))
        .arg("-L")
        .arg(lib_dir)
        .args(["-lrfs_io", "-o"])
        .arg(&exe)
        .status()
        .unwrap();
    assert!(built.success());
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", lib_dir)
        .arg(&m.dir)
        .arg("f")
        .output()
        .unwrap();
    let _ = fs::remove_file(&exe);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == data, "the C example's copy differs");

    fs::create_dir(m.path("samples")).unwrap();
    for i in 0..8 {
        fs::write(m.path(&format!("samples/{i}")), pattern(1 << 20, i)).unwrap();
    }
    let python = |args: &[&str]| {
        let out = Command::new("python3")
            .args(args)
            .env("RFS_IO_LIB", &lib)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{args:?}: {said} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        said
    };
    let loader = repo.join("io/python/examples/loader.py");
    let mount = m.dir.to_str().unwrap();
    let said = python(&[
        loader.to_str().unwrap(),
        mount,
        "samples",
        "--batches",
        "5",
        "--batch",
        "16",
    ]);
    assert!(said.contains("80 samples"), "{said}");
    let checkpoint = repo.join("io/python/examples/checkpoint.py");
    let said = python(&[
        checkpoint.to_str().unwrap(),
        mount,
        "ckpt",
        "--size",
        "16M",
        "--piece",
        "1M",
    ]);
    assert!(said.contains("same"), "{said}");
    assert_eq!(m.stat("io_errors"), 0);
}

/// Reads (and writes) of one file that follow each other, submitted together, move as one
/// transfer, and each completes with its own share: 80 adjacent 4 KiB reads across the end
/// of the file take a handful of transfers, not 80.
#[test]
fn adjacent_requests_move_as_one_transfer() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let len = 300 * 1024 + 100;
    let data = pattern(len, 4);
    fs::write(m.path("f"), &data).unwrap();
    let mut r = ring(&m, 1 << 20, 128);
    let f = r.register(&fs::File::open(m.path("f")).unwrap()).unwrap();
    let (before, taken) = (m.stat("requests"), m.stat("ring_transfers"));
    for i in 0..80u64 {
        r.prep_read(&f, i * 4096, 4096, i * 4096, i).unwrap();
    }
    let done = r.wait(80).unwrap();
    let transfers = m.stat("requests") - before;
    println!("80 adjacent reads: {transfers} transfers");
    assert!(transfers <= 8, "{transfers} transfers");
    assert!(
        m.stat("ring_transfers") - taken <= 2,
        "the ring's own count"
    );
    assert!(m.stat("ring_requests") >= 80);
    assert_eq!(m.stat("rings"), 1);
    for c in done {
        let at = c.user_data as usize * 4096;
        let want = len.saturating_sub(at).min(4096);
        assert_eq!(c.result.unwrap() as usize, want, "read {}", c.user_data);
        let mut got = vec![0u8; want];
        r.copy_from_buffer(at as u64, &mut got).unwrap();
        assert!(got == data[at.min(len)..at.min(len) + want]);
    }
    r.unregister(f).unwrap();

    let w = r
        .register(
            &fs::OpenOptions::new()
                .write(true)
                .open(m.path("f"))
                .unwrap(),
        )
        .unwrap();
    let new = pattern(16 << 16, 5);
    r.copy_to_buffer(0, &new).unwrap();
    for i in 0..16u64 {
        r.prep_write(&w, 4096 + (i << 16), 1 << 16, i << 16, i)
            .unwrap();
    }
    for c in r.wait(16).unwrap() {
        assert_eq!(c.result.unwrap(), 1 << 16);
    }
    r.fsync(&w).unwrap();
    let mut expect = data.clone();
    expect.resize(4096 + (16 << 16), 0);
    expect[4096..].copy_from_slice(&new);
    assert!(fs::read(m.path("f")).unwrap() == expect);
}

/// The ring rides out what the mount rides out: its mount's connections severed (SIGUSR1)
/// again and again, and the metadata node restarted, while reads and writes are in flight.
/// Every request completes, and every byte reads back as written.
#[test]
fn ring_io_survives_severed_connections_and_a_metadata_restart() {
    let mut meta = MemServer::durable_meta("ring-faults", &[]);
    let _data = MemServer::data(&meta, "64M", "1M");
    let m = Mount::new(&meta, &[]);
    let len = 4 << 20;
    let mut expect = pattern(len, 11);
    fs::write(m.path("f"), &expect).unwrap();
    let mut r = ring(&m, 1 << 20, 32);
    let rw = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"));
    let f = r.register(&rw.unwrap()).unwrap();
    let block = 64 << 10;
    let start = Instant::now();
    let mut round = 0u64;
    while start.elapsed() < Duration::from_secs(8) {
        round += 1;
        if round.is_multiple_of(5) {
            unsafe { libc::kill(m.pid(), libc::SIGUSR1) };
        }
        if round == 12 {
            meta.restart();
        }
        // 8 writes of new bytes and 8 reads, in flight together.
        let new = pattern(8 * block, 1000 + round);
        r.copy_to_buffer(0, &new).unwrap();
        for i in 0..8u64 {
            let at = ((round * 8 + i) * block as u64) % len as u64;
            r.prep_write(&f, at, block as u32, i * block as u64, i)
                .unwrap();
            expect[at as usize..at as usize + block]
                .copy_from_slice(&new[i as usize * block..(i as usize + 1) * block]);
        }
        for i in 0..8u64 {
            let at = ((round * 3 + i) * block as u64 + 4096) % (len - block) as u64;
            r.prep_read(&f, at, block as u32, (8 + i) * block as u64, 100 + i)
                .unwrap();
        }
        let done = r.wait(16).unwrap();
        for c in &done {
            assert_eq!(
                c.result.as_ref().unwrap(),
                &(block as u32),
                "round {round}: {}",
                c.user_data
            );
        }
    }
    r.fsync(&f).unwrap();
    r.unregister(f).unwrap();
    println!("{round} rounds");
    let fresh = Mount::new(&meta, &[]);
    assert!(fs::read(fresh.path("f")).unwrap() == expect);
    assert_eq!(m.stat("io_errors"), 0);
}

/// The ring and another mount on one file: a truncate there is what the ring reads next
/// (short, then zeros where the file grew again), and what the ring writes and commits the
/// other mount reads at its next open; close-to-open holds both ways.
#[test]
fn the_ring_sees_another_mounts_truncates_and_growth() {
    let meta = MemServer::meta("64M", "1M");
    let m = Mount::new(&meta, &[]);
    let other = Mount::new(&meta, &["attr_timeout=0", "entry_timeout=0"]);
    let data = pattern(1 << 20, 21);
    fs::write(m.path("f"), &data).unwrap();
    let mut r = ring(&m, 1 << 20, 4);
    let rw = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("f"));
    let f = r.register(&rw.unwrap()).unwrap();
    assert!(r.read_at(&f, 0, 1 << 20).unwrap() == data);

    // Cut short on the other mount: the ring's next read is short.
    let cut = fs::OpenOptions::new()
        .write(true)
        .open(other.path("f"))
        .unwrap();
    cut.set_len(4096).unwrap();
    drop(cut);
    rfs_e2e::within(Duration::from_secs(5), "the cut heard", || {
        r.read_at(&f, 0, 1 << 20).unwrap().len() == 4096
    });
    assert!(r.read_at(&f, 0, 4096).unwrap() == data[..4096]);

    // Grown again there past a hole: zeros where the cut was, then the new bytes.
    let grow = fs::OpenOptions::new()
        .write(true)
        .open(other.path("f"))
        .unwrap();
    grow.write_all_at(b"tail", 65536).unwrap();
    drop(grow);
    rfs_e2e::within(Duration::from_secs(5), "the growth heard", || {
        r.read_at(&f, 0, 1 << 20).unwrap().len() == 65540
    });
    let back = r.read_at(&f, 0, 1 << 20).unwrap();
    assert!(back[..4096] == data[..4096]);
    assert!(
        back[4096..65536].iter().all(|&b| b == 0),
        "the cut bytes stay cut"
    );
    assert_eq!(&back[65536..], b"tail");

    // Written through the ring and committed: the other mount's next open reads it.
    assert_eq!(r.write_at(&f, 100, b"ring was here").unwrap(), 13);
    r.fsync(&f).unwrap();
    let seen = fs::read(other.path("f")).unwrap();
    assert_eq!(&seen[100..113], b"ring was here");
    assert_eq!(seen.len(), 65540);
    r.unregister(f).unwrap();
}
