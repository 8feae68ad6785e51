//! The verbs-model conformance suite. Every test runs against the provider named by
//! RDMABOX_TEST_PROVIDER (`tcp` by default; the Soft-RoCE harness in tests/rxe runs it with
//! `verbs`), so both providers are held to the same semantics.
//!
//! On tcp, the first side of a pair has its queue pairs served by engines and the second by
//! the event loops, as a client and a storage node are: each kind is held to the suite against
//! the other. RDMABOX_TCP_SERVING=engines or =loops serves both sides alike.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmabox::transport::{
    exchange_endpoints, Access, Completion, CompletionQueue, Context, MemoryRegion, PostError,
    ProtectionDomain, ProviderKind, QpCaps, QpRoute, QpState, QueuePair, RecvWr, RemoteAddr,
    RemoteRegion, SendOp, SendWr, TransportConfig, WcOpcode, WcStatus,
};

fn provider() -> ProviderKind {
    std::env::var("RDMABOX_TEST_PROVIDER")
        .ok()
        .map(|p| p.parse().expect("RDMABOX_TEST_PROVIDER"))
        .unwrap_or(ProviderKind::Tcp)
}

/// Which side of a pair a context is for.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    First,
    Second,
}

fn config(role: Role) -> TransportConfig {
    let mut cfg = TransportConfig::with_provider(provider());
    cfg.tcp.served_by_loops = match std::env::var("RDMABOX_TCP_SERVING").as_deref() {
        Ok("engines") => false,
        Ok("loops") => true,
        Ok(other) => panic!("RDMABOX_TCP_SERVING={other}: engines or loops"),
        Err(_) => role == Role::Second,
    };
    cfg.tcp.rnr_timeout = Duration::from_millis(300);
    cfg.tcp.dead_peer_timeout = Duration::from_secs(2);
    cfg.verbs.dead_peer_timeout = Duration::from_secs(2);
    cfg
}

/// One end of a connection: its own context, PD, send and receive CQs and QP.
struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    scq: CompletionQueue,
    rcq: CompletionQueue,
    qp: QueuePair,
}

struct Half {
    ctx: Context,
    pd: ProtectionDomain,
    scq: CompletionQueue,
    rcq: CompletionQueue,
    prepared: rdmabox::transport::PreparedQueuePair,
}

fn half(caps: QpCaps, role: Role) -> Half {
    let ctx = Context::open(&config(role)).expect("open provider");
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(4096).unwrap();
    let rcq = ctx.create_cq(4096).unwrap();
    let prepared = ctx
        .create_qp(&pd, &scq, &rcq, caps, &QpRoute::OwnPort)
        .unwrap();
    Half {
        ctx,
        pd,
        scq,
        rcq,
        prepared,
    }
}

impl Half {
    fn connect(self, remote: &rdmabox::transport::Endpoint) -> Side {
        Side {
            qp: self.prepared.connect(remote).expect("connect qp"),
            ctx: self.ctx,
            pd: self.pd,
            scq: self.scq,
            rcq: self.rcq,
        }
    }
}

/// Two connected sides in this process, set up over a loopback control connection the way two
/// hosts would.
fn pair_with(caps: QpCaps) -> (Side, Side) {
    pair_of(caps, caps)
}

/// Like [`pair_with`], each side with caps of its own.
fn pair_of(caps: QpCaps, b_caps: QpCaps) -> (Side, Side) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let b = std::thread::spawn(move || {
        let h = half(b_caps, Role::Second);
        let mut c = TcpStream::connect(addr).unwrap();
        let remote = exchange_endpoints(&mut c, &[h.prepared.endpoint().unwrap()], None).unwrap();
        h.connect(&remote[0])
    });
    let h = half(caps, Role::First);
    let (mut s, _) = l.accept().unwrap();
    let remote = exchange_endpoints(&mut s, &[h.prepared.endpoint().unwrap()], None).unwrap();
    let a = h.connect(&remote[0]);
    (a, b.join().unwrap())
}

fn pair() -> (Side, Side) {
    pair_with(QpCaps::default())
}

