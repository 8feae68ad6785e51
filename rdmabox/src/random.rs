//! Random numbers from the kernel (getrandom): QP tokens, PSNs, rkeys, authentication nonces.

/// Fills `buf` with random bytes.
pub fn fill(buf: &mut [u8]) {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: getrandom writes at most `len - done` bytes into our buffer.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n > 0 {
            done += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // Not expected on Linux >= 3.17; never hand out predictable bytes silently.
            panic!("getrandom failed: {}", std::io::Error::last_os_error());
        }
    }
}

/// A random 64-bit value, for tokens, keys and PSNs.
pub fn u64() -> u64 {
    let mut b = [0u8; 8];
    fill(&mut b);
    u64::from_le_bytes(b)
}
