//! An in-memory stand-in for the nodes, for unit tests of the file system's logic: a tiny
//! metadata service (the calls the data path and close-to-open use) and chunk memory on two
//! "nodes" (three when chunks have replicas), answering synchronously. Several [`Rfs`](super::Rfs) over one [`FakeCluster`] are
//! several clients.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::{Arc, Mutex};

use rdmabox::transport::WcStatus;
use rdmabox::Snapshot;
use rfs_proto::message::{
    decode_reply, encode_reply, Call, Committed, Made, Opened, Request, RequestOp,
};
use rfs_proto::types::{
    Attr, ChunkRef, FileAccess, FileKind, FileMap, Ino, Owner, Replicas, StatFs, Timestamp, ROOT,
};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::{Errno, MetadataChannel};

use super::backend::{Backend, DataDone, WriteBack};
use super::error::{Error, Result};

pub(crate) const CHUNK: u64 = 4096;
const NODES: u32 = 2;

#[derive(Default)]
struct State {
    files: HashMap<Ino, Attr>,
    /// The names that Create made (other calls keep none), by (directory, name).
    names: HashMap<(Ino, Vec<u8>), Ino>,
    /// Calls whose answer is lost once applied, as with a session the node lost meanwhile.
    lose_answer: Vec<RequestOp>,
    chunks: BTreeMap<(Ino, u64), Replicas>,
    /// Copies of each chunk, on nodes `0..replicas + 1` (1 when 0: on two nodes).
    replicas: usize,
    /// The bytes of every allocated chunk, by (node, address).
    memory: HashMap<(u32, u64), Vec<u8>>,
    next_addr: u64,
    calls: HashMap<RequestOp, usize>,
    /// Calls to refuse once, by op (see [`FakeCluster::refuse_next`]).
    refuse_next: HashMap<RequestOp, Errno>,
    /// Handles given back, as (inode, access), in order.
    released: Vec<(Ino, FileAccess)>,
    failing_node: Option<u32>,
    /// Our session with this node is gone: transfers to it fail as over a closed session
    /// (a stale reference), and, if noticed, it reads as not connected.
    lost_session: Option<(u32, bool)>,
    /// The metadata connection reads as down (calls still get through).
    metadata_down: bool,
    /// Calls fail as over a lost connection, reaching nothing.
    unreachable: bool,
    /// Commits are answered EIO, unapplied, as by a node they reached too late.
    commits_late: bool,
    /// Handles held, by inode: a commit needs one, as on the metadata node.
    held: HashMap<Ino, u32>,
    /// Times every key was taken back: maps hand out key `revocations + 1`, and a transfer
    /// with an older one is refused, as a data node refuses keys it took back (when the
    /// metadata node restarted).
    revocations: u32,
    /// Keys taken back after every map handed out: no transfer ever gets through.
    refuse_every_key: bool,
    /// While set, writes wait here (not yet in "remote memory") until let go.
    held_writes: Option<Vec<HeldWrite>>,
    /// Allocations are refused with ENOSPC, as by a metadata node out of free chunks.
    pool_full: bool,
    /// File locks, by file: this fake has one client, so owners are its lock owners.
    locks: HashMap<Ino, rfs_proto::locks::LockSet<u64>>,
    /// Reads of several chunks gathered into one run of bytes.
    gathered_reads: usize,
    /// Every chunk on node 0 (else they take turns between the nodes).
    one_node: bool,
    /// Every chunk on both nodes.
    mirrored: bool,
}

/// A write the fake holds back, as a slow network would.
type HeldWrite = (ChunkRef, u64, Vec<u8>, WriteBack);

impl State {
    /// The key maps hand out now.
    fn key(&self) -> u32 {
        self.revocations + 1
    }

