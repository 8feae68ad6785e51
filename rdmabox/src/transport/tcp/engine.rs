//! The responder "NIC engine" of a tcp queue pair, and the requester's response handling.
//!
//! Two threads per QP. The reader executes incoming requests against registered memory (WRITE
//! payloads land straight in the region, SEND payloads in the posted RECV's buffers) and
//! completes our own requests when their ACK, NAK or READ response arrives. It never writes to
//! the socket, so two peers that both wait on a full socket can never deadlock: responses go to
//! the writer thread, which sends them in order, coalescing consecutive ACKs into one.
//!
//! Responses to requests that arrived together go out together: while the next frame read off
//! the socket is already buffered and quick to serve (a READ request or an ACK: no payload to
//! wait for), the engine holds its responses and sends them in one write after the last.
//!
//! READ data goes onto the socket straight from the region, while the engine holds off its
//! deregistration; only what the socket cannot take at once is copied out, for the writer. So
//! a held READ is read when its response goes, after the completions of our own requests run
//! meanwhile on this thread (as a NIC may read a region any time before it responds); never
//! after a WRITE, SEND or NAK that arrived behind it, which are not quick.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::io::{iovec, FrameReader};
use super::shared::{PostedRecv, QpShared, Target};
use super::wire::{Header, Kind, NakReason, HEADER_LEN};
use crate::transport::memory::MrInner;
use crate::transport::region::Access;
use crate::transport::types::{Completion, WcOpcode, WcStatus};

/// Responses queued for the writer. More than a requester may have outstanding (its send
/// queue), so an honest peer never fills it.
const RESPONSE_QUEUE: usize = 8192;

/// At most this many responses, and this many bytes of READ data, are held back to go out
/// together: the first of them should not wait for many large copies.
const MAX_HELD: usize = 64;
const MAX_HELD_BYTES: usize = 256 << 10;

enum Response {
    Ack(u32),
    /// Send the frame tail the engine left in `TxState::pending`.
    Flush,
    /// A READ's bytes, copied out of the region while it was registered.
    ReadData {
        psn: u32,
        data: Vec<u8>,
    },
    /// A READ to be answered from the region itself. Only the engine holds these, and reads
    /// the region only while it holds its registration ([`Engine::send_held`]); the writer
    /// thread gets a copy ([`Engine::enqueue`]).
    ReadInRegion {
        psn: u32,
        mr: Arc<MrInner>,
        offset: usize,
        len: usize,
    },
    Nak(u32, NakReason),
}

pub(super) fn spawn(shared: Arc<QpShared>) -> Vec<JoinHandle<()>> {
    let (tx, rx) = crossbeam_channel::bounded(RESPONSE_QUEUE);
    let reader = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name(format!("tcp-qp{}-engine", shared.qpn))
            .spawn(move || Engine::new(shared, tx).run())
            .expect("spawn engine thread")
    };
    let writer = std::thread::Builder::new()
        .name(format!("tcp-qp{}-resp", shared.qpn))
        .spawn(move || respond(shared, rx))
        .expect("spawn response thread");
    vec![reader, writer]
}

/// How the reader loop ended.
enum Stop {
    /// The connection closed or broke.
    Disconnected,
    /// The peer broke the protocol: closed without a word.
    Violation(String),
    /// We refused a request: NAK sent, wait for the peer to close.
    Refused,
    /// Our request was refused by the peer (NAK received).
    PeerRefused,
}

struct Engine {
    qp: Arc<QpShared>,
    responses: Sender<Response>,
    reader: FrameReader,
    /// Responses held back while more requests wait in the buffer, oldest first.
    held: Vec<Response>,
}

impl Engine {
    fn new(qp: Arc<QpShared>, responses: Sender<Response>) -> Engine {
        let reader = FrameReader::new(
            std::os::fd::AsRawFd::as_raw_fd(&qp.stream),
            qp.keys.as_ref(),
        );
        Engine {
            qp,
            responses,
            reader,
            held: Vec::new(),
        }
    }

