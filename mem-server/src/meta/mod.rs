//! The metadata service, on the first node: one metadata channel per client session (RPC over
//! SEND/RECV on one queue pair, callbacks on a second), each request applied to the namespace
//! and the allocator under one lock (metadata operations are short). What a change means for
//! other caches is planned under that lock ([`crate::meta::coherence`]); the callbacks are awaited
//! with it released, and chunks a change freed go to the zeroer only after every holder
//! dropped them (or its lease ran out): a stale chunk map can never reach another file.

pub(crate) mod callbacks;
pub(crate) mod coherence;
mod compaction;
mod effects;
mod freeing;
mod grant_channels;
mod growth;
mod lock_table;
mod metrics;
mod moves;
mod ops;
mod recovery;
pub(crate) mod repair;
pub(crate) mod sessions;
mod state;
mod tails;
#[cfg(test)]
mod tests;
pub(crate) mod zeroer;

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rdmabox::rpc::Dispatcher;
use rdmabox::transport::{MemoryRegion, QpCaps};
use rfs_proto::clock;
use rfs_proto::frame::send_frame;
use rfs_proto::grant::RevokeSession;
use rfs_proto::integrity;
use rfs_proto::message::{readdir_budget, unseal, Request};
use rfs_proto::session_key::SessionKey;
use rfs_proto::types::{AttrChanges, ROOT};
use rfs_proto::Errno;

use self::callbacks::Callbacks;
use self::coherence::Holders;
use self::effects::Effects;
use self::freeing::Quarantine;
use self::grant_channels::GrantChannels;
use self::ops::{Answer, Ctx, Reply};
use self::recovery::Recovery;
use self::repair::Repair;
use self::sessions::{Attached, ClientSession, Sessions};
use self::zeroer::Zeroer;
use crate::access::Policy;
use crate::alloc::Allocator;
use crate::config::NodeConfig;
use crate::grants::Grants;
use crate::journal::{Durable, Guard, Journal, Journaled};
use crate::meta::lock_table::LockTable;
use crate::namespace::Namespace;
use crate::record::Record;
use crate::runtime::{closed_by_peer, Runtime};

use self::state::HandleHolders;
pub(crate) use self::state::MetaState;

pub(crate) struct MetaService {
    pub(crate) state: Journaled<MetaState>,
    /// This node's own pool's id among the data nodes.
    pub(crate) local: u32,
    /// What a restart waits for (nothing after a fresh start).
    recovery: Recovery,
    pub(crate) zeroer: Zeroer,
    /// Bytes of entries a readdir reply may carry: pages are cut to fit a message.
    page_bytes: usize,
    pub(crate) lease: Duration,
    policy: Policy,
    pub(crate) sessions: Sessions,
    /// Freed chunks on their way to reuse.
    quarantine: Quarantine,
    /// How to grant and revoke at each live data node.
    pub(crate) grant_channels: GrantChannels,
    /// Copies of each chunk the file system keeps.
    pub(crate) replicas: usize,
    pub(crate) repair: Repair,
    /// Chunks whose span must move to grow.
    growth: growth::Growth,
    /// Whole chunks made again out of fragmented space, when asked for.
    compaction: compaction::Compaction,
    /// Whether copies move to even the nodes' fill out when one joins (else only on
    /// `rfs rebalance`).
    rebalance_on_join: bool,
    /// Serves every session's calls and callbacks on a pool that grows with what is busy.
    dispatcher: Dispatcher,
}

/// The sequence number and the sealed call (envelope and call) of `frame`, if its MAC by `key`
/// is right for that number.
fn opened_call<'a>(key: Option<&SessionKey>, frame: &'a [u8]) -> Option<(u64, &'a [u8])> {
    let inner = frame.get(..frame.len().checked_sub(integrity::TAG)?)?;
    let (envelope, _) = unseal(inner)?;
    let body = integrity::open(key, integrity::CALL, envelope.seq, frame)?;
    Some((envelope.seq, body))
}

/// How long an allocation waits for chunks being zeroed before it answers ENOSPC (after a
/// restart, every chunk freed before it is zeroed again).
const ZEROING_WAIT: Duration = Duration::from_secs(5);

fn invalid_state(dir: &std::path::Path, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("state directory {}: {why}", dir.display()),
    )
}

/// What extended attributes may cost the node, per file of the file limit: all of them
/// together (one file may take much of it), as the file limit budgets the inodes themselves.
const XATTR_BYTES_PER_FILE: u64 = 256;

