//! Both halves of a data node joining the metadata node: the joiner describes its pool; the
//! metadata node checks it by opening a data session back to the joiner (which it then uses to
//! zero that node's chunks), adds the node to the allocator, and counts it away when the join
//! connection closes.
//!
//! A data node outlives its join connection and its metadata node: when the connection ends
//! it takes every grant back (nobody could revoke them any more) and joins again, naming the
//! same pool. A metadata node that counts the node away (it cut a stopped node off, or it
//! restarted from its journal) takes it back with its pool and the chunks the maps name there
//! (files keep their data); one that does not know the pool refuses, and the node wipes it
//! and joins as a new one.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmabox::SessionConfig;
use rfs_daemon::backoff::Backoff;
use rfs_daemon::patience::until_reachable;
use rfs_proto::data::DataSession;
use rfs_proto::frame::{recv_frame, send_frame};
use rfs_proto::grant::{encode_grant_reply, GrantPool, GrantRequest, MAX_GRANT_FRAME};
use rfs_proto::handshake::dial;
use rfs_proto::hello::{Hello, Join, UNKNOWN_POOL};
use rfs_proto::integrity;
use rfs_proto::session_key::SessionKey;

use crate::config::invalid;
use crate::grant_channel::{GrantChannel, GrantChannelError, RemoteGrantChannel};
use crate::grants::Grants;
use crate::meta::{MetaService, MetaState};
use crate::runtime::Runtime;

const ACCEPTED: &[u8] = b"ok";
/// The most live data nodes one namespace takes.
const MAX_NODES: usize = 1024;
/// The most joins one metadata node records (ids are not reused: a node that restarts joins
/// anew); enough for every node to restart many times over.
const MAX_JOINS: usize = 64 * MAX_NODES;
/// The largest pool a node may lend: far beyond any machine's memory, and small enough that
/// chunk arithmetic cannot overflow.
const MAX_POOL_BYTES: u64 = 1 << 50;
/// The longest address a node may advertise.
const MAX_ADDR_LEN: usize = 255;
/// The longest pause between a data node's tries to join again: chunk maps of a restarted
/// metadata node wait for its data nodes, so this much adds to how soon I/O goes on.
const REJOIN_BACKOFF: Duration = Duration::from_millis(250);

/// Tells a joining node why it is refused (it gives up rather than try again), and says so.
fn refuse(s: &mut TcpStream, key: Option<&SessionKey>, why: String) -> io::Error {
    let _ = answer(s, key, why.as_bytes());
    invalid(format!("refused a join: {why}"))
}

/// The metadata node's answer to a join, sealed with the join's session key: a refusal that
/// says the pool is unknown makes the node wipe it, so no one on the path may say it.
fn answer(s: &mut TcpStream, key: Option<&SessionKey>, what: &[u8]) -> io::Result<()> {
    send_frame(
        s,
        &integrity::seal(key, integrity::JOIN_ANSWER, 0, what.to_vec()),
    )
}

/// The longest answer to a join: a refusal's reason.
const MAX_JOIN_ANSWER: usize = 1024;

/// Checks what a joining node says about itself before anything is sized by it.
fn check_join(join: &Join, chunk_size: u64) -> Result<(), String> {
    let Join {
        addr,
        pool_addr,
        pool_len,
        ..
    } = join;
    if join.chunk_size != chunk_size {
        return Err(format!(
            "node {addr:?} uses {}-byte chunks, this namespace {chunk_size}",
            join.chunk_size
        ));
    }
    if addr.len() > MAX_ADDR_LEN {
        return Err(format!("advertised address is {} bytes long", addr.len()));
    }
    if *pool_len < chunk_size || *pool_len > MAX_POOL_BYTES {
        return Err(format!(
            "node {addr:?} claims a pool of {pool_len} bytes (must be {chunk_size}..={MAX_POOL_BYTES})"
        ));
    }
    if pool_addr.checked_add(*pool_len).is_none() {
        return Err(format!(
            "node {addr:?} claims a pool that wraps around the address space"
        ));
    }
    Ok(())
}