/// Polls until `n` completions arrived; fails the test after `limit`.
fn wait_for(cq: &CompletionQueue, n: usize, limit: Duration) -> Vec<Completion> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [Completion::EMPTY; 64];
    while got.len() < n {
        let k = cq.poll(&mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                start.elapsed() < limit,
                "only {} of {n} completions after {limit:?}: {got:?}",
                got.len()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    got
}

fn wait_one(cq: &CompletionQueue) -> Completion {
    wait_for(cq, 1, Duration::from_secs(20))[0]
}

/// Nothing more arrives within a short while.
fn assert_quiet(cq: &CompletionQueue) {
    std::thread::sleep(Duration::from_millis(50));
    let mut buf = [Completion::EMPTY; 8];
    assert_eq!(cq.poll(&mut buf).unwrap(), 0, "unexpected: {:?}", &buf[..1]);
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn region(side: &Side, len: usize) -> MemoryRegion {
    side.pd.alloc_region(len, Access::ALL).unwrap()
}

fn at(r: &RemoteRegion, off: u64) -> RemoteAddr {
    r.at(off).unwrap()
}

#[test]
fn multi_sge_write_then_read_back_byte_for_byte() {
    let (a, b) = pair();
    let local = region(&a, 64 * 1024);
    let remote = region(&b, 64 * 1024);
    let data = pattern(3 * 5000, 7);
    local.write_at(0, &data[..5000]).unwrap();
    local.write_at(10_000, &data[5000..10_000]).unwrap();
    local.write_at(30_000, &data[10_000..]).unwrap();
    let r = remote.remote();
    let sges = [
        local.slice(0, 5000).unwrap(),
        local.slice(10_000, 5000).unwrap(),
        local.slice(30_000, 5000).unwrap(),
    ];
    a.qp.post_send(&[SendWr::new(1, SendOp::Write(at(&r, 100)), &sges)])
        .unwrap();
    let c = wait_one(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (1, WcStatus::Success, WcOpcode::Write)
    );
    let mut landed = vec![0u8; data.len()];
    remote.read_at(100, &mut landed).unwrap();
    assert_eq!(landed, data, "gathered WRITE landed contiguously");

    // Read it back scattered over two other SGEs of different sizes.
    let back = [
        local.slice(40_000, 4000).unwrap(),
        local.slice(50_000, 11_000).unwrap(),
    ];
    a.qp.post_send(&[SendWr::new(2, SendOp::Read(at(&r, 100)), &back)])
        .unwrap();
    let c = wait_one(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (2, WcStatus::Success, WcOpcode::Read)
    );
    assert_eq!(c.byte_len, 15_000);
    let mut got = vec![0u8; 15_000];
    local.read_at(40_000, &mut got[..4000]).unwrap();
    local.read_at(50_000, &mut got[4000..]).unwrap();
    assert_eq!(got, data);
}

/// A queue pair its side never posts on (on tcp: served by the responder loop, with no
/// threads of its own) serves READs and WRITEs like any: many in flight, byte for byte, and a
/// bad key is refused.
#[test]
fn a_responder_only_queue_pair_serves_reads_and_writes() {
    let (a, b) = pair_of(QpCaps::default(), QpCaps::RESPONDER);
    let local = region(&a, 256 * 1024);
    let remote = region(&b, 256 * 1024);
    let data = pattern(256 * 1024, 3);
    local.write_at(0, &data).unwrap();
    let r = remote.remote();
    let sges: Vec<_> = (0..64)
        .map(|i| [local.slice(i * 4096, 4096).unwrap()])
        .collect();
    let writes: Vec<_> = (0..64)
        .map(|i| SendWr::new(i as u64, SendOp::Write(at(&r, i as u64 * 4096)), &sges[i]))
        .collect();
    a.qp.post_send(&writes).unwrap();
    let done = wait_for(&a.scq, 64, Duration::from_secs(20));
    assert!(
        done.iter().all(|c| c.status == WcStatus::Success),
        "{done:?}"
    );
    assert_eq!(remote.to_vec(), data);
    let back: Vec<_> = (0..64)
        .map(|i| [local.slice(128 * 1024 + i * 2048, 2048).unwrap()])
        .collect();
    let reads: Vec<_> = (0..64)
        .map(|i| {
            SendWr::new(
                100 + i as u64,
                SendOp::Read(at(&r, i as u64 * 2048)),
                &back[i],
            )
        })
        .collect();
    a.qp.post_send(&reads).unwrap();
    let done = wait_for(&a.scq, 64, Duration::from_secs(20));
    assert!(
        done.iter().all(|c| c.status == WcStatus::Success),
        "{done:?}"
    );
    let mut got = vec![0u8; 128 * 1024];
    local.read_at(128 * 1024, &mut got).unwrap();
    assert_eq!(got, data[..128 * 1024]);
    let wrong = RemoteAddr {
        rkey: r.rkey ^ 0x5a5a,
        ..at(&r, 0)
    };
    a.qp.post_send(&[SendWr::new(999, SendOp::Read(wrong), &back[0])])
        .unwrap();
    let c = wait_one(&a.scq);
    assert_eq!((c.wr_id, c.status), (999, WcStatus::RemoteAccessError));
}

#[test]
fn chain_of_mixed_opcodes_in_one_post() {
    let (a, b) = pair();
    let local = region(&a, 16 * 1024);
    let remote = region(&b, 16 * 1024);
    let inbox = region(&b, 4096);
    b.qp.post_recv(&[RecvWr {
        wr_id: 90,
        sges: &[inbox.sge()],
    }])
    .unwrap();
    let r = remote.remote();
    local.write_at(0, &pattern(4096, 1)).unwrap();
    local.write_at(4096, b"inline!!").unwrap();
    local.write_at(8192, b"hello over send").unwrap();
    let w = [local.slice(0, 4096).unwrap()];
    let inl = [local.slice(4096, 8).unwrap()];
    let rd = [local.slice(12_288, 4096).unwrap()];
    let msg = [local.slice(8192, 15).unwrap()];
    let before = a.qp.wire_writes();
    a.qp.post_send(&[
        SendWr::new(1, SendOp::Write(at(&r, 0)), &w).unsignaled(),
        SendWr::new(2, SendOp::Write(at(&r, 5000)), &inl)
            .unsignaled()
            .inline(),
        SendWr::new(3, SendOp::Read(at(&r, 0)), &rd),
        SendWr::new(4, SendOp::Send, &msg),
    ])
    .unwrap();
    let done = wait_for(&a.scq, 2, Duration::from_secs(20));
    let ids: Vec<_> = done.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        ids,
        [(3, WcStatus::Success), (4, WcStatus::Success)],
        "in order, signaled only"
    );
    assert_quiet(&a.scq);
    if let (Some((p0, w0)), Some((p1, w1))) = (before, a.qp.wire_writes()) {
        assert_eq!(
            (p1 - p0, w1 - w0),
            (1, 1),
            "the chain left as one post and one writev"
        );
    }
    let mut back = vec![0u8; 4096];
    local.read_at(12_288, &mut back).unwrap();
    assert_eq!(
        back,
        pattern(4096, 1),
        "READ after WRITE in one chain sees the WRITE"
    );
    let mut inl_landed = [0u8; 8];
    remote.read_at(5000, &mut inl_landed).unwrap();
    assert_eq!(&inl_landed, b"inline!!");
    let c = wait_one(&b.rcq);
    assert_eq!((c.wr_id, c.opcode, c.byte_len), (90, WcOpcode::Recv, 15));
    let mut m = [0u8; 15];
    inbox.read_at(0, &mut m).unwrap();
    assert_eq!(&m, b"hello over send");
}

#[test]
fn unsignaled_requests_then_one_signaled() {
    let (a, b) = pair();
    let local = region(&a, 64 * 1024);
    let remote = region(&b, 64 * 1024);
    let r = remote.remote();
    local.write_at(0, &pattern(64 * 1024, 3)).unwrap();
    for round in 0..4u64 {
        let sges: Vec<_> = (0..16)
            .map(|i| [local.slice(i * 4096, 4096).unwrap()])
            .collect();
        let chain: Vec<_> = (0..16)
            .map(|i| {
                let wr = SendWr::new(
                    round * 100 + i as u64,
                    SendOp::Write(at(&r, i as u64 * 4096)),
                    &sges[i],
                );
                if i == 15 {
                    wr
                } else {
                    wr.unsignaled()
                }
            })
            .collect();
        // Post one at a time: unsignaled requests are still ordered and retired.
        for wr in &chain {
            a.qp.post_send(std::slice::from_ref(wr)).unwrap();
        }
        let c = wait_one(&a.scq);
        assert_eq!((c.wr_id, c.status), (round * 100 + 15, WcStatus::Success));
        assert_quiet(&a.scq);
    }
    assert_eq!(remote.to_vec(), pattern(64 * 1024, 3));
}

#[test]
fn write_with_imm_and_send_recv() {
    let (a, b) = pair();
    let local = region(&a, 8192);
    let remote = region(&b, 8192);
    let inbox = region(&b, 8192);
    local.write_at(0, &pattern(8192, 9)).unwrap();
    let recv_sges = [
        [
            inbox.slice(0, 100).unwrap(),
            inbox.slice(1000, 4000).unwrap(),
        ],
        [
            inbox.slice(5000, 64).unwrap(),
            inbox.slice(6000, 64).unwrap(),
        ],
        [inbox.slice(7000, 1).unwrap(), inbox.slice(7100, 1).unwrap()],
    ];
    let recvs: Vec<_> = recv_sges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: 50 + i as u64,
            sges: s,
        })
        .collect();
    b.qp.post_recv(&recvs).unwrap();

    let w = [local.slice(0, 2048).unwrap()];
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::WriteWithImm(at(&remote.remote(), 512), 0xabcd_0123),
        &w,
    )])
    .unwrap();
    let c = wait_one(&b.rcq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.imm, c.byte_len),
        (
            50,
            WcStatus::Success,
            WcOpcode::RecvWithImm,
            Some(0xabcd_0123),
            2048
        )
    );
    let mut got = vec![0u8; 2048];
    remote.read_at(512, &mut got).unwrap();
    assert_eq!(
        got,
        &pattern(8192, 9)[..2048],
        "WRITE_WITH_IMM data in memory, not the RECV"
    );
    assert_eq!(wait_one(&a.scq).status, WcStatus::Success);

    // SEND with immediate, scattered across the second RECV's two SGEs.
    let s = [local.slice(100, 100).unwrap()];
    a.qp.post_send(&[SendWr::new(2, SendOp::SendWithImm(7), &s)])
        .unwrap();
    let c = wait_one(&b.rcq);
    assert_eq!(
        (c.wr_id, c.opcode, c.imm, c.byte_len),
        (51, WcOpcode::RecvWithImm, Some(7), 100)
    );
    let mut first = vec![0u8; 64];
    let mut second = vec![0u8; 36];
    inbox.read_at(5000, &mut first).unwrap();
    inbox.read_at(6000, &mut second).unwrap();
    assert_eq!([first, second].concat(), &pattern(8192, 9)[100..200]);
    assert_eq!(wait_one(&a.scq).wr_id, 2);

    // A zero-length SEND still consumes a RECV.
    a.qp.post_send(&[SendWr::new(3, SendOp::Send, &[])])
        .unwrap();
    let c = wait_one(&b.rcq);
    assert_eq!((c.wr_id, c.byte_len, c.imm), (52, 0, None));
    assert_eq!(wait_one(&a.scq).status, WcStatus::Success);
}

