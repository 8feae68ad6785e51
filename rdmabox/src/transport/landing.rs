//! Memory owned outside the library that a read may land in directly: an application's
//! buffer shared with us (a memfd both processes map), registered for the one transfer that
//! lands there, so that its bytes are copied nowhere after the wire (dynMR into the caller's
//! memory rather than into a buffer of ours).
//!
//! Such memory may be written by another process at any moment, so, as with registered
//! memory (see `memory`), nothing here hands out references into it: bytes go in by copies
//! through raw pointers, and providers write it by address.

use std::sync::Arc;

/// Memory that stays mapped and writable while this object lives.
///
/// # Safety
/// `as_ptr()..as_ptr()+len()` must be valid for reads and writes for as long as the object
/// lives, always the same range, and reached by everyone only through raw pointers (never
/// Rust references), as shared memory is.
pub unsafe trait ExternalMemory: Send + Sync + 'static {
    /// The first byte.
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `len` bytes at `offset` of external memory: where one read lands. Holding it keeps the
/// memory alive, and so does a registration made over it.
#[derive(Clone)]
pub struct Landing {
    memory: Arc<dyn ExternalMemory>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for Landing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Landing(+{} len {})", self.offset, self.len)
    }
}

impl Landing {
    /// `len` bytes at `offset` of `memory`; None when they leave it.
    pub fn new(memory: Arc<dyn ExternalMemory>, offset: usize, len: usize) -> Option<Landing> {
        let end = offset.checked_add(len)?;
        (end <= memory.len()).then_some(Landing {
            memory,
            offset,
            len,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `at` of this landing; None when they leave it.
    pub fn part(&self, at: usize, len: usize) -> Option<Landing> {
        let end = at.checked_add(len)?;
        (end <= self.len).then(|| Landing {
            memory: self.memory.clone(),
            offset: self.offset + at,
            len,
        })
    }

    /// Copies `data` in at `at`; false (nothing copied) when it does not fit.
    pub fn copy_in(&self, at: usize, data: &[u8]) -> bool {
        if at.checked_add(data.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: inside the landing (checked), which is inside live memory (`new`); `data`
        // is ours and cannot overlap memory nobody holds references into.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr().add(at), data.len());
        }
        true
    }

    /// Sets `len` bytes at `at` to zero; false (nothing set) when they leave the landing.
    pub fn zero(&self, at: usize, len: usize) -> bool {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: as for `copy_in`.
        unsafe { std::ptr::write_bytes(self.ptr().add(at), 0, len) };
        true
    }

    /// The first byte, for a registration.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: `offset` is within the memory (`new`, `part`).
        unsafe { self.memory.as_ptr().add(self.offset) }
    }

    /// The memory, for a registration to keep alive.
    pub(crate) fn memory(&self) -> Arc<dyn ExternalMemory> {
        self.memory.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Heap(Mutex<Vec<u8>>, *mut u8);
    // SAFETY: test memory, reached only through `Landing`'s raw copies and read back by the
    // test once nothing else holds it.
    unsafe impl Send for Heap {}
    // SAFETY: as for Send.
    unsafe impl Sync for Heap {}
    // SAFETY: the vector is never resized, so its pointer and length hold while it lives.
    unsafe impl ExternalMemory for Heap {
        fn as_ptr(&self) -> *mut u8 {
            self.1
        }
        fn len(&self) -> usize {
            self.0.lock().unwrap().len()
        }
    }

    fn heap(len: usize) -> Arc<Heap> {
        let mut v = vec![7u8; len];
        let ptr = v.as_mut_ptr();
        Arc::new(Heap(Mutex::new(v), ptr))
    }

    #[test]
    fn landings_stay_inside_their_memory() {
        let m = heap(100);
        assert!(Landing::new(m.clone(), 90, 11).is_none());
        assert!(Landing::new(m.clone(), usize::MAX, 2).is_none());
        let l = Landing::new(m.clone(), 10, 80).unwrap();
        assert!(l.part(70, 11).is_none());
        let p = l.part(70, 10).unwrap();
        assert!(p.copy_in(0, &[1; 10]));
        assert!(!p.copy_in(1, &[1; 10]));
        assert!(p.zero(5, 5));
        assert!(!p.zero(6, 5));
        let bytes = m.0.lock().unwrap().clone();
        assert_eq!(
            &bytes[79..96],
            &[7, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 7, 7, 7, 7, 7, 7]
        );
    }
}
