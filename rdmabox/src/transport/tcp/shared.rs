//! What a tcp queue pair's handle, its engine threads or its responder loop share: the socket
//! and its transmit state, requests outstanding, receives posted, the completion queues.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::cq::Cq;
use super::io::{iovec, keep_unsent, send_now, writev_all};
use super::seal::Sealer;
use super::{PdShared, WireKeys};
use crate::transport::memory::MrInner;
use crate::transport::types::{Completion, QpCaps, WcOpcode, WcStatus};

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

pub(super) const STATE_RTS: u8 = 0;
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
    pub(super) state: AtomicU8,
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
