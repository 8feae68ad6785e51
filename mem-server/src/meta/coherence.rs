//! Coherence by callback, on the metadata node: which client sessions may cache what (chunk
//! maps they fetched, attributes and names they were told), and telling them when it changes,
//! as NFSv4 recalls delegations and Lustre cancels locks. A change is planned under the state
//! lock (so a fetch either precedes it and is recalled, or follows it and sees it), sent by
//! each session's callback thread, and waited for with the lock released, up to the lease: a
//! session that does not answer in time is taken to have dropped what it was told (its own
//! lease makes it refetch), and is not waited for again until it answers. Chunks that a
//! session could not be asked about (its connection is down, dead or cut: the service cannot
//! tell which) stay in quarantine until the lease has passed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rdmabox::rpc::{RpcClient, RpcConfig};
use rdmabox::transport::{CompletionQueue, ProtectionDomain, QueuePair};
use rfs_proto::callback::{is_ack, Callback, EntryChange, Invalidation, CALLBACK_RPC};
use rfs_proto::integrity;
use rfs_proto::session_key::SessionKey;
use rfs_proto::types::{Attr, Ino, Name};
use rfs_proto::wire::MAX_LIST;

/// A client session of the metadata service.
pub(crate) type SessionId = u64;

/// Callbacks queued for one session before it is declared lost: a client that stopped
/// answering while others keep changing what it cached.
const MAX_QUEUED: usize = 4096;

/// What one session may cache, as far as the service knows.
struct Cached {
    /// Inodes whose chunk maps it fetched: it may read and write their chunks.
    maps: HashSet<Ino>,
    /// Inodes whose attributes it was told (forgotten once it is told of a change: it asks
    /// again).
    seen: HashSet<Ino>,
    /// Files it has open: it is told of every change to them, since it keeps their sizes.
    open: HashMap<Ino, u32>,
    /// The connection whose callback channel this is.
    epoch: u64,
    /// Directories it looked names up in: its kernel may keep those names for as long as it
    /// likes, whatever it re-asks about the directory itself, so these are kept.
    dirs: HashSet<Ino>,
    callbacks: Arc<Callbacks>,
}

/// Every session's caches.
#[derive(Default)]
pub(crate) struct Holders {
    sessions: HashMap<SessionId, Cached>,
}

/// A change, described for the caches.
#[derive(Default)]
pub(crate) struct Change {
    /// Inodes whose attributes changed, and whether their contents did.
    pub(crate) inodes: Vec<(Ino, bool)>,
    /// Files whose chunks from an index on are no longer theirs.
    pub(crate) recalls: Vec<Recall>,
    /// Names that no longer lead where they did.
    pub(crate) entries: Vec<(Ino, Name)>,
    /// Files whose chunk maps changed without a size cut (replicas dropped or added).
    pub(crate) remaps: Vec<Ino>,
}

/// A file's chunks from index `from` on are no longer its own.
pub(crate) struct Recall {
    pub(crate) ino: Ino,
    pub(crate) from: u64,
    /// Its contents changed with them (a size cut, or the file is gone); not when only chunks
    /// past its size went back (a trim of those allocated ahead, at its last close), which
    /// leaves every cached byte of it as it was.
    pub(crate) cut: bool,
}

impl Change {
    pub(crate) fn is_empty(&self) -> bool {
        self.inodes.is_empty()
            && self.recalls.is_empty()
            && self.entries.is_empty()
            && self.remaps.is_empty()
    }
}

impl Holders {
    /// Session `id`'s connection `epoch` has a callback channel; returns the one that goes
    /// (the older of the two: connections of one session may race to get here). What a
    /// reconnecting session held, it is still taken to hold (it drops its chunk maps once it
    /// learns it reconnected, which may be after the next recall).
    pub(crate) fn attach(
        &mut self,
        id: SessionId,
        epoch: u64,
        callbacks: Arc<Callbacks>,
    ) -> Option<Arc<Callbacks>> {
        match self.sessions.get_mut(&id) {
            Some(c) if c.epoch > epoch => Some(callbacks),
            Some(c) => {
                c.epoch = epoch;
                Some(std::mem::replace(&mut c.callbacks, callbacks))
            }
            None => {
                self.sessions.insert(
                    id,
                    Cached {
                        maps: HashSet::new(),
                        seen: HashSet::new(),
                        dirs: HashSet::new(),
                        open: HashMap::new(),
                        callbacks,
                        epoch,
                    },
                );
                None
            }
        }
    }

