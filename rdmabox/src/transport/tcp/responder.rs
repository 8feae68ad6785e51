//! The responder loop: passive queue pairs, on which the local side never posts (created with
//! no send and no receive queue), are served by a few threads of the process with an epoll set
//! each, instead of two threads per queue pair. A node's data sessions are such queue pairs:
//! their peers READ and WRITE the pool and the node never posts. So a thousand of them cost the
//! node a handful of threads and no more than a few buffers each.
//!
//! What a passive queue pair can be sent is served as the engine (`engine.rs`) serves it:
//! - a WRITE's payload lands in the region as it arrives, each piece while the region is
//!   registered (a peer that drips a payload past a deregistration lands nothing after it);
//! - a READ is answered from the region while it is registered: straight from it when the
//!   socket takes the response at once, else from a copy taken then;
//! - responses go in request order; responses to requests that arrived together go out in one
//!   write, and a run of ACKs as its last; READs held for that are answered before any WRITE
//!   behind them lands;
//! - a refused request is answered with a NAK, after which nothing more is taken from the
//!   connection; a SEND or a WRITE with immediate finds no receive (none is ever posted) and
//!   is refused as a NIC refuses it once its RNR retries run out; a response (we sent no
//!   request) is a protocol violation, and the connection is closed without a word.
//!
//! A peer that does not read its responses stops being read once [`MAX_BACKLOG`] bytes of them
//! wait for its socket: it holds at most that, and one batch of responses more (256 KiB and one
//! READ, which may be as long as what it was granted), of our memory. And each connection is
//! served a turn at a time (64 requests, 1 MiB of payload), so that one that keeps its socket
//! full cannot keep the others of its loop waiting.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::engine::check_remote;
use super::io::{iovec, keep_unsent, send_now};
use super::seal::{Opener, Sealer};
use super::shared::QpShared;
use super::wire::{Header, Kind, NakReason, HEADER_LEN};
use crate::epoll::{Epoll, Ready};
use crate::transport::memory::MrInner;
use crate::transport::region::Access;

/// At most this many responses, and this many bytes of READ data, are held back to go out
/// together (as the engine holds them).
const MAX_HELD: usize = 64;
const MAX_HELD_BYTES: usize = 256 << 10;
/// Responses waiting for a peer's socket past which its requests are not read.
pub(super) const MAX_BACKLOG: usize = 4 << 20;
/// The bytes read off a socket at a time.
const INPUT_BUFFER: usize = 16 << 10;

/// The process's responder loops, started with the first passive queue pair.
static LOOPS: Mutex<Vec<Arc<Loop>>> = Mutex::new(Vec::new());
static NEXT_LOOP: AtomicUsize = AtomicUsize::new(0);

/// How many loop threads serve the process's passive queue pairs.
pub fn responder_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
}

/// Hands a connected passive queue pair to a responder loop, which serves it until its
/// connection ends.
pub(super) fn serve(qp: Arc<QpShared>) -> io::Result<()> {
    let l = {
        let mut loops = LOOPS.lock().unwrap();
        while loops.len() < responder_threads() {
            let i = loops.len();
            loops.push(Loop::start(i)?);
        }
        loops[NEXT_LOOP.fetch_add(1, Ordering::Relaxed) % loops.len()].clone()
    };
    l.add(qp)
}

struct Loop {
    epoll: Epoll,
    /// Served by the loop thread alone; the map's lock is held only to look one up or add
    /// one, never while serving.
    conns: Mutex<HashMap<u64, Arc<Mutex<Conn>>>>,
    next_id: AtomicU64,
}

impl Loop {
    fn start(i: usize) -> io::Result<Arc<Loop>> {
        let l = Arc::new(Loop {
            epoll: Epoll::new()?,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        });
        let run = l.clone();
        std::thread::Builder::new()
            .name(format!("tcp-responder-{i}"))
            .spawn(move || run.run())?;
        Ok(l)
    }

    fn add(&self, qp: Arc<QpShared>) -> io::Result<()> {
        qp.stream.set_nonblocking(true)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Conn::new(qp.clone());
        let interest = conn.interest();
        self.conns
            .lock()
            .unwrap()
            .insert(id, Arc::new(Mutex::new(conn)));
        if let Err(e) = self.epoll.add(&qp.stream, id, interest) {
            if let Some(c) = self.conns.lock().unwrap().remove(&id) {
                c.lock().unwrap().finish();
            }
            return Err(e);
        }
        Ok(())
    }

