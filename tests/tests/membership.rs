//! Data nodes leaving and coming back while the metadata node runs, and `rfs remove`.

use std::fs;
use std::time::{Duration, Instant};

use rfs_e2e::{client, direct_read, open_direct, MemServer, Mount};
use rfs_proto::message::ListNodes;
use rfs_proto::MetadataChannel;

/// Whether the metadata node `meta` lists node `id` as alive.
fn alive(meta: &MemServer, id: u32) -> bool {
    client(meta)
        .call(ListNodes {})
        .unwrap()
        .iter()
        .any(|n| n.id == id && n.alive)
}

/// A data node stopped (SIGSTOP: a paused VM, a frozen cgroup) past the metadata node's grant
/// deadline is cut off; when it resumes, its join connection is gone and it joins again. Its
/// pool still holds every copy the maps name there: it must come back with them, not be wiped
/// (at one copy per chunk that lost every file on it).
#[test]
fn a_data_node_cut_off_while_stopped_comes_back_with_its_pool() {
    let meta = MemServer::meta("16M", "1M");
    let data = MemServer::data(&meta, "16M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let content = |i: usize| vec![i as u8 + 1; 1 << 20];
    // One-chunk files alternate between the two nodes.
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), content(i)).unwrap();
    }
    rfs_e2e::stop(data.pid());
    // Reading the files again needs grants from the stopped node (each open is granted anew):
    // unanswered past the deadline, the metadata node cuts it off.
    let start = Instant::now();
    let mut i = 0;
    while alive(&meta, 1) {
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "the stopped node was never cut off"
        );
        let _ = direct_read(&open_direct(m.path(&format!("f{}", i % 6)), false), 0);
        i += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("cut off after {:?}", start.elapsed());
    rfs_e2e::resume(data.pid());
    let start = Instant::now();
    while !alive(&meta, 1) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the node did not come back as itself"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("back after {:?}", start.elapsed());
    let fresh = Mount::new(&meta, &["io_timeout=1"]);
    for i in 0..6 {
        let f = open_direct(fresh.path(&format!("f{i}")), false);
        assert_eq!(
            direct_read(&f, 0).0.unwrap(),
            content(i)[..4096],
            "f{i} after the node came back"
        );
        assert!(fs::read(fresh.path(&format!("f{i}"))).unwrap() == content(i));
    }
    assert_eq!(fresh.stat("io_errors"), 0);
}

/// How many chunks the metadata node `meta` counts short of copies.
fn chunks_short(meta: &MemServer) -> u64 {
    client(meta)
        .call(rfs_proto::message::GetStatFs {})
        .unwrap()
        .chunks_short
}

