//! What a client is given: its settings, and how it tells its user of the service's callbacks
//! and of reconnections (and asks what to take again after a restart).

use super::*;

/// How a client reaches the nodes.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Which provider, and its settings.
    pub transport: TransportConfig,
    /// The shared secret, if the nodes require one.
    pub secret: Option<Vec<u8>>,
    /// The tunables of every data session.
    pub session: SessionConfig,
    /// The metadata channel's buffers and deadline.
    pub rpc: RpcConfig,
    /// How long a node may take to accept a connection.
    pub connect_timeout: Duration,
    /// Encrypt every queue pair's connection (tcp; needs the secret).
    pub encrypt: bool,
    /// Metadata calls that find no node wait for one (a hard mount, as NFS's): they are sent
    /// again, over new connections, however long it takes, instead of failing at their
    /// deadline.
    pub hard: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            transport: TransportConfig::default(),
            secret: None,
            session: SessionConfig::default(),
            rpc: rfs_proto::message::METADATA_RPC,
            connect_timeout: Duration::from_secs(5),
            encrypt: false,
            hard: false,
        }
    }
}

/// What the service's side of a session tells a client.
pub enum Notice {
    /// Something the client caches changed; answered when the handler returns.
    Callback(Callback),
    /// The metadata connection was lost and is back: callbacks sent meanwhile are lost, so
    /// whatever the client caches from the service is to be fetched again.
    Reconnected,
    /// A service that lost our session did not take these locks again (it did not restart,
    /// but ended the session, or its grace period was over): they are held no more.
    LocksLost(Vec<HeldLock>),
}

/// What a client does with the service's notices.
pub type NoticeHandler = Box<dyn Fn(Notice) + Send + Sync>;

/// A file lock a client holds: the file, the owner, the lock.
pub type HeldLock = (Ino, u64, FileLock);

/// What a client holds at the service, taken again from one that restarted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Held {
    /// Open handles, as (inode, access).
    pub handles: Vec<(Ino, FileAccess)>,
    pub locks: Vec<HeldLock>,
}

/// Lists what the client holds at the service.
pub type ListHeld = Box<dyn Fn() -> Held + Send + Sync>;
