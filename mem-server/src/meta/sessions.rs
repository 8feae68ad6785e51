//! Client sessions of the metadata service. A session is named by the id its client chose and
//! outlives the connection that carries it: a client that loses its connection reconnects
//! under the same id within the grace period and finds its open handles, and the replies to
//! calls it may resend (each call is applied once, as NFSv4.1 sessions do with their reply
//! cache). A session whose client does not come back within the grace period ends: its
//! handles are released.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rfs_proto::clock::PeerClock;
use rfs_proto::types::Ino;

use crate::meta::coherence::SessionId;

/// Replies a session keeps at most.
const MAX_REPLIES: usize = 1024;

/// One client's session.
/// A session's open handles of one file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Handles {
    pub(crate) all: u32,
    /// Of them, open for writing.
    pub(crate) writable: u32,
}

pub(crate) struct ClientSession {
    pub(crate) id: SessionId,
    /// The id its client chose, which outlives restarts of the metadata node.
    pub(crate) client: u64,
    /// Handles the client holds open, by inode.
    pub(crate) open: HashMap<Ino, Handles>,
    /// The client's data session at each node, by node id: chunks are granted to it.
    pub(crate) data: HashMap<u32, u64>,
    /// Replies to the calls that change something, by sequence number, kept until the client
    /// says it has them.
    replies: BTreeMap<u64, Vec<u8>>,
    /// How the client's clock relates to ours: how long its calls took to reach us.
    pub(crate) clock: PeerClock,
    /// The highest "oldest call still unanswered" the client has said: a call numbered below
    /// it was answered, so it is never applied (again).
    floor: u64,
}

impl ClientSession {
    /// Whether it holds a handle open.
    pub(crate) fn holds_handles(&self) -> bool {
        self.open.values().any(|h| h.all > 0)
    }

    /// The reply already given to call `seq`, if it is a resend; replies below `oldest` (the
    /// client's oldest unanswered call) are forgotten first.
    pub(crate) fn replayed(&mut self, seq: u64, oldest: u64) -> Option<Vec<u8>> {
        self.replies = self.replies.split_off(&oldest);
        self.replies.get(&seq).cloned()
    }

    /// Whether call `seq` (saying `oldest`) was answered before and its reply forgotten: a
    /// copy of an old call (replayed by someone on the path), never to be applied. The client
    /// numbers its calls upwards and never says a call is answered before it has the reply.
    pub(crate) fn is_stale(&mut self, seq: u64, oldest: u64) -> bool {
        let stale = seq < self.floor;
        self.floor = self.floor.max(oldest);
        stale
    }

    /// Keeps the reply to call `seq` in case it is resent (the oldest go first past
    /// [`MAX_REPLIES`]: a client never has that many calls under way).
    pub(crate) fn remember(&mut self, seq: u64, reply: &[u8]) {
        self.replies.insert(seq, reply.to_vec());
        while self.replies.len() > MAX_REPLIES {
            self.replies.pop_first();
        }
    }
}

struct Entry {
    session: Arc<Mutex<ClientSession>>,
    /// Where its connection comes from (its last one), and since when the session is.
    peer: String,
    since: std::time::Instant,
    /// The session's id (also inside it, whose lock a call may hold for a while).
    id: SessionId,
    /// Bumped by every connection that attaches; shared with them, so a superseded one stops
    /// applying calls at once.
    epoch: Arc<AtomicU64>,
    /// Stops the loop of the connection attached now; None while detached.
    attached: Option<Arc<AtomicBool>>,
}

/// One session as [`Sessions::list`] gives it.
pub(crate) struct SessionListing {
    pub(crate) client: u64,
    pub(crate) id: SessionId,
    pub(crate) peer: String,
    pub(crate) connected: bool,
    pub(crate) age: std::time::Duration,
    pub(crate) session: Arc<Mutex<ClientSession>>,
}

/// Every client's session, by client id.
#[derive(Default)]
pub(crate) struct Sessions {
    by_client: Mutex<HashMap<u64, Entry>>,
    next_id: Mutex<SessionId>,
}

/// A connection's hold on its session.
pub(crate) struct Attached {
    pub(crate) session: Arc<Mutex<ClientSession>>,
    pub(crate) id: SessionId,
    epoch: u64,
    current: Arc<AtomicU64>,
    /// Whether the session existed before (a reconnection).
    pub(crate) resumed: bool,
}

impl Attached {
    /// Which connection of the session this is (later ones are larger).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether no newer connection took the session over.
    pub(crate) fn is_current(&self) -> bool {
        self.current.load(Ordering::Acquire) == self.epoch
    }
}