    fn run(mut self) {
        let stop = self.serve();
        let qpn = self.qp.qpn;
        match &stop {
            Stop::Disconnected | Stop::PeerRefused => {}
            Stop::Violation(why) => log::warn!("qp {qpn}: peer broke the protocol: {why}"),
            Stop::Refused => {
                log::debug!("qp {qpn}: refused a request, waiting for the peer to close")
            }
        }
        self.qp.enter_error();
        if let Stop::Refused = stop {
            // The writer still has to send the NAK; it shuts the socket down after it. Drain
            // whatever the requester had in flight until it closes, touching no memory.
            drop(self.responses);
            while self.reader.discard(64 * 1024).is_ok() {}
        }
        self.qp.close();
    }

    /// Queues a response for the writer thread; a READ still in its region is copied out
    /// first, or refused if the region was deregistered since its request arrived.
    fn enqueue(&self, r: Response) -> Result<(), Stop> {
        let r = match r {
            Response::ReadInRegion {
                psn,
                mr,
                offset,
                len,
            } => match copy_out(&self.qp, &mr, offset, len) {
                Some(data) => Response::ReadData { psn, data },
                None => {
                    self.enqueue(Response::Nak(psn, NakReason::RemoteAccess))?;
                    return Err(Stop::Refused);
                }
            },
            r => r,
        };
        self.qp.responses_queued.fetch_add(1, Ordering::AcqRel);
        self.responses.send(r).map_err(|_| Stop::Disconnected)
    }

    /// Answers a request: held back for [`Self::send_held_unless_more_come`] (after this
    /// step), which sends the held responses together. A NAK goes after every response held.
    fn respond(&mut self, r: Response) -> Result<(), Stop> {
        if matches!(r, Response::Flush | Response::Nak(..)) {
            self.hand_held_to_writer()?;
            return self.enqueue(r);
        }
        self.held.push(r);
        Ok(())
    }

    /// Sends the held responses, unless the next frame is already here and quick to serve
    /// and they are few: then they go with its response. Run after every step, so nothing
    /// stays held while the engine waits on the socket or on anything else.
    fn send_held_unless_more_come(&mut self) -> Result<(), Stop> {
        if self.held.is_empty() {
            return Ok(());
        }
        let held_bytes: usize = self.held.iter().map(read_data_len).sum();
        let few = self.held.len() < MAX_HELD && held_bytes < MAX_HELD_BYTES;
        if few && self.next_frame_is_quick() {
            return Ok(());
        }
        self.send_held()
    }

    /// Whether the next frame is buffered whole and needs no payload: serving it cannot wait
    /// on the socket or a posted RECV, so responses held for it go out moments later.
    fn next_frame_is_quick(&self) -> bool {
        let Some(raw) = self.reader.buffered().first_chunk::<HEADER_LEN>() else {
            return false;
        };
        Header::decode(raw).is_ok_and(|h| matches!(h.kind, Kind::ReadRequest | Kind::Ack))
    }

    /// Sends the held responses in one write, or hands them to the writer thread when the
    /// socket is not ours now; runs of ACKs collapse into their last.
    fn send_held(&mut self) -> Result<(), Stop> {
        let registered = self.qp.pd.hold_registrations();
        let gone = self.held.iter().any(|r| match r {
            Response::ReadInRegion { mr, .. } => !registered.contains(mr),
            _ => false,
        });
        if gone {
            // The writer's path copies what it can and refuses the READ that lost its region.
            drop(registered);
            return self.hand_held_to_writer();
        }
        let frames = frames(&self.held);
        let iovs = frame_iovecs(&frames);
        // SAFETY: the headers live in `frames`, READ data in the held responses' buffers or in
        // regions that `registered` keeps registered (so mapped), all until after the call;
        // the socket takes what it sends during the call and try_transmit_now copies the rest.
        let sent = unsafe { self.qp.try_transmit_now(&iovs) };
        drop(frames);
        drop(registered);
        match sent {
            Ok(Some(partial)) => {
                self.held.clear();
                if partial {
                    return self.enqueue(Response::Flush);
                }
                Ok(())
            }
            Ok(None) => self.hand_held_to_writer(),
            Err(_) => Err(Stop::Disconnected),
        }
    }

    /// Queues the held responses for the writer thread, in order.
    fn hand_held_to_writer(&mut self) -> Result<(), Stop> {
        for r in std::mem::take(&mut self.held) {
            self.enqueue(r)?;
        }
        Ok(())
    }

    fn refuse(&mut self, psn: u32, why: NakReason) -> Stop {
        let _ = self.respond(Response::Nak(psn, why));
        Stop::Refused
    }

