//! Encryption of a tcp queue pair's connection: every byte either way goes in AES-256-GCM
//! records, so that someone on the path neither reads file data nor alters a frame unseen.
//!
//! A record is a 4-byte little-endian length (of what follows, the tag included), the sealed
//! bytes and their 16-byte tag; the length is authenticated with them. Each direction has a key
//! of its own and numbers its records from 0 (the nonce): a record dropped, repeated, reordered
//! or moved to the other direction fails to open, and the connection ends. Keys are fresh per
//! connection (derived by whoever authenticated it), so a nonce never repeats under one key.
//!
//! The frame code stays as it is: it reads and writes through [`Opener`] and [`Sealer`] in
//! place of the socket. Plaintext is sealed when it is handed over, so READ data is read from
//! its region when sealed (while the region is registered), as it is when sent in the clear.

use std::io;
use std::os::fd::RawFd;

use aes_gcm::aead::consts::U12;
use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};

/// The most plaintext one record carries.
const MAX_RECORD: usize = 64 << 10;
const LEN: usize = 4;
const TAG: usize = 16;
/// Sealed bytes asked of the socket at a time, at least.
const READ_AHEAD: usize = 16 << 10;

/// The two keys of an encrypted connection, as one side sees them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct WireKeys {
    /// What we seal with (the peer opens with it).
    pub send: [u8; 32],
    /// What we open with (the peer seals with it).
    pub receive: [u8; 32],
}

impl std::fmt::Debug for WireKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WireKeys(..)")
    }
}

fn nonce(seq: u64) -> Nonce<U12> {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_le_bytes());
    Nonce::from(n)
}

/// Seals what we send, record by record.
pub(crate) struct Sealer {
    cipher: Aes256Gcm,
    seq: u64,
}

impl Sealer {
    pub(crate) fn new(keys: &WireKeys) -> Sealer {
        Sealer {
            cipher: Aes256Gcm::new(&keys.send.into()),
            seq: 0,
        }
    }

    /// Appends to `out` the records that carry the bytes `iovs` point at.
    ///
    /// # Safety
    /// Every iovec must describe readable memory, valid for the duration of the call.
    pub(crate) unsafe fn seal(&mut self, iovs: &[libc::iovec], out: &mut Vec<u8>) {
        let total: usize = iovs.iter().map(|v| v.iov_len).sum();
        let records = total.div_ceil(MAX_RECORD).max(1);
        out.reserve(total + records * (LEN + TAG));
        let mut pieces = iovs.iter().filter(|v| v.iov_len > 0).map(|v| {
            // SAFETY: the caller's iovec, valid for reads during the call.
            unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len) }
        });
        let mut current: &[u8] = &[];
        let mut left = total;
        while left > 0 {
            let len = left.min(MAX_RECORD);
            let head = out.len();
            out.extend_from_slice(&((len + TAG) as u32).to_le_bytes());
            let mut want = len;
            while want > 0 {
                if current.is_empty() {
                    current = pieces.next().expect("the iovecs hold `total` bytes");
                }
                let n = current.len().min(want);
                out.extend_from_slice(&current[..n]);
                current = &current[n..];
                want -= n;
            }
            let (header, body) = out[head..].split_at_mut(LEN);
            let tag = self
                .cipher
                .encrypt_in_place_detached(&nonce(self.seq), header, body)
                .expect("AES-GCM seals any record under 64 GiB");
            out.extend_from_slice(&tag);
            self.seq += 1;
            left -= len;
        }
    }
}

/// Opens what we receive: reads records off the socket and hands their plaintext out.
pub(crate) struct Opener {
    cipher: Aes256Gcm,
    seq: u64,
    /// Sealed bytes read and not yet a whole record.
    sealed: Vec<u8>,
    /// An opened record's plaintext, from `at` on not yet handed out.
    plain: Vec<u8>,
    at: usize,
}

impl Opener {
    pub(crate) fn new(keys: &WireKeys) -> Opener {
        Opener {
            cipher: Aes256Gcm::new(&keys.receive.into()),
            seq: 0,
            sealed: Vec::with_capacity(LEN + MAX_RECORD + TAG),
            plain: Vec::new(),
            at: 0,
        }
    }

    /// Whether plaintext, or a whole record, waits here: a reader must not wait on the
    /// socket for it.
    pub(crate) fn has_buffered(&self) -> bool {
        self.at < self.plain.len() || self.record_len().is_some_and(|n| self.sealed.len() >= n)
    }

    /// The whole length of the record whose start is buffered.
    fn record_len(&self) -> Option<usize> {
        let head: [u8; LEN] = self.sealed.get(..LEN)?.try_into().expect("4 bytes");
        Some(LEN + u32::from_le_bytes(head) as usize)
    }