impl Sessions {
    /// Attaches a connection whose loop stops with `stop` to `client`'s session (a new one if
    /// it has none); a connection still attached to it is told to stop.
    pub(crate) fn attach(&self, client: u64, stop: Arc<AtomicBool>, peer: String) -> Attached {
        let mut all = self.by_client.lock().unwrap();
        let resumed = all.contains_key(&client);
        let e = all.entry(client).or_insert_with(|| {
            let mut next = self.next_id.lock().unwrap();
            *next += 1;
            Entry {
                session: Arc::new(Mutex::new(ClientSession {
                    id: *next,
                    client,
                    open: HashMap::new(),
                    data: HashMap::new(),
                    replies: BTreeMap::new(),
                    clock: PeerClock::default(),
                    floor: 0,
                })),
                id: *next,
                peer: String::new(),
                since: std::time::Instant::now(),
                epoch: Arc::default(),
                attached: None,
            }
        });
        e.peer = peer;
        if let Some(old) = e.attached.replace(stop) {
            old.store(true, Ordering::Release);
        }
        let epoch = e.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        Attached {
            session: e.session.clone(),
            id: e.id,
            epoch,
            current: e.epoch.clone(),
            resumed,
        }
    }

    /// The connection of `a` ended: whether it was still the one attached (a newer one may
    /// have taken the session over).
    pub(crate) fn detach(&self, client: u64, a: &Attached) -> bool {
        let mut all = self.by_client.lock().unwrap();
        match all.get_mut(&client) {
            Some(e) if a.is_current() => {
                e.attached = None;
                true
            }
            _ => false,
        }
    }

    /// Every session, for `rfs status`: its client, id, peer, whether a connection carries it,
    /// its age, and the session itself (whose lock a call may hold).
    pub(crate) fn list(&self) -> Vec<SessionListing> {
        self.by_client
            .lock()
            .unwrap()
            .iter()
            .map(|(&client, e)| SessionListing {
                client,
                id: e.id,
                peer: e.peer.clone(),
                connected: e.attached.is_some(),
                age: e.since.elapsed(),
                session: e.session.clone(),
            })
            .collect()
    }

    /// Ends `client`'s session if no connection attached since `a` left it.
    pub(crate) fn expire(&self, client: u64, a: &Attached) -> Option<Arc<Mutex<ClientSession>>> {
        let mut all = self.by_client.lock().unwrap();
        match all.get(&client) {
            Some(e) if a.is_current() && e.attached.is_none() => {
                all.remove(&client).map(|e| e.session)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reconnection_finds_its_session_and_supersedes_the_old_connection() {
        let s = Sessions::default();
        let first_stop = Arc::new(AtomicBool::new(false));
        let first = s.attach(7, first_stop.clone(), String::new());
        assert!(!first.resumed);
        let one = Handles {
            all: 1,
            writable: 0,
        };
        first.session.lock().unwrap().open.insert(5, one);
        // The client reconnects before the server noticed the old connection died.
        let second = s.attach(7, Arc::new(AtomicBool::new(false)), String::new());
        assert!(second.resumed);
        assert_eq!(second.id, first.id);
        assert!(
            first_stop.load(Ordering::Acquire),
            "old connection told to stop"
        );
        assert_eq!(second.session.lock().unwrap().open.get(&5), Some(&one));
        assert!(
            !s.detach(7, &first),
            "the old connection no longer holds it"
        );
        assert!(s.expire(7, &first).is_none());
        assert!(s.detach(7, &second));
        assert!(
            s.expire(7, &second).is_some(),
            "gone after its grace period"
        );
        assert!(
            !s.attach(7, Arc::default(), String::new()).resumed,
            "a new session"
        );
        assert!(s.attach(8, Arc::default(), String::new()).id != second.id);
    }

    #[test]
    fn replies_are_replayed_until_the_client_has_them() {
        let s = Sessions::default();
        let a = s.attach(1, Arc::default(), String::new());
        let mut sess = a.session.lock().unwrap();
        assert_eq!(sess.replayed(10, 10), None);
        sess.remember(10, b"ten");
        sess.remember(11, b"eleven");
        assert_eq!(sess.replayed(10, 10).as_deref(), Some(&b"ten"[..]));
        assert_eq!(sess.replayed(12, 11), None);
        assert_eq!(sess.replayed(11, 11).as_deref(), Some(&b"eleven"[..]));
        assert_eq!(
            sess.replayed(11, 12),
            None,
            "forgotten once the client had it"
        );
        for seq in 100..100 + MAX_REPLIES as u64 + 10 {
            sess.remember(seq, b"x");
        }
        assert_eq!(sess.replies.len(), MAX_REPLIES, "bounded");
    }
}
