//! Payloads as they arrive, and the requester's and receiver's side of a connection a loop
//! serves: ACKs, NAKs and READ data complete our requests (`QpShared::outstanding`), and SENDs
//! consume posted receives, waiting for one up to the RNR window. Completions go to the CQ as
//! on any other thread (a sleeping poller is woken): no inline consumer runs on a loop, which
//! must not wait on what a consumer does.

use std::sync::Arc;
use std::time::Instant;

use super::{Conn, End, Held};
use crate::transport::memory::MrInner;
use crate::transport::tcp::shared::{PostedRecv, Target};
use crate::transport::tcp::wire::{Header, Kind, NakReason};
use crate::transport::types::{Completion, WcOpcode, WcStatus};

/// A payload still arriving.
pub(super) enum Landing {
    /// A WRITE's, into a region of ours: each piece only while the region is registered.
    Region {
        h: Header,
        mr: Arc<MrInner>,
        offset: usize,
        left: usize,
    },
    /// A SEND's, into the receive it took; or READ data, into our READ's buffers. These are
    /// ours, held by their regions' Arcs: no registration to check, as in the engine.
    Buffers {
        targets: Vec<Target>,
        /// The target being filled, and how far.
        next: usize,
        at: usize,
        left: usize,
        then: Landed,
    },
}

/// What a payload into our buffers completes.
pub(super) enum Landed {
    /// The receive, which then acknowledges the SEND `psn`.
    Receive { completion: Completion, psn: u32 },
    /// Our READ (its completion when signaled).
    Read {
        wr_id: u64,
        completion: Option<Completion>,
    },
}

/// A SEND, or a WRITE with immediate whose payload landed, waiting for a receive.
pub(super) struct Awaiting {
    h: Header,
    pub(super) until: Instant,
}

impl Landing {
    pub(super) fn into_region(h: Header, mr: Arc<MrInner>, offset: usize) -> Landing {
        Landing::Region {
            left: h.len as usize,
            h,
            mr,
            offset,
        }
    }

    /// Payload bytes still to come.
    pub(super) fn left(&self) -> usize {
        match self {
            Landing::Region { left, .. } | Landing::Buffers { left, .. } => *left,
        }
    }
}

impl Conn {
    /// Moves the payload under way to where it goes; false when the socket has no more for
    /// now.
    pub(super) fn land(&mut self) -> Result<bool, End> {
        let qp = self.qp.clone();
        loop {
            let registered = qp.pd.hold_registrations();
            let (dst, len) = match self.landing.as_ref().expect("a payload under way") {
                _ if self.landing.as_ref().is_some_and(|l| l.left() == 0) => break,
                Landing::Region { mr, .. } if !registered.contains(mr) => {
                    drop(registered);
                    // Deregistered under way: the rest of the payload goes nowhere.
                    let Some(Landing::Region { h, .. }) = self.landing.take() else {
                        unreachable!("matched above")
                    };
                    self.refuse(h.psn, NakReason::RemoteAccess)?;
                    return Ok(true);
                }
                // check_remote proved offset+len lies inside the region.
                Landing::Region {
                    mr, offset, left, ..
                } => (mr.ptr().wrapping_add(*offset), *left),
                Landing::Buffers {
                    targets, next, at, ..
                } => {
                    let t = &targets[*next];
                    (t.mr.ptr().wrapping_add(t.offset + at), t.len - at)
                }
            };
            let len = len.min(self.landing.as_ref().map_or(0, Landing::left));
            // SAFETY: `dst` is `len` bytes inside a region (checked by check_remote) or a
            // target (built from Sges, which lie inside their regions), whose memory the Arcs
            // keep mapped; a region a peer writes is kept registered by `registered` across the
            // call, which does not wait (the socket is non-blocking).
            let moved = unsafe { self.take_payload(dst, len)? };
            drop(registered);
            if moved == 0 {
                return Ok(false);
            }
            match self.landing.as_mut().expect("a payload under way") {
                Landing::Region { offset, left, .. } => {
                    *offset += moved;
                    *left -= moved;
                }
                Landing::Buffers {
                    targets,
                    next,
                    at,
                    left,
                    ..
                } => {
                    *at += moved;
                    *left -= moved;
                    if *at == targets[*next].len {
                        *next += 1;
                        *at = 0;
                    }
                }
            }
        }
        match self.landing.take().expect("a payload under way") {
            Landing::Region { h, .. } => self.landed_write(&h),
            Landing::Buffers { then, .. } => self.landed(then),
        }
        Ok(true)
    }

    /// A WRITE's payload is in: it is acknowledged; with immediate, once a receive takes it.
    pub(super) fn landed_write(&mut self, h: &Header) {
        if h.kind == Kind::WriteWithImm {
            self.await_recv(h);
        } else {
            self.held.push(Held::Ack(h.psn));
        }
    }

    fn landed(&mut self, then: Landed) {
        match then {
            Landed::Receive { completion, psn } => {
                self.qp.recv_cq.push(completion);
                self.held.push(Held::Ack(psn));
            }
            Landed::Read { completion, .. } => {
                if let Some(c) = completion {
                    self.qp.send_cq.push(c);
                }
            }
        }
    }

