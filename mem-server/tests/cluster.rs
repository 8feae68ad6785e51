//! Real mem-server processes on loopback: a metadata node and two data nodes, a client doing
//! metadata RPCs and one-sided chunk I/O across all of them, hostile input, secrets and
//! exhaustion.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rfs_client::Client;
use rfs_e2e::{client, client_config, secret, MemServer};
use rfs_proto::data::chunk_addr;
use rfs_proto::message::{
    decode_reply, Allocate, Call, ChunkMap, Commit, Committed, Create, GetAttr, GetStatFs,
    ListNodes, Lookup, Mkdir, Open, ReadDir, Release, SetAttr, Unlink,
};
use rfs_proto::types::{
    Attr, AttrChanges, Caller, ChunkRef, FileAccess, NodeInfo, Owner, Replicas, StatFs, ROOT,
};
use rfs_proto::{Errno, MetadataChannel};

/// A metadata node with a short lease: departed clients' sessions end two leases after.
fn meta(memory: &str) -> MemServer {
    MemServer::start(&["--memory", memory, "--lease", "1"])
}

fn data(meta: &MemServer, memory: &str) -> MemServer {
    let m = meta.addr.to_string();
    MemServer::start(&["--memory", memory, "--join", &m])
}

const RW: FileAccess = FileAccess::READ.union(FileAccess::WRITE);

/// Creates a file and opens it for reading and writing (chunk maps come only through a handle).
fn create(c: &Client, name: &str) -> u64 {
    let owner = Owner {
        perm: 0o644,
        uid: 0,
        gid: 0,
        umask: 0,
    };
    c.call(Create {
        parent: ROOT,
        name: name.into(),
        owner,
        access: RW,
        caller: Caller::default(),
    })
    .unwrap()
    .attr
    .ino
}

fn open(c: &Client, ino: u64) -> Attr {
    c.call(Open {
        ino,
        access: RW,
        caller: Caller::default(),
    })
    .unwrap()
    .attr
}

/// Connects and attaches a data session to every live node, so that maps come granted.
fn attach_all(c: &Client) {
    for n in nodes(c).into_iter().filter(|n| n.alive) {
        c.data(n.id).unwrap();
    }
}

/// A map of single-copy chunks, each by its one replica.
fn single(map: Vec<(u64, Replicas)>) -> Vec<(u64, ChunkRef)> {
    map.into_iter()
        .map(|(i, r)| {
            assert_eq!(r.len(), 1, "one copy of each chunk");
            (i, r[0])
        })
        .collect()
}

fn allocate(c: &Client, ino: u64, first: u64, count: u32) -> Result<Vec<(u64, ChunkRef)>, Errno> {
    attach_all(c);
    let (offset, end) = (first << 20, (first + count as u64) << 20);
    c.call(Allocate { ino, offset, end })
        .map(|m| single(m.chunks))
        .map_err(|e| e.errno())
}

/// Where chunks are, without the keys (each client has its own).
fn places(map: &[(u64, ChunkRef)]) -> Vec<(u64, u32, u64)> {
    map.iter().map(|(i, c)| (*i, c.node, c.addr)).collect()
}

fn chunk_map(c: &Client, ino: u64, count: u32) -> Vec<(u64, ChunkRef)> {
    attach_all(c);
    single(
        c.call(ChunkMap {
            ino,
            first: 0,
            count,
        })
        .unwrap()
        .chunks,
    )
}

fn statfs(c: &Client) -> StatFs {
    c.call(GetStatFs {}).unwrap()
}

fn nodes(c: &Client) -> Vec<NodeInfo> {
    c.call(ListNodes {}).unwrap()
}

fn write_chunk(c: &Client, chunk: &ChunkRef, data: Vec<u8>) {
    let d = c.data(chunk.node).unwrap();
    d.session
        .write_pending(chunk_addr(chunk, 0), data)
        .wait()
        .unwrap();
}

