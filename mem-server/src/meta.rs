//! The metadata service, on the first node: one metadata channel per client session (RPC over
//! SEND/RECV on one queue pair, callbacks on a second), each request applied to the namespace
//! and the allocator under one lock (metadata operations are short). What a change means for
//! other caches is planned under that lock ([`crate::coherence`]); the callbacks are awaited
//! with it released, and chunks a change freed go to the zeroer only after every holder
//! dropped them (or its lease ran out): a stale chunk map can never reach another file.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use rdmabox::rpc;
use rdmabox::transport::{MemoryRegion, QpCaps};
use rfs_proto::clock;
use rfs_proto::frame::send_frame;
use rfs_proto::grant::{GrantChunks, LinkRequest, RevokeChunks, RevokeFreed, RevokeSession};
use rfs_proto::handshake::SessionKey;
use rfs_proto::integrity;
use rfs_proto::locks::UNLOCK;
use rfs_proto::message::{encode_reply, readdir_budget, unseal, Call, Made, Request, RequestOp};
use rfs_proto::types::{
    Attr, AttrChanges, Caller, ChunkRef, FileKind, Ino, Name, NodeInfo, Owner, Replicas, StatFs,
    MAY_WRITE, ROOT,
};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::Errno;

use crate::access::{
    check_access_bits, check_change, check_list, check_open, check_rename, check_search,
    check_setattr, check_sticky, made_in, Policy,
};
use crate::alloc::Allocator;
use crate::coherence::{Callbacks, Change, Countdown, Holders, Recall, SessionId};
use crate::grants::Grants;
use crate::journal::{Durable, Guard, Journal, Journaled};
use crate::link::{Asked, Link};
use crate::locks::{LockTable, Woken};
use crate::namespace::Namespace;
use crate::node::{wait_for_close, NodeConfig, Shared};
use crate::record::Record;
use crate::repair::Repair;
use crate::sessions::{Attached, ClientSession, Handles, Sessions};
use crate::zeroer::Zeroer;
use rfs_proto::metrics::Metric;

/// The namespace, the allocator and who caches what, under one lock (journaled: see
/// [`Journaled`]).
pub(crate) struct MetaState {
    pub(crate) ns: Namespace,
    pub(crate) alloc: Allocator,
    pub(crate) holders: Holders,
    /// How many frees there were: grants decided now carry it, so that a data node refuses
    /// one that arrives after a later free was revoked.
    frees: u64,
    /// Chunks being copied to new replicas: maps of them are not handed out (EAGAIN: the
    /// client asks again) until the copies are in them.
    pub(crate) frozen: HashSet<(Ino, u64)>,
    /// Every client's file locks (not journaled: clients take them again after a restart).
    locks: LockTable,
    /// The clients holding handles open (journaled): those a restart waits for.
    holding: HandleHolders,
}

/// The clients that hold handles open, journaled as they come and go: after a restart, those
/// that held some are waited for (to take them back) before closed files give back what they
/// kept past their size and files unlinked while open go.
#[derive(Default)]
pub(crate) struct HandleHolders {
    clients: HashSet<u64>,
    log: Vec<Record>,
}

impl HandleHolders {
    /// Client `client` holds handles now (`holds`), or no more.
    fn set(&mut self, client: u64, holds: bool) {
        let changed = if holds {
            self.clients.insert(client)
        } else {
            self.clients.remove(&client)
        };
        if changed {
            self.log.push(Record::Holding { client, holds });
        }
    }

    /// The clients that `records` leave holding handles.
    fn replay(records: &[Record]) -> HashSet<u64> {
        let mut clients = HashSet::new();
        for r in records {
            if let Record::Holding { client, holds } = *r {
                if holds {
                    clients.insert(client);
                } else {
                    clients.remove(&client);
                }
            }
        }
        clients
    }
}

impl Durable for MetaState {
    fn take_records(&mut self, out: &mut Vec<Record>) {
        let before = out.len();
        self.ns.take_records(out);
        self.alloc.take_records(out);
        // A client that now holds handles is journaled before the call that made it so is
        // answered: a restart that did not know it would end its grace without it, trimming
        // what it wrote past sizes. One that holds none any more rides along with the next
        // change journaled anyway (lost, it is only waited for in vain until the grace ends),
        // rather than costing an fsync at every last close.
        let holds = |r: &Record| matches!(r, Record::Holding { holds: true, .. });
        if out.len() > before || self.holding.log.iter().any(holds) {
            out.append(&mut self.holding.log);
        }
    }

    fn records(&self) -> Vec<Record> {
        let mut all = self.ns.records();
        all.extend(self.alloc.records());
        all.extend(self.holding.clients.iter().map(|&client| Record::Holding {
            client,
            holds: true,
        }));
        all
    }
}

pub(crate) struct MetaService {
    pub(crate) state: Journaled<MetaState>,
    /// This node's own pool's id among the data nodes.
    pub(crate) local: u32,
    /// After a restart from the state directory: until when data nodes known from the
    /// journal are waited for (their chunks count as copies), and until when clients may
    /// reclaim the handles they had (files unlinked while open stay for them).
    nodes_until: Option<Instant>,
    reclaim_until: Option<Instant>,
    /// After a restart: the clients that held handles and are not back yet (none: the grace
    /// for what they may have written past sizes is over before its time).
    awaited_clients: Mutex<HashSet<u64>>,
    pub(crate) zeroer: Zeroer,
    /// Bytes of entries a readdir reply may carry: pages are cut to fit a message.
    page_bytes: usize,
    pub(crate) lease: Duration,
    policy: Policy,
    sessions: Sessions,
    /// Freed chunks on their way to reuse, each batch with when it is due (at once, or the end
    /// of the lease of a holder that could not be asked) and whether that was a lease.
    quarantine: Mutex<Vec<(Instant, Freed, bool)>>,
    /// How to grant and revoke at each live data node.
    links: Mutex<HashMap<u32, Arc<Link>>>,
    quarantined: Condvar,
    /// Copies of each chunk the file system keeps.
    pub(crate) replicas: usize,
    pub(crate) repair: Repair,
}

/// The sequence number and the sealed call (envelope and call) of `frame`, if its MAC by `key`
/// is right for that number.
fn opened_call<'a>(key: Option<&SessionKey>, frame: &'a [u8]) -> Option<(u64, &'a [u8])> {
    let inner = frame.get(..frame.len().checked_sub(integrity::TAG)?)?;
    let (envelope, _) = unseal(inner)?;
    let body = integrity::open(key, integrity::CALL, envelope.seq, frame)?;
    Some((envelope.seq, body))
}