    fn serve(&mut self) -> Stop {
        loop {
            let raw = match self.reader.read_header::<HEADER_LEN>() {
                Ok(Some(raw)) => raw,
                Ok(None) | Err(_) => return Stop::Disconnected,
            };
            let h = match Header::decode(&raw) {
                Ok(h) => h,
                Err(why) => return Stop::Violation(why),
            };
            let step = match h.kind {
                Kind::Write | Kind::WriteWithImm => self.on_write(&h),
                Kind::ReadRequest => self.on_read_request(&h),
                Kind::Send | Kind::SendWithImm => self.on_send(&h),
                Kind::Ack => self.on_ack(h.psn),
                Kind::Nak => self.on_nak(&h),
                Kind::ReadResponse => self.on_read_response(&h),
            };
            let step = step.and_then(|()| self.send_held_unless_more_come());
            // Also after a failed step: what was completed before the failure is answered.
            self.qp.send_cq.run_inline();
            self.qp.recv_cq.run_inline();
            if let Err(stop) = step {
                return stop;
            }
        }
    }

    fn on_write(&mut self, h: &Header) -> Result<(), Stop> {
        let Some(target) = check_remote(&self.qp, h, Access::REMOTE_WRITE) else {
            return Err(self.refuse(h.psn, NakReason::RemoteAccess));
        };
        if let Some((mr, offset)) = target {
            // The payload goes straight into the region, as it arrives, each piece while the
            // region is registered; the registration is never held while waiting for the
            // socket. So a peer that drips a payload cannot have it land after the region was
            // deregistered (and its memory given to someone else).
            let len = h.len as usize;
            let mut done = 0;
            while done < len {
                let registered = self.qp.pd.hold_registrations();
                if !registered.contains(&mr) {
                    drop(registered);
                    // Deregistered under way: the rest of the payload goes nowhere.
                    return Err(self.refuse(h.psn, NakReason::RemoteAccess));
                }
                // SAFETY: check_remote proved offset+len lies inside `mr`, whose memory this
                // Arc keeps mapped, and `registered` keeps it registered during the call,
                // which does not wait.
                let moved = unsafe {
                    self.reader
                        .read_now_into(mr.ptr().add(offset + done), len - done)
                };
                drop(registered);
                match on_io(moved)? {
                    0 => on_io(self.reader.wait_readable())?,
                    n => done += n,
                }
            }
        }
        if h.kind == Kind::WriteWithImm {
            let Some(recv) = self.wait_for_recv() else {
                return Err(self.refuse(h.psn, NakReason::ReceiverNotReady));
            };
            self.qp.recv_cq.push_deferred([Completion {
                byte_len: h.len,
                imm: Some(h.imm),
                ..self
                    .qp
                    .completion(recv.wr_id, WcStatus::Success, WcOpcode::RecvWithImm)
            }]);
        }
        self.respond(Response::Ack(h.psn))
    }

    fn on_read_request(&mut self, h: &Header) -> Result<(), Stop> {
        let Some(target) = check_remote(&self.qp, h, Access::REMOTE_READ) else {
            return Err(self.refuse(h.psn, NakReason::RemoteAccess));
        };
        // Read when sent (check_remote proved offset+len lies inside `mr`).
        self.respond(match target {
            None => Response::ReadData {
                psn: h.psn,
                data: Vec::new(),
            },
            Some((mr, offset)) => Response::ReadInRegion {
                psn: h.psn,
                mr,
                offset,
                len: h.len as usize,
            },
        })
    }

