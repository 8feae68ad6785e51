//! The session API end to end over the tcp provider: a "lender" side that only registers memory
//! (as a storage node does) and a client session that reads and writes it one-sidedly.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmabox::transport::{
    Access, CompletionQueue, Context, ExternalMemory, Landing, MemoryRegion, ProviderKind, QpCaps,
    QpRoute, QueuePair, RemoteAddr, TransportConfig, WcStatus,
};
use rdmabox::{connect_queue_pairs, IoError, PollMode, Session, SessionConfig, WindowConfig};

struct Lender {
    mem: MemoryRegion,
    _links: Vec<(QueuePair, CompletionQueue)>,
    _ctx: Context,
}

fn tcp() -> TransportConfig {
    let mut t = TransportConfig::with_provider(ProviderKind::Tcp);
    t.tcp.dead_peer_timeout = Duration::from_secs(2);
    t
}

/// A lender with `len` bytes and a client session over `cfg.qps` queue pairs.
fn setup(len: usize, cfg: SessionConfig) -> (Lender, Session) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let qps = cfg.qps;
    let caps = cfg.caps;
    let lender = std::thread::spawn(move || {
        let ctx = Context::open(&tcp()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mem = pd.alloc_region(len, Access::ALL).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let links = connect_queue_pairs(&ctx, &pd, &mut s, qps, caps, &QpRoute::OwnPort).unwrap();
        Lender {
            mem,
            _links: links,
            _ctx: ctx,
        }
    });
    let ctx = Context::open(&tcp()).unwrap();
    let pd = Arc::new(ctx.alloc_pd().unwrap());
    let mut c = TcpStream::connect(addr).unwrap();
    let links = connect_queue_pairs(&ctx, &pd, &mut c, qps, caps, &QpRoute::OwnPort).unwrap();
    let lender = lender.join().unwrap();
    let session = Session::new(pd, links, vec![lender.mem.remote()], cfg).unwrap();
    (lender, session)
}

