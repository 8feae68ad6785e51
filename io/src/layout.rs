//! The rings in shared memory, as both sides see them: a header of four counters, each on a
//! cache line of its own, then the submission entries, then the completion entries.
//!
//! The application writes submission entries and advances `sq_tail`; fs-client reads them and
//! advances `sq_head`. fs-client writes completion entries and advances `cq_tail`; the
//! application reads them and advances `cq_head`. Counters run freely (wrapping); an entry's
//! slot is its counter modulo the ring's size. Neither side trusts what the other wrote: every
//! counter and entry is read once, copied, and checked.

/// A cache line: producer and consumer counters on different lines.
const LINE: usize = 64;
/// Where each counter is, from the start of the ring memory.
pub const SQ_HEAD: usize = 0;
pub const SQ_TAIL: usize = LINE;
pub const CQ_HEAD: usize = 2 * LINE;
pub const CQ_TAIL: usize = 3 * LINE;
/// The header's length: the submission entries start here.
pub const HEADER_LEN: usize = 4 * LINE;
/// The most entries a ring may have.
pub const MAX_ENTRIES: u32 = 1 << 15;
/// Ring memory is a whole number of pages.
const PAGE: usize = 4096;

/// What a submission asks for.
pub mod op {
    /// Read `len` bytes at `offset` of the file into the buffer at `buf_off`.
    pub const READ: u8 = 1;
    /// Write `len` bytes from the buffer at `buf_off` to the file at `offset`.
    pub const WRITE: u8 = 2;
    /// Wait for the file's writes in flight, then commit its size and times (fsync).
    pub const FSYNC: u8 = 3;
}

/// A submission entry (40 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sqe {
    /// One of [`op`].
    pub op: u8,
    pub reserved: [u8; 3],
    /// The registered file (its number from registration).
    pub file: u32,
    pub len: u32,
    pub reserved2: u32,
    pub offset: u64,
    /// Where in the shared buffer the bytes go (read) or come from (write).
    pub buf_off: u64,
    /// Handed back in the completion as it is.
    pub user_data: u64,
}

/// A completion entry (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    pub user_data: u64,
    /// Bytes moved (a read short only at the end of the file), or a negated errno.
    pub result: i64,
}

/// Types that may be read from or written to shared memory as they are: plain data, any bit
/// pattern valid.
pub trait Pod: Copy + private::Sealed {}
impl Pod for Sqe {}
impl Pod for Cqe {}

mod private {
    pub trait Sealed {}
    impl Sealed for super::Sqe {}
    impl Sealed for super::Cqe {}
}

/// The sizes of a ring: both powers of two, the completion ring at least as large as the
/// submission ring (every request in flight has room for its completion).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub sq_entries: u32,
    pub cq_entries: u32,
}

impl Layout {
    /// A ring of `sq_entries` submissions and `cq_entries` completions, if valid.
    pub fn new(sq_entries: u32, cq_entries: u32) -> Result<Layout, String> {
        let fits = |n: u32| n.is_power_of_two() && n <= MAX_ENTRIES;
        if !fits(sq_entries) || !fits(cq_entries) || cq_entries < sq_entries {
            return Err(format!(
                "a ring of {sq_entries} submissions and {cq_entries} completions: both must be \
                 powers of two up to {MAX_ENTRIES}, the completions at least the submissions"
            ));
        }
        Ok(Layout {
            sq_entries,
            cq_entries,
        })
    }

    /// Where submission entry `slot` is.
    pub fn sqe_at(&self, slot: u32) -> usize {
        HEADER_LEN + (slot & (self.sq_entries - 1)) as usize * size_of::<Sqe>()
    }

    /// Where completion entry `slot` is.
    pub fn cqe_at(&self, slot: u32) -> usize {
        let cq = HEADER_LEN + self.sq_entries as usize * size_of::<Sqe>();
        cq + (slot & (self.cq_entries - 1)) as usize * size_of::<Cqe>()
    }

    /// The ring memory's length in bytes.
    pub fn bytes(&self) -> usize {
        let end = self.cqe_at(0) + self.cq_entries as usize * size_of::<Cqe>();
        end.div_ceil(PAGE) * PAGE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_have_the_sizes_both_sides_count_on() {
        assert_eq!(size_of::<Sqe>(), 40);
        assert_eq!(size_of::<Cqe>(), 16);
        assert_eq!(align_of::<Sqe>(), 8);
    }

    #[test]
    fn layouts_are_checked_and_slots_stay_inside() {
        assert!(Layout::new(0, 1).is_err());
        assert!(Layout::new(3, 4).is_err());
        assert!(
            Layout::new(8, 4).is_err(),
            "fewer completions than submissions"
        );
        assert!(Layout::new(MAX_ENTRIES * 2, MAX_ENTRIES * 2).is_err());
        let l = Layout::new(8, 16).unwrap();
        assert_eq!(l.sqe_at(0), HEADER_LEN);
        assert_eq!(l.sqe_at(8), l.sqe_at(0), "counters wrap onto slots");
        assert_eq!(l.cqe_at(0), HEADER_LEN + 8 * 40);
        assert!(l.cqe_at(u32::MAX) + 16 <= l.bytes());
        assert!(l.sqe_at(u32::MAX) + 40 <= l.cqe_at(0));
        assert_eq!(l.bytes() % 4096, 0);
        let big = Layout::new(MAX_ENTRIES, MAX_ENTRIES).unwrap();
        assert!(big.cqe_at(u32::MAX) + 16 <= big.bytes());
    }
}
