//! How a loop's responses go out. On a passive queue pair nobody else sends: the loop owns the
//! sealer and keeps what the socket did not take. On one that posts, they share the socket
//! with the posting threads under the transmit lock: the loop takes the lock only when it is
//! free (it must not wait), and leaves its answers to the lock's holder otherwise
//! (`QpShared::answer_now`).

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use super::{Conn, End, Held, MAX_BACKLOG};
use crate::transport::tcp::io::{iovec, keep_unsent, send_now};
use crate::transport::tcp::seal::Sealer;
use crate::transport::tcp::shared::QpShared;
use crate::transport::tcp::wire::{Header, Kind, NakReason, HEADER_LEN};

pub(super) enum Output {
    /// A passive queue pair's: what responses are sealed with, the room they are sealed in
    /// (kept from one batch to the next), and the frames the socket did not take yet, from
    /// `sent` on.
    Own {
        sealer: Option<Box<Sealer>>,
        sealing: Vec<u8>,
        out: Vec<u8>,
        sent: usize,
    },
    /// A posting queue pair's: whether the loop left bytes in its transmit state's `pending`
    /// for when the socket has room.
    Shared { pending: bool },
}

impl Output {
    pub(super) fn new(qp: &QpShared) -> Output {
        if qp.caps.is_responder() {
            Output::Own {
                sealer: qp.tx.lock().unwrap().sealer.take().map(Box::new),
                sealing: Vec::new(),
                out: Vec::new(),
                sent: 0,
            }
        } else {
            Output::Shared { pending: false }
        }
    }
}

impl Conn {
    /// Whether responses wait for the socket past [`MAX_BACKLOG`]: no input is read then. On
    /// a shared socket the one sending them wakes the loop when it has taken them.
    pub(super) fn backed_up(&self) -> bool {
        match &self.out {
            Output::Own { out, sent, .. } => out.len() - sent >= MAX_BACKLOG,
            Output::Shared { .. } => {
                let mut a = self.qp.answered.lock().unwrap();
                a.loop_waits = a.frames.len() >= MAX_BACKLOG;
                a.loop_waits
            }
        }
    }

    /// Whether the loop has bytes of its own waiting for the socket's room.
    pub(super) fn wants_out(&self) -> bool {
        match &self.out {
            Output::Own { out, sent, .. } => out.len() > *sent,
            Output::Shared { pending } => *pending,
        }
    }

    /// Sends the held responses in one write (or queues them behind those still waiting for
    /// the socket), each READ read from its region now, while it is registered; a READ whose
    /// region went since its request is refused, and nothing after it is answered.
    pub(super) fn flush_held(&mut self) -> Result<(), End> {
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
        // An ACK acknowledges every request before it: a run goes as its last.
        let goes = |i: usize| {
            !matches!(answered[i], Held::Ack(_))
                || !matches!(answered.get(i + 1), Some(Held::Ack(_)))
        };
        let headers: Vec<[u8; HEADER_LEN]> = (0..answered.len())
            .filter(|&i| goes(i))
            .map(|i| match &answered[i] {
                Held::Ack(psn) => Header::new(Kind::Ack, *psn).encode(),
                Held::Read { psn, len, .. } => {
                    let mut h = Header::new(Kind::ReadResponse, *psn);
                    h.len = *len as u32;
                    h.encode()
                }
            })
            .collect();
        let mut iovs = Vec::with_capacity(headers.len() * 2);
        for (i, h) in (0..answered.len()).filter(|&i| goes(i)).zip(&headers) {
            iovs.push(iovec(h.as_ptr(), HEADER_LEN));
            if let Held::Read {
                region: Some((mr, offset)),
                len,
                ..
            } = &answered[i]
            {
                iovs.push(iovec(mr.ptr().wrapping_add(*offset), *len));
            }
        }
        // SAFETY: the headers live in `headers`, READ data in regions that `registered` keeps
        // registered (so mapped) until after the call; what is not sent during the call is
        // copied out before `registered` goes.
        let sent = unsafe { self.emit(&iovs) };
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
    /// keeps a copy of the rest (on a shared socket, a copy of all of it, left to the
    /// transmit lock's holder if the lock is taken).
    ///
    /// # Safety
    /// The iovecs must point at memory valid for reads during the call.
    pub(super) unsafe fn emit(&mut self, iovs: &[libc::iovec]) -> Result<(), End> {
        let fd = self.qp.stream.as_raw_fd();
        match &mut self.out {
            Output::Shared { pending } => {
                let mut frames = Vec::new();
                // SAFETY: forwarded from the caller.
                unsafe { keep_unsent(iovs, 0, &mut frames) };
                if let Some(left) = self.qp.answer_now(&frames).map_err(|_| End::Disconnected)? {
                    *pending = left;
                }
                Ok(())
            }
            Output::Own {
                sealer,
                sealing,
                out,
                sent,
            } => {
                let mut sealed = std::mem::take(sealing);
                sealed.clear();
                let iovs = match sealer.as_mut() {
                    Some(sealer) => {
                        // SAFETY: forwarded from the caller.
                        unsafe { sealer.seal(iovs, &mut sealed) };
                        &[iovec(sealed.as_ptr(), sealed.len())][..]
                    }
                    None => iovs,
                };
                let mut now = 0;
                if out.len() == *sent {
                    out.clear();
                    *sent = 0;
                    // SAFETY: forwarded from the caller.
                    now = match unsafe { send_now(fd, iovs) } {
                        Ok(n) => {
                            self.qp.wire_writes.fetch_add(1, Ordering::Relaxed);
                            n
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                        Err(_) => return Err(End::Disconnected),
                    };
                }
                // SAFETY: forwarded from the caller.
                unsafe { keep_unsent(iovs, now, out) };
                *sealing = sealed;
                Ok(())
            }
        }
    }

    /// Sends what waits for the socket, as far as it takes it; once a refusal's NAK is out of
    /// a socket of its own, shuts the write side (the peer reads the NAK, then sees the end).
    pub(super) fn flush_out(&mut self) -> Result<(), End> {
        let fd = self.qp.stream.as_raw_fd();
        let nak_out = match &mut self.out {
            Output::Own { out, sent, .. } => {
                while out.len() > *sent {
                    let rest = &out[*sent..];
                    // SAFETY: one iovec over our own buffer, alive for the call.
                    match unsafe { send_now(fd, &[iovec(rest.as_ptr(), rest.len())]) } {
                        Ok(n) => {
                            self.qp.wire_writes.fetch_add(1, Ordering::Relaxed);
                            *sent += n;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                        Err(_) => return Err(End::Disconnected),
                    }
                }
                out.clear();
                *sent = 0;
                true
            }
            Output::Shared { pending } => {
                // Answers left to a holder of the lock that let go before it saw them go too.
                // With the lock taken, its holder sends them (and what is pending) before
                // anything of its own; what is pending is tried again when the socket has room.
                if let Some(left) = self.qp.answer_now(&[]).map_err(|_| End::Disconnected)? {
                    *pending = left;
                }
                // The socket stays whole: a posting thread may be writing what was left to
                // it, and the peer closes once it reads the NAK (its queue pair fails).
                false
            }
        };
        if nak_out && self.refused && !self.shut {
            self.shut = true;
            let _ = self.qp.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }
}
