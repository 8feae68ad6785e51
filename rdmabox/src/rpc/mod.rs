//! Request/response messaging over two-sided SEND/RECV on one queue pair, so that control and
//! metadata traffic use the same transport (and provider) as the data.
//!
//! Each side registers `slots` send buffers and `slots` receive buffers of `max_msg` bytes.
//! Flow control is by credit: a client slot is a credit for one request, taken before the SEND
//! and given back only once the reply has arrived (and the SEND has completed), and the server
//! re-posts a receive buffer before it answers. So neither side ever sends to a peer that has
//! no receive posted for it: a peer that is slow to answer (a descheduled thread, a machine
//! under load) delays calls, it never fails them. Every message starts with the request id; a
//! reply carries the id of its request.

use std::collections::HashMap;
use std::io;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

mod dispatch;

pub use dispatch::Dispatcher;

use crate::poller::{self, PollMode, PollTarget};
use crate::transport::{
    Access, Completion, CompletionQueue, MemoryRegion, ProtectionDomain, QpState, QueuePair,
    RecvWr, SendOp, SendWr, WcOpcode,
};

const ID_LEN: usize = 8;
/// wr_ids of receives are offset so they never collide with send slots.
const RECV_BASE: u64 = 1 << 32;

/// The sizing of an RPC channel; both sides must use the same `slots` and `max_msg`.
#[derive(Clone, Copy, Debug)]
pub struct RpcConfig {
    /// Send and receive buffers on each side: the most requests outstanding at once.
    pub slots: usize,
    /// Largest request or reply body, in bytes.
    pub max_msg: usize,
    /// How long a call waits for a free slot, and then again for its reply.
    pub timeout: Duration,
}

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig {
            slots: 16,
            max_msg: 64 << 10,
            timeout: Duration::from_secs(10),
        }
    }
}

/// Buffers and queue pair shared by both roles.
struct Channel {
    qp: QueuePair,
    cq: CompletionQueue,
    send: MemoryRegion,
    recv: MemoryRegion,
    cfg: RpcConfig,
}

impl Channel {
    fn new(
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        cfg: RpcConfig,
    ) -> io::Result<Channel> {
        let bytes = cfg.slots * (cfg.max_msg + ID_LEN);
        let ch = Channel {
            send: pd.alloc_region(bytes, Access::LOCAL_WRITE)?,
            recv: pd.alloc_region(bytes, Access::LOCAL_WRITE)?,
            qp,
            cq,
            cfg,
        };
        for i in 0..cfg.slots {
            ch.post_recv(i)?;
        }
        Ok(ch)
    }

    fn slot_len(&self) -> usize {
        self.cfg.max_msg + ID_LEN
    }

    fn post_recv(&self, slot: usize) -> io::Result<()> {
        let sge = [self
            .recv
            .slice(slot * self.slot_len(), self.slot_len())
            .expect("slot inside the region")];
        self.qp.post_recv(&[RecvWr {
            wr_id: RECV_BASE + slot as u64,
            sges: &sge,
        }])?;
        Ok(())
    }

    fn send(&self, slot: usize, id: u64, body: &[u8]) -> io::Result<()> {
        if body.len() > self.cfg.max_msg {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "message of {} bytes over the {} limit",
                    body.len(),
                    self.cfg.max_msg
                ),
            ));
        }
        let base = slot * self.slot_len();
        self.send.write_at(base, &id.to_le_bytes())?;
        self.send.write_at(base + ID_LEN, body)?;
        let sge = [self
            .send
            .slice(base, ID_LEN + body.len())
            .expect("slot inside the region")];
        self.qp
            .post_send(&[SendWr::new(slot as u64, SendOp::Send, &sge)])?;
        Ok(())
    }

    /// The message in receive slot `slot`: its id and body (copied out).
    fn received(&self, slot: usize, len: usize) -> Option<(u64, Vec<u8>)> {
        if !(ID_LEN..=self.slot_len()).contains(&len) {
            return None;
        }
        let base = slot * self.slot_len();
        let mut id = [0u8; ID_LEN];
        self.recv.read_at(base, &mut id).ok()?;
        let mut body = vec![0u8; len - ID_LEN];
        self.recv.read_at(base + ID_LEN, &mut body).ok()?;
        Some((u64::from_le_bytes(id), body))
    }

    fn broken(&self) -> bool {
        self.qp.state() == QpState::Error
    }
}

