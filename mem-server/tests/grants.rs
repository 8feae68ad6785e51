//! Data nodes enforce grants: a client's data session reaches only the chunks of files its
//! metadata session opened, for the access it opened them with, and only while they are
//! open and part of the file. Over a metadata node's own pool and a joined node's.

use std::time::{Duration, Instant};

use rdmabox::transport::{RemoteAddr, WcStatus};
use rdmabox::IoError;
use rfs_client::Client;
use rfs_e2e::{client, MemServer};
use rfs_proto::message::{
    Allocate, AttachData, ChunkMap, Create, ListNodes, Open, Release, ReleaseMany, SetAttr,
};
use rfs_proto::types::{AttrChanges, Caller, ChunkRef, FileAccess, Owner, ROOT};
use rfs_proto::MetadataChannel;

const RW: FileAccess = FileAccess::READ.union(FileAccess::WRITE);
const CHUNK: u64 = 1 << 20;

fn owner() -> Caller {
    Caller {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    }
}

/// A metadata node and a data node, both lending 4 chunks.
fn cluster() -> (MemServer, MemServer) {
    let meta = MemServer::start(&["--memory", "4M", "--lease", "1"]);
    let m = meta.addr.to_string();
    let data = MemServer::start(&["--memory", "4M", "--join", &m]);
    let c = client(&meta);
    let start = Instant::now();
    while c.call(ListNodes {}).unwrap().len() < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "data node never joined"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (meta, data)
}

/// Connects and attaches a data session to every live node, so that maps come granted.
fn attach_all(c: &Client) {
    for n in c
        .call(ListNodes {})
        .unwrap()
        .into_iter()
        .filter(|n| n.alive)
    {
        c.data(n.id).unwrap();
    }
}

/// A file of `chunks` chunks (spread over both nodes) made by uid 1000, mode 0644, each chunk
/// filled with its index + 1; the creator's handle stays open.
fn file(c: &Client, name: &str, chunks: u32) -> (u64, Vec<ChunkRef>) {
    let ino = c
        .call(Create {
            parent: ROOT,
            name: name.into(),
            owner: Owner {
                perm: 0o644,
                uid: 1000,
                gid: 1000,
                umask: 0,
            },
            access: RW,
            caller: Caller::default(),
        })
        .unwrap()
        .attr
        .ino;
    attach_all(c);
    let map = c
        .call(Allocate {
            ino,
            offset: 0,
            end: chunks as u64 * CHUNK,
        })
        .unwrap();
    let map: Vec<(u64, ChunkRef)> = map.chunks.into_iter().map(|(i, r)| (i, r[0])).collect();
    for (i, ch) in &map {
        assert_ne!(ch.rkey, 0, "granted to an attached session");
        write(c, ch, ch.rkey, vec![*i as u8 + 1; 4096]).unwrap();
    }
    (ino, map.into_iter().map(|(_, c)| c).collect())
}

/// Opens `ino` for reading, as its owner.
fn open_for_reading(c: &Client, ino: u64) {
    c.call(Open {
        ino,
        access: FileAccess::READ,
        caller: owner(),
    })
    .unwrap();
}

fn map(c: &Client, ino: u64) -> Vec<ChunkRef> {
    attach_all(c);
    let m = c
        .call(ChunkMap {
            ino,
            first: 0,
            count: 16,
        })
        .unwrap();
    m.chunks.into_iter().map(|(_, r)| r[0]).collect()
}

/// 4 KiB at the start of `chunk` through `c`'s data session, with remote key `rkey`.
fn read(c: &Client, chunk: &ChunkRef, rkey: u32) -> Result<Vec<u8>, IoError> {
    let d = c.data(chunk.node).unwrap();
    let at = RemoteAddr {
        addr: chunk.addr,
        rkey,
    };
    d.session.read_pending(at, vec![0; 4096]).wait()
}

fn write(c: &Client, chunk: &ChunkRef, rkey: u32, data: Vec<u8>) -> Result<Vec<u8>, IoError> {
    let d = c.data(chunk.node).unwrap();
    let at = RemoteAddr {
        addr: chunk.addr,
        rkey,
    };
    d.session.write_pending(at, data).wait()
}

const REFUSED: Result<Vec<u8>, IoError> = Err(IoError::Transport(WcStatus::RemoteAccessError));