fn assert_refused(a: &Side, status: WcStatus) {
    let c = wait_one(&a.scq);
    assert_eq!((c.wr_id, c.status), (1, status));
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.qp.state() != QpState::Error {
        assert!(
            Instant::now() < deadline,
            "QP never entered the error state"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // An error-state QP flushes whatever is posted next.
    a.qp.post_send(&[SendWr::new(2, SendOp::Send, &[])])
        .unwrap();
    let c = wait_one(&a.scq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::WrFlushError));
}

#[test]
fn wrong_rkey_is_a_remote_access_error_and_touches_nothing() {
    let (a, b) = pair();
    let local = region(&a, 4096);
    let remote = region(&b, 4096);
    local.fill(0, 4096, 0xee).unwrap();
    let bad = RemoteAddr {
        addr: remote.addr(),
        rkey: remote.rkey() ^ 0x5a5a,
    };
    a.qp.post_send(&[SendWr::new(1, SendOp::Write(bad), &[local.sge()])])
        .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(
        remote.to_vec().iter().all(|&x| x == 0),
        "remote memory untouched"
    );
}

#[test]
fn out_of_bounds_read_is_a_remote_access_error_and_touches_nothing() {
    let (a, b) = pair();
    let local = region(&a, 8192);
    let remote = region(&b, 4096);
    remote.fill(0, 4096, 0x11).unwrap();
    // Starts inside the region, ends 1 byte past it.
    let r = at(&remote.remote(), 1);
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Read(r),
        &[local.slice(0, 4096).unwrap()],
    )])
    .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(
        local.to_vec().iter().all(|&x| x == 0),
        "local memory untouched"
    );
}

