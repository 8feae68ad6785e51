//! tcp queue pairs: the requester side of posting, and the error state.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::socket::{setsockopt, sockopt};

use super::route::{QpRoute, Setup};

use super::cq::Cq;
use super::io::iovec;
use super::seal::Sealer;
use super::shared::{Outstanding, PostedRecv, QpShared, Target, TxState, STATE_RTS};
use super::wire::{Header, Kind, HEADER_LEN};
use super::{engine, event_loop, PdShared, TcpConfig, TcpEndpoint};
use crate::transport::region::Access;
use crate::transport::types::{
    check_recv_chain, check_send_chain, PostError, QpCaps, QpState, RecvWr, SendOp, SendWr,
    WcOpcode, WcStatus,
};

/// A queue pair that is not connected yet: it knows its endpoint and how its connection comes.
pub struct PreparedQp {
    cfg: TcpConfig,
    pd: Arc<PdShared>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    caps: QpCaps,
    qpn: u32,
    token: u64,
    setup: Setup,
}

impl PreparedQp {
    pub(super) fn new(
        cfg: TcpConfig,
        pd: Arc<PdShared>,
        (send_cq, recv_cq): (Arc<Cq>, Arc<Cq>),
        caps: QpCaps,
        qpn: u32,
        route: &QpRoute,
    ) -> io::Result<PreparedQp> {
        let token = crate::random::u64();
        let setup = Setup::new(route, cfg.bind_ip, token)?;
        Ok(PreparedQp {
            cfg,
            pd,
            send_cq,
            recv_cq,
            caps,
            qpn,
            token,
            setup,
        })
    }

    /// The queue pair's number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// What the peer needs: where we listen (if on a port of our own), our number and token.
    pub fn endpoint(&self) -> io::Result<TcpEndpoint> {
        Ok(TcpEndpoint {
            addr: self.setup.addr()?,
            qpn: self.qpn,
            token: self.token,
        })
    }

    /// Connects to the peer's queue pair, the way the route said (see [`QpRoute`]).
    pub fn connect(self, remote: &TcpEndpoint) -> io::Result<Qp> {
        let deadline = Instant::now() + self.cfg.connect_timeout;
        let PreparedQp {
            cfg,
            pd,
            send_cq,
            recv_cq,
            caps,
            qpn,
            token,
            setup,
        } = self;
        let (stream, keys) = setup.connect(qpn, token, remote, deadline)?;
        configure_socket(&stream, cfg.dead_peer_timeout)?;
        let shared = Arc::new(QpShared {
            qpn,
            caps,
            pd,
            send_cq,
            recv_cq,
            rnr_timeout: cfg.rnr_timeout,
            stream,
            state: AtomicU8::new(STATE_RTS),
            keys,
            tx: Mutex::new(TxState {
                psn: 0,
                pending: Vec::new(),
                sealer: keys.as_ref().map(Sealer::new),
            }),
            responses_queued: AtomicUsize::new(0),
            outstanding: Mutex::new(VecDeque::new()),
            recvs: Mutex::default(),
            recv_ready: Condvar::new(),
            answered: Mutex::default(),
            wake_loop: OnceLock::new(),
            post_calls: AtomicU64::new(0),
            wire_writes: AtomicU64::new(0),
        });
        log::debug!("tcp qp {qpn} connected to remote qp {}", remote.qpn);
        // A queue pair we never post on needs no threads of its own.
        let threads = if caps.is_responder() || cfg.served_by_loops {
            event_loop::serve(shared.clone())?;
            Vec::new()
        } else {
            engine::spawn(shared.clone())
        };
        Ok(Qp { shared, threads })
    }
}

/// No Nagle delay, and a peer that stops acknowledging or answering keepalives for
/// `dead_peer` ends the connection (a crashed host never sends a FIN).
pub fn configure_socket(s: &TcpStream, dead_peer: Duration) -> io::Result<()> {
    s.set_nodelay(true)?;
    let secs = dead_peer.as_secs().clamp(1, u32::MAX as u64) as u32;
    let millis = dead_peer.as_millis().clamp(1, u32::MAX as u128) as u32;
    setsockopt(s, sockopt::TcpUserTimeout, &millis)?;
    setsockopt(s, sockopt::KeepAlive, &true)?;
    setsockopt(s, sockopt::TcpKeepIdle, &1)?;
    setsockopt(s, sockopt::TcpKeepInterval, &1)?;
    setsockopt(s, sockopt::TcpKeepCount, &secs)?;
    Ok(())
}

