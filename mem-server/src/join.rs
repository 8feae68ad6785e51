//! Both halves of a data node joining the metadata node: the joiner describes its pool; the
//! metadata node checks it by opening a data session back to the joiner (which it then uses to
//! zero that node's chunks), adds the node to the allocator, and marks it dead when the join
//! connection closes.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use rdmabox::SessionConfig;
use rfs_proto::data::DataSession;
use rfs_proto::frame::{recv_frame, send_frame};
use rfs_proto::grant::{encode_link_reply, GrantPool, LinkRequest, MAX_LINK_FRAME};
use rfs_proto::handshake::dial;
use rfs_proto::hello::{Hello, Join};

use crate::grants::Grants;
use crate::link::{Link, RemoteLink};
use crate::meta::MetaService;
use crate::node::{invalid, Shared};

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
    node: &Shared,
    meta: &MetaService,
    mut s: TcpStream,
    join: &Join,
) -> io::Result<()> {
    if let Err(why) = check_join(join, node.cfg.chunk_size) {
        send_frame(&mut s, why.as_bytes())?;
        return Err(invalid(format!("refused a join: {why}")));
    }
    let (live, all) = meta.state.lock().unwrap().alloc.node_counts();
    if live >= MAX_NODES || all >= MAX_JOINS {
        send_frame(&mut s, b"too many data nodes")?;
        return Err(invalid(format!(
            "refused a join: {live} live data nodes, {all} joins so far (at most {MAX_NODES} and {MAX_JOINS})"
        )));
    }
    let Join {
        addr,
        pool_addr,
        pool_len,
        chunk_size,
    } = join;
    // Our own session to the node, to zero its freed chunks one-sidedly.
    let target: SocketAddr = addr
        .parse()
        .map_err(|_| invalid(format!("joining node advertises a bad address {addr:?}")))?;
    // No deadline: a node that is stopped for a while is zeroed once it resumes (a broken
    // zeroing session would lose every chunk freed on it until it joined again); a dead one
    // is seen by its join connection, and over verbs by the NIC's bounded retries.
    let zero_cfg = SessionConfig {
        qps: 1,
        pool_slots: 2,
        io_timeout: None,
        ..SessionConfig::default()
    };
    let mut session = DataSession::connect(
        &node.ctx,
        &node.pd,
        target,
        node.cfg.secret.as_deref(),
        &zero_cfg,
        Duration::from_secs(5),
    )?;
    if session.pool.addr != *pool_addr || session.pool.len != *pool_len {
        return Err(invalid(format!(
            "node {addr} described its pool inconsistently"
        )));
    }
    let (link, pump) = RemoteLink::new(&s)?;
    send_frame(&mut s, ACCEPTED)?;
    // The answers to our grants come back on this connection, and its end is the node's.
    let pumping = std::thread::Builder::new()
        .name("join-link".into())
        .spawn(move || pump.run())?;
    let zeroing = link.call(
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
    let chunks = pool_len / chunk_size;
    let id =
        meta.state
            .lock()
            .unwrap()
            .alloc
            .add_node(addr.clone(), *pool_addr, *chunk_size, chunks);
    meta.zeroer.add_node(id, session);
    meta.add_link(id, Link::Remote(link));
    log::info!("data node {id} joined from {addr}: {chunks} chunks");
    meta.node_joined();
    match pumping.join() {
        Ok(Err(e)) if e.kind() != io::ErrorKind::UnexpectedEof => {
            log::warn!("data node {id}: join connection: {e}")
        }
        _ => {}
    }
    log::warn!("data node {id} at {addr} left; its chunks are unavailable");
    // Dead before the link goes: a node without a link counts as gone (see `reuse`).
    meta.node_left(id);
    meta.remove_link(id);
    meta.zeroer.remove_node(id);
    Ok(())
}

/// The joiner's half: joins the metadata node at `meta`; returns the connection that keeps the
/// membership alive.
pub(crate) fn join(node: &Shared, meta: SocketAddr, listen: SocketAddr) -> io::Result<TcpStream> {
    let advertise = match &node.cfg.advertise {
        Some(a) => a.clone(),
        None if !listen.ip().is_unspecified() => listen.to_string(),
        None => {
            // Reachable the way we reach the metadata node.
            let probe = TcpStream::connect_timeout(&meta, Duration::from_secs(5))?;
            SocketAddr::new(probe.local_addr()?.ip(), listen.port()).to_string()
        }
    };
    let hello = Hello::Join(Join {
        addr: advertise,
        pool_addr: node.pool.addr(),
        pool_len: node.pool.len() as u64,
        chunk_size: node.cfg.chunk_size,
    });
    let mut s = dial(
        meta,
        node.cfg.secret.as_deref(),
        &hello,
        Duration::from_secs(5),
    )?;
    // The metadata node connects back to us (a zeroing session) before it answers.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let answer = recv_frame(&mut s, 64)?;
    if answer != ACCEPTED {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "metadata node refused the join: {}",
                String::from_utf8_lossy(&answer)
            ),
        ));
    }
    s.set_read_timeout(None)?;
    let link = s.try_clone()?;
    let grants = node.grants.clone();
    std::thread::Builder::new()
        .name("join-link".into())
        .spawn(move || serve_link(link, &grants))?;
    Ok(s)
}

/// The data node's end of the link: does what the metadata node asks until it goes.
fn serve_link(mut s: TcpStream, grants: &Grants) {
    let why = loop {
        let req = match recv_frame(&mut s, MAX_LINK_FRAME) {
            Ok(f) => f,
            Err(e) => break e,
        };
        let req = match LinkRequest::decode(&req) {
            Ok(r) => r,
            Err(e) => break io::Error::new(io::ErrorKind::InvalidData, e),
        };
        let answer = encode_link_reply(req.op(), &grants.serve(&req));
        if let Err(e) = send_frame(&mut s, &answer) {
            break e;
        }
    };
    // Nobody can revoke what was granted from now on, and the metadata node counts this
    // node's chunks as lost: no session keeps any reach.
    grants.revoke_everything();
    log::error!(
        "the join connection to the metadata node ended ({why}): this node's pool is no longer in use"
    );
    let _ = s.shutdown(std::net::Shutdown::Both);
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