#[test]
fn write_to_a_read_only_region_is_refused() {
    let (a, b) = pair();
    let local = region(&a, 4096);
    let remote =
        b.pd.alloc_region(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .unwrap();
    local.fill(0, 4096, 0x77).unwrap();
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Write(at(&remote.remote(), 0)),
        &[local.sge()],
    )])
    .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(remote.to_vec().iter().all(|&x| x == 0));
}

#[test]
fn deregistered_region_is_no_longer_reachable() {
    let (a, b) = pair();
    let local = region(&a, 4096);
    let remote = region(&b, 4096);
    let r = remote.remote();
    drop(remote);
    a.qp.post_send(&[SendWr::new(1, SendOp::Read(at(&r, 0)), &[local.sge()])])
        .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
}

/// A pool in a domain no queue pair uses, as a storage node keeps it, and a grant of
/// `len` bytes at `offset` of it in `side`'s domain (the one its queue pair uses).
fn pool_and_grant(
    side: &Side,
    offset: usize,
    len: usize,
    access: Access,
) -> (ProtectionDomain, MemoryRegion, MemoryRegion) {
    let pool_pd = side.ctx.alloc_pd().unwrap();
    let pool = pool_pd.alloc_region(64 << 10, Access::ALL).unwrap();
    let grant = side.pd.register_within(&pool, offset, len, access).unwrap();
    (pool_pd, pool, grant)
}

#[test]
fn a_grant_reaches_its_range_of_the_pool_and_nothing_past_it() {
    let (a, b) = pair();
    let (_pd, pool, grant) = pool_and_grant(&b, 16 << 10, 8 << 10, Access::ALL);
    assert_eq!(grant.addr(), pool.addr() + (16 << 10));
    let local = region(&a, 8 << 10);
    let data = pattern(4096, 7);
    local.write_at(0, &data).unwrap();
    let g = grant.remote();
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Write(at(&g, 4096)),
        &[local.slice(0, 4096).unwrap()],
    )])
    .unwrap();
    assert!(wait_one(&a.scq).status.is_ok());
    let mut back = vec![0u8; 4096];
    pool.read_at((16 << 10) + 4096, &mut back).unwrap();
    assert_eq!(back, data, "the write landed in the pool through the grant");
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Read(at(&g, 1)),
        &[local.slice(0, 8 << 10).unwrap()],
    )])
    .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(pool.to_vec()[..16 << 10].iter().all(|&x| x == 0));
}

#[test]
fn the_pool_itself_is_out_of_reach_of_a_queue_pair_in_another_domain() {
    let (a, b) = pair();
    let (_pd, pool, _grant) = pool_and_grant(&b, 0, 4096, Access::ALL);
    let local = region(&a, 4096);
    local.fill(0, 4096, 0x5c).unwrap();
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Write(at(&pool.remote(), 8192)),
        &[local.sge()],
    )])
    .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(pool.to_vec().iter().all(|&x| x == 0), "pool untouched");
}