/// How long a restarted metadata node waits for the data nodes its journal knows (they join
/// again within a second of its start) before their chunks are copied elsewhere.
const REJOIN_WAIT: Duration = Duration::from_secs(5);
/// How long an allocation waits for chunks being zeroed before it answers ENOSPC (after a
/// restart, every chunk freed before it is zeroed again).
const ZEROING_WAIT: Duration = Duration::from_secs(5);
/// How long a chunk map waits for a data node's grant: a live node answers in microseconds; a
/// stopped one must not hold the caller past its I/O deadline (1 s at the least). The map then
/// goes out ungranted for that node, and the client fails the transfer (or asks again).
const GRANT_WAIT: Duration = Duration::from_millis(800);
/// How long dropping a failed replica waits for the other holders of the file's map to let it
/// go before the writer is answered: they answer in microseconds unless their own transfers
/// are under way, and two writers each dropping a replica wait on each other's transfers.
const REMAP_WAIT: Duration = Duration::from_millis(200);

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
    )
}

/// What applying a request did beyond its answer: chunks it freed, the change for caches, and
/// grants to ask for or revoke at the data nodes (once the state lock is released).
#[derive(Default)]
struct Effects {
    freed: Vec<ChunkRef>,
    change: Change,
    grant: Option<Granting>,
    /// Chunks whose grants to the session go: files it closed its last handle of.
    closed: Vec<ChunkRef>,
    /// Chunks whose grants for writing go: files it closed its last writable handle of.
    closed_for_writing: Vec<ChunkRef>,
    /// Data sessions the session attached before and no more, by node: all their grants go.
    detached: Vec<(u32, u64)>,
    /// Holders are waited for only briefly ([`REMAP_WAIT`]).
    quick: bool,
    /// Sessions waiting for a lock of a file that one of went: told, not waited for.
    woken: Woken,
    /// Closed files keep their chunks past their size: after a restart, until clients took
    /// their handles again, a file closed here may be open at a client that wrote past the
    /// size it committed, into chunks allocated ahead.
    keep_past_size: bool,
}

/// A chunk map to hand out once its chunks are granted to the caller's data sessions.
struct Granting {
    op: RequestOp,
    writable: bool,
    /// The free number when the map was read.
    seq: u64,
    chunks: Vec<(u64, Replicas)>,
}

/// Chunks freed together, and their free number.
struct Freed {
    seq: u64,
    chunks: Vec<ChunkRef>,
    /// [`Allocator::rejoins`] when they were freed.
    rejoins: u64,
}

/// Whether any of chunks `first..first+count` of `ino` is being copied.
fn invalid_state(dir: &std::path::Path, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("state directory {}: {why}", dir.display()),
    )
}

fn is_frozen(frozen: &HashSet<(Ino, u64)>, ino: Ino, first: u64, count: u32) -> bool {
    let span = first..first.saturating_add(count as u64);
    frozen
        .iter()
        .any(|&(i, index)| i == ino && span.contains(&index))
}

/// The chunks of `refs`, by node.
fn by_node<'a>(refs: impl IntoIterator<Item = &'a ChunkRef>) -> HashMap<u32, Vec<u64>> {
    let mut out: HashMap<u32, Vec<u64>> = HashMap::new();
    for c in refs {
        out.entry(c.node).or_default().push(c.addr);
    }
    out
}

impl Effects {
    /// Records chunks freed from `ino` (from chunk index `from` on), with its contents.
    fn freed(&mut self, ino: Ino, from: u64, chunks: Vec<ChunkRef>) {
        self.give_back(ino, from, chunks, true);
    }

    /// Records chunks past `ino`'s size given back (from chunk index `from` on): its
    /// contents stay as they were.
    fn trimmed(&mut self, ino: Ino, from: u64, chunks: Vec<ChunkRef>) {
        self.give_back(ino, from, chunks, false);
    }

    fn give_back(&mut self, ino: Ino, from: u64, chunks: Vec<ChunkRef>, cut: bool) {
        if !chunks.is_empty() {
            self.change.recalls.push(Recall { ino, from, cut });
            self.freed.extend(chunks);
        }
    }
}

/// What the session is told, it may cache: it is told again when that changes. A name looked
/// up or made in a directory `dir`, its kernel may keep.
fn told(
    holders: &mut Holders,
    session: SessionId,
    r: Result<Attr, Errno>,
    dir: Option<Ino>,
) -> Result<Attr, Errno> {
    if let Ok(a) = &r {
        holders.saw(session, a.ino);
        dir.inspect(|&d| holders.looked_in(session, d));
    }
    r
}

/// Directory `dir`'s attributes after a change `session` made in it: it may keep them, so it
/// is told when they change again.
fn dir_after(
    holders: &mut Holders,
    session: SessionId,
    ns: &Namespace,
    dir: Ino,
) -> Result<Attr, Errno> {
    let a = ns.getattr(dir)?;
    holders.saw(session, dir);
    Ok(a)
}

/// The answer to a call that added a name to `dir` (see [`told`] and [`dir_after`]).
fn made(
    holders: &mut Holders,
    session: SessionId,
    ns: &Namespace,
    r: Result<Attr, Errno>,
    dir: Ino,
) -> Result<Made, Errno> {
    let attr = told(holders, session, r, Some(dir))?;
    let dir = dir_after(holders, session, ns, dir)?;
    Ok(Made { attr, dir })
}

/// The reply to `call`: typed by the call, so each request can only get its own kind of answer.
fn answer<C: Call>(_call: &C, result: Result<C::Reply, Errno>) -> Vec<u8> {
    encode_reply(C::OP as u8, &result)
}

impl MetaService {
    /// The metadata service's figures, for the metrics endpoint.
    pub(crate) fn metrics(&self) -> Vec<Metric> {
        let st = self.state.lock();
        let (chunks, free) = st.alloc.totals();
        let (alive, nodes) = st.alloc.node_counts();
        let (zeroing, inodes) = (st.alloc.zeroing(), st.ns.inode_count());
        let locks = st.locks.count() as u64;
        drop(st);
        vec![
            Metric::gauge("chunks", "Chunks of every data node", chunks),
            Metric::gauge("chunks_free", "Chunks free (some being zeroed)", free),
            Metric::gauge(
                "chunks_zeroing",
                "Chunks freed and not yet allocatable",
                zeroing,
            ),
            Metric::gauge("data_nodes_alive", "Data nodes up", alive as u64),
            Metric::gauge("data_nodes", "Data nodes ever joined", nodes as u64),
            Metric::gauge("inodes", "Files, directories and links", inodes),
            Metric::gauge("file_locks", "File locks held, over every client", locks),
            Metric::gauge(
                "chunks_short_of_replicas",
                "Chunks with fewer copies than --replicas",
                self.repair.short(),
            ),
        ]
    }

