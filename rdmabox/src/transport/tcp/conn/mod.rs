//! One connection as an event loop serves it (see `event_loop`), a turn at a time, never
//! waiting, with the semantics of a queue pair's engine (`engine.rs`):
//! - a WRITE's payload lands in the region as it arrives, each piece while the region is
//!   registered (a peer that drips a payload past a deregistration lands nothing after it);
//! - a READ is answered from the region while it is registered;
//! - responses go in request order; responses to requests that arrived together go out in one
//!   write, and a run of ACKs as its last; READs held for that are answered before any WRITE
//!   behind them lands;
//! - a refused request is answered with a NAK, after which nothing more is taken from the
//!   connection;
//! - on a queue pair that posts (`requester.rs`): a SEND consumes a posted receive, waiting for
//!   one up to the RNR window without holding up the loop; ACKs, NAKs and READ data complete
//!   our own requests. On a passive one (no send or receive queue) a SEND or a WRITE with
//!   immediate is refused as a NIC refuses it once its RNR retries run out, and a response (we
//!   sent no request) is a protocol violation: the connection is closed without a word.
//!
//! How responses go out, on a connection of its own or beside the queue pair's posters, is in
//! `output.rs`. A peer that does not read its responses stops being read once
//! [`MAX_BACKLOG`] bytes of them wait: it holds at most that, and one batch of responses more
//! (256 KiB and one READ, which may be as long as what it was granted), of our memory. And each
//! connection is served a turn at a time (64 frames, 1 MiB of payload), so that one that keeps
//! its socket full cannot keep the others of its loop waiting.

mod output;
mod requester;

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use super::engine::check_remote;
use super::seal::Opener;
use super::shared::QpShared;
use super::wire::{Header, Kind, NakReason, HEADER_LEN};
use crate::transport::memory::MrInner;
use crate::transport::region::Access;
use output::Output;
use requester::{Awaiting, Landing};

/// At most this many responses, and this many bytes of READ data, are held back to go out
/// together (as the engine holds them).
const MAX_HELD: usize = 64;
const MAX_HELD_BYTES: usize = 256 << 10;
/// Responses waiting for a peer's socket past which its requests are not read.
pub(super) const MAX_BACKLOG: usize = 4 << 20;
/// The bytes read off a socket at a time.
const INPUT_BUFFER: usize = 16 << 10;

/// Frames, and bytes of payload, one connection is served in a turn: a peer that keeps its
/// socket full cannot keep its loop's other connections waiting.
const TURN_FRAMES: usize = 64;
const TURN_BYTES: usize = 1 << 20;

/// How a connection's turn ended.
pub(super) enum Turn {
    /// It waits for its socket, or to be woken.
    Waiting,
    /// It used up its turn with frames left: others go first, then it again.
    More,
    /// It waits to be woken, or until then at the latest.
    Until(Instant),
    /// It is over.
    Done,
}

/// Why serving a connection stopped.
enum End {
    /// It closed or broke, or the peer refused one of our requests.
    Disconnected,
    /// The peer broke the protocol: closed without a word.
    Violation(String),
}

/// A response waiting to go out with the others of its burst.
enum Held {
    Ack(u32),
    /// A READ, answered from the region when it goes (zero-length: no region).
    Read {
        psn: u32,
        region: Option<(Arc<MrInner>, usize)>,
        len: usize,
    },
}

pub(super) struct Conn {
    pub(super) qp: Arc<QpShared>,
    /// The interest its loop has registered for it.
    pub(super) registered: u32,
    /// On an encrypted connection, what the socket's bytes are opened with.
    opener: Option<Opener>,
    out: Output,
    input: Box<[u8]>,
    start: usize,
    end: usize,
    landing: Option<Landing>,
    awaiting: Option<Awaiting>,
    held: Vec<Held>,
    held_bytes: usize,
    /// A request was refused: its NAK is (or was) the last frame; input is discarded.
    refused: bool,
    /// The write side is shut after the NAK went out.
    shut: bool,
}

