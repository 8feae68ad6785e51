//! The serving sides of the tcp provider, driven by a raw socket that speaks the wire protocol:
//! the engine of a queue pair that posts (two threads of its own), the event loop serving one
//! that posts, and the event loop serving a passive one (no send or receive queue) are held to
//! the same behaviour.
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::route::hello;
use super::wire::{Header, Kind, NakReason, HEADER_LEN};
use super::TcpEndpoint;
use crate::transport::{
    Access, Completion, CompletionQueue, Context, Endpoint, ProviderKind, QpCaps, QpRoute,
    TransportConfig,
};

/// How a queue pair is served.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Served {
    /// One that posts, by an engine of its own.
    Engine,
    /// One that posts, by an event loop.
    Loop,
    /// A passive one, by an event loop.
    Passive,
}

const ALL: [Served; 3] = [Served::Engine, Served::Loop, Served::Passive];
/// Those that post.
const POSTING: [Served; 2] = [Served::Engine, Served::Loop];

impl Served {
    fn context(self) -> Context {
        let mut cfg = TransportConfig::with_provider(ProviderKind::Tcp);
        cfg.tcp.served_by_loops = self == Served::Loop;
        cfg.tcp.rnr_timeout = Duration::from_millis(500);
        Context::open(&cfg).unwrap()
    }

    fn caps(self) -> QpCaps {
        match self {
            Served::Passive => QpCaps::RESPONDER,
            _ => QpCaps::DEFAULT,
        }
    }
}

/// A peer connected to a fresh tcp queue pair over `pd`, as a raw socket that speaks the
/// wire protocol, and the queue pair.
fn raw_peer(
    ctx: &Context,
    pd: &crate::transport::ProtectionDomain,
    caps: QpCaps,
) -> (TcpStream, crate::transport::QueuePair) {
    let (s, qp, _) = raw_peer_cq(ctx, pd, caps);
    (s, qp)
}

/// [`raw_peer`], with the queue pair's one completion queue (send and receive).
fn raw_peer_cq(
    ctx: &Context,
    pd: &crate::transport::ProtectionDomain,
    caps: QpCaps,
) -> (TcpStream, crate::transport::QueuePair, CompletionQueue) {
    let cq = ctx.create_cq(4096).unwrap();
    let prepared = ctx
        .create_qp(pd, &cq, &cq, caps, &QpRoute::OwnPort)
        .unwrap();
    let Endpoint::Tcp(ep) = prepared.endpoint().unwrap() else {
        panic!("a tcp endpoint")
    };
    // With the smaller token we dial, as a peer provider would.
    let fake = TcpEndpoint {
        addr: ep.addr,
        qpn: 1,
        token: 0,
    };
    let accepting = std::thread::spawn(move || prepared.connect(&Endpoint::Tcp(fake)));
    let mut s = TcpStream::connect(ep.addr).unwrap();
    s.write_all(&hello(0, ep.token)).unwrap();
    let mut answer = hello(0, 0);
    s.read_exact(&mut answer).unwrap();
    (s, accepting.join().unwrap().unwrap(), cq)
}

/// A READ request frame for `len` bytes at `addr` of the region `rkey` names.
fn read_request(psn: u32, addr: u64, rkey: u32, len: u32) -> [u8; HEADER_LEN] {
    let mut h = Header::new(Kind::ReadRequest, psn);
    h.remote_addr = addr;
    h.rkey = rkey;
    h.len = len;
    h.encode()
}

