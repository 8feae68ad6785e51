//! Handles as the kernel opens them: the access asked, page-cache use, where appends land,
//! create's answer for a name made meanwhile.

use crate::fs::kernel_handles::{access, FMODE_EXEC};
use crate::fs::STATS_INO;
use crate::host::direct_writes_drop_cached_pages;
use rfs_proto::types::FileAccess;

use super::*;

/// A write the kernel sends for a handle opened with `flags`, answered.
fn kernel_write(fs: &Arc<Rfs<Fake>>, ino: Ino, offset: u64, data: &[u8], flags: i32) -> u32 {
    let (tx, rx) = mpsc::channel();
    fs.write_from_kernel(
        ino,
        offset,
        data,
        flags,
        Box::new(move |r| tx.send(r).unwrap()),
    );
    rx.recv().unwrap().unwrap()
}

#[test]
fn open_flags_give_the_access_asked() {
    assert_eq!(access(libc::O_RDONLY), FileAccess::READ);
    assert_eq!(access(libc::O_WRONLY | libc::O_APPEND), FileAccess::WRITE);
    assert_eq!(access(libc::O_RDWR), FileAccess::READ | FileAccess::WRITE);
    assert_eq!(access(libc::O_RDONLY | FMODE_EXEC), FileAccess::EXEC);
}

/// Write-only handles go around the page cache (on a kernel that drops what a direct write
/// overlaps), appending ones always; a handle that reads keeps it; the writeback cache
/// keeps every handle in it.
#[test]
fn handles_that_only_write_go_around_the_page_cache() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let fs = client(&cluster);
    let (_, made, _) = fs
        .create_for_kernel(ROOT, b"f", OWNER, libc::O_RDWR, &ROOT_CALLER)
        .unwrap();
    let direct = |fs: &Arc<Rfs<Fake>>, flags| {
        fs.open_for_kernel(made.ino, flags, &ROOT_CALLER)
            .unwrap()
            .1
            .direct_io
    };
    assert!(!direct(&fs, libc::O_RDWR));
    assert!(!direct(&fs, libc::O_RDWR | libc::O_APPEND));
    assert!(direct(&fs, libc::O_WRONLY | libc::O_APPEND));
    assert_eq!(
        direct(&fs, libc::O_WRONLY),
        direct_writes_drop_cached_pages()
    );
    let writeback = FsConfig {
        writeback_cache: true,
        ..FsConfig::default()
    };
    let cached = client_with(&cluster, writeback);
    assert!(!direct(&cached, libc::O_WRONLY | libc::O_APPEND));
    let stats = fs.open_for_kernel(STATS_INO, libc::O_RDONLY, &ROOT_CALLER);
    assert!(
        stats.unwrap().1.direct_io,
        "the stats file changes under the kernel"
    );
}

/// Two mounts appending through write-only O_APPEND handles, each at the offset its kernel
/// thinks is the end (0): each append lands at the end the metadata node knows.
#[test]
fn write_only_appends_land_at_the_end_the_node_knows() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    let appending = libc::O_WRONLY | libc::O_APPEND;
    let (fa, made, _) = a
        .create_for_kernel(ROOT, b"log", OWNER, appending, &ROOT_CALLER)
        .unwrap();
    let ino = made.ino;
    let (fb, _) = b.open_for_kernel(ino, appending, &ROOT_CALLER).unwrap();
    assert_eq!(kernel_write(&a, ino, 0, b"abc\n", appending), 4);
    a.flush(ino, fa).unwrap();
    assert_eq!(kernel_write(&b, ino, 0, b"def\n", appending), 4);
    b.flush(ino, fb).unwrap();
    assert_eq!(kernel_write(&a, ino, 4, b"ghi\n", appending), 4);
    a.flush(ino, fa).unwrap();
    let fresh = client(&cluster);
    fresh
        .open_for_kernel(ino, libc::O_RDONLY, &ROOT_CALLER)
        .unwrap();
    assert_eq!(read(&fresh, ino, 0, 100).unwrap(), b"abc\ndef\nghi\n");
}

#[test]
fn a_create_without_o_excl_of_a_name_made_meanwhile_is_looked_up_again() {
    let cluster: Arc<FakeCluster> = Arc::default();
    let (a, b) = (client(&cluster), client(&cluster));
    a.create_for_kernel(ROOT, b"f", OWNER, libc::O_RDWR, &ROOT_CALLER)
        .unwrap();
    let again = |flags| {
        b.create_for_kernel(ROOT, b"f", OWNER, flags, &ROOT_CALLER)
            .map(|_| ())
            .map_err(|e| e.errno())
    };
    assert_eq!(again(libc::O_RDWR | libc::O_CREAT), Err(Errno::ESTALE));
    assert_eq!(
        again(libc::O_RDWR | libc::O_CREAT | libc::O_EXCL),
        Err(Errno::EEXIST)
    );
}