/// Whether applying `req` twice would differ from applying it once: its reply is kept for a
/// resend. (Reading calls are simply applied again.)
fn changes_something(req: &Request) -> bool {
    !matches!(
        req,
        Request::Lookup(_)
            | Request::GetAttr(_)
            | Request::Readlink(_)
            | Request::ReadDir(_)
            | Request::ChunkMap(_)
            | Request::GetStatFs(_)
            | Request::ListNodes(_)
            | Request::GetLock(_)
            | Request::GetXattr(_)
            | Request::ListXattr(_)
    )
}

impl MetaService {
    /// The service, with this node's own pool as one of the data nodes, and the kicks its
    /// zeroer thread waits on. With a state directory, the namespace and the data nodes are
    /// those it holds (none yet: a new file system), and every change is journaled there.
    pub(crate) fn new(
        cfg: &NodeConfig,
        advertise: String,
        pool: &Arc<MemoryRegion>,
        chunks: u64,
        grants: &Arc<Grants>,
    ) -> io::Result<(Arc<MetaService>, Receiver<()>)> {
        let mut awaited = HashSet::new();
        let (mut ns, mut alloc, journal, restarted) = match &cfg.state_dir {
            None => (
                Namespace::new(cfg.chunk_size),
                Allocator::default(),
                None,
                false,
            ),
            Some(dir) => {
                let (journal, records) = Journal::open(dir).map_err(|e| {
                    io::Error::new(e.kind(), format!("state directory {}: {e}", dir.display()))
                })?;
                let restarted = !records.is_empty();
                awaited = HandleHolders::replay(&records);
                let (ns, alloc) = if restarted {
                    Self::replay(cfg.chunk_size, &records).map_err(|e| invalid_state(dir, &e))?
                } else {
                    log::info!("state directory {}: a new file system", dir.display());
                    (Namespace::new(cfg.chunk_size), Allocator::default())
                };
                (ns, alloc, Some(journal), restarted)
            }
        };
        ns.journal_changes();
        ns.set_max_inodes(cfg.max_files);
        ns.set_max_xattr_bytes(cfg.max_files.saturating_mul(XATTR_BYTES_PER_FILE));
        alloc.journal_changes();
        if cfg.root_dir != AttrChanges::default() {
            let (root, _) = ns.setattr(ROOT, &cfg.root_dir).map_err(|e| {
                io::Error::other(format!("setting the root directory's mode or owner: {e}"))
            })?;
            log::info!(
                "root directory: mode {:o}, owner {}:{}",
                root.perm,
                root.uid,
                root.gid
            );
        }
        // The pool is new whenever this process is: never one the journal names.
        let (local, lost) = alloc.add_own_pool(
            advertise,
            rdmabox::random::u64(),
            pool.addr(),
            cfg.chunk_size,
            chunks,
        );
        let mut state = MetaState {
            ns,
            alloc,
            holders: Holders::default(),
            frees: 0,
            frozen: HashSet::new(),
            tails_zeroing: HashSet::new(),
            moved: HashMap::new(),
            rebalancing: false,
            locks: LockTable::default(),
            // Still holding until they are back, or the grace is over: a restart meanwhile
            // waits for them too.
            holding: HandleHolders {
                clients: awaited.clone(),
                log: Vec::new(),
            },
        };
        if let Some(j) = &journal {
            // The snapshot that starts the journal has what was made here.
            state.take_records(&mut Vec::new());
            j.start(&state.records())?;
        }
        let (zeroer, wait) = Zeroer::new(local, pool.clone());
        let meta = Arc::new(MetaService {
            state: Journaled::new(state, journal),
            local,
            recovery: Recovery::new(restarted, cfg.lease, awaited),
            zeroer,
            page_bytes: readdir_budget(cfg.rpc.max_msg),
            lease: cfg.lease,
            policy: cfg.policy,
            sessions: Sessions::default(),
            quarantine: Quarantine::default(),
            grant_channels: GrantChannels::new(local, grants.clone()),
            replicas: cfg.replicas as usize,
            repair: Repair::new(cfg.repair_rate),
            growth: growth::Growth::new(),
            compaction: compaction::Compaction::new(),
            rebalance_on_join: cfg.rebalance_on_join,
            dispatcher: Dispatcher::start("session")?,
        });
        for id in lost {
            log::warn!("this node's own pool before the restart (data node {id}) is gone");
            // Down for good (as journaled), not away: only its copies go from the maps.
            meta.drop_copies_on(meta.state.lock(), id);
        }
        Ok((meta, wait))
    }