fn read_chunk(c: &Client, chunk: &ChunkRef, len: usize) -> Vec<u8> {
    let d = c.data(chunk.node).unwrap();
    d.session
        .read_pending(chunk_addr(chunk, 0), vec![0; len])
        .wait()
        .unwrap()
}

/// A metadata channel set up by hand, as a peer on the path would after forwarding a real
/// client's handshake: its call queue pair, the session key the handshake gave the real ends,
/// and the control connection (the session lasts while it is open).
fn raw_metadata_channel(
    meta: &MemServer,
) -> (
    rdmabox::rpc::RpcClient,
    Option<rfs_proto::session_key::SessionKey>,
    TcpStream,
) {
    use rdmabox::transport::Context;
    use rfs_proto::hello::{Hello, Metadata};
    let ctx = Context::open(&client_config().transport).unwrap();
    let pd = std::sync::Arc::new(ctx.alloc_pd().unwrap());
    let hello = Hello::Metadata(Metadata {
        client_id: rdmabox::random::u64(),
    });
    let (mut s, key) = rfs_proto::handshake::dial(
        meta.addr,
        secret().as_deref(),
        &hello,
        Duration::from_secs(5),
    )
    .unwrap();
    // Calls on the first queue pair; the second (callbacks) stays open, unused.
    let route =
        rfs_proto::handshake::queue_pair_route(secret().as_deref(), false, key.as_ref()).unwrap();
    let mut links =
        rdmabox::connect_queue_pairs(&ctx, &pd, &mut s, 2, Default::default(), &route).unwrap();
    std::mem::forget(links.pop());
    let (qp, cq) = links.remove(0);
    let _resumed = rfs_proto::frame::recv_frame(&mut s, 1).unwrap();
    let rpc = rdmabox::rpc::RpcClient::new(&pd, qp, cq, rfs_proto::message::METADATA_RPC).unwrap();
    (rpc, key, s)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn three_nodes_spread_chunks_and_serve_one_sided_io() {
    let meta = meta("16M");
    let d1 = data(&meta, "16M");
    let d2 = data(&meta, "16M");
    let c = client(&meta);
    wait_until("both data nodes to join", || nodes(&c).len() == 3);
    let s = statfs(&c);
    assert_eq!(
        (s.chunk_size, s.bytes_total >> 20, s.bytes_free >> 20),
        (1 << 20, 48, 48)
    );
    let ino = create(&c, "big");
    let chunks = allocate(&c, ino, 0, 12).unwrap();
    assert_eq!(chunks.len(), 12);
    for node in 0..3 {
        assert_eq!(
            chunks.iter().filter(|(_, ch)| ch.node == node).count(),
            4,
            "even spread"
        );
    }
    for (i, ch) in &chunks {
        write_chunk(&c, ch, vec![*i as u8 + 1; 1 << 20]);
    }
    // A second client sees the same bytes through its own sessions.
    let c2 = client(&meta);
    open(&c2, ino);
    let map = chunk_map(&c2, ino, 100);
    assert_eq!(places(&map), places(&chunks));
    assert!(map
        .iter()
        .zip(&chunks)
        .all(|((_, a), (_, b))| a.rkey != b.rkey && a.rkey != 0));
    for (i, ch) in &map {
        assert!(read_chunk(&c2, ch, 1 << 20)
            .iter()
            .all(|&b| b == *i as u8 + 1));
    }
    assert_eq!(statfs(&c).bytes_free >> 20, 36);
    drop((d1, d2));
}

#[test]
fn freed_chunks_are_zeroed_before_reuse_and_enospc_allocates_nothing() {
    let meta = meta("4M");
    let d1 = data(&meta, "2M");
    let c = client(&meta);
    wait_until("the data node to join", || nodes(&c).len() == 2);
    let a = create(&c, "a");
    let chunks = allocate(&c, a, 0, 6).unwrap();
    for (_, ch) in &chunks {
        write_chunk(&c, ch, vec![0xee; 1 << 20]);
    }
    let b = create(&c, "b");
    assert_eq!(allocate(&c, b, 0, 1), Err(Errno::ENOSPC));
    assert_eq!(chunk_map(&c, b, 10), vec![], "nothing allocated");
    c.call(Release { ino: a, access: RW }).unwrap();
    c.call(Unlink {
        parent: ROOT,
        name: "a".into(),
        caller: Caller::default(),
    })
    .unwrap();
    assert_eq!(statfs(&c).bytes_free >> 20, 6);
    let mut again = Vec::new();
    wait_until("zeroed chunks to come back", || {
        match allocate(&c, b, 0, 6) {
            Ok(cs) => {
                again = cs;
                true
            }
            Err(_) => false,
        }
    });
    for (_, ch) in &again {
        assert!(
            read_chunk(&c, ch, 1 << 20).iter().all(|&x| x == 0),
            "old data leaked"
        );
    }
    drop(d1);
}

#[test]
fn a_departed_client_releases_its_open_files() {
    let meta = meta("8M");
    let c = client(&meta);
    let ino = create(&c, "f");
    allocate(&c, ino, 0, 4).unwrap();
    {
        let other = client(&meta);
        assert_eq!(open(&other, ino).ino, ino);
        c.call(Release { ino, access: RW }).unwrap();
        c.call(Unlink {
            parent: ROOT,
            name: "f".into(),
            caller: Caller::default(),
        })
        .unwrap();
        assert_eq!(statfs(&c).bytes_free >> 20, 4, "open elsewhere: data kept");
        // A client may not release handles it does not hold.
        assert_eq!(
            c.call(Release { ino, access: RW }).map_err(|e| e.errno()),
            Err(Errno::EBADF)
        );
    }
    wait_until("the departed client's handle to be released", || {
        statfs(&c).bytes_free >> 20 == 8
    });
}

#[test]
fn secrets_are_required_and_checked() {
    let dir = std::env::temp_dir().join(format!("rfs-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    let bad = dir.join("bad");
    std::fs::write(&good, "correct horse\n").unwrap();
    std::fs::write(&bad, "wrong horse\n").unwrap();
    for f in [&good, &bad] {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let meta = MemServer::start(&["--memory", "4M", "--secret-file", good.to_str().unwrap()]);
    let with = |secret: Option<&[u8]>| {
        let mut c = client_config();
        c.secret = secret.map(|s| s.to_vec());
        Client::connect(&meta.addr.to_string(), c)
    };
    assert!(with(None).is_err(), "no secret");
    assert!(with(Some(b"wrong horse")).is_err(), "wrong secret");
    let c = with(Some(b"correct horse")).expect("right secret");
    let ino = create(&c, "x");
    let chunks = allocate(&c, ino, 0, 1).unwrap();
    write_chunk(&c, &chunks[0].1, vec![1; 4096]);
    // A data node with the wrong secret cannot join.
    let status = Command::new(env!("CARGO_BIN_EXE_mem-server"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
            "--memory",
            "2M",
        ])
        .args([
            "--join",
            &meta.addr.to_string(),
            "--secret-file",
            bad.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
    assert_eq!(nodes(&c).len(), 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn hostile_input_is_refused_and_harms_no_one() {
    let meta = meta("4M");
    let c = client(&meta);
    let ino = create(&c, "keep");
    // Garbage instead of an authentication answer, then a bad hello, then an oversized frame.
    for junk in [
        vec![0xffu8; 100],
        {
            let mut v = vec![0u8; 64];
            v.extend_from_slice(&[1, 0, 0, 0, 0xff]);
            v
        },
        {
            let mut v = vec![0u8; 64];
            v.extend_from_slice(&u32::MAX.to_le_bytes());
            v
        },
    ] {
        let mut s = TcpStream::connect(meta.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut greeting = [0u8; 37];
        s.read_exact(&mut greeting).unwrap();
        let _ = s.write_all(&junk);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest); // the node closes the connection
    }
    // Malformed metadata requests of an authenticated peer get an error reply, on a raw RPC
    // channel (in their envelope, sealed with the session key).
    {
        use rfs_proto::integrity::{self, CALL, REPLY};
        use rfs_proto::message::{seal, Envelope};
        let (rpc, key, _control) = raw_metadata_channel(&meta);
        for (seq, garbage) in [
            vec![],
            vec![rfs_proto::wire::VERSION, 42, 1, 2, 3],
            vec![rfs_proto::wire::VERSION, 2, 1, 2, 3],
            vec![9; 1000],
        ]
        .into_iter()
        .enumerate()
        {
            let seq = seq as u64 + 1;
            let envelope = Envelope {
                seq,
                oldest: seq,
                sent_ms: rfs_proto::clock::now_ms(),
                budget_ms: 10_000,
            };
            let call = integrity::seal(key.as_ref(), CALL, seq, seal(&envelope, &garbage));
            let sealed = rpc.call(&call).unwrap();
            let raw = integrity::open(key.as_ref(), REPLY, seq, &sealed)
                .expect("a reply sealed with the session key")
                .to_vec();
            // The error answers the op the garbage claimed to be, whatever that was.
            let mut as_getattr = raw.clone();
            as_getattr[1] = GetAttr::OP as u8;
            assert_eq!(
                decode_reply::<GetAttr>(&as_getattr).unwrap(),
                Err(Errno::EPROTO),
                "{garbage:?}"
            );
        }
    }
    assert_eq!(
        c.call(GetAttr { ino: 999_999 }).map_err(|e| e.errno()),
        Err(Errno::ENOENT)
    );
    assert_eq!(
        c.call(Lookup {
            parent: ino,
            name: "x".into(),
            caller: Caller::default(),
        })
        .map_err(|e| e.errno()),
        Err(Errno::ENOTDIR)
    );
    assert_eq!(
        c.call(ReadDir {
            ino: ROOT,
            cookie: 0,
            max: u32::MAX,
            caller: Caller::default(),
        })
        .unwrap()
        .len(),
        3,
        "oversized page requests are clamped"
    );
    // Access past a granted chunk fails (and ends that data session only).
    let file = create(&c, "granted");
    let chunk = allocate(&c, file, 0, 1).unwrap()[0].1;
    let d = c.data(chunk.node).unwrap();
    let beyond = rdmabox::transport::RemoteAddr {
        addr: chunk.addr + (1 << 20),
        rkey: chunk.rkey,
    };
    assert!(d.session.read_pending(beyond, vec![0; 16]).wait().is_err());
    // Everyone else is unharmed.
    let c2 = client(&meta);
    assert_eq!(c2.call(GetAttr { ino }).unwrap().ino, ino);
}

/// A peer on the path without the secret forwards a real client's handshake, then uses the
/// authenticated connection itself: its calls carry no MAC by the session key (which the
/// handshake never sends), so the node applies none of them, answers nothing and closes the
/// connection. (Before, such a relay chmodded a root 0600 file to 0666: here one of 0644.)
#[test]
fn a_relay_that_forwarded_the_handshake_cannot_use_the_connection() {
    use rfs_proto::message::{encode_call, seal, Envelope};
    let meta = meta("16M");
    if secret().is_none() {
        return; // nothing to forge without authentication
    }
    let c = client(&meta);
    let ino = create(&c, "private");
    let mode = |c: &Client| c.call(GetAttr { ino }).unwrap().perm;
    assert_eq!(mode(&c) & 0o777, 0o644);
    let (rpc, _key, _control) = raw_metadata_channel(&meta);
    let chmod = SetAttr {
        ino,
        changes: AttrChanges {
            mode: Some(0o666),
            ..AttrChanges::default()
        },
        caller: Caller::default(),
    };
    let envelope = Envelope {
        seq: 1,
        oldest: 1,
        sent_ms: rfs_proto::clock::now_ms(),
        budget_ms: 10_000,
    };
    // What the relay can make: a MAC of its own guessing, or none at all.
    let mut forged = seal(&envelope, &encode_call(&chmod));
    forged.extend_from_slice(&[7; rfs_proto::integrity::TAG]);
    assert!(
        rpc.call(&forged).map_or(true, |reply| reply.is_empty()),
        "the node answered a forged call"
    );
    assert!(
        rpc.call(&seal(&envelope, &encode_call(&chmod))).is_err(),
        "the connection is closed"
    );
    assert_eq!(mode(&c) & 0o777, 0o644, "the chmod was not applied");
    assert_eq!(
        c.call(GetAttr { ino }).unwrap().ino,
        ino,
        "the real client is served"
    );
}

/// Another peer holding the cluster's secret that saw a data session's endpoint exchange (in
/// clear on the path) dials the node first and names the session's queue-pair tokens: it
/// proves nothing about the session's control connection, so the node turns it away, and the
/// session's own connection takes the queue pair. (Before, the first connection to name the
/// tokens got the queue pair, and with it whatever the session was granted.)
#[test]
fn a_peer_that_saw_a_sessions_tokens_cannot_take_its_queue_pair() {
    use rdmabox::transport::{exchange_endpoints, Context, Endpoint, QpCaps};
    use rfs_proto::handshake::{dial, queue_pair_route};
    use rfs_proto::hello::{Data, Hello, QueuePair};
    let meta = meta("16M");
    if secret().is_none() || rfs_e2e::transport() != "tcp" {
        return; // tokens are what tcp queue pairs name; without a secret nothing is bound
    }
    let timeout = Duration::from_secs(5);
    let ctx = Context::open(&client_config().transport).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let (mut s, key) = dial(
        meta.addr,
        secret().as_deref(),
        &Hello::Data(Data { qps: 1 }),
        timeout,
    )
    .unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    let route = queue_pair_route(secret().as_deref(), false, key.as_ref()).unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let prepared = ctx
        .create_qp(&pd, &cq, &cq, QpCaps::default(), &route)
        .unwrap();
    let ours = prepared.endpoint().unwrap();
    let theirs = exchange_endpoints(&mut s, &[ours], route.binding()).unwrap();
    let (Endpoint::Tcp(ours_tcp), Endpoint::Tcp(node_tcp)) = (ours, theirs[0]) else {
        unreachable!("tcp endpoints")
    };
    // The other peer: authenticated in its own right, naming the session's tokens, with a
    // proof it can only make up (here: none, and one of its own connection's key).
    for proof in [[0u8; 32], [0x5a; 32]] {
        let (mut thief, _) = dial(
            meta.addr,
            secret().as_deref(),
            &Hello::QueuePair(QueuePair { encrypt: false }),
            timeout,
        )
        .unwrap();
        let mut hello = 0x5242_5150u32.to_le_bytes().to_vec();
        hello.extend_from_slice(&ours_tcp.token.to_le_bytes());
        hello.extend_from_slice(&node_tcp.token.to_le_bytes());
        hello.extend_from_slice(&proof);
        thief.write_all(&hello).unwrap();
        thief.set_read_timeout(Some(timeout)).unwrap();
        let mut answer = [0u8; 1];
        assert_eq!(
            thief.read(&mut answer).unwrap_or(0),
            0,
            "the node answered the thief's hello"
        );
    }
    prepared
        .connect(&theirs[0])
        .expect("the session's own connection takes its queue pair");
    let pool = rfs_proto::frame::recv_frame(&mut s, 1 << 16).unwrap();
    assert!(
        rfs_proto::integrity::open(key.as_ref(), rfs_proto::integrity::POOL, 0, &pool).is_some(),
        "the session is set up"
    );
}

/// A copy of a call the client made before, sent again on its own connection by someone on
/// the path (the MAC is right: it is the client's): an unlink replayed after the client made
/// the name again is not applied.
#[test]
fn a_call_replayed_after_it_was_answered_is_not_applied() {
    use rfs_proto::integrity::{self, CALL, REPLY};
    use rfs_proto::message::{encode_call, seal, Envelope};
    let meta = meta("16M");
    let (rpc, key, _control) = raw_metadata_channel(&meta);
    let frame = |seq: u64, call: Vec<u8>| {
        let envelope = Envelope {
            seq,
            oldest: seq,
            sent_ms: rfs_proto::clock::now_ms(),
            budget_ms: 10_000,
        };
        integrity::seal(key.as_ref(), CALL, seq, seal(&envelope, &call))
    };
    let ask = |seq: u64, sealed: &[u8]| {
        let reply = rpc.call(sealed).unwrap();
        integrity::open(key.as_ref(), REPLY, seq, &reply)
            .expect("sealed by the session key")
            .to_vec()
    };
    let owner = Owner {
        perm: 0o644,
        uid: 0,
        gid: 0,
        umask: 0,
    };
    let create = |seq| {
        let call = Create {
            parent: ROOT,
            name: "again".into(),
            owner,
            access: RW,
            caller: Caller::default(),
        };
        let r = ask(seq, &frame(seq, encode_call(&call)));
        decode_reply::<Create>(&r).unwrap().unwrap().attr.ino
    };
    create(1);
    let unlink = frame(
        2,
        encode_call(&Unlink {
            parent: ROOT,
            name: "again".into(),
            caller: Caller::default(),
        }),
    );
    decode_reply::<Unlink>(&ask(2, &unlink)).unwrap().unwrap();
    let ino = create(3);
    let replayed = ask(2, &unlink);
    assert_eq!(
        decode_reply::<Unlink>(&replayed).unwrap(),
        Err(Errno::EIO),
        "the copy is refused"
    );
    let c = client(&meta);
    let found = c.call(Lookup {
        parent: ROOT,
        name: "again".into(),
        caller: Caller::default(),
    });
    assert_eq!(
        found.unwrap().ino,
        ino,
        "the name made again is still there"
    );
}

#[test]
fn bad_flags_fail_with_a_message() {
    // A secret anyone may read is no secret.
    let shared = std::env::temp_dir().join(format!("rfs-shared-secret-{}", std::process::id()));
    std::fs::write(&shared, "k\n").unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o640)).unwrap();
    let shared = shared.to_str().unwrap().to_string();
    for args in [
        vec!["--memory", "lots"],
        vec!["--memory", "1K"],
        vec!["--memory", "8M", "--chunk-size", "3000"],
        vec!["--memory", "8M", "--transport", "carrier-pigeon"],
        vec!["--memory", "8M", "--secret-file", "/nonexistent/secret"],
        vec!["--memory", "8M", "--secret-file", &shared, "--insecure"],
        vec!["--memory", "8M", "--secret-file", &shared],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_mem-server"))
            .args(["--listen", "127.0.0.1:0"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!out.stderr.is_empty(), "{args:?} said nothing");
    }
    let _ = std::fs::remove_file(shared);
}

/// The availability issue's finding: a call given up on while the metadata node was stopped
/// was applied when the node resumed, behind the caller's back. Now a call that reaches the
/// node past its caller's deadline is refused, unapplied; one with time left is applied.
#[test]
fn a_call_that_reaches_the_node_after_its_deadline_is_not_applied() {
    let server = MemServer::start(&["--memory", "4M", "--lease", "5"]);
    let c = client(&server);
    c.set_call_timeout(Duration::from_millis(1000));
    let mkdir = |name: &str| {
        c.call(Mkdir {
            parent: ROOT,
            name: name.into(),
            owner: Owner {
                perm: 0o755,
                uid: 0,
                gid: 0,
                umask: 0,
            },
            caller: Caller::default(),
        })
    };
    mkdir("before").unwrap();
    rfs_e2e::stop(server.pid());
    let start = Instant::now();
    let given_up = mkdir("given-up");
    let took = start.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    rfs_e2e::resume(server.pid());
    println!("given up after {took:?}: {given_up:?}");
    assert!(given_up.is_err(), "{given_up:?}");
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // Stopped well within the session's grace: the session and its connection go on.
    mkdir("after").unwrap();
    let looked = |name: &str| {
        c.call(Lookup {
            parent: ROOT,
            name: name.into(),
            caller: Caller::default(),
        })
        .map(|_| ())
        .map_err(|e| e.errno())
    };
    assert_eq!(looked("after"), Ok(()));
    assert_eq!(
        looked("given-up"),
        Err(Errno::ENOENT),
        "applied behind the caller's back"
    );
}

fn commit(c: &Client, ino: u64, size: u64, cuts: u64) -> Result<Committed, Errno> {
    c.call(Commit {
        ino,
        size,
        mtime: None,
        cuts,
    })
    .map_err(|e| e.errno())
}

/// Every truncate counts as a cut, and a commit made with an older count (its client missed
/// the cut: a lost callback, or one it has not applied yet) is refused with ESTALE rather than
/// grow the file back over the cut; with the count it learns, it commits.
#[test]
fn a_commit_made_before_a_cut_its_client_missed_is_refused() {
    let meta = meta("8M");
    let a = client(&meta);
    let ino = create(&a, "f");
    let first = commit(&a, ino, 5000, 0).unwrap().after;
    assert_eq!((first.size, first.cuts), (5000, 0));
    let b = client(&meta);
    open(&b, ino);
    let changes = AttrChanges {
        size: Some(0),
        ..AttrChanges::default()
    };
    let cut = b
        .call(SetAttr {
            ino,
            changes,
            caller: Caller::default(),
        })
        .unwrap();
    assert_eq!(cut.cuts, 1);
    let grown = commit(&b, ino, 6000, 1).unwrap();
    assert_eq!(
        grown.before, cut,
        "the commit's before is what the cut left"
    );
    assert_eq!(grown.after.size, 6000);
    assert_eq!(commit(&a, ino, 9000, 0), Err(Errno::ESTALE));
    let now = a.call(GetAttr { ino }).unwrap();
    assert_eq!(
        (now.size, now.cuts),
        (6000, 1),
        "the cut and what followed it hold"
    );
    let last = commit(&a, ino, 7000, now.cuts).unwrap();
    assert_eq!(last.before, now, "a's commit shows b's change before it");
    assert_eq!(last.after.size, 7000);
}

/// A connection severed on request is a partition that lasts until traffic: the idle redial
/// leaves it down (tests count on the callbacks it misses), and the next call dials again.
#[test]
fn a_connection_severed_on_request_stays_down_until_the_next_call() {
    let meta = meta("8M");
    let c = client(&meta);
    let ino = create(&c, "f");
    c.sever();
    assert!(!c.metadata_connected());
    c.redial().unwrap();
    assert!(!c.metadata_connected(), "the idle redial reconnected");
    assert_eq!(c.call(GetAttr { ino }).unwrap().ino, ino);
    assert!(c.metadata_connected());
}

/// The client's transfer counters are totals over its data sessions, those gone included:
/// they summed the live sessions only, so a session broken and dropped took its bytes with it
/// and the totals went back (an end-to-end test saw bytes_written short under load).
#[test]
fn transfer_counters_keep_what_a_broken_data_session_moved() {
    let meta = meta("8M");
    let mut d = data(&meta, "8M");
    let c = client(&meta);
    wait_until("the data node to join", || nodes(&c).len() == 2);
    let ino = create(&c, "f");
    let on_data = allocate(&c, ino, 0, 8)
        .unwrap()
        .into_iter()
        .find(|(_, ch)| ch.node != 0)
        .expect("a chunk on the data node");
    write_chunk(&c, &on_data.1, vec![7; 1 << 20]);
    let written = c.counters().bytes_written;
    assert!(written >= 1 << 20);
    d.kill();
    wait_until("the broken session to be dropped", || {
        c.is_down(on_data.1.node) || c.connected(on_data.1.node).is_none()
    });
    assert!(c.connected(on_data.1.node).is_none());
    let after = c.counters();
    assert_eq!(after.bytes_written, written, "bytes written stay counted");
    assert_eq!(after.inflight_bytes, 0);
}