/// Empty polls before a pump sleeps: requests and replies come in bursts, and a sleep costs a
/// wake-up on each side of every round trip.
const SPIN_POLLS: u32 = 200;
/// Completions taken per poll.
const BATCH: usize = 16;
/// How both sides poll: spin through [`SPIN_POLLS`] empty rounds (yielding between them), then
/// arm, poll once more and sleep on the CQ event (bounded, so that `stop` is noticed).
const POLLING: PollMode = PollMode::Adaptive {
    max_poll_wc: BATCH,
    max_retry: SPIN_POLLS,
};

/// Polls `ch`'s CQ as [`POLLING`] says and hands each completion to `on`, until `stop`, a poll
/// or arm error, or `on` returns false.
fn pump(ch: &Channel, stop: &AtomicBool, on: impl FnMut(&Completion) -> bool) {
    poller::drive(
        POLLING,
        &mut Pump {
            ch,
            stop,
            wc: [Completion::EMPTY; BATCH],
            on,
        },
    );
}

/// One side's [`poller::drive`] target: the channel's CQ, the stop flag and the handler.
struct Pump<'a, F> {
    ch: &'a Channel,
    stop: &'a AtomicBool,
    wc: [Completion; BATCH],
    on: F,
}

impl<F: FnMut(&Completion) -> bool> PollTarget for Pump<'_, F> {
    fn poll_round(&mut self) -> ControlFlow<(), usize> {
        if self.stop.load(Ordering::Acquire) {
            return ControlFlow::Break(());
        }
        let n = match self.ch.cq.poll(&mut self.wc) {
            Ok(n) => n,
            Err(e) => {
                log::error!("rpc: polling failed: {e}");
                return ControlFlow::Break(());
            }
        };
        for c in &self.wc[..n] {
            if !(self.on)(c) {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(n)
    }

    fn arm(&mut self) -> ControlFlow<()> {
        match self.ch.cq.arm() {
            Ok(()) => ControlFlow::Continue(()),
            Err(_) => ControlFlow::Break(()),
        }
    }

    fn sleep(&mut self, timeout: Duration) {
        let _ = self.ch.cq.wait_event(Some(timeout));
    }

    /// A metadata call is a round trip someone waits for: a pump that slept through it would
    /// add a wake-up on each side (creates ran at 0.6-1.0x and unlinks at 0.7-0.8x when the
    /// pumps gave way with the data pollers, client and node on one machine).
    fn gives_way_to_waiting_threads(&self) -> bool {
        false
    }
}

/// A call waiting for its reply: the slot it holds, and where the reply goes (a caller that
/// gave up has dropped the receiving end; the slot still waits for the late reply).
struct Waiter {
    slot: usize,
    reply: Sender<io::Result<Vec<u8>>>,
}

type Waiters = Mutex<HashMap<u64, Waiter>>;

/// What a client slot still waits for before it is free again: its SEND's completion and its
/// reply. Owned by the pump, which sees both.
#[derive(Clone, Copy, Default)]
struct SlotUse {
    sent: bool,
    answered: bool,
}

/// The requesting side.
pub struct RpcClient {
    ch: Arc<Channel>,
    free_slots: Receiver<usize>,
    slot_back: Sender<usize>,
    waiters: Arc<Waiters>,
    next_id: AtomicU64,
    stop: Arc<AtomicBool>,
    pump: Option<JoinHandle<()>>,
}

impl RpcClient {
    /// Sets up the client side on a connected queue pair and starts its pump thread, which
    /// delivers replies to waiting callers.
    pub fn new(
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        cfg: RpcConfig,
    ) -> io::Result<RpcClient> {
        let (mut client, mut delivering) = RpcClient::parts(pd, qp, cq, cfg)?;
        let pump = {
            let (ch, stop) = (client.ch.clone(), client.stop.clone());
            std::thread::Builder::new()
                .name("rpc-client".into())
                .spawn(move || {
                    pump(&ch, &stop, |c| delivering.on(c));
                    delivering.end();
                })?
        };
        client.pump = Some(pump);
        Ok(client)
    }

    /// The client, and what delivers its replies (for a pump to run).
    fn parts(
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        cfg: RpcConfig,
    ) -> io::Result<(RpcClient, Delivering)> {
        let ch = Arc::new(Channel::new(pd, qp, cq, cfg)?);
        let (slot_back, free_slots) = crossbeam_channel::bounded(cfg.slots);
        for i in 0..cfg.slots {
            slot_back.send(i).expect("room for every slot");
        }
        let waiters: Arc<Waiters> = Arc::default();
        let delivering = Delivering {
            ch: ch.clone(),
            waiters: waiters.clone(),
            slot_back: slot_back.clone(),
            slots: vec![SlotUse::default(); cfg.slots],
        };
        let client = RpcClient {
            ch,
            free_slots,
            slot_back,
            waiters,
            next_id: AtomicU64::new(1),
            stop: Arc::new(AtomicBool::new(false)),
            pump: None,
        };
        Ok((client, delivering))
    }

    /// Sends `body` and waits for the reply (up to the configured timeout).
    pub fn call(&self, body: &[u8]) -> io::Result<Vec<u8>> {
        self.call_within(body, self.ch.cfg.timeout)
    }

    /// Whether the connection is gone (no call can succeed any more).
    pub fn is_broken(&self) -> bool {
        self.ch.broken()
    }

    /// Breaks the connection as a network failure would: calls in flight and to come fail.
    pub fn abort(&self) {
        self.ch.qp.set_error();
    }

    /// Sends `body` and waits up to `timeout` for a free slot, and again for the reply.
    pub fn call_within(&self, body: &[u8], timeout: Duration) -> io::Result<Vec<u8>> {
        let dead = || io::Error::new(io::ErrorKind::BrokenPipe, "rpc connection lost");
        if self.ch.broken() {
            return Err(dead());
        }
        // Slots of a broken connection never come back: look for that while waiting.
        let give_up = Instant::now() + timeout;
        let slot = loop {
            let left = give_up.saturating_duration_since(Instant::now());
            match self
                .free_slots
                .recv_timeout(left.min(Duration::from_millis(50)))
            {
                Ok(slot) => break slot,
                Err(_) if self.ch.broken() => return Err(dead()),
                Err(_) if left.is_zero() => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "rpc: no free slot"))
                }
                Err(_) => {}
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.waiters
            .lock()
            .unwrap()
            .insert(id, Waiter { slot, reply: tx });
        // The slot comes back once the send has completed and the reply arrived (client_pump).
        if let Err(e) = self.ch.send(slot, id, body) {
            self.waiters.lock().unwrap().remove(&id);
            let _ = self.slot_back.send(slot);
            return Err(e);
        }
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => {
                // The waiter stays: its slot is free only once the late reply has come, since
                // until then the reply may still take one of our receive buffers.
                Err(if self.ch.broken() {
                    dead()
                } else {
                    io::Error::new(io::ErrorKind::TimedOut, "rpc: no reply in time")
                })
            }
        }
    }
}