/// The metadata node's half: admits the node described by `join`, then holds its membership
/// until the connection closes.
pub(crate) fn admit(
    node: &Runtime,
    meta: &MetaService,
    mut s: TcpStream,
    join: &Join,
    key: Option<SessionKey>,
) -> io::Result<()> {
    if let Err(why) = check_join(join, node.cfg.chunk_size) {
        answer(&mut s, key.as_ref(), why.as_bytes())?;
        return Err(invalid(format!("refused a join: {why}")));
    }
    let (live, all) = meta.state.lock().alloc.node_counts();
    if live >= MAX_NODES || all >= MAX_JOINS {
        answer(&mut s, key.as_ref(), b"too many data nodes")?;
        return Err(invalid(format!(
            "refused a join: {live} live data nodes, {all} joins so far (at most {MAX_NODES} and {MAX_JOINS})"
        )));
    }
    let Join {
        addr,
        pool_addr,
        pool_len,
        chunk_size,
        pool_id,
        fresh,
    } = join;
    let chunks = pool_len / chunk_size;
    let (away, up) = {
        let st = meta.state.lock();
        (
            st.alloc.is_away_pool(*pool_id),
            st.alloc.is_live_pool(*pool_id),
        )
    };
    if !fresh && up {
        // It saw its join connection end before we did: we shall in a moment (it shut it
        // down), and it may then come back with its pool.
        return Err(refuse(
            &mut s,
            key.as_ref(),
            "its earlier join is still being closed: try again".into(),
        ));
    }
    if !fresh && !away {
        answer(&mut s, key.as_ref(), UNKNOWN_POOL)?;
        return Err(invalid(format!(
            "refused a join from {addr}: its pool holds data this node does not know of"
        )));
    }
    // Our own session to the node, to zero its freed chunks one-sidedly.
    let Ok(target) = addr.parse::<SocketAddr>() else {
        return Err(refuse(
            &mut s,
            key.as_ref(),
            format!("a bad advertised address {addr:?}"),
        ));
    };
    // No deadline: a node that is stopped for a while is zeroed once it resumes (a broken
    // zeroing session would lose every chunk freed on it until it joined again); a dead one
    // is seen by its join connection, and over verbs by the NIC's bounded retries.
    let zero_cfg = SessionConfig {
        qps: 1,
        pool_slots: 2,
        io_timeout: None,
        ..SessionConfig::default()
    };
    let mut session = match DataSession::connect(
        &node.ctx,
        &node.pd,
        target,
        node.cfg.secret.as_deref(),
        node.cfg.encrypt,
        &zero_cfg,
        Duration::from_secs(5),
    ) {
        Ok(session) => session,
        Err(e) => {
            return Err(refuse(
                &mut s,
                key.as_ref(),
                format!("cannot reach it at {addr}: {e}"),
            ))
        }
    };
    if session.pool.addr != *pool_addr || session.pool.len != *pool_len {
        return Err(refuse(
            &mut s,
            key.as_ref(),
            format!("node {addr} described its pool inconsistently"),
        ));
    }
    let (channel, pump) = RemoteGrantChannel::new(&s, key.clone())?;
    answer(&mut s, key.as_ref(), ACCEPTED)?;
    // The answers to our grants come back on this connection, and its end is the node's.
    let pumping = std::thread::Builder::new()
        .name("join-grants".into())
        .spawn(move || pump.run())?;
    let zeroing = channel.call(
        &GrantPool {
            session: session.name,
        }
        .into(),
        None,
    );
    let rkey = match zeroing {
        Ok(Ok(keys)) if keys.len() == 1 && keys[0] != 0 => keys[0],
        other => {
            let _ = s.shutdown(std::net::Shutdown::Both);
            let _ = pumping.join();
            return Err(invalid(format!(
                "node {addr} did not grant its pool for zeroing: {other:?}"
            )));
        }
    };
    session.pool.rkey = rkey;
    let registered = {
        let mut st = meta.state.lock();
        let MetaState {
            ns, alloc, moved, ..
        } = &mut *st;
        let known = alloc.rejoin(*pool_id, addr.clone(), (*pool_addr, chunks), |id| {
            ns.chunks_on(id)
        });
        let joined = match known {
            Some(id) => {
                // What moved off it is listed for reuse with the rest of its pool: a place
                // there names no moved copy any more.
                moved.retain(|&(node, _), _| node != id);
                Some((id, true, Vec::new()))
            }
            None if *fresh => {
                let gone = alloc.gone_from(addr);
                let id = alloc.add_node(addr.clone(), *pool_id, *pool_addr, *chunk_size, chunks);
                Some((id, false, gone))
            }
            None => None,
        };
        // Its session and channel are there before anyone sees it up (under this hold of the
        // lock): a zeroing pass or a grant meanwhile would find none, or its earlier life's.
        joined.map(|(id, back, gone)| {
            let epoch = alloc.epoch(id);
            meta.zeroer.add_node(id, epoch, session);
            meta.grant_channels
                .add(id, epoch, GrantChannel::Remote(channel));
            (id, epoch, back, gone)
        })
    };
    let Some((id, epoch, back, gone)) = registered else {
        let _ = s.shutdown(std::net::Shutdown::Both);
        let _ = pumping.join();
        return Err(invalid(format!(
            "refused a join from {addr}: its pool is back already"
        )));
    };
    for gone in gone {
        let held = meta.drop_copies_on(meta.state.lock(), gone);
        log::warn!(
            "data node {gone} at {addr} is down for good: a new node joined from its address \
             (its pool went with its process, and {held} copies with it)"
        );
    }
    if back {
        log::info!("data node {id} is back from {addr} with its pool: {chunks} chunks");
    } else {
        log::info!("data node {id} joined from {addr}: {chunks} chunks");
    }
    meta.node_joined();
    match pumping.join() {
        Ok(Err(GrantChannelError::Io(e))) if e.kind() == io::ErrorKind::UnexpectedEof => {}
        Ok(Err(e)) => log::warn!("data node {id}: {e}"),
        _ => {}
    }
    // Dead before the channel goes: a node without a channel counts as gone (see `reuse`).
    match meta.node_left(id) {
        0 => log::info!("data node {id} at {addr} left, holding no copies"),
        held => log::warn!(
            "data node {id} at {addr} left; its {held} copies are unavailable until it comes \
             back with its pool"
        ),
    }
    // A return may have taken the node's place meanwhile (it was away as soon as it left):
    // only this life's channel and session go.
    meta.grant_channels.remove(id, epoch);
    meta.zeroer.remove_node(id, epoch);
    Ok(())
}

