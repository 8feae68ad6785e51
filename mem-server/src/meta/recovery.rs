//! After a restart from the state directory: the data nodes the journal knows are waited for
//! (their chunks count as copies until they are back or their time is up), and the clients
//! that held handles may take them back within a grace period; until they did, files unlinked
//! while open stay and closed files keep what they hold past their size.

use std::collections::HashSet;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfs_proto::types::ChunkRef;

use super::effects::Effects;
use super::MetaService;
use crate::alloc::Allocator;

/// How long a restarted metadata node waits for the data nodes its journal knows (they join
/// again within a second of its start) before their chunks are copied elsewhere.
const REJOIN_WAIT: Duration = Duration::from_secs(5);

/// The clocks of a restart, and the clients it waits for (none of either after a fresh start).
pub(crate) struct Recovery {
    /// Until when data nodes known from the journal are waited for.
    nodes_until: Option<Instant>,
    /// Until when clients may reclaim the handles they had.
    reclaim_until: Option<Instant>,
    /// The clients that held handles and are not back yet (none: the grace for what they may
    /// have written past sizes is over before its time).
    awaited_clients: Mutex<HashSet<u64>>,
}

impl Recovery {
    /// After a fresh start (nothing to wait for), or a restart with a lease of `lease` and
    /// `awaited` the clients the journal says held handles.
    pub(super) fn new(restarted: bool, lease: Duration, awaited: HashSet<u64>) -> Recovery {
        Recovery {
            nodes_until: restarted.then(|| Instant::now() + REJOIN_WAIT.min(lease * 2)),
            reclaim_until: restarted.then(|| Instant::now() + lease * 2),
            awaited_clients: Mutex::new(awaited),
        }
    }

    /// Until when data nodes known from the journal are waited for, after a restart.
    pub(super) fn nodes_until(&self) -> Option<Instant> {
        self.nodes_until
    }

    /// Whether data nodes known from the journal may still come back (shortly after a
    /// restart, while some are not back yet).
    pub(super) fn awaiting_nodes(&self, alloc: &Allocator) -> bool {
        self.nodes_until.is_some_and(|t| Instant::now() < t) && !alloc.away().is_empty()
    }

    /// Whether clients that held handles before a restart may still come back for them:
    /// until then, closed files keep what they hold past their size, and files unlinked while
    /// open stay.
    pub(super) fn awaiting_clients(&self) -> bool {
        self.reclaiming() && !self.awaited_clients.lock().unwrap().is_empty()
    }

    /// Client `client` made a call of its own after a restart (its handles are taken back by
    /// then: that comes first on a new connection).
    pub(super) fn client_back(&self, client: u64) {
        let mut awaited = self.awaited_clients.lock().unwrap();
        if awaited.remove(&client) && awaited.is_empty() {
            log::info!("every client that held handles before the restart is back");
        }
    }

    /// Whether clients may still take their handles again after a restart.
    pub(super) fn reclaiming(&self) -> bool {
        self.reclaim_until
            .is_some_and(|until| Instant::now() < until)
    }
}

impl MetaService {
    /// Whether fewer live data nodes have space than a chunk has copies while others known
    /// from the journal may still come back (shortly after a restart).
    pub(super) fn copies_are_coming_back(&self, alloc: &Allocator) -> bool {
        self.recovery.awaiting_nodes(alloc)
            && alloc.nodes_with_room(crate::alloc::PAGE) < self.replicas
    }

    /// After a restart: data nodes not back in time count as gone (their chunks are copied
    /// from others); once every client that held handles is back, or their time is up, files
    /// unlinked while open that nobody reclaimed go, and closed files give back what they
    /// kept past their size.
    pub(crate) fn start_grace(self: &Arc<Self>) -> io::Result<()> {
        let (Some(nodes_until), Some(_)) = (self.recovery.nodes_until, self.recovery.reclaim_until)
        else {
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
                    if !clients_done && !me.recovery.awaiting_clients() {
                        me.clients_back();
                        clients_done = true;
                    }
                    if !nodes_done && Instant::now() >= nodes_until {
                        let away = me.state.lock().alloc.away();
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
        let awaited = std::mem::take(&mut *self.recovery.awaited_clients.lock().unwrap());
        for client in awaited {
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
}