/// Revocations at close (and on re-attaching) do not hold up the call that caused them: they
/// reach the data node right after it. Tries `access` until it is refused, for up to 2 s.
fn refused_soon(mut access: impl FnMut() -> Result<Vec<u8>, IoError>, what: &str) {
    let start = Instant::now();
    loop {
        match access() {
            Ok(_) if start.elapsed() < Duration::from_secs(2) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            other => return assert_eq!(other, REFUSED, "{what}"),
        }
    }
}

#[test]
fn a_client_reaches_no_chunk_of_a_file_it_did_not_open() {
    let (meta, _data) = cluster();
    let victim = client(&meta);
    let (_, secret) = file(&victim, "secret", 4);
    let thief = client(&meta);
    let (own, _) = file(&thief, "own", 2);
    // A refused access ends the data session it was made on (as on RC queue pairs): each
    // attempt below starts on a fresh one, with fresh grants of the thief's own file.
    for (i, ch) in secret.iter().enumerate() {
        // A key the thief was granted, for another chunk of the same node, reaches only it.
        let mine = map(&thief, own);
        let mine = mine.iter().find(|o| o.node == ch.node).expect("both nodes");
        assert!(read(&thief, mine, mine.rkey).is_ok());
        assert_eq!(read(&thief, ch, mine.rkey), REFUSED, "chunk {i}, own key");
        // The victim's key does not work on another session: each has its own domain.
        assert_eq!(read(&thief, ch, ch.rkey), REFUSED, "chunk {i}, stolen key");
        assert_eq!(
            write(&thief, ch, ch.rkey, vec![0; 4096]),
            REFUSED,
            "chunk {i}, stolen key"
        );
    }
    // Untouched, and still the victim's to read.
    for (i, ch) in secret.iter().enumerate() {
        assert_eq!(read(&victim, ch, ch.rkey).unwrap(), vec![i as u8 + 1; 4096]);
    }
}

#[test]
fn grants_follow_the_handle_and_end_with_close_and_truncate() {
    let (meta, _data) = cluster();
    let writer = client(&meta);
    let (ino, chunks) = file(&writer, "f", 2);
    let reader = client(&meta);
    open_for_reading(&reader, ino);
    for (i, want) in chunks.iter().enumerate() {
        let ch = map(&reader, ino)[i];
        assert_eq!((ch.node, ch.addr), (want.node, want.addr));
        assert_eq!(
            read(&reader, &ch, ch.rkey).unwrap(),
            vec![i as u8 + 1; 4096]
        );
        // Opened for reading: granted for reading.
        assert_eq!(write(&reader, &ch, ch.rkey, vec![0; 4096]), REFUSED);
    }
    let granted = map(&reader, ino);
    for ch in &granted {
        assert!(read(&reader, ch, ch.rkey).is_ok());
    }
    // Closed: out of reach.
    reader
        .call(Release {
            ino,
            access: FileAccess::READ,
        })
        .unwrap();
    for ch in &granted {
        refused_soon(|| read(&reader, ch, ch.rkey), "after close");
    }
    // Opened again, then the file is cut under it: the cut chunks are out of reach.
    open_for_reading(&reader, ino);
    let again = map(&reader, ino);
    assert_eq!(read(&reader, &again[1], again[1].rkey).unwrap()[0], 2);
    // Another reader holds a grant on the chunk about to be cut, and does not touch it until
    // the chunk belongs to another file.
    let late = client(&meta);
    open_for_reading(&late, ino);
    let held = map(&late, ino);
    writer
        .call(SetAttr {
            ino,
            changes: AttrChanges {
                size: Some(CHUNK),
                ..AttrChanges::default()
            },
            caller: owner(),
        })
        .unwrap();
    assert_eq!(
        read(&reader, &again[0], again[0].rkey).unwrap()[0],
        1,
        "kept"
    );
    assert_eq!(read(&reader, &again[1], again[1].rkey), REFUSED, "cut off");
    // Every free chunk (the cut one among them, once zeroed) goes to another file.
    let (_, next) = file(&writer, "g", 7);
    assert!(
        next.iter()
            .any(|c| (c.node, c.addr) == (held[1].node, held[1].addr)),
        "the cut chunk was reused"
    );
    assert_eq!(
        read(&late, &held[0], held[0].rkey).unwrap()[0],
        1,
        "session alive"
    );
    assert_eq!(read(&late, &held[1], held[1].rkey), REFUSED, "reused");
}

