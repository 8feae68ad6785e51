//! What each data session on this node may reach of the pool. A data session's queue pairs
//! live in a protection domain of their own, where nothing is registered until the metadata
//! node grants copies to it ([`rfs_proto::grant`]): each grant is a registration of exactly
//! one copy's extent in that domain (its own remote key; small files share chunks of the pool,
//! and a grant never reaches a neighbour's bytes), and a revocation drops it, after which the
//! key fails with a remote access error. The pool's own key is never handed out.
//!
//! A session holds at most `max_per_session` grants (`--max-grants`), and the node four times
//! that over all sessions: a client that opens more small files than that at once must not
//! exhaust the NIC's table of registrations or the node's memory. Past either, the grant made
//! longest ago (of the session, or of the session holding the most) goes; a transfer through
//! its key then fails alone, and the client fetches the map again, which grants it again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use rdmabox::transport::{Access, MemoryRegion, ProtectionDomain};
use rfs_proto::grant::{
    GrantChunks, GrantPool, GrantRequest, RevokeChunks, RevokeFreed, RevokeSession,
};
use rfs_proto::Errno;

/// What a copy's extent starts and ends on.
const PAGE: u64 = 4096;
/// The node holds at most this many sessions' worth of grants.
const NODE_SHARES: usize = 4;

/// A grant: a copy's extent (address, length) and whether it may be written.
type Extent = (u64, u32, bool);

/// One data session: its domain and what it was granted, with when each was granted last.
struct SessionGrants {
    pd: Arc<ProtectionDomain>,
    chunks: BTreeMap<Extent, (MemoryRegion, u64)>,
    /// The grants by when they were granted last: the first goes when the session is full.
    by_age: BTreeMap<u64, Extent>,
    pool: Option<MemoryRegion>,
}

impl SessionGrants {
    fn new(pd: Arc<ProtectionDomain>) -> SessionGrants {
        SessionGrants {
            pd,
            chunks: BTreeMap::new(),
            by_age: BTreeMap::new(),
            pool: None,
        }
    }

    /// The key of grant `k` if the session holds it, marked as granted at `now`.
    fn touch(&mut self, k: Extent, now: u64) -> Option<u32> {
        let (mr, at) = self.chunks.get_mut(&k)?;
        self.by_age.remove(at);
        *at = now;
        self.by_age.insert(now, k);
        Some(mr.rkey())
    }

    /// Holds `mr` as grant `k`, granted at `now`, after dropping the oldest grants past
    /// `most` made before `since` (how many went): the grants of one answer never push each
    /// other out (the session may hold more for a moment).
    fn insert(&mut self, k: Extent, mr: MemoryRegion, now: u64, most: usize, since: u64) -> usize {
        let mut evicted = 0;
        while self.chunks.len() >= most && self.drop_oldest(since) {
            evicted += 1;
        }
        self.chunks.insert(k, (mr, now));
        self.by_age.insert(now, k);
        evicted
    }

    /// Drops the grant made longest ago, if it was made before `since`: whether one went.
    fn drop_oldest(&mut self, since: u64) -> bool {
        match self.by_age.first_key_value() {
            Some((&at, _)) if at < since => {}
            _ => return false,
        }
        let (_, oldest) = self.by_age.pop_first().expect("looked at");
        self.chunks.remove(&oldest);
        true
    }

    fn remove(&mut self, k: &Extent) {
        if let Some((_, at)) = self.chunks.remove(k) {
            self.by_age.remove(&at);
        }
    }

    fn clear(&mut self) {
        self.chunks.clear();
        self.by_age.clear();
        self.pool = None;
    }

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
            self.remove(&k);
        }
    }
}

#[derive(Default)]
struct State {
    sessions: HashMap<u64, SessionGrants>,
    /// Per chunk of the pool, the number of the latest free that revoked anything in it: a
    /// grant in it decided before is refused.
    freed: Vec<u64>,
    /// Counts grants as they are made or made again: their age.
    clock: u64,
    /// Grants dropped because their session was full.
    evicted: u64,
}

/// The node's grant table. One lock covers a grant's check and its registration, and a
/// revocation's record and its drops, so that neither can slip between the other's halves.
pub(crate) struct Grants {
    pool: Arc<MemoryRegion>,
    chunk_size: u64,
    max_per_session: usize,
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
    /// The grant table of `pool`, each session holding at most `max_per_session` grants.
    pub(crate) fn new(pool: Arc<MemoryRegion>, chunk_size: u64, max_per_session: usize) -> Grants {
        let chunks = pool.len() as u64 / chunk_size;
        Grants {
            pool,
            chunk_size,
            max_per_session: max_per_session.max(1),
            state: Mutex::new(State {
                freed: vec![0; chunks as usize],
                ..State::default()
            }),
        }
    }

