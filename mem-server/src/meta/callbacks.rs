//! Telling one client session what changed: its callbacks go out in order, one at a time
//! (each numbered, its answer naming the number), merging what has piled up into one message,
//! on a thread of the metadata node's pool while any are queued (a session with nothing to
//! be told costs no thread); and counting the answers a change waits for.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rdmabox::rpc::{Dispatcher, RpcClient, RpcConfig};
use rdmabox::transport::{CompletionQueue, ProtectionDomain, QueuePair};
use rdmabox::workers::Workers;
use rfs_proto::callback::{is_ack, Callback, CALLBACK_RPC};
use rfs_proto::integrity;
use rfs_proto::session_key::SessionKey;
use rfs_proto::types::Ino;
use rfs_proto::wire::MAX_LIST;

/// Callbacks queued for one session before it is declared lost: a client that stopped
/// answering while others keep changing what it cached.
const MAX_QUEUED: usize = 4096;

/// Counts answers still awaited, and whether every holder really answered: one that could
/// not be asked (its connection is down, or it let an earlier callback run out) may still
/// use what it holds until its lease runs out.
pub(crate) struct Countdown {
    left: Mutex<usize>,
    zero: Condvar,
    unanswered: AtomicBool,
}

impl Countdown {
    pub(crate) fn new() -> Arc<Countdown> {
        Arc::new(Countdown {
            left: Mutex::new(0),
            zero: Condvar::new(),
            unanswered: AtomicBool::new(false),
        })
    }

    fn add(&self) {
        *self.left.lock().unwrap() += 1;
    }

    /// A holder that cannot be asked (away, or ended): nothing of it is awaited, and the
    /// change is known to have gone unanswered by someone.
    fn unasked(&self) {
        self.unanswered.store(true, Ordering::Release);
    }

    fn done(&self, answered: bool) {
        if !answered {
            self.unanswered.store(true, Ordering::Release);
        }
        let mut left = self.left.lock().unwrap();
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.zero.notify_all();
        }
    }

    /// Waits until every answer came or `deadline`; whether every holder answered.
    pub(crate) fn wait(&self, deadline: Instant) -> bool {
        let mut left = self.left.lock().unwrap();
        while *left > 0 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            left = self.zero.wait_timeout(left, deadline - now).unwrap().0;
        }
        !self.unanswered.load(Ordering::Acquire)
    }
}

struct Queue {
    items: VecDeque<(Callback, Option<Arc<Countdown>>)>,
    closed: bool,
    /// A pool thread is sending them (or about to).
    sending: bool,
    /// Callbacks sent so far: the next one's number is one more.
    sent: u64,
}

/// The callback side of one session.
pub(crate) struct Callbacks {
    /// Who the client is, for the log ("client ADDR (id ...)").
    client: String,
    rpc: RpcClient,
    queue: Mutex<Queue>,
    workers: Workers,
    /// Whether the client answers: a session that let a callback run past the lease is not
    /// waited for until it answers again.
    responsive: AtomicBool,
    /// Ends the whole session (its request loop watches it).
    end_session: Arc<AtomicBool>,
    /// The connection's session key: callbacks and their answers carry MACs by it.
    key: Option<SessionKey>,
}