    /// A handle of `ino` given back.
    fn let_go(&mut self, ino: Ino) {
        if let Some(n) = self.held.get_mut(&ino) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Run before the next Commit reaches the "metadata node", outside its lock.
type BeforeCommit = Box<dyn FnOnce() + Send>;

/// Run once the "metadata node" answered the next call of an op, before the answer is back.
type AfterAnswer = (RequestOp, Box<dyn FnOnce() + Send>);

/// The shared "cluster".
#[derive(Default)]
pub(crate) struct FakeCluster {
    state: Mutex<State>,
    before_commit: Mutex<Option<BeforeCommit>>,
    after_answer: Mutex<Option<AfterAnswer>>,
    /// Held by a test, it holds batches of closes back on their way, as a slow node would.
    pub(crate) closes_gate: Mutex<()>,
    /// Batches of closes that reached the gate.
    pub(crate) closes_sent: std::sync::atomic::AtomicUsize,
    /// The lease the "metadata node" says it keeps, if not the default 10 s.
    lease_ms: std::sync::atomic::AtomicU64,
}

/// One client's connection to the cluster.
#[derive(Clone)]
pub(crate) struct Fake(pub(crate) Arc<FakeCluster>);

fn answer<C: Call>(_: &C, r: Result<C::Reply, Errno>) -> Vec<u8> {
    encode_reply(C::OP as u8, &r)
}

impl FakeCluster {
    /// Has the "metadata node" say it keeps a lease of `ms` (clients made after ask).
    pub(crate) fn set_lease_ms(&self, ms: u64) {
        self.lease_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Has `meanwhile` run while the next commit is on its way, before the node applies it.
    pub(crate) fn before_next_commit(&self, meanwhile: BeforeCommit) {
        *self.before_commit.lock().unwrap() = Some(meanwhile);
    }

    /// Has the "metadata node" refuse the next `op` call with `errno`, unapplied.
    pub(crate) fn refuse_next(&self, op: RequestOp, errno: Errno) {
        self.state.lock().unwrap().refuse_next.insert(op, errno);
    }

    /// Has the next `op` call applied and its answer lost, as when the metadata node lost our
    /// session while the call was under way.
    pub(crate) fn lose_next_answer(&self, op: RequestOp) {
        self.state.lock().unwrap().lose_answer.push(op);
    }

    /// Has `meanwhile` run once the next `op` call is answered, while the answer is on its
    /// way back (as a reply overtaken by later calls would be).
    pub(crate) fn after_next_answer(&self, op: RequestOp, meanwhile: Box<dyn FnOnce() + Send>) {
        *self.after_answer.lock().unwrap() = Some((op, meanwhile));
    }

    /// How many `op` calls reached the "metadata node".
    pub(crate) fn calls(&self, op: RequestOp) -> usize {
        *self.state.lock().unwrap().calls.get(&op).unwrap_or(&0)
    }

    /// Reads of several chunks that were gathered into one run of bytes.
    pub(crate) fn gathered_reads(&self) -> usize {
        self.state.lock().unwrap().gathered_reads
    }

    /// The handles given back so far, as (inode, access).
    pub(crate) fn released(&self) -> Vec<(Ino, FileAccess)> {
        self.state.lock().unwrap().released.clone()
    }

    /// Every call that reached the "metadata node".
    pub(crate) fn total_calls(&self) -> usize {
        self.state.lock().unwrap().calls.values().sum()
    }

    /// Has the metadata connection read as down (or up again).
    pub(crate) fn metadata_down(&self, down: bool) {
        self.state.lock().unwrap().metadata_down = down;
    }

    /// Has every call fail as over a lost connection (or get through again).
    pub(crate) fn unreachable(&self, unreachable: bool) {
        self.state.lock().unwrap().unreachable = unreachable;
    }

    /// Has commits answered EIO and not applied, as a node answers calls that reach it too
    /// late (or has them applied again).
    pub(crate) fn commits_late(&self, late: bool) {
        self.state.lock().unwrap().commits_late = late;
    }

    /// Cuts `ino` to `size`, as another client's truncate would, without callbacks.
    pub(crate) fn cut(&self, ino: Ino, size: u64) {
        let mut st = self.state.lock().unwrap();
        st.zero_tail(ino, size);
        let a = st.files.get_mut(&ino).unwrap();
        a.size = size;
        a.cuts += 1;
    }

    /// Grows `ino` to `size`, as another client's writes and close would.
    pub(crate) fn grow(&self, ino: Ino, size: u64) {
        let mut st = self.state.lock().unwrap();
        let a = st.files.get_mut(&ino).unwrap();
        a.size = a.size.max(size);
    }

    /// Whether `owner` holds a lock on `ino` here.
    pub(crate) fn holds_lock(&self, ino: Ino, owner: u64) -> bool {
        let st = self.state.lock().unwrap();
        st.locks.get(&ino).is_some_and(|s| s.holds(owner))
    }

    /// Another client's lock, taken under the fake's only client (owner `owner`).
    pub(crate) fn lock_elsewhere(&self, ino: Ino, owner: u64, lock: rfs_proto::locks::FileLock) {
        let mut st = self.state.lock().unwrap();
        st.locks.entry(ino).or_default().set(owner, lock);
    }

    /// Has allocations refused with ENOSPC (or granted again).
    pub(crate) fn pool_full(&self, full: bool) {
        self.state.lock().unwrap().pool_full = full;
    }

    /// Makes every transfer to `node` fail (None: none).
    pub(crate) fn fail_node(&self, node: Option<u32>) {
        self.state.lock().unwrap().failing_node = node;
    }

    /// Has our session with `node` be gone (None: none), `noticed` or not yet.
    pub(crate) fn lose_session(&self, lost: Option<(u32, bool)>) {
        self.state.lock().unwrap().lost_session = lost;
    }

    /// Takes back every key handed out, as data nodes do when their metadata node restarts.
    pub(crate) fn revoke_keys(&self) {
        self.state.lock().unwrap().revocations += 1;
    }

    /// Takes back every key as soon as it is handed out, for good (`true`) or not.
    pub(crate) fn refuse_every_key(&self, refuse: bool) {
        self.state.lock().unwrap().refuse_every_key = refuse;
    }

    /// Holds every write back until [`Self::let_writes_go`].
    pub(crate) fn hold_writes(&self) {
        self.state
            .lock()
            .unwrap()
            .held_writes
            .get_or_insert_with(Vec::new);
    }

    /// Writes held back so far.
    pub(crate) fn writes_held(&self) -> usize {
        self.state
            .lock()
            .unwrap()
            .held_writes
            .as_ref()
            .map_or(0, Vec::len)
    }

    /// Carries out the writes held back, in order, and holds no more.
    pub(crate) fn let_writes_go(&self) {
        let held = self.state.lock().unwrap().held_writes.take();
        for (chunk, offset, data, done) in held.into_iter().flatten() {
            self.write_now(&chunk, offset, data, done);
        }
    }

    /// Carries out the first `n` writes held back, and goes on holding.
    pub(crate) fn let_first_writes_go(&self, n: usize) {
        let first: Vec<HeldWrite> = {
            let mut st = self.state.lock().unwrap();
            let held = st.held_writes.as_mut().expect("holding writes");
            held.drain(..n).collect()
        };
        for (chunk, offset, data, done) in first {
            self.write_now(&chunk, offset, data, done);
        }
    }

    fn write_now(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: WriteBack) {
        let kept = data.clone();
        match self.transfer(chunk, offset, data, true) {
            Ok(data) => done(Ok(()), data),
            Err(e) => done(Err(e), kept),
        }
    }

    /// A cluster that keeps `n` copies of each chunk, over `n + 1` nodes.
    pub(crate) fn with_replicas(n: usize) -> Arc<FakeCluster> {
        let c = FakeCluster::default();
        c.state.lock().unwrap().replicas = n;
        Arc::new(c)
    }

    /// A cluster of two data nodes that each hold a copy of every chunk.
    pub(crate) fn mirrored() -> Arc<FakeCluster> {
        let c = FakeCluster::default();
        c.state.lock().unwrap().mirrored = true;
        Arc::new(c)
    }

    /// A cluster whose only data node is node 0.
    pub(crate) fn on_one_node() -> Arc<FakeCluster> {
        let c = FakeCluster::default();
        c.state.lock().unwrap().one_node = true;
        Arc::new(c)
    }

    /// The replicas of chunk `index` of `ino`.
    pub(crate) fn replicas(&self, ino: Ino, index: u64) -> Replicas {
        self.state.lock().unwrap().chunks[&(ino, index)].clone()
    }

    /// The size the "metadata node" has for `ino`.
    pub(crate) fn size(&self, ino: Ino) -> u64 {
        self.state.lock().unwrap().files[&ino].size
    }

    /// Removes `ino` as another client's unlink would: calls about it answer ENOENT.
    pub(crate) fn forget_file(&self, ino: Ino) {
        self.state.lock().unwrap().files.remove(&ino);
    }

    /// Chunks allocated to `ino`.
    pub(crate) fn chunk_count(&self, ino: Ino) -> usize {
        let st = self.state.lock().unwrap();
        st.chunks.keys().filter(|(i, _)| *i == ino).count()
    }

    fn handle(&self, req: Request) -> Vec<u8> {
        fn make(st: &mut State, kind: FileKind, owner: Owner, rdev: u32) -> Attr {
            let ino = ROOT + 1 + st.files.len() as u64;
            let a = Attr {
                ino,
                kind,
                perm: owner.perm & !owner.umask,
                nlink: 1,
                uid: owner.uid,
                gid: owner.gid,
                rdev,
                size: 0,
                atime: Timestamp::default(),
                mtime: Timestamp::default(),
                ctime: Timestamp::default(),
                cuts: 0,
                acl: false,
                held: 0,
            };
            st.files.insert(ino, a);
            a
        }
        // The fake keeps no directories: any parent is one, as the new inode left it.
        fn made(parent: Ino, attr: Attr) -> Made {
            let dir = Attr {
                ino: parent,
                kind: FileKind::Directory,
                ..attr
            };
            Made { attr, dir }
        }
        let mut st = self.state.lock().unwrap();
        *st.calls.entry(req.op()).or_default() += 1;
        if let Some(errno) = st.refuse_next.remove(&req.op()) {
            return encode_reply::<()>(req.op() as u8, &Err(errno));
        }
        let st = &mut *st;
        let attr = |st: &State, ino| st.files.get(&ino).copied().ok_or(Errno::ENOENT);
        match &req {
            Request::GetStatFs(m) => answer(
                m,
                Ok(StatFs {
                    chunk_size: CHUNK,
                    bytes_total: CHUNK << 20,
                    bytes_free: CHUNK << 20,
                    inodes: st.files.len() as u64,
                    inodes_max: u64::MAX,
                    lease_ms: match self.lease_ms.load(std::sync::atomic::Ordering::Relaxed) {
                        0 => 10_000,
                        ms => ms,
                    },
                    replicas: st.replicas.max(1) as u32,
                    chunks_short: 0,
                }),
            ),
            Request::Mknod(m) => answer(m, Ok(made(m.parent, make(st, m.kind, m.owner, m.rdev)))),
            Request::Mkdir(m) => answer(
                m,
                Ok(made(m.parent, make(st, FileKind::Directory, m.owner, 0))),
            ),
            // Only the names Create made.
            Request::Lookup(m) => answer(
                m,
                match st.names.get(&(m.parent, m.name.0.clone())) {
                    Some(&ino) => attr(st, ino),
                    None => Err(Errno::ENOENT),
                },
            ),
            Request::Create(m) if st.names.contains_key(&(m.parent, m.name.0.clone())) => {
                answer(m, Err(Errno::EEXIST))
            }
            Request::Create(m) => {
                let made = made(m.parent, make(st, FileKind::RegularFile, m.owner, 0));
                st.names.insert((m.parent, m.name.0.clone()), made.attr.ino);
                *st.held.entry(made.attr.ino).or_default() += 1;
                answer(m, Ok(made))
            }
            Request::GetAttr(m) => answer(m, attr(st, m.ino)),
            Request::Open(m) => {
                let a = attr(st, m.ino);
                if a.is_ok() {
                    *st.held.entry(m.ino).or_default() += 1;
                }
                // No chunks with it: the client fetches them as it would after an open that
                // found the file's chunks frozen.
                let opened = a.map(|attr| Opened {
                    attr,
                    map: FileMap {
                        cuts: attr.cuts,
                        chunks: Vec::new(),
                    },
                });
                answer(m, opened)
            }
            Request::Release(m) => {
                st.released.push((m.ino, m.access));
                st.let_go(m.ino);
                answer(m, attr(st, m.ino).map(drop))
            }
            Request::ReleaseMany(m) => {
                st.released.extend(&m.handles);
                for &(ino, _) in &m.handles {
                    st.let_go(ino);
                }
                answer(m, Ok(m.handles.len() as u32))
            }
            Request::Commit(m) if st.commits_late => answer(m, Err(Errno::EIO)),
            Request::Commit(m) if st.held.get(&m.ino).copied().unwrap_or(0) == 0 => {
                answer(m, Err(Errno::EBADF))
            }
            Request::Commit(m) => {
                let r = st.files.get_mut(&m.ino).ok_or(Errno::ENOENT).and_then(|a| {
                    if m.cuts != a.cuts {
                        return Err(Errno::ESTALE); // made before a cut it had not heard of
                    }
                    let before = *a;
                    a.size = a.size.max(m.size);
                    a.mtime = m.mtime.unwrap_or(a.mtime);
                    Ok(Committed { before, after: *a })
                });
                answer(m, r)
            }
            Request::SetAttr(m) => {
                if let Some(size) = m.changes.size {
                    st.zero_tail(m.ino, size);
                    let keep = size.div_ceil(CHUNK);
                    st.chunks.retain(|&(i, idx), _| i != m.ino || idx < keep);
                }
                let r = st.files.get_mut(&m.ino).ok_or(Errno::ENOENT).map(|a| {
                    if let Some(size) = m.changes.size {
                        a.size = size;
                        a.cuts += 1;
                    }
                    *a
                });
                answer(m, r)
            }
            Request::ChunkMap(m) => answer(m, Ok(map(st, m.ino, m.first, m.count))),
            Request::Allocate(m) if st.pool_full => answer(m, Err(Errno::ENOSPC)),
            Request::Allocate(m) => {
                let (copies, nodes) = match st.replicas {
                    _ if st.mirrored => (2, 2),
                    0 if st.one_node => (1, 1),
                    0 => (1, NODES as u64),
                    n => (n, n as u64 + 1),
                };
                let (first, end) = (m.offset / CHUNK, m.end.div_ceil(CHUNK));
                for idx in first..end {
                    if !st.chunks.contains_key(&(m.ino, idx)) {
                        let first = st.next_addr / CHUNK;
                        let replicas: Replicas = (0..copies as u64)
                            .map(|k| ChunkRef {
                                node: ((first + k) % nodes) as u32,
                                addr: st.next_addr,
                                rkey: 1,
                                lo: 0,
                                len: CHUNK as u32,
                            })
                            .collect();
                        st.next_addr += CHUNK;
                        for c in &replicas {
                            st.memory.insert((c.node, c.addr), vec![0; CHUNK as usize]);
                        }
                        st.chunks.insert((m.ino, idx), replicas);
                    }
                }
                answer(m, Ok(map(st, m.ino, first, (end - first) as u32)))
            }
            Request::DropReplicas(m) => {
                let r = match st.chunks.get_mut(&(m.ino, m.index)) {
                    Some(replicas) => {
                        let reached = |c: &ChunkRef| m.reached.iter().any(|r| r.node == c.node);
                        if !replicas.iter().any(reached) {
                            Err(Errno::EIO)
                        } else {
                            let before = replicas.len();
                            replicas.retain(reached);
                            Ok((before - replicas.len()) as u32)
                        }
                    }
                    None => Ok(0),
                };
                answer(m, r)
            }
            Request::SetLock(m) => {
                let set = st.locks.entry(m.ino).or_default();
                let conflict = set.conflict(m.owner, &m.lock).map(|&(_, l)| l);
                if conflict.is_none() {
                    set.set(m.owner, m.lock);
                }
                answer(m, Ok(conflict))
            }
            Request::GetLock(m) => {
                let set = st.locks.entry(m.ino).or_default();
                answer(m, Ok(set.conflict(m.owner, &m.lock).map(|&(_, l)| l)))
            }
            Request::CancelWait(m) => answer(m, Ok(())),
            Request::DropLocks(m) => {
                if let Some(set) = st.locks.get_mut(&m.ino) {
                    set.drop_owners(|o| o == m.owner);
                }
                answer(m, Ok(()))
            }
            other => {
                let op = other.op() as u8;
                encode_reply::<()>(op, &Err(Errno::from_raw(libc::ENOSYS)))
            }
        }
    }

    fn transfer(
        &self,
        chunk: &ChunkRef,
        offset: u64,
        mut buf: Vec<u8>,
        write: bool,
    ) -> Result<Vec<u8>> {
        let mut st = self.state.lock().unwrap();
        if st.failing_node == Some(chunk.node) {
            return Err(Error::new(Errno::EIO, "injected failure"));
        }
        if st.lost_session.is_some_and(|(node, _)| node == chunk.node) {
            return Err(Error::data(chunk.node, &rdmabox::IoError::Closed));
        }
        if chunk.rkey != st.key() || st.refuse_every_key {
            let refused = rdmabox::IoError::Transport(WcStatus::RemoteAccessError);
            return Err(Error::data(chunk.node, &refused));
        }
        let mem = st
            .memory
            .get_mut(&(chunk.node, chunk.addr))
            .ok_or_else(|| Error::new(Errno::EIO, "remote access error"))?;
        let range = offset as usize..offset as usize + buf.len();
        if write {
            mem[range].copy_from_slice(&buf);
        } else {
            buf.copy_from_slice(&mem[range]);
        }
        Ok(buf)
    }
}

impl State {
    /// Zeroes the rest of the chunk a cut of `ino` to `size` splits, on every replica, as the
    /// metadata node does (growing the file too: it holds over uncommitted writes).
    fn zero_tail(&mut self, ino: Ino, size: u64) {
        let Some(replicas) = self.chunks.get(&(ino, size / CHUNK)) else {
            return;
        };
        for c in replicas {
            if let Some(mem) = self.memory.get_mut(&(c.node, c.addr)) {
                mem[(size % CHUNK) as usize..].fill(0);
            }
        }
    }
}

/// Chunks `first..first+count` of `ino`, with the keys handed out now.
fn map(st: &State, ino: Ino, first: u64, count: u32) -> FileMap {
    let with_key = |c: &ChunkRef| ChunkRef {
        rkey: st.key(),
        ..*c
    };
    FileMap {
        cuts: st.files.get(&ino).map_or(0, |a| a.cuts),
        chunks: st
            .chunks
            .range((ino, first)..(ino, first + count as u64))
            .map(|(&(_, idx), c)| (idx, c.iter().map(with_key).collect()))
            .take(MAX_LIST as usize)
            .collect(),
    }
}

impl MetadataChannel for Fake {
    fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>> {
        if self.0.state.lock().unwrap().unreachable {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "metadata node unreachable",
            ));
        }
        let req =
            Request::decode(request).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if matches!(req, Request::ReleaseMany(_)) {
            (self.0.closes_sent).fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(self.0.closes_gate.lock().unwrap());
        }
        if matches!(req, Request::Commit(_)) {
            let meanwhile = self.0.before_commit.lock().unwrap().take();
            if let Some(meanwhile) = meanwhile {
                meanwhile();
            }
        }
        let op = req.op();
        let answered = self.0.handle(req);
        {
            let mut st = self.0.state.lock().unwrap();
            if let Some(i) = st.lose_answer.iter().position(|&o| o == op) {
                st.lose_answer.remove(i);
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the metadata node lost this client's session while the call was under way",
                ));
            }
        }
        let meanwhile = {
            let mut after = self.0.after_answer.lock().unwrap();
            match after.take() {
                Some((due, meanwhile)) if due == op => Some(meanwhile),
                other => {
                    *after = other;
                    None
                }
            }
        };
        if let Some(meanwhile) = meanwhile {
            meanwhile();
        }
        Ok(answered)
    }
}