fn at(l: &Lender, off: u64) -> RemoteAddr {
    l.mem.remote().at(off).unwrap()
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn concurrent_sequential_writes_merge_and_read_back_intact() {
    let (lender, session) = setup(8 << 20, SessionConfig::default());
    let session = Arc::new(session);
    let lender = Arc::new(lender);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (s, l) = (session.clone(), lender.clone());
            std::thread::spawn(move || {
                // Each thread writes its own consecutive 4 KiB blocks, all in flight at once.
                let pending: Vec<_> = (0..64u64)
                    .map(|i| {
                        let off = (t * 64 + i) * 4096;
                        s.write_pending(at(&l, off), pattern(4096, off))
                    })
                    .collect();
                for p in pending {
                    p.wait().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let before = session.counters();
    for off in (0..512u64).map(|i| i * 4096) {
        let got = session
            .read_pending(at(&lender, off), vec![0; 4096])
            .wait()
            .unwrap();
        assert!(got == pattern(4096, off), "block at {off}");
    }
    // A batch of reads of the whole area merges into few work requests.
    let pending: Vec<_> = (0..512u64)
        .map(|i| session.read_pending(at(&lender, i * 4096), vec![0; 4096]))
        .collect();
    for (i, p) in pending.into_iter().enumerate() {
        assert!(p.wait().unwrap() == pattern(4096, i as u64 * 4096));
    }
    let c = session.counters();
    assert_eq!(c.requests, 512 * 3);
    assert_eq!(c.bytes_written, 512 * 4096);
    assert_eq!(c.bytes_read, 1024 * 4096);
    assert!(c.work_requests < c.requests, "{c:?}");
    assert!(c.doorbells <= c.work_requests);
    assert_eq!(c.requests_failed, 0);
    assert_eq!(c.inflight_bytes, 0);
    assert!(before.requests_merged <= c.requests_merged);
}

#[test]
fn random_io_matches_a_model_under_every_mechanism_setting() {
    let settings = [
        SessionConfig::default(),
        SessionConfig {
            merge: false,
            chain: false,
            qps: 1,
            window: WindowConfig::Off,
            polling: PollMode::Event,
            dyn_threshold: usize::MAX,
            ..SessionConfig::default()
        },
        SessionConfig {
            window: WindowConfig::Static(64 << 10),
            polling: PollMode::EventBatch,
            dyn_threshold: 16 << 10,
            ..SessionConfig::default()
        },
        SessionConfig {
            window: "adaptive:64K-4M".parse().unwrap(),
            polling: PollMode::Busy,
            qps: 2,
            ..SessionConfig::default()
        },
    ];
    const LEN: usize = 4 << 20;
    for cfg in settings {
        let label = format!("{cfg:?}");
        let (lender, session) = setup(LEN, cfg);
        let mut model = vec![0u8; LEN];
        let mut rng = 42u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for round in 0..20 {
            // A wave of non-overlapping writes in flight together, then reads of random ranges.
            let mut writes = Vec::new();
            let mut used: Vec<(usize, usize)> = Vec::new();
            for _ in 0..16 {
                let len = 1 + (next() % (300 << 10)) as usize;
                let off = (next() % (LEN - len) as u64) as usize;
                if used.iter().any(|&(o, l)| off < o + l && o < off + len) {
                    continue;
                }
                used.push((off, len));
                let data = pattern(len, next());
                model[off..off + len].copy_from_slice(&data);
                writes.push(session.write_pending(at(&lender, off as u64), data));
            }
            for w in writes {
                w.wait().unwrap();
            }
            let reads: Vec<_> = (0..16)
                .map(|_| {
                    let len = 1 + (next() % (1200 << 10)) as usize;
                    let off = (next() % (LEN - len) as u64) as usize;
                    (
                        off,
                        len,
                        session.read_pending(at(&lender, off as u64), vec![0; len]),
                    )
                })
                .collect();
            for (off, len, r) in reads {
                let got = r.wait().unwrap();
                assert!(
                    got == model[off..off + len],
                    "{label} round {round}: {off}+{len}"
                );
            }
        }
        assert_eq!(lender.mem.to_vec(), model, "{label}");
        assert_eq!(session.counters().requests_failed, 0);
    }
}

#[test]
fn large_requests_register_their_own_buffer() {
    let (lender, session) = setup(8 << 20, SessionConfig::default());
    let data = pattern(3 << 20, 1);
    session
        .write_pending(at(&lender, 4096), data.clone())
        .wait()
        .unwrap();
    let back = session
        .read_pending(at(&lender, 4096), vec![0; 3 << 20])
        .wait()
        .unwrap();
    assert!(back == data);
    let c = session.counters();
    assert_eq!(c.dynmr_registrations, 2);
    assert_eq!(c.premr_copies, 0);
}

/// Reads whose callback borrows the bytes where they landed: staged ones (merged or not)
/// without a buffer or a copy of the caller's, large ones from a slot where they fit in one
/// and from their own buffer (dynMR) otherwise, and an out-of-bounds one fails alone.
#[test]
fn borrowing_reads_see_the_bytes_where_they_landed() {
    let (lender, session) = setup(8 << 20, SessionConfig::default());
    let data = pattern(4 << 20, 3);
    lender.mem.write_at(0, &data).unwrap();
    let read = |off: u64, len: usize| {
        let (tx, rx) = std::sync::mpsc::channel();
        session.read_borrowing(
            at(&lender, off),
            len,
            Box::new(move |r| drop(tx.send(r.map(<[u8]>::to_vec)))),
        );
        rx
    };
    // Adjacent 4 KiB reads in flight together, each lent its own bytes.
    let staged: Vec<_> = (0..256u64).map(|i| (i, read(i * 4096, 4096))).collect();
    for (i, rx) in staged {
        let at = i as usize * 4096;
        let got = rx.recv().unwrap().unwrap();
        assert!(got == data[at..at + 4096], "block {i}");
    }
    let c = session.counters();
    assert_eq!(c.premr_copies, 0, "borrowed, not copied out of their slot");
    let odd = read(12_345, 100_000).recv().unwrap().unwrap();
    assert!(odd == data[12_345..112_345]);
    let large = read(4096, 3 << 20).recv().unwrap().unwrap();
    assert!(large == data[4096..4096 + (3 << 20)]);
    assert_eq!(session.counters().dynmr_registrations, 1);
    // Above the dynMR threshold but within a slot: lent from a slot, nothing registered.
    let fits = read(8192, 1000 << 10).recv().unwrap().unwrap();
    assert!(fits == data[8192..8192 + (1000 << 10)]);
    assert_eq!(session.counters().dynmr_registrations, 1);
    assert!(read(0, 0).recv().unwrap().unwrap().is_empty());
    assert!(matches!(
        read((8 << 20) - 10, 11).recv().unwrap(),
        Err(IoError::OutOfBounds { .. })
    ));
    assert_eq!(session.counters().inflight_bytes, 0);
    // A read into a buffer of the caller's is copied there.
    let before = session.counters().premr_copies;
    let copied = session
        .read_pending(at(&lender, 0), vec![0; 4096])
        .wait()
        .unwrap();
    assert!(copied == data[..4096]);
    assert_eq!(session.counters().premr_copies, before + 1);
}

/// Memory of the caller's own (as an application's shared buffer is), which says when it goes.
struct Outside {
    bytes: *mut u8,
    len: usize,
    gone: Arc<AtomicUsize>,
}

// SAFETY: reached only through raw pointers (Landing's copies, the provider's writes, and the
// test's reads once every transfer is over).
unsafe impl Send for Outside {}
// SAFETY: as for Send.
unsafe impl Sync for Outside {}

// SAFETY: the boxed slice is leaked in `outside` and freed only in `drop`: it stays put while
// the object lives.
unsafe impl ExternalMemory for Outside {
    fn as_ptr(&self) -> *mut u8 {
        self.bytes
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        // SAFETY: made from a leaked Box<[u8]> of this length in `outside`, freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.bytes, self.len)) });
        self.gone.fetch_add(1, Ordering::SeqCst);
    }
}

fn outside(len: usize) -> (Arc<Outside>, Arc<AtomicUsize>) {
    let gone = Arc::new(AtomicUsize::new(0));
    let bytes = Box::leak(vec![0xeeu8; len].into_boxed_slice()).as_mut_ptr();
    let memory = Outside {
        bytes,
        len,
        gone: gone.clone(),
    };
    (Arc::new(memory), gone)
}

impl Outside {
    fn bytes(&self, at: usize, len: usize) -> Vec<u8> {
        assert!(at + len <= self.len);
        // SAFETY: inside the memory; called once the reads into it are over.
        unsafe { std::slice::from_raw_parts(self.bytes.add(at), len).to_vec() }
    }
}

/// Reads into memory of the caller's: a large one is registered there and lands there (no
/// copy), a small one is staged and copied in; failures leave the memory as it was, and the
/// memory lives on while a transfer still holds it, whoever let go of it first.
#[test]
fn reads_land_in_the_callers_memory() {
    let (lender, session) = setup(8 << 20, SessionConfig::default());
    let data = pattern(4 << 20, 9);
    lender.mem.write_at(0, &data).unwrap();
    let (memory, gone) = outside(6 << 20);
    let read_into = |off: u64, to: usize, len: usize| {
        let (tx, rx) = std::sync::mpsc::channel();
        let into = Landing::new(memory.clone(), to, len).unwrap();
        session.read_into(at(&lender, off), into, Box::new(move |r| drop(tx.send(r))));
        rx
    };
    let registered = session.counters().dynmr_registrations;
    read_into(4096, 1 << 20, 3 << 20).recv().unwrap().unwrap();
    assert!(memory.bytes(1 << 20, 3 << 20) == data[4096..4096 + (3 << 20)]);
    assert_eq!(memory.bytes((1 << 20) - 1, 1), [0xee]);
    assert_eq!(memory.bytes(4 << 20, 1), [0xee]);
    assert_eq!(session.counters().dynmr_registrations, registered + 1);
    let small: Vec<_> = (0..64usize)
        .map(|i| read_into(i as u64 * 4096, i * 4096, 4096))
        .collect();
    for rx in small {
        rx.recv().unwrap().unwrap();
    }
    assert!(memory.bytes(0, 64 * 4096) == data[..64 * 4096]);
    assert_eq!(session.counters().dynmr_registrations, registered + 1);
    let before = memory.bytes(5 << 20, 1 << 20);
    assert!(matches!(
        read_into((8 << 20) - (1 << 20) + 1, 5 << 20, 1 << 20)
            .recv()
            .unwrap(),
        Err(IoError::OutOfBounds { .. })
    ));
    assert!(memory.bytes(5 << 20, 1 << 20) == before);
    // The caller lets go at once; the transfer keeps the memory until it is over.
    let rx = read_into(0, 0, 2 << 20);
    drop(memory);
    rx.recv().unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while gone.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        gone.load(Ordering::SeqCst),
        1,
        "freed once the transfer let go"
    );
    assert_eq!(session.counters().inflight_bytes, 0);
}

/// Borrowing reads that merge into one work request are each lent their own bytes, without a
/// copy. Requests merge only when they wait in the queue together: a small window holds them
/// there while the first few are in flight. A round in which each completion admitted the one
/// request it made room for (the tcp engine completes message by message, and on a loaded
/// machine the submitter seldom gets ahead of it) merges nothing, so rounds go on for up to
/// half a minute (ten rounds failed 7 suite runs of 45 under load).
#[test]
fn merged_borrowing_reads_are_each_lent_their_own_bytes() {
    let cfg = SessionConfig {
        window: WindowConfig::Static(16 << 10),
        ..SessionConfig::default()
    };
    let (lender, session) = setup(1 << 20, cfg);
    let data = pattern(1 << 20, 5);
    lender.mem.write_at(0, &data).unwrap();
    let mut merged = false;
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut rounds = 0;
    while std::time::Instant::now() < give_up {
        rounds += 1;
        let before = session.counters();
        let staged: Vec<_> = (0..256u64)
            .map(|i| {
                let (tx, rx) = std::sync::mpsc::channel();
                session.read_borrowing(
                    at(&lender, i * 4096),
                    4096,
                    Box::new(move |r| drop(tx.send(r.map(<[u8]>::to_vec)))),
                );
                (i as usize * 4096, rx)
            })
            .collect();
        for (at, rx) in staged {
            let got = rx.recv().unwrap().unwrap();
            assert!(got == data[at..at + 4096], "block at {at}");
        }
        let c = session.counters();
        assert_eq!(c.premr_copies, 0, "borrowed, not copied out of their slot");
        if c.requests_merged > before.requests_merged {
            assert!(c.work_requests - before.work_requests < 256, "{c:?}");
            merged = true;
            break;
        }
    }
    assert!(
        merged,
        "no read merged in {rounds} rounds: {:?}",
        session.counters()
    );
    assert_eq!(session.counters().inflight_bytes, 0);
}

/// A gathered read lands its pieces side by side in one staging slot and lends them as one run
/// of bytes, whatever their sizes and wherever they are in remote memory (apart, adjacent, in
/// either order, one above the dynMR threshold); with the pool dry, or larger than a slot, it
/// is copied together instead, with the same bytes. A piece out of bounds fails the whole, once.
#[test]
fn gathered_reads_come_together_in_one_slot() {
    // Three slots: a gather's slot goes back after its callback returns, so the next gather
    // may find the last one's still out; with it and the one spared, one is left to take.
    let cfg = SessionConfig {
        pool_slots: 3,
        slot_size: 1 << 20,
        ..SessionConfig::default()
    };
    let (lender, session) = setup(8 << 20, cfg);
    let data = pattern(8 << 20, 5);
    lender.mem.write_at(0, &data).unwrap();
    let gather = |pieces: &[(u64, usize)]| {
        let (tx, rx) = std::sync::mpsc::channel();
        let remote: Vec<_> = pieces.iter().map(|&(o, n)| (at(&lender, o), n)).collect();
        session.read_gathered(
            &remote,
            Box::new(move |r| drop(tx.send(r.map(<[u8]>::to_vec)))),
        );
        rx
    };
    let want = |pieces: &[(u64, usize)]| -> Vec<u8> {
        pieces
            .iter()
            .flat_map(|&(o, n)| data[o as usize..o as usize + n].iter().copied())
            .collect()
    };
    let shapes: [&[(u64, usize)]; 5] = [
        // A 1 MiB FUSE read across a chunk boundary: the chunks apart in remote memory.
        &[(5 << 20, 256 << 10), (1 << 20, 768 << 10)],
        // Adjacent, and in reverse order.
        &[(4096, 4096), (8192, 100)],
        &[(3 << 20, 10), (0, 9_999), (7 << 20, 1)],
        // One piece above the dynMR threshold, still in the slot.
        &[(2 << 20, 1000 << 10), (6 << 20, 24 << 10)],
        &[(0, 0), (4 << 20, 4096)],
    ];
    for pieces in shapes {
        let got = gather(pieces).recv().unwrap().unwrap();
        assert!(got == want(pieces), "{pieces:?}");
    }
    let c = session.counters();
    assert_eq!(c.premr_copies, 0, "landed in the slot, not copied: {c:?}");
    assert_eq!(c.dynmr_registrations, 0, "{c:?}");
    assert_eq!(c.inflight_bytes, 0);
    // Many at once, more than the pool lends gathers: those that find none are copied together.
    let many: Vec<(u64, usize)> = vec![(7 << 20, 300 << 10), (1 << 20, 200 << 10)];
    let rxs: Vec<_> = (0..16).map(|_| gather(&many)).collect();
    for rx in rxs {
        assert!(rx.recv().unwrap().unwrap() == want(&many));
    }
    // Larger than a slot: copied together.
    let big: &[(u64, usize)] = &[(0, 1 << 20), (3 << 20, 5)];
    let before = session.counters().premr_copies;
    assert!(gather(big).recv().unwrap().unwrap() == want(big));
    assert!(session.counters().premr_copies > before);
    // A piece out of bounds fails the whole.
    let bad = gather(&[(0, 4096), ((8 << 20) - 10, 11)]).recv().unwrap();
    assert!(matches!(bad, Err(IoError::OutOfBounds { .. })), "{bad:?}");
    assert_eq!(session.counters().inflight_bytes, 0);
    // The slots went back: a staged read still finds one.
    let got = session
        .read_pending(at(&lender, 4096), vec![0; 4096])
        .wait_timeout(Duration::from_secs(20))
        .unwrap();
    assert!(got == data[4096..8192]);
    // A pool of one slot is left to staged requests: gathers are copied together.
    let (lender, session) = setup(
        8 << 20,
        SessionConfig {
            pool_slots: 1,
            ..SessionConfig::default()
        },
    );
    lender.mem.write_at(0, &data).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let pieces = [(at(&lender, 5 << 20), 5000), (at(&lender, 1 << 20), 3000)];
    session.read_gathered(
        &pieces,
        Box::new(move |r| drop(tx.send(r.map(<[u8]>::to_vec)))),
    );
    let got = rx.recv_timeout(Duration::from_secs(20)).unwrap().unwrap();
    assert!(
        got[..5000] == data[5 << 20..(5 << 20) + 5000]
            && got[5000..] == data[1 << 20..(1 << 20) + 3000]
    );
    assert_eq!(
        session.counters().premr_copies,
        2,
        "both pieces copied together"
    );
}

/// Gathers hold their slot while their pieces wait in the queue, maybe behind a staged request
/// that needs one. Several threads mixing gathered and staged reads through a small pool and a
/// small window all get their answers (a gather that took the last slot could leave a staged
/// request at the head of the queue, with nothing in flight to free one: a hang).
#[test]
fn gathers_and_staged_reads_share_a_small_pool_without_hanging() {
    let cfg = SessionConfig {
        qps: 1,
        pool_slots: 2,
        slot_size: 256 << 10,
        window: WindowConfig::Static(64 << 10),
        ..SessionConfig::default()
    };
    let (lender, session) = setup(8 << 20, cfg);
    let data = Arc::new(pattern(8 << 20, 9));
    lender.mem.write_at(0, &data).unwrap();
    let (lender, session) = (Arc::new(lender), Arc::new(session));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (lender, session, data) = (lender.clone(), session.clone(), data.clone());
            std::thread::spawn(move || {
                for i in 0..1000u64 {
                    let a = (t * 1_000_003 + i * 7_919) % (7 << 20);
                    let b = (t * 3_000_017 + i * 104_729) % (7 << 20);
                    let (tx, rx) = std::sync::mpsc::channel();
                    if (i + t) % 2 == 0 {
                        let pieces = [(at(&lender, a), 40_000), (at(&lender, b), 30_000)];
                        session.read_gathered(
                            &pieces,
                            Box::new(move |r| drop(tx.send(r.map(<[u8]>::to_vec)))),
                        );
                        let got = rx.recv_timeout(Duration::from_secs(20)).expect("answered");
                        let got = got.unwrap();
                        let (a, b) = (a as usize, b as usize);
                        assert!(
                            got[..40_000] == data[a..a + 40_000],
                            "thread {t} gather {i}"
                        );
                        assert!(
                            got[40_000..] == data[b..b + 30_000],
                            "thread {t} gather {i}"
                        );
                    } else {
                        let got = session
                            .read_pending(at(&lender, a), vec![0; 50_000])
                            .wait_timeout(Duration::from_secs(20))
                            .expect("answered");
                        assert!(
                            got == data[a as usize..a as usize + 50_000],
                            "thread {t} read {i}"
                        );
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(session.counters().inflight_bytes, 0);
}

/// Large requests (dynMR) planned into a chain behind staged ones that found the pool empty
/// are put back in the queue, already registered: when they go out later, they carry their own
/// bytes, not a staging slot's leftovers. And a large request at the head of the queue, with a
/// staged one at a lower address behind it (the planner's first), does not keep the drainer
/// (the poller that would free a slot) spinning.
#[test]
fn large_requests_put_back_by_a_dry_pool_keep_their_bytes() {
    let cfg = SessionConfig {
        qps: 1,
        pool_slots: 1,
        slot_size: 64 << 10,
        dyn_threshold: 64 << 10,
        window: WindowConfig::Off,
        ..SessionConfig::default()
    };
    // A drainer spinning on a queue only a completion can unblock never gets there.
    const LIMIT: Duration = Duration::from_secs(20);
    let (lender, session) = setup(16 << 20, cfg);
    let mut model = vec![0u8; 16 << 20];
    let mut datas = Vec::new();
    for i in 0..48u64 {
        // Apart, so that nothing merges: staged and large work requests alternate in a chain.
        let off = i * (256 << 10);
        let data = pattern(if i % 2 == 0 { 4096 } else { 128 << 10 }, i + 1);
        model[off as usize..off as usize + data.len()].copy_from_slice(&data);
        datas.push((off, data));
    }
    // Submitted at once: they queue behind the first, and drain in batches. A round in which
    // each write completed before the next was submitted (the engine kept pace) finds the pool
    // never dry, so rounds go on for up to half a minute (one CI run's single round did not).
    let give_up = Instant::now() + Duration::from_secs(30);
    let mut rounds = 0;
    loop {
        rounds += 1;
        let writes: Vec<_> = datas
            .iter()
            .map(|(off, data)| session.write_pending(at(&lender, *off), data.clone()))
            .collect();
        for w in writes {
            w.wait_timeout(LIMIT).unwrap();
        }
        assert!(
            lender.mem.to_vec() == model,
            "every write landed with its own bytes"
        );
        let c = session.counters();
        if c.pool_stalls > 0 {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "the pool never ran dry in {rounds} rounds: {c:?}"
        );
    }
    let mut reads = Vec::new();
    for i in (1..48u64).step_by(2) {
        let off = i * (256 << 10);
        reads.push((
            i,
            session.read_pending(at(&lender, off), vec![0; 128 << 10]),
        ));
        reads.push((
            i - 1,
            session.read_pending(at(&lender, off - (256 << 10)), vec![0; 4096]),
        ));
    }
    for (i, r) in reads {
        let got = r.wait_timeout(LIMIT).unwrap();
        let off = (i * (256 << 10)) as usize;
        assert!(got == model[off..off + got.len()], "read {i}");
        assert_eq!(
            got.len(),
            if i % 2 == 0 { 4096 } else { 128 << 10 },
            "read {i}"
        );
    }
}

#[test]
fn the_window_bounds_bytes_in_flight() {
    let cfg = SessionConfig {
        window: WindowConfig::Static(32 << 10),
        ..SessionConfig::default()
    };
    let (lender, session) = setup(8 << 20, cfg);
    let pending: Vec<_> = (0..256u64)
        .map(|i| session.write_pending(at(&lender, i * 8192), vec![7; 4096]))
        .collect();
    for p in pending {
        p.wait().unwrap();
    }
    let c = session.counters();
    assert!(c.inflight_peak <= 32 << 10, "peak {}", c.inflight_peak);
    assert!(c.window_stalls > 0, "the window held requests back");
    assert_eq!(c.inflight_bytes, 0);
}

#[test]
fn out_of_bounds_requests_fail_alone() {
    let (lender, session) = setup(1 << 20, SessionConfig::default());
    let r = lender.mem.remote();
    let err = session
        .read_pending(at(&lender, (1 << 20) - 10), vec![0; 11])
        .wait()
        .unwrap_err();
    assert!(matches!(err, IoError::OutOfBounds { .. }));
    // The session is unharmed.
    session
        .write_pending(at(&lender, 0), vec![1; 8])
        .wait()
        .unwrap();
    assert!(session.is_open());
    // Zero-length requests complete at once.
    assert!(session
        .read_pending(at(&lender, 0), Vec::new())
        .wait()
        .unwrap()
        .is_empty());
    // A key is the peer's to check (it may have granted any number of them): a wrong one is
    // refused there, which ends its RC queue pair; the session goes on over the others until
    // none is left. A key refused once fails at once after, without taking another.
    let wrong = |k: u32| RemoteAddr {
        addr: r.addr,
        rkey: r.rkey ^ k,
    };
    for refused in 1..=4u32 {
        // The last queue pair's refusal closes the session: nothing is tried again after.
        for _ in 0..if refused < 4 { 2 } else { 1 } {
            assert_eq!(
                session.write_pending(wrong(refused), vec![1; 8]).wait(),
                Err(IoError::Transport(WcStatus::RemoteAccessError))
            );
        }
        assert_eq!(session.counters().transfers_refused, refused.min(3) as u64);
        assert_eq!(session.is_open(), refused < 4, "after {refused} refusals");
        assert_eq!(
            session.is_degraded(),
            refused > 2,
            "after {refused} refusals"
        );
    }
}

/// A stale key fails the one transfer that used it: the requests in flight beside it on its
/// queue pair, flushed when the peer's refusal took that queue pair down, are sent again over
/// the others and succeed, byte for byte.
#[test]
fn a_refused_transfer_fails_alone_and_what_it_flushed_goes_again() {
    let cfg = SessionConfig {
        qps: 2,
        ..SessionConfig::default()
    };
    let (lender, session) = setup(8 << 20, cfg);
    let r = lender.mem.remote();
    let wrong_key = RemoteAddr {
        addr: r.addr,
        rkey: r.rkey ^ 1,
    };
    let data: Vec<Vec<u8>> = (0..512).map(|i| pattern(4096, i)).collect();
    // Writes to scattered blocks (nothing merges), a refused one among them.
    let blocks = |i: u64| (i * 7919) % 2048 * 4096;
    let writes: Vec<_> = data
        .iter()
        .enumerate()
        .map(|(i, d)| session.write_pending(at(&lender, blocks(i as u64)), d.clone()))
        .collect();
    let refused = session.write_pending(wrong_key, vec![1; 4096]);
    let more: Vec<_> = (0..256u64)
        .map(|i| session.read_pending(at(&lender, blocks(i)), vec![0; 4096]))
        .collect();
    assert_eq!(
        refused.wait(),
        Err(IoError::Transport(WcStatus::RemoteAccessError))
    );
    for (i, w) in writes.into_iter().enumerate() {
        w.wait().unwrap_or_else(|e| panic!("write {i}: {e}"));
    }
    for r in more {
        r.wait().expect("a read beside the refused write");
    }
    for (i, d) in data.iter().enumerate() {
        let got = session
            .read_pending(at(&lender, blocks(i as u64)), vec![0; 4096])
            .wait()
            .unwrap();
        assert!(got == *d, "block {i}");
    }
    assert!(session.is_open());
    let c = session.counters();
    assert_eq!(c.transfers_refused, 1);
    assert_eq!(c.requests_failed, 1, "only the refused one");
}

/// A write's result with its buffer, as `write_keeping` gives it.
fn write_keeping(
    session: &Session,
    at: RemoteAddr,
    data: Vec<u8>,
) -> Result<Vec<u8>, (IoError, Vec<u8>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    session.write_keeping(at, data, Box::new(move |r| tx.send(r).unwrap()));
    rx.recv_timeout(Duration::from_secs(20)).expect("answered")
}

#[test]
fn a_failed_write_gives_its_buffer_back_whatever_failed() {
    // Large requests go out in a buffer registered for them (dynMR), small ones staged in the
    // pool: both come back, intact, on success and on each kind of failure.
    let (lender, session) = setup(4 << 20, SessionConfig::default());
    for len in [4096, 1 << 20] {
        let data = pattern(len, len as u64);
        assert_eq!(
            write_keeping(&session, at(&lender, 0), data.clone()).unwrap(),
            data
        );
        let (e, back) = write_keeping(&session, at(&lender, 4 << 20), data.clone()).unwrap_err();
        assert!(matches!(e, IoError::OutOfBounds { .. }), "{e}");
        assert_eq!(back, data, "out of bounds, {len} bytes");
    }
    let r = lender.mem.remote();
    let wrong_key = RemoteAddr {
        addr: r.addr,
        rkey: r.rkey ^ 1,
    };
    for len in [4096, 1 << 20] {
        let data = pattern(len, 7 + len as u64);
        let (e, back) = write_keeping(&session, wrong_key, data.clone()).unwrap_err();
        assert!(
            matches!(
                e,
                IoError::Transport(WcStatus::RemoteAccessError) | IoError::Closed
            ),
            "{e}"
        );
        assert_eq!(
            back, data,
            "refused by the peer or a broken session, {len} bytes"
        );
    }
}

#[test]
fn a_dead_peer_fails_everything_without_hanging() {
    // Event polling answers completions on the transport's own thread while the poller
    // sleeps; a peer's death must still reach every waiter in each mode.
    for mode in [
        PollMode::default(),
        PollMode::Busy,
        PollMode::Event,
        PollMode::EventBatch,
    ] {
        let cfg = SessionConfig {
            polling: mode,
            ..SessionConfig::default()
        };
        a_dead_peer_fails_everything(cfg);
    }
}

fn a_dead_peer_fails_everything(cfg: SessionConfig) {
    let mode = cfg.polling;
    let (lender, session) = setup(8 << 20, cfg);
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    for i in 0..200u64 {
        let (d, f) = (done.clone(), failed.clone());
        session.write(
            at(&lender, (i % 8) << 20),
            vec![1; 1 << 20],
            Box::new(move |r| {
                if r.is_err() {
                    f.fetch_add(1, Ordering::Relaxed);
                }
                d.fetch_add(1, Ordering::Relaxed);
            }),
        );
        if i == 20 {
            break;
        }
    }
    let (remote_addr, remote_key) = (lender.mem.addr(), lender.mem.rkey());
    drop(lender);
    let start = Instant::now();
    while done.load(Ordering::Relaxed) < 21 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "requests hung ({mode})"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Whether or not those writes beat the peer's death, the next request fails in bounded
    // time, and from then on the session refuses work at once. (Some of those writes may have
    // been refused, the region gone first: then their key fails at once without being sent,
    // which tells nothing of the peer; a key never refused goes out.)
    let (tx, rx) = std::sync::mpsc::channel();
    session.write(
        RemoteAddr {
            addr: remote_addr,
            rkey: remote_key ^ 0x40,
        },
        vec![1; 4096],
        Box::new(move |r| drop(tx.send(r))),
    );
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("no answer: hung ({mode})"));
    assert!(r.is_err(), "a write to a dead peer succeeded ({mode})");
    assert!(
        !session.is_open(),
        "the session noticed the peer is gone ({mode})"
    );
    let r = session
        .write_pending(RemoteAddr { addr: 0, rkey: 0 }, vec![1])
        .wait();
    assert_eq!(r.unwrap_err(), IoError::Closed);
}

#[test]
fn dropping_a_session_answers_every_request() {
    // In every polling mode: with event polling, the transport threads answer requests too.
    for (round, polling) in [PollMode::default(), PollMode::Event, PollMode::EventBatch]
        .into_iter()
        .cycle()
        .take(60)
        .enumerate()
    {
        let cfg = SessionConfig {
            polling,
            qps: 3,
            chain: false,
            pool_slots: 1,
            slot_size: 64 << 10,
            dyn_threshold: 4096,
            window: WindowConfig::Static(1 << 20),
            caps: QpCaps {
                max_send_wr: 16,
                ..QpCaps::default()
            },
            ..SessionConfig::default()
        };
        let (lender, session) = setup(8 << 20, cfg);
        let (session, lender) = (Arc::new(session), Arc::new(lender));
        let done = Arc::new(AtomicUsize::new(0));
        let submitters: Vec<_> = (0..3u64)
            .map(|t| {
                let (s, l, done) = (session.clone(), lender.clone(), done.clone());
                std::thread::spawn(move || {
                    for i in 0..100u64 {
                        let d = done.clone();
                        let size = if i % 3 == 0 { 65536 } else { 2048 };
                        s.write(
                            at(&l, (t * 100 + i) * 65536 % (8 << 20)),
                            vec![2; size],
                            Box::new(move |_| {
                                d.fetch_add(1, Ordering::Relaxed);
                            }),
                        );
                    }
                })
            })
            .collect();
        for s in submitters {
            s.join().unwrap();
        }
        let session = Arc::try_unwrap(session).unwrap_or_else(|_| panic!("one owner"));
        drop(session);
        assert_eq!(
            done.load(Ordering::Relaxed),
            300,
            "round {round}, {polling:?}: answered when the session was dropped"
        );
        drop(lender);
    }
}

#[test]
fn every_polling_mode_completes_work() {
    for mode in [
        PollMode::Busy,
        PollMode::Event,
        PollMode::EventBatch,
        PollMode::Adaptive {
            max_poll_wc: 4,
            max_retry: 2,
        },
    ] {
        let cfg = SessionConfig {
            polling: mode,
            qps: 2,
            caps: QpCaps::default(),
            ..SessionConfig::default()
        };
        let (lender, session) = setup(1 << 20, cfg);
        let p: Vec<_> = (0..64u64)
            .map(|i| session.write_pending(at(&lender, i * 4096), pattern(4096, i)))
            .collect();
        for x in p {
            x.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        let got = session
            .read_pending(at(&lender, 0), vec![0; 4096])
            .wait()
            .unwrap();
        assert_eq!(got, pattern(4096, 0), "{mode}");
        let c = session.counters();
        if mode.sleeps() {
            // The tcp engine finished what came while the poller slept.
            assert!(c.completed_inline > 0, "{mode}: {c:?}");
        } else if mode != PollMode::Busy {
            assert!(c.event_wakeups > 0, "{mode} slept and was woken");
        }
    }
}

/// With event polling on the tcp provider, the engine thread that reads a completion off the
/// socket also answers it: a lone request wakes no poller. Requests that callbacks send from
/// there (as a write-behind chain does) go out and complete too.
#[test]
fn event_polling_answers_on_the_transport_thread_without_waking_the_poller() {
    let cfg = SessionConfig {
        polling: PollMode::Event,
        qps: 2,
        ..SessionConfig::default()
    };
    let (lender, session) = setup(1 << 20, cfg);
    for i in 0..200u64 {
        let off = (i % 256) * 4096;
        session
            .write_pending(at(&lender, off), pattern(4096, i))
            .wait()
            .unwrap();
        let got = session
            .read_pending(at(&lender, off), vec![0; 4096])
            .wait()
            .unwrap();
        assert!(got == pattern(4096, i), "block {i}");
    }
    let c = session.counters();
    assert_eq!(c.event_wakeups, 0, "no completion woke a poller: {c:?}");
    assert!(
        c.completed_inline >= 300,
        "most of 400 answered inline: {c:?}"
    );

    // Each write's callback sends the next one, from the engine's thread.
    let session = Arc::new(session);
    let lender = Arc::new(lender);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    fn chain(s: Arc<Session>, l: Arc<Lender>, i: u64, done: std::sync::mpsc::Sender<u64>) {
        let next = (s.clone(), l.clone());
        s.write(
            at(&l, (i % 256) * 4096),
            pattern(4096, 1000 + i),
            Box::new(move |r| {
                r.expect("chained write");
                if i == 99 {
                    done.send(i).unwrap();
                } else {
                    chain(next.0, next.1, i + 1, done);
                }
            }),
        );
    }
    chain(session.clone(), lender.clone(), 0, done_tx);
    assert_eq!(done_rx.recv_timeout(Duration::from_secs(20)), Ok(99));
    let got = session
        .read_pending(at(&lender, 99 * 4096), vec![0; 4096])
        .wait()
        .unwrap();
    assert!(got == pattern(4096, 1099));
}

/// What a watcher of the peer's control connection does when the peer goes: every request
/// queued or in flight is answered with the reason, later ones are refused, nothing hangs.
#[test]
fn an_aborted_session_answers_everything_with_the_reason() {
    let (lender, session) = setup(
        8 << 20,
        SessionConfig {
            window: WindowConfig::Static(2 << 20),
            ..SessionConfig::default()
        },
    );
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..64u64 {
        let tx = tx.clone();
        session.write(
            at(&lender, (i % 8) << 20),
            vec![3; 1 << 20],
            Box::new(move |r| drop(tx.send(r))),
        );
    }
    let abort = session.abort_handle();
    abort.abort("the peer closed its control connection");
    abort.abort("a second abort changes nothing");
    for _ in 0..64 {
        let r = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a request was never answered");
        if let Err(e) = r {
            assert!(
                e == IoError::Closed
                    || e == IoError::Aborted("the peer closed its control connection".into()),
                "{e:?}"
            );
        }
    }
    assert!(!session.is_open());
    assert_eq!(
        session.broken_by(),
        Some(IoError::Aborted(
            "the peer closed its control connection".into()
        ))
    );
    let r = session.write_pending(at(&lender, 0), vec![1]).wait();
    assert_eq!(r.unwrap_err(), IoError::Closed);
    // A handle outliving its session does nothing.
    drop(session);
    abort.abort("too late");
}

/// Over tcp, whose queue pairs are each served by a thread on both sides, small transfers join
/// a queue pair that is busy already rather than waking the threads of another; large ones do
/// not (a second queue pair's threads copy in parallel).
#[test]
fn small_transfers_join_a_busy_queue_pair_and_large_ones_spread() {
    let cfg = SessionConfig {
        qps: 4,
        merge: false,
        ..SessionConfig::default()
    };
    let (lender, session) = setup(8 << 20, cfg);
    let small: Vec<_> = (0..32u64)
        .map(|i| session.read_pending(at(&lender, i * 65536), vec![0; 4096]))
        .collect();
    for p in small {
        p.wait().unwrap();
    }
    let joined = session.counters().joined_busy;
    assert!(
        joined > 0,
        "32 small reads at once, none joined a busy queue pair"
    );
    let large: Vec<_> = (0..4u64)
        .map(|i| session.read_pending(at(&lender, i << 20), vec![0; 1 << 20]))
        .collect();
    for p in large {
        p.wait().unwrap();
    }
    assert_eq!(
        session.counters().joined_busy,
        joined,
        "1 MiB reads joined a queue pair busy with another"
    );
}

/// Requests that carry a key the peer refused are not sent again: each would take out another
/// queue pair. Three writes with one stale key, then 64 good ones: the good ones all land, the
/// stale ones fail, and the session keeps most of its queue pairs.
#[test]
fn one_stale_key_takes_out_one_queue_pair_not_one_per_request() {
    for round in 0..5 {
        let (lender, session) = setup(4 << 20, SessionConfig::default());
        let r = lender.mem.remote();
        let wrong_key = RemoteAddr {
            addr: r.addr,
            rkey: r.rkey ^ 1,
        };
        let stale: Vec<_> = (0..3)
            .map(|_| session.write_pending(wrong_key, vec![1; 4096]))
            .collect();
        let good: Vec<_> = (0..64u64)
            .map(|i| session.write_pending(at(&lender, i * 8192), pattern(4096, i)))
            .collect();
        for s in stale {
            assert_eq!(
                s.wait(),
                Err(IoError::Transport(WcStatus::RemoteAccessError))
            );
        }
        for (i, g) in good.into_iter().enumerate() {
            g.wait()
                .unwrap_or_else(|e| panic!("round {round}: good write {i}: {e}"));
        }
        assert!(session.is_open(), "round {round}");
        assert!(
            !session.is_degraded(),
            "round {round}: {} queue pairs refused",
            session.counters().transfers_refused
        );
    }
}