/// The joiner's half: joins the metadata node at `meta`, then keeps the membership in the
/// background (joining again whenever the connection ends, until `stop`). Returns what ends
/// it.
pub(crate) fn join(
    node: &Arc<Runtime>,
    meta: SocketAddr,
    listen: SocketAddr,
) -> io::Result<Membership> {
    let what = format!("joining the metadata node {meta}");
    let start = std::time::Instant::now();
    let advertise = match &node.cfg.advertise {
        Some(a) => a.clone(),
        None if !listen.ip().is_unspecified() => listen.to_string(),
        None => {
            // Reachable the way we reach the metadata node.
            let probe = until_reachable(&what, node.cfg.join_timeout, || {
                TcpStream::connect_timeout(&meta, Duration::from_secs(5))
            })?;
            SocketAddr::new(probe.local_addr()?.ip(), listen.port()).to_string()
        }
    };
    let mut pool = PoolName {
        id: rdmabox::random::u64(),
        fresh: true,
    };
    // One patience for both: the probe's wait counts against the join's.
    let left = node.cfg.join_timeout.saturating_sub(start.elapsed());
    let first = until_reachable(&what, left, || {
        join_once(node, meta, &advertise, &pool).map_err(io::Error::from)
    })?;
    let current = Arc::new(Mutex::new(Some(first.0.try_clone()?)));
    let membership = Membership {
        current: current.clone(),
        meta,
        advertise: advertise.clone(),
    };
    let node = node.clone();
    std::thread::Builder::new()
        .name("join-grants".into())
        .spawn(move || {
            let (mut channel, mut key) = first;
            loop {
                let why = serve_grants(&mut channel, &node.grants, key.as_ref());
                if current.lock().unwrap().is_none() {
                    return; // this node is stopping
                }
                log::error!(
                    "the join connection to the metadata node ended ({why}): every grant \
                     revoked; joining again"
                );
                pool.fresh = false;
                (channel, key) = match rejoin(&node, meta, &advertise, &mut pool, &current) {
                    Some(joined) => joined,
                    None => return,
                };
            }
        })?;
    Ok(membership)
}