    /// The namespace and the data nodes a state directory's records rebuild.
    fn replay(chunk_size: u64, records: &[Record]) -> Result<(Namespace, Allocator), String> {
        let started = Instant::now();
        let (ns, skipped) = Namespace::replay(chunk_size, records)?;
        let alloc = Allocator::replay(chunk_size, records)?;
        if skipped > 0 {
            log::warn!("replay: {skipped} records named inodes that were not there");
        }
        log::info!(
            "replayed {} records in {:.0?}: {} inodes, {} data nodes known",
            records.len(),
            started.elapsed(),
            ns.inode_count(),
            alloc.node_counts().1,
        );
        Ok((ns, alloc))
    }

    /// A data node joined: chunks short of copies may get them there, a node back after a
    /// restart has chunks to zero, and copies move to even the fill out (when asked to).
    pub(crate) fn node_joined(&self) {
        if self.rebalance_on_join {
            self.state.lock().rebalancing = true;
        }
        self.repair.kick();
        self.zeroer.kick();
    }

    /// Whether chunks on node `id` count as copies: it is alive, or it is away and may come
    /// back any moment (shortly after a restart).
    pub(crate) fn counts_as_copy(&self, alloc: &Allocator, id: u32) -> bool {
        alloc.is_alive(id) || (alloc.is_away(id) && self.recovery.awaiting_nodes(alloc))
    }

    /// Data node `id` left (its join connection closed): nothing more is allocated there, and
    /// it is away until it comes back with its pool. How many copies the maps named there.
    pub(crate) fn node_left(&self, id: u32) -> u64 {
        // One hold of the lock: a return may follow the leave at once, and must find its
        // copies as the leave left them.
        let mut st = self.state.lock();
        st.alloc.leave(id);
        self.drop_copies_on(st, id)
    }

    /// Node `id` is not up: its copies of chunks that have others go from the maps, to be made
    /// again elsewhere (a chunk whose only copy is there keeps it: reading it fails until the
    /// node is back, rather than reading zeros). How many copies the maps named there.
    pub(crate) fn drop_copies_on(&self, mut st: Guard<'_, MetaState>, id: u32) -> u64 {
        let held = st.ns.copies_per_node().get(&id).copied().unwrap_or(0);
        let lost = st.ns.drop_node(id);
        if lost > 0 {
            self.repair.lost(lost);
            drop(st);
            log::warn!("data node {id}: {lost} chunks lost a copy; copying them again");
        }
        held
    }

