//! A data node asked to stop (SIGTERM, SIGINT) while it holds copies moves them to other nodes
//! first, as `rfs drain` does, for up to `--drain-on-stop`: stopping then loses nothing, even at
//! one copy per chunk. Past that time, at a second signal, or once nothing has moved for
//! [`STUCK`] (no other node can take them), it stops anyway and says how many copies it took
//! with it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rfs_client::{Client, ClientConfig};
use rfs_proto::message::{Drain, Status};
use rfs_proto::types::{Caller, NodeStatus};
use rfs_proto::{CallError, MetadataChannel};

use crate::runtime::Runtime;

/// How often the copies left are looked at.
const POLL: Duration = Duration::from_millis(200);
/// How long the copies left may stay the same before the drain is taken to be stuck.
const STUCK: Duration = Duration::from_secs(30);
/// The pause before the metadata node is tried again when it did not answer.
const AGAIN: Duration = Duration::from_secs(1);

/// Moves this data node's copies (it is `advertise` to the metadata node at `meta`) to the
/// other nodes, within `patience`; `interrupted(wait)` waits up to `wait` for a signal to stop
/// at once, and says whether one came. Whether it holds nothing now.
pub(crate) fn drain_before_stop(
    rt: &Runtime,
    meta: SocketAddr,
    advertise: &str,
    patience: Duration,
    mut interrupted: impl FnMut(Duration) -> bool,
) -> bool {
    let deadline = Instant::now() + patience;
    let cfg = ClientConfig {
        transport: rt.cfg.transport.clone(),
        secret: rt.cfg.secret.clone(),
        encrypt: rt.cfg.encrypt,
        ..ClientConfig::default()
    };
    // A metadata node that is paused or restarting is tried again until the time is up.
    let mut out_of_time = |what: &dyn std::fmt::Display| {
        let now = Instant::now();
        let over = now >= deadline || interrupted(AGAIN.min(deadline - now));
        if over {
            log::error!("{what}: stopping with this node's copies");
        }
        over
    };
    let client = loop {
        match Client::connect(&meta.to_string(), cfg.clone()) {
            Ok(c) => break c,
            Err(e) => {
                log::warn!("cannot reach the metadata node {meta} ({e}); trying again");
                if out_of_time(&"the metadata node did not answer in time") {
                    return false;
                }
            }
        }
    };
    let root = Caller {
        uid: 0,
        gid: 0,
        groups: Vec::new(),
    };
    let status = || {
        client.call(Status {
            caller: root.clone(),
        })
    };
    let id = loop {
        match status().map(|s| s.node(advertise).map(|n| n.id)) {
            Ok(Some(id)) => break id,
            Ok(None) => {
                log::error!(
                    "the metadata node {meta} does not list this node ({advertise}); stopping"
                );
                return false;
            }
            // Refused (a node run with --root-squash refuses it to root too): no use asking again.
            Err(e @ CallError::Remote(_)) => {
                log::error!(
                    "the metadata node {meta} will not say what this node holds ({e}); stopping"
                );
                return false;
            }
            Err(e) => {
                log::warn!("asking the metadata node {meta} what this node holds: {e}");
                if out_of_time(&"the metadata node did not answer in time") {
                    return false;
                }
            }
        }
    };
    // Asked first, even of a node that holds nothing now: it takes no new chunks from here on.
    let drain = || {
        client.call(Drain {
            caller: root.clone(),
            node: id,
            on: true,
        })
    };
    loop {
        match drain() {
            Ok(_) => break,
            Err(e @ CallError::Remote(_)) => {
                log::error!("the metadata node {meta} would not drain this node ({e}); stopping");
                return false;
            }
            Err(e) => {
                log::warn!("asking the metadata node {meta} to drain this node: {e}");
                if out_of_time(&"the metadata node did not answer in time") {
                    return false;
                }
            }
        }
    }
    let mut left: Option<u64> = None;
    // Chunks whose only copies are here, as last heard.
    let mut only: Option<u64> = None;
    let mut moved_at = Instant::now();
    loop {
        let now_held = status().map(|s| s.nodes.into_iter().find(|n| n.id == id));
        match now_held {
            Ok(Some(NodeStatus { copies: 0, .. })) => {
                if left.is_some() {
                    log::info!("every copy moved: this node stops losing nothing");
                }
                return true;
            }
            Ok(Some(n)) => {
                if n.state != "draining" {
                    // The metadata node restarted (drains are not journaled): ask again.
                    log::warn!(
                        "this node is {} at the metadata node: draining it again",
                        n.state
                    );
                    if let Err(e) = drain() {
                        log::warn!("draining again: {e}");
                    }
                }
                if left.is_none() {
                    log::warn!(
                        "moving this node's {} copies to the other data nodes before stopping \
                         (up to {}s; signal again to stop at once)",
                        n.copies,
                        patience.as_secs()
                    );
                }
                only = Some(n.only_copies);
                if left != Some(n.copies) {
                    left = Some(n.copies);
                    moved_at = Instant::now();
                }
            }
            // A metadata node that does not answer is no drain that is stuck.
            Ok(None) => {
                log::warn!("the metadata node no longer lists this node (id {id})");
                moved_at = Instant::now();
            }
            Err(e) => {
                log::warn!("asking the metadata node what is left: {e}");
                moved_at = Instant::now();
            }
        }
        let held = left.map_or("its".to_string(), |n| n.to_string());
        let lost = match only {
            Some(0) => "every chunk has another copy: nothing is lost".to_string(),
            Some(n) => format!("{n} chunks had no other copy: they are lost"),
            None => "chunks that had no other copy are lost".to_string(),
        };
        let now = Instant::now();
        if now >= deadline {
            log::error!(
                "{held} copies still here after {}s: stopping anyway; {lost}",
                patience.as_secs()
            );
            return false;
        }
        if now.duration_since(moved_at) >= STUCK {
            log::error!(
                "no copy moved for {}s (no other node can take them?): stopping with {held} \
                 copies; {lost}",
                STUCK.as_secs()
            );
            return false;
        }
        if interrupted(POLL.min(deadline - now)) {
            log::error!("stopped at once with {held} copies still here; {lost}");
            return false;
        }
    }
}