/// What a joining node says of its pool.
struct PoolName {
    id: u64,
    fresh: bool,
}

/// Joins again, with backoff, until it works or the node stops (None).
fn rejoin(
    node: &Runtime,
    meta: SocketAddr,
    advertise: &str,
    pool: &mut PoolName,
    current: &Mutex<Option<TcpStream>>,
) -> Option<(TcpStream, Option<SessionKey>)> {
    let mut backoff = Backoff::new(Duration::from_millis(50), REJOIN_BACKOFF);
    let mut tries = 0u32;
    loop {
        if node.stop.load(Ordering::Acquire) || current.lock().unwrap().is_none() {
            return None;
        }
        match join_once(node, meta, advertise, pool) {
            Ok((s, key)) => {
                let clone = s.try_clone().ok()?;
                let mut slot = current.lock().unwrap();
                if slot.is_none() {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    return None;
                }
                *slot = Some(clone);
                log::warn!("joined the metadata node {meta} again");
                return Some((s, key));
            }
            Err(e @ JoinError::UnknownPool) => {
                // Not a pool it knows: wiped, this node starts over as a new one.
                log::warn!("{e}: wiping the pool and joining as a new data node");
                if let Err(e) = node.pool.fill(0, node.pool.len(), 0) {
                    log::error!("wiping the pool: {e}");
                    return None;
                }
                *pool = PoolName {
                    id: rdmabox::random::u64(),
                    fresh: true,
                };
                continue;
            }
            Err(e) => {
                if tries.is_multiple_of(20) {
                    log::warn!("joining the metadata node {meta} again: {e}");
                }
                tries += 1;
            }
        }
        std::thread::sleep(backoff.next_pause());
    }
}

