//! The provider-neutral vocabulary of the verbs model: access flags, remote addresses, work requests,
//! completions and queue-pair states. Providers translate these to their own representation.

use std::fmt;

use super::memory::Sge;
use super::region::RemoteAddr;

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// One-sided write of the gathered SGEs to `remote`.
    Write(RemoteAddr),
    /// One-sided write that also consumes a RECV at the peer and delivers `imm` with it.
    WriteWithImm(RemoteAddr, u32),
    /// One-sided read from `remote`, scattered into the SGEs.
    Read(RemoteAddr),
    /// Two-sided message; consumes a RECV posted by the peer.
    Send,
    /// Two-sided message carrying an immediate value.
    SendWithImm(u32),
}

/// A send-queue work request. A slice of them posted by one call is a chain (one doorbell).
#[derive(Clone, Debug)]
pub struct SendWr<'a> {
    /// The caller's tag, returned in the request's completion.
    pub wr_id: u64,
    /// What the request does.
    pub op: SendOp,
    /// The local buffers gathered (WRITE, SEND) or scattered into (READ), in order.
    pub sges: &'a [Sge<'a>],
    /// Unsignaled requests produce a completion only when they fail.
    pub signaled: bool,
    /// Ask the provider to copy the payload at post time (small WRITE/SEND only).
    pub inline: bool,
}

impl<'a> SendWr<'a> {
    /// A signaled, not inlined request.
    pub fn new(wr_id: u64, op: SendOp, sges: &'a [Sge<'a>]) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            sges,
            signaled: true,
            inline: false,
        }
    }
    /// The same request, completing silently unless it fails.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }
    /// The same request, with its payload copied at post time.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }
    /// Payload bytes: the sum of the SGE lengths.
    pub fn byte_len(&self) -> usize {
        self.sges.iter().map(|s| s.len).sum()
    }
}

/// A receive-queue work request: where the next incoming SEND (or WRITE_WITH_IMM) lands.
#[derive(Clone, Debug)]
pub struct RecvWr<'a> {
    /// The caller's tag, returned in the receive's completion.
    pub wr_id: u64,
    /// Where the incoming payload is scattered, in order.
    pub sges: &'a [Sge<'a>],
}

/// Completion status, as `ibv_wc_status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done as asked.
    Success,
    /// A length was wrong locally (e.g. an incoming message longer than the receive buffer).
    LocalLengthError,
    /// The local queue pair could not carry out the request.
    LocalQpOperationError,
    /// A local SGE is not inside a region of this protection domain with the rights needed.
    LocalProtectionError,
    /// Never executed: the queue pair went to the error state first.
    WrFlushError,
    /// The peer answered with an unexpected transport response.
    BadResponse,
    /// A local buffer refused an incoming operation (e.g. a WRITE with immediate).
    LocalAccessError,
    /// The peer found the request invalid (an operation or length it does not accept).
    RemoteInvalidRequest,
    /// The peer refused the access: unknown rkey, range outside the region, or missing rights.
    RemoteAccessError,
    /// The peer could not carry out the operation (on tcp: a SEND longer than its receive
    /// buffer).
    RemoteOperationError,
    /// The peer stopped acknowledging: it is gone or unreachable.
    RetryExceeded,
    /// The peer had no receive posted for a SEND, longer than the retries allowed.
    RnrRetryExceeded,
    /// Any other status a device reports, with its raw value.
    Other(u32),
}

impl WcStatus {
    /// Whether this is [`WcStatus::Success`].
    pub fn is_ok(self) -> bool {
        self == WcStatus::Success
    }
}

/// What a completed work request was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND (with or without immediate).
    Send,
    /// An RDMA WRITE (with or without immediate).
    Write,
    /// An RDMA READ.
    Read,
    /// A receive that took a SEND.
    Recv,
    /// A receive that took an immediate value (SEND or WRITE with immediate).
    RecvWithImm,
    /// Unknown to the model (flushed receive completions on some devices say nothing).
    Other(u32),
}

/// A work completion, as `ibv_wc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The tag of the work request that completed.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was (may be [`WcOpcode::Other`] for a failed request).
    pub opcode: WcOpcode,
    /// Bytes received (receive completions) or read (READ); 0 where the device leaves it unset.
    pub byte_len: u32,
    /// The immediate value a receive took, if any.
    pub imm: Option<u32>,
    /// The queue pair the work request was posted on.
    pub qp_num: u32,
}

impl Completion {
    /// A placeholder, to size the arrays that polls fill in.
    pub const EMPTY: Completion = Completion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Other(0),
        byte_len: 0,
        imm: None,
        qp_num: 0,
    };
}