impl Callbacks {
    /// The callback channel on a connected queue pair, answered within `lease`, its replies
    /// delivered and its callbacks sent by `dispatcher`'s pool.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        dispatcher: &Dispatcher,
        pd: &ProtectionDomain,
        qp: QueuePair,
        cq: CompletionQueue,
        lease: Duration,
        client: String,
        end_session: Arc<AtomicBool>,
        key: Option<SessionKey>,
    ) -> io::Result<Arc<Callbacks>> {
        let cfg = RpcConfig {
            timeout: lease,
            ..CALLBACK_RPC
        };
        Ok(Arc::new(Callbacks {
            client,
            rpc: dispatcher.client(pd, qp, cq, cfg)?,
            queue: Mutex::new(Queue {
                items: VecDeque::new(),
                closed: false,
                sending: false,
                sent: 0,
            }),
            workers: dispatcher.workers().clone(),
            responsive: AtomicBool::new(true),
            end_session,
            key,
        }))
    }

    /// Queues `cb`; `answered` counts it while the client is responsive, and learns if it
    /// could not be asked.
    pub(crate) fn send(self: &Arc<Self>, cb: Callback, answered: &Arc<Countdown>) {
        // A holder that cannot be asked must not count down the others' answers: the change
        // would return before they dropped what it made stale.
        let wait = self.responsive.load(Ordering::Acquire);
        if !wait {
            answered.unasked();
        }
        let mut q = self.queue.lock().unwrap();
        if q.closed {
            answered.unasked();
            return;
        }
        if q.items.len() >= MAX_QUEUED {
            log::warn!(
                "{}: {MAX_QUEUED} callbacks unanswered; ending its session",
                self.client
            );
            q.closed = true;
            answered.unasked();
            self.end_session.store(true, Ordering::Release);
            self.send_queued(q);
            return;
        }
        for part in cb.split() {
            if wait {
                answered.add();
            }
            q.items.push_back((part, wait.then(|| answered.clone())));
        }
        self.send_queued(q);
    }

    /// Tells the session that a lock of each of `inos` went (it waits to take one), not
    /// waited for. Words not sent yet are merged into one, so that a client slow to answer
    /// while others lock and unlock fast is not ended for a backlog of them.
    pub(crate) fn tell_locks_freed(self: &Arc<Self>, inos: Vec<Ino>) {
        let mut q = self.queue.lock().unwrap();
        if q.closed {
            return;
        }
        let pending = q
            .items
            .iter_mut()
            .find(|(cb, w)| w.is_none() && cb.inodes.is_empty() && cb.entries.is_empty());
        match pending {
            Some((cb, _)) => {
                for ino in inos {
                    let room = cb.locks_freed.len() < MAX_LIST as usize;
                    if room && !cb.locks_freed.contains(&ino) {
                        cb.locks_freed.push(ino);
                    }
                }
            }
            None => q.items.push_back((
                Callback {
                    locks_freed: inos,
                    ..Callback::default()
                },
                None,
            )),
        }
        self.send_queued(q);
    }

    /// Stops sending: the session ended. Whoever waits for its answers stops waiting.
    pub(crate) fn close(self: &Arc<Self>) {
        let mut q = self.queue.lock().unwrap();
        q.closed = true;
        self.send_queued(q);
    }

    /// Has a pool thread send what is queued, unless one is at it.
    fn send_queued(self: &Arc<Self>, mut q: std::sync::MutexGuard<'_, Queue>) {
        if q.sending {
            return;
        }
        q.sending = true;
        drop(q);
        let me = self.clone();
        self.workers.run(move || me.send_all());
    }

    /// Sends callbacks until none is queued; once closed, lets go of whoever waits.
    fn send_all(&self) {
        loop {
            let (batch, waiting, number) = {
                let mut q = self.queue.lock().unwrap();
                if q.closed {
                    for (_, w) in q.items.drain(..) {
                        w.inspect(|w| w.done(false));
                    }
                }
                let Some((mut batch, w)) = q.items.pop_front() else {
                    q.sending = false;
                    return;
                };
                let mut waiting: Vec<_> = w.into_iter().collect();
                while q.items.front().is_some_and(|(c, _)| batch.has_room_for(c)) {
                    let (c, w) = q.items.pop_front().expect("not empty");
                    batch.merge(c);
                    waiting.extend(w);
                }
                q.sent += 1;
                (batch, waiting, q.sent)
            };
            let answered = self.ask(batch, number);
            for w in waiting {
                w.done(answered);
            }
        }
    }

    /// Sends one callback, numbered `number`; whether the client answered it.
    fn ask(&self, batch: Callback, number: u64) -> bool {
        // Callbacks are numbered in turn (one at a time), and each answer names its number:
        // an old one replayed, or an old answer, is refused.
        let key = self.key.as_ref();
        let sealed = integrity::seal_numbered(key, integrity::CALLBACK, number, batch.encode());
        match self.rpc.call(&sealed) {
            Ok(reply)
                if integrity::open(key, integrity::ANSWER, number, &reply).is_some_and(is_ack) =>
            {
                if !self.responsive.swap(true, Ordering::AcqRel) {
                    log::warn!("{} answers callbacks again", self.client);
                }
                true
            }
            Ok(_) => {
                log::warn!("{}: malformed callback answer", self.client);
                false
            }
            Err(e) => {
                if self.responsive.swap(false, Ordering::AcqRel) {
                    log::warn!(
                        "{}: callback unanswered ({e}); its chunk references are \
                         taken as dropped (lease)",
                        self.client
                    );
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A holder that cannot be asked (its connection is down) leaves another holder's answer
    /// awaited: a change waits for those it asked, then says one went unanswered. It counted
    /// the other's answer down, and a rename returned before a healthy mount dropped the old
    /// name (the model test's rare "contents differ" under load).
    #[test]
    fn an_unasked_holder_does_not_count_down_another_holders_answer() {
        let c = Countdown::new();
        c.add();
        c.unasked();
        let start = Instant::now();
        assert!(!c.wait(start + Duration::from_millis(100)));
        assert!(
            start.elapsed() >= Duration::from_millis(100),
            "the asked holder's answer was not awaited"
        );
        c.done(true);
        assert!(
            !c.wait(Instant::now() + Duration::from_secs(1)),
            "answered, and one holder was never asked"
        );
        let all = Countdown::new();
        all.add();
        all.done(true);
        assert!(all.wait(Instant::now()), "every holder answered");
    }
}
