//! Metadata calls: numbered, resent after a reconnection within their deadline, and what a
//! client holds taken again from a service that restarted.

use super::*;

impl Client {
    /// Sends call `seq` until it is answered, resending it over new connections if the
    /// connection breaks, until `deadline`; `session` is the count of lost sessions when the
    /// call was first made.
    pub(super) fn exchange_until(
        &self,
        seq: u64,
        request: &[u8],
        deadline: Instant,
        session: u64,
        used: &mut Option<Arc<Channel>>,
    ) -> io::Result<Vec<u8>> {
        loop {
            let channel = self.channel(deadline)?;
            *used = Some(channel.clone());
            if self.lost_session_of(request, session) {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the metadata node lost this client's session while the call was under way \
                     (it may or may not have been applied)",
                ));
            }
            match self.send_on(&channel, seq, request, deadline) {
                Err(e) if channel.is_broken() && Instant::now() < deadline => {
                    log::debug!("call {seq}: {e}; resending over a new connection");
                }
                r => return r,
            }
        }
    }

    /// Whether `request`, first made when the count of lost sessions was `session`, may have
    /// been applied by a session lost since and must not be sent again.
    pub(super) fn lost_session_of(&self, request: &[u8], session: u64) -> bool {
        let repeatable = request
            .get(1)
            .and_then(|&op| RequestOp::from_code(op))
            .is_some_and(RequestOp::repeatable);
        self.sessions_lost.load(Ordering::Acquire) != session && !repeatable
    }

    /// Drops the metadata connection `used` (its node stayed silent past a call's deadline),
    /// if it is still the current one: the next call dials again. One another call already
    /// replaced is left alone.
    pub(super) fn abandon_channel(&self, used: &Arc<Channel>) {
        if let Some(c) = self.channel.lock().unwrap().as_ref() {
            if Arc::ptr_eq(c, used) {
                c.sever();
            }
        }
    }

    /// Sends call `seq` over `channel` once, and waits for its answer until `deadline`.
    pub(super) fn send_on(
        &self,
        channel: &Channel,
        seq: u64,
        request: &[u8],
        deadline: Instant,
    ) -> io::Result<Vec<u8>> {
        let oldest = self.calls.lock().unwrap().outstanding.first().copied();
        let left = deadline.saturating_duration_since(Instant::now());
        let envelope = Envelope {
            seq,
            oldest: oldest.unwrap_or(seq),
            sent_ms: clock::now_ms(),
            budget_ms: left.as_millis().min(u32::MAX as u128) as u32,
        };
        let key = channel.key.as_ref();
        let sealed = integrity::seal(key, integrity::CALL, seq, seal(&envelope, request));
        let reply = channel.rpc.call_within(&sealed, left)?;
        integrity::open(key, integrity::REPLY, seq, &reply)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| {
                // Not the node's: the connection is no one's to trust any more.
                channel.sever();
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a reply without the session's MAC: altered on the path",
                )
            })
    }

    /// A sequence number for a new call, counted as under way until [`Client::end_call`].
    pub(super) fn begin_call(&self) -> u64 {
        let mut c = self.calls.lock().unwrap();
        c.next += 1;
        let seq = c.next;
        c.outstanding.insert(seq);
        seq
    }

    pub(super) fn end_call(&self, seq: u64) {
        self.calls.lock().unwrap().outstanding.remove(&seq);
    }

    /// Takes this client's open handles and locks again on `channel`, a new session, before
    /// anything else is sent on it; what cannot be taken is logged (those files fail with
    /// EBADF). Answers the locks not taken again.
    pub(super) fn reclaim(&self, channel: &Channel, deadline: Instant) -> Vec<HeldLock> {
        let Some(Held { handles, locks }) = self.held.get().map(|list| list()) else {
            return Vec::new();
        };
        if !handles.is_empty() {
            self.reclaim_handles(channel, &handles, deadline);
        }
        let lost: Vec<HeldLock> = locks
            .into_iter()
            .filter(|&(ino, owner, lock)| {
                let req = SetLock {
                    ino,
                    owner,
                    lock,
                    wait: false,
                    reclaim: true,
                };
                let seq = self.begin_call();
                let answer = self.send_on(channel, seq, &encode_call(&req), deadline);
                self.end_call(seq);
                // Lost only when the node says so (it refused, or someone holds it now): on
                // a channel that broke meanwhile, the locks are asked again at the next dial.
                answer
                    .ok()
                    .and_then(|raw| decode_reply::<SetLock>(&raw).ok())
                    .is_some_and(|r| r != Ok(None))
            })
            .collect();
        if !lost.is_empty() {
            log::error!(
                "{} file locks not taken again: the metadata node ended this client's session \
                 (or was past its grace period), and others may have taken them since",
                lost.len()
            );
        }
        lost
    }

    pub(super) fn reclaim_handles(
        &self,
        channel: &Channel,
        handles: &[(Ino, FileAccess)],
        deadline: Instant,
    ) {
        let mut taken = 0;
        for part in handles.chunks(MAX_LIST as usize) {
            let seq = self.begin_call();
            let req = Reclaim {
                handles: part.to_vec(),
            };
            let answer = self.send_on(channel, seq, &encode_call(&req), deadline);
            self.end_call(seq);
            let taken_now =
                answer.map_err(|e| e.to_string()).and_then(|raw| {
                    match decode_reply::<Reclaim>(&raw).map_err(|e| e.to_string())? {
                        Ok(n) => Ok(n),
                        Err(e) => Err(e.to_string()),
                    }
                });
            match taken_now {
                Ok(n) => taken += n as usize,
                Err(e) => log::warn!("reclaiming open files: {e}"),
            }
        }
        if taken == handles.len() {
            log::warn!("{taken} open handles taken again");
        } else {
            log::warn!(
                "{taken} of {} open handles taken again: the others' files are gone, or the \
                 metadata node forgot them (no state directory, or past its grace period)",
                handles.len()
            );
        }
    }

    /// The live channel, reconnecting if it broke (until `deadline`).
    /// Whether the metadata connection is up: not lost, or lost and already replaced (a
    /// lost one is noticed at once, replaced at the next call).
    pub fn metadata_connected(&self) -> bool {
        self.channel
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|c| !c.is_broken())
    }

    /// Dials the metadata service now if the connection is lost (within a call's deadline),
    /// taking our handles back and telling the notice handler, as the next call would: an
    /// idle client must not wait for a call to find a restarted node, whose grace period for
    /// our handles may be over by then. A connection severed on request stays down.
    pub fn redial(&self) -> io::Result<()> {
        if self.metadata_connected() || self.severed_on_request.load(Ordering::Acquire) {
            return Ok(());
        }
        let timeout = Duration::from_millis(self.call_timeout_ms.load(Ordering::Relaxed));
        self.channel(Instant::now() + timeout).map(drop)
    }

    /// Waits (up to `limit`) while another thread tells the notice handler of a
    /// reconnection: an answer on the new connection (a lock granted, a file opened) must not
    /// reach the application before what was cached under the old one is dropped. Called with
    /// nothing held that the handler may need: calls themselves never wait for it.
    pub fn reconnection_settled(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let me = std::thread::current().id();
        let mut r = self.revalidating.lock().unwrap();
        while r.is_some_and(|t| t != me) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            r = self.revalidated.wait_timeout(r, left).unwrap().0;
        }
    }

    pub(super) fn channel(&self, deadline: Instant) -> io::Result<Arc<Channel>> {
        let live = |c: &Option<Arc<Channel>>| c.as_ref().filter(|c| !c.is_broken()).cloned();
        if let Some(c) = live(&self.channel.lock().unwrap()) {
            return Ok(c);
        }
        let mut locks_lost = Vec::new();
        let (c, broken, _gate) = {
            let _one = self.reconnecting.lock().unwrap();
            if let Some(c) = live(&self.channel.lock().unwrap()) {
                return Ok(c); // another thread reconnected meanwhile
            }
            let broken = self.channel.lock().unwrap().take();
            if let Some(b) = &broken {
                // Closed at once: a restarted service cannot listen on its port again while
                // its side of our old connection waits for us to close ours.
                b.sever();
                log::warn!(
                    "metadata connection to {} lost; reconnecting",
                    self.meta_addr
                );
            }
            let c = Arc::new(self.reconnect(deadline)?);
            self.severed_on_request.store(false, Ordering::Release);
            if !c.resumed {
                // Before any call can use the new channel.
                self.sessions_lost.fetch_add(1, Ordering::AcqRel);
                locks_lost = self.reclaim(&c, deadline);
            }
            let gate = Revalidated {
                client: self,
                before: *self.revalidating.lock().unwrap(),
            };
            if self.on_notice.get().is_some() {
                *self.revalidating.lock().unwrap() = Some(std::thread::current().id());
            }
            *self.channel.lock().unwrap() = Some(c.clone());
            (c, broken, gate)
        };
        // Outside the lock: the old channel's callback thread may still be busy, and the
        // handler may take a while; neither should hold up calls on the new channel.
        drop(broken);
        if c.resumed {
            log::warn!("metadata connection to {} re-established", self.meta_addr);
        } else {
            log::warn!(
                "metadata connection to {} re-established in a new session (the node \
                 restarted, or had ended this client's session)",
                self.meta_addr
            );
        }
        if let Some(handle) = self.on_notice.get() {
            handle(Notice::Reconnected);
            if !locks_lost.is_empty() {
                handle(Notice::LocksLost(locks_lost));
            }
        }
        Ok(c)
    }

    /// Dials the service again, with backoff, until `deadline`.
    pub(super) fn reconnect(&self, deadline: Instant) -> io::Result<Channel> {
        // At most a quarter second between attempts: how soon mounts work again after a
        // restart is this much past the restart.
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(250));
        loop {
            let opened = Channel::open(
                &self.ctx,
                &self.pd,
                self.meta_addr,
                &self.cfg,
                self.client_id,
                &self.on_notice,
            );
            match opened {
                Ok(c) => return Ok(c),
                Err(e) => {
                    let wait = backoff.next_pause();
                    if Instant::now() + wait >= deadline {
                        // A refusal (the secret, the version) says so: not an outage to wait
                        // out.
                        let kind = match is_outage(&e) {
                            true => io::ErrorKind::TimedOut,
                            false => e.kind(),
                        };
                        return Err(io::Error::new(
                            kind,
                            format!("metadata node {} unreachable: {e}", self.meta_addr),
                        ));
                    }
                    log::debug!("reconnecting to {}: {e}", self.meta_addr);
                    std::thread::sleep(wait);
                }
            }
        }
    }
}
