//! preMR: a pool of pre-registered staging buffers, allocated and registered once, so the hot
//! path never allocates or registers. Requests below the dynMR threshold are copied into a slot.

use std::io;
use std::sync::{Arc, Mutex};

use crate::transport::{Access, MemoryRegion, ProtectionDomain, Sge};

/// Fixed-size staging slots carved out of one registered region.
pub struct MrPool {
    region: MemoryRegion,
    slot_size: usize,
    free: Mutex<Vec<u32>>,
}

/// One staging buffer, returned to the pool when dropped.
pub struct Slot {
    pool: Arc<MrPool>,
    index: u32,
}

impl MrPool {
    /// Allocates and registers `slots` (at least one) slots of `slot_size` bytes each.
    pub fn new(pd: &ProtectionDomain, slots: usize, slot_size: usize) -> io::Result<Arc<MrPool>> {
        let slots = slots.max(1);
        let region = pd.alloc_region(slots * slot_size, Access::LOCAL_WRITE)?;
        Ok(Arc::new(MrPool {
            region,
            slot_size,
            free: Mutex::new((0..slots as u32).rev().collect()),
        }))
    }

    /// The most bytes one slot stages.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// Slots free right now (a snapshot).
    pub fn available(&self) -> usize {
        self.free.lock().unwrap().len()
    }

    /// Takes a free slot, or `None` when all are in use: the caller backs off, never waits.
    pub fn try_get(self: &Arc<Self>) -> Option<Slot> {
        self.try_get_sparing(0)
    }

    /// Takes a free slot if more than `spare` are free (`None` otherwise).
    pub fn try_get_sparing(self: &Arc<Self>, spare: usize) -> Option<Slot> {
        let mut free = self.free.lock().unwrap();
        if free.len() <= spare {
            return None;
        }
        let index = free.pop()?;
        Some(Slot {
            pool: self.clone(),
            index,
        })
    }
}

impl MrPool {
    /// `len` bytes at `offset` of the whole pool region (a slot's `offset()` plus an offset
    /// inside it).
    pub fn sge_at(&self, offset: usize, len: usize) -> Sge<'_> {
        self.region
            .slice(offset, len)
            .expect("staging range inside the pool region")
    }
}

impl Slot {
    fn base(&self) -> usize {
        self.index as usize * self.pool.slot_size
    }

    /// Where this slot starts in the pool region.
    pub fn offset(&self) -> usize {
        self.base()
    }

    /// Copies `data` into the slot at `offset` (staging a write). Panics outside the slot.
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.pool.slot_size);
        self.pool
            .region
            .write_at(self.base() + offset, data)
            .expect("slot lies inside the pool region");
    }

    /// Copies from the slot at `offset` into `out` (delivering a read). Panics outside the slot.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.pool.slot_size);
        self.pool
            .region
            .read_at(self.base() + offset, out)
            .expect("slot lies inside the pool region");
    }
}

impl Slot {
    /// `len` bytes at `offset` of the slot, borrowed. Panics outside the slot.
    ///
    /// # Safety
    /// Nothing may write these bytes while the borrow lives: no transfer posted with this
    /// slot may be under way.
    pub(crate) unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.pool.slot_size);
        // SAFETY: inside the pool region (asserted), whose memory lives as long as the pool,
        // which this slot keeps; the caller promises that nothing writes it meanwhile.
        unsafe {
            std::slice::from_raw_parts(self.pool.region.inner.ptr().add(self.base() + offset), len)
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap().push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Context, ProviderKind, TransportConfig};

    #[test]
    fn slots_are_reused_and_bounded() {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let pool = MrPool::new(&pd, 2, 4096).unwrap();
        let a = pool.try_get().unwrap();
        let b = pool.try_get().unwrap();
        assert!(pool.try_get().is_none(), "only two slots");
        a.write_at(10, b"abc");
        b.write_at(10, b"xyz");
        let mut out = [0u8; 3];
        a.read_at(10, &mut out);
        assert_eq!(&out, b"abc", "slots do not overlap");
        assert_eq!(b.offset() - a.offset(), 4096);
        drop(a);
        assert_eq!(pool.available(), 1);
        assert!(pool.try_get().is_some());
    }

    #[test]
    fn a_taker_that_spares_slots_leaves_them() {
        let ctx = Context::open(&TransportConfig::with_provider(ProviderKind::Tcp)).unwrap();
        let pool = MrPool::new(&ctx.alloc_pd().unwrap(), 3, 4096).unwrap();
        let a = pool.try_get_sparing(1).unwrap();
        let b = pool.try_get_sparing(1).unwrap();
        assert!(pool.try_get_sparing(1).is_none(), "the last one is spared");
        let c = pool.try_get().expect("for one that spares none");
        drop((a, b, c));
        assert_eq!(pool.available(), 3);
    }
}