/// Why a join did not take.
#[derive(Debug, thiserror::Error)]
enum JoinError {
    /// The metadata node does not know the pool this node says it holds (it lost its state,
    /// or dropped this node): the pool must be wiped. Only the node's sealed answer says so,
    /// never a failure on the way to it, however it is spelled.
    #[error("the metadata node does not know this node's pool")]
    UnknownPool,
    /// Lasting (another chunk size, a pool it will not take): not tried again at start-up.
    #[error("metadata node refused the join: {0}")]
    Refused(String),
    #[error("an answer to our join without the session's MAC")]
    Unsealed,
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<JoinError> for io::Error {
    /// For start-up's patience, which tries again only what may go away by itself.
    fn from(e: JoinError) -> io::Error {
        match e {
            JoinError::Io(e) => e,
            e @ (JoinError::UnknownPool | JoinError::Refused(_)) => {
                io::Error::new(io::ErrorKind::InvalidInput, e)
            }
            e @ JoinError::Unsealed => io::Error::new(io::ErrorKind::PermissionDenied, e),
        }
    }
}

/// One join: the connection that holds the membership, once the metadata node took us, and
/// its session key.
fn join_once(
    node: &Runtime,
    meta: SocketAddr,
    advertise: &str,
    pool: &PoolName,
) -> Result<(TcpStream, Option<SessionKey>), JoinError> {
    let hello = Hello::Join(Join {
        addr: advertise.to_string(),
        pool_addr: node.pool.addr(),
        pool_len: node.pool.len() as u64,
        chunk_size: node.cfg.chunk_size,
        pool_id: pool.id,
        fresh: pool.fresh,
    });
    let (mut s, key) = dial(
        meta,
        node.cfg.secret.as_deref(),
        &hello,
        Duration::from_secs(5),
    )?;
    // The metadata node connects back to us (a zeroing session) before it answers.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let sealed = recv_frame(&mut s, MAX_JOIN_ANSWER + integrity::TAG)?;
    let answer = integrity::open(key.as_ref(), integrity::JOIN_ANSWER, 0, &sealed)
        .ok_or(JoinError::Unsealed)?;
    if answer == UNKNOWN_POOL {
        return Err(JoinError::UnknownPool);
    }
    if answer != ACCEPTED {
        return Err(JoinError::Refused(
            String::from_utf8_lossy(answer).into_owned(),
        ));
    }
    s.set_read_timeout(None)?;
    Ok((s, key))
}

/// A data node's membership: ended (the join connection shut down, not just closed, so that
/// the metadata node sees the node leave; no joining again) when dropped.
pub(crate) struct Membership {
    current: Arc<Mutex<Option<TcpStream>>>,
    /// Where the metadata node is, and the address it knows this node by.
    pub(crate) meta: SocketAddr,
    pub(crate) advertise: String,
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(s) = self.current.lock().unwrap().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The data node's end of the channel: does what the metadata node asks until it goes (why).
/// Requests and answers carry MACs by the join's session key, numbered in turn: nobody on
/// the path can grant itself chunks, or answer for us.
fn serve_grants(s: &mut TcpStream, grants: &Grants, key: Option<&SessionKey>) -> io::Error {
    let mut number = 0u64;
    let why = loop {
        let frame = match recv_frame(s, MAX_GRANT_FRAME + integrity::TAG) {
            Ok(f) => f,
            Err(e) => break e,
        };
        number += 1;
        let Some(req) = integrity::open(key, integrity::GRANT_CALL, number, &frame) else {
            break io::Error::new(
                io::ErrorKind::PermissionDenied,
                "a channel request without the session's MAC",
            );
        };
        let req = match GrantRequest::decode(req) {
            Ok(r) => r,
            Err(e) => break io::Error::new(io::ErrorKind::InvalidData, e),
        };
        let answer = encode_grant_reply(req.op(), &grants.serve(&req));
        let sealed = integrity::seal(key, integrity::GRANT_ANSWER, number, answer);
        if let Err(e) = send_frame(s, &sealed) {
            break e;
        }
    };
    // Nobody can revoke what was granted from now on: no session keeps any reach until the
    // metadata node (restarted, or reached again) grants anew.
    grants.revoke_everything();
    let _ = s.shutdown(std::net::Shutdown::Both);
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(pool_addr: u64, pool_len: u64) -> Join {
        Join {
            addr: "127.0.0.1:1".into(),
            pool_addr,
            pool_len,
            chunk_size: 1 << 20,
            pool_id: 1,
            fresh: true,
        }
    }

    #[test]
    fn absurd_pools_are_refused_before_anything_is_sized_by_them() {
        assert!(check_join(&join(0, 1 << 30), 1 << 20).is_ok());
        for bad in [
            join(0, 1 << 62),
            join(0, u64::MAX),
            join(0, 0),
            join(0, 4096),
            join(u64::MAX - (1 << 20), 1 << 30),
        ] {
            assert!(check_join(&bad, 1 << 20).is_err(), "{bad:?}");
        }
        let mut long = join(0, 1 << 30);
        long.addr = "h".repeat(300);
        assert!(check_join(&long, 1 << 20).is_err());
        assert!(check_join(&join(0, 1 << 30), 1 << 21).is_err());
    }
}