impl Backend for Fake {
    fn is_connected(&self, node: u32) -> bool {
        self.0.state.lock().unwrap().lost_session != Some((node, true))
    }

    fn is_down(&self, _node: u32) -> bool {
        false
    }

    fn connect(&self, _node: u32) -> Result<()> {
        Ok(())
    }

    fn read(&self, chunk: &ChunkRef, offset: u64, len: usize, done: DataDone) {
        match self.0.transfer(chunk, offset, vec![0; len], false) {
            Ok(data) => done(Ok(&data)),
            Err(e) => done(Err(e)),
        }
    }

    fn read_gathered(&self, pieces: &[(ChunkRef, u64, usize)], done: DataDone) {
        self.0.state.lock().unwrap().gathered_reads += 1;
        let mut whole = Vec::new();
        for (chunk, offset, len) in pieces {
            match self.0.transfer(chunk, *offset, vec![0; *len], false) {
                Ok(data) => whole.extend_from_slice(&data),
                Err(e) => return done(Err(e)),
            }
        }
        done(Ok(&whole))
    }

    fn write(&self, chunk: &ChunkRef, offset: u64, data: Vec<u8>, done: WriteBack) {
        if let Some(held) = &mut self.0.state.lock().unwrap().held_writes {
            return held.push((*chunk, offset, data, done));
        }
        self.0.write_now(chunk, offset, data, done)
    }

    fn transport(&self) -> String {
        "fake".into()
    }

    fn counters(&self) -> Snapshot {
        Snapshot::default()
    }

    /// The fake makes no callbacks: the tests call `Rfs::on_callback` themselves.
    fn on_notice(&self, _handler: rfs_client::NoticeHandler) {}

    fn on_reclaim(&self, _held: rfs_client::ListHeld) {}

    fn metadata_connected(&self) -> bool {
        !self.0.state.lock().unwrap().metadata_down
    }

    /// The fake's connection comes back when a test says so.
    fn redial(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Proves the fake answers like the real service does: typed replies decode.
#[test]
fn the_fake_speaks_the_protocol() {
    let f = Fake(Arc::default());
    let raw = f
        .exchange(&Request::from(rfs_proto::message::GetStatFs {}).encode())
        .unwrap();
    let s = decode_reply::<rfs_proto::message::GetStatFs>(&raw)
        .unwrap()
        .unwrap();
    assert_eq!(s.chunk_size, CHUNK);
}
