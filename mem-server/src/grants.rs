//! What each data session on this node may reach of the pool. A data session's queue pairs
//! live in a protection domain of their own, where nothing is registered until the metadata
//! node grants copies to it ([`rfs_proto::grant`]): each grant is a registration of exactly
//! one copy's extent in that domain (its own remote key; small files share chunks of the pool,
//! and a grant never reaches a neighbour's bytes), and a revocation drops it, after which the
//! key fails with a remote access error. The pool's own key is never handed out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use rdmabox::transport::{Access, MemoryRegion, ProtectionDomain};
use rfs_proto::grant::{
    GrantChunks, GrantPool, GrantRequest, RevokeChunks, RevokeFreed, RevokeSession,
};
use rfs_proto::Errno;

/// What a copy's extent starts and ends on.
const PAGE: u64 = 4096;

/// One data session: its domain and what it was granted, by (address, length, writable).
struct SessionGrants {
    pd: Arc<ProtectionDomain>,
    chunks: BTreeMap<(u64, u32, bool), MemoryRegion>,
    pool: Option<MemoryRegion>,
}

impl SessionGrants {
    /// Drops every grant that reaches into `[addr, addr + len)` (grants are at most a chunk
    /// long, `longest`).
    fn drop_overlapping(&mut self, addr: u64, len: u64, longest: u64) {
        let from = (addr.saturating_sub(longest), 0, false);
        let hit: Vec<_> = self
            .chunks
            .range(from..(addr + len, 0, false))
            .filter(|((a, l, _), _)| a + *l as u64 > addr)
            .map(|(k, _)| *k)
            .collect();
        for k in hit {
            self.chunks.remove(&k);
        }
    }
}

#[derive(Default)]
struct State {
    sessions: HashMap<u64, SessionGrants>,
    /// Per chunk of the pool, the number of the latest free that revoked anything in it: a
    /// grant in it decided before is refused.
    freed: Vec<u64>,
}

/// The node's grant table. One lock covers a grant's check and its registration, and a
/// revocation's record and its drops, so that neither can slip between the other's halves.
pub(crate) struct Grants {
    pool: Arc<MemoryRegion>,
    chunk_size: u64,
    state: Mutex<State>,
}

/// What a grant lets the peer do (verbs wants local write beside remote write).
fn grant_access(writable: bool) -> Access {
    if writable {
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE
    } else {
        Access::REMOTE_READ
    }
}

impl Grants {
    pub(crate) fn new(pool: Arc<MemoryRegion>, chunk_size: u64) -> Grants {
        let chunks = pool.len() as u64 / chunk_size;
        Grants {
            pool,
            chunk_size,
            state: Mutex::new(State {
                sessions: HashMap::new(),
                freed: vec![0; chunks as usize],
            }),
        }
    }

    /// Names a new data session whose queue pairs are in `pd`; it reaches nothing yet.
    pub(crate) fn open(&self, pd: Arc<ProtectionDomain>) -> u64 {
        let mut st = self.state.lock().unwrap();
        let name = loop {
            let n = rdmabox::random::u64();
            if n != 0 && !st.sessions.contains_key(&n) {
                break n;
            }
        };
        st.sessions.insert(
            name,
            SessionGrants {
                pd,
                chunks: BTreeMap::new(),
                pool: None,
            },
        );
        name
    }

    /// The session is gone: its grants with it.
    pub(crate) fn close(&self, session: u64) {
        let gone = self.state.lock().unwrap().sessions.remove(&session);
        drop(gone);
    }

    /// Every session's grants go (the metadata node that made them is gone), and the free
    /// numbers with them: the next metadata node (restarted, or reached again) counts anew.
    pub(crate) fn revoke_everything(&self) {
        let mut st = self.state.lock().unwrap();
        for s in st.sessions.values_mut() {
            s.chunks.clear();
            s.pool = None;
        }
        st.freed.fill(0);
    }

    /// The chunks of the pool that extent `[addr, addr + len)` is in, if it is a copy's
    /// (page-aligned, at most a chunk long, within the pool).
    fn chunks_of(&self, addr: u64, len: u32) -> Option<std::ops::Range<usize>> {
        let off = addr.checked_sub(self.pool.addr())?;
        let end = off.checked_add(len as u64)?;
        let fits = off % PAGE == 0
            && len > 0
            && len as u64 <= self.chunk_size
            && end <= self.pool.len() as u64;
        fits.then(|| (off / self.chunk_size) as usize..end.div_ceil(self.chunk_size) as usize)
    }

