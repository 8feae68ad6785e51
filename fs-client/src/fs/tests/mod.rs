//! The file system's logic against the in-memory fake: split reads and writes, holes,
//! close-to-open between two clients, cache invalidation, allocate-ahead and failed pieces.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use rfs_proto::locks::{FileLock, LockKind, TO_END};
use rfs_proto::message::RequestOp;
use rfs_proto::types::{Attr, AttrChanges, Caller, FileAccess, FileKind, Ino, Owner, ROOT};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::Errno;

use super::fake::{Fake, FakeCluster, CHUNK};
use super::{FsConfig, Result, Rfs};

mod answers;
mod behind;
mod closes;
mod cuts;
mod data;
mod handles;
mod landing;
mod locks;
mod misc;
mod owed;
mod pages;
mod parity;

fn client(cluster: &Arc<FakeCluster>) -> Arc<Rfs<Fake>> {
    client_with(cluster, FsConfig::default())
}

fn client_with(cluster: &Arc<FakeCluster>, cfg: FsConfig) -> Arc<Rfs<Fake>> {
    Arc::new(Rfs::new(Fake(cluster.clone()), cfg).expect("statfs"))
}

/// Write-behind on, with up to 1 MiB in flight.
const BEHIND: FsConfig = FsConfig {
    write_behind: 1 << 20,
    writeback_cache: false,
    rpc_timeout: std::time::Duration::ZERO,
    io_timeout: std::time::Duration::ZERO,
    hard: false,
};

const RW: FileAccess = FileAccess::READ.union(FileAccess::WRITE);

const ROOT_CALLER: Caller = Caller {
    uid: 0,
    gid: 0,
    groups: Vec::new(),
};

const OWNER: Owner = Owner {
    perm: 0o644,
    uid: 0,
    gid: 0,
    umask: 0,
};

fn create(fs: &Rfs<Fake>, name: &str) -> Ino {
    fs.mknod(
        ROOT,
        name.as_bytes(),
        FileKind::RegularFile,
        0,
        OWNER,
        &ROOT_CALLER,
    )
    .unwrap()
    .ino
}

/// The fake answers in place, so the callbacks have run when these return.
fn write(fs: &Arc<Rfs<Fake>>, ino: Ino, offset: u64, data: &[u8]) -> Result<u32> {
    let (tx, rx) = mpsc::channel();
    fs.write(ino, offset, data, Box::new(move |r| tx.send(r).unwrap()));
    rx.recv().unwrap()
}

fn read(fs: &Arc<Rfs<Fake>>, ino: Ino, offset: u64, len: usize) -> Result<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    fs.read(
        ino,
        offset,
        len,
        Box::new(move |r: Result<&[u8]>| tx.send(r.map(<[u8]>::to_vec)).unwrap()),
    );
    rx.recv().unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A truncate (or growth) of `ino` to `size`, by root.
fn resize(fs: &Arc<Rfs<Fake>>, ino: Ino, size: u64) -> Result<Attr> {
    let changes = AttrChanges {
        size: Some(size),
        ..AttrChanges::default()
    };
    fs.setattr(ino, changes, &ROOT_CALLER)
}

/// A file of `len` bytes written and committed through a handle still open: (the file, the
/// handle, its bytes).
fn committed_file(fs: &Arc<Rfs<Fake>>, len: u64) -> (Ino, u64, Vec<u8>) {
    let ino = create(fs, "f");
    let fh = fs.open(ino, RW, &ROOT_CALLER).unwrap().0;
    let data = pattern(len as usize, 9);
    write(fs, ino, 0, &data).unwrap();
    fs.commit(ino).unwrap();
    (ino, fh, data)
}

/// Grows `ino`, cut at `cut`, to a chunk: its bytes before the cut are `data`'s, and zeros
/// after (not the old bytes past the cut).
fn assert_grows_with_zeros_past(fs: &Arc<Rfs<Fake>>, ino: Ino, cut: u64, data: &[u8]) {
    resize(fs, ino, CHUNK).unwrap();
    let back = read(fs, ino, 0, CHUNK as usize).unwrap();
    assert!(back[..cut as usize] == data[..cut as usize]);
    assert!(
        back[cut as usize..].iter().all(|&b| b == 0),
        "grown past the cut: the old bytes are back"
    );
}