#[test]
fn a_revoked_grant_is_out_of_reach_while_the_pool_lives() {
    let (a, b) = pair();
    let (_pd, pool, grant) = pool_and_grant(&b, 0, 4096, Access::ALL);
    let g = grant.remote();
    drop(grant);
    pool.fill(0, 4096, 0x42).unwrap();
    let local = region(&a, 4096);
    a.qp.post_send(&[SendWr::new(1, SendOp::Read(at(&g, 0)), &[local.sge()])])
        .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(local.to_vec().iter().all(|&x| x == 0), "nothing read");
}

#[test]
fn a_read_only_grant_refuses_writes_and_grants_stay_within_their_parent() {
    let (a, b) = pair();
    let (_pd, pool, grant) = pool_and_grant(&b, 0, 4096, Access::LOCAL_WRITE | Access::REMOTE_READ);
    assert!(b
        .pd
        .register_within(&pool, 60 << 10, 8 << 10, Access::ALL)
        .is_err());
    assert!(b.pd.register_within(&grant, 0, 4096, Access::ALL).is_err());
    let local = region(&a, 4096);
    local.fill(0, 4096, 0x66).unwrap();
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Write(at(&grant.remote(), 0)),
        &[local.sge()],
    )])
    .unwrap();
    assert_refused(&a, WcStatus::RemoteAccessError);
    assert!(pool.to_vec().iter().all(|&x| x == 0), "pool untouched");
}

#[test]
fn send_queue_depth_is_enforced() {
    let caps = QpCaps {
        max_send_wr: 16,
        ..QpCaps::default()
    };
    let (a, b) = pair_with(caps);
    let local = region(&a, 4096);
    let remote = region(&b, 4096);
    let granted = a.qp.caps().max_send_wr as usize;
    let s = [local.sge()];
    // Devices may round the queue up (rxe does), so overfill it well past what was granted.
    let chain: Vec<_> = (0..granted * 4 + 64)
        .map(|i| SendWr::new(i as u64, SendOp::Write(at(&remote.remote(), 0)), &s))
        .collect();
    // Like ibv_post_send, a provider posts the prefix that fits and says how much; only that
    // prefix completes.
    let posted = match a.qp.post_send(&chain) {
        Err(PostError::QueueFull { posted }) => posted,
        other => panic!(
            "{} requests into a {granted}-deep queue: {other:?}",
            chain.len()
        ),
    };
    assert!(posted >= granted && posted < chain.len(), "posted {posted}");
    let done = wait_for(&a.scq, posted, Duration::from_secs(20));
    assert!(done.iter().all(|c| c.status.is_ok()));
    assert_quiet(&a.scq);
    // Once drained, a chain as deep as the queue goes out whole.
    a.qp.post_send(&chain[..granted]).unwrap();
    let done = wait_for(&a.scq, granted, Duration::from_secs(20));
    assert!(done.iter().all(|c| c.status.is_ok()));
    let too_many_sges: Vec<_> = (0..a.qp.caps().max_send_sge + 1)
        .map(|_| local.slice(0, 1).unwrap())
        .collect();
    assert!(matches!(
        a.qp.post_send(&[SendWr::new(
            1,
            SendOp::Write(at(&remote.remote(), 0)),
            &too_many_sges
        )]),
        Err(PostError::Invalid(_))
    ));
}

#[test]
fn zero_length_write_and_read_complete() {
    let (a, b) = pair();
    let local = region(&a, 64);
    let remote = region(&b, 64);
    let r = remote.remote();
    let empty = [local.slice(0, 0).unwrap()];
    a.qp.post_send(&[
        SendWr::new(1, SendOp::Write(at(&r, 0)), &empty),
        SendWr::new(2, SendOp::Read(at(&r, 0)), &empty),
        SendWr::new(3, SendOp::Write(at(&r, 0)), &[]),
    ])
    .unwrap();
    let done = wait_for(&a.scq, 3, Duration::from_secs(20));
    assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
    assert_eq!(a.qp.state(), QpState::ReadyToSend);
}

#[test]
fn large_transfer_of_64_mib() {
    const LEN: usize = 64 << 20;
    let (a, b) = pair();
    let local = region(&a, LEN);
    let remote = region(&b, LEN);
    let data = pattern(LEN, 5);
    local.write_at(0, &data).unwrap();
    a.qp.post_send(&[SendWr::new(
        1,
        SendOp::Write(at(&remote.remote(), 0)),
        &[local.sge()],
    )])
    .unwrap();
    assert_eq!(
        wait_for(&a.scq, 1, Duration::from_secs(120))[0].status,
        WcStatus::Success
    );
    assert!(remote.to_vec() == data, "64 MiB WRITE landed intact");
    local.fill(0, LEN, 0).unwrap();
    a.qp.post_send(&[SendWr::new(
        2,
        SendOp::Read(at(&remote.remote(), 0)),
        &[local.sge()],
    )])
    .unwrap();
    let c = wait_for(&a.scq, 1, Duration::from_secs(120))[0];
    assert_eq!((c.status, c.byte_len as usize), (WcStatus::Success, LEN));
    assert!(local.to_vec() == data, "64 MiB READ came back intact");
}

