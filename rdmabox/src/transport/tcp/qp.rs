//! tcp queue pairs: the requester side of posting, and the error state.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::route::{QpRoute, Setup};

use super::cq::Cq;
use super::io::{iovec, writev_all};
use super::io::{keep_unsent, send_now};
use super::seal::Sealer;
use super::wire::{Header, Kind, HEADER_LEN};
use super::{engine, responder, PdShared, TcpConfig, TcpEndpoint, WireKeys};
use crate::transport::memory::MrInner;
use crate::transport::types::{
    check_recv_chain, check_send_chain, Access, Completion, PostError, QpCaps, QpState, RecvWr,
    SendOp, SendWr, WcOpcode, WcStatus,
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
            recvs: Mutex::new(VecDeque::new()),
            recv_ready: Condvar::new(),
            post_calls: AtomicU64::new(0),
            wire_writes: AtomicU64::new(0),
        });
        log::debug!("tcp qp {qpn} connected to remote qp {}", remote.qpn);
        // A queue pair we never post on needs no threads of its own.
        let threads = if caps.is_responder() {
            responder::serve(shared.clone())?;
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
    let fd = s.as_raw_fd();
    let secs = dead_peer.as_secs().max(1) as libc::c_int;
    let opts: [(libc::c_int, libc::c_int, libc::c_int); 5] = [
        (
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            dead_peer.as_millis().max(1) as libc::c_int,
        ),
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, secs),
    ];
    for (level, name, value) in opts {
        // SAFETY: setsockopt on our own socket with a c_int option value.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A byte range of a local region that a READ response or an incoming SEND lands in. Holding
/// the region keeps its memory alive until the data has arrived.
pub(crate) struct Target {
    pub mr: Arc<MrInner>,
    pub offset: usize,
    pub len: usize,
}

/// A request sent and not yet answered.
pub(crate) struct Outstanding {
    pub psn: u32,
    pub wr_id: u64,
    pub opcode: WcOpcode,
    pub signaled: bool,
    pub byte_len: u32,
    /// Where READ data goes; empty for other opcodes.
    pub read_targets: Vec<Target>,
}

pub(crate) struct PostedRecv {
    pub wr_id: u64,
    pub targets: Vec<Target>,
}

impl PostedRecv {
    pub(crate) fn capacity(&self) -> usize {
        self.targets.iter().map(|t| t.len).sum()
    }
}

/// What the transmit lock protects.
pub(crate) struct TxState {
    /// PSN of the next request.
    pub psn: u32,
    /// The tail of a frame the engine began with a non-blocking send: it goes out before any
    /// other frame. Sealed bytes on an encrypted connection.
    pub pending: Vec<u8>,
    /// Seals what is sent, on an encrypted connection: in the order it goes out.
    pub sealer: Option<Sealer>,
}

const STATE_RTS: u8 = 0;
const STATE_ERROR: u8 = 1;

/// What the user's handle and the two engine threads share.
pub(crate) struct QpShared {
    pub qpn: u32,
    pub caps: QpCaps,
    pub pd: Arc<PdShared>,
    pub send_cq: Arc<Cq>,
    pub recv_cq: Arc<Cq>,
    pub rnr_timeout: Duration,
    pub stream: TcpStream,
    state: AtomicU8,
    /// The keys of an encrypted connection: readers open what they read with them.
    pub keys: Option<WireKeys>,
    /// Serializes whole frames onto the socket.
    pub tx: Mutex<TxState>,
    /// Responses handed to the writer thread and not yet on the wire: while any are, the engine
    /// must queue its own behind them to keep responses in order.
    pub responses_queued: AtomicUsize,
    pub outstanding: Mutex<VecDeque<Outstanding>>,
    pub recvs: Mutex<VecDeque<PostedRecv>>,
    pub recv_ready: Condvar,
    pub post_calls: AtomicU64,
    pub wire_writes: AtomicU64,
}

impl QpShared {
    pub(crate) fn is_error(&self) -> bool {
        self.state.load(Ordering::Acquire) == STATE_ERROR
    }

    pub(crate) fn completion(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm: None,
            qp_num: self.qpn,
        }
    }

    /// Moves the QP to the error state and flushes every outstanding request and posted
    /// receive. Closing the socket is up to the caller (a responder must first send its NAK).
    pub(crate) fn enter_error(&self) {
        self.state.store(STATE_ERROR, Ordering::Release);
        let flushed: Vec<_> = self.outstanding.lock().unwrap().drain(..).collect();
        self.send_cq.push_all(
            flushed
                .into_iter()
                .map(|o| self.completion(o.wr_id, WcStatus::WrFlushError, o.opcode)),
        );
        let recvs: Vec<_> = self.recvs.lock().unwrap().drain(..).collect();
        self.recv_ready.notify_all();
        self.recv_cq.push_all(
            recvs
                .into_iter()
                .map(|r| self.completion(r.wr_id, WcStatus::WrFlushError, WcOpcode::Recv)),
        );
    }

    pub(crate) fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Writes frames; the caller holds the transmit lock (`tx`). A frame tail left by the
    /// engine goes first.
    ///
    /// # Safety
    /// The iovecs must point at memory that stays valid during the call.
    pub(crate) unsafe fn transmit(
        &self,
        tx: &mut TxState,
        iovs: &mut [libc::iovec],
    ) -> io::Result<()> {
        if let Some(sealer) = tx.sealer.as_mut() {
            let mut wire = std::mem::take(&mut tx.pending);
            // SAFETY: forwarded from the caller.
            unsafe { sealer.seal(iovs, &mut wire) };
            let mut all = [iovec(wire.as_ptr(), wire.len())];
            // SAFETY: `wire` is alive for the call.
            let calls = unsafe { writev_all(self.stream.as_raw_fd(), &mut all)? };
            self.wire_writes.fetch_add(calls, Ordering::Relaxed);
            wire.clear();
            tx.pending = wire;
            return Ok(());
        }
        let mut calls = 0;
        if !tx.pending.is_empty() {
            let mut head = [iovec(tx.pending.as_ptr(), tx.pending.len())];
            // SAFETY: `pending` is alive for the call.
            calls += unsafe { writev_all(self.stream.as_raw_fd(), &mut head)? };
            tx.pending.clear();
        }
        // SAFETY: forwarded from the caller.
        calls += unsafe { writev_all(self.stream.as_raw_fd(), iovs)? };
        self.wire_writes.fetch_add(calls, Ordering::Relaxed);
        Ok(())
    }

    /// Sends frames without blocking, for the engine, which must never wait on the socket (it
    /// is the one reading it). Returns false, sending nothing, when the transmit lock is taken,
    /// responses are queued ahead, or the socket is full; a partly sent frame's tail is kept in
    /// `pending` and `true` is returned: the caller must then have the writer thread flush it.
    ///
    /// # Safety
    /// The iovecs must point at memory that stays valid during the call.
    pub(crate) unsafe fn try_transmit_now(&self, iovs: &[libc::iovec]) -> io::Result<Option<bool>> {
        if self.responses_queued.load(Ordering::Acquire) != 0 {
            return Ok(None);
        }
        let Ok(mut tx) = self.tx.try_lock() else {
            return Ok(None);
        };
        if !tx.pending.is_empty() {
            return Ok(None);
        }
        let TxState {
            sealer, pending, ..
        } = &mut *tx;
        if let Some(sealer) = sealer.as_mut() {
            // Sealed (into the empty tail buffer, whose room is reused), the records must go,
            // now or by the writer thread.
            // SAFETY: forwarded from the caller.
            unsafe { sealer.seal(iovs, pending) };
            let records = [iovec(pending.as_ptr(), pending.len())];
            // SAFETY: one iovec over `pending`, alive for the call.
            let sent = match unsafe { send_now(self.stream.as_raw_fd(), &records) } {
                Ok(n) => {
                    self.wire_writes.fetch_add(1, Ordering::Relaxed);
                    n
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(e) => {
                    pending.clear();
                    return Err(e);
                }
            };
            pending.drain(..sent);
            return Ok(Some(!pending.is_empty()));
        }
        // SAFETY: forwarded from the caller.
        let sent = match unsafe { send_now(self.stream.as_raw_fd(), iovs) } {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        };
        self.wire_writes.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded from the caller.
        Ok(Some(unsafe { keep_unsent(iovs, sent, &mut tx.pending) }))
    }
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
            sh.send_cq.push_all(
                chain
                    .iter()
                    .map(|wr| sh.completion(wr.wr_id, WcStatus::WrFlushError, opcode_of(&wr.op).1)),
            );
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
        if let Err(e) = sent {
            log::warn!("qp {}: send failed: {e}", sh.qpn);
            sh.enter_error();
            sh.close();
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
        if recvs.len() + chain.len() > sh.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull { posted: 0 });
        }
        recvs.extend(chain.iter().map(|wr| {
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
        drop(recvs);
        sh.recv_ready.notify_all();
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