/// READ requests that arrive together are answered together, in order: one socket write
/// for 16 responses instead of 16.
#[test]
fn reads_that_arrive_together_are_answered_in_one_write() {
    for served in ALL {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let region = pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let pattern: Vec<u8> = (0..1 << 16).map(|i| (i * 7 % 251) as u8).collect();
        region.write_at(0, &pattern).unwrap();
        let (mut s, qp) = raw_peer(&ctx, &pd, served.caps());
        let mut requests = Vec::new();
        for psn in 0..16u32 {
            let at = region.addr() + psn as u64 * 1000;
            requests.extend_from_slice(&read_request(psn, at, region.rkey(), 256));
        }
        let writes = || qp.wire_writes().expect("tcp").1;
        let writes_before = writes();
        s.write_all(&requests).unwrap();
        for psn in 0..16u32 {
            let mut raw = [0u8; HEADER_LEN];
            s.read_exact(&mut raw).unwrap();
            let h = Header::decode(&raw).unwrap();
            assert_eq!((h.kind, h.psn, h.len), (Kind::ReadResponse, psn, 256));
            let mut data = [0u8; 256];
            s.read_exact(&mut data).unwrap();
            let at = psn as usize * 1000;
            assert_eq!(data[..], pattern[at..at + 256], "response {psn}");
        }
        // The engine counts a write after it returned, maybe after we read it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while writes() == writes_before && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            writes() - writes_before,
            1,
            "socket writes for 16 responses"
        );
    }
}

/// The hold is bounded: 200 READs that arrive together go out in batches of at most
/// MAX_HELD responses (or MAX_HELD_BYTES of data), still in order and whole.
#[test]
fn held_responses_go_out_once_there_are_enough_of_them() {
    for served in ALL {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let region = pd.alloc_region(1 << 20, Access::ALL).unwrap();
        let pattern: Vec<u8> = (0..1 << 20).map(|i| (i * 13 % 253) as u8).collect();
        region.write_at(0, &pattern).unwrap();
        let (mut s, qp) = raw_peer(&ctx, &pd, served.caps());
        let writes = || qp.wire_writes().expect("tcp").1;
        for (count, len, fewest) in [(200u32, 64u32, 4), (16, 64 << 10, 4)] {
            let mut requests = Vec::new();
            for psn in 0..count {
                let at = region.addr() + (psn as u64 * 4099) % (1 << 19);
                requests.extend_from_slice(&read_request(psn, at, region.rkey(), len));
            }
            let before = writes();
            s.write_all(&requests).unwrap();
            let mut data = vec![0u8; len as usize];
            for psn in 0..count {
                let mut raw = [0u8; HEADER_LEN];
                s.read_exact(&mut raw).unwrap();
                let h = Header::decode(&raw).unwrap();
                assert_eq!((h.kind, h.psn, h.len), (Kind::ReadResponse, psn, len));
                s.read_exact(&mut data).unwrap();
                let at = (psn as usize * 4099) % (1 << 19);
                assert!(data[..] == pattern[at..at + len as usize], "response {psn}");
            }
            std::thread::sleep(Duration::from_millis(50));
            let sent = writes() - before;
            assert!(
                sent >= fewest,
                "{count} READs of {len} bytes went out in {sent} socket writes"
            );
        }
    }
}

/// A READ request followed by an ACK (the peer acknowledging our own WRITE) in one
/// segment: the READ's response, held while the ACK was served, goes out once nothing
/// quick follows, not when some later request comes.
#[test]
fn a_response_held_for_an_ack_behind_it_is_not_kept_waiting() {
    for served in POSTING {
        a_response_held_for_an_ack_is_not_kept_waiting_on(served);
    }
}

fn a_response_held_for_an_ack_is_not_kept_waiting_on(served: Served) {
    use crate::transport::{RemoteAddr, SendOp, SendWr, Sge};
    let ctx = served.context();
    let pd = ctx.alloc_pd().unwrap();
    let region = pd.alloc_region(4096, Access::ALL).unwrap();
    let (mut s, qp) = raw_peer(&ctx, &pd, QpCaps::DEFAULT);
    let sge = [Sge::new(&region, 0, 64).unwrap()];
    let target = RemoteAddr { addr: 0, rkey: 1 };
    qp.post_send(&[SendWr::new(7, SendOp::Write(target), &sge)])
        .unwrap();
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).unwrap();
    let write = Header::decode(&raw).unwrap();
    assert_eq!(write.kind, Kind::Write);
    s.read_exact(&mut [0u8; 64]).unwrap();

    let mut frames = read_request(0, region.addr(), region.rkey(), 16).to_vec();
    frames.extend_from_slice(&Header::new(Kind::Ack, write.psn).encode());
    s.write_all(&frames).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.read_exact(&mut raw)
        .expect("the READ response, with nothing more sent");
    let h = Header::decode(&raw).unwrap();
    assert_eq!((h.kind, h.psn, h.len), (Kind::ReadResponse, 0, 16));
}

