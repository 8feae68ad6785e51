//! A metadata call and its answer, whatever carries it: the network client (`rfs-client`), the
//! service in process (mem-server's `in_process`), or a test's stand-in all take encoded requests
//! and give encoded replies; [`MetadataChannel::call`] types both ends.

use std::fmt;
use std::io;

use crate::errno::Errno;
use crate::message::{decode_reply, encode_call, Call};
use crate::wire::DecodeError;

/// Why a call gave no answer.
#[derive(Debug)]
pub enum CallError {
    /// The service answered with an error number.
    Remote(Errno),
    /// The channel failed: connection lost, no reply in time.
    Transport(io::Error),
    /// The reply was not a valid answer to the call.
    Malformed(DecodeError),
    /// A data node is unknown, gone, or could not be reached.
    NoDataNode {
        /// The node's id.
        node: u32,
        /// Why.
        why: String,
    },
}

impl CallError {
    /// What the file system tells the application: the service's answer, or EIO.
    pub fn errno(&self) -> Errno {
        match self {
            CallError::Remote(e) => *e,
            _ => Errno::EIO,
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Remote(e) => write!(f, "{e}"),
            CallError::Transport(e) => write!(f, "metadata channel: {e}"),
            CallError::Malformed(e) => write!(f, "metadata reply: {e}"),
            CallError::NoDataNode { node, why } => write!(f, "data node {node}: {why}"),
        }
    }
}

impl std::error::Error for CallError {}

/// What carries metadata calls: the network client, or a test's stand-in.
pub trait MetadataChannel {
    /// Sends one encoded request and returns the encoded reply.
    fn exchange(&self, request: &[u8]) -> io::Result<Vec<u8>>;

    /// One metadata call and its typed answer. Failures are the caller's to log, once.
    fn call<C: Call + fmt::Debug>(&self, req: C) -> Result<C::Reply, CallError>
    where
        Self: Sized,
    {
        let raw = self
            .exchange(&encode_call(&req))
            .map_err(|e| CallError::Transport(io::Error::new(e.kind(), format!("{req:?}: {e}"))))?;
        match decode_reply::<C>(&raw) {
            Ok(r) => r.map_err(CallError::Remote),
            Err(e) => Err(CallError::Malformed(DecodeError(format!(
                "reply to {req:?}: {}",
                e.0
            )))),
        }
    }
}
