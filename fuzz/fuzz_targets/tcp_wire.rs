//! The tcp provider's packet headers, as the engine reads them from a peer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmabox::transport::tcp::wire::{Header, NakReason, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    for chunk in data.chunks_exact(HEADER_LEN) {
        let b: &[u8; HEADER_LEN] = chunk.try_into().unwrap();
        if let Ok(h) = Header::decode(b) {
            assert_eq!(Header::decode(&h.encode()).ok(), Some(h));
            let _ = h.kind.carries_payload();
        }
    }
    if data.len() >= 4 {
        let _ = NakReason::from_u32(u32::from_le_bytes(data[..4].try_into().unwrap()));
    }
});