    /// (grants held over every session, grants dropped because their session was full).
    pub(crate) fn counts(&self) -> (u64, u64) {
        let st = self.state.lock().unwrap();
        let held = st.sessions.values().map(|s| s.chunks.len() as u64).sum();
        (held, st.evicted)
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
        st.sessions.insert(name, SessionGrants::new(pd));
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
            s.clear();
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
        let State {
            sessions,
            freed,
            clock,
            evicted,
        } = &mut *st;
        match req {
            GrantRequest::GrantChunks(GrantChunks {
                session,
                seq,
                writable,
                extents,
            }) => {
                if !sessions.contains_key(session) {
                    return Ok(vec![0; extents.len()]);
                }
                let since = *clock + 1;
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
                        *clock += 1;
                        let k = (addr, len, *writable);
                        let s = sessions.get_mut(session).expect("looked up above");
                        if let Some(rkey) = s.touch(k, *clock) {
                            return rkey;
                        }
                        // The node's bound: the session holding the most gives one up.
                        let held: usize = sessions.values().map(|s| s.chunks.len()).sum();
                        if held >= self.max_per_session * NODE_SHARES {
                            let fattest = sessions.values_mut().max_by_key(|s| s.chunks.len());
                            if fattest.is_some_and(|f| f.drop_oldest(since)) {
                                *evicted += 1;
                            }
                        }
                        let s = sessions.get_mut(session).expect("looked up above");
                        let off = (addr - self.pool.addr()) as usize;
                        match s.pd.register_within(
                            &self.pool,
                            off,
                            len as usize,
                            grant_access(*writable),
                        ) {
                            Ok(mr) => {
                                let rkey = mr.rkey();
                                let most = self.max_per_session;
                                *evicted += s.insert(k, mr, *clock, most, since) as u64;
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
                    let gone: Vec<Extent> = s
                        .chunks
                        .keys()
                        .filter(|(a, _, w)| addrs.contains(a) && (*w || !writable_only))
                        .copied()
                        .collect();
                    for k in &gone {
                        s.remove(k);
                    }
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
                    s.clear();
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
        grants_of_at_most(1 << 20)
    }

    /// A grant table of a four-chunk pool whose sessions hold at most `most` grants each.
    fn grants_of_at_most(most: usize) -> (Context, Grants) {
        let ctx = Context::open(&TransportConfig::default()).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let pool = Arc::new(pd.alloc_region(4 * CHUNK as usize, Access::ALL).unwrap());
        (ctx, Grants::new(pool, CHUNK, most))
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
            .map(|(mr, _)| mr.len() as u64)
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

    /// A session holds at most its bound of grants: past it the one granted longest ago goes
    /// (its key fails from then on), one granted again is young again, and a grant dropped is
    /// granted anew when asked again.
    #[test]
    fn a_full_session_gives_up_its_oldest_grant() {
        let (ctx, g) = grants_of_at_most(3);
        let a = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let base = g.pool.addr();
        let page = |i: u64| (base + i * PAGE, PAGE as u32);
        let first: Vec<u32> = (0..3)
            .map(|i| grant_extents(&g, a, 0, false, &[page(i)])[0])
            .collect();
        assert_eq!(g.counts(), (3, 0));
        // Page 0 granted again: young again, so page 1 goes for page 3.
        assert_eq!(grant_extents(&g, a, 0, false, &[page(0)]), vec![first[0]]);
        grant_extents(&g, a, 0, false, &[page(3)]);
        assert_eq!(g.counts(), (3, 1));
        let held: Vec<_> = g.state.lock().unwrap().sessions[&a]
            .chunks
            .keys()
            .map(|k| k.0)
            .collect();
        assert_eq!(held, vec![page(0).0, page(2).0, page(3).0]);
        let again = grant_extents(&g, a, 0, false, &[page(1)])[0];
        assert!(
            again != 0 && again != first[1],
            "granted anew, with a new key"
        );
        assert_eq!(g.counts(), (3, 2));
    }

    /// The grants of one answer never push each other out: a map of more extents than the
    /// bound is granted whole (its keys all good), and the next grant brings the session back
    /// down, from what was granted before.
    #[test]
    fn one_answers_grants_never_push_each_other_out() {
        let (ctx, g) = grants_of_at_most(3);
        let a = g.open(Arc::new(ctx.alloc_pd().unwrap()));
        let page = |i: u64| (g.pool.addr() + i * PAGE, PAGE as u32);
        let five: Vec<_> = (0..5).map(page).collect();
        let keys = grant_extents(&g, a, 0, false, &five);
        assert!(keys.iter().all(|&k| k != 0));
        assert_eq!(g.counts(), (5, 0), "all five held");
        grant_extents(&g, a, 0, false, &[page(5)]);
        assert_eq!(g.counts(), (3, 3), "back to the bound");
    }

    /// Over all sessions the node holds at most four sessions' worth: the session holding the
    /// most gives one up.
    #[test]
    fn the_node_bounds_grants_over_all_sessions() {
        let (ctx, g) = grants_of_at_most(4);
        let base = g.pool.addr();
        let sessions: Vec<u64> = (0..5)
            .map(|_| g.open(Arc::new(ctx.alloc_pd().unwrap())))
            .collect();
        for (n, &s) in sessions.iter().enumerate() {
            for i in 0..4 {
                grant_extents(
                    &g,
                    s,
                    0,
                    false,
                    &[(base + ((n as u64 * 4 + i) % 16) * PAGE, PAGE as u32)],
                );
            }
        }
        let (held, evicted) = g.counts();
        assert_eq!((held, evicted), (16, 4), "four sessions' worth");
    }
}
