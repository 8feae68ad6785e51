//! Operations on byte ranges that move no data through FUSE: `copy_file_range` (one-sided
//! READ of the source's chunks into a buffer here, one-sided WRITE of it into the
//! destination's), `fallocate` (chunks allocated by the metadata node, zeros written
//! straight into the chunks), and lseek's SEEK_DATA and SEEK_HOLE (from the chunk map).

use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};

use rfs_proto::message::ChunkMap;
use rfs_proto::types::{Ino, Replicas};
use rfs_proto::wire::MAX_LIST;
use rfs_proto::{Errno, MetadataChannel};

use super::chunks::ChunkCache;
use super::{Backend, ClientStats, Error, Result, Rfs, STATS_INO};

/// The most a copy or a zeroing moves per transfer: the largest FUSE write, so each piece
/// takes the data path's usual shape.
const PIECE: u64 = 1 << 20;
/// Chunks allocated per metadata call.
const ALLOCATE_BATCH: u64 = 64;
/// The most one copy_file_range answers (its reply counts bytes in 32 bits).
const MAX_COPY: u64 = u32::MAX as u64 & !(PIECE - 1);

impl<B: Backend> Rfs<B> {
    /// Copies up to `len` bytes of `src` from `from` into `dst` at `to`, piece by piece:
    /// each read by one-sided READ and written by one-sided WRITE, so the bytes never cross
    /// FUSE. Returns how many were copied: fewer at the end of `src`. (The kernel refuses
    /// overlapping ranges of one file before asking.)
    pub fn copy_range(
        self: &Arc<Self>,
        src: Ino,
        from: u64,
        dst: Ino,
        to: u64,
        len: u64,
    ) -> Result<u64> {
        if src == STATS_INO || dst == STATS_INO {
            return Err(Errno::EACCES.into());
        }
        let len = len.min(MAX_COPY);
        let end = from.checked_add(len).ok_or(Errno::EINVAL)?;
        to.checked_add(len).ok_or(Errno::EFBIG)?;
        let mut copied = 0;
        while copied < len {
            let want = (len - copied).min(PIECE) as usize;
            let data = self.read_now(src, from + copied, want).inspect_err(|_| {
                if copied > 0 {
                    // The pieces copied so far are in `dst`: its pages are stale.
                    self.pages_left_stale(dst);
                }
            })?;
            if data.is_empty() {
                break;
            }
            self.write_now(dst, to + copied, &data)
                .inspect_err(|_| self.pages_left_stale(dst))?;
            copied += data.len() as u64;
            ClientStats::add(&self.stats.bytes_copied, data.len() as u64);
            if from + copied >= end || data.len() < want {
                break;
            }
        }
        Ok(copied)
    }

    /// fallocate: mode 0 allocates the range's chunks and extends the file to its end;
    /// `KEEP_SIZE` allocates without extending; `PUNCH_HOLE | KEEP_SIZE` turns the range into
    /// zeros (its holes stay holes); `ZERO_RANGE` (with or without `KEEP_SIZE`) turns it into
    /// zeros and allocates it. Other modes (collapse, insert, unshare) are not supported.
    pub fn fallocate(self: &Arc<Self>, ino: Ino, offset: u64, len: u64, mode: i32) -> Result<()> {
        if ino == STATS_INO {
            return Err(Errno::EACCES.into());
        }
        let end = offset.checked_add(len).ok_or(Errno::EFBIG)?;
        if len == 0 {
            return Err(Errno::EINVAL.into());
        }
        let keep_size = mode & FALLOC_FL_KEEP_SIZE != 0;
        let size = self.size_for_read(ino)?;
        match mode & !FALLOC_FL_KEEP_SIZE {
            0 => self.allocate_range(ino, offset, end)?,
            FALLOC_FL_PUNCH_HOLE if keep_size => {
                self.zero_range(ino, offset, end.min(size), false)
                    .inspect_err(|_| self.pages_left_stale(ino))?;
            }
            FALLOC_FL_PUNCH_HOLE => return Err(Errno::EINVAL.into()),
            FALLOC_FL_ZERO_RANGE => {
                // Bytes past the end are zeros already (truncation zeroes what it cuts);
                // they only need chunks, allocated first: a fallocate that fails for
                // space changes no byte.
                if end > size {
                    self.allocate_range(ino, offset.max(size), end)?;
                }
                self.zero_range(ino, offset, end.min(size), true)
                    .inspect_err(|_| self.pages_left_stale(ino))?;
            }
            _ => return Err(Errno::ENOTSUP.into()),
        }
        if !keep_size && end > size {
            self.wrote(ino, end, 0);
        }
        Ok(())
    }

    /// Has the metadata node allocate every chunk of `[from, end)` that is not yet.
    fn allocate_range(&self, ino: Ino, from: u64, end: u64) -> Result<()> {
        let last = (end - 1) / self.chunk_size;
        let mut index = from / self.chunk_size;
        while index <= last {
            let count = (last + 1 - index).min(ALLOCATE_BATCH);
            let bytes = (
                from.max(index * self.chunk_size),
                end.min((index + count) * self.chunk_size),
            );
            let (_, hold) = self.refs(ino, index, count, Some(bytes))?;
            drop(hold);
            index += count;
        }
        Ok(())
    }

