//! Many RPC channels served by few threads, for a server with many peers (a storage node's
//! metadata sessions): one thread watches the channels' completion events in an epoll set; a
//! channel with completions gets a turn on a pool thread ([`Workers`]), which handles them,
//! keeps polling through a short spin (requests come in bursts) and then hands the channel
//! back to the watcher. A channel is served by one turn at a time, in order, as by a thread of
//! its own; a handler that waits holds one pool thread, and the pool grows while others are
//! waited on. So an idle session costs no thread.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Answering, Channel, RpcClient, RpcConfig, BATCH, SPIN_POLLS};
use crate::epoll::Epoll;
use crate::transport::{Completion, CompletionQueue, ProtectionDomain, QueuePair};
use crate::workers::Workers;

/// How often channels are looked at for a `stop` set from outside (as a pump's bounded sleep
/// notices it).
const STOP_SCAN: Duration = Duration::from_millis(200);

/// The watcher and its pool; cheap to clone.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

struct Inner {
    epoll: Epoll,
    channels: Mutex<HashMap<u64, Arc<Entry>>>,
    next: AtomicU64,
    workers: Workers,
}

/// A channel being served.
struct Entry {
    cq: CompletionQueue,
    stop: Arc<AtomicBool>,
    /// Taken by a turn; None once the channel has ended.
    serving: Mutex<Option<Serving>>,
}

struct Serving {
    on: Box<dyn FnMut(&Completion) -> bool + Send>,
    ended: Box<dyn FnOnce(bool) + Send>,
}

const ONESHOT_IN: u32 = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;

impl Dispatcher {
    /// Starts the watcher; pool threads are named `name`.
    pub fn start(name: &str) -> io::Result<Dispatcher> {
        let inner = Arc::new(Inner {
            epoll: Epoll::new()?,
            channels: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            workers: Workers::new(name),
        });
        let run = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name(format!("{name}-watch"))
            .spawn(move || watch(run))?;
        Ok(Dispatcher { inner })
    }

    /// The pool channels are served on, for other work of the same server that may wait.
    pub fn workers(&self) -> &Workers {
        &self.inner.workers
    }

    /// Serves requests on `qp` as [`super::serve`] does, without a thread of its own: returns
    /// at once, and `ended` runs (on a pool thread) with what `serve` would have returned, once
    /// `stop` is set or the connection ends. If serving cannot start, `ended` runs at once,
    /// with the error this returns too.
    pub fn serve(
        &self,
        pd: &ProtectionDomain,
        (qp, cq): (QueuePair, CompletionQueue),
        cfg: RpcConfig,
        stop: Arc<AtomicBool>,
        handler: impl FnMut(&[u8]) -> Vec<u8> + Send + 'static,
        ended: impl FnOnce(io::Result<()>) + Send + 'static,
    ) -> io::Result<()> {
        let ch = match Channel::new(pd, qp, cq, cfg) {
            Ok(ch) => Arc::new(ch),
            Err(e) => {
                ended(Err(io::Error::new(e.kind(), e.to_string())));
                return Err(e);
            }
        };
        let answering = Arc::new(Mutex::new(Some(Answering::new(ch.clone(), handler))));
        let a = answering.clone();
        self.add(
            &ch.cq,
            stop,
            move |c| unpoisoned(&a).as_mut().is_some_and(|a| a.on(c)),
            move |stopped| {
                let a = unpoisoned(&answering).take().expect("ends once");
                ended(a.result(stopped));
            },
        )
    }

    /// A client on `qp` whose replies are delivered by the pool instead of a pump thread of
    /// its own.
    pub fn client(
        &self,
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        cfg: RpcConfig,
    ) -> io::Result<RpcClient> {
        let (client, delivering) = RpcClient::parts(pd, qp, cq, cfg)?;
        let d = Arc::new(Mutex::new(Some(delivering)));
        let end = d.clone();
        self.add(
            &client.ch.cq,
            client.stop.clone(),
            move |c| unpoisoned(&d).as_mut().is_some_and(|d| d.on(c)),
            move |_| {
                if let Some(d) = unpoisoned(&end).take() {
                    d.end();
                }
            },
        )?;
        Ok(client)
    }