#[test]
fn cq_event_wakes_a_sleeping_waiter() {
    let (a, b) = pair();
    let local = region(&a, 64);
    let remote = region(&b, 64);
    let scq = a.scq.clone();
    scq.arm().unwrap();
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        let woke = scq.wait_event(Some(Duration::from_secs(20))).unwrap();
        (woke, t.elapsed(), wait_one(&scq))
    });
    std::thread::sleep(Duration::from_millis(100));
    a.qp.post_send(&[SendWr::new(
        9,
        SendOp::Write(at(&remote.remote(), 0)),
        &[local.sge()],
    )])
    .unwrap();
    let (woke, slept, c) = waiter.join().unwrap();
    assert!(woke, "the waiter was not woken");
    assert!(slept >= Duration::from_millis(50), "it did sleep first");
    assert_eq!(c.wr_id, 9);
    // Not re-armed: the next completion fires no event.
    a.qp.post_send(&[SendWr::new(
        10,
        SendOp::Write(at(&remote.remote(), 0)),
        &[local.sge()],
    )])
    .unwrap();
    wait_one(&a.scq);
    assert!(!a.scq.wait_event(Some(Duration::from_millis(50))).unwrap());
}

#[test]
fn cq_event_never_loses_a_completion_racing_the_rearm() {
    const N: u64 = 400;
    let (a, b) = pair();
    let local = region(&a, 64);
    let remote = region(&b, 64);
    let cq = a.scq.clone();
    let consumer = std::thread::spawn(move || {
        let mut got = 0u64;
        let mut sleeps = 0u64;
        let mut buf = [Completion::EMPTY; 16];
        while got < N {
            let n = cq.poll(&mut buf).unwrap();
            if n > 0 {
                got += n as u64;
                continue;
            }
            cq.arm().unwrap();
            // The completion may have landed between the poll and the arm: look once more.
            let n = cq.poll(&mut buf).unwrap();
            if n > 0 {
                got += n as u64;
                continue;
            }
            sleeps += 1;
            assert!(
                cq.wait_event(Some(Duration::from_secs(10))).unwrap(),
                "lost wake-up with {got} of {N} completions"
            );
        }
        sleeps
    });
    let mut rng = 0x1234_5678u64;
    for i in 0..N {
        a.qp.post_send(&[SendWr::new(
            i,
            SendOp::Write(at(&remote.remote(), 0)),
            &[local.sge()],
        )])
        .unwrap();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if rng.is_multiple_of(3) {
            std::thread::sleep(Duration::from_micros(rng % 300));
        }
    }
    let sleeps = consumer.join().unwrap();
    assert!(
        sleeps > 0,
        "the consumer never slept, so the race was not exercised"
    );
}