/// Queue-pair state, as `ibv_qp_state` (only the states a connected QP passes through).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Bound to a port; receives may be posted.
    Init,
    /// Connected for receiving.
    ReadyToReceive,
    /// Connected both ways: work requests may be posted.
    ReadyToSend,
    /// Broken or shut down: outstanding requests complete with flush errors.
    Error,
    /// Any other state a device reports, with its raw value.
    Other(u32),
}

/// Queue sizes asked of a queue pair; the provider may grant more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send-queue depth: work requests outstanding at once.
    pub max_send_wr: u32,
    /// Receive-queue depth: receives posted at once.
    pub max_recv_wr: u32,
    /// SGEs one send work request may carry.
    pub max_send_sge: u32,
    /// SGEs one receive may carry.
    pub max_recv_sge: u32,
    /// Largest payload a send work request may inline.
    pub max_inline_data: u32,
}

impl QpCaps {
    /// What [`Default`] gives.
    pub const DEFAULT: QpCaps = QpCaps {
        max_send_wr: 512,
        max_recv_wr: 256,
        max_send_sge: 16,
        max_recv_sge: 4,
        max_inline_data: 64,
    };

    /// A queue pair the local side never posts on: it only answers its peer's READs and
    /// WRITEs. On tcp it has no threads of its own (a responder loop of the process serves
    /// it).
    pub const RESPONDER: QpCaps = QpCaps {
        max_send_wr: 0,
        max_recv_wr: 0,
        ..QpCaps::DEFAULT
    };

    /// Whether it is [`QpCaps::RESPONDER`]'s kind: no send and no receive queue.
    pub fn is_responder(&self) -> bool {
        self.max_send_wr == 0 && self.max_recv_wr == 0
    }
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps::DEFAULT
    }
}

/// Why a post stopped. As with `ibv_post_send`'s `bad_wr`, the requests before the one that
/// failed may have been posted: `posted` says how many, and only those will complete.
#[derive(Debug)]
pub enum PostError {
    /// The queue had no room; retry the rest after completions drain it.
    QueueFull {
        /// Requests at the head of the chain that were posted.
        posted: usize,
    },
    /// The request cannot be expressed on this QP (too many SGEs, inline too long...); checked
    /// before anything is posted.
    Invalid(String),
    /// The device refused the post.
    Os {
        /// Requests at the head of the chain that were posted.
        posted: usize,
        /// What the device said.
        error: std::io::Error,
    },
}

impl PostError {
    /// How many requests at the head of the chain were posted before the failure.
    pub fn posted(&self) -> usize {
        match self {
            PostError::QueueFull { posted } | PostError::Os { posted, .. } => *posted,
            PostError::Invalid(_) => 0,
        }
    }
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PostError::QueueFull { posted } => {
                write!(f, "work queue full ({posted} of the chain posted)")
            }
            PostError::Invalid(why) => write!(f, "invalid work request: {why}"),
            PostError::Os { posted, error } => {
                write!(f, "post failed after {posted} of the chain: {error}")
            }
        }
    }
}

impl std::error::Error for PostError {}

impl From<PostError> for std::io::Error {
    fn from(e: PostError) -> Self {
        match e {
            PostError::Os { error, .. } => error,
            PostError::QueueFull { .. } => std::io::Error::new(std::io::ErrorKind::WouldBlock, e),
            PostError::Invalid(_) => std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        }
    }
}

/// Checks a chain against queue-pair limits, the same way for every provider.
pub(crate) fn check_send_chain(chain: &[SendWr<'_>], caps: &QpCaps) -> Result<(), PostError> {
    for wr in chain {
        if wr.sges.len() > caps.max_send_sge as usize {
            return Err(PostError::Invalid(format!(
                "wr {} has {} SGEs, the QP allows {}",
                wr.wr_id,
                wr.sges.len(),
                caps.max_send_sge
            )));
        }
        let len = wr.byte_len();
        if len > i32::MAX as usize {
            return Err(PostError::Invalid(format!(
                "wr {} moves {len} bytes, more than a message may (2^31)",
                wr.wr_id
            )));
        }
        if wr.inline {
            if matches!(wr.op, SendOp::Read(_)) {
                return Err(PostError::Invalid("a READ cannot be inline".into()));
            }
            if len > caps.max_inline_data as usize {
                return Err(PostError::Invalid(format!(
                    "wr {} inlines {len} bytes, the QP allows {}",
                    wr.wr_id, caps.max_inline_data
                )));
            }
        }
    }
    Ok(())
}

pub(crate) fn check_recv_chain(chain: &[RecvWr<'_>], caps: &QpCaps) -> Result<(), PostError> {
    for wr in chain {
        if wr.sges.len() > caps.max_recv_sge as usize {
            return Err(PostError::Invalid(format!(
                "recv wr {} has {} SGEs, the QP allows {}",
                wr.wr_id,
                wr.sges.len(),
                caps.max_recv_sge
            )));
        }
    }
    Ok(())
}
