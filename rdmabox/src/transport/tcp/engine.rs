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
use super::qp::{PostedRecv, QpShared, Target};
use super::wire::{Header, Kind, NakReason, HEADER_LEN};
use crate::transport::memory::MrInner;
use crate::transport::types::{Access, Completion, WcOpcode, WcStatus};

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
        let reader = FrameReader::new(std::os::fd::AsRawFd::as_raw_fd(&qp.stream));
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
        self.qp.hold.lock().unwrap().take();
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

    /// The region and offset that an incoming one-sided access may touch, checked like a NIC
    /// checks its MR table: the rkey names a live region of this PD with the right access, and
    /// the whole range lies inside it. Zero-length accesses check nothing, as in RC.
    fn check_remote(&self, h: &Header, need: Access) -> Option<Option<(Arc<MrInner>, usize)>> {
        if h.len == 0 {
            return Some(None);
        }
        let mr = self.qp.pd.lookup(h.rkey)?;
        if !mr.access.contains(need) {
            return None;
        }
        let offset = h.remote_addr.checked_sub(mr.addr)?;
        let end = offset.checked_add(h.len as u64)?;
        (end <= mr.len as u64).then_some(Some((mr, offset as usize)))
    }

    fn on_write(&mut self, h: &Header) -> Result<(), Stop> {
        let Some(target) = self.check_remote(h, Access::REMOTE_WRITE) else {
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
        let Some(target) = self.check_remote(h, Access::REMOTE_READ) else {
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
            if let Some(r) = recvs.pop_front() {
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

    /// Completes our requests up to and including `psn`, which a response acknowledged.
    /// Returns the entry for `psn` itself (not completed) when `keep_last` is set.
    fn complete_through(
        &self,
        psn: u32,
        keep_last: bool,
    ) -> Result<Option<super::qp::Outstanding>, Stop> {
        let mut out = self.qp.outstanding.lock().unwrap();
        if !out.iter().any(|o| o.psn == psn) {
            return Err(Stop::Violation(format!("response for unknown psn {psn}")));
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
                return Err(Stop::Violation(format!(
                    "acknowledgement {psn} skips READ {}",
                    o.psn
                )));
            }
            if o.signaled {
                done.push(Completion {
                    byte_len: o.byte_len,
                    ..self.qp.completion(o.wr_id, WcStatus::Success, o.opcode)
                });
            }
            if is_last {
                break;
            }
        }
        drop(out);
        self.qp.send_cq.push_deferred(done);
        Ok(last)
    }

    fn on_ack(&mut self, psn: u32) -> Result<(), Stop> {
        self.complete_through(psn, false).map(|_| ())
    }

    fn on_nak(&mut self, h: &Header) -> Result<(), Stop> {
        let o = self.complete_through(h.psn, true)?.expect("kept");
        let status = match NakReason::from_u32(h.imm).expect("validated by decode") {
            NakReason::RemoteAccess => WcStatus::RemoteAccessError,
            NakReason::InvalidRequest => WcStatus::RemoteInvalidRequest,
            NakReason::ReceiverNotReady => WcStatus::RnrRetryExceeded,
            NakReason::RemoteOperation => WcStatus::RemoteOperationError,
        };
        // Errors complete even unsignaled requests.
        self.qp
            .send_cq
            .push(self.qp.completion(o.wr_id, status, o.opcode));
        Err(Stop::PeerRefused)
    }

    fn on_read_response(&mut self, h: &Header) -> Result<(), Stop> {
        let o = self.complete_through(h.psn, true)?.expect("kept");
        if o.opcode != WcOpcode::Read || o.byte_len != h.len {
            // Put nothing anywhere: a response that does not match its request is garbage.
            self.qp
                .send_cq
                .push(self.qp.completion(o.wr_id, WcStatus::BadResponse, o.opcode));
            return Err(Stop::Violation(format!(
                "READ response {} of {} bytes does not match the request",
                h.psn, h.len
            )));
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    use super::super::route::hello;
    use super::super::wire::{Header, Kind, NakReason, HEADER_LEN};
    use super::super::TcpEndpoint;
    use crate::transport::{
        Access, Context, Endpoint, ProviderKind, QpCaps, QpRoute, TransportConfig,
    };

    /// A peer connected to a fresh tcp queue pair over `pd`, as a raw socket that speaks the
    /// wire protocol, and the queue pair.
    fn raw_peer(
        ctx: &Context,
        pd: &crate::transport::ProtectionDomain,
    ) -> (TcpStream, crate::transport::QueuePair) {
        let cq = ctx.create_cq(16).unwrap();
        let prepared = ctx
            .create_qp(pd, &cq, &cq, QpCaps::default(), &QpRoute::OwnPort)
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
        let mut answer = [0u8; 20];
        s.read_exact(&mut answer).unwrap();
        (s, accepting.join().unwrap().unwrap())
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
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let region = pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let pattern: Vec<u8> = (0..1 << 16).map(|i| (i * 7 % 251) as u8).collect();
        region.write_at(0, &pattern).unwrap();
        let (mut s, qp) = raw_peer(&ctx, &pd);
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

    /// The hold is bounded: 200 READs that arrive together go out in batches of at most
    /// MAX_HELD responses (or MAX_HELD_BYTES of data), still in order and whole.
    #[test]
    fn held_responses_go_out_once_there_are_enough_of_them() {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let region = pd.alloc_region(1 << 20, Access::ALL).unwrap();
        let pattern: Vec<u8> = (0..1 << 20).map(|i| (i * 13 % 253) as u8).collect();
        region.write_at(0, &pattern).unwrap();
        let (mut s, qp) = raw_peer(&ctx, &pd);
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

    /// A READ request followed by an ACK (the peer acknowledging our own WRITE) in one
    /// segment: the READ's response, held while the ACK was served, goes out once nothing
    /// quick follows, not when some later request comes.
    #[test]
    fn a_response_held_for_an_ack_behind_it_is_not_kept_waiting() {
        use crate::transport::{RemoteAddr, SendOp, SendWr, Sge};
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let region = pd.alloc_region(4096, Access::ALL).unwrap();
        let (mut s, qp) = raw_peer(&ctx, &pd);
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
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pool_pd = ctx.alloc_pd().unwrap();
        let pool = pool_pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let pattern: Vec<u8> = (0..LEN).map(|i| (i % 249) as u8 + 1).collect();
        pool.write_at(0, &pattern).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let grant = pd.register_within(&pool, 0, LEN, Access::ALL).unwrap();
        let (mut s, _qp) = raw_peer(&ctx, &pd);
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
        for psn in 0..READS {
            let mut raw = [0u8; HEADER_LEN];
            s.read_exact(&mut raw).unwrap();
            let h = Header::decode(&raw).unwrap();
            if h.kind == Kind::Nak {
                assert_eq!((h.psn, h.imm), (psn, NakReason::RemoteAccess as u32));
                return;
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
        }
        panic!("no READ was refused");
    }

    /// A peer that starts a WRITE through a grant, stalls mid-payload while the grant is
    /// revoked (and the memory could go to another file), then sends the rest: what came
    /// before may have landed (a NIC writes packets as they come), nothing after it may, and
    /// the WRITE is refused.
    #[test]
    fn a_payload_dripped_past_a_deregistration_lands_nothing_after_it() {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pool_pd = ctx.alloc_pd().unwrap();
        let pool = pool_pd.alloc_region(1 << 16, Access::ALL).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let grant = pd.register_within(&pool, 0, 8192, Access::ALL).unwrap();
        let (mut s, _qp) = raw_peer(&ctx, &pd);
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
