//! The frame reader of control connections, and the queue-pair endpoints exchanged over them:
//! any bytes, any length prefix, without a panic or an allocation past the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmabox::transport::Endpoint;
use rfs_proto::frame::recv_frame;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    while let Ok(frame) = recv_frame(&mut input, 4096) {
        assert!(frame.len() <= 4096);
    }
    if let Ok(e) = Endpoint::decode(data) {
        assert_eq!(Endpoint::decode(&e.encode()).ok(), Some(e));
    }
});
