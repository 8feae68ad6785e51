//! Several mounts of one namespace, large files over two nodes, and a storage node dying.

use std::fs;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rfs_e2e::{errno, MemServer, Mount};

#[test]
fn two_mounts_see_each_others_closed_files() {
    let server = MemServer::meta("64M", "1M");
    let a = Mount::new(&server, &[]);
    let b = Mount::new(&server, &["attr_timeout=0", "entry_timeout=0"]);
    fs::write(a.path("shared"), b"from a").unwrap();
    assert_eq!(fs::read(b.path("shared")).unwrap(), b"from a");
    let mut data = fs::read(b.path("shared")).unwrap();
    data.extend_from_slice(&vec![1u8; 3 << 20]);
    fs::write(b.path("shared"), &data).unwrap();
    // Close-to-open: a fresh open on `a` sees b's closed file.
    let f = fs::File::open(a.path("shared")).unwrap();
    assert_eq!(f.metadata().unwrap().len(), data.len() as u64);
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data);
    fs::create_dir(a.path("dir")).unwrap();
    assert!(b.path("dir").is_dir());
}

#[test]
fn large_files_span_many_chunks_on_two_nodes() {
    let meta = MemServer::meta("96M", "1M");
    let _data = MemServer::data(&meta, "96M", "1M");
    let m = Mount::new(&meta, &[]);
    let data: Vec<u8> = (0..(150u32 << 20) / 4)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    fs::write(m.path("big"), &data).unwrap();
    assert!(fs::read(m.path("big")).unwrap() == data);
    let stats = fs::read_to_string(m.path(".rfs-stats")).unwrap();
    assert!(stats
        .lines()
        .any(|l| l.starts_with("bytes_written ") && l[14..].parse::<u64>().unwrap() >= 150 << 20));
}

#[test]
fn a_dead_storage_node_fails_io_with_eio_and_nothing_hangs() {
    let meta = MemServer::meta("16M", "1M");
    let mut data = MemServer::data(&meta, "16M", "1M");
    let mut m = Mount::new(&meta, &["io_timeout=2"]);
    // One-chunk files alternate between the nodes.
    for i in 0..8 {
        fs::write(m.path(&format!("f{i}")), vec![i as u8; 1 << 20]).unwrap();
    }
    data.kill();
    let start = Instant::now();
    let (mut ok, mut eio) = (0, 0);
    for i in 0..8 {
        match fs::read(m.path(&format!("f{i}"))) {
            Ok(d) => {
                assert_eq!(d, vec![i as u8; 1 << 20]);
                ok += 1;
            }
            Err(e) => {
                assert_eq!(errno(&e), libc::EIO, "{e}");
                eio += 1;
            }
        }
    }
    let took = start.elapsed();
    assert!(ok > 0, "files on the live node still work");
    assert!(eio > 0, "files on the dead node fail");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    // New files still work (allocated on the live node), and unmount is clean.
    fs::write(m.path("after"), b"still here").unwrap();
    assert_eq!(fs::read(m.path("after")).unwrap(), b"still here");
    assert!(m.unmount());
}
