//! The metadata node's grant channel to each data node: its own pool directly, other nodes over
//! their join connection (which the data node dialed itself, to the metadata node it was told
//! to join: no other peer can speak on it). One request at a time per node, in the order they
//! were made; the join thread reads the answers, and sees the node leave when the connection
//! closes.

use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use rfs_proto::frame::{recv_frame, send_frame};
use rfs_proto::grant::{GrantOp, GrantRequest, MAX_GRANT_FRAME};
use rfs_proto::integrity;
use rfs_proto::session_key::SessionKey;
use rfs_proto::wire::DecodeError;
use rfs_proto::Errno;

use crate::grants::Grants;

/// How long a data node may take to answer a grant or revocation: one that takes longer is
/// cut off (its channel closes, and the node is taken as gone).
const GRANT_DEADLINE: Duration = Duration::from_secs(10);

/// Why a data node gave no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GrantChannelError {
    /// The node left, or was cut off for an answer later than [`GRANT_DEADLINE`].
    #[error("grant channel closed")]
    Closed,
    /// The caller gave up waiting (the request still reaches the node in its turn).
    #[error("data node did not answer a {0:?} in time")]
    Late(GrantOp),
    /// The node took longer than [`GRANT_DEADLINE`]: it is cut off.
    #[error("data node did not answer a {0:?} within {GRANT_DEADLINE:?}")]
    CutOff(GrantOp),
    /// Something on the path answered for the node.
    #[error("a data node's answer without the session's MAC")]
    Unsealed,
    #[error("a data node's answer: {0}")]
    Malformed(#[from] DecodeError),
    /// The node answered more than it was asked.
    #[error("data node answered a request it was not asked")]
    Unasked,
    /// The metadata node's own pool refused a revocation.
    #[error("refused: {0}")]
    Refused(Errno),
    /// The join connection failed.
    #[error("join connection: {0}")]
    Io(#[from] io::Error),
}

pub(crate) enum GrantChannel {
    /// The metadata node's own pool.
    Local(Arc<Grants>),
    Remote(Arc<RemoteGrantChannel>),
}

impl GrantChannel {
    /// Asks the node. With `wait`, gives up on the answer after it ([`GrantChannelError::Late`]; the
    /// request still reaches the node in its turn, so what it asked for may take effect later);
    /// without, waits for the worker, which answers every request: the node's answer, or a
    /// failure once the node took longer than [`GRANT_DEADLINE`] over one. Any other error
    /// means the node is gone or going.
    pub(crate) fn call(&self, req: &GrantRequest, wait: Option<Duration>) -> Answer {
        self.ask(req).wait_until(wait.map(|w| Instant::now() + w))
    }

    /// Asks the node without waiting yet: several nodes can be asked at once, and their
    /// answers awaited together ([`Asked::wait_until`]).
    pub(crate) fn ask(&self, req: &GrantRequest) -> Asked {
        match self {
            GrantChannel::Local(g) => Asked::Ready(Ok(g.serve(req))),
            GrantChannel::Remote(r) => match r.ask(req) {
                Ok(rx) => Asked::Waiting(rx, req.op()),
                Err(e) => Asked::Ready(Err(e)),
            },
        }
    }

    /// Tells the node, after everything asked of it before and before everything asked
    /// after, without waiting for its answer (a refusal or a silent node is logged).
    pub(crate) fn tell(&self, req: GrantRequest) -> Result<(), GrantChannelError> {
        match self {
            GrantChannel::Local(g) => g.serve(&req).map(drop).map_err(GrantChannelError::Refused),
            GrantChannel::Remote(r) => r.tell(req),
        }
    }
}

/// A node's answer: its keys or its refusal; an error when it gave none.
type Answer = Result<Result<Vec<u32>, Errno>, GrantChannelError>;

/// An answer on its way from [`GrantChannel::ask`].
pub(crate) enum Asked {
    Ready(Answer),
    Waiting(Receiver<Answer>, GrantOp),
}

impl Asked {
    /// The answer, given up on at `deadline` if there is one ([`GrantChannelError::Late`]; the request
    /// still reaches the node in its turn); without, whatever the worker answers.
    pub(crate) fn wait_until(self, deadline: Option<Instant>) -> Answer {
        let (rx, op) = match self {
            Asked::Ready(a) => return a,
            Asked::Waiting(rx, op) => (rx, op),
        };
        let Some(deadline) = deadline else {
            return rx.recv().unwrap_or(Err(GrantChannelError::Closed));
        };
        match rx.recv_deadline(deadline) {
            Ok(answer) => answer,
            Err(RecvTimeoutError::Timeout) => Err(GrantChannelError::Late(op)),
            Err(RecvTimeoutError::Disconnected) => Err(GrantChannelError::Closed),
        }
    }
}

/// A request for the channel's worker, and where its answer goes (nowhere for a `tell`).
struct Job {
    req: GrantRequest,
    answer: Option<Sender<Answer>>,
}

/// A remote node's channel: a worker sends the requests in the order they were made, one at a
/// time. Callers that need the answer wait for it; the others (revocations at close) go on, so
/// that a data node that stops answering holds up only what needs that node.
pub(crate) struct RemoteGrantChannel {
    jobs: Sender<Job>,
}

impl RemoteGrantChannel {
    /// A channel over the join connection `s`; the returned pump (run it on the join thread)
    /// forwards answers until the connection closes.
    pub(crate) fn new(
        s: &TcpStream,
        key: Option<SessionKey>,
    ) -> io::Result<(Arc<RemoteGrantChannel>, Pump)> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let (jobs, queue) = crossbeam_channel::unbounded();
        let out = s.try_clone()?;
        std::thread::Builder::new()
            .name("grants-out".into())
            .spawn(move || send_in_order(&out, &queue, &rx, key.as_ref()))?;
        Ok((
            Arc::new(RemoteGrantChannel { jobs }),
            Pump {
                s: s.try_clone()?,
                answers: tx,
            },
        ))
    }

    /// [`GrantChannel::call`] on this channel.
    pub(crate) fn call(&self, req: &GrantRequest, wait: Option<Duration>) -> Answer {
        let rx = self.ask(req)?;
        Asked::Waiting(rx, req.op()).wait_until(wait.map(|w| Instant::now() + w))
    }

    fn ask(&self, req: &GrantRequest) -> Result<Receiver<Answer>, GrantChannelError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.enqueue(Job {
            req: req.clone(),
            answer: Some(tx),
        })?;
        Ok(rx)
    }

    fn tell(&self, req: GrantRequest) -> Result<(), GrantChannelError> {
        self.enqueue(Job { req, answer: None })
    }

    fn enqueue(&self, job: Job) -> Result<(), GrantChannelError> {
        self.jobs.send(job).map_err(|_| GrantChannelError::Closed)
    }
}

