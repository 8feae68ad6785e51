//! One connection to the metadata service: calls on the first queue pair, the service's
//! callbacks answered on the second by a thread of their own, and the control connection that
//! keeps both. A [`crate::Client`] replaces a channel that broke with a new one.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use rdmabox::connect_queue_pairs;
use rdmabox::rpc::{self, RpcClient};
use rdmabox::transport::{Context, ProtectionDomain};

use crate::callback::{encode_ack, Callback, CALLBACK_RPC};
use crate::client::config::{ClientConfig, Notice, NoticeHandler};
use crate::frame::recv_frame;
use crate::handshake::{dial, queue_pair_route};
use crate::hello::{Hello, Metadata};
use crate::integrity::{self, ANSWER, CALLBACK};
use crate::session_key::SessionKey;

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
        let route = queue_pair_route(cfg.secret.as_deref(), cfg.encrypt)?;
        let mut qps = connect_queue_pairs(ctx, pd, &mut s, 2, cfg.session.caps, &route)?;
        let (cb_qp, cb_cq) = qps.pop().expect("two queue pairs");
        let (qp, cq) = qps.pop().expect("two queue pairs");
        let resumed = matches!(recv_frame(&mut s, 1)?.as_slice(), [1]);
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