/// A peer that asks for far more READ data than the socket holds and does not read it:
/// taking the grant back must not wait for that peer, and no byte written to the memory
/// after it was taken back may reach the peer. Every READ is answered with the bytes the
/// grant had, until one the engine came to after it was taken back is refused (the half
/// sent after it, at the latest; the engine is given time to answer the first half, which
/// then waits on the socket, but how many it answered does not matter).
#[test]
fn reads_a_peer_does_not_take_neither_hold_up_a_deregistration_nor_see_past_it() {
    for served in ALL {
        let ctx = served.context();
        let pool_pd = ctx.alloc_pd().unwrap();
        let pool = pool_pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let pattern: Vec<u8> = (0..LEN).map(|i| (i % 249) as u8 + 1).collect();
        pool.write_at(0, &pattern).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let grant = pd.register_within(&pool, 0, LEN, Access::ALL).unwrap();
        let (mut s, _qp) = raw_peer(&ctx, &pd, served.caps());
        const READS: u32 = 1024;
        const LEN: usize = 1 << 16; // 64 MiB of answers, far more than loopback buffers hold
        let mut requests = Vec::new();
        for psn in 0..READS {
            requests.extend_from_slice(&read_request(psn, grant.addr(), grant.rkey(), LEN as u32));
        }
        s.write_all(&requests[..requests.len() / 2]).unwrap();
        std::thread::sleep(Duration::from_millis(300));

        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(grant);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the grant is taken back while the peer reads nothing");
        pool.write_at(0, &[0xee; LEN]).unwrap();
        s.write_all(&requests[requests.len() / 2..]).unwrap();

        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut data = vec![0u8; LEN];
        let refused = (0..READS).find(|&psn| {
            let mut raw = [0u8; HEADER_LEN];
            s.read_exact(&mut raw).unwrap();
            let h = Header::decode(&raw).unwrap();
            if h.kind == Kind::Nak {
                assert_eq!((h.psn, h.imm), (psn, NakReason::RemoteAccess as u32));
                return true;
            }
            assert_eq!(
                (h.kind, h.psn, h.len),
                (Kind::ReadResponse, psn, LEN as u32)
            );
            s.read_exact(&mut data).unwrap();
            assert!(
                data == pattern,
                "READ {psn} saw memory written after deregistration"
            );
            false
        });
        assert!(refused.is_some(), "no READ was refused ({served:?})");
    }
}