    fn add(
        &self,
        cq: &CompletionQueue,
        stop: Arc<AtomicBool>,
        on: impl FnMut(&Completion) -> bool + Send + 'static,
        ended: impl FnOnce(bool) + Send + 'static,
    ) -> io::Result<()> {
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry {
            cq: cq.clone(),
            stop,
            serving: Mutex::new(Some(Serving {
                on: Box::new(on),
                ended: Box::new(ended),
            })),
        });
        self.inner
            .channels
            .lock()
            .unwrap()
            .insert(id, entry.clone());
        // A first look at once: requests may have come before the event was armed.
        if let Err(e) = self.inner.epoll.add(cq.event_fd(), id, 0) {
            self.inner.channels.lock().unwrap().remove(&id);
            let s = entry.serving.lock().unwrap().take();
            if let Some(Serving { ended, .. }) = s {
                ended(false);
            }
            return Err(e);
        }
        let inner = self.inner.clone();
        self.inner.workers.run(move || inner.turn(id, &entry, 1));
        Ok(())
    }
}

/// The lock of a side's state, also after a handler panicked holding it: the side is only
/// ended then.
fn unpoisoned<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Hands completions to a channel's handler; false once it says the channel is over, or
/// panicked (the channel ends then, as a thread of its own would have: its peer sees it go).
fn handled(on: &mut Box<dyn FnMut(&Completion) -> bool + Send>, wc: &[Completion]) -> bool {
    let run = std::panic::AssertUnwindSafe(|| wc.iter().all(&mut *on));
    std::panic::catch_unwind(run).unwrap_or_else(|_| {
        log::error!("rpc: a handler panicked; its channel is closed");
        false
    })
}

/// The watcher thread: each channel whose event fired gets a turn; every [`STOP_SCAN`], each
/// channel stopped from outside gets one too (to end). Ends with the dispatcher.
fn watch(inner: std::sync::Weak<Inner>) {
    let mut ready = Vec::new();
    let mut scanned = Instant::now();
    loop {
        let Some(me) = inner.upgrade() else {
            return;
        };
        if let Err(e) = me.epoll.wait(STOP_SCAN.as_millis() as i32, &mut ready) {
            log::error!("rpc dispatcher: epoll_wait: {e}");
            std::thread::sleep(STOP_SCAN);
        }
        let mut due: Vec<(u64, Arc<Entry>)> = {
            let channels = me.channels.lock().unwrap();
            ready
                .drain(..)
                .filter_map(|(id, _)| Some((id, channels.get(&id)?.clone())))
                .collect()
        };
        if scanned.elapsed() >= STOP_SCAN {
            scanned = Instant::now();
            let channels = me.channels.lock().unwrap();
            due.extend(
                channels
                    .iter()
                    .filter(|(_, e)| e.stop.load(Ordering::Acquire))
                    .map(|(&id, e)| (id, e.clone())),
            );
        }
        for (id, entry) in due {
            let run = me.clone();
            me.workers.run(move || run.turn(id, &entry, SPIN_POLLS));
        }
    }
}

