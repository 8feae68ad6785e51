//! Completion queues: polling, and waiting on a completion channel.

use std::os::fd::BorrowedFd;

use super::*;

/// A device completion queue and its completion channel.
pub struct Cq {
    pub(super) cq: *mut ffi::ibv_cq,
    pub(super) channel: *mut ffi::ibv_comp_channel,
    pub(super) _ctx: Arc<CtxInner>,
}

// SAFETY: a CQ may be polled from any thread; concurrent pollers are serialized by the
// provider library's own CQ lock.
unsafe impl Send for Cq {}

// SAFETY: see Send.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so none is alive; every event was
        // acknowledged in `wait_event`.
        unsafe {
            ffi::ibv_destroy_cq(self.cq);
            ffi::ibv_destroy_comp_channel(self.channel);
        }
    }
}

impl Cq {
    /// Moves up to `out.len()` completions into `out`, 32 per `ibv_poll_cq`; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> io::Result<usize> {
        const BATCH: usize = 32;
        let mut wc = [ffi::ibv_wc::default(); BATCH];
        let mut total = 0;
        while total < out.len() {
            let want = (out.len() - total).min(BATCH);
            // SAFETY: valid CQ; `wc` has room for `want` entries.
            let n = unsafe {
                (*(*self.cq).context).ops.poll_cq.expect("poll_cq op")(
                    self.cq,
                    want as i32,
                    wc.as_mut_ptr(),
                )
            };
            if n < 0 {
                return Err(io::Error::other(format!("ibv_poll_cq returned {n}")));
            }
            for (slot, w) in out[total..].iter_mut().zip(&wc[..n as usize]) {
                *slot = completion_from_wc(w);
            }
            total += n as usize;
            if (n as usize) < want {
                break;
            }
        }
        Ok(total)
    }

    /// Requests an event at the next completion (`ibv_req_notify_cq`, any completion).
    pub fn arm(&self) -> io::Result<()> {
        // SAFETY: the CQ lives as long as `self`; req_notify_cq is the context's own op for it.
        let rc = unsafe {
            (*(*self.cq).context)
                .ops
                .req_notify_cq
                .expect("req_notify_cq op")(self.cq, 0)
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }

    /// The completion channel's descriptor, readable when an event is pending.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel, and its descriptor, live as long as self.
        unsafe { BorrowedFd::borrow_raw((*self.channel).fd) }
    }

    /// Waits for an event (true, taken and acknowledged) or `timeout` (false).
    pub fn wait_event(&self, timeout: Option<Duration>) -> io::Result<bool> {
        if !crate::transport::poll_readable(self.event_fd(), timeout)? {
            return Ok(false);
        }
        let mut cq = ptr::null_mut();
        let mut ctx = ptr::null_mut();
        // SAFETY: valid channel; the fd is non-blocking, so this returns at once.
        if unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } != 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock {
                Ok(false)
            } else {
                Err(e)
            };
        }
        // SAFETY: acknowledging the one event just received on our own CQ.
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}
