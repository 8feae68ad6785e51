//! The metadata service, on the first node: one metadata channel per client (RPC over SEND/RECV),
//! each request applied to the namespace and the allocator under one lock (metadata operations
//! are short), freed chunks handed to the zeroer.

use std::collections::HashMap;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use crossbeam_channel::Receiver;
use rdmabox::connect_links;
use rdmabox::rpc;
use rdmabox::transport::MemoryRegion;
use rfs_proto::message::{encode_reply, readdir_budget, Call, Request};
use rfs_proto::types::{ChunkRef, Ino, StatFs};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::Errno;

use crate::alloc::Allocator;
use crate::namespace::Namespace;
use crate::node::{wait_for_close, NodeConfig, Shared};
use crate::zeroer::Zeroer;

/// The namespace and the allocator, under one lock.
pub(crate) struct MetaState {
    pub(crate) ns: Namespace,
    pub(crate) alloc: Allocator,
}

pub(crate) struct MetaService {
    pub(crate) state: Mutex<MetaState>,
    pub(crate) zeroer: Zeroer,
    /// Bytes of entries a readdir reply may carry: pages are cut to fit a message.
    page_bytes: usize,
}

/// The handles one client holds open, released when it leaves however it leaves.
#[derive(Default)]
struct OpenHandles(HashMap<Ino, u32>);

/// Keeps the chunks an operation freed, for the zeroer.
fn freeing(freed: &mut Vec<ChunkRef>, r: Result<Vec<ChunkRef>, Errno>) -> Result<(), Errno> {
    r.map(|f| freed.extend(f))
}

/// The reply to `call`: typed by the call, so each request can only get its own kind of answer.
fn answer<C: Call>(_call: &C, result: Result<C::Reply, Errno>) -> Vec<u8> {
    encode_reply(C::OP as u8, &result)
}