/// What delivers a client's replies to its callers: owned by whatever pumps its CQ.
struct Delivering {
    ch: Arc<Channel>,
    waiters: Arc<Waiters>,
    slot_back: Sender<usize>,
    /// What each slot still waits for.
    slots: Vec<SlotUse>,
}

impl Delivering {
    /// A slot is a credit: it returns when both its SEND completed and its reply arrived.
    fn progress(&mut self, slot: usize, f: fn(&mut SlotUse)) {
        if let Some(u) = self.slots.get_mut(slot) {
            f(u);
            if u.sent && u.answered {
                *u = SlotUse::default();
                let _ = self.slot_back.send(slot);
            }
        }
    }

    /// Takes one completion; false once the connection failed.
    fn on(&mut self, c: &Completion) -> bool {
        if !c.status.is_ok() {
            // The owner says why at its level (a lost metadata connection, a client gone).
            log::debug!("rpc client: connection failed ({:?})", c.status);
            return false;
        }
        match c.opcode {
            WcOpcode::Send => self.progress(c.wr_id as usize, |u| u.sent = true),
            WcOpcode::Recv => {
                let slot = (c.wr_id - RECV_BASE) as usize;
                let msg = self.ch.received(slot, c.byte_len as usize);
                if let Err(e) = self.ch.post_recv(slot) {
                    log::warn!("rpc client: re-posting a receive failed: {e}");
                    return false;
                }
                match msg {
                    Some((id, body)) => {
                        let w = self.waiters.lock().unwrap().remove(&id);
                        if let Some(w) = w {
                            let _ = w.reply.send(Ok(body));
                            self.progress(w.slot, |u| u.answered = true);
                        }
                    }
                    None => log::warn!("rpc client: malformed reply dropped"),
                }
            }
            _ => {}
        }
        true
    }

