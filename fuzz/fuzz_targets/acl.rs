//! The metadata node's reading of a POSIX ACL, which any client that may set one hands it: no
//! input may panic, and what reads as an ACL writes back to the same bytes' ACL, keeps its
//! mode bits within the nine it may have, and answers a permission check and a chmod.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mem_server::acl::Acl;
use rfs_proto::types::{Caller, FileAccess};

fuzz_target!(|data: &[u8]| {
    let Ok(Some(mut acl)) = Acl::parse(data) else {
        return;
    };
    assert_eq!(Acl::parse(&acl.to_bytes()), Ok(Some(acl.clone())));
    assert!(acl.mode_bits() <= 0o777);
    let caller = Caller {
        uid: 1000,
        gid: 1000,
        groups: vec![100, 2000],
    };
    let _ = acl.permits((0, 100), &caller, FileAccess::READ | FileAccess::WRITE);
    let (mode, inherited) = acl.inherit(0o100666);
    assert_eq!(mode & !0o777, 0o100000);
    if let Some(a) = inherited {
        assert_eq!(a.mode_bits(), mode & 0o777);
    }
    acl.chmod(0o754);
    assert_eq!(acl.mode_bits(), 0o754);
});