impl Inner {
    /// Serves a channel's completions until `spin` polls in a row find none, then arms its
    /// event and hands it back to the watcher; or ends it.
    fn turn(&self, id: u64, entry: &Entry, spin: u32) {
        // Another turn is under way (a stop scan met a busy channel): it sees all of it.
        let Ok(mut serving) = entry.serving.try_lock() else {
            return;
        };
        let Some(s) = serving.as_mut() else {
            return;
        };
        let _ = entry.cq.wait_event(Some(Duration::ZERO));
        let mut wc = [Completion::EMPTY; BATCH];
        let mut empty = 0;
        let go_on = loop {
            if entry.stop.load(Ordering::Acquire) {
                break false;
            }
            let n = match entry.cq.poll(&mut wc) {
                Ok(n) => n,
                Err(e) => {
                    log::error!("rpc: polling failed: {e}");
                    break false;
                }
            };
            if !handled(&mut s.on, &wc[..n]) {
                break false;
            }
            if n > 0 {
                empty = 0;
                continue;
            }
            empty += 1;
            if empty < spin {
                std::thread::yield_now();
                continue;
            }
            if entry.cq.arm().is_err() {
                break false;
            }
            // A completion may have come before the arm took effect.
            let n = entry.cq.poll(&mut wc).unwrap_or(0);
            if n == 0 {
                break true;
            }
            if !handled(&mut s.on, &wc[..n]) {
                break false;
            }
            empty = 0;
        };
        if go_on {
            // Let go first: the turn an event after the re-entry starts must find it free (it
            // gives up on a channel it finds taken, and the event is spent).
            drop(serving);
            // Re-entered with its readiness checked: an event that fired meanwhile is seen.
            match self.epoll.modify(entry.cq.event_fd(), id, ONESHOT_IN) {
                Ok(()) => {
                    // A thread descheduled here (as tests make it) must hold nothing.
                    #[cfg(test)]
                    std::thread::sleep(Duration::from_millis(1));
                    return;
                }
                Err(_) => serving = entry.serving.lock().unwrap(),
            }
        }
        let Some(Serving { ended, .. }) = serving.take() else {
            return;
        };
        drop(serving);
        let _ = self.epoll.remove(entry.cq.event_fd());
        self.channels.lock().unwrap().remove(&id);
        ended(entry.stop.load(Ordering::Acquire));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::time::Instant;

    use crate::transport::TransportConfig;
    use crate::transport::{connect_queue_pairs, Context, ProviderKind, QpCaps, QpRoute};

    /// A served side (queue pairs served by the loops, as on a node) and a client side.
    struct Ends {
        server: (Context, ProtectionDomain),
        client: (Context, ProtectionDomain),
    }

    fn ends() -> Ends {
        let open = |loops: bool| {
            let mut cfg = TransportConfig::with_provider(ProviderKind::Tcp);
            cfg.tcp.served_by_loops = loops;
            let ctx = Context::open(&cfg).unwrap();
            let pd = ctx.alloc_pd().unwrap();
            (ctx, pd)
        };
        Ends {
            server: open(true),
            client: open(false),
        }
    }

    type Link = (QueuePair, CompletionQueue);

    /// A connected queue pair: (server end, client end).
    fn link(e: &Ends) -> (Link, Link) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::scope(|scope| {
            let server = scope.spawn(|| {
                let (mut s, _) = l.accept().unwrap();
                let (ctx, pd) = &e.server;
                connect_queue_pairs(ctx, pd, &mut s, 1, QpCaps::default(), &QpRoute::OwnPort)
                    .unwrap()
                    .pop()
                    .unwrap()
            });
            let mut c = TcpStream::connect(addr).unwrap();
            let (ctx, pd) = &e.client;
            let client =
                connect_queue_pairs(ctx, pd, &mut c, 1, QpCaps::default(), &QpRoute::OwnPort)
                    .unwrap()
                    .pop()
                    .unwrap();
            (server.join().unwrap(), client)
        })
    }

    fn reversed(req: &[u8]) -> Vec<u8> {
        req.iter().rev().copied().collect()
    }

    /// Serves one channel with `handler`; returns its client and what `ended` said.
    fn served(
        d: &Dispatcher,
        e: &Ends,
        stop: Arc<AtomicBool>,
        handler: impl FnMut(&[u8]) -> Vec<u8> + Send + 'static,
    ) -> (RpcClient, mpsc::Receiver<io::Result<()>>) {
        let (server, (qp, cq)) = link(e);
        let (tx, rx) = mpsc::channel();
        d.serve(
            &e.server.1,
            server,
            RpcConfig::default(),
            stop,
            handler,
            move |r| {
                let _ = tx.send(r);
            },
        )
        .unwrap();
        let client = RpcClient::new(&e.client.1, qp, cq, RpcConfig::default()).unwrap();
        (client, rx)
    }

    #[test]
    fn many_channels_are_answered_by_a_few_threads_which_idle_sessions_do_not_hold() {
        let d = Dispatcher::start("test-rpc").unwrap();
        let e = ends();
        let clients: Vec<_> = (0..30)
            .map(|_| served(&d, &e, Arc::default(), reversed))
            .collect();
        for round in 0..3u8 {
            for (i, (c, _)) in clients.iter().enumerate() {
                assert_eq!(c.call(&[round, i as u8]).unwrap(), [i as u8, round]);
            }
        }
        // A turn spins a moment after its calls, so a burst over many channels takes a thread
        // each for that moment; idle, they are let go: idle channels hold none.
        let start = Instant::now();
        while d.workers().threads() > 2 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{} pool threads for 30 idle channels",
                d.workers().threads()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(clients[7].0.call(b"still").unwrap(), b"llits");
    }