    /// The service, with this node's own pool as one of the data nodes, and the kicks its
    /// zeroer thread waits on. With a state directory, the namespace and the data nodes are
    /// those it holds (none yet: a new file system), and every change is journaled there.
    pub(crate) fn new(
        cfg: &NodeConfig,
        advertise: String,
        pool: &MemoryRegion,
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
        let (zeroer, wait) = Zeroer::new(local);
        let meta = Arc::new(MetaService {
            state: Journaled::new(state, journal),
            local,
            nodes_until: restarted.then(|| Instant::now() + REJOIN_WAIT.min(cfg.lease * 2)),
            reclaim_until: restarted.then(|| Instant::now() + cfg.lease * 2),
            awaited_clients: Mutex::new(awaited),
            zeroer,
            page_bytes: readdir_budget(cfg.rpc.max_msg),
            lease: cfg.lease,
            policy: cfg.policy,
            sessions: Sessions::default(),
            quarantine: Mutex::default(),
            quarantined: Condvar::new(),
            links: Mutex::new(HashMap::from([(
                local,
                Arc::new(Link::Local(grants.clone())),
            )])),
            replicas: cfg.replicas as usize,
            repair: Repair::new(cfg.repair_rate),
        });
        for id in lost {
            log::warn!("this node's own pool before the restart (data node {id}) is gone");
            meta.node_left(id);
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

    /// A data node joined: chunks short of copies may get them there, and a node back after
    /// a restart has chunks to zero.
    pub(crate) fn node_joined(&self) {
        self.repair.kick();
        self.zeroer.kick();
    }

    /// Whether chunks on node `id` count as copies: it is alive, or it is known from the
    /// journal and may still come back.
    pub(crate) fn counts_as_copy(&self, alloc: &Allocator, id: u32) -> bool {
        alloc.is_alive(id) || (alloc.is_replayed(id) && self.awaiting_nodes(alloc))
    }

    /// Whether data nodes known from the journal may still come back (shortly after a
    /// restart, while some are not back yet).
    fn awaiting_nodes(&self, alloc: &Allocator) -> bool {
        self.nodes_until.is_some_and(|t| Instant::now() < t) && !alloc.replayed().is_empty()
    }

    /// Whether fewer live data nodes have space than a chunk has copies while others known
    /// from the journal may still come back (shortly after a restart).
    fn copies_are_coming_back(&self, alloc: &Allocator) -> bool {
        self.awaiting_nodes(alloc) && alloc.nodes_with_space() < self.replicas
    }

    /// Whether clients that held handles before a restart may still come back for them:
    /// until then, closed files keep what they hold past their size, and files unlinked while
    /// open stay.
    fn awaiting_clients(&self) -> bool {
        self.reclaiming() && !self.awaited_clients.lock().unwrap().is_empty()
    }

    /// Client `client` made a call of its own after a restart (its handles are taken back by
    /// then: that comes first on a new connection).
    fn client_back(&self, client: u64) {
        let mut awaited = self.awaited_clients.lock().unwrap();
        if awaited.remove(&client) && awaited.is_empty() {
            log::info!("every client that held handles before the restart is back");
        }
    }

    /// Whether clients may still take their handles again after a restart.
    fn reclaiming(&self) -> bool {
        self.reclaim_until
            .is_some_and(|until| Instant::now() < until)
    }

    /// After a restart: data nodes not back in time count as gone (their chunks are copied
    /// from others); once every client that held handles is back, or their time is up, files
    /// unlinked while open that nobody reclaimed go, and closed files give back what they
    /// kept past their size.
    pub(crate) fn start_grace(self: &Arc<Self>) -> io::Result<()> {
        let (Some(nodes_until), Some(_)) = (self.nodes_until, self.reclaim_until) else {
            return Ok(());
        };
        let me = self.clone();
        // The two ends are apart: clients are back within moments of a restart, and what
        // waits for them must not wait for a data node that is not coming back (nor for the
        // next restart, which begins both again).
        std::thread::Builder::new()
            .name("grace".into())
            .spawn(move || {
                let (mut nodes_done, mut clients_done) = (false, false);
                while !(nodes_done && clients_done) {
                    if !clients_done && !me.awaiting_clients() {
                        me.clients_back();
                        clients_done = true;
                    }
                    if !nodes_done && Instant::now() >= nodes_until {
                        let away = me.state.lock().alloc.replayed();
                        for id in away {
                            log::warn!("data node {id} did not come back after the restart");
                            me.node_left(id);
                        }
                        nodes_done = true;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            })?;
        Ok(())
    }

    /// Every client that held handles before the restart is back, or its time is up: files
    /// unlinked while open that nobody took back go, and closed files give back what they
    /// kept past their size.
    fn clients_back(&self) {
        let mut st = self.state.lock();
        for client in std::mem::take(&mut *self.awaited_clients.lock().unwrap()) {
            log::warn!("client {client:x} did not come back for its handles");
            st.holding.set(client, false);
        }
        let orphans = st.ns.reap_orphans();
        let chunks: Vec<ChunkRef> = orphans
            .iter()
            .flat_map(|(_, c)| c.iter().copied())
            .collect();
        // Nobody was granted them since the restart (only reclaimed files are).
        st.alloc.release(chunks);
        drop(st);
        if !orphans.is_empty() {
            log::info!(
                "{} files unlinked while open before the restart were not reclaimed: gone",
                orphans.len()
            );
            self.zeroer.kick();
        }
        let mut st = self.state.lock();
        let mut effects = Effects::default();
        for (ino, from, chunks) in st.ns.trim_closed() {
            effects.trimmed(ino, from, chunks);
        }
        self.settle(st, None, effects);
    }

    /// Data node `id` left (its join connection closed): nothing more is allocated there, and
    /// its copies of chunks that have others go from the maps, to be made again elsewhere.
    pub(crate) fn node_left(&self, id: u32) {
        let mut st = self.state.lock();
        st.alloc.set_alive(id, false);
        let lost = st.ns.drop_node(id);
        if lost > 0 {
            self.repair.lost(lost);
            drop(st);
            log::warn!("data node {id}: {lost} chunks lost a copy; copying them again");
        }
    }

    /// Grants at data node `node` go over `link` from now on.
    pub(crate) fn add_link(&self, node: u32, link: Link) {
        self.links.lock().unwrap().insert(node, Arc::new(link));
    }

    pub(crate) fn remove_link(&self, node: u32) {
        self.links.lock().unwrap().remove(&node);
    }

    fn link(&self, node: u32) -> Option<Arc<Link>> {
        self.links.lock().unwrap().get(&node).cloned()
    }

    /// Asks `node` for `req`, waiting at most `wait` (if given) for the answer; None when the
    /// node is gone, refused or did not answer (logged).
    fn ask_within(&self, node: u32, req: LinkRequest, wait: Option<Duration>) -> Option<Vec<u32>> {
        let link = self.link(node)?;
        match link.call(&req, wait) {
            Ok(Ok(keys)) => Some(keys),
            Ok(Err(e)) => {
                log::warn!("data node {node} refused a {:?}: {e}", req.op());
                None
            }
            Err(e) => {
                log::warn!("data node {node}: {e}");
                None
            }
        }
    }

    /// Tells `node` `req` without waiting: it reaches the node after what was asked of it
    /// before and before what is asked after (a failure is logged; the node is then gone).
    fn tell(&self, node: u32, req: LinkRequest) {
        if let Some(link) = self.link(node) {
            let op = req.op();
            if let Err(e) = link.tell(req) {
                log::warn!("data node {node}: {op:?}: {e}");
            }
        }
    }

    /// Hands out a chunk map with each chunk granted to the caller's data session at its node
    /// (key 0 where the session has none there yet, or the node refused or did not answer
    /// within [`GRANT_WAIT`]: every node is asked at once, so slow ones cost that once).
    fn grant(&self, data: &HashMap<u32, u64>, g: Granting) -> Vec<u8> {
        let Granting {
            op,
            writable,
            seq,
            mut chunks,
        } = g;
        let deadline = Instant::now() + GRANT_WAIT;
        let nodes = by_node(chunks.iter().flat_map(|(_, r)| r));
        self.await_nodes(nodes.keys().copied(), deadline);
        let asked: Vec<(u32, Asked)> = nodes
            .into_iter()
            .filter_map(|(node, addrs)| {
                let session = *data.get(&node)?;
                let req = GrantChunks {
                    session,
                    seq,
                    writable,
                    addrs,
                };
                Some((node, self.link(node)?.ask(&req.into())))
            })
            .collect();
        for (node, asked) in asked {
            let keys = match asked.wait_until(Some(deadline)) {
                Ok(Ok(keys)) => keys,
                Ok(Err(e)) => {
                    log::warn!("data node {node} refused a grant: {e}");
                    continue;
                }
                Err(e) => {
                    log::warn!("data node {node}: {e}");
                    continue;
                }
            };
            let mut keys = keys.into_iter();
            let on_node = chunks
                .iter_mut()
                .flat_map(|(_, r)| r.iter_mut())
                .filter(|c| c.node == node);
            for c in on_node {
                c.rkey = keys.next().unwrap_or(0);
            }
        }
        encode_reply(op as u8, &Ok(chunks))
    }

    /// Right after a restart, waits (until `deadline` at the latest) for those of `nodes`
    /// that the journal knows and that are not back yet: they join again within moments, and
    /// a map granted without them would fail its reads.
    fn await_nodes(&self, nodes: impl Iterator<Item = u32> + Clone, deadline: Instant) {
        let Some(until) = self.nodes_until else {
            return;
        };
        let deadline = deadline.min(until);
        while Instant::now() < deadline {
            let st = self.state.lock();
            if !nodes.clone().any(|n| st.alloc.is_replayed(n)) {
                return;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Takes back what the session was granted on `chunks` (only for writing if
    /// `writable_only`), without waiting: the grants are the session's own, so nobody else
    /// depends on when they go, and a data node that stopped answering must not hold up a
    /// close. Anything asked of the node later comes after.
    fn revoke(&self, data: &HashMap<u32, u64>, chunks: &[ChunkRef], writable_only: bool) {
        for (node, addrs) in by_node(chunks) {
            let Some(&session) = data.get(&node) else {
                continue;
            };
            for part in addrs.chunks(MAX_LIST as usize) {
                let req = RevokeChunks {
                    session,
                    writable_only,
                    addrs: part.to_vec(),
                };
                self.tell(node, req.into());
            }
        }
    }

    pub(crate) fn start_zeroer(
        self: &Arc<Self>,
        node: Arc<Shared>,
        wait: Receiver<()>,
    ) -> io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("zeroer".into())
            .spawn(move || me.zeroer.run(&node, &me.state, wait))?;
        Ok(())
    }

    /// Tells the caches what `effects` changed, waits (lock released) for their answers up to
    /// the lease, and only then hands the freed chunks to the zeroer.
    fn settle(&self, mut st: Guard<'_, MetaState>, caller: Option<SessionId>, effects: Effects) {
        let Effects {
            freed,
            change,
            quick,
            woken,
            ..
        } = effects;
        // Waiters for locks are told, not waited for: one that is slow must not hold up the
        // unlock (it asks again within a second anyway).
        let waiters = st.holders.lock_freed(&woken);
        let tell_waiters = move || {
            for (callbacks, inos) in waiters {
                callbacks.tell_locks_freed(inos);
            }
        };
        if change.is_empty() && freed.is_empty() {
            drop(st);
            tell_waiters();
            return;
        }
        if !freed.is_empty() {
            st.frees += 1;
        }
        let freed = Freed {
            seq: st.frees,
            chunks: freed,
            rejoins: st.alloc.rejoins(),
        };
        let MetaState { ns, holders, .. } = &mut *st;
        let plan = holders.plan(caller, &change, |ino| ns.getattr(ino).ok());
        drop(st);
        tell_waiters();
        let answered = Countdown::new();
        for (callbacks, cb) in plan {
            callbacks.send(cb, &answered);
        }
        let start = Instant::now();
        let deadline = start + self.lease;
        let wait_until = if quick { start + REMAP_WAIT } else { deadline };
        // Live holders answer in microseconds. One that is slow (stopped, descheduled) is
        // waited for up to the lease, as NFS waits out a delegation: once its answer or its
        // lease is in, a write it makes through an old descriptor goes to the file as it is
        // now. One that cannot be asked (its connection is down) is not waited for; the
        // chunks wait out its lease instead.
        let mut all_answered = answered.wait(wait_until);
        if freed.chunks.is_empty() {
            return;
        }
        if quick && !all_answered && !self.unreachable_now(&freed) {
            // A holder that did not answer may still read the dropped copies, and their
            // node did not confirm them out of reach: the writer waits, as for a free.
            all_answered = answered.wait(deadline);
        }
        // Reused by the quarantine thread: making them unreachable takes a call to each node
        // they are on, and a stopped node must not hold the caller up for the link deadline.
        let lease = !(all_answered || Instant::now() >= deadline);
        let due = if lease {
            // A holder could not be asked: its references die with its lease.
            start + self.lease
        } else {
            log::debug!(
                "{} chunks freed after {:?} of recalls",
                freed.chunks.len(),
                start.elapsed()
            );
            Instant::now()
        };
        self.state.lock().alloc.expect_freed(freed.chunks.len());
        self.quarantine.lock().unwrap().push((due, freed, lease));
        self.quarantined.notify_one();
    }

    /// Revokes every session's reach to `freed` at their nodes, waiting [`GRANT_WAIT`] for
    /// each; whether each node confirmed it.
    fn unreachable_now(&self, freed: &Freed) -> bool {
        by_node(&freed.chunks)
            .into_iter()
            .all(|(node, addrs)| self.revoke_freed(node, freed.seq, &addrs, Some(GRANT_WAIT)))
    }

    /// Has `node` revoke every session's reach to `addrs` (freed with free number `seq`),
    /// waiting at most `wait` for each part if given; whether it confirmed.
    fn revoke_freed(&self, node: u32, seq: u64, addrs: &[u64], wait: Option<Duration>) -> bool {
        addrs.chunks(MAX_LIST as usize).all(|part| {
            let req = RevokeFreed {
                seq,
                addrs: part.to_vec(),
            };
            self.ask_within(node, req.into(), wait).is_some()
        })
    }

    /// Freed chunks whose every holder let go: out of every session's reach, zeroed, then
    /// allocatable again. Chunks a live node did not confirm revoked are never reused.
    fn reuse(&self, freed: Freed) {
        let mut reusable = Vec::with_capacity(freed.chunks.len());
        for (node, addrs) in by_node(&freed.chunks) {
            if self.state.lock().alloc.rejoined_since(node, freed.rejoins) {
                // Its return listed them for zeroing (no map named them), and they may be
                // another file's by now: neither revoked nor released again.
                continue;
            }
            let revoked = self.revoke_freed(node, freed.seq, &addrs, None);
            // A node without a link has left: nobody reaches its pool through us any more.
            if revoked || self.link(node).is_none() {
                reusable.extend(addrs.into_iter().map(|addr| ChunkRef {
                    node,
                    addr,
                    rkey: 0,
                }));
            } else {
                log::error!(
                    "data node {node} did not confirm that {} freed chunks are out of reach: \
                     they are not reused",
                    addrs.len()
                );
            }
        }
        let mut st = self.state.lock();
        st.alloc.release_freed(reusable, freed.rejoins);
        st.alloc.freed_now(freed.chunks.len());
        drop(st);
        self.zeroer.kick();
    }

    /// Reuses freed chunks as they fall due.
    pub(crate) fn start_quarantine(self: &Arc<Self>) -> io::Result<()> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("quarantine".into())
            .spawn(move || {
                let mut q = me.quarantine.lock().unwrap();
                loop {
                    let now = Instant::now();
                    let (due, waiting): (Vec<_>, Vec<_>) =
                        q.drain(..).partition(|(at, _, _)| *at <= now);
                    *q = waiting;
                    if !due.is_empty() {
                        drop(q);
                        for (_, freed, lease) in due {
                            if lease {
                                log::info!(
                                    "{} quarantined chunks released (lease over)",
                                    freed.chunks.len()
                                );
                            }
                            me.reuse(freed);
                        }
                        q = me.quarantine.lock().unwrap();
                        continue;
                    }
                    let next = q.iter().map(|(at, _, _)| *at).min();
                    q = match next {
                        Some(at) => me.quarantined.wait_timeout(q, at - now).unwrap().0,
                        None => me.quarantined.wait(q).unwrap(),
                    };
                }
            })?;
        Ok(())
    }

    /// Serves one connection of client `client_id`'s session until it goes (first telling the
    /// client whether its session was still there); the session waits a grace period (twice
    /// the lease) for the client to come back before it ends.
    pub(crate) fn serve(
        self: &Arc<Self>,
        node: &Shared,
        mut s: TcpStream,
        client_id: u64,
        key: Option<SessionKey>,
    ) -> io::Result<()> {
        let peer = s.peer_addr()?;
        let mut links = node.links(&node.pd, &mut s, 2, QpCaps::default())?;
        let (cb_qp, cb_cq) = links.pop().expect("two links");
        let (qp, cq) = links.pop().expect("two links");
        let closed = Arc::new(AtomicBool::new(false));
        let mut watch = s.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let who = format!("client {peer} (id {client_id:016x})");
        let callbacks = Callbacks::start(
            &node.pd,
            cb_qp,
            cb_cq,
            self.lease,
            who.clone(),
            stop.clone(),
            key.clone(),
        )?;
        // From here on, every way out goes through the detach below.
        let attached = self.sessions.attach(client_id, stop.clone());
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
        let result = send_frame(&mut s, &[attached.resumed as u8]).and_then(|()| {
            let closer = {
                let closed = closed.clone();
                std::thread::spawn(move || {
                    wait_for_close(&mut watch);
                    closed.store(true, Ordering::Release);
                })
            };
            let served = rpc::serve(&node.pd, qp, cq, node.cfg.rpc, &stop, |frame| {
                match opened_call(key.as_ref(), frame) {
                    Some((seq, body)) => {
                        let reply = self.handle(&attached, body);
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
            });
            let _ = s.shutdown(std::net::Shutdown::Both);
            let _ = closer.join();
            served
        });
        callbacks.close();
        if self.sessions.detach(client_id, &attached) {
            match &result {
                Err(e) if !closed.load(Ordering::Acquire) => {
                    log::warn!("{who}: metadata connection ended: {e}")
                }
                _ => log::info!("{who}: connection closed"),
            }
            self.expire_later(client_id, attached, who);
        }
        result.or_else(|e| {
            if closed.load(Ordering::Acquire) {
                Ok(())
            } else {
                Err(e)
            }
        })
    }

    /// Ends a detached session unless its client comes back within the grace period: twice
    /// the lease, since clients resend for up to their call deadline, which the lease is meant
    /// to exceed.
    fn expire_later(self: &Arc<Self>, client_id: u64, attached: Attached, who: String) {
        let me = self.clone();
        let grace = self.lease * 2;
        let expire = move || {
            std::thread::sleep(grace);
            if let Some(gone) = me.sessions.expire(client_id, &attached) {
                log::info!("{who}: not back within {grace:?}; session ended");
                me.end_session(&gone);
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("session-grace".into())
            .spawn(expire)
        {
            log::error!(
                "no thread to end a session later ({e}); it stays until its client returns"
            );
        }
    }

    /// A session ended: it caches nothing any more, and its handles are released (with the
    /// chunks of files it had unlinked, and what closed files hold past their size).
    fn end_session(&self, session: &Mutex<ClientSession>) {
        let session = session.lock().unwrap();
        let mut st = self.state.lock();
        st.holders.remove(session.id);
        let mut effects = Effects {
            keep_past_size: self.awaiting_clients(),
            woken: st.locks.drop_session(session.id),
            ..Effects::default()
        };
        for (&ino, h) in &session.open {
            for _ in 0..h.all {
                Self::release(&mut st.ns, ino, &mut effects);
            }
        }
        st.holding.set(session.client, false);
        self.settle(st, Some(session.id), effects);
        for (&node, &data) in &session.data {
            self.tell(node, RevokeSession { session: data }.into());
        }
    }

    /// Closes one of the session's handles of `ino`, taken for `access` (EBADF: it holds
    /// none such).
    fn close_handle(
        ns: &mut Namespace,
        holders: &mut Holders,
        open: &mut HashMap<Ino, Handles>,
        session: SessionId,
        ino: Ino,
        access: u8,
        fx: &mut Effects,
    ) -> Result<(), Errno> {
        let h = match open.get_mut(&ino) {
            Some(h) if h.all > 0 && (access & MAY_WRITE == 0 || h.writable > 0) => h,
            _ => return Err(Errno::EBADF),
        };
        let was_writable = h.writable > 0;
        h.all -= 1;
        h.writable -= (access & MAY_WRITE != 0) as u32;
        // A client that closes a writable handle as read-only keeps no more writable handles
        // than handles.
        h.writable = h.writable.min(h.all);
        // Its last handle, or its last writable one: the session's grants on the file go, or
        // those for writing.
        let last = h.all == 0;
        if last || (was_writable && h.writable == 0) {
            let all = ns.chunk_map(ino, 0, u64::MAX).unwrap_or_default();
            let chunks = all.into_iter().flat_map(|(_, c)| c);
            if last {
                fx.closed.extend(chunks);
            } else {
                fx.closed_for_writing.extend(chunks);
            }
        }
        if last {
            open.remove(&ino);
        }
        holders.closed(session, ino);
        Self::release(ns, ino, fx);
        Ok(())
    }

    /// A session that closed its last handle of `ino` holds no lock on it any more (its
    /// client drops them before; this covers one that did not).
    fn unlock_if_closed(
        locks: &mut LockTable,
        open: &HashMap<Ino, Handles>,
        session: SessionId,
        ino: Ino,
        fx: &mut Effects,
    ) {
        if !open.contains_key(&ino) {
            fx.woken.extend(locks.drop_on(ino, session, None));
        }
    }

    /// One handle of `ino` closed: an unlinked file goes with its last handle, a closed file
    /// gives back the chunks allocated ahead past its size (see [`Effects::keep_past_size`]).
    fn release(ns: &mut Namespace, ino: Ino, effects: &mut Effects) {
        let reaped = ns.release(ino);
        if !reaped.is_empty() {
            effects.change.inodes.push((ino, true));
            effects.freed(ino, 0, reaped);
        } else if effects.keep_past_size {
            // Given back at the file's next last close.
        } else if let Some((from, trimmed)) = ns.trim(ino) {
            effects.trimmed(ino, from, trimmed);
        }
    }

    /// Decodes, applies and answers one call, once: a call resent after a reconnection gets
    /// the reply it had.
    fn handle(&self, attached: &Attached, body: &[u8]) -> Vec<u8> {
        let read = clock::now_ms();
        let Some((envelope, call)) = unseal(body) else {
            log::warn!("metadata call without an envelope");
            return encode_reply::<()>(0, &Err(Errno::EPROTO));
        };
        let seq = envelope.seq;
        let op = call.get(1).copied().unwrap_or(0);
        let mut session = attached.session.lock().unwrap();
        if !attached.is_current() {
            // A newer connection took the session over: the client resends there.
            return encode_reply::<()>(op, &Err(Errno::EIO));
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
            return encode_reply::<()>(op, &Err(Errno::EIO));
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
            return encode_reply::<()>(op, &Err(Errno::EIO));
        }
        let req = match Request::decode(call) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("malformed metadata request: {e}");
                let op = call.get(1).copied().unwrap_or(0);
                return encode_reply::<()>(op, &Err(Errno::EPROTO));
            }
        };
        let id = session.id;
        if !matches!(
            req,
            Request::Reclaim(_)
                | Request::SetLock(rfs_proto::message::SetLock { reclaim: true, .. })
        ) {
            self.client_back(session.client);
        }
        // Space being zeroed is free space: an allocation that only it would satisfy waits
        // for the zeroer rather than failing with ENOSPC.
        let give_up = Instant::now() + ZEROING_WAIT;
        // Fewer copies rather than none: the wait for returning nodes leaves the caller half
        // the time it had left.
        let left_ms = (envelope.budget_ms as u64).saturating_sub(age);
        let copies_wait_until = Instant::now() + Duration::from_millis(left_ms / 2);
        let mut reply = loop {
            let mut st = self.state.lock();
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
                keep_past_size: self.awaiting_clients(),
                ..Effects::default()
            };
            let held = session.holds_handles();
            let reply = self.apply(&mut st, &mut session, &req, &mut effects);
            if session.holds_handles() != held {
                st.holding.set(session.client, !held);
            }
            // Space is also coming while data nodes known from the journal come back.
            let short = matches!(req, Request::Allocate(_))
                && reply == encode_reply::<()>(RequestOp::Allocate as u8, &Err(Errno::ENOSPC))
                && (st.alloc.zeroing() > 0 || self.awaiting_nodes(&st.alloc));
            if short && Instant::now() < give_up {
                drop(st);
                self.zeroer.kick();
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            let granting = effects.grant.take();
            let closed = std::mem::take(&mut effects.closed);
            let closed_for_writing = std::mem::take(&mut effects.closed_for_writing);
            let detached = std::mem::take(&mut effects.detached);
            self.settle(st, Some(id), effects);
            // Calls of one session are applied one at a time (its lock is held), so its
            // grants and revocations reach each node in the order of its calls.
            self.revoke(&session.data, &closed_for_writing, true);
            self.revoke(&session.data, &closed, false);
            for (node, old) in detached {
                self.tell(node, RevokeSession { session: old }.into());
            }
            break match granting {
                Some(g) => self.grant(&session.data, g),
                None => reply,
            };
        };
        // Nothing is answered that a restart could take back.
        if let Err(e) = self.state.sync() {
            log::error!("call {seq} of session {id}: {e}");
            reply = encode_reply::<()>(op, &Err(Errno::EIO));
        }
        if changes_something(&req) {
            session.remember(seq, &reply);
        }
        reply
    }

    /// Applies one request under the state lock: its reply, and in `fx` what it changed.
    fn apply(
        &self,
        st: &mut MetaState,
        cs: &mut ClientSession,
        req: &Request,
        fx: &mut Effects,
    ) -> Vec<u8> {
        let MetaState {
            ns,
            alloc,
            holders,
            frees,
            frozen,
            locks,
            ..
        } = st;
        let ClientSession {
            id: session,
            open,
            data,
            ..
        } = cs;
        let session = *session;
        // A map read now is granted with this free number (see `MetaState::frees`); its reply
        // is made once the grants are in.
        let granting = |fx: &mut Effects, op, writable, chunks| {
            fx.grant = Some(Granting {
                op,
                writable,
                seq: *frees,
                chunks,
            });
            Vec::new()
        };
        let chunk_size = ns.chunk_size();
        let target = |ns: &Namespace, parent: Ino, name: &Name| ns.lookup(parent, name).ok();
        let policy = self.policy;
        // Who makes a call that looks in or changes directory `dir`, if `check` lets them.
        let in_dir = |ns: &Namespace,
                      caller: &Caller,
                      dir: Ino,
                      check: fn(&Attr, &Caller) -> Result<(), Errno>|
         -> Result<(Caller, Attr), Errno> {
            let c = policy.caller(caller)?;
            let d = ns.getattr(dir)?;
            check(&d, &c)?;
            Ok((c, d))
        };
        let opened = |open: &mut HashMap<Ino, Handles>, ino: Ino, access: u8| {
            let h = open.entry(ino).or_default();
            h.all += 1;
            h.writable += (access & MAY_WRITE != 0) as u32;
        };
        match req {
            Request::Lookup(m) => {
                let r = in_dir(ns, &m.caller, m.parent, check_search)
                    .and_then(|_| ns.lookup(m.parent, &m.name));
                answer(m, told(holders, session, r, Some(m.parent)))
            }
            Request::GetAttr(m) => answer(m, told(holders, session, ns.getattr(m.ino), None)),
            Request::SetAttr(m) => {
                let writing = open.get(&m.ino).is_some_and(|h| h.writable > 0);
                let r = policy
                    .caller(&m.caller)
                    .and_then(|c| check_setattr(&ns.getattr(m.ino)?, &c, &m.changes, writing))
                    .and_then(|()| ns.setattr(m.ino, &m.changes))
                    .map(|(a, freed)| {
                        fx.change.inodes.push((m.ino, m.changes.size.is_some()));
                        if let Some(size) = m.changes.size {
                            // Every size cut is told, freed chunks or not: holders cut their sizes.
                            let from = size.div_ceil(chunk_size);
                            fx.change.recalls.push(Recall {
                                ino: m.ino,
                                from,
                                cut: true,
                            });
                            fx.freed.extend(freed);
                        }
                        a
                    });
                answer(m, told(holders, session, r, None))
            }
            Request::Mknod(m) => {
                let r = in_dir(ns, &m.caller, m.parent, check_change).and_then(|(c, dir)| {
                    let owner = made_in(policy.owner(m.owner), &dir, &c);
                    ns.mknod(m.parent, &m.name, m.kind, m.rdev, owner)
                });
                r.is_ok().then(|| fx.change.inodes.push((m.parent, false)));
                answer(m, made(holders, session, ns, r, m.parent))
            }
            Request::Mkdir(m) => {
                let r = in_dir(ns, &m.caller, m.parent, check_change)
                    .and_then(|_| ns.mkdir(m.parent, &m.name, policy.owner(m.owner)));
                r.is_ok().then(|| fx.change.inodes.push((m.parent, false)));
                answer(m, made(holders, session, ns, r, m.parent))
            }
            Request::Symlink(m) => {
                let o = policy.owner(Owner {
                    perm: 0o777,
                    uid: m.uid,
                    gid: m.gid,
                });
                let r = in_dir(ns, &m.caller, m.parent, check_change)
                    .and_then(|_| ns.symlink(m.parent, &m.name, &m.target, o.uid, o.gid));
                r.is_ok().then(|| fx.change.inodes.push((m.parent, false)));
                answer(m, made(holders, session, ns, r, m.parent))
            }
            Request::Readlink(m) => answer(m, ns.readlink(m.ino)),
            Request::Link(m) => {
                let r = in_dir(ns, &m.caller, m.newparent, check_change)
                    .and_then(|_| ns.link(m.ino, m.newparent, &m.newname));
                if r.is_ok() {
                    fx.change
                        .inodes
                        .extend([(m.ino, false), (m.newparent, false)]);
                }
                answer(m, made(holders, session, ns, r, m.newparent))
            }
            Request::Unlink(m) => {
                let victim = target(ns, m.parent, &m.name);
                let r = in_dir(ns, &m.caller, m.parent, check_change)
                    .and_then(|(c, dir)| victim.map_or(Ok(()), |v| check_sticky(&dir, &v, &c)));
                let r = r.and_then(|()| ns.unlink(m.parent, &m.name)).map(|freed| {
                    let ino = victim.map_or(0, |a| a.ino);
                    fx.change.inodes.extend([(m.parent, false), (ino, false)]);
                    fx.change.entries.push((m.parent, m.name.clone()));
                    fx.freed(ino, 0, freed);
                });
                answer(
                    m,
                    r.and_then(|()| dir_after(holders, session, ns, m.parent)),
                )
            }
            Request::Rmdir(m) => {
                let victim = target(ns, m.parent, &m.name);
                let r = in_dir(ns, &m.caller, m.parent, check_change)
                    .and_then(|(c, dir)| victim.map_or(Ok(()), |v| check_sticky(&dir, &v, &c)));
                let r = r.and_then(|()| ns.rmdir(m.parent, &m.name)).inspect(|_| {
                    fx.change.inodes.push((m.parent, false));
                    fx.change.inodes.extend(victim.map(|a| (a.ino, false)));
                    fx.change.entries.push((m.parent, m.name.clone()));
                });
                answer(
                    m,
                    r.and_then(|()| dir_after(holders, session, ns, m.parent)),
                )
            }
            Request::Rename(m) => {
                let src = target(ns, m.parent, &m.name);
                let dst = target(ns, m.newparent, &m.newname);
                let r = policy
                    .caller(&m.caller)
                    .and_then(|c| {
                        let (from, to) = (ns.getattr(m.parent)?, ns.getattr(m.newparent)?);
                        let (src, dst) = (src.as_ref(), dst.as_ref());
                        check_rename((&from, src), (&to, dst), m.flags, &c)
                    })
                    .and_then(|()| ns.rename(m.parent, &m.name, m.newparent, &m.newname, m.flags))
                    .map(|freed| {
                        let c = &mut fx.change;
                        c.inodes.extend([(m.parent, false), (m.newparent, false)]);
                        c.inodes
                            .extend(src.iter().chain(&dst).map(|a| (a.ino, false)));
                        c.entries.push((m.parent, m.name.clone()));
                        c.entries.push((m.newparent, m.newname.clone()));
                        fx.freed(dst.map_or(0, |a| a.ino), 0, freed);
                    });
                let dirs = r.and_then(|()| {
                    // The caller's kernel now holds the new name: it is told when it changes.
                    holders.looked_in(session, m.parent);
                    holders.looked_in(session, m.newparent);
                    let old = dir_after(holders, session, ns, m.parent)?;
                    Ok((old, dir_after(holders, session, ns, m.newparent)?))
                });
                answer(m, dirs)
            }
            Request::ReadDir(m) => {
                let max = m.max.min(MAX_LIST) as usize;
                let r = in_dir(ns, &m.caller, m.ino, check_list)
                    .and_then(|_| ns.readdir(m.ino, m.cookie, max, self.page_bytes));
                if let Ok(page) = &r {
                    holders.looked_in(session, m.ino);
                    for e in page {
                        holders.saw(session, e.attr.ino);
                    }
                }
                answer(m, r)
            }
            Request::Open(m) => {
                let r = policy
                    .caller(&m.caller)
                    .and_then(|c| check_open(&ns.getattr(m.ino)?, &c, m.access))
                    .and_then(|()| ns.open(m.ino));
                if r.is_ok() {
                    opened(open, m.ino, m.access);
                    holders.opened(session, m.ino);
                }
                answer(m, told(holders, session, r, None))
            }
            Request::Create(m) => {
                let r = check_access_bits(m.access)
                    .and_then(|()| in_dir(ns, &m.caller, m.parent, check_change))
                    .and_then(|(c, dir)| {
                        let owner = made_in(policy.owner(m.owner), &dir, &c);
                        let a = ns.mknod(m.parent, &m.name, FileKind::RegularFile, 0, owner)?;
                        ns.open(a.ino)
                    });
                if let Ok(a) = &r {
                    opened(open, a.ino, m.access);
                    holders.opened(session, a.ino);
                    fx.change.inodes.push((m.parent, false));
                }
                answer(m, made(holders, session, ns, r, m.parent))
            }
            Request::Release(m) => {
                let r = Self::close_handle(ns, holders, open, session, m.ino, m.access, fx);
                Self::unlock_if_closed(locks, open, session, m.ino, fx);
                answer(m, r)
            }
            Request::ReleaseMany(m) => {
                let mut closed = 0;
                for &(ino, access) in &m.handles {
                    if Self::close_handle(ns, holders, open, session, ino, access, fx).is_ok() {
                        closed += 1;
                    }
                    Self::unlock_if_closed(locks, open, session, ino, fx);
                }
                answer(m, Ok(closed))
            }
            Request::SetLock(m) => {
                let r = match (m.reclaim, self.reclaiming()) {
                    _ if !m.lock.is_valid() => Err(Errno::EINVAL),
                    // Only a file the session has open: the open is where access was checked.
                    _ if !open.contains_key(&m.ino) => Err(Errno::EBADF),
                    // An unlock only removes: it needs no grace period to wait out.
                    (false, true) if m.lock.kind != UNLOCK => Err(Errno::EAGAIN),
                    (true, false) => Err(Errno::EPERM),
                    _ => {
                        let now = Instant::now();
                        let (r, woken) = locks.set(m.ino, session, m.owner, m.lock, m.wait, now);
                        fx.woken.extend(woken);
                        r
                    }
                };
                answer(m, r)
            }
            Request::GetLock(m) => {
                let r = match self.reclaiming() {
                    _ if !m.lock.is_valid() => Err(Errno::EINVAL),
                    _ if !open.contains_key(&m.ino) => Err(Errno::EBADF),
                    true => Err(Errno::EAGAIN),
                    false => Ok(locks.conflict(m.ino, session, m.owner, &m.lock)),
                };
                answer(m, r)
            }
            Request::CancelWait(m) => {
                fx.woken.extend(locks.cancel_wait(m.ino, session, m.owner));
                answer(m, Ok(()))
            }
            Request::DropLocks(m) => {
                fx.woken
                    .extend(locks.drop_on(m.ino, session, Some(m.owner)));
                answer(m, Ok(()))
            }
            Request::ChunkMap(m) => {
                // Only through a handle: the open is where permission was checked.
                let r = match open.get(&m.ino) {
                    Some(_) if is_frozen(frozen, m.ino, m.first, m.count) => Err(Errno::EAGAIN),
                    Some(_) => ns.chunk_map_page(m.ino, m.first, m.count as u64, MAX_LIST as usize),
                    None => Err(Errno::EBADF),
                };
                match r {
                    Ok(chunks) => {
                        holders.fetched(session, m.ino);
                        let writable = open.get(&m.ino).is_some_and(|h| h.writable > 0);
                        granting(fx, RequestOp::ChunkMap, writable, chunks)
                    }
                    Err(e) => answer(m, Err(e)),
                }
            }
            Request::Allocate(m) => {
                let count = m.count.min(MAX_LIST) as u64;
                let writable = open.get(&m.ino).is_some_and(|h| h.writable > 0);
                let result = writable
                    .then_some(())
                    .ok_or(Errno::EBADF)
                    .and_then(|()| match is_frozen(frozen, m.ino, m.first, count as u32) {
                        true => Err(Errno::EAGAIN),
                        false => ns.missing_chunks(m.ino, m.first, count),
                    })
                    .and_then(|missing| {
                        let chunks = alloc.alloc(missing.len(), self.replicas)?;
                        if chunks.iter().any(|c| c.len() < self.replicas) {
                            self.repair.degraded(chunks.len());
                        }
                        let new: Vec<_> = missing.into_iter().zip(chunks).collect();
                        if let Err(e) = ns.add_chunks(m.ino, &new) {
                            fx.freed.extend(new.into_iter().flat_map(|(_, c)| c));
                            return Err(e);
                        }
                        ns.chunk_map(m.ino, m.first, count)
                    });
                match result {
                    Ok(chunks) => {
                        holders.fetched(session, m.ino);
                        granting(fx, RequestOp::Allocate, true, chunks)
                    }
                    Err(e) => answer(m, Err(e)),
                }
            }
            Request::Commit(m) => {
                // Through any handle: close(2) of a read-only descriptor flushes what the
                // client's writers left uncommitted, and may come after their release.
                let r = match open.get(&m.ino) {
                    Some(_) => ns.commit(m.ino, m.size, m.mtime, m.cuts),
                    None => Err(Errno::EBADF),
                };
                if r.is_ok() {
                    fx.change.inodes.push((m.ino, true));
                    holders.saw(session, m.ino);
                }
                answer(m, r)
            }
            Request::GetStatFs(m) => {
                // Space as files see it: each chunk takes a chunk on every replica's node.
                let (total, free) = alloc.totals();
                let copies = self.replicas as u64;
                answer(
                    m,
                    Ok(StatFs {
                        chunk_size,
                        chunks_total: total / copies,
                        chunks_free: free / copies,
                        inodes: ns.inode_count(),
                        lease_ms: self.lease.as_millis() as u64,
                        replicas: self.replicas as u32,
                        chunks_short: self.repair.short(),
                    }),
                )
            }
            Request::ListNodes(m) => {
                // A node known from the journal and not back yet still counts: clients wait
                // for it rather than give up on it.
                let nodes = alloc
                    .nodes(self.local)
                    .into_iter()
                    .map(|n| NodeInfo {
                        alive: self.counts_as_copy(alloc, n.id),
                        ..n
                    })
                    .collect();
                answer(m, Ok(nodes))
            }
            Request::DropReplicas(m) => {
                let writable = open.get(&m.ino).is_some_and(|h| h.writable > 0);
                let r = writable
                    .then_some(())
                    .ok_or(Errno::EBADF)
                    .and_then(|()| ns.drop_replicas(m.ino, m.index, &m.reached))
                    .map(|dropped| {
                        let n = dropped.len() as u32;
                        if !dropped.is_empty() {
                            log::warn!(
                                "inode {}: chunk {}: a write missed its replicas on nodes {:?}: \
                                 dropped, to be copied again",
                                m.ino,
                                m.index,
                                dropped.iter().map(|c| c.node).collect::<Vec<_>>()
                            );
                            // Other holders must not read the copies that missed the write;
                            // the chunks themselves are freed once they let go.
                            fx.change.remaps.push(m.ino);
                            self.repair.avoid(dropped.iter().map(|c| c.node));
                            fx.freed.extend(dropped);
                            fx.quick = true;
                            self.repair.lost(1);
                        }
                        n
                    });
                answer(m, r)
            }
            Request::Reclaim(m) => {
                let r = match self.reclaiming() {
                    true => {
                        let mut taken = 0;
                        for &(ino, access) in &m.handles {
                            let file = ns
                                .getattr(ino)
                                .is_ok_and(|a| a.kind == FileKind::RegularFile);
                            if file && check_access_bits(access).is_ok() && ns.open(ino).is_ok() {
                                opened(open, ino, access);
                                holders.opened(session, ino);
                                taken += 1;
                            }
                        }
                        Ok(taken)
                    }
                    // Handles are taken with a permission check outside the grace period.
                    false => Err(Errno::EPERM),
                };
                answer(m, r)
            }
            Request::AttachData(m) => {
                // The name only says where this session's grants go: a client naming another's
                // session gives that one more reach, never itself. What the session granted
                // before goes with the old name: revocations follow the new one.
                let r = if (m.node as usize) < alloc.node_counts().1 {
                    if let Some(old) = data.insert(m.node, m.session) {
                        (old != m.session).then(|| fx.detached.push((m.node, old)));
                    }
                    Ok(())
                } else {
                    Err(Errno::EINVAL)
                };
                answer(m, r)
            }
        }
    }
}
