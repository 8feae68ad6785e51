//! The fake against the real metadata service: one script of calls goes through both and must
//! get the same answers wherever the fake models the service (names a create made, handles,
//! commits and cuts, allocation and chunk maps, replicas a write missed, locks), so that the
//! fake these tests run the file system on cannot drift from what the service does.

use std::fmt::Debug;
use std::time::Duration;

use mem_server::in_process::InProcessService;
use rfs_proto::message::{
    Allocate, ChunkMap, Commit, Committed, Create, DropLocks, DropReplicas, GetAttr, GetLock,
    GetStatFs, Lookup, Open, Opened, Release, ReleaseMany, SetAttr, SetLock,
};
use rfs_proto::{CallError, MetadataChannel};

use super::*;
use rfs_proto::types::ChunkRef;

/// What a call answered, as both sides can be compared: the errno, or what the script looks at.
fn said<T: Debug>(r: std::result::Result<T, CallError>, shown: impl FnOnce(T) -> String) -> String {
    match r {
        Ok(v) => shown(v),
        Err(CallError::Remote(e)) => format!("{e:?}"),
        Err(e) => format!("failed: {e}"),
    }
}

fn attr(a: Attr) -> String {
    format!(
        "{:?} size {} nlink {} perm {:o} cuts {}",
        a.kind, a.size, a.nlink, a.perm, a.cuts
    )
}

fn indices(map: rfs_proto::types::FileMap) -> String {
    let shown: Vec<_> = map
        .chunks
        .iter()
        .map(|(i, r)| format!("{i}x{}", r.len()))
        .collect();
    format!("{} (cuts {})", shown.join(" "), map.cuts)
}

fn committed(c: Committed) -> String {
    format!("{} -> {}", c.before.size, c.after.size)
}

fn lock(kind: LockKind) -> FileLock {
    FileLock {
        start: 0,
        end: TO_END,
        kind,
        pid: 1,
    }
}

fn set_lock(ino: Ino, owner: u64, kind: LockKind) -> SetLock {
    SetLock {
        ino,
        owner,
        lock: lock(kind),
        wait: false,
        reclaim: false,
    }
}

/// The script, through `ch`: a line per call.
fn script(ch: &impl MetadataChannel) -> Vec<String> {
    let mut out = Vec::new();
    let create = || Create {
        parent: ROOT,
        name: "f".into(),
        owner: OWNER,
        access: RW,
        caller: ROOT_CALLER,
    };
    let made = ch.call(create()).unwrap().attr;
    let ino = made.ino;
    out.push(format!("create: {}", attr(made)));
    out.push(format!(
        "create again: {}",
        said(ch.call(create()), |m| attr(m.attr))
    ));
    let lookup = |name: &str| Lookup {
        parent: ROOT,
        name: name.into(),
        caller: ROOT_CALLER,
    };
    out.push(format!("lookup: {}", said(ch.call(lookup("f")), attr)));
    out.push(format!(
        "lookup missing: {}",
        said(ch.call(lookup("g")), attr)
    ));
    out.push(format!("getattr: {}", said(ch.call(GetAttr { ino }), attr)));
    let statfs = ch.call(GetStatFs {}).unwrap();
    out.push(format!("chunk size: {}", statfs.chunk_size));

    let allocate = Allocate {
        ino,
        offset: 0,
        end: 3 * statfs.chunk_size,
    };
    out.push(format!("allocate: {}", said(ch.call(allocate), indices)));
    let map = || ChunkMap {
        ino,
        first: 0,
        count: 8,
    };
    out.push(format!("map: {}", said(ch.call(map()), indices)));
    let commit = |size, cuts| Commit {
        ino,
        size,
        mtime: None,
        cuts,
    };
    out.push(format!(
        "commit 10: {}",
        said(ch.call(commit(10, 0)), committed)
    ));
    out.push(format!(
        "commit 5: {}",
        said(ch.call(commit(5, 0)), committed)
    ));
    let cut = SetAttr {
        ino,
        changes: AttrChanges {
            size: Some(3),
            ..AttrChanges::default()
        },
        caller: ROOT_CALLER,
    };
    out.push(format!("cut to 3: {}", said(ch.call(cut), attr)));
    out.push(format!(
        "map after the cut: {}",
        said(ch.call(map()), indices)
    ));
    out.push(format!(
        "commit before the cut: {}",
        said(ch.call(commit(10, 0)), committed)
    ));
    out.push(format!(
        "commit after the cut: {}",
        said(ch.call(commit(10, 1)), committed)
    ));

    let copy = ch.call(map()).unwrap().chunks[0].1[0];
    let drop_replicas = |index, reached: Vec<ChunkRef>| DropReplicas {
        ino,
        index,
        reached,
    };
    out.push(format!(
        "drop all copies: {}",
        said(ch.call(drop_replicas(0, vec![])), |n| n.to_string())
    ));
    out.push(format!(
        "drop none: {}",
        said(ch.call(drop_replicas(0, vec![copy])), |n| n.to_string())
    ));
    out.push(format!(
        "drop of a hole: {}",
        said(ch.call(drop_replicas(7, vec![copy])), |n| n.to_string())
    ));

    let conflict = |l: Option<FileLock>| format!("{:?}", l.map(|l| (l.start, l.kind)));
    out.push(format!(
        "lock: {}",
        said(ch.call(set_lock(ino, 1, LockKind::Write)), conflict)
    ));
    out.push(format!(
        "lock, another owner: {}",
        said(ch.call(set_lock(ino, 2, LockKind::Write)), conflict)
    ));
    let probe = GetLock {
        ino,
        owner: 2,
        lock: lock(LockKind::Read),
    };
    out.push(format!("probe: {}", said(ch.call(probe), conflict)));
    out.push(format!(
        "drop locks: {}",
        said(ch.call(DropLocks { ino, owner: 1 }), |()| "ok".into())
    ));
    out.push(format!(
        "lock again: {}",
        said(ch.call(set_lock(ino, 2, LockKind::Read)), conflict)
    ));
    out.push(format!(
        "unlock: {}",
        said(ch.call(set_lock(ino, 2, LockKind::Unlock)), conflict)
    ));

    let release = Release { ino, access: RW };
    out.push(format!(
        "release: {}",
        said(ch.call(release), |()| "ok".into())
    ));
    out.push(format!(
        "commit closed: {}",
        said(ch.call(commit(20, 1)), committed)
    ));
    let open = |ino| Open {
        ino,
        access: RW,
        caller: ROOT_CALLER,
    };
    out.push(format!(
        "open: {}",
        said(ch.call(open(ino)), |o: Opened| attr(o.attr))
    ));
    out.push(format!(
        "open missing: {}",
        said(ch.call(open(ino + 1000)), |o: Opened| attr(o.attr))
    ));
    let many = ReleaseMany {
        handles: vec![(ino, RW)],
    };
    out.push(format!(
        "release many: {}",
        said(ch.call(many), |n| n.to_string())
    ));
    out
}

#[test]
fn the_fake_answers_a_script_of_calls_as_the_real_service_does() {
    let real = InProcessService::new(CHUNK, 64, Duration::from_secs(10)).unwrap();
    let fake = Fake(Arc::default());
    let (theirs, ours) = (script(&real.client(1)), script(&fake));
    for (t, o) in theirs.iter().zip(&ours) {
        assert_eq!(
            o, t,
            "the fake differs from the service (left: fake, right: service)"
        );
    }
    assert_eq!(ours.len(), theirs.len());
}