#[test]
fn many_qps_and_threads_at_once() {
    const QPS: usize = 6;
    let workers: Vec<_> = (0..QPS)
        .map(|q| {
            std::thread::spawn(move || {
                let (a, b) = pair();
                let local = region(&a, 256 * 1024);
                let remote = region(&b, 256 * 1024);
                let r = remote.remote();
                for round in 0..40usize {
                    let len = 1 + (round * 7919 + q * 104_729) % (128 * 1024);
                    let data = pattern(len, (q * 40 + round) as u8);
                    local.write_at(0, &data).unwrap();
                    let off = (round * 4096) as u64 % (128 * 1024);
                    a.qp.post_send(&[
                        SendWr::new(
                            1,
                            SendOp::Write(at(&r, off)),
                            &[local.slice(0, len).unwrap()],
                        )
                        .unsignaled(),
                        SendWr::new(
                            2,
                            SendOp::Read(at(&r, off)),
                            &[local.slice(128 * 1024, len).unwrap()],
                        ),
                    ])
                    .unwrap();
                    let c = wait_one(&a.scq);
                    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
                    let mut back = vec![0u8; len];
                    local.read_at(128 * 1024, &mut back).unwrap();
                    assert!(back == data, "qp {q} round {round}: data mismatch");
                }
                drop(b);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
}

#[test]
fn many_threads_posting_to_one_qp() {
    const THREADS: u64 = 4;
    const EACH: u64 = 200;
    let (a, b) = pair();
    let a = Arc::new(a);
    let local = Arc::new(region(&a, 4096 * THREADS as usize));
    let remote = region(&b, 4096 * THREADS as usize);
    let r = remote.remote();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, local) = (a.clone(), local.clone());
            std::thread::spawn(move || {
                local
                    .write_at(t as usize * 4096, &pattern(4096, t as u8))
                    .unwrap();
                for i in 0..EACH {
                    let s = [local.slice(t as usize * 4096, 4096).unwrap()];
                    loop {
                        match a.qp.post_send(&[SendWr::new(
                            t * EACH + i,
                            SendOp::Write(at(&r, t * 4096)),
                            &s,
                        )]) {
                            Ok(()) => break,
                            Err(PostError::QueueFull { posted: 0 }) => std::thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            })
        })
        .collect();
    let done = wait_for(&a.scq, (THREADS * EACH) as usize, Duration::from_secs(60));
    for t in threads {
        t.join().unwrap();
    }
    let mut ids: Vec<_> = done.iter().map(|c| c.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..THREADS * EACH).collect::<Vec<_>>());
    assert!(done.iter().all(|c| c.status.is_ok()));
    for t in 0..THREADS {
        let mut got = vec![0u8; 4096];
        remote.read_at(t as usize * 4096, &mut got).unwrap();
        assert_eq!(got, pattern(4096, t as u8));
    }
}

#[test]
fn send_without_a_posted_recv_fails_after_the_rnr_window() {
    if provider() != ProviderKind::Tcp {
        // RC hardware with rnr_retry = 7 retries forever by design; only tcp has a window.
        return;
    }
    let (a, _b) = pair();
    let local = region(&a, 64);
    a.qp.post_send(&[SendWr::new(1, SendOp::Send, &[local.sge()])])
        .unwrap();
    let t = Instant::now();
    let c = wait_one(&a.scq);
    assert_eq!(c.status, WcStatus::RnrRetryExceeded);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "waited for a RECV first"
    );
}

#[test]
fn send_larger_than_the_recv_buffer_is_a_remote_operation_error() {
    let (a, b) = pair();
    let local = region(&a, 256);
    let inbox = region(&b, 256);
    b.qp.post_recv(&[RecvWr {
        wr_id: 5,
        sges: &[inbox.slice(0, 16).unwrap()],
    }])
    .unwrap();
    a.qp.post_send(&[SendWr::new(1, SendOp::Send, &[local.slice(0, 64).unwrap()])])
        .unwrap();
    // What RC NICs report (rxe and mlx5 alike): a remote operation error for the sender, a
    // local length error for the receiver.
    let c = wait_one(&a.scq);
    assert_eq!(c.status, WcStatus::RemoteOperationError);
    let c = wait_one(&b.rcq);
    // mlx5 and tcp say local length error; rxe says local QP operation error.
    assert_eq!(c.wr_id, 5);
    assert!(
        matches!(
            c.status,
            WcStatus::LocalLengthError | WcStatus::LocalQpOperationError
        ),
        "{c:?}"
    );
}

const PEER_ENV: &str = "RDMABOX_CONFORMANCE_PEER";

/// Runs as the child process of `peer_killed_mid_transfer_flushes_everything`: serves a region
/// until it is killed.
#[test]
#[ignore = "helper: started as a child process by peer_killed_mid_transfer_flushes_everything"]
fn peer_process() {
    let Ok(addr) = std::env::var(PEER_ENV) else {
        return;
    };
    let h = half(QpCaps::default(), Role::Second);
    let mem = h.pd.alloc_region(64 << 20, Access::ALL).unwrap();
    let mut c = TcpStream::connect(addr).unwrap();
    let remote = exchange_endpoints(&mut c, &[h.prepared.endpoint().unwrap()], None).unwrap();
    let r = mem.remote();
    let mut msg = Vec::new();
    msg.extend_from_slice(&r.addr.to_le_bytes());
    msg.extend_from_slice(&r.len.to_le_bytes());
    msg.extend_from_slice(&r.rkey.to_le_bytes());
    c.write_all(&msg).unwrap();
    let _side = h.connect(&remote[0]);
    let mut buf = [0u8; 1];
    let _ = c.read(&mut buf); // until the parent goes away or kills us
}

struct KillOnDrop(Child);

impl KillOnDrop {
    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, sig) }, 0);
    }

    /// SIGSTOP, returning once the child is stopped: the signal is asynchronous, and a test
    /// that races it sees the peer answer requests "while stopped" (CI saw 2 of 16 answered).
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let stat = format!("/proc/{}/stat", self.0.id());
        let start = Instant::now();
        // The state letter follows the parenthesized command name.
        while !std::fs::read_to_string(&stat)
            .unwrap_or_default()
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T'))
        {
            assert!(start.elapsed() < Duration::from_secs(5), "never stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A peer in a child process serving a 64 MiB region, connected to a queue pair of ours.
struct ChildPeer {
    child: KillOnDrop,
    side: Side,
    region: RemoteRegion,
    /// The child serves until this closes.
    control: TcpStream,
}

impl ChildPeer {
    fn start() -> ChildPeer {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "peer_process", "--nocapture"])
            .env(PEER_ENV, l.local_addr().unwrap().to_string())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let child = KillOnDrop(child);
        let h = half(QpCaps::default(), Role::First);
        let (mut c, _) = l.accept().unwrap();
        let remote = exchange_endpoints(&mut c, &[h.prepared.endpoint().unwrap()], None).unwrap();
        let mut m = [0u8; 20];
        c.read_exact(&mut m).unwrap();
        let region = RemoteRegion {
            addr: u64::from_le_bytes(m[..8].try_into().unwrap()),
            len: u64::from_le_bytes(m[8..16].try_into().unwrap()),
            rkey: u32::from_le_bytes(m[16..].try_into().unwrap()),
        };
        ChildPeer {
            child,
            side: h.connect(&remote[0]),
            region,
            control: c,
        }
    }
}