    /// Calls that come just as a turn hands its channel back are all answered: the turn their
    /// event starts must not find the channel still taken. A new channel's first turn is
    /// short, and its client calls at once (as a mount that reconnects does): 200 of those.
    #[test]
    fn calls_arriving_as_a_turn_ends_are_never_lost() {
        let d = Dispatcher::start("test-rpc").unwrap();
        let e = ends();
        for i in 0..200u32 {
            let (client, _) = served(&d, &e, Arc::default(), reversed);
            let reply = client
                .call_within(&i.to_le_bytes(), Duration::from_secs(3))
                .unwrap_or_else(|err| panic!("call on channel {i}: {err}"));
            assert_eq!(reply, reversed(&i.to_le_bytes()));
        }
    }

    #[test]
    fn a_handler_that_waits_holds_up_only_its_own_channel() {
        let d = Dispatcher::start("test-rpc").unwrap();
        let e = ends();
        let (slow, _) = served(&d, &e, Arc::default(), |req| {
            std::thread::sleep(Duration::from_millis(1500));
            req.to_vec()
        });
        let (quick, _) = served(&d, &e, Arc::default(), reversed);
        let waiting = std::thread::spawn(move || slow.call(b"slow").unwrap());
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        assert_eq!(quick.call(b"ab").unwrap(), b"ba");
        assert!(
            start.elapsed() < Duration::from_millis(700),
            "waited {:?} behind another channel's handler",
            start.elapsed()
        );
        assert_eq!(waiting.join().unwrap(), b"slow");
    }

    /// A handler that panics ends its channel (its client is told at once, as when a thread
    /// of its own unwound), and the others go on.
    #[test]
    fn a_panicking_handler_ends_only_its_channel() {
        let d = Dispatcher::start("test-rpc").unwrap();
        let e = ends();
        let (bad, ended) = served(&d, &e, Arc::default(), |req| {
            assert!(req != b"boom", "a handler's bug");
            req.to_vec()
        });
        let (good, _) = served(&d, &e, Arc::default(), reversed);
        assert_eq!(bad.call(b"ok").unwrap(), b"ok");
        assert!(bad.call(b"boom").is_err());
        let r = ended.recv_timeout(Duration::from_secs(5)).expect("ended");
        assert!(r.is_err());
        assert_eq!(good.call(b"xy").unwrap(), b"yx");
    }

    #[test]
    fn a_stop_ends_the_channel_well_and_a_lost_peer_with_its_reason() {
        let d = Dispatcher::start("test-rpc").unwrap();
        let e = ends();
        let stop = Arc::new(AtomicBool::new(false));
        let (client, ended) = served(&d, &e, stop.clone(), reversed);
        assert_eq!(client.call(b"12").unwrap(), b"21");
        stop.store(true, Ordering::Release);
        let r = ended.recv_timeout(Duration::from_secs(2)).expect("ended");
        assert!(r.is_ok(), "{r:?}");
        assert!(client.call(b"x").is_err(), "nothing answers after the stop");

        let (client, ended) = served(&d, &e, Arc::default(), reversed);
        assert_eq!(client.call(b"34").unwrap(), b"43");
        drop(client);
        let r = ended.recv_timeout(Duration::from_secs(5)).expect("ended");
        assert!(r.is_err(), "a lost peer is no stop");
    }

    #[test]
    fn a_client_on_the_pool_gets_its_replies_and_fails_at_once_when_the_peer_goes() {
        let d = Dispatcher::start("test-rpc").unwrap();
        let e = ends();
        // Here the dispatcher's side calls, and the other side serves on a thread of its own.
        let (calling, (qp, cq)) = link(&e);
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let server = scope.spawn(|| {
                let _ =
                    super::super::serve(&e.client.1, qp, cq, RpcConfig::default(), &stop, reversed);
            });
            let cfg = RpcConfig {
                timeout: Duration::from_secs(20),
                ..RpcConfig::default()
            };
            let client = d.client(&e.server.1, calling.0, calling.1, cfg).unwrap();
            for i in 0..50u8 {
                assert_eq!(client.call(&[i, 0]).unwrap(), [0, i]);
            }
            stop.store(true, Ordering::Release);
            server.join().unwrap();
            let start = Instant::now();
            let err = client.call(b"gone").unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::BrokenPipe, "{err}");
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{:?}",
                start.elapsed()
            );
        });
    }
}