    /// `recv(fd, dst, len, flags)` with the socket's bytes opened: up to `len` bytes of
    /// plaintext (Ok(0) at the end of the stream). Waits for a whole record unless `flags`
    /// says not to (then WouldBlock until one is here). A record that does not open (altered,
    /// replayed, out of order) is an error: the connection is not to be trusted any more.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes for the duration of the call.
    pub(crate) unsafe fn recv(
        &mut self,
        fd: RawFd,
        dst: *mut u8,
        len: usize,
        flags: libc::c_int,
    ) -> io::Result<usize> {
        loop {
            if self.at < self.plain.len() {
                let n = (self.plain.len() - self.at).min(len);
                // SAFETY: source within our buffer; destination valid per the caller.
                unsafe { std::ptr::copy_nonoverlapping(self.plain[self.at..].as_ptr(), dst, n) };
                self.at += n;
                return Ok(n);
            }
            if let Some(whole) = self.record_len() {
                if !(LEN + TAG..=LEN + MAX_RECORD + TAG).contains(&whole) {
                    return Err(broken("a record of impossible length"));
                }
                if self.sealed.len() >= whole {
                    self.open_record(whole)?;
                    continue;
                }
            }
            // Whatever the socket has, up to a record and more: what is beyond this record
            // stays for the next.
            let want = self
                .record_len()
                .map_or(LEN, |n| n.saturating_sub(self.sealed.len()))
                .max(READ_AHEAD);
            let have = self.sealed.len();
            self.sealed.resize(have + want, 0);
            let got = loop {
                // SAFETY: the spare room we just made in `sealed`.
                let n =
                    unsafe { libc::recv(fd, self.sealed[have..].as_mut_ptr().cast(), want, flags) };
                if n >= 0 {
                    break Ok(n as usize);
                }
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    break Err(e);
                }
            };
            self.sealed.truncate(have + *got.as_ref().unwrap_or(&0));
            match got? {
                0 => return Ok(0),
                _ => continue,
            }
        }
    }

    /// Opens the buffered record of `whole` bytes into `plain`.
    fn open_record(&mut self, whole: usize) -> io::Result<()> {
        let (head, rest) = self.sealed.split_at(LEN);
        let (body, tag) = rest[..whole - LEN].split_at(whole - LEN - TAG);
        self.plain.clear();
        self.plain.extend_from_slice(body);
        self.at = 0;
        let tag = Tag::clone_from_slice(tag);
        self.cipher
            .decrypt_in_place_detached(&nonce(self.seq), head, &mut self.plain, &tag)
            .map_err(|_| broken("a record that does not open: altered, replayed or reordered"))?;
        self.seq += 1;
        self.sealed.drain(..whole);
        Ok(())
    }
}

fn broken(why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("encrypted connection: {why}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::tcp::io::iovec;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn keys() -> (WireKeys, WireKeys) {
        let a = WireKeys {
            send: [1; 32],
            receive: [2; 32],
        };
        let b = WireKeys {
            send: a.receive,
            receive: a.send,
        };
        (a, b)
    }

    fn read_all(o: &mut Opener, fd: RawFd, n: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        let mut done = 0;
        while done < n {
            // SAFETY: the rest of `out`.
            let got = unsafe { o.recv(fd, out[done..].as_mut_ptr(), n - done, 0)? };
            if got == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            done += got;
        }
        Ok(out)
    }

    /// What goes in comes out, over records of every size; nothing of it is on the wire in
    /// the clear.
    #[test]
    fn sealed_bytes_open_on_the_other_side_and_only_there() {
        let (a, b) = keys();
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let mut sealer = Sealer::new(&a);
        let mut opener = Opener::new(&b);
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8 + 1).collect();
        let mut wire = Vec::new();
        // SAFETY: iovecs over `data`, alive for the call.
        unsafe {
            sealer.seal(
                &[
                    iovec(data.as_ptr(), 10),
                    iovec(data[10..].as_ptr(), data.len() - 10),
                ],
                &mut wire,
            )
        };
        assert!(
            !wire
                .windows(64)
                .any(|w| data.windows(64).take(1000).any(|d| d == w)),
            "plaintext on the wire"
        );
        let writer = std::thread::spawn(move || tx.write_all(&wire).unwrap());
        let got = read_all(&mut opener, rx.as_raw_fd(), data.len()).unwrap();
        writer.join().unwrap();
        assert!(got == data);
    }

    /// A flipped bit, a replayed record and the other direction's key are all refused.
    #[test]
    fn altered_replayed_or_reflected_records_do_not_open() {
        let (a, b) = keys();
        let seal = |k: &WireKeys, n: usize| {
            let mut s = Sealer::new(k);
            let data = [7u8; 100];
            let mut wire = Vec::new();
            for _ in 0..n {
                // SAFETY: one iovec over `data`.
                unsafe { s.seal(&[iovec(data.as_ptr(), data.len())], &mut wire) };
            }
            wire
        };
        let try_open = |wire: Vec<u8>, k: &WireKeys, records: usize| {
            let (mut tx, rx) = UnixStream::pair().unwrap();
            tx.write_all(&wire).unwrap();
            drop(tx);
            let mut o = Opener::new(k);
            read_all(&mut o, rx.as_raw_fd(), 100 * records)
        };
        assert!(try_open(seal(&a, 2), &b, 2).is_ok());
        let mut flipped = seal(&a, 1);
        flipped[30] ^= 1;
        assert!(try_open(flipped, &b, 1).is_err(), "altered");
        let one = seal(&a, 1);
        let replayed = [one.clone(), one].concat();
        assert!(try_open(replayed, &b, 2).is_err(), "replayed");
        assert!(try_open(seal(&b, 1), &b, 1).is_err(), "reflected");
        let mut long = seal(&a, 1);
        long[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(try_open(long, &b, 1).is_err(), "impossible length");
    }
}
