//! The event loops: queue pairs served by a few threads of the process with an epoll set each,
//! instead of two threads per queue pair. Passive queue pairs, on which the local side never
//! posts (a node's data sessions: their peers READ and WRITE the pool), always are; queue pairs
//! that post are too where the provider is set so (`TcpConfig::served_by_loops`: a storage
//! node's metadata and grant channels). So a thousand of them cost a handful of threads and no
//! more than a few buffers each. What a connection is served, and how, is in [`super::conn`].
//!
//! A loop also wakes for a connection that waits on its queue pair's other users (a receive to
//! be posted, answers left to the transmit lock's holder), and at the deadline of a SEND that
//! waits for a receive (the RNR window).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use nix::sys::eventfd::{EfdFlags, EventFd};

use super::conn::{Conn, Turn};
use super::shared::QpShared;
use crate::epoll::{Epoll, Ready};

/// The process's loops, started with the first queue pair one serves.
static LOOPS: Mutex<Vec<Arc<Loop>>> = Mutex::new(Vec::new());
static NEXT_LOOP: AtomicUsize = AtomicUsize::new(0);

/// The epoll id of a loop's wake-up eventfd; connections count from 1.
const WAKE: u64 = 0;

/// How many loop threads serve the process's loop-served queue pairs.
pub fn loop_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
}

/// Hands a connected queue pair to a loop, which serves it until its connection ends.
pub(super) fn serve(qp: Arc<QpShared>) -> io::Result<()> {
    let l = {
        let mut loops = LOOPS.lock().unwrap();
        while loops.len() < loop_threads() {
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
    wake: EventFd,
    /// Connections to look at again, named by the queue pairs' other users.
    woken: Mutex<Vec<u64>>,
}

impl Loop {
    fn start(i: usize) -> io::Result<Arc<Loop>> {
        let l = Arc::new(Loop {
            epoll: Epoll::new()?,
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(WAKE + 1),
            wake: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            woken: Mutex::new(Vec::new()),
        });
        l.epoll.add(&l.wake, WAKE, libc::EPOLLIN as u32)?;
        let run = l.clone();
        std::thread::Builder::new()
            .name(format!("tcp-loop-{i}"))
            .spawn(move || run.run())?;
        Ok(l)
    }

    fn add(self: &Arc<Self>, qp: Arc<QpShared>) -> io::Result<()> {
        qp.stream.set_nonblocking(true)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let me: Weak<Loop> = Arc::downgrade(self);
        let _ = qp.wake_loop.set(Box::new(move || {
            if let Some(l) = me.upgrade() {
                l.woken.lock().unwrap().push(id);
                // It cannot fail for want of room: every wake-up drains the counter.
                let _ = l.wake.write(1);
            }
        }));
        let mut conn = Conn::new(qp.clone());
        let interest = conn.interest();
        conn.registered = interest;
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

    /// Serves what epoll reports, the connections that used up their turn with work left
    /// (whose input may wait in an opener, where epoll does not see it), those woken, and
    /// those whose wait ran out.
    fn run(&self) {
        let mut turns: Vec<Ready> = Vec::new();
        let mut again: Vec<u64> = Vec::new();
        let mut deadlines: Vec<(Instant, u64)> = Vec::new();
        loop {
            let wait = if again.is_empty() {
                deadlines.iter().map(|&(at, _)| at).min().map_or(-1, |at| {
                    let left = at.saturating_duration_since(Instant::now());
                    // Rounded up: waking before the deadline would only wait again.
                    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
                })
            } else {
                0
            };
            if let Err(e) = self.epoll.wait(wait, &mut turns) {
                log::error!("tcp loop: epoll_wait: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            if let Some(i) = turns.iter().position(|&(id, _)| id == WAKE) {
                turns.swap_remove(i);
                let _ = self.wake.read();
                turns.extend(self.woken.lock().unwrap().drain(..).map(|id| (id, 0)));
            }
            let now = Instant::now();
            deadlines.retain(|&(at, id)| {
                let due = at <= now;
                if due {
                    turns.push((id, 0));
                }
                !due
            });
            turns.extend(again.drain(..).map(|id| (id, 0)));
            for (id, ready) in turns.drain(..) {
                let Some(conn) = self.conns.lock().unwrap().get(&id).cloned() else {
                    continue;
                };
                let mut conn = conn.lock().unwrap();
                match conn.serve(ready) {
                    Turn::Done => {
                        let _ = self.epoll.remove(&conn.qp.stream);
                        self.conns.lock().unwrap().remove(&id);
                        conn.finish();
                        continue;
                    }
                    Turn::More => again.push(id),
                    Turn::Waiting => {}
                    Turn::Until(at) if !deadlines.contains(&(at, id)) => deadlines.push((at, id)),
                    Turn::Until(_) => {}
                }
                // Compared with what is registered, not with what the turn began with: on a
                // shared socket, posting threads change the backlog between turns.
                let now = conn.interest();
                if now != conn.registered {
                    match self.epoll.modify(&conn.qp.stream, id, now) {
                        Ok(()) => conn.registered = now,
                        Err(e) => log::warn!("qp {}: epoll: {e}", conn.qp.qpn),
                    }
                }
            }
        }
    }
}