    /// Writes zeros over `[from, end)`; where no chunk is allocated, only if `fill_holes`
    /// (the range is allocated then).
    fn zero_range(self: &Arc<Self>, ino: Ino, from: u64, end: u64, fill_holes: bool) -> Result<()> {
        if from >= end {
            return Ok(());
        }
        let (first, last) = (from / self.chunk_size, (end - 1) / self.chunk_size);
        // Filling holes goes through every chunk of the range, one by one (a vast one runs
        // out of space on the way): never a list of them. Otherwise only what the copies'
        // spans hold is written (the rest of a chunk is a hole).
        let whole = (0, self.chunk_size);
        let chunks: Box<dyn Iterator<Item = (u64, (u64, u64))>> = if fill_holes {
            Box::new((first..=last).map(|i| (i, whole)))
        } else {
            Box::new(self.allocated_chunks(ino, first, last)?.into_iter())
        };
        let zeros = vec![0u8; PIECE as usize];
        for (index, (lo, hi)) in chunks {
            let chunk = index * self.chunk_size;
            let (mut at, chunk_end) = (from.max(chunk + lo), end.min(chunk + hi));
            while at < chunk_end {
                let piece_end = chunk_end.min(at + PIECE);
                self.write_now(ino, at, &zeros[..(piece_end - at) as usize])?;
                at = piece_end;
            }
        }
        Ok(())
    }

    /// lseek's SEEK_DATA (`data`) or SEEK_HOLE: the first offset at or after `offset` in data
    /// or in a hole, at chunk granularity (a chunk is data once allocated; the end of the file
    /// is a hole). ENXIO at or past the end of the file, and for SEEK_DATA when only holes
    /// follow. Our writes not yet committed count: their chunks are allocated before they are
    /// answered, and the size is ours.
    pub fn seek(&self, ino: Ino, offset: u64, data: bool) -> Result<u64> {
        if ino == super::STATS_INO {
            // The counters as they are now: one reading answers both questions.
            let size = self.stats_attr().size;
            return match (offset < size, data) {
                (false, _) => Err(Errno::ENXIO.into()),
                (true, true) => Ok(offset),
                (true, false) => Ok(size),
            };
        }
        let size = self.size_for_read(ino)?;
        if offset >= size {
            return Err(Errno::ENXIO.into());
        }
        let chunk = self.chunk_size;
        let (first, last) = (offset / chunk, (size - 1) / chunk);
        let at_or_after = |index: u64| (index * chunk).max(offset);
        let mut at = first;
        while at <= last {
            let (count, page) = self.map_page(ino, at, last)?;
            if data {
                if let Some(&(index, _)) = page.first() {
                    return Ok(at_or_after(index));
                }
            } else {
                // The first index the page skips is a hole.
                for &(index, _) in &page {
                    if index != at {
                        return Ok(at_or_after(at));
                    }
                    at += 1;
                }
                if page.len() >= MAX_LIST as usize {
                    continue;
                }
                return Ok(at_or_after(at).min(size));
            }
            at += count as u64;
        }
        match data {
            true => Err(Errno::ENXIO.into()),
            false => Ok(size),
        }
    }

    /// The first page of `ino`'s chunk map from chunk `at` to `last`: how many chunks it
    /// spans, and the allocated ones in it (at most [`MAX_LIST`], the first ones).
    fn map_page(&self, ino: Ino, at: u64, last: u64) -> Result<(u32, Vec<(u64, Replicas)>)> {
        let count = (last - at).min(u32::MAX as u64 - 1) as u32 + 1;
        let meta = self.meta();
        let page = ChunkCache::while_frozen(ino, || {
            meta.call(ChunkMap {
                ino,
                first: at,
                count,
            })
        })?;
        Ok((count, page.chunks))
    }

    /// `ino`'s chunks in `first..=last` that are allocated, each with its copies' span
    /// (`lo`, `hi`) in it. The node's map
    /// leaves holes out and answers at most [`MAX_LIST`] chunks per call over any span, so a
    /// punch over a sparse exabyte costs calls by the chunks it finds, not by its length
    /// (one chunk at a time, a punch of 4 EiB kept the client and the node busy for years,
    /// and its caller unkillable).
    fn allocated_chunks(&self, ino: Ino, first: u64, last: u64) -> Result<Vec<(u64, (u64, u64))>> {
        let mut found = Vec::new();
        let mut at = first;
        while at <= last {
            let (count, page) = self.map_page(ino, at, last)?;
            let full = page.len() >= MAX_LIST as usize;
            found.extend(page.iter().filter_map(|(index, r)| {
                let c = r.first()?;
                Some((*index, (c.lo as u64, c.hi())))
            }));
            at = match page.last() {
                Some(&(index, _)) if full => index + 1,
                _ => at + count as u64,
            };
        }
        Ok(found)
    }

    /// A read, waited for.
    pub(super) fn read_now(self: &Arc<Self>, ino: Ino, offset: u64, len: usize) -> Result<Vec<u8>> {
        let (tx, rx) = sync_channel(1);
        self.read(
            ino,
            offset,
            len,
            Box::new(move |r: Result<&[u8]>| drop(tx.send(r.map(<[u8]>::to_vec)))),
        );
        rx.recv()
            .unwrap_or_else(|_| Err(Error::new(Errno::EIO, "a read got no answer")))
    }

    /// A write, waited for.
    fn write_now(self: &Arc<Self>, ino: Ino, offset: u64, data: &[u8]) -> Result<()> {
        let (tx, rx) = sync_channel(1);
        self.write(ino, offset, data, Box::new(move |r| drop(tx.send(r))));
        rx.recv()
            .unwrap_or_else(|_| Err(Error::new(Errno::EIO, "a write got no answer")))
            .map(drop)
    }
}
