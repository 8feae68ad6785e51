//! Reads into the caller's memory (the ring's path) against the fake: the same bytes as a
//! read that lends them, holes zeroed where they land, nothing past the end of file touched,
//! and the same fail-over and retries.

use rdmabox::transport::{ExternalMemory, Landing};

use super::*;

/// Memory of the caller's, as an application's shared buffer is.
struct Memory {
    bytes: *mut u8,
    len: usize,
}

// SAFETY: reached only through raw pointers (Landing's copies and `Memory::bytes` once the
// reads into it are over).
unsafe impl Send for Memory {}
// SAFETY: as for Send.
unsafe impl Sync for Memory {}

// SAFETY: a leaked boxed slice, freed only in `drop`: it stays put while the object lives.
unsafe impl ExternalMemory for Memory {
    fn as_ptr(&self) -> *mut u8 {
        self.bytes
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: made from a leaked Box<[u8]> of this length in `memory`, freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.bytes, self.len)) });
    }
}

/// `len` bytes of 0xee.
fn memory(len: usize) -> Arc<Memory> {
    let bytes = Box::leak(vec![0xeeu8; len].into_boxed_slice()).as_mut_ptr();
    Arc::new(Memory { bytes, len })
}

impl Memory {
    fn bytes(&self, at: usize, len: usize) -> Vec<u8> {
        assert!(at + len <= self.len);
        // SAFETY: inside the memory; the fake answers in place, so no read into it is on.
        unsafe { std::slice::from_raw_parts(self.bytes.add(at), len).to_vec() }
    }
}

/// Reads `len` bytes at `offset` of `ino` into fresh memory at `at`: (bytes the file had,
/// the whole memory).
fn read_into(
    fs: &Arc<Rfs<Fake>>,
    ino: Ino,
    offset: u64,
    at: usize,
    len: usize,
) -> Result<(usize, Vec<u8>)> {
    let m = memory(at + len + 16);
    let (tx, rx) = mpsc::channel();
    let into = Landing::new(m.clone(), at, len).unwrap();
    fs.read_into(ino, offset, into, Box::new(move |r| tx.send(r).unwrap()));
    let n = rx.recv().unwrap()?;
    Ok((n, m.bytes(0, m.len)))
}

/// Lands `offset, len` at `at` and checks it against a lending read: the file's bytes where
/// they belong, the rest of the memory as it was.
fn lands_as_read(fs: &Arc<Rfs<Fake>>, ino: Ino, offset: u64, len: usize) {
    let want = read(fs, ino, offset, len).unwrap();
    let at = 3;
    let (n, got) = read_into(fs, ino, offset, at, len).unwrap();
    assert_eq!(n, want.len(), "{offset}+{len}");
    assert!(got[at..at + n] == want[..], "{offset}+{len}");
    assert!(
        got[..at].iter().chain(&got[at + n..]).all(|&b| b == 0xee),
        "{offset}+{len}: outside what was read"
    );
}

#[test]
fn reads_into_memory_land_what_a_read_lends_and_zero_the_holes() {
    for cluster in [FakeCluster::on_one_node(), Arc::default()] {
        let fs = client(&cluster);
        let ino = create(&fs, "f");
        let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
        write(&fs, ino, 0, &pattern(2 * CHUNK as usize + 100, 3)).unwrap();
        // Holes: chunks 3 and 4 never written, then a tail.
        write(&fs, ino, 5 * CHUNK + 7, &pattern(CHUNK as usize, 4)).unwrap();
        let size = 6 * CHUNK + 7;
        let c = CHUNK;
        for (offset, len) in [
            (0, 1),
            (0, size as usize),
            (c - 1, 2),
            (c / 2, 3 * c as usize),
            (2 * c, c as usize),
            (3 * c + 5, 2 * c as usize),
            (size - 10, 100),
            (size - 1, 1),
        ] {
            lands_as_read(&fs, ino, offset, len);
        }
        assert_eq!(read_into(&fs, ino, size, 0, 10).unwrap().0, 0);
        assert_eq!(read_into(&fs, ino, size + 5, 0, 10).unwrap().0, 0);
        fs.release(fh).unwrap();
    }
}

#[test]
fn reads_into_memory_fail_over_between_replicas_and_go_again_for_stale_keys() {
    let cluster = FakeCluster::with_replicas(2);
    let fs = client(&cluster);
    let ino = create(&fs, "f");
    let (fh, _) = fs.open(ino, RW, &ROOT_CALLER).unwrap();
    let data = pattern(3 * CHUNK as usize, 1);
    write(&fs, ino, 0, &data).unwrap();
    cluster.fail_node(Some(1));
    for _ in 0..4 {
        let (n, got) = read_into(&fs, ino, 0, 0, data.len()).unwrap();
        assert_eq!(n, data.len());
        assert!(got[..n] == data[..]);
    }
    let stats = fs.stats_text();
    assert!(stats.contains("io_errors 0"), "{stats}");
    assert!(!stats.contains("failovers 0\n"), "{stats}");
    cluster.fail_node(None);
    cluster.revoke_keys();
    let (n, got) = read_into(&fs, ino, 5, 1, data.len() - 5).unwrap();
    assert!(got[1..1 + n] == data[5..]);
    assert!(fs.stats_text().contains("\nretries 1\n"));
    fs.release(fh).unwrap();
}
