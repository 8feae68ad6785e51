//! The metadata node's grant link to each data node: its own pool directly, other nodes over
//! their join connection (which the data node dialed itself, to the metadata node it was told
//! to join: no other peer can speak on it). One request at a time per node; the join thread
//! reads the answers, and sees the node leave when the connection closes.

use std::io;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use rfs_proto::frame::{recv_frame, send_frame};
use rfs_proto::grant::{LinkRequest, MAX_LINK_FRAME};
use rfs_proto::Errno;

use crate::grants::Grants;

/// How long a data node may take to answer a grant or revocation: one that takes longer is
/// cut off (its link closes, and the node is taken as gone).
const LINK_DEADLINE: Duration = Duration::from_secs(10);

pub(crate) enum Link {
    /// The metadata node's own pool.
    Local(Arc<Grants>),
    Remote(Arc<RemoteLink>),
}

impl Link {
    /// Asks the node; an error means the node did not answer (it is gone or going).
    pub(crate) fn call(&self, req: &LinkRequest) -> io::Result<Result<Vec<u32>, Errno>> {
        match self {
            Link::Local(g) => Ok(g.serve(req)),
            Link::Remote(r) => r.call(req),
        }
    }
}

pub(crate) struct RemoteLink {
    /// The write half, and the answers the join thread reads off the read half.
    calls: Mutex<(TcpStream, Receiver<Vec<u8>>)>,
}

impl RemoteLink {
    /// A link over the join connection `s`; the returned pump (run it on the join thread)
    /// forwards answers until the connection closes.
    pub(crate) fn new(s: &TcpStream) -> io::Result<(Arc<RemoteLink>, Pump)> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let link = Arc::new(RemoteLink {
            calls: Mutex::new((s.try_clone()?, rx)),
        });
        Ok((
            link,
            Pump {
                s: s.try_clone()?,
                answers: tx,
            },
        ))
    }

    pub(crate) fn call(&self, req: &LinkRequest) -> io::Result<Result<Vec<u32>, Errno>> {
        let calls = self.calls.lock().unwrap();
        let (s, answers) = &*calls;
        send_frame(&mut &*s, &req.encode())?;
        let answer = match answers.recv_timeout(LINK_DEADLINE) {
            Ok(a) => a,
            Err(e) => {
                // Whatever it says later would answer the wrong request.
                let _ = s.shutdown(std::net::Shutdown::Both);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("data node did not answer a {:?}: {e}", req.op()),
                ));
            }
        };
        req.decode_answer(&answer)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Reads the data node's answers off the join connection.
pub(crate) struct Pump {
    s: TcpStream,
    answers: Sender<Vec<u8>>,
}

impl Pump {
    /// Forwards answers until the connection closes (the node left) or breaks the protocol.
    pub(crate) fn run(mut self) -> io::Result<()> {
        loop {
            let answer = recv_frame(&mut self.s, MAX_LINK_FRAME)?;
            if self.answers.try_send(answer).is_err() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "data node answered a request it was not asked",
                ));
            }
        }
    }
}
