//! How much of a chunk a copy holds: spans sized to what is written, so that a small file costs
//! pages, not a chunk. A span starts and ends on a page; a new one takes what is asked with room
//! to grow (the next power of two, at least [`FIRST_SPAN`]); one that must grow at least
//! doubles, so that a file written a little at a time grows a few times per chunk, not once
//! per write. From half a chunk on a span takes the whole chunk. What is past the end of file goes
//! back at the last close, but for a tenth of the file's size ([`trimmed`]): a file appended to
//! again after each close (a log) does not move at every append.

use crate::alloc::PAGE;

/// How much room to grow a span gets.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Room {
    /// Room for the next few writes (powers of two, doubling).
    ToGrow,
    /// The pages of the bytes asked for, no more.
    Tight,
}

/// The least span handed out for new bytes: room for a small file's next few writes.
pub const FIRST_SPAN: u64 = 16 * 1024;

/// The span (`lo`, `len`) that chunk bytes `a..b` need, given the span the chunk has (`have`,
/// none for a hole); None if it holds them already. `Room::Tight` asks for the pages of the
/// bytes alone: what a nearly full pool may still have when the room to grow does not fit.
pub fn wanted(
    have: Option<(u32, u32)>,
    a: u64,
    b: u64,
    chunk: u64,
    room: Room,
) -> Option<(u32, u32)> {
    debug_assert!(a < b && b <= chunk);
    let tight = room == Room::Tight;
    let (lo, hi) = match have {
        Some((lo, len)) if lo as u64 <= a && b <= lo as u64 + len as u64 => return None,
        Some((lo, len)) => {
            let (lo, hi) = (lo as u64, lo as u64 + len as u64);
            let (new_lo, new_hi) = (lo.min(a / PAGE * PAGE), hi.max(b.next_multiple_of(PAGE)));
            let doubled = match tight {
                true => new_hi - new_lo,
                false => (new_hi - new_lo).max(2 * (hi - lo)),
            };
            (new_lo, (new_lo + doubled).min(chunk))
        }
        None => {
            let lo = a / PAGE * PAGE;
            let len = match tight {
                true => b.next_multiple_of(PAGE) - lo,
                false => (b - lo).next_power_of_two().max(FIRST_SPAN),
            };
            (lo, (lo + len).min(chunk))
        }
    };
    match hi - lo >= chunk / 2 {
        true => Some((0, chunk as u32)),
        false => Some((lo as u32, (hi - lo) as u32)),
    }
}

/// The span a copy keeps of `(lo, len)` when the file, `size` bytes long, ends at byte `end` of
/// the chunk: the pages up to the end stay, and up to a tenth of the size past it (at most
/// 1.1 times the size in all, or its last page), the rest goes back. None if it keeps all of it, `Some(0)` length if nothing.
pub fn trimmed((lo, len): (u32, u32), end: u64, size: u64) -> Option<(u32, u32)> {
    // At most a tenth over the size (and never short of the last page).
    let keep_end = end
        .next_multiple_of(PAGE)
        .max((end + size / 10) / PAGE * PAGE);
    let keep = keep_end.saturating_sub(lo as u64);
    (keep < len as u64).then_some((lo, keep as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: u64 = 1 << 20;

    #[test]
    fn a_small_write_gets_a_small_span_with_room() {
        assert_eq!(wanted(None, 0, 100, CHUNK, Room::ToGrow), Some((0, 16384)));
        assert_eq!(
            wanted(None, 0, 110_000, CHUNK, Room::ToGrow),
            Some((0, 131072))
        );
        assert_eq!(
            wanted(None, 500_000, 504_096, CHUNK, Room::ToGrow),
            Some((499_712, 16384)),
            "a sparse write: pages around it"
        );
        assert_eq!(
            wanted(None, 0, 600_000, CHUNK, Room::ToGrow),
            Some((0, CHUNK as u32))
        );
        assert_eq!(
            wanted(None, CHUNK - 100, CHUNK, CHUNK, Room::ToGrow),
            Some((CHUNK as u32 - 4096, 4096)),
            "never past the chunk"
        );
    }

    #[test]
    fn a_tight_span_takes_the_pages_of_the_bytes_alone() {
        let tight = |have, a, b| wanted(have, a, b, CHUNK, Room::Tight);
        assert_eq!(tight(None, 0, 100), Some((0, 4096)));
        assert_eq!(tight(None, 5000, 9000), Some((4096, 8192)));
        assert_eq!(
            tight(Some((0, 4096)), 4096, 5000),
            Some((0, 8192)),
            "not doubled"
        );
        assert_eq!(
            tight(None, 0, 600_000),
            Some((0, CHUNK as u32)),
            "still whole"
        );
    }

    #[test]
    fn spans_hold_what_they_cover_and_at_least_double_to_grow() {
        assert_eq!(
            wanted(Some((0, 16384)), 4096, 16384, CHUNK, Room::ToGrow),
            None
        );
        assert_eq!(
            wanted(Some((0, 16384)), 16384, 20480, CHUNK, Room::ToGrow),
            Some((0, 32768)),
            "doubled"
        );
        assert_eq!(
            wanted(Some((65536, 16384)), 0, 100, CHUNK, Room::ToGrow),
            Some((0, 81920)),
            "down to the write"
        );
        assert_eq!(
            wanted(Some((0, 262144)), 262144, 266240, CHUNK, Room::ToGrow),
            Some((0, CHUNK as u32)),
            "past half a chunk: the whole chunk"
        );
    }

    #[test]
    fn trimming_keeps_the_pages_up_to_the_end_of_file() {
        assert_eq!(trimmed((0, 16384), 100, 100), Some((0, 4096)));
        assert_eq!(trimmed((0, 16384), 16384, 16384), None);
        assert_eq!(
            trimmed((8192, 16384), 4096, 4096),
            Some((8192, 0)),
            "all past the end"
        );
        assert_eq!(
            trimmed((0, CHUNK as u32), 300_000, 300_000),
            Some((0, 327_680)),
            "a tenth of the size stays for appends"
        );
        assert_eq!(
            trimmed((0, CHUNK as u32), 300_000, 20 << 20),
            None,
            "a large file's last chunk stays whole"
        );
    }
}
