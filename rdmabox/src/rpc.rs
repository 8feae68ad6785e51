//! Request/response messaging over two-sided SEND/RECV on one queue pair, so that control and
//! metadata traffic use the same transport (and provider) as the data.
//!
//! Each side registers `slots` send buffers and `slots` receive buffers of `max_msg` bytes. The
//! client never has more than `slots` requests outstanding, and the server re-posts a receive
//! buffer before it answers, so neither side can overrun the other's receive queue. Every
//! message starts with the request id; a reply carries the id of its request.

use std::collections::HashMap;
use std::io;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

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
}

type Waiters = Mutex<HashMap<u64, Sender<io::Result<Vec<u8>>>>>;

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
        let ch = Arc::new(Channel::new(pd, qp, cq, cfg)?);
        let (slot_back, free_slots) = crossbeam_channel::bounded(cfg.slots);
        for i in 0..cfg.slots {
            slot_back.send(i).expect("room for every slot");
        }
        let waiters: Arc<Waiters> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let pump = {
            let (ch, waiters, stop, slot_back) =
                (ch.clone(), waiters.clone(), stop.clone(), slot_back.clone());
            std::thread::Builder::new()
                .name("rpc-client".into())
                .spawn(move || client_pump(&ch, &waiters, &stop, &slot_back))?
        };
        Ok(RpcClient {
            ch,
            free_slots,
            slot_back,
            waiters,
            next_id: AtomicU64::new(1),
            stop,
            pump: Some(pump),
        })
    }

    /// Sends `body` and waits for the reply (up to the configured timeout).
    pub fn call(&self, body: &[u8]) -> io::Result<Vec<u8>> {
        let timeout = self.ch.cfg.timeout;
        let dead = || io::Error::new(io::ErrorKind::BrokenPipe, "rpc connection lost");
        if self.ch.broken() {
            return Err(dead());
        }
        let slot = self
            .free_slots
            .recv_timeout(timeout)
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "rpc: no free slot"))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.waiters.lock().unwrap().insert(id, tx);
        // The slot comes back when the send completes (see client_pump).
        if let Err(e) = self.ch.send(slot, id, body) {
            self.waiters.lock().unwrap().remove(&id);
            let _ = self.slot_back.send(slot);
            return Err(e);
        }
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => {
                self.waiters.lock().unwrap().remove(&id);
                Err(if self.ch.broken() {
                    dead()
                } else {
                    io::Error::new(io::ErrorKind::TimedOut, "rpc: no reply in time")
                })
            }
        }
    }
}

fn client_pump(ch: &Channel, waiters: &Waiters, stop: &AtomicBool, slot_back: &Sender<usize>) {
    pump(ch, stop, |c| {
        if !c.status.is_ok() {
            log::debug!("rpc client: connection failed ({:?})", c.status);
            // Fail everyone waiting: the QP is in error and nothing more will come.
            for (_, w) in waiters.lock().unwrap().drain() {
                let _ = w.send(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "rpc connection lost",
                )));
            }
            return false;
        }
        match c.opcode {
            WcOpcode::Send => {
                let _ = slot_back.send(c.wr_id as usize);
            }
            WcOpcode::Recv => {
                let slot = (c.wr_id - RECV_BASE) as usize;
                let msg = ch.received(slot, c.byte_len as usize);
                if ch.post_recv(slot).is_err() {
                    return false;
                }
                match msg {
                    Some((id, body)) => {
                        if let Some(w) = waiters.lock().unwrap().remove(&id) {
                            let _ = w.send(Ok(body));
                        }
                    }
                    None => log::warn!("rpc client: malformed reply dropped"),
                }
            }
            _ => {}
        }
        true
    });
    for (_, w) in waiters.lock().unwrap().drain() {
        let _ = w.send(Err(io::Error::new(
            io::ErrorKind::BrokenPipe,
            "rpc connection lost",
        )));
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
/// body to a reply body. Returns when the connection breaks or `stop` is set.
pub fn serve(
    pd: &ProtectionDomain,
    qp: QueuePair,
    cq: CompletionQueue,
    cfg: RpcConfig,
    stop: &AtomicBool,
    mut handler: impl FnMut(&[u8]) -> Vec<u8>,
) -> io::Result<()> {
    let ch = Channel::new(pd, qp, cq, cfg)?;
    // Replies reuse the receive slot's index as their send slot: at most `slots` are pending.
    pump(&ch, stop, |c| {
        if !c.status.is_ok() {
            return false;
        }
        if c.opcode != WcOpcode::Recv && c.opcode != WcOpcode::RecvWithImm {
            return true;
        }
        let slot = (c.wr_id - RECV_BASE) as usize;
        let msg = ch.received(slot, c.byte_len as usize);
        if ch.post_recv(slot).is_err() {
            return false;
        }
        let Some((id, body)) = msg else {
            log::warn!("rpc server: malformed message; closing the connection");
            return false;
        };
        let mut reply = handler(&body);
        if reply.len() > cfg.max_msg {
            log::error!("rpc server: reply of {} bytes over the limit", reply.len());
            reply.clear();
        }
        ch.send(slot, id, &reply).is_ok()
    });
    ch.qp.set_error();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    use crate::transport::{connect_links, Context, ProviderKind, QpCaps, TransportConfig};

    fn one_link(
        ctx: &Context,
        pd: &ProtectionDomain,
        s: &mut TcpStream,
    ) -> (QueuePair, CompletionQueue) {
        connect_links(ctx, pd, s, 1, QpCaps::default())
            .unwrap()
            .pop()
            .unwrap()
    }

    #[test]
    fn calls_are_answered_before_and_after_the_pumps_sleep() {
        let tcp = TransportConfig::with_provider(ProviderKind::Tcp);
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
                serve(&pd, qp, cq, RpcConfig::default(), &stop, |req| {
                    req.iter().rev().copied().collect()
                })
                .unwrap();
            })
        };
        let ctx = Context::open(&tcp).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let (qp, cq) = one_link(&ctx, &pd, &mut TcpStream::connect(addr).unwrap());
        let client = RpcClient::new(&pd, qp, cq, RpcConfig::default()).unwrap();
        assert_eq!(client.call(b"abc").unwrap(), b"cba");
        // Long enough for both pumps to spin out and sleep on their CQ events.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(client.call(b"xyz").unwrap(), b"zyx");
        stop.store(true, Ordering::Release);
        drop(client);
        server.join().unwrap();
    }
}
