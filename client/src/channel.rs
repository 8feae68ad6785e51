//! One connection to the metadata service: calls on the first queue pair, the service's
//! callbacks answered on the second by a thread of their own, and the control connection that
//! keeps both. A [`crate::Client`] replaces a channel that broke with a new one.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use rdmabox::connect_queue_pairs;
use rdmabox::rpc::{self, RpcClient};
use rdmabox::transport::{Context, DeadlineStream, ProtectionDomain};

use crate::config::{ClientConfig, Notice, NoticeHandler};
use rfs_proto::callback::{encode_ack, Callback, CALLBACK_RPC};
use rfs_proto::frame::recv_frame;
use rfs_proto::handshake::{dial, queue_pair_route};
use rfs_proto::hello::{Hello, Metadata};
use rfs_proto::integrity::{self, ANSWER, CALLBACK};
use rfs_proto::session_key::SessionKey;

pub(crate) struct Channel {
    pub(crate) rpc: RpcClient,
    /// What every call, reply, callback and answer on it is sealed with.
    pub(crate) key: Option<SessionKey>,
    /// Whether the service still had this client's session (false: a new one).
    pub(crate) resumed: bool,
    control: TcpStream,
    callbacks_stop: Arc<AtomicBool>,
    callbacks: Option<JoinHandle<()>>,
}

impl Channel {
    /// Dials the service as client `client_id` and sets both queue pairs up.
    pub(crate) fn open(
        ctx: &Context,
        pd: &Arc<ProtectionDomain>,
        addr: SocketAddr,
        cfg: &ClientConfig,
        client_id: u64,
        on_notice: &Arc<OnceLock<NoticeHandler>>,
    ) -> io::Result<Channel> {
        let hello = Hello::Metadata(Metadata { client_id });
        let (mut s, key) = dial(addr, cfg.secret.as_deref(), &hello, cfg.connect_timeout)?;
        // A node that goes silent during setup (stopped, or stuck before it answers) fails the
        // dial instead of hanging it: a mount starting would wait for it without a word, and a
        // reconnection holds up every call meanwhile. Timed-out dials are tried again.
        s.set_read_timeout(Some(cfg.connect_timeout))?;
        log::debug!("metadata node {addr}: authenticated; setting the queue pairs up");
        let route = queue_pair_route(cfg.secret.as_deref(), cfg.encrypt, key.as_ref())?;
        let mut qps = connect_queue_pairs(ctx, pd, &mut s, 2, cfg.session.caps, &route)?;
        let (cb_qp, cb_cq) = qps.pop().expect("two queue pairs");
        let (qp, cq) = qps.pop().expect("two queue pairs");
        let answer_by = Instant::now() + cfg.connect_timeout;
        let session = recv_frame(&mut DeadlineStream::new(&s, answer_by, "session setup"), 1)?;
        let resumed = matches!(session.as_slice(), [1]);
        s.set_read_timeout(None)?;
        let rpc = RpcClient::new(pd, qp, cq, cfg.rpc)?;
        let callbacks_stop = Arc::new(AtomicBool::new(false));
        let callbacks = {
            let (pd, on, stop) = (pd.clone(), on_notice.clone(), callbacks_stop.clone());
            let key = key.clone();
            std::thread::Builder::new()
                .name("rfs-callbacks".into())
                .spawn(move || {
                    let mut last = 0u64;
                    let served = rpc::serve(&pd, cb_qp, cb_cq, CALLBACK_RPC, &stop, |frame| {
                        // Not from the node, or one it sent before: neither applied nor answered.
                        let body = match integrity::open_numbered(key.as_ref(), CALLBACK, frame) {
                            Some((number, body)) if number > last => {
                                last = number;
                                body
                            }
                            _ => {
                                log::warn!(
                                    "a callback without the session's MAC, or an old one: refused"
                                );
                                return Vec::new();
                            }
                        };
                        match Callback::decode(body) {
                            // Nothing is cached before there is a handler: answer at once.
                            Ok(cb) => {
                                if let Some(handle) = on.get() {
                                    handle(Notice::Callback(cb));
                                }
                                integrity::seal(key.as_ref(), ANSWER, last, encode_ack())
                            }
                            // Not an answer: the service counts it as unanswered.
                            Err(e) => {
                                log::warn!("callback not understood: {e}");
                                Vec::new()
                            }
                        }
                    });
                    if let Err(e) = served {
                        log::warn!("callback channel ended: {e}");
                    }
                })?
        };
        Ok(Channel {
            rpc,
            key,
            resumed,
            control: s,
            callbacks_stop,
            callbacks: Some(callbacks),
        })
    }

    /// Whether the channel is gone.
    pub(crate) fn is_broken(&self) -> bool {
        self.rpc.is_broken()
    }

    /// Breaks the channel as a network failure would: calls, control and callbacks alike (a
    /// callback answered on a severed channel would tell us what a partition hides).
    pub(crate) fn sever(&self) {
        self.callbacks_stop.store(true, Ordering::Release);
        self.rpc.abort();
        let _ = self.control.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.callbacks_stop.store(true, Ordering::Release);
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.callbacks.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use rdmabox::transport::{ProviderKind, TransportConfig};

    use crate::config::ClientConfig;
    use crate::Client;
    use rfs_proto::handshake::{accept, HANDSHAKE_TIMEOUT};
    use rfs_proto::hello::Hello;

    /// A node that authenticates a client and takes its hello, then says nothing more (stopped,
    /// or stuck before it sets the session up): the client gives up after its connect timeout,
    /// with an error its start-up retries, instead of waiting for it silently for ever.
    #[test]
    fn a_node_silent_after_the_hello_fails_the_connect_in_time() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in l.incoming() {
                let mut s = s.unwrap();
                let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
                let key = accept(&mut s, None, false, deadline).unwrap();
                let _ = Hello::receive(&mut s, key.as_ref());
                held.push(s);
            }
        });
        let cfg = ClientConfig {
            transport: TransportConfig::with_provider(ProviderKind::Tcp),
            connect_timeout: Duration::from_millis(500),
            ..ClientConfig::default()
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let start = Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(Client::connect(&addr.to_string(), cfg).map(drop));
        });
        let e = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("connect still waiting for a silent node after 10 s")
            .unwrap_err();
        assert!(rfs_daemon::patience::is_transient(&e), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }
}
