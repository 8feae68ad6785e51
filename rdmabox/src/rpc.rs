//! Request/response messaging over two-sided SEND/RECV on one queue pair, so that control and
//! metadata traffic use the same transport (and provider) as the data.
//!
//! Each side registers `slots` send buffers and `slots` receive buffers of `max_msg` bytes. The
//! client never has more than `slots` requests outstanding, and the server re-posts a receive
//! buffer before it answers, so neither side can overrun the other's receive queue. Every
//! message starts with the request id; a reply carries the id of its request.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::transport::{
    Access, Completion, CompletionQueue, MemoryRegion, ProtectionDomain, QpState, QueuePair,
    RecvWr, SendOp, SendWr, WcOpcode,
};

const ID_LEN: usize = 8;
/// wr_ids of receives are offset so they never collide with send slots.
const RECV_BASE: u64 = 1 << 32;

#[derive(Clone, Copy, Debug)]
pub struct RpcConfig {
    pub slots: usize,
    pub max_msg: usize,
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

/// Polls `cq` adaptively (spinning a while, then sleeping on the CQ event) and hands each
/// completion to `on`, until `stop`, a poll error, or `on` returns false.
fn pump(ch: &Channel, stop: &AtomicBool, mut on: impl FnMut(&Completion) -> bool) {
    let mut wc = [Completion::EMPTY; 16];
    let mut empty = 0u32;
    let mut armed = false;
    while !stop.load(Ordering::Acquire) {
        let n = match ch.cq.poll(&mut wc) {
            Ok(n) => n,
            Err(e) => {
                log::error!("rpc: polling failed: {e}");
                return;
            }
        };
        for c in &wc[..n] {
            if !on(c) {
                return;
            }
        }
        if n > 0 {
            empty = 0;
            continue;
        }
        empty += 1;
        if empty < SPIN_POLLS {
            std::thread::yield_now();
            continue;
        }
        if !armed {
            // Arm, then poll once more before sleeping: a completion may have landed between
            // the empty poll and the arm.
            if ch.cq.arm().is_err() {
                return;
            }
            armed = true;
            continue;
        }
        armed = false;
        empty = 0;
        let _ = ch.cq.wait_event(Some(Duration::from_millis(100)));
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