/// A peer that starts a WRITE through a grant, stalls mid-payload while the grant is
/// revoked (and the memory could go to another file), then sends the rest: what came
/// before may have landed (a NIC writes packets as they come), nothing after it may, and
/// the WRITE is refused.
#[test]
fn a_payload_dripped_past_a_deregistration_lands_nothing_after_it() {
    for served in ALL {
        let ctx = served.context();
        let pool_pd = ctx.alloc_pd().unwrap();
        let pool = pool_pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let grant = pd.register_within(&pool, 0, 8192, Access::ALL).unwrap();
        let (mut s, _qp) = raw_peer(&ctx, &pd, served.caps());
        let mut h = Header::new(Kind::Write, 0);
        h.remote_addr = grant.addr();
        h.rkey = grant.rkey();
        h.len = 8192;
        s.write_all(&h.encode()).unwrap();
        s.write_all(&[0xab; 4096]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(grant);
        s.write_all(&[0xcd; 4096]).unwrap();
        let mut raw = [0u8; HEADER_LEN];
        s.read_exact(&mut raw).unwrap();
        let nak = Header::decode(&raw).unwrap();
        assert_eq!(
            (nak.kind, nak.imm),
            (Kind::Nak, NakReason::RemoteAccess as u32)
        );
        let pool = pool.to_vec();
        assert!(pool[..4096].iter().all(|&b| b == 0 || b == 0xab));
        assert!(pool[4096..].iter().all(|&b| b == 0), "nothing landed after");
    }
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

/// Passive queue pairs have no threads of their own: a hundred of them, each serving a WRITE
/// and a READ, are served by the process's few responder loops.
#[test]
fn passive_queue_pairs_share_the_responder_loops() {
    let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let region = pd.alloc_region(100 * 64, Access::ALL).unwrap();
    let peers: Vec<_> = (0..100)
        .map(|_| raw_peer(&ctx, &pd, QpCaps::RESPONDER))
        .collect();
    for (i, (s, _)) in peers.iter().enumerate() {
        let mut s = s;
        let at = region.addr() + i as u64 * 64;
        let mut h = Header::new(Kind::Write, 0);
        h.remote_addr = at;
        h.rkey = region.rkey();
        h.len = 64;
        s.write_all(&h.encode()).unwrap();
        s.write_all(&[i as u8; 64]).unwrap();
        s.write_all(&read_request(1, at, region.rkey(), 64))
            .unwrap();
    }
    for (i, (s, _)) in peers.iter().enumerate() {
        let mut s = s;
        let mut raw = [0u8; HEADER_LEN];
        s.read_exact(&mut raw).unwrap();
        let h = Header::decode(&raw).unwrap();
        // The READ's response may follow the ACK, or stand for it (RC: a READ response
        // acknowledges what came before).
        let h = if h.kind == Kind::Ack {
            s.read_exact(&mut raw).unwrap();
            Header::decode(&raw).unwrap()
        } else {
            h
        };
        assert_eq!((h.kind, h.psn, h.len), (Kind::ReadResponse, 1, 64));
        let mut data = [0u8; 64];
        s.read_exact(&mut data).unwrap();
        assert_eq!(data, [i as u8; 64]);
    }
    // Other tests' queue pairs (numbered alike, in contexts of their own) may have theirs:
    // a few, not the two hundred these would need.
    let names = thread_names();
    let engines = names.iter().filter(|n| n.starts_with("tcp-qp")).count();
    assert!(engines < 50, "{engines} queue-pair threads");
    let loops = names.iter().filter(|n| n.starts_with("tcp-loop")).count();
    assert!(
        (1..=super::loop_threads()).contains(&loops),
        "{loops} responder threads"
    );
}

/// What a passive queue pair cannot serve: a SEND finds no receive (refused as RNR, then the
/// connection ends); a response to a request it never sent closes the connection without a
/// word; a READ that arrives before a WRITE to the same bytes reads them as they were.
#[test]
fn a_passive_queue_pair_refuses_sends_and_stray_responses_and_keeps_request_order() {
    let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let region = pd.alloc_region(4096, Access::ALL).unwrap();
    region.write_at(0, &[1u8; 64]).unwrap();
    let read_until_end = |s: &mut TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        rest
    };

    let (mut s, _qp) = raw_peer(&ctx, &pd, QpCaps::RESPONDER);
    let mut send = Header::new(Kind::Send, 0);
    send.len = 8;
    s.write_all(&send.encode()).unwrap();
    s.write_all(&[0u8; 8]).unwrap();
    let rest = read_until_end(&mut s);
    let nak = Header::decode(rest[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(
        (nak.kind, nak.psn, nak.imm, rest.len()),
        (Kind::Nak, 0, NakReason::ReceiverNotReady as u32, HEADER_LEN)
    );

    let (mut s, _qp) = raw_peer(&ctx, &pd, QpCaps::RESPONDER);
    s.write_all(&Header::new(Kind::Ack, 0).encode()).unwrap();
    assert!(read_until_end(&mut s).is_empty(), "closed without a word");

    let (mut s, _qp) = raw_peer(&ctx, &pd, QpCaps::RESPONDER);
    let mut frames = read_request(0, region.addr(), region.rkey(), 64).to_vec();
    let mut write = Header::new(Kind::Write, 1);
    write.remote_addr = region.addr();
    write.rkey = region.rkey();
    write.len = 64;
    frames.extend_from_slice(&write.encode());
    frames.extend_from_slice(&[2u8; 64]);
    s.write_all(&frames).unwrap();
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).unwrap();
    let h = Header::decode(&raw).unwrap();
    assert_eq!((h.kind, h.psn), (Kind::ReadResponse, 0));
    let mut data = [0u8; 64];
    s.read_exact(&mut data).unwrap();
    assert_eq!(data, [1u8; 64], "the READ saw the WRITE behind it");
    s.read_exact(&mut raw).unwrap();
    assert_eq!(Header::decode(&raw).unwrap().kind, Kind::Ack);
    assert_eq!(region.to_vec()[..64], [2u8; 64]);
}

/// A peer that keeps its socket full of requests (zero-length WRITEs, which need no grant)
/// and reads its answers cannot keep the other passive queue pairs of its responder loop
/// waiting: each of them is answered at once all along.
#[test]
fn a_greedy_peer_does_not_starve_the_others_of_its_loop() {
    let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let region = pd.alloc_region(4096, Access::ALL).unwrap();
    let (greedy, _g) = raw_peer(&ctx, &pd, QpCaps::RESPONDER);
    // Victims on every loop, whichever the greedy one landed on.
    let victims: Vec<_> = (0..2 * super::loop_threads())
        .map(|_| raw_peer(&ctx, &pd, QpCaps::RESPONDER))
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut drain = greedy.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut b = vec![0u8; 1 << 16];
        while matches!(drain.read(&mut b), Ok(n) if n > 0) {}
    });
    let flood = {
        let (mut s, stop) = (greedy, stop.clone());
        std::thread::spawn(move || {
            let burst: Vec<u8> = (0..1024u32)
                .flat_map(|psn| Header::new(Kind::Write, psn).encode())
                .collect();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if s.write_all(&burst).is_err() {
                    break;
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    for round in 0..5u32 {
        for (i, (s, _)) in victims.iter().enumerate() {
            let mut s = s;
            let asked = std::time::Instant::now();
            s.write_all(&read_request(round, region.addr(), region.rkey(), 8))
                .unwrap();
            let mut raw = [0u8; HEADER_LEN + 8];
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.read_exact(&mut raw).unwrap();
            let took = asked.elapsed();
            assert!(
                took < Duration::from_secs(2),
                "victim {i} waited {took:?} behind the greedy peer"
            );
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = flood.join();
}

/// Waits up to 5 s for `n` completions.
fn completions(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    let mut buf = [Completion::EMPTY; 16];
    while got.len() < n {
        let k = cq.poll(&mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} completions: {got:?}",
            got.len()
        );
        if k == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    got
}

/// A SEND that comes before its receive is posted waits for it (without holding up anything
/// else the loop serves), lands once it is posted, scattered over its buffers, and is
/// acknowledged; one that finds no receive within the RNR window is refused.
#[test]
fn a_send_waits_for_a_receive_up_to_the_rnr_window() {
    use crate::transport::{RecvWr, Sge, WcOpcode, WcStatus};
    for served in POSTING {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let buf = pd.alloc_region(4096, Access::ALL).unwrap();
        let (mut s, qp, cq) = raw_peer_cq(&ctx, &pd, QpCaps::DEFAULT);
        let mut send = Header::new(Kind::SendWithImm, 0);
        send.len = 300;
        send.imm = 77;
        s.write_all(&send.encode()).unwrap();
        let payload: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        s.write_all(&payload).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        let sges = [
            Sge::new(&buf, 0, 100).unwrap(),
            Sge::new(&buf, 1000, 0).unwrap(),
            Sge::new(&buf, 2000, 400).unwrap(),
        ];
        qp.post_recv(&[RecvWr {
            wr_id: 5,
            sges: &sges,
        }])
        .unwrap();
        let c = completions(&cq, 1)[0];
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len, c.imm),
            (5, WcStatus::Success, WcOpcode::RecvWithImm, 300, Some(77)),
            "{served:?}"
        );
        let got = buf.to_vec();
        assert_eq!(got[..100], payload[..100]);
        assert_eq!(got[2000..2200], payload[100..]);
        let mut raw = [0u8; HEADER_LEN];
        s.read_exact(&mut raw).unwrap();
        assert_eq!(Header::decode(&raw).unwrap().kind, Kind::Ack);

        // None posted in time: refused as receiver-not-ready, after the window, not before.
        let mut send = Header::new(Kind::Send, 1);
        send.len = 8;
        let sent = std::time::Instant::now();
        s.write_all(&send.encode()).unwrap();
        s.write_all(&[9u8; 8]).unwrap();
        s.read_exact(&mut raw).unwrap();
        let nak = Header::decode(&raw).unwrap();
        assert_eq!(
            (nak.kind, nak.psn, nak.imm),
            (Kind::Nak, 1, NakReason::ReceiverNotReady as u32),
            "{served:?}"
        );
        let waited = sent.elapsed();
        assert!(
            waited >= Duration::from_millis(450),
            "{served:?}: refused after {waited:?}"
        );
    }
}

/// READ data that the peer drips in pieces lands in our buffers in order, and completes the
/// READ once whole; a NAK completes the request it names with its error and ends the queue
/// pair, flushing what was posted after it.
#[test]
fn read_data_dripped_in_pieces_lands_whole_and_a_nak_ends_the_queue_pair() {
    use crate::transport::{RemoteAddr, SendOp, SendWr, Sge, WcOpcode, WcStatus};
    for served in POSTING {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let buf = pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let (mut s, qp, cq) = raw_peer_cq(&ctx, &pd, QpCaps::DEFAULT);
        let sges = [
            Sge::new(&buf, 0, 30_000).unwrap(),
            Sge::new(&buf, 40_000, 10_000).unwrap(),
        ];
        let target = RemoteAddr { addr: 0, rkey: 1 };
        qp.post_send(&[SendWr::new(1, SendOp::Read(target), &sges)])
            .unwrap();
        let mut raw = [0u8; HEADER_LEN];
        s.read_exact(&mut raw).unwrap();
        let read = Header::decode(&raw).unwrap();
        assert_eq!((read.kind, read.len), (Kind::ReadRequest, 40_000));
        let mut answer = Header::new(Kind::ReadResponse, read.psn);
        answer.len = 40_000;
        let data: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let mut wire = answer.encode().to_vec();
        wire.extend_from_slice(&data);
        for piece in wire.chunks(7_001) {
            s.write_all(piece).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        let c = completions(&cq, 1)[0];
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (1, WcStatus::Success, WcOpcode::Read, 40_000),
            "{served:?}"
        );
        let got = buf.to_vec();
        assert!(got[..30_000] == data[..30_000] && got[40_000..50_000] == data[30_000..]);

        let one = [Sge::new(&buf, 0, 8).unwrap()];
        qp.post_send(&[
            SendWr::new(2, SendOp::Write(target), &one),
            SendWr::new(3, SendOp::Write(target), &one),
        ])
        .unwrap();
        for _ in 0..2 {
            s.read_exact(&mut raw).unwrap();
            s.read_exact(&mut [0u8; 8]).unwrap();
        }
        let mut nak = Header::new(Kind::Nak, Header::decode(&raw).unwrap().psn - 1);
        nak.imm = NakReason::RemoteAccess as u32;
        s.write_all(&nak.encode()).unwrap();
        let got = completions(&cq, 2);
        assert_eq!(
            got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
            [
                (2, WcStatus::RemoteAccessError),
                (3, WcStatus::WrFlushError)
            ],
            "{served:?}"
        );
    }
}

/// A queue pair whose poster waits on a full socket (the peer reads nothing) still serves
/// the peer's requests meanwhile, and their answers go out behind the posted frames, in
/// order, once the peer reads again: nobody deadlocks, nothing is lost.
#[test]
fn requests_served_while_a_poster_waits_on_a_full_socket_are_answered_in_order() {
    use crate::transport::{RemoteAddr, SendOp, SendWr, Sge};
    for served in POSTING {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let big = pd.alloc_region(8 << 20, Access::ALL).unwrap();
        let small = pd.alloc_region(4096, Access::ALL).unwrap();
        small.write_at(0, &[5u8; 64]).unwrap();
        let (s, qp, cq) = raw_peer_cq(&ctx, &pd, QpCaps::DEFAULT);
        let qp = std::sync::Arc::new(qp);
        let poster = {
            let (qp, big) = (qp.clone(), big);
            std::thread::spawn(move || {
                let sge = [Sge::new(&big, 0, 8 << 20).unwrap()];
                let target = RemoteAddr { addr: 0, rkey: 1 };
                // Blocks until the peer reads: far more than the socket buffers hold.
                qp.post_send(&[SendWr::new(1, SendOp::Write(target), &sge)])
                    .unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        let mut requests = Vec::new();
        for psn in 0..200u32 {
            requests.extend_from_slice(&read_request(psn, small.addr(), small.rkey(), 64));
        }
        let mut w = s.try_clone().unwrap();
        w.write_all(&requests).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // Now read it all: the WRITE, then the 200 READ responses.
        let mut r = s;
        r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut raw = [0u8; HEADER_LEN];
        let mut answers = Vec::new();
        let mut write_psn = None;
        while answers.len() < 200 {
            r.read_exact(&mut raw).unwrap();
            let h = Header::decode(&raw).unwrap();
            match h.kind {
                Kind::Write => {
                    let mut payload = vec![0u8; h.len as usize];
                    r.read_exact(&mut payload).unwrap();
                    write_psn = Some(h.psn);
                }
                Kind::ReadResponse => {
                    let mut data = [0u8; 64];
                    r.read_exact(&mut data).unwrap();
                    assert_eq!(data, [5u8; 64]);
                    answers.push(h.psn);
                }
                other => panic!("{served:?}: unexpected {other:?}"),
            }
        }
        assert_eq!(answers, (0..200).collect::<Vec<_>>(), "{served:?}");
        poster.join().unwrap();
        let psn = write_psn.expect("the WRITE went out");
        w.write_all(&Header::new(Kind::Ack, psn).encode()).unwrap();
        assert_eq!(completions(&cq, 1)[0].wr_id, 1);
    }
}

/// Queue pairs that post, served by the loops, have no threads of their own either.
#[test]
fn posting_queue_pairs_served_by_the_loops_have_no_threads() {
    use crate::transport::{RecvWr, Sge};
    let ctx = Served::Loop.context();
    let pd = ctx.alloc_pd().unwrap();
    let buf = pd.alloc_region(4096, Access::ALL).unwrap();
    let before = thread_names().len();
    let peers: Vec<_> = (0..60)
        .map(|_| raw_peer_cq(&ctx, &pd, QpCaps::DEFAULT))
        .collect();
    for (i, (s, qp, cq)) in peers.iter().enumerate() {
        let sge = [Sge::new(&buf, i * 64, 64).unwrap()];
        qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sges: &sge,
        }])
        .unwrap();
        let mut send = Header::new(Kind::Send, 0);
        send.len = 4;
        let mut s = s;
        s.write_all(&send.encode()).unwrap();
        s.write_all(&[i as u8; 4]).unwrap();
        assert_eq!(completions(cq, 1)[0].wr_id, i as u64);
    }
    let added = thread_names().len().saturating_sub(before);
    // Other tests run beside this one and start threads of their own; 60 queue pairs with
    // engines would add 120.
    assert!(added < 40, "{added} threads more for 60 queue pairs");
}

/// A READ that arrives before a SEND whose payload lands on the same bytes reads them as they
/// were: held responses go out before anything behind them touches memory.
#[test]
fn a_read_held_for_its_burst_does_not_see_a_send_that_came_after_it() {
    use crate::transport::{RecvWr, Sge};
    for served in POSTING {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let region = pd.alloc_region(4096, Access::ALL).unwrap();
        region.write_at(0, &[1u8; 64]).unwrap();
        let (mut s, qp, cq) = raw_peer_cq(&ctx, &pd, QpCaps::DEFAULT);
        let sge = [Sge::new(&region, 0, 64).unwrap()];
        qp.post_recv(&[RecvWr {
            wr_id: 9,
            sges: &sge,
        }])
        .unwrap();
        let mut frames = read_request(0, region.addr(), region.rkey(), 64).to_vec();
        let mut send = Header::new(Kind::Send, 1);
        send.len = 64;
        frames.extend_from_slice(&send.encode());
        frames.extend_from_slice(&[2u8; 64]);
        s.write_all(&frames).unwrap();
        let mut raw = [0u8; HEADER_LEN];
        s.read_exact(&mut raw).unwrap();
        assert_eq!(Header::decode(&raw).unwrap().kind, Kind::ReadResponse);
        let mut data = [0u8; 64];
        s.read_exact(&mut data).unwrap();
        assert_eq!(
            data, [1u8; 64],
            "{served:?}: the READ saw the SEND behind it"
        );
        assert_eq!(completions(&cq, 1)[0].wr_id, 9);
        assert_eq!(region.to_vec()[..64], [2u8; 64]);
    }
}

/// More answers than a loop holds back for a peer (4 MiB of READ data) pile up while a
/// poster waits on the full socket; once the peer reads, the loop takes its requests again:
/// every READ is answered.
#[test]
fn a_loop_reads_again_after_its_backlog_of_answers_went_out() {
    use crate::transport::{RemoteAddr, SendOp, SendWr, Sge};
    for served in POSTING {
        let ctx = served.context();
        let pd = ctx.alloc_pd().unwrap();
        let big = pd.alloc_region(16 << 20, Access::ALL).unwrap();
        let reads = pd.alloc_region(256 << 10, Access::ALL).unwrap();
        let (s, qp, _cq) = raw_peer_cq(&ctx, &pd, QpCaps::DEFAULT);
        let qp = std::sync::Arc::new(qp);
        let poster = {
            let qp = qp.clone();
            std::thread::spawn(move || {
                let sge = [Sge::new(&big, 0, 16 << 20).unwrap()];
                let target = RemoteAddr { addr: 0, rkey: 1 };
                qp.post_send(&[SendWr::new(1, SendOp::Write(target), &sge)])
                    .unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        let mut w = s.try_clone().unwrap();
        let requests: Vec<u8> = (0..40u32)
            .flat_map(|psn| read_request(psn, reads.addr(), reads.rkey(), 256 << 10))
            .collect();
        let writer = std::thread::spawn(move || w.write_all(&requests).unwrap());
        std::thread::sleep(Duration::from_millis(300));
        let mut r = s;
        r.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut raw = [0u8; HEADER_LEN];
        let mut answered = 0;
        let mut payload = vec![0u8; 16 << 20];
        while answered < 40 {
            r.read_exact(&mut raw)
                .unwrap_or_else(|e| panic!("{served:?}: {answered} of 40 READs answered: {e}"));
            let h = Header::decode(&raw).unwrap();
            r.read_exact(&mut payload[..h.len as usize]).unwrap();
            if h.kind == Kind::ReadResponse {
                assert_eq!(h.psn, answered);
                answered += 1;
            }
        }
        writer.join().unwrap();
        poster.join().unwrap();
        // And later requests are read too.
        let mut w = r.try_clone().unwrap();
        w.write_all(&read_request(40, reads.addr(), reads.rkey(), 8))
            .unwrap();
        r.read_exact(&mut raw)
            .unwrap_or_else(|e| panic!("{served:?}: a READ after the backlog: {e}"));
        assert_eq!(Header::decode(&raw).unwrap().psn, 40);
    }
}