impl Conn {
    pub(super) fn new(qp: Arc<QpShared>) -> Conn {
        Conn {
            registered: 0,
            opener: qp.keys.as_ref().map(Opener::new),
            out: Output::new(&qp),
            qp,
            input: vec![0u8; INPUT_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
            landing: None,
            awaiting: None,
            held: Vec::new(),
            held_bytes: 0,
            refused: false,
            shut: false,
        }
    }

    /// What to wait for: input unless its responses are backed up or a SEND waits for a
    /// receive, the socket's room while responses wait for it.
    pub(super) fn interest(&self) -> u32 {
        let mut e = 0;
        if self.awaiting.is_none() && !self.backed_up() {
            e |= libc::EPOLLIN as u32;
        }
        if self.wants_out() {
            e |= libc::EPOLLOUT as u32;
        }
        e
    }

    /// Serves what `ready` says is ready, for one turn.
    pub(super) fn serve(&mut self, ready: u32) -> Turn {
        let result = self.flush_out().and_then(|()| {
            if ready & libc::EPOLLERR as u32 != 0 {
                return Err(End::Disconnected);
            }
            // Closed by both ends: what was received before is still served (its end of
            // stream follows), unless input is not being read now (the hangup would be
            // reported again and again meanwhile).
            let hangup = ready & libc::EPOLLHUP as u32 != 0;
            if hangup && (self.awaiting.is_some() || self.backed_up()) {
                return Err(End::Disconnected);
            }
            self.read_frames()
        });
        match result {
            Ok(turn) => turn,
            Err(End::Disconnected) => Turn::Done,
            Err(End::Violation(why)) => {
                log::warn!("qp {}: peer broke the protocol: {why}", self.qp.qpn);
                Turn::Done
            }
        }
    }

    /// The connection is over: everything outstanding is flushed, a receive or READ whose
    /// data was still arriving included.
    pub(super) fn finish(&mut self) {
        self.flush_landing();
        self.qp.enter_error();
        self.qp.close();
    }

    /// Serves frames until the socket has no more for now, or the turn is used up, then
    /// sends the responses held.
    fn read_frames(&mut self) -> Result<Turn, End> {
        let mut frames = 0;
        let mut landed = 0;
        loop {
            if self.backed_up() {
                return self.flush_held().map(|()| Turn::Waiting);
            }
            if self.refused {
                return self.discard();
            }
            if frames >= TURN_FRAMES || landed >= TURN_BYTES {
                return self.flush_held().map(|()| Turn::More);
            }
            if let Some(a) = &self.awaiting {
                let until = a.until;
                if !self.take_awaited_recv()? {
                    return self.flush_held().map(|()| Turn::Until(until));
                }
                continue;
            }
            if let Some(l) = &self.landing {
                let before = l.left();
                let more = self.land()?;
                landed += before - self.landing.as_ref().map_or(0, Landing::left);
                if !more {
                    return self.flush_held().map(|()| Turn::Waiting);
                }
                continue;
            }
            if self.end - self.start < HEADER_LEN {
                if !self.fill()? {
                    return self.flush_held().map(|()| Turn::Waiting);
                }
                continue;
            }
            frames += 1;
            let raw: [u8; HEADER_LEN] = self.input[self.start..self.start + HEADER_LEN]
                .try_into()
                .expect("header length");
            self.start += HEADER_LEN;
            let h = Header::decode(&raw).map_err(End::Violation)?;
            self.on_frame(&h)?;
            if self.held.len() >= MAX_HELD || self.held_bytes >= MAX_HELD_BYTES {
                self.flush_held()?;
            }
        }
    }

    fn on_frame(&mut self, h: &Header) -> Result<(), End> {
        // Held READs are answered before anything behind them touches memory or completes
        // (a WRITE or SEND landing, READ data arriving, a NAK): only READ requests and ACKs
        // are quick to serve.
        if !matches!(h.kind, Kind::ReadRequest | Kind::Ack) {
            self.flush_held()?;
        }
        let posts = !self.qp.caps.is_responder();
        match h.kind {
            Kind::Write | Kind::WriteWithImm => self.on_write(h),
            Kind::ReadRequest => match check_remote(&self.qp, h, Access::REMOTE_READ) {
                None => self.refuse(h.psn, NakReason::RemoteAccess),
                Some(region) => {
                    self.held_bytes += h.len as usize;
                    self.held.push(Held::Read {
                        psn: h.psn,
                        region,
                        len: h.len as usize,
                    });
                    Ok(())
                }
            },
            Kind::Send | Kind::SendWithImm if posts => {
                self.await_recv(h);
                Ok(())
            }
            Kind::Send | Kind::SendWithImm => self.refuse(h.psn, NakReason::ReceiverNotReady),
            Kind::Ack | Kind::Nak | Kind::ReadResponse if posts => self.on_response(h),
            Kind::Ack | Kind::Nak | Kind::ReadResponse => Err(End::Violation(format!(
                "a {:?} on a queue pair that sent no request",
                h.kind
            ))),
        }
    }

    fn on_write(&mut self, h: &Header) -> Result<(), End> {
        if h.kind == Kind::WriteWithImm && self.qp.caps.is_responder() {
            return self.refuse(h.psn, NakReason::ReceiverNotReady);
        }
        match check_remote(&self.qp, h, Access::REMOTE_WRITE) {
            None => self.refuse(h.psn, NakReason::RemoteAccess),
            Some(None) => {
                self.landed_write(h);
                Ok(())
            }
            Some(Some((mr, offset))) => {
                self.landing = Some(Landing::into_region(*h, mr, offset));
                Ok(())
            }
        }
    }

    /// Reads more input; false when the socket has none for now.
    fn fill(&mut self) -> Result<bool, End> {
        if self.start > 0 {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = self.input.len() - self.end;
        let dst = self.input[self.end..].as_mut_ptr();
        // SAFETY: `room` bytes of our input buffer from `end` on.
        match unsafe { recv(&mut self.opener, self.qp.stream.as_raw_fd(), dst, room) } {
            Ok(0) => Err(End::Disconnected),
            Ok(n) => {
                self.end += n;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(_) => Err(End::Disconnected),
        }
    }

    /// Moves up to `len` bytes of payload to `dst`: what is buffered, else straight off the
    /// socket. Ok(0) when the socket has none for now.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes for the duration of the call.
    unsafe fn take_payload(&mut self, dst: *mut u8, len: usize) -> Result<usize, End> {
        let buffered = self.end - self.start;
        if buffered > 0 {
            let n = buffered.min(len);
            // SAFETY: `n` bytes of our buffer into the caller's `dst`, valid for `len` >= n.
            unsafe { std::ptr::copy_nonoverlapping(self.input[self.start..].as_ptr(), dst, n) };
            self.start += n;
            return Ok(n);
        }
        // SAFETY: forwarded from the caller.
        match unsafe { recv(&mut self.opener, self.qp.stream.as_raw_fd(), dst, len) } {
            Ok(0) => Err(End::Disconnected),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(_) => Err(End::Disconnected),
        }
    }

    /// After a refusal: whatever the peer had in flight is read and dropped, touching no
    /// memory, until it closes (a turn's worth at a time).
    fn discard(&mut self) -> Result<Turn, End> {
        self.start = 0;
        self.end = 0;
        let mut dropped = 0;
        while dropped < TURN_BYTES {
            let dst = self.input.as_mut_ptr();
            match recv_now(self.qp.stream.as_raw_fd(), dst, self.input.len()) {
                Ok(0) => return Err(End::Disconnected),
                Ok(n) => dropped += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Turn::Waiting),
                Err(_) => return Err(End::Disconnected),
            }
        }
        Ok(Turn::More)
    }

    /// Answers every request before `psn` and refuses `psn`: the NAK is the last frame, and
    /// the queue pair goes to the error state (as a NIC's responder does).
    fn refuse(&mut self, psn: u32, why: NakReason) -> Result<(), End> {
        self.flush_held()?;
        let mut h = Header::new(Kind::Nak, psn);
        h.imm = why as u32;
        let nak = h.encode();
        self.refused = true;
        self.flush_landing();
        self.awaiting = None;
        self.qp.enter_error();
        // SAFETY: one iovec over `nak`, alive for the call.
        unsafe { self.emit(&[super::io::iovec(nak.as_ptr(), nak.len())])? };
        self.flush_out()
    }
}

/// `recv` without waiting, through `opener` on an encrypted connection: Ok(0) at the end of
/// the stream, WouldBlock while no (whole record of) input is here.
///
/// # Safety
/// `dst` must be valid for `len` bytes of writes for the duration of the call.
unsafe fn recv(
    opener: &mut Option<Opener>,
    fd: RawFd,
    dst: *mut u8,
    len: usize,
) -> io::Result<usize> {
    match opener {
        // SAFETY: forwarded from the caller.
        Some(o) => unsafe { o.recv(fd, dst, len, libc::MSG_DONTWAIT) },
        None => recv_now(fd, dst, len),
    }
}

/// `recv` without waiting, again when interrupted; Ok(0) at the end of the stream.
fn recv_now(fd: RawFd, dst: *mut u8, len: usize) -> io::Result<usize> {
    loop {
        // SAFETY: callers pass memory valid for `len` bytes of writes.
        let n = unsafe { libc::recv(fd, dst.cast(), len, libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
