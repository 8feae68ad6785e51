//! Protection domains and memory registrations.

use super::*;

pub(super) struct PdInner {
    pub(super) pd: *mut ffi::ibv_pd,
    pub(super) _ctx: Arc<CtxInner>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for PdInner {}

// SAFETY: see Send.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc to us, so none is alive any more.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A protection domain on the device.
pub struct Pd {
    pub(super) inner: Arc<PdInner>,
}

impl Pd {
    /// Registers `len` bytes at `addr` that `backing` keeps alive.
    pub(crate) fn register(
        &self,
        backing: Backing,
        addr: u64,
        len: usize,
        access: Access,
        pd_id: u64,
    ) -> Result<MemoryRegion, (io::Error, Backing)> {
        // SAFETY: the caller guarantees addr..addr+len is memory that outlives the MR.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.inner.pd,
                addr as *mut libc::c_void,
                len,
                access.bits() as i32,
            )
        };
        if mr.is_null() {
            return Err((os_err(&format!("ibv_reg_mr({len} bytes)")), backing));
        }
        // SAFETY: a registered MR's keys are plain fields.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            inner: Arc::new(MrInner {
                registration: Box::new(Registration {
                    mr,
                    _pd: self.inner.clone(),
                }),
                backing,
                addr,
                len,
                access,
                lkey,
                rkey,
                pd_id,
            }),
        })
    }
}

pub(crate) struct Registration {
    pub(super) mr: *mut ffi::ibv_mr,
    pub(super) _pd: Arc<PdInner>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Registration {}

// SAFETY: see Send.
unsafe impl Sync for Registration {}

impl AnyRegistration for Registration {}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: the MR is ours and deregistered once.
        if unsafe { ffi::ibv_dereg_mr(self.mr) } != 0 {
            log::error!("ibv_dereg_mr: {}", io::Error::last_os_error());
        }
    }
}
