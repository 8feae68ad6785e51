//! What a tcp queue pair's handle, its engine threads or the loop serving it share: the socket
//! and its transmit state, requests outstanding, receives posted, the completion queues.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::cq::Cq;
use super::io::{iovec, keep_unsent, send_now, writev_all};
use super::seal::Sealer;
use super::wire::Header;
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

/// The receives posted and not yet consumed.
#[derive(Default)]
pub(crate) struct PostedRecvs {
    pub queue: VecDeque<PostedRecv>,
    /// A SEND waits in the serving loop for a receive: the next post wakes it.
    pub loop_waits: bool,
}

/// Frames the serving loop answered while someone else held the transmit lock.
#[derive(Default)]
pub(crate) struct Answered {
    pub frames: Vec<u8>,
    /// The loop stopped reading until these go: wake it when they are taken.
    pub loop_waits: bool,
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

/// What the user's handle and the engine threads, or the loop that serves it, share.
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
    pub recvs: Mutex<PostedRecvs>,
    pub recv_ready: Condvar,
    /// On a queue pair a loop serves (see `event_loop`): responses it could not send because
    /// the transmit lock was taken. Whoever holds the lock sends them before letting go.
    pub answered: Mutex<Answered>,
    /// Wakes the loop that serves this queue pair, if one does.
    pub wake_loop: OnceLock<Box<dyn Fn() + Send + Sync>>,
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
        let recvs: Vec<_> = self.recvs.lock().unwrap().queue.drain(..).collect();
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
        // What the serving loop answered meanwhile goes along, behind ours.
        let answered = self.take_answered();
        let mut joined;
        let iovs = if answered.is_empty() {
            iovs
        } else {
            joined = iovs.to_vec();
            joined.push(iovec(answered.as_ptr(), answered.len()));
            &mut joined[..]
        };
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

    /// The frames the serving loop answered and left for the transmit lock's holder, waking
    /// the loop if it stopped reading for them.
    fn take_answered(&self) -> Vec<u8> {
        // Only a loop leaves answers: an engine's queue pair takes no lock for them.
        if self.wake_loop.get().is_none() {
            return Vec::new();
        }
        let mut a = self.answered.lock().unwrap();
        let frames = std::mem::take(&mut a.frames);
        let wake = std::mem::take(&mut a.loop_waits);
        drop(a);
        if wake {
            self.wake_loop();
        }
        frames
    }

    /// Has the serving loop look at this queue pair again (a receive was posted, answers it
    /// held back went out).
    pub(crate) fn wake_loop(&self) {
        if let Some(wake) = self.wake_loop.get() {
            wake();
        }
    }

    /// After letting go of the transmit lock: sends what the loop answered while it was held
    /// (it found the lock taken and left them to us), unless another holder has it now.
    pub(crate) fn send_answered_left(&self) {
        if self.wake_loop.get().is_none() {
            return;
        }
        while !self.answered.lock().unwrap().frames.is_empty() {
            let Ok(mut tx) = self.tx.try_lock() else {
                return;
            };
            // SAFETY: no iovecs of ours; the answered frames are owned by the call.
            if let Err(e) = unsafe { self.transmit(&mut tx, &mut []) } {
                drop(tx);
                log::warn!("qp {}: send failed: {e}", self.qpn);
                self.enter_error();
                self.close();
                return;
            }
        }
    }

    /// For the serving loop, which must not wait: queues `frames` (plain) behind what waits
    /// for the socket and sends as much as it takes now, if the transmit lock is free; else
    /// leaves them to its holder (None). Some(true) when bytes are left in `pending` for the
    /// loop to send when the socket has room.
    pub(crate) fn answer_now(&self, frames: &[u8]) -> io::Result<Option<bool>> {
        self.answered
            .lock()
            .unwrap()
            .frames
            .extend_from_slice(frames);
        let Ok(mut tx) = self.tx.try_lock() else {
            return Ok(None);
        };
        let answered = self.take_answered();
        let TxState {
            sealer, pending, ..
        } = &mut *tx;
        match sealer.as_mut() {
            // SAFETY: one iovec over `answered`, alive for the call.
            Some(s) => unsafe { s.seal(&[iovec(answered.as_ptr(), answered.len())], pending) },
            None => pending.extend_from_slice(&answered),
        }
        self.send_pending_now(&mut tx).map(Some)
    }

    /// Sends what waits in `pending` as far as the socket takes it without waiting; true when
    /// some is left.
    pub(crate) fn send_pending_now(&self, tx: &mut TxState) -> io::Result<bool> {
        while !tx.pending.is_empty() {
            let all = [iovec(tx.pending.as_ptr(), tx.pending.len())];
            // SAFETY: one iovec over `pending`, alive for the call.
            match unsafe { send_now(self.stream.as_raw_fd(), &all) } {
                Ok(n) => {
                    self.wire_writes.fetch_add(1, Ordering::Relaxed);
                    tx.pending.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// Completes our requests up to and including `psn`, which a response acknowledged: the
    /// completions of the signaled ones, and the entry for `psn` itself (not completed) when
    /// `keep_last` is set. Err(None) when our side went to the error state meanwhile (the
    /// response was on its way: no fault of the peer's), Err(Some(why)) for a response that
    /// breaks the protocol.
    pub(crate) fn complete_through(
        &self,
        psn: u32,
        keep_last: bool,
    ) -> Result<(Vec<Completion>, Option<Outstanding>), Option<String>> {
        let mut out = self.outstanding.lock().unwrap();
        if !out.iter().any(|o| o.psn == psn) {
            if self.is_error() {
                return Err(None);
            }
            return Err(Some(format!("response for unknown psn {psn}")));
        }
        let mut done = Vec::new();
        let mut last = None;
        while let Some(o) = out.pop_front() {
            let is_last = o.psn == psn;
            if is_last && keep_last {
                last = Some(o);
                break;
            }
            if o.opcode == WcOpcode::Read && !is_last {
                return Err(Some(format!("acknowledgement {psn} skips READ {}", o.psn)));
            }
            if o.signaled {
                done.push(Completion {
                    byte_len: o.byte_len,
                    ..self.completion(o.wr_id, WcStatus::Success, o.opcode)
                });
            }
            if is_last {
                break;
            }
        }
        Ok((done, last))
    }

    /// Whether READ data `h` answers its request `o` (a READ of that length); if not, `o`
    /// completes with a bad response and the reason is returned: nothing of it lands anywhere.
    pub(crate) fn mismatched_read(&self, o: &Outstanding, h: &Header) -> Option<String> {
        if o.opcode == WcOpcode::Read && o.byte_len == h.len {
            return None;
        }
        self.send_cq
            .push(self.completion(o.wr_id, WcStatus::BadResponse, o.opcode));
        Some(format!(
            "READ response {} of {} bytes does not match the request",
            h.psn, h.len
        ))
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