    /// The connection ends with a payload into our buffers under way: what it was for
    /// completes flushed (it was taken off its queue, so the error state would not see it).
    pub(super) fn flush_landing(&mut self) {
        let Some(Landing::Buffers { then, .. }) = self.landing.take() else {
            return;
        };
        match then {
            Landed::Receive { completion, .. } => self.qp.recv_cq.push(Completion {
                status: WcStatus::WrFlushError,
                byte_len: 0,
                imm: None,
                ..completion
            }),
            Landed::Read { wr_id, .. } => self.qp.send_cq.push(self.qp.completion(
                wr_id,
                WcStatus::WrFlushError,
                WcOpcode::Read,
            )),
        }
    }

    /// `h` needs a receive: the next posted one, or one posted within the RNR window.
    pub(super) fn await_recv(&mut self, h: &Header) {
        self.awaiting = Some(Awaiting {
            h: *h,
            until: Instant::now() + self.qp.rnr_timeout,
        });
    }

    /// Gives the awaited SEND the next posted receive. False when none is posted yet (the
    /// next post wakes the loop); a refusal once the RNR window is over.
    pub(super) fn take_awaited_recv(&mut self) -> Result<bool, End> {
        let a = self.awaiting.as_ref().expect("a SEND awaiting");
        let recv = {
            let mut recvs = self.qp.recvs.lock().unwrap();
            let r = recvs.queue.pop_front();
            recvs.loop_waits = r.is_none();
            r
        };
        let Some(recv) = recv else {
            if Instant::now() < a.until && !self.qp.is_error() {
                return Ok(false);
            }
            let psn = a.h.psn;
            self.awaiting = None;
            self.refuse(psn, NakReason::ReceiverNotReady)?;
            return Ok(true);
        };
        let h = self.awaiting.take().expect("a SEND awaiting").h;
        if h.kind == Kind::WriteWithImm {
            self.qp.recv_cq.push(Completion {
                byte_len: h.len,
                imm: Some(h.imm),
                ..self
                    .qp
                    .completion(recv.wr_id, WcStatus::Success, WcOpcode::RecvWithImm)
            });
            self.held.push(Held::Ack(h.psn));
            return Ok(true);
        }
        self.receive(&h, recv)?;
        Ok(true)
    }

    /// A SEND's payload goes into `recv`, if it fits.
    fn receive(&mut self, h: &Header, recv: PostedRecv) -> Result<(), End> {
        let len = h.len as usize;
        if recv.capacity() < len {
            self.qp.recv_cq.push(self.qp.completion(
                recv.wr_id,
                WcStatus::LocalLengthError,
                WcOpcode::Recv,
            ));
            return self.refuse(h.psn, NakReason::RemoteOperation);
        }
        let opcode = if h.kind == Kind::SendWithImm {
            WcOpcode::RecvWithImm
        } else {
            WcOpcode::Recv
        };
        let completion = Completion {
            byte_len: h.len,
            imm: (h.kind == Kind::SendWithImm).then_some(h.imm),
            ..self.qp.completion(recv.wr_id, WcStatus::Success, opcode)
        };
        self.land_in_buffers(
            recv.targets,
            len,
            Landed::Receive {
                completion,
                psn: h.psn,
            },
        );
        Ok(())
    }

    fn land_in_buffers(&mut self, targets: Vec<Target>, len: usize, then: Landed) {
        // Empty targets hold nothing: skip them, so `next` always names one with room.
        let targets: Vec<Target> = targets.into_iter().filter(|t| t.len > 0).collect();
        self.landing = Some(Landing::Buffers {
            targets,
            next: 0,
            at: 0,
            left: len,
            then,
        });
    }

    /// An ACK, NAK or READ response to our requests.
    pub(super) fn on_response(&mut self, h: &Header) -> Result<(), End> {
        let keep_last = h.kind != Kind::Ack;
        let (done, last) = match self.qp.complete_through(h.psn, keep_last) {
            Ok(r) => r,
            Err(None) => return Err(End::Disconnected),
            Err(Some(why)) => return Err(End::Violation(why)),
        };
        self.qp.send_cq.push_all(done);
        let Some(o) = last else {
            return Ok(());
        };
        if h.kind == Kind::Nak {
            let status = NakReason::from_u32(h.imm)
                .expect("validated by decode")
                .status();
            // Errors complete even unsignaled requests; the queue pair is done.
            self.qp
                .send_cq
                .push(self.qp.completion(o.wr_id, status, o.opcode));
            return Err(End::Disconnected);
        }
        if let Some(why) = self.qp.mismatched_read(&o, h) {
            return Err(End::Violation(why));
        }
        let completion = o.signaled.then(|| Completion {
            byte_len: o.byte_len,
            ..self
                .qp
                .completion(o.wr_id, WcStatus::Success, WcOpcode::Read)
        });
        self.land_in_buffers(
            o.read_targets,
            h.len as usize,
            Landed::Read {
                wr_id: o.wr_id,
                completion,
            },
        );
        Ok(())
    }
}
