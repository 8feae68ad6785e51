//! Data sessions to the data nodes: connected on first use, replaced when broken or degraded,
//! and nodes that just failed us avoided for a while.

use super::*;

impl Client {
    /// The data session to `node` if it is connected: never a metadata call.
    pub fn connected(&self, node: u32) -> Option<Arc<DataSession>> {
        let data = self.data.lock().unwrap();
        data.get(&node).filter(|d| serves_well(d)).cloned()
    }

    /// The data session to `node`, connected on first use, and attached to this client's
    /// metadata session (again: the metadata node may have lost the attachment with the
    /// session), so that chunk maps of the node come granted to it.
    pub fn data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        let d = self.connect_data(node)?;
        self.call(AttachData {
            node,
            session: d.name,
        })?;
        Ok(d)
    }

    pub(super) fn connect_data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        if let Some(d) = self.connected(node) {
            return Ok(d);
        }
        let gone = |why: String| CallError::NoDataNode { node, why };
        self.note_broken(node);
        if let Some(left) = self.down_for(node) {
            return Err(gone(format!(
                "failed moments ago; tried again in {} ms",
                left.as_millis()
            )));
        }
        self.dial_data(node)
    }

    /// Whether `node` failed moments ago (see [`Client::data`]): connecting to it would fail
    /// at once.
    pub fn is_down(&self, node: u32) -> bool {
        self.note_broken(node);
        self.down_for(node).is_some()
    }

    /// A session to `node` that broke because the node stopped answering or went away marks
    /// the node down; it is forgotten either way.
    pub(super) fn note_broken(&self, node: u32) {
        let broken = {
            let mut data = self.data.lock().unwrap();
            let broken = match data.get(&node) {
                Some(d) if !d.session.is_open() => data.remove(&node),
                _ => None,
            };
            // Under the table's lock: a total read meanwhile sees the session in one place.
            if let Some(d) = &broken {
                self.retire(d);
            }
            broken
        };
        let dead = broken.and_then(|d| d.session.broken_by()).is_some_and(|e| {
            matches!(
                e,
                rdmabox::IoError::TimedOut(_) | rdmabox::IoError::Aborted(_)
            )
        });
        if dead {
            self.mark_down(node);
        }
    }

    pub(super) fn mark_down(&self, node: u32) {
        let until = Instant::now() + self.cfg.connect_timeout;
        self.down.lock().unwrap().insert(node, until);
    }

    /// How long `node` stays down, if it is.
    pub(super) fn down_for(&self, node: u32) -> Option<Duration> {
        let mut down = self.down.lock().unwrap();
        let left = down
            .get(&node)
            .and_then(|until| until.checked_duration_since(Instant::now()));
        if left.is_none() {
            down.remove(&node);
        }
        left
    }

    pub(super) fn dial_data(&self, node: u32) -> Result<Arc<DataSession>, CallError> {
        let gone = |why: String| CallError::NoDataNode { node, why };
        // A node the metadata node counts out is down for us too: transfers there fail at
        // once (a read goes to another replica) instead of dialling it again each time.
        let info = self
            .call(ListNodes {})?
            .into_iter()
            .find(|n| n.id == node)
            .filter(|n| n.alive)
            .ok_or_else(|| {
                self.mark_down(node);
                gone("the node left".into())
            })?;
        // The metadata node is reached the way we reached it; others as they advertise.
        let addr = if info.meta {
            self.meta_addr
        } else {
            resolve(&info.addr).map_err(|e| gone(format!("{}: {e}", info.addr)))?
        };
        let d = DataSession::connect(
            &self.ctx,
            &self.pd,
            addr,
            self.cfg.secret.as_deref(),
            self.cfg.encrypt,
            &self.cfg.session,
            self.cfg.connect_timeout,
        )
        .map_err(|e| {
            self.mark_down(node);
            gone(format!("{addr}: {e}"))
        })?;
        // Another thread may have connected meanwhile: keep the first live session, since
        // dropping a session fails the requests in flight on it.
        let mut data = self.data.lock().unwrap();
        if let Some(existing) = data.get(&node).filter(|e| serves_well(e)) {
            return Ok(existing.clone());
        }
        let d = Arc::new(d);
        if let Some(old) = data.insert(node, d.clone()) {
            self.retire(&old);
        }
        Ok(d)
    }

    /// A data session left the table: its counts go on counting in the totals.
    pub(super) fn retire(&self, gone: &DataSession) {
        let mut retired = self.retired.lock().unwrap();
        *retired = retired.plus(&gone.session.counters().settled());
    }

    /// The rdmabox counters of every data session, summed, those gone included.
    pub fn counters(&self) -> Snapshot {
        let data = self.data.lock().unwrap();
        let retired = *self.retired.lock().unwrap();
        data.values()
            .fold(retired, |acc, d| acc.plus(&d.session.counters()))
    }
}

/// Whether a data session is worth using: open, and not left with fewer than half its queue
/// pairs by refused transfers (then a new one is dialled, and the old one serves what it has
/// until it goes).
pub(super) fn serves_well(d: &DataSession) -> bool {
    d.session.is_open() && !d.session.is_degraded()
}