/// The worker: each request in turn, answered or failed. A node that takes longer than
/// [`GRANT_DEADLINE`] is cut off: every later request fails at once.
fn send_in_order(
    s: &TcpStream,
    queue: &Receiver<Job>,
    answers: &Receiver<Vec<u8>>,
    key: Option<&SessionKey>,
) {
    let mut cut = false;
    for (number, Job { req, answer }) in (1u64..).zip(queue) {
        let result = if cut {
            Err(GrantChannelError::Closed)
        } else {
            exchange(s, &req, answers, key, number)
        };
        if let Err(e) = &result {
            cut = true;
            // Whatever it says later would answer the wrong request.
            let _ = s.shutdown(std::net::Shutdown::Both);
            if answer.is_none() {
                log::warn!("grant channel: {e}");
            }
        }
        if let Some(a) = answer {
            let _ = a.send(result);
        }
    }
}

/// Sends request `number` of the channel, sealed with `key`, and takes its answer.
fn exchange(
    mut s: &TcpStream,
    req: &GrantRequest,
    answers: &Receiver<Vec<u8>>,
    key: Option<&SessionKey>,
    number: u64,
) -> Answer {
    send_frame(
        &mut s,
        &integrity::seal(key, integrity::GRANT_CALL, number, req.encode()),
    )?;
    let answer = answers
        .recv_timeout(GRANT_DEADLINE)
        .map_err(|_| GrantChannelError::CutOff(req.op()))?;
    let answer = integrity::open(key, integrity::GRANT_ANSWER, number, &answer)
        .ok_or(GrantChannelError::Unsealed)?;
    Ok(req.decode_answer(answer)?)
}

/// Reads the data node's answers off the join connection.
pub(crate) struct Pump {
    s: TcpStream,
    answers: Sender<Vec<u8>>,
}

impl Pump {
    /// Forwards answers until the connection closes (the node left) or breaks the protocol.
    pub(crate) fn run(mut self) -> Result<(), GrantChannelError> {
        loop {
            let answer = recv_frame(&mut self.s, MAX_GRANT_FRAME + integrity::TAG)?;
            if self.answers.try_send(answer).is_err() {
                return Err(GrantChannelError::Unasked);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Instant;

    use rfs_proto::grant::{encode_grant_reply, GrantChunks, RevokeChunks};

    use super::*;

    /// A data node's end that answers each request (with its first address as the key) after
    /// `delay(n)` for the n-th, and reports the first addresses in the order they came.
    fn fake_node(delay: fn(usize) -> Duration) -> (TcpStream, Receiver<u64>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut theirs, _) = l.accept().unwrap();
        let (seen, order) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for n in 0.. {
                let Ok(f) = recv_frame(&mut theirs, MAX_GRANT_FRAME + integrity::TAG) else {
                    return;
                };
                let number = n as u64 + 1;
                let req = integrity::open(None, integrity::GRANT_CALL, number, &f).unwrap();
                let req = GrantRequest::decode(req).unwrap();
                let first = match &req {
                    GrantRequest::GrantChunks(g) => g.extents[0].0,
                    GrantRequest::RevokeChunks(r) => r.addrs[0],
                    _ => 0,
                };
                let _ = seen.send(first);
                std::thread::sleep(delay(n));
                let answer = match req {
                    GrantRequest::GrantChunks(_) => Ok(vec![first as u32]),
                    _ => Ok(Vec::new()),
                };
                let answer = encode_grant_reply(req.op(), &answer);
                let sealed = integrity::seal(None, integrity::GRANT_ANSWER, number, answer);
                if send_frame(&mut theirs, &sealed).is_err() {
                    return;
                }
            }
        });
        (ours, order)
    }