    /// Serves what epoll reports, and the connections that used up their turn with work left
    /// (whose input may wait in an opener, where epoll does not see it).
    fn run(&self) {
        let mut turns: Vec<Ready> = Vec::new();
        let mut again: Vec<u64> = Vec::new();
        loop {
            let wait = if again.is_empty() { -1 } else { 0 };
            if let Err(e) = self.epoll.wait(wait, &mut turns) {
                log::error!("responder loop: epoll_wait: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            turns.extend(again.drain(..).map(|id| (id, 0)));
            for (id, ready) in turns.drain(..) {
                let Some(conn) = self.conns.lock().unwrap().get(&id).cloned() else {
                    continue;
                };
                let mut conn = conn.lock().unwrap();
                let before = conn.interest();
                match conn.serve(ready) {
                    Turn::Done => {
                        let _ = self.epoll.remove(&conn.qp.stream);
                        self.conns.lock().unwrap().remove(&id);
                        conn.finish();
                        continue;
                    }
                    Turn::More => again.push(id),
                    Turn::Waiting => {}
                }
                let after = conn.interest();
                if after != before {
                    if let Err(e) = self.epoll.modify(&conn.qp.stream, id, after) {
                        log::warn!("qp {}: epoll: {e}", conn.qp.qpn);
                    }
                }
            }
        }
    }
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

/// A WRITE whose payload is still arriving.
struct Payload {
    psn: u32,
    mr: Arc<MrInner>,
    offset: usize,
    left: usize,
}

/// How a connection's turn ended.
enum Turn {
    /// It waits for its socket.
    Waiting,
    /// It used up its turn with requests left: others go first, then it again.
    More,
    /// It is over.
    Done,
}

/// Requests, and bytes of WRITE payload, one connection is served in a turn: a peer that
/// keeps its socket full cannot keep its loop's other connections waiting.
const TURN_REQUESTS: usize = 64;
const TURN_BYTES: usize = 1 << 20;

/// Why serving a connection stopped.
enum End {
    /// It closed or broke.
    Disconnected,
    /// The peer broke the protocol: closed without a word.
    Violation(String),
}

struct Conn {
    qp: Arc<QpShared>,
    /// On an encrypted connection, what the socket's bytes are opened with, what responses
    /// are sealed with (nobody else sends here: the queue pair posts nothing), and the room
    /// they are sealed in (kept from one batch to the next).
    opener: Option<Opener>,
    sealer: Option<Sealer>,
    sealing: Vec<u8>,
    input: Box<[u8]>,
    start: usize,
    end: usize,
    payload: Option<Payload>,
    held: Vec<Held>,
    held_bytes: usize,
    /// Frames the socket did not take yet, from `out_sent` on.
    out: Vec<u8>,
    out_sent: usize,
    /// A request was refused: its NAK is (or was) the last frame; input is discarded.
    refused: bool,
    /// The write side is shut after the NAK went out.
    shut: bool,
}

impl Conn {
    fn new(qp: Arc<QpShared>) -> Conn {
        let sealer = qp.tx.lock().unwrap().sealer.take();
        Conn {
            opener: qp.keys.as_ref().map(Opener::new),
            sealer,
            sealing: Vec::new(),
            qp,
            input: vec![0u8; INPUT_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
            payload: None,
            held: Vec::new(),
            held_bytes: 0,
            out: Vec::new(),
            out_sent: 0,
            refused: false,
            shut: false,
        }
    }

    fn backlog(&self) -> usize {
        self.out.len() - self.out_sent
    }

    /// What to wait for: input unless its responses are backed up, the socket's room while
    /// any are.
    fn interest(&self) -> u32 {
        let mut e = 0;
        if self.backlog() < MAX_BACKLOG {
            e |= libc::EPOLLIN as u32;
        }
        if self.backlog() > 0 {
            e |= libc::EPOLLOUT as u32;
        }
        e
    }

    /// Serves what `ready` says is ready, for one turn.
    fn serve(&mut self, ready: u32) -> Turn {
        let result = self.flush_out().and_then(|()| {
            if ready & ((libc::EPOLLERR | libc::EPOLLHUP) as u32) != 0 {
                return Err(End::Disconnected);
            }
            self.read_requests()
        });
        match result {
            Ok(true) => Turn::More,
            Ok(false) => Turn::Waiting,
            Err(End::Disconnected) => Turn::Done,
            Err(End::Violation(why)) => {
                log::warn!("qp {}: peer broke the protocol: {why}", self.qp.qpn);
                Turn::Done
            }
        }
    }

    fn finish(&self) {
        self.qp.enter_error();
        self.qp.close();
    }

    /// Serves requests until the socket has no more for now, or the turn is used up, then
    /// sends the responses held. True when requests may be left.
    fn read_requests(&mut self) -> Result<bool, End> {
        let mut requests = 0;
        let mut landed = 0;
        loop {
            if self.backlog() >= MAX_BACKLOG {
                return self.flush_held().map(|()| false);
            }
            if self.refused {
                return self.discard();
            }
            if requests >= TURN_REQUESTS || landed >= TURN_BYTES {
                return self.flush_held().map(|()| true);
            }
            if let Some(p) = &self.payload {
                let before = p.left;
                let more = self.land_payload()?;
                landed += before - self.payload.as_ref().map_or(0, |p| p.left);
                if !more {
                    return self.flush_held().map(|()| false);
                }
                continue;
            }
            if self.end - self.start < HEADER_LEN {
                if !self.fill()? {
                    return self.flush_held().map(|()| false);
                }
                continue;
            }
            requests += 1;
            let raw: [u8; HEADER_LEN] = self.input[self.start..self.start + HEADER_LEN]
                .try_into()
                .expect("header length");
            self.start += HEADER_LEN;
            let h = Header::decode(&raw).map_err(End::Violation)?;
            self.on_request(&h)?;
            if self.held.len() >= MAX_HELD || self.held_bytes >= MAX_HELD_BYTES {
                self.flush_held()?;
            }
        }
    }

    fn on_request(&mut self, h: &Header) -> Result<(), End> {
        match h.kind {
            Kind::Write => match check_remote(&self.qp, h, Access::REMOTE_WRITE) {
                None => self.refuse(h.psn, NakReason::RemoteAccess),
                Some(None) => {
                    self.held.push(Held::Ack(h.psn));
                    Ok(())
                }
                Some(Some((mr, offset))) => {
                    // Held READs are answered before this WRITE lands anything.
                    self.flush_held()?;
                    self.payload = Some(Payload {
                        psn: h.psn,
                        mr,
                        offset,
                        left: h.len as usize,
                    });
                    Ok(())
                }
            },
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
            Kind::WriteWithImm | Kind::Send | Kind::SendWithImm => {
                self.refuse(h.psn, NakReason::ReceiverNotReady)
            }
            Kind::Ack | Kind::Nak | Kind::ReadResponse => Err(End::Violation(format!(
                "a {:?} on a queue pair that sent no request",
                h.kind
            ))),
        }
    }

    /// Moves the WRITE's payload into its region: what is buffered, then straight off the
    /// socket. False when the socket has no more for now.
    fn land_payload(&mut self) -> Result<bool, End> {
        let p = self.payload.as_mut().expect("a payload under way");
        while p.left > 0 {
            let registered = self.qp.pd.hold_registrations();
            if !registered.contains(&p.mr) {
                drop(registered);
                let psn = p.psn;
                self.payload = None;
                self.refuse(psn, NakReason::RemoteAccess)?;
                return Ok(true);
            }
            let buffered = self.end - self.start;
            // SAFETY: check_remote proved offset+len lies inside the region, whose memory the
            // Arc keeps mapped, and `registered` keeps it registered across these calls, which
            // do not wait (the socket is non-blocking).
            let moved = unsafe {
                let dst = p.mr.ptr().add(p.offset);
                if buffered > 0 {
                    let n = buffered.min(p.left);
                    std::ptr::copy_nonoverlapping(self.input[self.start..].as_ptr(), dst, n);
                    self.start += n;
                    n
                } else {
                    match recv(&mut self.opener, self.qp.stream.as_raw_fd(), dst, p.left) {
                        Ok(0) => return Err(End::Disconnected),
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                        Err(_) => return Err(End::Disconnected),
                    }
                }
            };
            drop(registered);
            p.offset += moved;
            p.left -= moved;
        }
        let psn = p.psn;
        self.payload = None;
        self.held.push(Held::Ack(psn));
        Ok(true)
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

    /// After a refusal: whatever the peer had in flight is read and dropped, touching no
    /// memory, until it closes (a turn's worth at a time). True when more may wait.
    fn discard(&mut self) -> Result<bool, End> {
        self.start = 0;
        self.end = 0;
        let mut dropped = 0;
        while dropped < TURN_BYTES {
            let dst = self.input.as_mut_ptr();
            match recv_now(self.qp.stream.as_raw_fd(), dst, self.input.len()) {
                Ok(0) => return Err(End::Disconnected),
                Ok(n) => dropped += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(_) => return Err(End::Disconnected),
            }
        }
        Ok(true)
    }

    /// Answers every request before `psn` and refuses `psn`: the NAK is the last frame.
    fn refuse(&mut self, psn: u32, why: NakReason) -> Result<(), End> {
        self.flush_held()?;
        let mut h = Header::new(Kind::Nak, psn);
        h.imm = why as u32;
        let nak = h.encode();
        self.refused = true;
        self.payload = None;
        // SAFETY: one iovec over `nak`, alive for the call.
        unsafe { self.send_or_queue(&[iovec(nak.as_ptr(), nak.len())])? };
        self.flush_out()
    }

    /// Sends the held responses in one write (or queues them behind those still waiting for
    /// the socket), each READ read from its region now, while it is registered; a READ whose
    /// region went since its request is refused, and nothing after it is answered.
    fn flush_held(&mut self) -> Result<(), End> {
        if self.held.is_empty() {
            return Ok(());
        }
        let held = std::mem::take(&mut self.held);
        self.held_bytes = 0;
        let qp = self.qp.clone();
        let registered = qp.pd.hold_registrations();
        let lost = held.iter().position(|r| match r {
            Held::Read {
                region: Some((mr, _)),
                ..
            } => !registered.contains(mr),
            _ => false,
        });
        let answered = &held[..lost.unwrap_or(held.len())];
        let mut headers = Vec::with_capacity(answered.len());
        for (i, r) in answered.iter().enumerate() {
            match r {
                // An ACK acknowledges every request before it: a run goes as its last.
                Held::Ack(_) if matches!(answered.get(i + 1), Some(Held::Ack(_))) => {}
                Held::Ack(psn) => headers.push(Header::new(Kind::Ack, *psn).encode()),
                Held::Read { psn, len, .. } => {
                    let mut h = Header::new(Kind::ReadResponse, *psn);
                    h.len = *len as u32;
                    headers.push(h.encode());
                }
            }
        }
        let mut iovs = Vec::with_capacity(headers.len() * 2);
        let mut next_header = headers.iter();
        for (i, r) in answered.iter().enumerate() {
            match r {
                Held::Ack(_) if matches!(answered.get(i + 1), Some(Held::Ack(_))) => {}
                Held::Ack(_) => {
                    let h = next_header.next().expect("a header each");
                    iovs.push(iovec(h.as_ptr(), HEADER_LEN));
                }
                Held::Read { region, len, .. } => {
                    let h = next_header.next().expect("a header each");
                    iovs.push(iovec(h.as_ptr(), HEADER_LEN));
                    if let Some((mr, offset)) = region {
                        iovs.push(iovec(mr.ptr().wrapping_add(*offset), *len));
                    }
                }
            }
        }
        // SAFETY: the headers live in `headers`, READ data in regions that `registered` keeps
        // registered (so mapped) until after the call; the unsent rest is copied out before
        // `registered` goes.
        let sent = unsafe { self.send_or_queue(&iovs) };
        drop(registered);
        sent?;
        if let Some(i) = lost {
            let Held::Read { psn, .. } = held[i] else {
                unreachable!("only READs lose their region")
            };
            return self.refuse(psn, NakReason::RemoteAccess);
        }
        Ok(())
    }

    /// Sends `iovs` now as far as the socket takes them, when nothing waits before them, and
    /// keeps a copy of the rest.
    ///
    /// # Safety
    /// The iovecs must point at memory valid for reads during the call.
    unsafe fn send_or_queue(&mut self, iovs: &[libc::iovec]) -> Result<(), End> {
        let mut sealed = std::mem::take(&mut self.sealing);
        sealed.clear();
        let iovs = match self.sealer.as_mut() {
            Some(sealer) => {
                // SAFETY: forwarded from the caller.
                unsafe { sealer.seal(iovs, &mut sealed) };
                &[iovec(sealed.as_ptr(), sealed.len())][..]
            }
            None => iovs,
        };
        let mut sent = 0;
        if self.backlog() == 0 {
            self.out.clear();
            self.out_sent = 0;
            // SAFETY: forwarded from the caller.
            sent = match unsafe { send_now(self.qp.stream.as_raw_fd(), iovs) } {
                Ok(n) => {
                    self.qp.wire_writes.fetch_add(1, Ordering::Relaxed);
                    n
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(_) => return Err(End::Disconnected),
            };
        }
        // SAFETY: forwarded from the caller.
        unsafe { keep_unsent(iovs, sent, &mut self.out) };
        self.sealing = sealed;
        Ok(())
    }

    /// Sends what waits for the socket, as far as it takes it; once a refusal's NAK is out,
    /// shuts the write side (the peer reads the NAK, then sees the end).
    fn flush_out(&mut self) -> Result<(), End> {
        while self.backlog() > 0 {
            let rest = &self.out[self.out_sent..];
            // SAFETY: one iovec over our own buffer, alive for the call.
            match unsafe {
                send_now(
                    self.qp.stream.as_raw_fd(),
                    &[iovec(rest.as_ptr(), rest.len())],
                )
            } {
                Ok(n) => {
                    self.qp.wire_writes.fetch_add(1, Ordering::Relaxed);
                    self.out_sent += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(_) => return Err(End::Disconnected),
            }
        }
        self.out.clear();
        self.out_sent = 0;
        if self.refused && !self.shut {
            self.shut = true;
            let _ = self.qp.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
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
