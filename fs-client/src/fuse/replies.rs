//! Replies to the kernel: a failed operation is logged once (faults as warnings, plain answers
//! such as ENOENT at debug level) and answered with its errno.

use fuser::{ReplyEmpty, ReplyXattr};

use crate::fs::Error;

/// Logs a failed operation and replies with its errno: faults (a node, the connection) as
/// warnings, plain answers (ENOENT, EEXIST...) at debug level.
macro_rules! fuse_error {
    ($op:expr, $reply:expr, $err:expr) => {{
        let err: Error = $err.into();
        if err.is_fault() {
            log::warn!("{}: {err}", $op);
        } else {
            log::debug!("{}: {err}", $op);
        }
        $reply.error(fuser::Errno::from_i32(err.errno().raw()))
    }};
}

/// The reply on `Ok`, [`fuse_error!`] on `Err`.
macro_rules! reply {
    ($op:literal, $result:expr, $reply:ident, |$v:pat_param| $ok:expr) => {
        match $result {
            Ok($v) => $ok,
            Err(e) => fuse_error!($op, $reply, e),
        }
    };
}

pub(super) fn empty(op: &'static str, r: Result<(), Error>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => fuse_error!(op, reply, e),
    }
}

/// The value on `Ok`; on `Err`, reply and return.
macro_rules! or_reply {
    ($op:literal, $e:expr, $reply:ident) => {
        match $e {
            Ok(v) => v,
            Err(e) => return fuse_error!($op, $reply, e),
        }
    };
}

/// Answers a getxattr or listxattr that has room for `size` bytes with `bytes`: their size when
/// `size` is 0 (the caller sizes its buffer), ERANGE when they do not fit, else the bytes.
pub(super) fn sized(op: &'static str, r: Result<Vec<u8>, Error>, size: u32, reply: ReplyXattr) {
    match r {
        Ok(bytes) if size == 0 => reply.size(bytes.len() as u32),
        Ok(bytes) if bytes.len() > size as usize => reply.error(fuser::Errno::ERANGE),
        Ok(bytes) => reply.data(&bytes),
        Err(e) => fuse_error!(op, reply, e),
    }
}