#[test]
fn peer_killed_mid_transfer_flushes_everything() {
    let ChildPeer {
        mut child,
        side: a,
        region: r,
        control: _control,
    } = ChildPeer::start();
    let a = Arc::new(a);
    let local = Arc::new(a.pd.alloc_region(1 << 20, Access::ALL).unwrap());

    // Keep 1 MiB WRITEs and READs flowing until the peer dies under them.
    let posted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let poster = {
        let (a, local, posted, stop) = (a.clone(), local.clone(), posted.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let off = (i % 64) << 20;
                let op = if i.is_multiple_of(2) {
                    SendOp::Write(at(&r, off))
                } else {
                    SendOp::Read(at(&r, off))
                };
                match a.qp.post_send(&[SendWr::new(i, op, &[local.sge()])]) {
                    Ok(()) => {
                        i += 1;
                        posted.store(i, Ordering::Release);
                    }
                    Err(PostError::QueueFull { .. }) => {
                        std::thread::sleep(Duration::from_micros(100))
                    }
                    Err(e) => panic!("{e}"),
                }
                if i >= 512 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    let mut completions = Vec::new();
    let mut buf = [Completion::EMPTY; 64];
    // Let some work succeed first.
    let started = Instant::now();
    while completions
        .iter()
        .filter(|c: &&Completion| c.status.is_ok())
        .count()
        < 8
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no work succeeded: {completions:?}"
        );
        let n = a.scq.poll(&mut buf).unwrap();
        completions.extend_from_slice(&buf[..n]);
    }
    child.0.kill().unwrap();
    let killed = Instant::now();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    poster.join().unwrap();
    let total = posted.load(Ordering::Acquire) as usize;
    completions.extend(wait_for(
        &a.scq,
        total - completions.len(),
        Duration::from_secs(30),
    ));
    let elapsed = killed.elapsed();
    assert_eq!(completions.len(), total, "one completion per request");
    let failed = completions.iter().filter(|c| !c.status.is_ok()).count();
    // The first failure says why the requests failed: a flush after the NIC's retries ran
    // out (RetryExceeded), or something the dead peer's side still answered.
    let first_failure = completions
        .iter()
        .find(|c| !c.status.is_ok())
        .map(|c| c.status);
    assert!(
        failed > 0,
        "requests in flight when the peer died must fail"
    );
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    assert_eq!(a.qp.state(), QpState::Error);
    eprintln!(
        "peer killed: {total} requests, {failed} failed (first: {first_failure:?}), all \
         completed {elapsed:?} after the kill"
    );
}

/// A session's deadline holds whatever the peer does: stopped (over tcp its engine stops
/// answering; a NIC keeps serving a stopped process's memory) or killed (over verbs the NIC
/// retries, a bounded number of times). Every request is answered, with data or an error,
/// within the deadline and a little slack; none hangs.
#[test]
fn a_session_answers_every_request_in_time_when_the_peer_stops_or_dies() {
    let ChildPeer {
        child,
        side:
            Side {
                pd,
                scq,
                qp,
                rcq: _rcq,
                ctx: _ctx,
            },
        region: r,
        control: _control,
    } = ChildPeer::start();
    let limit = Duration::from_secs(1);
    let session = rdmabox::Session::new(
        Arc::new(pd),
        vec![(qp, scq)],
        vec![r],
        rdmabox::SessionConfig {
            qps: 1,
            io_timeout: Some(limit),
            ..Default::default()
        },
    )
    .unwrap();
    let burst = |what: &str| {
        let start = Instant::now();
        let pending: Vec<_> = (0..16u64)
            .map(|i| session.read_pending(at(&r, i << 20), vec![0; 1 << 20]))
            .collect();
        let results: Vec<_> = pending.into_iter().map(|p| p.wait()).collect();
        let took = start.elapsed();
        eprintln!(
            "{what}: {} of 16 failed ({:?}), all answered in {took:?}",
            results.iter().filter(|r| r.is_err()).count(),
            results.iter().find_map(|r| r.as_ref().err())
        );
        assert!(
            took < limit * 2 + Duration::from_millis(500),
            "{what}: {took:?}"
        );
        results
    };
    assert!(burst("alive").iter().all(|r| r.is_ok()));
    child.stop();
    let stopped = burst("stopped");
    for e in stopped.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(e, rdmabox::IoError::TimedOut(_) | rdmabox::IoError::Closed),
            "{e:?}"
        );
    }
    if provider() == ProviderKind::Tcp {
        assert!(
            stopped.iter().all(|r| r.is_err()),
            "nobody answers for a stopped engine"
        );
        assert!(session.counters().deadline_expiries >= 1);
        assert!(!session.is_open());
    }
    child.signal(libc::SIGKILL);
    burst("killed");
}