    /// The QP is in error (or the client stopped): nothing more will come; everyone waiting
    /// fails.
    fn end(self) {
        self.ch.qp.set_error();
        for (_, w) in self.waiters.lock().unwrap().drain() {
            let _ = w.reply.send(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "rpc connection lost",
            )));
        }
    }
}

impl Drop for RpcClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.ch.qp.set_error();
        if let Some(p) = self.pump.take() {
            let _ = p.join();
        }
    }
}

/// Serves requests on the calling thread until the peer goes away: `handler` maps a request
/// body to a reply body. Returns when `stop` is set (Ok) or the connection ends (Err: why).
pub fn serve(
    pd: &ProtectionDomain,
    qp: QueuePair,
    cq: CompletionQueue,
    cfg: RpcConfig,
    stop: &AtomicBool,
    handler: impl FnMut(&[u8]) -> Vec<u8>,
) -> io::Result<()> {
    let ch = Arc::new(Channel::new(pd, qp, cq, cfg)?);
    let mut answering = Answering::new(ch.clone(), handler);
    pump(&ch, stop, |c| answering.on(c));
    answering.result(stop.load(Ordering::Acquire))
}

/// The serving side of a channel: answers each request with its handler, in order. Replies
/// reuse the receive slot's index as their send slot: at most `slots` are pending.
struct Answering<H> {
    ch: Arc<Channel>,
    handler: H,
    /// Why the connection ended, if it did.
    ended: Option<String>,
}

impl<H: FnMut(&[u8]) -> Vec<u8>> Answering<H> {
    fn new(ch: Arc<Channel>, handler: H) -> Answering<H> {
        Answering {
            ch,
            handler,
            ended: None,
        }
    }

    /// Takes one completion; false once the connection ended.
    fn on(&mut self, c: &Completion) -> bool {
        let mut end = |why: String| {
            self.ended = Some(why);
            false
        };
        if !c.status.is_ok() {
            return end(format!("{:?}", c.status));
        }
        if c.opcode != WcOpcode::Recv && c.opcode != WcOpcode::RecvWithImm {
            return true;
        }
        let slot = (c.wr_id - RECV_BASE) as usize;
        let msg = self.ch.received(slot, c.byte_len as usize);
        if let Err(e) = self.ch.post_recv(slot) {
            return end(format!("re-posting a receive: {e}"));
        }
        let Some((id, body)) = msg else {
            return end("malformed message".into());
        };
        let mut reply = (self.handler)(&body);
        if reply.len() > self.ch.cfg.max_msg {
            log::error!("rpc server: reply of {} bytes over the limit", reply.len());
            reply.clear();
        }
        match self.ch.send(slot, id, &reply) {
            Ok(()) => true,
            Err(e) => {
                self.ended = Some(format!("sending a reply: {e}"));
                false
            }
        }
    }