impl MetaService {
    /// The service over a fresh namespace, with this node's own pool as node 0, and the kicks
    /// its zeroer thread waits on.
    pub(crate) fn new(
        cfg: &NodeConfig,
        advertise: String,
        pool: &MemoryRegion,
        chunks: u64,
    ) -> (Arc<MetaService>, Receiver<()>) {
        let mut alloc = Allocator::default();
        alloc.add_node(advertise, pool.addr(), pool.rkey(), cfg.chunk_size, chunks);
        let (zeroer, wait) = Zeroer::new();
        let meta = Arc::new(MetaService {
            state: Mutex::new(MetaState {
                ns: Namespace::new(cfg.chunk_size),
                alloc,
            }),
            zeroer,
            page_bytes: readdir_budget(cfg.rpc.max_msg),
        });
        (meta, wait)
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

    /// Chunks no file uses any more: zeroed before anyone gets them again.
    fn free(&self, st: &mut MetaState, freed: Vec<ChunkRef>) {
        if !freed.is_empty() {
            st.alloc.release(freed);
            self.zeroer.kick();
        }
    }

    /// Serves one client's metadata channel until it goes.
    pub(crate) fn serve(&self, node: &Shared, mut s: TcpStream) -> io::Result<()> {
        let mut links = connect_links(
            &node.ctx,
            &node.pd,
            &mut s,
            1,
            rdmabox::SessionConfig::default().caps,
        )?;
        let (qp, cq) = links.pop().expect("one link");
        let mut open = OpenHandles::default();
        let stop = AtomicBool::new(false);
        let closer = {
            let mut watch = s.try_clone()?;
            std::thread::spawn(move || wait_for_close(&mut watch))
        };
        let result = rpc::serve(&node.pd, qp, cq, node.cfg.rpc, &stop, |body| {
            self.handle(&mut open, body)
        });
        let mut st = self.state.lock().unwrap();
        let mut freed = Vec::new();
        for (ino, n) in open.0 {
            for _ in 0..n {
                freed.extend(st.ns.release(ino));
            }
        }
        self.free(&mut st, freed);
        drop(st);
        drop(s);
        let _ = closer.join();
        result
    }

    /// Decodes, applies and answers one request.
    fn handle(&self, open: &mut OpenHandles, body: &[u8]) -> Vec<u8> {
        let req = match Request::decode(body) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("malformed metadata request: {e}");
                let op = body.get(1).copied().unwrap_or(0);
                return encode_reply::<()>(op, &Err(Errno::EPROTO));
            }
        };
        let mut st = self.state.lock().unwrap();
        let MetaState { ns, alloc } = &mut *st;
        let mut freed = Vec::new();
        let reply = match &req {
            Request::Lookup(m) => answer(m, ns.lookup(m.parent, &m.name)),
            Request::GetAttr(m) => answer(m, ns.getattr(m.ino)),
            Request::SetAttr(m) => answer(
                m,
                ns.setattr(m.ino, &m.changes).map(|(a, f)| {
                    freed = f;
                    a
                }),
            ),
            Request::Mknod(m) => answer(m, ns.mknod(m.parent, &m.name, m.kind, m.rdev, m.owner)),
            Request::Mkdir(m) => answer(m, ns.mkdir(m.parent, &m.name, m.owner)),
            Request::Symlink(m) => {
                answer(m, ns.symlink(m.parent, &m.name, &m.target, m.uid, m.gid))
            }
            Request::Readlink(m) => answer(m, ns.readlink(m.ino)),
            Request::Link(m) => answer(m, ns.link(m.ino, m.newparent, &m.newname)),
            Request::Unlink(m) => answer(m, freeing(&mut freed, ns.unlink(m.parent, &m.name))),
            Request::Rmdir(m) => answer(m, ns.rmdir(m.parent, &m.name)),
            Request::Rename(m) => answer(
                m,
                freeing(
                    &mut freed,
                    ns.rename(m.parent, &m.name, m.newparent, &m.newname, m.flags),
                ),
            ),
            Request::ReadDir(m) => answer(
                m,
                ns.readdir(
                    m.ino,
                    m.cookie,
                    m.max.min(MAX_LIST) as usize,
                    self.page_bytes,
                ),
            ),
            Request::Open(m) => answer(
                m,
                ns.open(m.ino)
                    .inspect(|_| *open.0.entry(m.ino).or_default() += 1),
            ),
            Request::Release(m) => answer(
                m,
                match open.0.get_mut(&m.ino) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        if *n == 0 {
                            open.0.remove(&m.ino);
                        }
                        freeing(&mut freed, Ok(ns.release(m.ino)))
                    }
                    _ => Err(Errno::EBADF),
                },
            ),
            Request::ChunkMap(m) => answer(
                m,
                ns.chunk_map(m.ino, m.first, m.count.min(MAX_LIST) as u64),
            ),
            Request::Allocate(m) => {
                let count = m.count.min(MAX_LIST) as u64;
                let result = ns
                    .missing_chunks(m.ino, m.first, count)
                    .and_then(|missing| {
                        let chunks = alloc.alloc(missing.len())?;
                        let new: Vec<_> = missing.into_iter().zip(chunks).collect();
                        if let Err(e) = ns.add_chunks(m.ino, &new) {
                            freed.extend(new.into_iter().map(|(_, c)| c));
                            return Err(e);
                        }
                        ns.chunk_map(m.ino, m.first, count)
                    });
                answer(m, result)
            }
            Request::Commit(m) => answer(m, ns.commit(m.ino, m.size, m.mtime)),
            Request::GetStatFs(m) => {
                let (total, free) = alloc.totals();
                answer(
                    m,
                    Ok(StatFs {
                        chunk_size: ns.chunk_size(),
                        chunks_total: total,
                        chunks_free: free,
                        inodes: ns.inode_count(),
                    }),
                )
            }
            Request::ListNodes(m) => answer(m, Ok(alloc.nodes())),
        };
        self.free(&mut st, freed);
        reply
    }
}