/// A write through write-behind: the receiver gets its answer.
fn write_behind(
    fs: &Arc<Rfs<Fake>>,
    ino: Ino,
    offset: u64,
    data: &[u8],
    sync: bool,
) -> mpsc::Receiver<Result<u32>> {
    let (tx, rx) = mpsc::channel();
    fs.write_behind(
        ino,
        offset,
        data,
        sync,
        Box::new(move |r| tx.send(r).unwrap()),
    );
    rx
}

/// Runs `f` on a thread; the receiver gets its result.
fn in_background<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || drop(tx.send(f())));
    rx
}

/// A commit of `ino` that a fake's hook starts on another thread while a first commit is on
/// its way: `hook` (for `before_next_commit` or `after_next_answer`) runs `first`, starts the
/// commit and gives it a moment; `result` waits for its outcome.
struct SideCommit(Arc<Mutex<Option<mpsc::Receiver<Result<()>>>>>);

impl SideCommit {
    fn hook(
        fs: &Arc<Rfs<Fake>>,
        ino: Ino,
        first: impl FnOnce(&Arc<Rfs<Fake>>) + Send + 'static,
    ) -> (SideCommit, Box<dyn FnOnce() + Send>) {
        let slot = Arc::new(Mutex::new(None));
        let (fs, started) = (fs.clone(), slot.clone());
        let hook = move || {
            first(&fs);
            *started.lock().unwrap() = Some(in_background(move || fs.commit(ino)));
            std::thread::sleep(MOMENT);
        };
        (SideCommit(slot), Box::new(hook))
    }

    fn result(&self) -> Result<()> {
        let started = self.0.lock().unwrap().take();
        started
            .expect("the side commit began")
            .recv_timeout(LONG)
            .unwrap()
    }
}

const MOMENT: std::time::Duration = std::time::Duration::from_millis(150);

const LONG: std::time::Duration = std::time::Duration::from_secs(10);

/// A client whose close of a file (5,000 bytes committed, 9,000 written) could not reach the
/// metadata node, which is unreachable still: the commit is owed.
fn owing_a_commit() -> (Arc<FakeCluster>, Arc<Rfs<Fake>>, Ino) {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    write(&fs, ino, 0, &pattern(5000, 4)).unwrap();
    fs.commit(ino).unwrap();
    write(&fs, ino, 5000, &pattern(4000, 5)).unwrap();
    cluster.unreachable(true);
    assert!(fs.release(fh).is_err());
    (cluster, fs, ino)
}

/// Waits until no commit is owed.
fn owed_commits_made(fs: &Arc<Rfs<Fake>>) {
    let t = std::time::Instant::now();
    while !fs.stats_text().contains("commits_owed 0\n") {
        assert!(t.elapsed().as_secs() < 10, "not retried");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A callback telling `fs` that `attr`'s file changed, its contents and chunks from 0 too.
fn told_of_cut(fs: &Arc<Rfs<Fake>>, attr: Attr) {
    use rfs_proto::callback::{Callback, Invalidation};
    fs.on_callback(Callback {
        inodes: vec![Invalidation {
            ino: attr.ino,
            chunks_from: Some(0),
            attr: Some(attr),
            data: true,
            remapped: false,
        }],
        ..Callback::default()
    });
}

/// A fresh cluster and a client of it with file "f" open for reading and writing, and 1000
/// bytes written and not committed: (cluster, client, inode, handle).
fn written_not_committed() -> (Arc<FakeCluster>, Arc<Rfs<Fake>>, Ino, u64) {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let fh = fs.open(ino, RW, &ROOT_CALLER).unwrap().0;
    write(&fs, ino, 0, &pattern(1000, 1)).unwrap();
    (cluster, fs, ino, fh)
}

/// A fake cluster, a client of it, and a file made and opened for reading and writing.
fn open_file(name: &str) -> (Arc<FakeCluster>, Arc<Rfs<Fake>>, Ino, u64) {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let ino = create(&fs, name);
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    (cluster, fs, ino, fh)
}

fn whole_file(kind: LockKind) -> FileLock {
    FileLock {
        start: 0,
        end: TO_END,
        kind,
        pid: 1,
    }
}