    /// Ends the channel: Ok if it was stopped, else why it ended.
    fn result(self, stopped: bool) -> io::Result<()> {
        self.ch.qp.set_error();
        match self.ended {
            Some(why) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, why)),
            None if stopped => Ok(()),
            None => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "completion queue failed",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    use crate::transport::{
        connect_queue_pairs, Context, ProviderKind, QpCaps, QpRoute, TransportConfig,
    };

    fn one_link(
        ctx: &Context,
        pd: &ProtectionDomain,
        s: &mut TcpStream,
    ) -> (QueuePair, CompletionQueue) {
        connect_queue_pairs(ctx, pd, s, 1, QpCaps::default(), &QpRoute::OwnPort)
            .unwrap()
            .pop()
            .unwrap()
    }

    /// A server thread answering with `handler` and a client connected to it, over `tcp`.
    fn pair(
        tcp: TransportConfig,
        cfg: RpcConfig,
        handler: impl FnMut(&[u8]) -> Vec<u8> + Send + 'static,
    ) -> (RpcClient, impl FnOnce()) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let (stop, tcp) = (stop.clone(), tcp.clone());
            std::thread::spawn(move || {
                let ctx = Context::open(&tcp).unwrap();
                let pd = ctx.alloc_pd().unwrap();
                let (mut s, _) = l.accept().unwrap();
                let (qp, cq) = one_link(&ctx, &pd, &mut s);
                let _ = serve(&pd, qp, cq, cfg, &stop, handler);
            })
        };
        let ctx = Context::open(&tcp).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let (qp, cq) = one_link(&ctx, &pd, &mut TcpStream::connect(addr).unwrap());
        let client = RpcClient::new(&pd, qp, cq, cfg).unwrap();
        let finish = move || {
            stop.store(true, Ordering::Release);
            server.join().unwrap();
        };
        (client, finish)
    }

    #[test]
    fn calls_are_answered_before_and_after_the_pumps_sleep() {
        let tcp = TransportConfig::with_provider(ProviderKind::Tcp);
        let (client, finish) = pair(tcp, RpcConfig::default(), |req| {
            req.iter().rev().copied().collect()
        });
        assert_eq!(client.call(b"abc").unwrap(), b"cba");
        // Long enough for both pumps to spin out and sleep on their CQ events.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(client.call(b"xyz").unwrap(), b"zyx");
        drop(client);
        finish();
    }

    #[test]
    fn a_server_slower_than_the_rnr_window_delays_calls_never_fails_them() {
        // Receivers that are not re-posted in time fail SENDs after the RNR window; credits
        // must keep the client from ever sending into a receive queue with nothing posted.
        let mut tcp = TransportConfig::with_provider(ProviderKind::Tcp);
        tcp.tcp.rnr_timeout = Duration::from_millis(50);
        let cfg = RpcConfig {
            slots: 2,
            ..RpcConfig::default()
        };
        let (client, finish) = pair(tcp, cfg, |req| {
            // A descheduled server thread: far longer than the RNR window.
            std::thread::sleep(Duration::from_millis(150));
            req.to_vec()
        });
        let client = Arc::new(client);
        let callers: Vec<_> = (0..6u8)
            .map(|i| {
                let client = client.clone();
                std::thread::spawn(move || client.call(&[i]))
            })
            .collect();
        for (i, c) in callers.into_iter().enumerate() {
            assert_eq!(c.join().unwrap().unwrap(), [i as u8], "call {i}");
        }
        drop(client);
        finish();
    }
}