    fn grant(addr: u64) -> GrantRequest {
        GrantChunks {
            session: 1,
            seq: 0,
            writable: false,
            extents: vec![(addr, 4096)],
        }
        .into()
    }

    /// Both ends of a connection that went through the handshake, with their session keys.
    fn authenticated_pair() -> (
        (TcpStream, Option<SessionKey>),
        (TcpStream, Option<SessionKey>),
    ) {
        use rfs_proto::handshake::{accept, connect};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let node = std::thread::spawn(move || {
            let (mut theirs, _) = l.accept().unwrap();
            let key = accept(&mut theirs, Some(b"secret"), false, deadline).unwrap();
            (theirs, key)
        });
        let (key, _) = connect(&mut ours, Some(b"secret"), deadline).unwrap();
        ((ours, key), node.join().unwrap())
    }

    /// Something on the path answers for the data node: without the join's session key its
    /// answer has no valid MAC, and the grant fails instead of taking a key it made up.
    #[test]
    fn an_answer_without_the_sessions_mac_is_refused() {
        let ((ours, key), (mut theirs, their_key)) = authenticated_pair();
        std::thread::spawn(move || {
            let f = recv_frame(&mut theirs, MAX_GRANT_FRAME + integrity::TAG).unwrap();
            assert!(integrity::open(their_key.as_ref(), integrity::GRANT_CALL, 1, &f).is_some());
            assert!(integrity::open(their_key.as_ref(), integrity::GRANT_CALL, 2, &f).is_none());
            let answer = encode_grant_reply(GrantOp::GrantChunks, &Ok(vec![7]));
            let forged = integrity::seal(None, integrity::GRANT_ANSWER, 1, answer);
            let _ = send_frame(&mut theirs, &forged);
        });
        let (channel, pump) = RemoteGrantChannel::new(&ours, key).unwrap();
        std::thread::spawn(move || pump.run());
        let e = channel.call(&grant(1), None).unwrap_err();
        assert!(matches!(e, GrantChannelError::Unsealed), "{e}");
    }

    #[test]
    fn requests_reach_the_node_in_order_and_only_callers_wait() {
        let (s, order) = fake_node(|n| Duration::from_millis(if n == 0 { 300 } else { 0 }));
        let (channel, pump) = RemoteGrantChannel::new(&s, None).unwrap();
        std::thread::spawn(move || pump.run());
        let start = Instant::now();
        channel
            .tell(
                RevokeChunks {
                    session: 1,
                    writable_only: false,
                    addrs: vec![1],
                }
                .into(),
            )
            .unwrap();
        assert!(
            start.elapsed() < Duration::from_millis(100),
            "tell waits for nothing"
        );
        let e = channel
            .call(&grant(2), Some(Duration::from_millis(50)))
            .unwrap_err();
        assert!(
            matches!(e, GrantChannelError::Late(GrantOp::GrantChunks)),
            "{e}"
        );
        let keys = channel.call(&grant(3), None).unwrap().unwrap();
        assert_eq!(
            keys,
            vec![3],
            "the answer to our request, not to the abandoned one"
        );
        let seen: Vec<u64> = order.try_iter().collect();
        assert_eq!(seen, vec![1, 2, 3], "in the order asked");
    }

    #[test]
    fn nodes_asked_at_once_are_waited_for_together_up_to_one_deadline() {
        // Three nodes that take 600 ms and one that takes 5 s, all asked at once with one
        // deadline of 1 s: asked one after another, the second would already be past it.
        let mut streams = Vec::new();
        let channels: Vec<GrantChannel> = [false, false, false, true]
            .into_iter()
            .map(|stopped| {
                let delay: fn(usize) -> Duration = if stopped {
                    |_| Duration::from_secs(5)
                } else {
                    |_| Duration::from_millis(600)
                };
                let (s, _order) = fake_node(delay);
                let (channel, pump) = RemoteGrantChannel::new(&s, None).unwrap();
                std::thread::spawn(move || pump.run());
                streams.push(s); // the fake nodes live as long as the test
                GrantChannel::Remote(channel)
            })
            .collect();
        let start = Instant::now();
        let asked: Vec<Asked> = channels
            .iter()
            .enumerate()
            .map(|(i, l)| l.ask(&grant(i as u64 + 10)))
            .collect();
        let deadline = start + Duration::from_secs(1);
        let answers: Vec<Answer> = asked
            .into_iter()
            .map(|a| a.wait_until(Some(deadline)))
            .collect();
        for (i, a) in answers[..3].iter().enumerate() {
            assert_eq!(a.as_ref().unwrap(), &Ok(vec![i as u32 + 10]), "node {i}");
        }
        assert!(
            matches!(answers[3], Err(GrantChannelError::Late(_))),
            "the stopped node: {:?}",
            answers[3]
        );
        assert!(start.elapsed() < Duration::from_millis(1500));
    }
}
