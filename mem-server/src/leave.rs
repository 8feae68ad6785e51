//! A data node asked to stop (SIGTERM, SIGINT) while it holds copies moves them to other nodes
//! first, as `rfs drain` does, for up to `--drain-on-stop`: stopping then loses nothing, even at
//! one copy per chunk. Past that time, or at a second signal, it stops anyway and says how
//! many copies it took with it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rfs_client::{Client, ClientConfig};
use rfs_proto::message::{Drain, Status};
use rfs_proto::types::{Caller, ClusterStatus, NodeStatus};
use rfs_proto::MetadataChannel;

use crate::runtime::Runtime;

/// How often the copies left are looked at.
const POLL: Duration = Duration::from_millis(200);

/// Moves this data node's copies (it is `advertise` to the metadata node at `meta`) to the
/// other nodes, within `patience`; `interrupted(wait)` waits up to `wait` for a signal to stop
/// at once, and says whether one came.
pub(crate) fn drain_before_stop(
    rt: &Runtime,
    meta: SocketAddr,
    advertise: &str,
    patience: Duration,
    mut interrupted: impl FnMut(Duration) -> bool,
) {
    let cfg = ClientConfig {
        transport: rdmabox::transport::TransportConfig::with_provider(rt.cfg.transport.provider),
        secret: rt.cfg.secret.clone(),
        encrypt: rt.cfg.encrypt,
        ..ClientConfig::default()
    };
    let client = match Client::connect(&meta.to_string(), cfg) {
        Ok(c) => c,
        Err(e) => {
            log::warn!(
                "cannot reach the metadata node {meta} to move this node's copies off ({e}); \
                 stopping with them"
            );
            return;
        }
    };
    let root = Caller {
        uid: 0,
        gid: 0,
        groups: Vec::new(),
    };
    let me = |s: &ClusterStatus| s.node(advertise).cloned();
    let status = || {
        client.call(Status {
            caller: root.clone(),
        })
    };
    let here = match status().map(|s| me(&s)) {
        Ok(Some(n)) => n,
        Ok(None) => {
            log::warn!("the metadata node {meta} does not list this node ({advertise}); stopping");
            return;
        }
        Err(e) => {
            log::warn!("cannot ask the metadata node {meta} what this node holds ({e}); stopping");
            return;
        }
    };
    if here.copies == 0 {
        log::info!("this data node holds no copies: nothing to move before stopping");
        return;
    }
    let drain = Drain {
        caller: root.clone(),
        node: here.id,
        on: true,
    };
    if let Err(e) = client.call(drain) {
        log::warn!(
            "the metadata node {meta} would not drain this node ({e}; a node run with \
             --root-squash refuses it): stopping with {} copies here",
            here.copies
        );
        return;
    }
    log::warn!(
        "moving this node's {} copies to the other data nodes before stopping (up to {}s; \
         signal again to stop at once)",
        here.copies,
        patience.as_secs()
    );
    let deadline = Instant::now() + patience;
    let mut left = here.copies;
    loop {
        match status().map(|s| me(&s)) {
            Ok(Some(NodeStatus { copies: 0, .. })) => {
                log::info!("every copy moved: this node can stop losing nothing");
                return;
            }
            Ok(Some(n)) if n.state == "draining" => left = n.copies,
            Ok(n) => {
                let state = n.map_or("gone".to_string(), |n| n.state);
                log::warn!("this node is {state} at the metadata node, not draining; stopping");
                return;
            }
            Err(e) => log::warn!("asking the metadata node what is left: {e}"),
        }
        let now = Instant::now();
        if now >= deadline {
            log::error!(
                "{left} copies still here after {}s: stopping anyway; chunks that had no other \
                 copy are lost",
                patience.as_secs()
            );
            return;
        }
        if interrupted(POLL.min(deadline - now)) {
            log::error!(
                "stopped at once with {left} copies still here; chunks that had no other copy \
                 are lost"
            );
            return;
        }
    }
}
