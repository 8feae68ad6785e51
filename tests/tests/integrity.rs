//! Data integrity against an in-memory model: random sizes and offsets, overwrites in the
//! middle, truncation up and down, sparse regions, over many chunks on two storage nodes.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;

use rfs_e2e::rng::Rng;
use rfs_e2e::{MemServer, Mount};

fn check(path: &std::path::Path, model: &[u8], step: usize) {
    let got = fs::read(path).unwrap();
    assert_eq!(got.len(), model.len(), "size after step {step}");
    if let Some(i) = got.iter().zip(model).position(|(a, b)| a != b) {
        panic!("first difference at byte {i} after step {step}");
    }
}

fn run(opts: &[&str], seed: u64) {
    // 64 KiB chunks: a few MiB of file already spans dozens of chunks on both nodes.
    let meta = MemServer::meta("32M", "64K");
    let _data = MemServer::data(&meta, "32M", "64K");
    let m = Mount::new(&meta, opts);
    let path = m.path("model");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let mut model: Vec<u8> = Vec::new();
    let mut rng = Rng(seed);
    const MAX: u64 = 6 << 20;
    for step in 0..300 {
        match rng.below(10) {
            0 => {
                let len = rng.below(MAX);
                f.set_len(len).unwrap();
                model.resize(len as usize, 0);
            }
            1..=6 => {
                let off = rng.below(MAX - 1);
                let len = 1 + rng.below((1 << 20).min(MAX - off)) as usize;
                let byte = rng.draw() as u8;
                let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                f.write_all_at(&data, off).unwrap();
                let end = off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
            }
            _ => {
                let off = rng.below(MAX);
                let len = rng.below(1 << 20) as usize;
                let mut buf = vec![0u8; len];
                let n = read_full(&f, &mut buf, off);
                let expect_end = (off as usize + len).min(model.len());
                let expect = model.get(off as usize..expect_end).unwrap_or(&[]);
                assert_eq!(&buf[..n], expect, "read {off}+{len} at step {step}");
            }
        }
        if step % 50 == 49 {
            check(&path, &model, step);
        }
    }
    drop(f);
    check(&path, &model, 300);
}

fn read_full(f: &fs::File, buf: &mut [u8], off: u64) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], off + n as u64).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

#[test]
fn random_io_matches_the_model() {
    run(&[], 0x5eed_0001);
}

#[test]
fn random_io_matches_the_model_with_mechanisms_off_and_small_writes() {
    run(
        &[
            "max_write=128K",
            "merge=off",
            "chain=off",
            "qps=1",
            "window=off",
            "dyn_threshold=never",
            "polling=event",
        ],
        0x5eed_0002,
    );
}

#[test]
fn fio_verifies_crc32c() {
    if std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_err()
    {
        panic!("fio is not installed: scripts/setup.sh installs it");
    }
    let meta = MemServer::meta("256M", "1M");
    let _data = MemServer::data(&meta, "256M", "1M");
    let m = Mount::new(&meta, &[]);
    let out = std::process::Command::new("fio")
        .args([
            "--name=verify",
            "--rw=randwrite",
            "--bs=4k-256k",
            "--size=96M",
            "--numjobs=2",
            "--iodepth=4",
            "--ioengine=psync",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ])
        .arg(format!("--directory={}", m.dir.display()))
        // fio saves its verify state in its working directory: keep it inside the mount.
        .current_dir(&m.dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fio failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// fio writing (or, `verify_only`, checking) at once: one job of 1 MiB records, which the
/// client registers on their own (dynMR), and four of random 4 KiB records, which fill its
/// staging pool (each its own work request).
fn mixed_records(m: &Mount, verify_only: bool) -> std::process::Output {
    let mut cmd = std::process::Command::new("fio");
    cmd.arg(format!("--directory={}", m.dir.display()))
        .args(["--verify=crc32c", "--verify_fatal=1", "--ioengine=psync"])
        .args(["--name=large", "--rw=write", "--bs=1M", "--size=64M"])
        .args(["--name=small", "--rw=randwrite", "--bs=4k", "--size=16M"])
        .arg("--numjobs=4");
    if verify_only {
        cmd.arg("--verify_only");
    } else {
        cmd.arg("--do_verify=0");
    }
    // fio saves its verify state in its working directory: keep it inside the mount.
    cmd.current_dir(&m.dir).output().unwrap()
}

/// Large and small records written at once land whole: while the small ones keep the staging
/// pool dry, a large one the session had to put back lost its buffer and went out with a
/// slot's leftovers (fio found a 4 KiB block's header inside a 1 MiB record). Read back through
/// a second mount, whose page cache never saw the bytes.
#[test]
fn large_and_small_records_written_at_once_land_whole() {
    let meta = MemServer::meta("512M", "1M");
    let writer = Mount::new(&meta, &[]);
    let out = mixed_records(&writer, false);
    assert!(
        out.status.success(),
        "fio writing failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reader = Mount::new(&meta, &[]);
    let out = mixed_records(&reader, true);
    assert!(
        out.status.success(),
        "fio found bytes that were not written:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
