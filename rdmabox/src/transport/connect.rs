//! Queue-pair setup: creating a peer's queue pairs and connecting them over the control
//! connection, on top of the endpoint exchange. Both ends (a session's client and the peer that
//! lends it memory) run the same steps, so it lives with the transport, not the session.

use std::io;
use std::net::TcpStream;

use super::{
    exchange_endpoints, CompletionQueue, Context, ProtectionDomain, QpCaps, QpRoute, QueuePair,
};

/// Creates `n` queue pairs (each with its own CQ) and connects them to the peer's over a
/// control connection. Both sides call it with the same `n`, and with routes that match: both
/// [`QpRoute::OwnPort`], or one side dialing (the one that dialed the control connection) and
/// the other taking arrivals.
pub fn connect_queue_pairs(
    ctx: &Context,
    pd: &ProtectionDomain,
    control: &mut TcpStream,
    n: usize,
    caps: QpCaps,
    route: &QpRoute,
) -> io::Result<Vec<(QueuePair, CompletionQueue)>> {
    let mut prepared = Vec::with_capacity(n);
    let mut local = Vec::with_capacity(n);
    // Queue pairs we never post on complete nothing but flushes: they share one queue.
    let shared = match caps.is_responder() {
        true => Some(ctx.create_cq(n.max(1))?),
        false => None,
    };
    for _ in 0..n {
        let cq = match &shared {
            Some(cq) => cq.clone(),
            None => ctx.create_cq((caps.max_send_wr + caps.max_recv_wr) as usize)?,
        };
        let qp = ctx.create_qp(pd, &cq, &cq, caps, route)?;
        local.push(qp.endpoint()?);
        prepared.push((qp, cq));
    }
    let remote = exchange_endpoints(control, &local, route.binding())?;
    if remote.len() != n {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "peer offered {} queue pairs, we asked for {n}",
                remote.len()
            ),
        ));
    }
    prepared
        .into_iter()
        .zip(&remote)
        .map(|((qp, cq), r)| Ok((qp.connect(r)?, cq)))
        .collect()
}