/// A connected tcp queue pair.
pub struct Qp {
    shared: Arc<QpShared>,
    threads: Vec<JoinHandle<()>>,
}

fn opcode_of(op: &SendOp) -> (Kind, WcOpcode) {
    match op {
        SendOp::Write(_) => (Kind::Write, WcOpcode::Write),
        SendOp::WriteWithImm(..) => (Kind::WriteWithImm, WcOpcode::Write),
        SendOp::Read(_) => (Kind::ReadRequest, WcOpcode::Read),
        SendOp::Send => (Kind::Send, WcOpcode::Send),
        SendOp::SendWithImm(_) => (Kind::SendWithImm, WcOpcode::Send),
    }
}

impl Qp {
    /// The queue pair's number.
    pub fn qp_num(&self) -> u32 {
        self.shared.qpn
    }

    /// The queue sizes in force (exactly those asked for).
    pub fn caps(&self) -> QpCaps {
        self.shared.caps
    }

    /// Ready to send until the connection fails or [`Qp::set_error`] runs; then error.
    pub fn state(&self) -> QpState {
        if self.shared.is_error() {
            QpState::Error
        } else {
            QpState::ReadyToSend
        }
    }

    /// Moves the QP to the error state, as `ibv_modify_qp(IBV_QPS_ERR)`: everything
    /// outstanding is flushed.
    pub fn set_error(&self) {
        self.shared.enter_error();
        self.shared.close();
    }

    /// (post calls, socket write calls) so far: a chain is one post and, when it fits the
    /// socket buffer, one write.
    pub fn doorbells(&self) -> (u64, u64) {
        (
            self.shared.post_calls.load(Ordering::Relaxed),
            self.shared.wire_writes.load(Ordering::Relaxed),
        )
    }

    fn locally_valid(&self, wr: &SendWr<'_>) -> bool {
        let needs_write = matches!(wr.op, SendOp::Read(_));
        wr.sges.iter().all(|s| {
            s.mr.inner.pd_id == self.shared.pd.id
                && (!needs_write || s.mr.access().contains(Access::LOCAL_WRITE))
        })
    }