    pub(crate) fn remove(&mut self, id: SessionId) {
        self.sessions.remove(&id);
    }

    /// `id` was told `ino`'s attributes (or names in it).
    pub(crate) fn saw(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            c.seen.insert(ino);
        }
    }

    /// `id` looked names up in directory `dir` (and may cache them).
    pub(crate) fn looked_in(&mut self, id: SessionId, dir: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            c.dirs.insert(dir);
        }
    }

    /// `id` opened a handle of `ino`.
    pub(crate) fn opened(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            *c.open.entry(ino).or_default() += 1;
        }
    }

    /// `id` closed a handle of `ino`.
    pub(crate) fn closed(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            if let Some(n) = c.open.get_mut(&ino) {
                *n -= 1;
                if *n == 0 {
                    c.open.remove(&ino);
                }
            }
        }
    }

    /// `id` fetched part of `ino`'s chunk map.
    pub(crate) fn fetched(&mut self, id: SessionId, ino: Ino) {
        if let Some(c) = self.sessions.get_mut(&id) {
            c.maps.insert(ino);
        }
    }

    /// The sessions waiting for locks to tell that a lock of each file went, with the files.
    pub(crate) fn lock_freed(&self, woken: &[(SessionId, Ino)]) -> Vec<(Arc<Callbacks>, Vec<Ino>)> {
        let mut by_session: HashMap<SessionId, Vec<Ino>> = HashMap::new();
        for &(session, ino) in woken {
            let inos = by_session.entry(session).or_default();
            if !inos.contains(&ino) {
                inos.push(ino);
            }
        }
        by_session
            .into_iter()
            .filter_map(|(session, inos)| {
                let c = self.sessions.get(&session)?;
                Some((c.callbacks.clone(), inos))
            })
            .collect()
    }

    /// The callback each session needs for `change` made by `caller` (None: by the service
    /// itself): chunk recalls go to every holder, the caller too (its other threads may have
    /// transfers in flight); remaps and the rest go to the others (the caller knows what it
    /// did, and may hold the very references a remap would wait for). Told sessions forget
    /// what they were told: they are told again only after they fetch again.
    pub(crate) fn plan(
        &mut self,
        caller: Option<SessionId>,
        change: &Change,
        attr: impl Fn(Ino) -> Option<Attr>,
    ) -> Vec<(Arc<Callbacks>, Callback)> {
        let gone: Vec<Ino> = change
            .inodes
            .iter()
            .map(|&(ino, _)| ino)
            .filter(|&ino| attr(ino).is_none())
            .collect();
        let mut out = Vec::new();
        for (&id, c) in &mut self.sessions {
            let mut cb = Callback::default();
            let mut told: HashMap<Ino, usize> = HashMap::new();
            let is_caller = Some(id) == caller;
            for &(ino, data) in &change.inodes {
                if is_caller || told.contains_key(&ino) {
                    continue;
                }
                if c.seen.remove(&ino) || c.open.contains_key(&ino) {
                    told.insert(ino, cb.inodes.len());
                    cb.inodes.push(Invalidation {
                        ino,
                        chunks_from: None,
                        attr: attr(ino),
                        data,
                        remapped: false,
                    });
                }
            }
            for &Recall { ino, from, cut } in &change.recalls {
                let gone = attr(ino).is_none();
                let holds = if from == 0 || gone {
                    c.maps.remove(&ino)
                } else {
                    c.maps.contains(&ino)
                };
                if !holds {
                    continue;
                }
                match told.get(&ino) {
                    Some(&i) => {
                        cb.inodes[i].chunks_from = Some(from);
                        cb.inodes[i].data |= cut;
                    }
                    None => {
                        told.insert(ino, cb.inodes.len());
                        cb.inodes.push(Invalidation {
                            ino,
                            chunks_from: Some(from),
                            attr: attr(ino),
                            data: cut,
                            remapped: false,
                        });
                    }
                }
            }
            for &ino in &change.remaps {
                if is_caller || !c.maps.remove(&ino) {
                    continue;
                }
                match told.get(&ino) {
                    Some(&i) => cb.inodes[i].remapped = true,
                    None => {
                        told.insert(ino, cb.inodes.len());
                        cb.inodes.push(Invalidation {
                            ino,
                            chunks_from: None,
                            attr: attr(ino),
                            data: false,
                            remapped: true,
                        });
                    }
                }
            }
            if !is_caller {
                for (parent, name) in &change.entries {
                    if c.dirs.contains(parent) {
                        cb.entries.push(EntryChange {
                            parent: *parent,
                            name: name.clone(),
                        });
                    }
                }
            }
            // An inode that is gone is cached by no one any more, once told.
            for ino in &gone {
                c.maps.remove(ino);
                c.seen.remove(ino);
                c.dirs.remove(ino);
            }
            if !cb.is_empty() {
                out.push((c.callbacks.clone(), cb));
            }
        }
        out
    }
}

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
}

