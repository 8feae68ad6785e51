//! Every decoder of what a peer sends on the metadata channel and the control connection: a
//! request, a reply to any op, a callback, a hello, a pool descriptor, a grant link request
//! and its answer. None may panic; what decodes must encode back to what decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rfs_proto::callback::{is_ack, Callback};
use rfs_proto::grant::{GrantChunks, GrantRequest};
use rfs_proto::hello::{Hello, PoolDescriptor};
use rfs_proto::message::{decode_reply, unseal, Request};
use rfs_proto::message::{
    Allocate, ChunkMap, Create, GetAttr, GetStatFs, GetXattr, ListNodes, ListXattr, Lookup, Open,
    ReadDir, Readlink,
};

fuzz_target!(|data: &[u8]| {
    let call = unseal(data).map_or(data, |(_, call)| call);
    if let Ok(r) = Request::decode(call) {
        assert_eq!(Request::decode(&r.encode()).ok(), Some(r));
    }
    let _ = decode_reply::<Lookup>(data);
    let _ = decode_reply::<GetAttr>(data);
    let _ = decode_reply::<Readlink>(data);
    let _ = decode_reply::<ReadDir>(data);
    let _ = decode_reply::<Open>(data);
    let _ = decode_reply::<Create>(data);
    let _ = decode_reply::<ChunkMap>(data);
    let _ = decode_reply::<Allocate>(data);
    let _ = decode_reply::<GetStatFs>(data);
    let _ = decode_reply::<ListNodes>(data);
    let _ = decode_reply::<GetXattr>(data);
    let _ = decode_reply::<ListXattr>(data);
    if let Ok(cb) = Callback::decode(data) {
        assert_eq!(Callback::decode(&cb.encode()).ok().as_ref(), Some(&cb));
        for part in cb.split() {
            let _ = part.encode();
        }
    }
    let _ = is_ack(data);
    if let Ok(h) = Hello::parse(data) {
        assert_eq!(Hello::parse(&h.encode()).ok(), Some(h));
    }
    let _ = PoolDescriptor::decode(data);
    if let Ok(l) = GrantRequest::decode(data) {
        assert_eq!(GrantRequest::decode(&l.encode()).ok().as_ref(), Some(&l));
        let _ = l.decode_answer(data);
    }
    let grant = GrantRequest::from(GrantChunks {
        session: 1,
        seq: 0,
        writable: false,
        extents: vec![],
    });
    let _ = grant.decode_answer(data);
});