    /// Sends a chain's requests as frames with one gathered write (the doorbell); each
    /// completes when the peer's engine answers it.
    pub fn post_send(&self, chain: &[SendWr<'_>]) -> Result<(), PostError> {
        check_send_chain(chain, &self.shared.caps)?;
        let sh = &self.shared;
        sh.post_calls.fetch_add(1, Ordering::Relaxed);
        let mut tx = sh.tx.lock().unwrap();
        if sh.is_error() {
            drop(tx);
            sh.send_cq.push_all(
                chain
                    .iter()
                    .map(|wr| sh.completion(wr.wr_id, WcStatus::WrFlushError, opcode_of(&wr.op).1)),
            );
            // A refusal's NAK may have been left to us by the loop.
            sh.send_answered_left();
            return Ok(());
        }
        // A request whose local buffers are not ours fails like a NIC's local protection
        // error: the requests before it go out, it and the rest do not.
        let invalid_at = chain.iter().position(|wr| !self.locally_valid(wr));
        // Like a NIC's send queue, post what fits and say so.
        let room =
            (sh.caps.max_send_wr as usize).saturating_sub(sh.outstanding.lock().unwrap().len());
        let fits = chain.len().min(room);
        let valid = invalid_at.map_or(fits, |i| i.min(fits));
        let mut headers = Vec::with_capacity(valid);
        let mut pending = Vec::with_capacity(valid);
        for wr in &chain[..valid] {
            let (kind, opcode) = opcode_of(&wr.op);
            let mut h = Header::new(kind, tx.psn);
            h.len = wr.byte_len() as u32;
            match wr.op {
                SendOp::Write(r) | SendOp::Read(r) => {
                    h.remote_addr = r.addr;
                    h.rkey = r.rkey;
                }
                SendOp::WriteWithImm(r, imm) => {
                    h.remote_addr = r.addr;
                    h.rkey = r.rkey;
                    h.imm = imm;
                }
                SendOp::SendWithImm(imm) => h.imm = imm,
                SendOp::Send => {}
            }
            let read_targets = if kind == Kind::ReadRequest {
                wr.sges
                    .iter()
                    .map(|s| Target {
                        mr: s.mr.inner.clone(),
                        offset: s.offset,
                        len: s.len,
                    })
                    .collect()
            } else {
                Vec::new()
            };
            pending.push(Outstanding {
                psn: tx.psn,
                wr_id: wr.wr_id,
                opcode,
                signaled: wr.signaled,
                byte_len: h.len,
                read_targets,
            });
            headers.push(h.encode());
            tx.psn = tx.psn.wrapping_add(1);
        }
        sh.outstanding.lock().unwrap().extend(pending);
        if sh.is_error() {
            // The engine failed the QP between our state check and the push: flush what we
            // just queued too, so that no request is left without a completion.
            sh.enter_error();
        }
        let mut iovs = Vec::with_capacity(valid * 2);
        for (wr, h) in chain[..valid].iter().zip(&headers) {
            iovs.push(iovec(h.as_ptr(), HEADER_LEN));
            if !matches!(wr.op, SendOp::Read(_)) {
                iovs.extend(wr.sges.iter().filter(|s| s.len > 0).map(|s| {
                    // SAFETY: Sge::new keeps offset+len in the region, so the pointer
                    // stays in it.
                    iovec(unsafe { s.mr.inner.ptr().add(s.offset) }, s.len)
                }));
            }
        }
        // SAFETY: the headers live in `headers`; the payload SGEs point into regions the chain
        // borrows for the duration of this call.
        let sent = unsafe { sh.transmit(&mut tx, &mut iovs) };
        drop(tx);
        match sent {
            Ok(()) => sh.send_answered_left(),
            Err(e) => {
                log::warn!("qp {}: send failed: {e}", sh.qpn);
                sh.enter_error();
                sh.close();
            }
        }
        if valid == fits && fits < chain.len() {
            return Err(PostError::QueueFull { posted: fits });
        }
        if valid < chain.len() {
            let bad = &chain[valid];
            log::warn!(
                "qp {}: wr {} refers to memory outside this protection domain",
                sh.qpn,
                bad.wr_id
            );
            sh.send_cq.push(sh.completion(
                bad.wr_id,
                WcStatus::LocalProtectionError,
                opcode_of(&bad.op).1,
            ));
            sh.enter_error();
            sh.close();
            sh.send_cq.push_all(
                chain[valid + 1..]
                    .iter()
                    .map(|wr| sh.completion(wr.wr_id, WcStatus::WrFlushError, opcode_of(&wr.op).1)),
            );
        }
        Ok(())
    }

    /// Queues receive buffers for the engine to fill with incoming SENDs, in order.
    pub fn post_recv(&self, chain: &[RecvWr<'_>]) -> Result<(), PostError> {
        check_recv_chain(chain, &self.shared.caps)?;
        let sh = &self.shared;
        for wr in chain {
            for s in wr.sges {
                if s.mr.inner.pd_id != sh.pd.id || !s.mr.access().contains(Access::LOCAL_WRITE) {
                    return Err(PostError::Invalid(format!(
                        "recv wr {}: buffer not writable in this protection domain",
                        wr.wr_id
                    )));
                }
            }
        }
        let mut recvs = sh.recvs.lock().unwrap();
        if sh.is_error() {
            drop(recvs);
            sh.recv_cq.push_all(
                chain
                    .iter()
                    .map(|wr| sh.completion(wr.wr_id, WcStatus::WrFlushError, WcOpcode::Recv)),
            );
            return Ok(());
        }
        if recvs.queue.len() + chain.len() > sh.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull { posted: 0 });
        }
        recvs.queue.extend(chain.iter().map(|wr| {
            PostedRecv {
                wr_id: wr.wr_id,
                targets: wr
                    .sges
                    .iter()
                    .map(|s| Target {
                        mr: s.mr.inner.clone(),
                        offset: s.offset,
                        len: s.len,
                    })
                    .collect(),
            }
        }));
        let loop_waits = std::mem::take(&mut recvs.loop_waits);
        drop(recvs);
        sh.recv_ready.notify_all();
        if loop_waits {
            sh.wake_loop();
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.shared.enter_error();
        self.shared.close();
        let me = std::thread::current().id();
        // An inline consumer on the engine thread may hold the last reference to the session
        // that owns this QP. Then neither thread is joined: the writer ends once the engine
        // (which holds its channel) has, and the engine ends by itself, the socket being shut.
        if self.threads.iter().any(|t| t.thread().id() == me) {
            self.threads.clear();
            return;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
