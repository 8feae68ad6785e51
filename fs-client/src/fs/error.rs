//! The file system's one error type: the errno the application gets, and what went wrong, for
//! the log. Errors map to an errno here and nowhere else.

use std::fmt;

use rdmabox::IoError;
use rfs_proto::{CallError, Errno};

/// A failed operation: its errno and, when the errno alone does not say it, the cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    errno: Errno,
    context: Option<String>,
    /// A transfer refused for a reference a fresh chunk map may cure (see [`Error::is_stale`]).
    stale: bool,
    /// A transfer that could not reach its node (see [`Error::is_outage`]).
    outage: bool,
    /// A metadata call that may or may not have been applied (see [`Error::is_unsettled`]).
    unsettled: bool,
}

/// What every file system operation returns.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// `errno`, with what caused it.
    pub fn new(errno: Errno, context: impl Into<String>) -> Error {
        Error {
            errno,
            context: Some(context.into()),
            stale: false,
            outage: false,
            unsettled: false,
        }
    }

    /// A transfer to data node `node` could not use its reference (`why`), though the node is
    /// not known to be gone.
    pub(crate) fn stale(node: u32, why: &str) -> Error {
        Error {
            stale: true,
            ..Error::new(Errno::EIO, format!("data node {node}: {why}"))
        }
    }

    /// A transfer could not reach data node `node` (our session there is gone and no new
    /// one could be had): a hard mount waits for it.
    pub(crate) fn unreachable(node: u32, why: &str) -> Error {
        Error {
            outage: true,
            ..Error::stale(node, why)
        }
    }

    /// What the application gets.
    pub fn errno(&self) -> Errno {
        self.errno
    }

    /// Whether this is a fault of the system (a node, a connection, a protocol) rather than an
    /// answer about the file system (no such file, not empty...): faults are worth a warning.
    pub fn is_fault(&self) -> bool {
        self.context.is_some()
    }

    /// A one-sided transfer to data node `node` failed. Unless the node stopped answering or
    /// is known gone, the reference is taken as stale: the node refused our key (it took back
    /// its grants when the metadata node that made them went away), or our session there broke
    /// and took the transfer with it.
    pub(crate) fn data(node: u32, e: &IoError) -> Error {
        use rdmabox::transport::WcStatus;
        Error {
            stale: !matches!(
                e,
                IoError::TimedOut(_) | IoError::Aborted(_) | IoError::Registration(_)
            ),
            // The session broke under it, not a key the node refused.
            outage: matches!(
                e,
                IoError::Closed
                    | IoError::Transport(
                        WcStatus::WrFlushError
                            | WcStatus::RetryExceeded
                            | WcStatus::RnrRetryExceeded
                    )
            ),
            ..Error::new(Errno::EIO, format!("data node {node}: {e}"))
        }
    }

    /// Whether the transfer failed for want of its node (a hard mount waits for it), not for
    /// a reference the node refused.
    pub(crate) fn is_outage(&self) -> bool {
        self.outage
    }

    /// Whether the transfer may succeed when sent again with a fresh chunk map (and session).
    pub(crate) fn is_stale(&self) -> bool {
        self.stale
    }

    /// Whether a metadata call failed with its fate unknown: the node lost our session (it
    /// restarted) while the call was under way, so it may or may not have been applied.
    pub(crate) fn is_unsettled(&self) -> bool {
        self.unsettled
    }
}

/// A plain answer (ENOENT, EEXIST...): nothing more to say.
impl From<Errno> for Error {
    fn from(errno: Errno) -> Error {
        Error {
            errno,
            context: None,
            stale: false,
            outage: false,
            unsettled: false,
        }
    }
}

impl From<CallError> for Error {
    fn from(e: CallError) -> Error {
        match e {
            CallError::Remote(errno) => errno.into(),
            other => Error {
                // The client's word for a call its lost session took with it.
                unsettled: matches!(&other, CallError::Transport(t)
                    if t.kind() == std::io::ErrorKind::ConnectionReset),
                ..Error::new(other.errno(), other.to_string())
            },
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.context {
            Some(c) => write!(f, "{c} ({})", self.errno),
            None => write!(f, "{}", self.errno),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_answers_pass_through_and_faults_become_eio_with_their_cause() {
        let e = Error::from(CallError::Remote(Errno::ENOENT));
        assert_eq!(e.errno(), Errno::ENOENT);
        assert!(!e.is_fault());
        let lost = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "rpc connection lost");
        let e = Error::from(CallError::Transport(lost));
        assert_eq!(e.errno(), Errno::EIO);
        assert!(e.is_fault());
        assert!(e.to_string().contains("rpc connection lost"), "{e}");
        let e = Error::data(3, &IoError::Closed);
        assert_eq!(e.errno(), Errno::EIO);
        assert!(e.to_string().contains("data node 3"), "{e}");
    }

    #[test]
    fn only_a_node_that_answers_makes_a_reference_stale() {
        use rdmabox::transport::WcStatus;
        let refused = IoError::Transport(WcStatus::RemoteAccessError);
        assert!(Error::data(1, &refused).is_stale());
        assert!(Error::data(1, &IoError::Closed).is_stale());
        let silent = IoError::TimedOut(std::time::Duration::from_secs(1));
        assert!(!Error::data(1, &silent).is_stale());
        assert!(!Error::data(1, &IoError::Aborted("gone".into())).is_stale());
        assert!(!Error::from(Errno::ENOENT).is_stale());
    }
}
