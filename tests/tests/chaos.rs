//! Chaos: fio writing and verifying on a mount of a file system with two replicas over three
//! data nodes, while another mount writes files of its own; mid-run a data node is killed, and
//! then the metadata node is killed and started again from its state directory. Nothing may
//! fail or read back wrong; once the lost copies are made again, killing a second data node
//! still loses nothing.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rfs_e2e::rng::Rng;
use rfs_e2e::{wait_until_whole, MemServer, Mount};

/// fio on `dir`: random writes of 4k..256k over two jobs, each block checksummed (crc32c) and
/// verified; `verify_only` reads and verifies what an earlier run wrote. The writes are paced
/// (16 MiB/s per job, 4 s in all) so that the failures happen while fio writes.
fn fio(dir: &Path, verify_only: bool) -> Output {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=chaos",
        "--rw=randwrite",
        "--bs=4k-256k",
        "--size=64M",
        "--rate=16m",
        "--numjobs=2",
        "--iodepth=4",
        "--ioengine=psync",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--randseed=7",
    ])
    .arg(format!("--directory={}", dir.display()))
    // fio saves its verify state in its working directory: keep it inside the mount.
    .current_dir(dir);
    if verify_only {
        cmd.arg("--verify_only");
    }
    rfs_e2e::run_child(&mut cmd).expect("fio is installed by scripts/setup.sh")
}

fn check(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Random writes over `files` files of `len` bytes through `m`, each block also applied to
/// a model, until `stop` says so; the model.
fn writer(m: &Mount, files: usize, len: usize, until: Instant) -> Vec<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut model = vec![vec![0u8; len]; files];
    let handles: Vec<fs::File> = (0..files)
        .map(|i| {
            let f = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(m.path(&format!("w{i}")))
                .unwrap();
            f.set_len(len as u64).unwrap();
            f
        })
        .collect();
    let mut rng = Rng(42);
    while Instant::now() < until {
        let i = rng.draw() as usize % files;
        let n = 1 + rng.draw() as usize % (300 << 10);
        let at = rng.draw() as usize % (len - n);
        let byte = rng.draw() as u8;
        handles[i].write_all_at(&vec![byte; n], at as u64).unwrap();
        model[i][at..at + n].fill(byte);
    }
    for f in &handles {
        f.sync_all().unwrap();
    }
    model
}

#[test]
fn fio_verify_and_a_second_writer_survive_a_killed_data_node_and_a_restarted_metadata_node() {
    // The durable setup docs/semantics.md describes: a metadata node that lends nothing and keeps
    // its state on disk, and data nodes that outlive it.
    let mut meta = MemServer::durable_meta("chaos", &["--replicas", "2"]);
    let mut first = MemServer::data(&meta, "256M", "1M");
    let mut second = MemServer::data(&meta, "256M", "1M");
    let _third = MemServer::data(&meta, "256M", "1M");
    let a = Mount::new(&meta, &["io_timeout=1"]);
    let b = Mount::new(&meta, &["io_timeout=1"]);
    let started = Instant::now();
    let model = std::thread::scope(|s| {
        let fio_run = s.spawn(|| {
            let out = fio(&a.dir, false);
            let done = started.elapsed();
            println!("fio done at {done:?}");
            (out, done)
        });
        let model = s.spawn(|| writer(&b, 4, 4 << 20, Instant::now() + Duration::from_secs(8)));
        std::thread::sleep(Duration::from_millis(1500));
        first.kill();
        println!("data node 1 killed at {:?}", started.elapsed());
        std::thread::sleep(Duration::from_millis(1500));
        let killed = Instant::now();
        meta.restart_after(Duration::from_millis(300));
        let up = started.elapsed();
        println!(
            "metadata node killed at {:?}, up again {:?} later",
            killed - started,
            killed.elapsed()
        );
        let (fio_run, fio_done) = fio_run.join().unwrap();
        check(&fio_run, "fio through the kill and the restart");
        assert!(
            fio_done > up,
            "fio was done before the metadata node was back"
        );
        model.join().unwrap()
    });
    for (i, expect) in model.iter().enumerate() {
        assert!(
            &fs::read(b.path(&format!("w{i}"))).unwrap() == expect,
            "w{i}"
        );
    }
    let took = wait_until_whole(&meta, 1, Duration::from_secs(60));
    println!("copies whole again {took:?} later");
    let both = |name| a.stat(name) + b.stat(name);
    // The client may meet the dead node (failovers, dropped replicas) or learn of it first
    // (the metadata node drops its copies from the maps and recalls them): either is right.
    // Transfers refused while the metadata node was away (the data nodes took back its
    // grants) went again with fresh maps (retries).
    println!(
        "failovers {}, replicas dropped {}, retries {}",
        both("failovers"),
        both("replicas_dropped"),
        both("retries")
    );
    assert_eq!(both("io_errors"), 0);

    second.kill();
    check(&fio(&a.dir, true), "fio verifying with one data node left");
    for (i, expect) in model.iter().enumerate() {
        assert!(
            &fs::read(b.path(&format!("w{i}"))).unwrap() == expect,
            "w{i} after the second kill"
        );
    }
    drop((a, b));
}