#[test]
fn a_data_node_that_loses_its_metadata_node_keeps_no_grants() {
    let (mut meta, _data) = cluster();
    let c = client(&meta);
    let (_, chunks) = file(&c, "f", 2);
    let remote = *chunks
        .iter()
        .find(|ch| ch.node != 0)
        .expect("one on the data node");
    assert_eq!(read(&c, &remote, remote.rkey).unwrap()[0], 1);
    // Nobody could revoke its grants any more: they go with the link.
    meta.kill();
    let start = Instant::now();
    let d = c.connected(remote.node).expect("the data session lives on");
    loop {
        let at = RemoteAddr {
            addr: remote.addr,
            rkey: remote.rkey,
        };
        match d.session.read_pending(at, vec![0; 4096]).wait() {
            Ok(_) => assert!(
                start.elapsed() < Duration::from_secs(10),
                "still granted 10 s after the metadata node died"
            ),
            Err(e) => {
                assert_eq!(e, IoError::Transport(WcStatus::RemoteAccessError));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_write_grant_ends_with_the_last_writable_handle() {
    let (meta, _data) = cluster();
    let c = client(&meta);
    let (ino, _) = file(&c, "f", 1);
    open_for_reading(&c, ino);
    let writable = map(&c, ino)[0];
    assert!(write(&c, &writable, writable.rkey, vec![9; 4096]).is_ok());
    c.call(Release { ino, access: RW }).unwrap();
    // Still open for reading: reads are granted anew, writes are not.
    let readable = map(&c, ino)[0];
    assert_eq!(read(&c, &readable, readable.rkey).unwrap()[0], 9);
    refused_soon(
        || write(&c, &writable, writable.rkey, vec![0; 4096]),
        "the writable handle is closed",
    );
}

#[test]
fn naming_another_data_session_takes_back_what_the_old_one_was_granted() {
    let (meta, _data) = cluster();
    let c = client(&meta);
    let (ino, chunks) = file(&c, "f", 1);
    let ch = chunks[0];
    assert!(read(&c, &ch, ch.rkey).is_ok());
    // Grants follow the attached name; a client that points it elsewhere (to escape the
    // revocation at close) loses what its old session had at once.
    c.call(AttachData {
        node: ch.node,
        session: 12345,
    })
    .unwrap();
    let d = c.connected(ch.node).expect("still connected");
    let at = RemoteAddr {
        addr: ch.addr,
        rkey: ch.rkey,
    };
    refused_soon(
        || d.session.read_pending(at, vec![0; 4096]).wait(),
        "the old name's grants",
    );
    assert!(
        c.call(AttachData {
            node: 999,
            session: 1
        })
        .is_err(),
        "no such node"
    );
    // The honest path still works: attach again and ask again.
    assert_eq!(
        read(&c, &map(&c, ino)[0], map(&c, ino)[0].rkey).unwrap()[0],
        1
    );
}

#[test]
fn closes_sent_together_each_take_back_what_a_lone_close_would() {
    let (meta, _data) = cluster();
    let c = client(&meta);
    // a: open for writing (its creation) and for reading; b: open for writing only.
    let (a, _) = file(&c, "a", 1);
    let (b, _) = file(&c, "b", 1);
    open_for_reading(&c, a);
    let a_chunk = map(&c, a)[0];
    let b_chunk = map(&c, b)[0];
    assert!(write(&c, &a_chunk, a_chunk.rkey, vec![1; 4096]).is_ok());
    assert!(write(&c, &b_chunk, b_chunk.rkey, vec![2; 4096]).is_ok());
    // One call: a's last writable handle (it stays open for reading), b's last handle, and
    // a handle this client never had.
    let closed = c
        .call(ReleaseMany {
            handles: vec![(a, RW), (b, RW), (b, FileAccess::READ)],
        })
        .unwrap();
    assert_eq!(closed, 2, "the close of a handle not held is skipped");
    refused_soon(
        || write(&c, &a_chunk, a_chunk.rkey, vec![0; 4096]),
        "a's writable handle is closed",
    );
    let readable = map(&c, a)[0];
    assert_eq!(read(&c, &readable, readable.rkey).unwrap()[0], 1);
    refused_soon(|| read(&c, &b_chunk, b_chunk.rkey), "b is closed");
    // Each close counted once: a's reading handle is the last one.
    assert_eq!(
        c.call(ReleaseMany {
            handles: vec![(a, FileAccess::READ), (a, FileAccess::READ)],
        })
        .unwrap(),
        1
    );
    refused_soon(|| read(&c, &readable, readable.rkey), "a is closed");
}