    /// The next posted RECV, waiting up to the RNR window for one.
    fn wait_for_recv(&self) -> Option<PostedRecv> {
        let deadline = Instant::now() + self.qp.rnr_timeout;
        let mut recvs = self.qp.recvs.lock().unwrap();
        loop {
            if let Some(r) = recvs.queue.pop_front() {
                return Some(r);
            }
            if self.qp.is_error() {
                return None;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            recvs = self.qp.recv_ready.wait_timeout(recvs, left).unwrap().0;
        }
    }

    fn on_send(&mut self, h: &Header) -> Result<(), Stop> {
        let Some(recv) = self.wait_for_recv() else {
            return Err(self.refuse(h.psn, NakReason::ReceiverNotReady));
        };
        let len = h.len as usize;
        if recv.capacity() < len {
            self.qp.recv_cq.push(self.qp.completion(
                recv.wr_id,
                WcStatus::LocalLengthError,
                WcOpcode::Recv,
            ));
            return Err(self.refuse(h.psn, NakReason::RemoteOperation));
        }
        if let Err(stop) = on_io(scatter(&mut self.reader, &recv.targets, len)) {
            // The RECV was taken off the queue: it must still complete.
            let flushed = self
                .qp
                .completion(recv.wr_id, WcStatus::WrFlushError, WcOpcode::Recv);
            self.qp.recv_cq.push(flushed);
            return Err(stop);
        }
        let opcode = if h.kind == Kind::SendWithImm {
            WcOpcode::RecvWithImm
        } else {
            WcOpcode::Recv
        };
        self.qp.recv_cq.push_deferred([Completion {
            byte_len: h.len,
            imm: (h.kind == Kind::SendWithImm).then_some(h.imm),
            ..self.qp.completion(recv.wr_id, WcStatus::Success, opcode)
        }]);
        self.respond(Response::Ack(h.psn))
    }

    /// Completes our requests up to and including `psn` (see [`QpShared::complete_through`]).
    fn complete_through(
        &self,
        psn: u32,
        keep_last: bool,
    ) -> Result<Option<super::shared::Outstanding>, Stop> {
        match self.qp.complete_through(psn, keep_last) {
            Ok((done, last)) => {
                self.qp.send_cq.push_deferred(done);
                Ok(last)
            }
            Err(None) => Err(Stop::Disconnected),
            Err(Some(why)) => Err(Stop::Violation(why)),
        }
    }

    fn on_ack(&mut self, psn: u32) -> Result<(), Stop> {
        self.complete_through(psn, false).map(|_| ())
    }

    fn on_nak(&mut self, h: &Header) -> Result<(), Stop> {
        let o = self.complete_through(h.psn, true)?.expect("kept");
        let status = NakReason::from_u32(h.imm)
            .expect("validated by decode")
            .status();
        // Errors complete even unsignaled requests.
        self.qp
            .send_cq
            .push(self.qp.completion(o.wr_id, status, o.opcode));
        Err(Stop::PeerRefused)
    }

    fn on_read_response(&mut self, h: &Header) -> Result<(), Stop> {
        let o = self.complete_through(h.psn, true)?.expect("kept");
        if let Some(why) = self.qp.mismatched_read(&o, h) {
            return Err(Stop::Violation(why));
        }
        if let Err(stop) = on_io(scatter(&mut self.reader, &o.read_targets, h.len as usize)) {
            // Already taken off the outstanding queue, so the flush would not see it.
            let flushed = self
                .qp
                .completion(o.wr_id, WcStatus::WrFlushError, o.opcode);
            self.qp.send_cq.push(flushed);
            return Err(stop);
        }
        if o.signaled {
            self.qp.send_cq.push_deferred([Completion {
                byte_len: o.byte_len,
                ..self
                    .qp
                    .completion(o.wr_id, WcStatus::Success, WcOpcode::Read)
            }]);
        }
        Ok(())
    }
}

/// The header of a response's frame; a Flush has none (it sends what is pending).
fn frame_header(r: &Response) -> Option<Header> {
    match r {
        Response::Ack(psn) => Some(Header::new(Kind::Ack, *psn)),
        Response::ReadData { psn, .. } | Response::ReadInRegion { psn, .. } => {
            let mut h = Header::new(Kind::ReadResponse, *psn);
            h.len = read_data_len(r) as u32;
            Some(h)
        }
        Response::Nak(psn, why) => {
            let mut h = Header::new(Kind::Nak, *psn);
            h.imm = *why as u32;
            Some(h)
        }
        Response::Flush => None,
    }
}

/// The bytes of READ data a response carries.
fn read_data_len(r: &Response) -> usize {
    match r {
        Response::ReadData { data, .. } => data.len(),
        Response::ReadInRegion { len, .. } => *len,
        _ => 0,
    }
}

/// The responses of `batch` that go on the wire, with their headers: runs of ACKs collapse
/// into their last (an ACK acknowledges every request before it), a Flush sends nothing.
fn frames(batch: &[Response]) -> Vec<(&Response, [u8; HEADER_LEN])> {
    batch
        .iter()
        .enumerate()
        .filter(|&(i, r)| {
            !(matches!(r, Response::Ack(_)) && matches!(batch.get(i + 1), Some(Response::Ack(_))))
        })
        .filter_map(|(_, r)| Some((r, frame_header(r)?.encode())))
        .collect()
}

/// The iovecs that send `frames`: each header, then its READ data (in a region for a READ
/// still there: only the engine, holding the region's registration, may send those).
fn frame_iovecs(frames: &[(&Response, [u8; HEADER_LEN])]) -> Vec<libc::iovec> {
    let mut iovs = Vec::with_capacity(frames.len() * 2);
    for (r, h) in frames {
        iovs.push(iovec(h.as_ptr(), HEADER_LEN));
        match r {
            Response::ReadData { data, .. } if !data.is_empty() => {
                iovs.push(iovec(data.as_ptr(), data.len()))
            }
            Response::ReadInRegion {
                mr, offset, len, ..
            } => iovs.push(iovec(mr.ptr().wrapping_add(*offset), *len)),
            _ => {}
        }
    }
    iovs
}

/// The region and offset that an incoming one-sided access may touch, checked like a NIC
/// checks its MR table: the rkey names a live region of this PD with the right access, and
/// the whole range lies inside it. Zero-length accesses check nothing, as in RC.
pub(super) fn check_remote(
    qp: &QpShared,
    h: &Header,
    need: Access,
) -> Option<Option<(Arc<MrInner>, usize)>> {
    if h.len == 0 {
        return Some(None);
    }
    let mr = qp.pd.lookup(h.rkey)?;
    if !mr.access.contains(need) {
        return None;
    }
    let offset = h.remote_addr.checked_sub(mr.addr)?;
    let end = offset.checked_add(h.len as u64)?;
    (end <= mr.len as u64).then_some(Some((mr, offset as usize)))
}

/// A copy of `len` bytes at `offset` of `mr`, taken while it is registered; None if it is
/// not (any more).
fn copy_out(qp: &QpShared, mr: &Arc<MrInner>, offset: usize, len: usize) -> Option<Vec<u8>> {
    qp.pd.while_registered(mr, || {
        let mut data = Vec::with_capacity(len);
        // SAFETY: the READ's request was checked to lie inside `mr` (check_remote), whose
        // memory this Arc keeps mapped; `data` has room for len bytes, all written before the
        // length is set.
        unsafe {
            std::ptr::copy_nonoverlapping(mr.ptr().add(offset), data.as_mut_ptr(), len);
            data.set_len(len);
        }
        data
    })
}

/// A socket error while moving payload ends the connection.
fn on_io<T>(r: io::Result<T>) -> Result<T, Stop> {
    r.map_err(|_| Stop::Disconnected)
}

/// Reads `len` payload bytes into the targets in order.
fn scatter(reader: &mut FrameReader, targets: &[Target], mut len: usize) -> io::Result<()> {
    for t in targets {
        if len == 0 {
            break;
        }
        let n = t.len.min(len);
        // SAFETY: Target ranges were built from Sges, which lie inside their regions; the Arc
        // keeps the region's memory alive.
        unsafe { reader.read_into(t.mr.ptr().add(t.offset), n)? };
        len -= n;
    }
    debug_assert_eq!(len, 0, "callers check capacity");
    Ok(())
}

/// The writer thread: sends queued responses in order, batching what is queued into one
/// `writev` and collapsing runs of ACKs into the last one.
fn respond(qp: Arc<QpShared>, rx: Receiver<Response>) {
    let mut batch: Vec<Response> = Vec::new();
    while let Ok(first) = rx.recv() {
        batch.clear();
        batch.push(first);
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let nak = batch.iter().any(|r| matches!(r, Response::Nak(..)));
        let frames = frames(&batch);
        let mut iovs = frame_iovecs(&frames);
        let sent = {
            let mut tx = qp.tx.lock().unwrap();
            // SAFETY: headers are alive in `frames`, READ data in the buffers of `batch`,
            // both until after this call.
            unsafe { qp.transmit(&mut tx, &mut iovs) }
        };
        drop(frames);
        qp.responses_queued.fetch_sub(batch.len(), Ordering::AcqRel);
        if sent.is_err() || nak {
            // After a NAK the connection is done: let the peer read it, then see the end.
            let _ = qp.stream.shutdown(std::net::Shutdown::Write);
            if sent.is_err() {
                qp.close();
            }
            return;
        }
    }
}