    /// Does what the metadata node asks: the remote keys of a grant, nothing for a revocation.
    pub(crate) fn serve(&self, req: &GrantRequest) -> Result<Vec<u32>, Errno> {
        let mut st = self.state.lock().unwrap();
        let State { sessions, freed } = &mut *st;
        match req {
            GrantRequest::GrantChunks(GrantChunks {
                session,
                seq,
                writable,
                extents,
            }) => {
                let Some(s) = sessions.get_mut(session) else {
                    return Ok(vec![0; extents.len()]);
                };
                Ok(extents
                    .iter()
                    .map(|&(addr, len)| {
                        let Some(chunks) = self.chunks_of(addr, len) else {
                            log::warn!(
                                "the metadata node granted {len} bytes at {addr:#x}, not a \
                                 copy's extent here"
                            );
                            return 0;
                        };
                        if freed[chunks].iter().any(|&f| f > *seq) {
                            return 0; // freed after the grant was decided
                        }
                        if let Some(mr) = s.chunks.get(&(addr, len, *writable)) {
                            return mr.rkey();
                        }
                        let off = (addr - self.pool.addr()) as usize;
                        match s.pd.register_within(
                            &self.pool,
                            off,
                            len as usize,
                            grant_access(*writable),
                        ) {
                            Ok(mr) => {
                                let rkey = mr.rkey();
                                s.chunks.insert((addr, len, *writable), mr);
                                rkey
                            }
                            Err(e) => {
                                log::error!("granting chunk {addr:#x}: {e}");
                                0
                            }
                        }
                    })
                    .collect())
            }
            GrantRequest::RevokeChunks(RevokeChunks {
                session,
                writable_only,
                addrs,
            }) => {
                if let Some(s) = sessions.get_mut(session) {
                    let addrs: HashSet<u64> = addrs.iter().copied().collect();
                    s.chunks
                        .retain(|(a, _, w), _| !(addrs.contains(a) && (*w || !writable_only)));
                }
                Ok(Vec::new())
            }
            GrantRequest::RevokeFreed(RevokeFreed { seq, extents }) => {
                for &(a, len) in extents {
                    if let Some(chunks) = self.chunks_of(a, len) {
                        for f in &mut freed[chunks] {
                            *f = (*f).max(*seq);
                        }
                    }
                    for s in sessions.values_mut() {
                        s.drop_overlapping(a, len as u64, self.chunk_size);
                    }
                }
                Ok(Vec::new())
            }
            GrantRequest::RevokeSession(RevokeSession { session }) => {
                if let Some(s) = sessions.get_mut(session) {
                    s.chunks.clear();
                    s.pool = None;
                }
                Ok(Vec::new())
            }
            GrantRequest::GrantPool(GrantPool { session }) => {
                let s = sessions.get_mut(session).ok_or(Errno::ENOENT)?;
                let mr =
                    s.pd.register_within(&self.pool, 0, self.pool.len(), grant_access(true))
                        .map_err(|e| {
                            log::error!("granting the pool: {e}");
                            Errno::EIO
                        })?;
                let rkey = mr.rkey();
                s.pool = Some(mr);
                Ok(vec![rkey])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmabox::transport::{Context, TransportConfig};

    const CHUNK: u64 = 4 * PAGE;

    fn grants() -> (Context, Grants) {
        let ctx = Context::open(&TransportConfig::default()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let pool = Arc::new(pd.alloc_region(4 * CHUNK as usize, Access::ALL).unwrap());
        (ctx, Grants::new(pool, CHUNK))
    }

    /// Grants the whole chunks at `addrs`.
    fn grant(g: &Grants, session: u64, seq: u64, writable: bool, addrs: &[u64]) -> Vec<u32> {
        let extents: Vec<(u64, u32)> = addrs.iter().map(|&a| (a, CHUNK as u32)).collect();
        grant_extents(g, session, seq, writable, &extents)
    }

    fn grant_extents(
        g: &Grants,
        session: u64,
        seq: u64,
        writable: bool,
        extents: &[(u64, u32)],
    ) -> Vec<u32> {
        let req = GrantChunks {
            session,
            seq,
            writable,
            extents: extents.to_vec(),
        };
        g.serve(&req.into()).unwrap()
    }

    #[test]
    fn grants_are_per_session_chunk_and_access_and_idempotent() {
        let (ctx, g) = grants();
        let a = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let b = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let base = g.pool.addr();
        let ka = grant(&g, a, 0, false, &[base, base + CHUNK]);
        assert!(ka.iter().all(|&k| k != 0));
        assert_eq!(grant(&g, a, 0, false, &[base]), vec![ka[0]], "same grant");
        let kw = grant(&g, a, 0, true, &[base]);
        assert_ne!(kw, vec![ka[0]], "writing is a grant of its own");
        let kb = grant(&g, b, 0, false, &[base]);
        assert_ne!(kb, vec![ka[0]]);
        // Not chunks of this pool, or no such session: refused.
        assert_eq!(
            grant(&g, a, 0, false, &[base + 1, base + 4 * CHUNK, 0]),
            vec![0, 0, 0]
        );
        assert_eq!(grant(&g, 12345, 0, false, &[base]), vec![0]);
    }

    #[test]
    fn a_grant_decided_before_a_free_is_refused_after_it() {
        let (ctx, g) = grants();
        let a = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let b = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let c = g.pool.addr() + 2 * CHUNK;
        let old = grant(&g, a, 4, true, &[c])[0];
        let free = RevokeFreed {
            seq: 5,
            extents: vec![(c, CHUNK as u32)],
        };
        g.serve(&free.into()).unwrap();
        assert_eq!(
            grant(&g, b, 4, true, &[c]),
            vec![0],
            "decided before free 5"
        );
        let new = grant(&g, a, 5, true, &[c])[0];
        assert!(new != 0 && new != old, "a fresh grant after the free");
    }

    #[test]
    fn revocations_drop_exactly_what_they_name() {
        let (ctx, g) = grants();
        let a = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let base = g.pool.addr();
        let first = grant(&g, a, 0, true, &[base, base + CHUNK]);
        let read_only = grant(&g, a, 0, false, &[base])[0];
        let writes = RevokeChunks {
            session: a,
            writable_only: true,
            addrs: vec![base],
        };
        g.serve(&writes.into()).unwrap();
        assert_eq!(grant(&g, a, 0, false, &[base]), vec![read_only], "kept");
        assert_ne!(grant(&g, a, 0, true, &[base]), vec![first[0]], "revoked");
        let revoke = RevokeChunks {
            session: a,
            writable_only: false,
            addrs: vec![base],
        };
        g.serve(&revoke.into()).unwrap();
        let again = grant(&g, a, 0, true, &[base, base + CHUNK]);
        assert_ne!(again[0], first[0], "revoked, granted anew");
        assert_eq!(again[1], first[1], "untouched");
        g.serve(&RevokeSession { session: a }.into()).unwrap();
        assert_ne!(grant(&g, a, 0, true, &[base + CHUNK])[0], first[1]);
        assert_eq!(
            g.serve(&GrantPool { session: 999 }.into()),
            Err(Errno::ENOENT)
        );
        assert!(g.serve(&GrantPool { session: a }.into()).unwrap()[0] != 0);
    }

    /// Small files share chunks of the pool: a grant is exactly its extent, a free of one
    /// drops only the grants reaching into it, and a grant decided before a free anywhere in
    /// the chunk is refused (conservative: the client asks again).
    #[test]
    fn extents_sharing_a_chunk_are_granted_and_freed_apart() {
        let (ctx, g) = grants();
        let a = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let base = g.pool.addr() + CHUNK;
        let small = [(base, PAGE as u32), (base + PAGE, 2 * PAGE as u32)];
        let keys = grant_extents(&g, a, 1, true, &small);
        assert!(keys.iter().all(|&k| k != 0));
        assert_eq!(
            grant_extents(
                &g,
                a,
                1,
                true,
                &[(base + 1, 4096), (base, 0), (base, 2 * CHUNK as u32)]
            ),
            vec![0, 0, 0],
            "unaligned, empty, longer than a chunk"
        );
        let st = g.state.lock().unwrap();
        let lens: Vec<u64> = st.sessions[&a]
            .chunks
            .values()
            .map(|mr| mr.len() as u64)
            .collect();
        assert_eq!(lens, [PAGE, 2 * PAGE], "registered exactly");
        drop(st);
        let free = RevokeFreed {
            seq: 2,
            extents: vec![(base + 2 * PAGE, PAGE as u32)],
        };
        g.serve(&free.into()).unwrap();
        assert_eq!(
            grant_extents(&g, a, 1, true, &small),
            vec![0, 0],
            "decided before a free in their chunk"
        );
        assert_eq!(
            grant_extents(&g, a, 2, true, &small[..1]),
            vec![keys[0]],
            "untouched"
        );
        let again = grant_extents(&g, a, 2, true, &small[1..])[0];
        assert!(again != 0 && again != keys[1], "the overlapping grant went");
    }
}
