//! The handshake, both sides, against a peer that says anything: the node must never let a
//! peer that does not know the secret through, and neither side may panic.
#![no_main]

use std::io::{self, Read, Write};

use libfuzzer_sys::fuzz_target;
use rfs_proto::handshake::{accept_over, connect_over};
use rfs_proto::hello::Hello;

/// A peer whose every byte comes from the fuzzer; what we send is swallowed.
struct Scripted<'a>(&'a [u8]);

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    // The nonce is random, so a scripted answer can only pass by forging a MAC.
    let mut peer = Scripted(data);
    assert!(accept_over(&mut peer, Some(b"secret"), false).is_err());
    let mut peer = Scripted(data);
    if accept_over(&mut peer, None, false).is_ok() {
        let _ = Hello::receive(&mut peer, None);
    }
    let _ = connect_over(&mut Scripted(data), Some(b"secret"));
    let _ = connect_over(&mut Scripted(data), None);
});