    pub(crate) fn start_zeroer(
        self: &Arc<Self>,
        node: Arc<Runtime>,
        wait: Receiver<()>,
    ) -> io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("zeroer".into())
            .spawn(move || me.zeroer.run(&node, &me.state, wait))?;
        Ok(())
    }

    /// Serves one connection of client `client_id`'s session until it goes (first telling the
    /// client whether its session was still there); the session waits a grace period (twice
    /// the lease) for the client to come back before it ends. Returns once the connection is
    /// set up: its calls and callbacks are served by the dispatcher's pool, and `slot` (what
    /// the connection holds of the node's admission) goes with the connection.
    pub(crate) fn serve(
        self: &Arc<Self>,
        node: &Runtime,
        mut s: TcpStream,
        client_id: u64,
        key: Option<SessionKey>,
        slot: impl Send + 'static,
    ) -> io::Result<()> {
        let peer = s.peer_addr()?;
        let mut qps = node.queue_pairs(&node.pd, &mut s, key.as_ref(), 2, QpCaps::default())?;
        let (cb_qp, cb_cq) = qps.pop().expect("two queue pairs");
        let calls = qps.pop().expect("two queue pairs");
        let stop = Arc::new(AtomicBool::new(false));
        let who = format!("client {peer} (id {client_id:016x})");
        let callbacks = Callbacks::start(
            &self.dispatcher,
            &node.pd,
            cb_qp,
            cb_cq,
            self.lease,
            who.clone(),
            stop.clone(),
            key.clone(),
        )?;
        // From here on, every way out goes through `ended` below.
        let attached = Arc::new(
            self.sessions
                .attach(client_id, stop.clone(), peer.to_string()),
        );
        let replaced =
            self.state
                .lock()
                .holders
                .attach(attached.id, attached.epoch(), callbacks.clone());
        if let Some(old) = replaced {
            old.close();
        }
        if attached.resumed {
            log::warn!("{who} reconnected");
        }
        let greeted = send_frame(&mut s, &[attached.resumed as u8]);
        let ended = {
            let (me, attached, who) = (self.clone(), attached.clone(), who.clone());
            move |result: io::Result<()>| {
                let closed = closed_by_peer(&s);
                let _ = s.shutdown(std::net::Shutdown::Both);
                callbacks.close();
                me.connection_ended(client_id, &attached, who, result, closed);
                drop(slot);
            }
        };
        if let Err(e) = greeted {
            ended(Err(e));
            return Ok(());
        }
        let handler = {
            let (me, stop) = (self.clone(), stop.clone());
            move |frame: &[u8]| match opened_call(key.as_ref(), frame) {
                Some((seq, body)) => {
                    let reply = me.handle(&attached, body);
                    integrity::seal(key.as_ref(), integrity::REPLY, seq, reply)
                }
                None => {
                    // Not the client's: whoever sent it is on the path. Nothing more is
                    // taken from this connection.
                    log::error!("{who}: a call without the session's MAC; connection closed");
                    stop.store(true, Ordering::Release);
                    Vec::new()
                }
            }
        };
        self.dispatcher
            .serve(&node.pd, calls, node.cfg.rpc, stop, handler, ended)
    }

    /// A connection of a session ended (`closed`: by its client); the session waits for the
    /// client to come back.
    fn connection_ended(
        self: &Arc<Self>,
        client_id: u64,
        attached: &Arc<Attached>,
        who: String,
        result: io::Result<()>,
        closed: bool,
    ) {
        if !self.sessions.detach(client_id, attached) {
            return;
        }
        match &result {
            Err(e) if !closed => log::warn!("{who}: metadata connection ended: {e}"),
            _ => log::info!("{who}: connection closed"),
        }
        self.expire_later(client_id, attached.clone(), who);
    }

    /// Ends a detached session unless its client comes back within the grace period: twice
    /// the lease, since clients resend for up to their call deadline, which the lease is meant
    /// to exceed.
    fn expire_later(self: &Arc<Self>, client_id: u64, attached: Arc<Attached>, who: String) {
        let me = self.clone();
        let grace = self.lease * 2;
        let expire = move || {
            if let Some(gone) = me.sessions.expire(client_id, &attached) {
                let held = gone.lock().unwrap().open.len();
                if held > 0 {
                    log::warn!(
                        "{who}: not back within {grace:?}; session ended, its {held} open \
                         files closed and its locks dropped"
                    );
                } else {
                    // What a clean unmount leaves: nothing to say at info.
                    log::debug!("{who}: session ended");
                }
                me.end_session(&gone);
            }
        };
        self.dispatcher.workers().run_after(grace, expire);
    }

    /// A session ended: it caches nothing any more, and its handles are released (with the
    /// chunks of files it had unlinked, and what closed files hold past their size).
    fn end_session(&self, session: &Mutex<ClientSession>) {
        let session = session.lock().unwrap();
        let mut st = self.state.lock();
        st.holders.remove(session.id);
        let mut effects = Effects {
            keep_past_size: self.recovery.awaiting_clients(),
            woken: st.locks.drop_session(session.id),
            ..Effects::default()
        };
        for (&ino, h) in &session.open {
            for _ in 0..h.all {
                ops::release(&mut st.ns, ino, &mut effects);
            }
        }
        st.holding.set(session.client, false);
        self.settle(st, Some(session.id), effects);
        for (&node, &data) in &session.data {
            self.grant_channels
                .tell(node, RevokeSession { session: data }.into());
        }
    }

    /// Decodes, applies and answers one call, once: a call resent after a reconnection gets
    /// the reply it had.
    pub(crate) fn handle(&self, attached: &Attached, body: &[u8]) -> Vec<u8> {
        let read = clock::now_ms();
        let Some((envelope, call)) = unseal(body) else {
            log::warn!("metadata call without an envelope");
            return Reply::failed(0, Errno::EPROTO).bytes;
        };
        let seq = envelope.seq;
        let op = call.get(1).copied().unwrap_or(0);
        let mut session = attached.session.lock().unwrap();
        if !attached.is_current() {
            // A newer connection took the session over: the client resends there.
            return Reply::failed(op, Errno::EIO).bytes;
        }
        if let Some(reply) = session.replayed(seq, envelope.oldest) {
            log::debug!("call {seq} resent: answered from the reply cache");
            return reply;
        }
        if session.is_stale(seq, envelope.oldest) {
            log::warn!(
                "call {seq} of session {} was answered before: a copy, not applied",
                session.id
            );
            return Reply::failed(op, Errno::EIO).bytes;
        }
        // Its age now, with the wait for the session's lock (another call of its) counted.
        let age = session.clock.age(envelope.sent_ms, read) + (clock::now_ms() - read);
        if clock::too_late(age, envelope.budget_ms as u64) {
            // The caller has given up (or is about to): applying it now would do it behind
            // the caller's back. Not remembered: a resend with time left is applied.
            log::warn!(
                "call {seq} of session {} arrived {age} ms late for its {} ms: not applied",
                session.id,
                envelope.budget_ms
            );
            return Reply::failed(op, Errno::EIO).bytes;
        }
        let req = match Request::decode(call) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("malformed metadata request: {e}");
                let op = call.get(1).copied().unwrap_or(0);
                return Reply::failed(op, Errno::EPROTO).bytes;
            }
        };
        let id = session.id;
        if !matches!(
            req,
            Request::Reclaim(_)
                | Request::SetLock(rfs_proto::message::SetLock { reclaim: true, .. })
        ) {
            self.recovery.client_back(session.client);
        }
        // Space being zeroed is free space: an allocation that only it would satisfy waits
        // for the zeroer rather than failing with ENOSPC.
        let give_up = Instant::now() + ZEROING_WAIT;
        // Fewer copies rather than none: the wait for returning nodes leaves the caller half
        // the time it had left.
        let left_ms = (envelope.budget_ms as u64).saturating_sub(age);
        let copies_wait_until = Instant::now() + Duration::from_millis(left_ms / 2);
        let busy_wait_until = Instant::now() + Duration::from_millis(left_ms.saturating_sub(50));
        let mut reply = loop {
            let mut st = self.state.lock();
            if let Request::SetAttr(m) = &req {
                if ops::cut_must_wait(&st, m) && Instant::now() < busy_wait_until {
                    // Another cut's tail is being zeroed, or a copy made: moments, as a rule.
                    drop(st);
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
            }
            if matches!(req, Request::Allocate(_))
                && self.copies_are_coming_back(&st.alloc)
                && Instant::now() < copies_wait_until
            {
                // Chunks allocated now would get fewer copies than the file system keeps.
                drop(st);
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let mut effects = Effects {
                keep_past_size: self.recovery.awaiting_clients(),
                ..Effects::default()
            };
            let held = session.holds_handles();
            let answer = ops::apply(
                &mut Ctx {
                    svc: self,
                    st: &mut st,
                    cs: &mut session,
                    fx: &mut effects,
                },
                &req,
            );
            if session.holds_handles() != held {
                st.holding.set(session.client, !held);
            }
            // Space is also coming while data nodes known from the journal come back.
            let short = matches!(req, Request::Allocate(_))
                && matches!(&answer, Answer::Now(r) if r.errno == Some(Errno::ENOSPC))
                && (st.alloc.zeroing() > 0 || self.recovery.awaiting_nodes(&st.alloc));
            if short && Instant::now() < give_up {
                drop(st);
                self.zeroer.kick();
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            let closed = std::mem::take(&mut effects.closed);
            let closed_for_writing = std::mem::take(&mut effects.closed_for_writing);
            let detached = std::mem::take(&mut effects.detached);
            self.settle(st, Some(id), effects);
            // Calls of one session are applied one at a time (its lock is held), so its
            // grants and revocations reach each node in the order of its calls.
            self.grant_channels
                .revoke(&session.data, &closed_for_writing, true);
            self.grant_channels.revoke(&session.data, &closed, false);
            for (node, old) in detached {
                self.grant_channels
                    .tell(node, RevokeSession { session: old }.into());
            }
            break match answer {
                Answer::Grant(g) => self.grant(&session.data, g).bytes,
                Answer::Now(reply) => reply.bytes,
            };
        };
        // Nothing is answered that a restart could take back.
        if let Err(e) = self.state.sync() {
            log::error!("call {seq} of session {id}: {e}");
            reply = Reply::failed(op, Errno::EIO).bytes;
        }
        if changes_something(&req) {
            session.remember(seq, &reply);
        }
        reply
    }
}