/// At two copies a cut-off node's copies leave the maps and are made again elsewhere while it
/// is away, and files are written meanwhile; when it comes back, what its pool held that no map
/// names any more is zeroed and reused. Nothing is lost or mixed up: every file reads back as
/// written, on a fresh mount, through a second stop of the same node.
#[test]
fn at_two_copies_a_node_cut_off_and_back_loses_and_mixes_nothing() {
    let meta = MemServer::start(&["--memory", "24M", "--chunk-size", "1M", "--replicas", "2"]);
    let a = MemServer::data(&meta, "24M", "1M");
    let _b = MemServer::data(&meta, "24M", "1M");
    let m = Mount::new(&meta, &["io_timeout=1"]);
    let content = |i: usize| {
        (0..(1usize << 19) + i * 4096)
            .map(|k| (k * 7 + i * 13) as u8)
            .collect::<Vec<u8>>()
    };
    let mut written = Vec::new();
    for round in 0..2 {
        for i in 0..6 {
            let k = round * 100 + i;
            fs::write(m.path(&format!("f{k}")), content(k)).unwrap();
            written.push(k);
        }
        rfs_e2e::stop(a.pid());
        let start = Instant::now();
        let mut i = 0;
        while alive(&meta, 1) {
            assert!(start.elapsed() < Duration::from_secs(40), "never cut off");
            let f = open_direct(m.path(&format!("f{}", written[i % written.len()])), false);
            let _ = direct_read(&f, 0);
            i += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        // Written while it is away, and some removed (their space freed on the others).
        for i in 0..4 {
            let k = round * 100 + 50 + i;
            fs::write(m.path(&format!("f{k}")), content(k)).unwrap();
            written.push(k);
        }
        fs::remove_file(m.path(&format!("f{}", round * 100))).unwrap();
        written.retain(|&k| k != round * 100);
        rfs_e2e::resume(a.pid());
        rfs_e2e::within(Duration::from_secs(20), "the node back", || alive(&meta, 1));
        rfs_e2e::within(Duration::from_secs(60), "every chunk whole", || {
            chunks_short(&meta) == 0
        });
        // New files land on it again.
        for i in 0..4 {
            let k = round * 100 + 80 + i;
            fs::write(m.path(&format!("f{k}")), content(k)).unwrap();
            written.push(k);
        }
        let fresh = Mount::new(&meta, &["io_timeout=1"]);
        for &k in &written {
            let back = fs::read(fresh.path(&format!("f{k}"))).unwrap();
            assert!(back == content(k), "round {round}: f{k}");
        }
        assert_eq!(fresh.stat("io_errors"), 0);
    }
}

/// The state `rfs status` gives data node `addr` ("up", "away"...), None once not listed.
fn state_of(meta: &MemServer, addr: &str) -> Option<String> {
    let status = client(meta)
        .call(rfs_proto::message::Status {
            caller: rfs_proto::types::Caller::default(),
        })
        .unwrap();
    status
        .nodes
        .iter()
        .filter(|n| n.addr == addr)
        .max_by_key(|n| n.id)
        .map(|n| n.state.clone())
}

fn wait_for_state(meta: &MemServer, addr: &str, state: &str) {
    rfs_e2e::within(Duration::from_secs(30), &format!("{addr} {state}"), || {
        state_of(meta, addr).as_deref() == Some(state)
    });
}

/// `rfs remove` forgets a data node that is not up: refused while it is up, and while chunks
/// have their only copies there (unless `--force`, and those then fail to read rather than
/// read zeros). A drained and stopped node goes losing nothing and stays gone across a
/// restart of the metadata node.
#[test]
fn rfs_remove_forgets_a_node_not_up_and_asks_for_force_to_lose_copies() {
    let mut meta = MemServer::durable_meta("remove", &[]);
    let mut a = MemServer::data(&meta, "16M", "1M");
    let mut b = MemServer::data(&meta, "16M", "1M");
    let (at, a_addr, b_addr) = (
        meta.addr.to_string(),
        a.addr.to_string(),
        b.addr.to_string(),
    );
    let m = Mount::new(&meta, &[]);
    let content = |i: usize| vec![i as u8 + 1; 1 << 20];
    for i in 0..6 {
        fs::write(m.path(&format!("f{i}")), content(i)).unwrap();
    }
    let out = rfs_e2e::rfs(&["remove", &at, &a_addr]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("stop it first"),
        "{said}"
    );
    assert_eq!(state_of(&meta, &a_addr).as_deref(), Some("up"));

    // Drained and stopped, it holds nothing: removed without force.
    assert!(rfs_e2e::rfs(&["drain", &at, &a_addr]).status.success());
    unsafe { libc::kill(a.pid() as i32, libc::SIGTERM) };
    assert!(a.wait_exit(Duration::from_secs(30)).is_some());
    wait_for_state(&meta, &a_addr, "away");
    let out = rfs_e2e::rfs(&["remove", &at, &a_addr]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(state_of(&meta, &a_addr), None, "no longer listed");
    let out = rfs_e2e::rfs(&["remove", &at, &a_addr]);
    assert_eq!(out.status.code(), Some(2), "gone already: {out:?}");

    // Across a restart of the metadata node: still not listed, and every file whole.
    drop(m);
    meta.restart();
    wait_for_state(&meta, &b_addr, "up");
    assert_eq!(state_of(&meta, &a_addr), None);
    let m = Mount::new(&meta, &["io_timeout=1"]);
    for i in 0..6 {
        assert!(
            fs::read(m.path(&format!("f{i}"))).unwrap() == content(i),
            "f{i}"
        );
    }

    // b killed with the only copies of every chunk: away, and removing it needs --force.
    b.kill();
    wait_for_state(&meta, &b_addr, "away");
    let status = String::from_utf8(rfs_e2e::rfs(&["status", &at, "--json"]).stdout).unwrap();
    let entry = &status[status.find(&format!("\"address\":\"{b_addr}\"")).unwrap()..];
    let only = &entry[entry.find("\"only_copies\":").unwrap() + 14..];
    let only: u64 = only[..only.find('}').unwrap()].parse().unwrap();
    assert!(only >= 6, "every file's chunks are only there: {status}");
    let out = rfs_e2e::rfs(&["remove", &at, &b_addr]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && said.contains(&format!("only copies of {only} chunks"))
            && said.contains("--force"),
        "{said}"
    );
    assert_eq!(state_of(&meta, &b_addr).as_deref(), Some("away"));
    assert!(rfs_e2e::rfs(&["remove", &at, &b_addr, "--force"])
        .status
        .success());
    assert_eq!(state_of(&meta, &b_addr), None);
    // Its chunks fail rather than read zeros; a node that joins takes new files.
    let f = open_direct(m.path("f0"), false);
    let (r, _) = direct_read(&f, 0);
    assert_eq!(rfs_e2e::errno(&r.unwrap_err()), libc::EIO);
    let _c = MemServer::data(&meta, "16M", "1M");
    fs::write(m.path("new"), content(9)).unwrap();
    assert!(fs::read(m.path("new")).unwrap() == content(9));
}