/// The callback side of one session: a queue, and a thread that sends it in order, merging
/// what has piled up into one message.
pub(crate) struct Callbacks {
    /// Who the client is, for the log ("client ADDR (id ...)").
    client: String,
    rpc: RpcClient,
    queue: Mutex<Queue>,
    ready: Condvar,
    /// Whether the client answers: a session that let a callback run past the lease is not
    /// waited for until it answers again.
    responsive: AtomicBool,
    /// Ends the whole session (its request loop watches it).
    end_session: Arc<AtomicBool>,
    /// The connection's session key: callbacks and their answers carry MACs by it.
    key: Option<SessionKey>,
}

impl Callbacks {
    /// The callback channel on a connected queue pair, answered within `lease`.
    pub(crate) fn start(
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
        let me = Arc::new(Callbacks {
            client,
            rpc: RpcClient::new(pd, qp, cq, cfg)?,
            queue: Mutex::new(Queue {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            responsive: AtomicBool::new(true),
            end_session,
            key,
        });
        let run = me.clone();
        std::thread::Builder::new()
            .name("callbacks".into())
            .spawn(move || run.run())?;
        Ok(me)
    }

    /// Queues `cb`; `answered` counts it while the client is responsive, and learns if it
    /// could not be asked.
    pub(crate) fn send(&self, cb: Callback, answered: &Arc<Countdown>) {
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
            drop(q);
            answered.unasked();
            self.end_session.store(true, Ordering::Release);
            self.ready.notify_all();
            return;
        }
        for part in cb.split() {
            if wait {
                answered.add();
            }
            q.items.push_back((part, wait.then(|| answered.clone())));
        }
        self.ready.notify_one();
    }

    /// Tells the session that a lock of each of `inos` went (it waits to take one), not
    /// waited for. Words not sent yet are merged into one, so that a client slow to answer
    /// while others lock and unlock fast is not ended for a backlog of them.
    pub(crate) fn tell_locks_freed(&self, inos: Vec<Ino>) {
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
        self.ready.notify_one();
    }

    /// Stops sending: the session ended. Whoever waits for its answers stops waiting.
    pub(crate) fn close(&self) {
        self.queue.lock().unwrap().closed = true;
        self.ready.notify_all();
    }

    fn run(&self) {
        // Callbacks are numbered in turn (one at a time), and each answer names its number:
        // an old one replayed, or an old answer, is refused.
        let mut sent = 0u64;
        loop {
            let (batch, waiting) = {
                let mut q = self.queue.lock().unwrap();
                while q.items.is_empty() && !q.closed {
                    q = self.ready.wait(q).unwrap();
                }
                if q.closed {
                    for (_, w) in q.items.drain(..) {
                        w.inspect(|w| w.done(false));
                    }
                    return;
                }
                let (mut batch, w) = q.items.pop_front().expect("not empty");
                let mut waiting: Vec<_> = w.into_iter().collect();
                while q.items.front().is_some_and(|(c, _)| batch.has_room_for(c)) {
                    let (c, w) = q.items.pop_front().expect("not empty");
                    batch.merge(c);
                    waiting.extend(w);
                }
                (batch, waiting)
            };
            let key = self.key.as_ref();
            sent += 1;
            let sealed = integrity::seal_numbered(key, integrity::CALLBACK, sent, batch.encode());
            let answered = match self.rpc.call(&sealed) {
                Ok(reply)
                    if integrity::open(key, integrity::ANSWER, sent, &reply)
                        .is_some_and(is_ack) =>
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
            };
            for w in waiting {
                w.done(answered);
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
