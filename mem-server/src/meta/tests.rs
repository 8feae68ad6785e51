//! Every metadata operation, in process: a service with this node's own small pool, clients
//! that call it through [`MetaService::handle`] as their connections do (calls sealed in their
//! envelopes, replies decoded), and no socket.

use rfs_proto::locks::{FileLock, LockKind, TO_END};
use rfs_proto::message::{
    decode_reply, encode_call, seal, Allocate, AttachData, Call, CancelWait, ChunkMap, Commit,
    Create, DropLocks, DropReplicas, Envelope, GetAttr, GetLock, GetStatFs, Link, ListNodes,
    Lookup, Made, Mkdir, Mknod, Open, ReadDir, Readlink, Reclaim, Release, ReleaseMany, Rename,
    Rmdir, SetAttr, SetLock, Status, Symlink, Unlink,
};
use rfs_proto::message::{GetXattr, ListXattr, RemoveXattr, SetXattr};
use rfs_proto::types::{
    Attr, Caller, ChunkRef, FileAccess, FileKind, Ino, Name, Owner, Replicas, RENAME_NOREPLACE,
};
use rfs_proto::xattr::{XattrValue, XATTR_CREATE};

use super::*;
use crate::in_process::{InProcessClient, InProcessService};

const CHUNK: u64 = 64 << 10;
const CHUNKS: u64 = 16;
const RW: FileAccess = FileAccess::READ.union(FileAccess::WRITE);

fn root() -> Caller {
    Caller {
        uid: 0,
        gid: 0,
        groups: vec![],
    }
}

fn user(uid: u32) -> Caller {
    Caller {
        uid,
        gid: uid,
        groups: vec![],
    }
}

fn owner(perm: u16, c: &Caller) -> Owner {
    Owner {
        perm,
        uid: c.uid,
        gid: c.gid,
        umask: 0,
    }
}

/// A metadata node with its own pool of [`CHUNKS`] chunks and nothing else: no zeroer (freed
/// chunks are not allocatable again here), no data node but its own.
struct Node(InProcessService);

impl Node {
    fn new() -> Node {
        Node(InProcessService::new(CHUNK, CHUNKS, Duration::from_millis(500)).unwrap())
    }

    /// A client session, as a connection of client `id` attaches it.
    fn client(&self, id: u64) -> Client<'_> {
        Client {
            session: self.0.client(id),
            seq: 0,
        }
    }

    fn handle(&self, c: &Client<'_>, call: &[u8]) -> Vec<u8> {
        c.session.handle(call)
    }
}

struct Client<'a> {
    session: InProcessClient<'a>,
    seq: u64,
}

impl Client<'_> {
    /// Calls `c` as the next call of the session, answered in time.
    fn call<C: Call>(&mut self, c: C) -> Result<C::Reply, Errno> {
        self.seq += 1;
        self.call_as(self.seq, self.seq, 10_000, c)
    }

    /// Calls `c` numbered `seq`, with `oldest` the oldest call unanswered and `budget_ms` to
    /// answer it in.
    fn call_as<C: Call>(
        &mut self,
        seq: u64,
        oldest: u64,
        budget_ms: u32,
        c: C,
    ) -> Result<C::Reply, Errno> {
        self.seq = self.seq.max(seq);
        let envelope = Envelope {
            seq,
            oldest,
            sent_ms: clock::now_ms(),
            budget_ms,
        };
        let reply = self.session.handle(&seal(&envelope, &encode_call(&c)));
        decode_reply::<C>(&reply).expect("a well-formed reply to the call made")
    }

    fn lookup(&mut self, parent: Ino, name: &str) -> Result<Attr, Errno> {
        self.call(Lookup {
            parent,
            name: name.into(),
            caller: root(),
        })
    }

    fn create_as(
        &mut self,
        caller: &Caller,
        parent: Ino,
        name: &str,
        perm: u16,
    ) -> Result<Made, Errno> {
        self.call(Create {
            parent,
            name: name.into(),
            owner: owner(perm, caller),
            access: RW,
            caller: caller.clone(),
        })
    }

    /// A file made (and opened for reading and writing) by root.
    fn create(&mut self, parent: Ino, name: &str) -> Attr {
        self.create_as(&root(), parent, name, 0o644).unwrap().attr
    }

    fn mkdir_as(
        &mut self,
        caller: &Caller,
        parent: Ino,
        name: &str,
        perm: u16,
    ) -> Result<Made, Errno> {
        self.call(Mkdir {
            parent,
            name: name.into(),
            owner: owner(perm, caller),
            caller: caller.clone(),
        })
    }

    fn mkdir(&mut self, parent: Ino, name: &str) -> Attr {
        self.mkdir_as(&root(), parent, name, 0o755).unwrap().attr
    }

    fn open(&mut self, ino: Ino, access: FileAccess, caller: &Caller) -> Result<Attr, Errno> {
        self.call(Open {
            ino,
            access,
            caller: caller.clone(),
        })
        .map(|o| o.attr)
    }

    fn allocate(
        &mut self,
        ino: Ino,
        first: u64,
        count: u32,
    ) -> Result<Vec<(u64, Replicas)>, Errno> {
        let (offset, end) = (first * CHUNK, (first + count as u64) * CHUNK);
        self.call(Allocate { ino, offset, end }).map(|m| m.chunks)
    }

    fn names(&mut self, dir: Ino) -> Vec<Vec<u8>> {
        let page = self
            .call(ReadDir {
                ino: dir,
                cookie: 0,
                max: 1000,
                caller: root(),
            })
            .unwrap();
        page.into_iter()
            .map(|e| e.name.0)
            .filter(|n| n != b"." && n != b"..")
            .collect()
    }

    /// A data session of this client at the node's own pool, attached to its metadata
    /// session: its chunk maps are granted there from now on.
    fn attach_data(&mut self) -> u64 {
        let service = self.session.service;
        let session = service.data_session().unwrap();
        let node = service.own_node();
        self.call(AttachData { node, session }).unwrap();
        session
    }
}

fn lock(kind: LockKind, start: u64, end: u64) -> FileLock {
    FileLock {
        start,
        end,
        kind,
        pid: 1,
    }
}

fn set_lock(ino: Ino, owner: u64, l: FileLock) -> SetLock {
    SetLock {
        ino,
        owner,
        lock: l,
        wait: false,
        reclaim: false,
    }
}

// Names.

#[test]
fn lookup_finds_what_was_made_and_checks_search_rights() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    assert_eq!(c.lookup(ROOT, "f").unwrap().ino, f.ino);
    assert_eq!(c.lookup(ROOT, "nope"), Err(Errno::ENOENT));
    let private = c.mkdir_as(&root(), ROOT, "private", 0o700).unwrap().attr;
    c.create(private.ino, "secret");
    let as_user = c.call(Lookup {
        parent: private.ino,
        name: "secret".into(),
        caller: user(1000),
    });
    assert_eq!(as_user, Err(Errno::EACCES));
}

/// Every kind of create stops at the file limit (a client cannot grow the node's memory
/// without bound), an existing name still says EEXIST, a hard link makes no inode, statfs
/// counts against the limit, and a removal makes room again.
#[test]
fn creates_past_the_file_limit_fail_with_enospc() {
    let node = Node::new();
    let mut c = node.client(1);
    let held = c.call(GetStatFs {}).unwrap().inodes;
    node.0.meta.state.lock().ns.set_max_inodes(held + 2);
    let f = c.create(ROOT, "f");
    let d = c.mkdir(ROOT, "d");
    let full = c.call(GetStatFs {}).unwrap();
    assert_eq!((full.inodes, full.inodes_max), (held + 2, held + 2));
    assert_eq!(c.create_as(&root(), ROOT, "g", 0o644), Err(Errno::ENOSPC));
    assert_eq!(c.mkdir_as(&root(), d.ino, "e", 0o755), Err(Errno::ENOSPC));
    let mknod = c.call(Mknod {
        parent: ROOT,
        name: "fifo".into(),
        kind: FileKind::NamedPipe,
        rdev: 0,
        owner: owner(0o644, &root()),
        caller: root(),
    });
    assert_eq!(mknod, Err(Errno::ENOSPC));
    let symlink = c.call(Symlink {
        parent: ROOT,
        name: "l".into(),
        target: "f".into(),
        uid: 0,
        gid: 0,
        caller: root(),
    });
    assert_eq!(symlink, Err(Errno::ENOSPC));
    assert_eq!(
        c.create_as(&root(), ROOT, "f", 0o644),
        Err(Errno::EEXIST),
        "a name that exists is that, full or not"
    );
    c.call(Link {
        ino: f.ino,
        newparent: d.ino,
        newname: "f2".into(),
        caller: root(),
    })
    .expect("a hard link makes no inode");
    c.call(Rmdir {
        parent: ROOT,
        name: "d".into(),
        caller: root(),
    })
    .expect_err("not empty");
    c.call(Unlink {
        parent: d.ino,
        name: "f2".into(),
        caller: root(),
    })
    .unwrap();
    c.call(Rmdir {
        parent: ROOT,
        name: "d".into(),
        caller: root(),
    })
    .unwrap();
    c.create(ROOT, "g");
}

#[test]
fn getattr_answers_the_inode_and_refuses_unknown_ones() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let a = c.call(GetAttr { ino: f.ino }).unwrap();
    assert_eq!(
        (a.ino, a.kind, a.perm, a.size),
        (f.ino, FileKind::RegularFile, 0o644, 0)
    );
    assert!(c.call(GetAttr { ino: 999_999 }).is_err());
}

#[test]
fn setattr_lets_the_owner_chmod_refuses_others_and_truncation_frees_chunks() {
    let node = Node::new();
    let mut c = node.client(1);
    let u = user(1000);
    let f = c.create_as(&u, ROOT, "f", 0o644);
    // Root made the directory entry possible only for root: the root directory is 0755.
    assert_eq!(f, Err(Errno::EACCES));
    let dir = c.mkdir_as(&root(), ROOT, "d", 0o777).unwrap().attr;
    let f = c.create_as(&u, dir.ino, "f", 0o644).unwrap().attr;
    let chmod = |caller: &Caller, mode| SetAttr {
        ino: f.ino,
        changes: AttrChanges {
            mode: Some(mode),
            ..AttrChanges::default()
        },
        caller: caller.clone(),
    };
    assert_eq!(c.call(chmod(&user(2000), 0o666)), Err(Errno::EPERM));
    assert_eq!(c.call(chmod(&u, 0o600)).unwrap().perm, 0o600);

    c.allocate(f.ino, 0, 3).unwrap();
    let free_before = c.call(GetStatFs {}).unwrap().bytes_free / CHUNK;
    let cut = SetAttr {
        ino: f.ino,
        changes: AttrChanges {
            size: Some(0),
            ..AttrChanges::default()
        },
        caller: u.clone(),
    };
    assert_eq!(c.call(cut).unwrap().size, 0);
    let map = c.call(ChunkMap {
        ino: f.ino,
        first: 0,
        count: 8,
    });
    assert!(
        map.unwrap().chunks.iter().all(|(_, r)| r.is_empty()),
        "no chunk left"
    );
    // Nobody else holds the map: the chunks go back to the pool (to be zeroed) at once.
    let deadline = Instant::now() + Duration::from_secs(5);
    while c.call(GetStatFs {}).unwrap().bytes_free / CHUNK != free_before + 3 {
        assert!(
            Instant::now() < deadline,
            "the freed chunks did not come back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn mknod_makes_special_files_once() {
    let node = Node::new();
    let mut c = node.client(1);
    let fifo = |name: &str| Mknod {
        parent: ROOT,
        name: name.into(),
        kind: FileKind::NamedPipe,
        rdev: 0,
        owner: owner(0o600, &root()),
        caller: root(),
    };
    let made = c.call(fifo("p")).unwrap();
    assert_eq!(made.attr.kind, FileKind::NamedPipe);
    assert_eq!(made.dir.ino, ROOT);
    assert_eq!(c.call(fifo("p")), Err(Errno::EEXIST));
}

#[test]
fn mkdir_counts_the_parents_links_and_refuses_a_read_only_parent() {
    let node = Node::new();
    let mut c = node.client(1);
    let before = c.call(GetAttr { ino: ROOT }).unwrap().nlink;
    let made = c.mkdir_as(&root(), ROOT, "d", 0o755).unwrap();
    assert_eq!(made.attr.kind, FileKind::Directory);
    assert_eq!(made.dir.nlink, before + 1, "the new directory's '..'");
    assert_eq!(
        c.mkdir_as(&user(1000), made.attr.ino, "sub", 0o755),
        Err(Errno::EACCES)
    );
}

#[test]
fn symlink_and_readlink_keep_the_target_byte_for_byte() {
    let node = Node::new();
    let mut c = node.client(1);
    let target = Name(b"../not/utf8/\xff\xfe".to_vec());
    let made = c
        .call(Symlink {
            parent: ROOT,
            name: "l".into(),
            target: target.clone(),
            uid: 0,
            gid: 0,
            caller: root(),
        })
        .unwrap();
    assert_eq!(made.attr.kind, FileKind::Symlink);
    assert_eq!(c.call(Readlink { ino: made.attr.ino }), Ok(target));
    let f = c.create(ROOT, "f");
    assert!(c.call(Readlink { ino: f.ino }).is_err(), "not a link");
}

#[test]
fn link_adds_a_name_to_files_but_not_to_directories() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let d = c.mkdir(ROOT, "d");
    let link = |ino, name: &str| Link {
        ino,
        newparent: ROOT,
        newname: name.into(),
        caller: root(),
    };
    assert_eq!(c.call(link(f.ino, "g")).unwrap().attr.nlink, 2);
    assert_eq!(c.lookup(ROOT, "g").unwrap().ino, f.ino);
    assert_eq!(c.call(link(d.ino, "d2")), Err(Errno::EPERM));
}

#[test]
fn unlink_of_an_open_file_keeps_it_for_its_handle_until_the_last_release() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    c.allocate(f.ino, 0, 2).unwrap();
    let unlink = Unlink {
        parent: ROOT,
        name: "f".into(),
        caller: root(),
    };
    c.call(unlink.clone()).unwrap();
    assert_eq!(c.lookup(ROOT, "f"), Err(Errno::ENOENT));
    assert_eq!(c.call(unlink), Err(Errno::ENOENT));
    let map = c.call(ChunkMap {
        ino: f.ino,
        first: 0,
        count: 2,
    });
    assert_eq!(
        map.unwrap().chunks.len(),
        2,
        "its chunks stay while it is open"
    );
    c.call(Release {
        ino: f.ino,
        access: RW,
    })
    .unwrap();
    assert!(
        c.call(GetAttr { ino: f.ino }).is_err(),
        "gone with its last handle"
    );
}

#[test]
fn unlink_in_a_sticky_directory_is_for_the_owners() {
    let node = Node::new();
    let mut c = node.client(1);
    let tmp = c.mkdir_as(&root(), ROOT, "tmp", 0o1777).unwrap().attr;
    let (a, b) = (user(1000), user(2000));
    c.create_as(&a, tmp.ino, "mine", 0o666).unwrap();
    let by = |caller: &Caller| Unlink {
        parent: tmp.ino,
        name: "mine".into(),
        caller: caller.clone(),
    };
    assert_eq!(c.call(by(&b)), Err(Errno::EPERM));
    c.call(by(&a)).unwrap();
}

#[test]
fn rmdir_refuses_a_directory_with_entries() {
    let node = Node::new();
    let mut c = node.client(1);
    let d = c.mkdir(ROOT, "d");
    c.create(d.ino, "f");
    let rmdir = Rmdir {
        parent: ROOT,
        name: "d".into(),
        caller: root(),
    };
    assert_eq!(c.call(rmdir.clone()), Err(Errno::ENOTEMPTY));
    c.call(Unlink {
        parent: d.ino,
        name: "f".into(),
        caller: root(),
    })
    .unwrap();
    c.call(rmdir).unwrap();
    assert_eq!(c.lookup(ROOT, "d"), Err(Errno::ENOENT));
}

#[test]
fn rename_moves_replaces_and_honours_noreplace() {
    let node = Node::new();
    let mut c = node.client(1);
    let (a, b) = (c.create(ROOT, "a"), c.create(ROOT, "b"));
    let d = c.mkdir(ROOT, "d");
    let rename = |name: &str, to: Ino, newname: &str, flags| Rename {
        parent: ROOT,
        name: name.into(),
        newparent: to,
        newname: newname.into(),
        flags,
        caller: root(),
    };
    assert_eq!(
        c.call(rename("a", ROOT, "b", RENAME_NOREPLACE)),
        Err(Errno::EEXIST)
    );
    let (old, new) = c.call(rename("a", d.ino, "a2", 0)).unwrap();
    assert_eq!((old.ino, new.ino), (ROOT, d.ino));
    assert_eq!(c.lookup(d.ino, "a2").unwrap().ino, a.ino);
    // Over an existing name: the name now leads to the moved file.
    c.call(rename("b", d.ino, "a2", 0)).unwrap();
    assert_eq!(c.lookup(d.ino, "a2").unwrap().ino, b.ino);
    assert_eq!(c.names(ROOT), vec![b"d".to_vec()]);
}

#[test]
fn readdir_pages_through_every_entry_once() {
    let node = Node::new();
    let mut c = node.client(1);
    let d = c.mkdir(ROOT, "d");
    let mut want: Vec<Vec<u8>> = (0..50).map(|i| format!("f{i:02}").into_bytes()).collect();
    for n in &want {
        c.create(d.ino, std::str::from_utf8(n).unwrap());
    }
    let (mut got, mut cookie) = (Vec::new(), 0);
    loop {
        let page = c
            .call(ReadDir {
                ino: d.ino,
                cookie,
                max: 7,
                caller: root(),
            })
            .unwrap();
        assert!(page.len() <= 7);
        let Some(last) = page.last() else { break };
        cookie = last.cookie;
        got.extend(page.into_iter().map(|e| e.name.0));
    }
    got.retain(|n| n != b"." && n != b"..");
    got.sort();
    want.sort();
    assert_eq!(got, want);
    let listing = c.call(ReadDir {
        ino: d.ino,
        cookie: 0,
        max: 7,
        caller: user(1000),
    });
    assert!(listing.is_ok(), "0755: anyone may list");
}

// Files.

#[test]
fn open_checks_the_mode_bits_for_the_access_asked() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create_as(&root(), ROOT, "f", 0o640).unwrap().attr;
    assert_eq!(
        c.open(f.ino, FileAccess::READ, &user(1000)),
        Err(Errno::EACCES)
    );
    let group = Caller {
        uid: 1000,
        gid: 1000,
        groups: vec![0],
    };
    assert!(
        c.open(f.ino, FileAccess::READ, &group).is_ok(),
        "group may read"
    );
    assert_eq!(c.open(f.ino, FileAccess::WRITE, &group), Err(Errno::EACCES));
    assert!(c.open(f.ino, RW, &root()).is_ok());
}

#[test]
fn create_makes_and_opens_once() {
    let node = Node::new();
    let mut c = node.client(1);
    let made = c.create_as(&root(), ROOT, "f", 0o600).unwrap();
    assert_eq!(
        (made.attr.kind, made.attr.perm),
        (FileKind::RegularFile, 0o600)
    );
    assert_eq!(c.create_as(&root(), ROOT, "f", 0o600), Err(Errno::EEXIST));
    // Opened by the create: its map may be fetched.
    assert!(c
        .call(ChunkMap {
            ino: made.attr.ino,
            first: 0,
            count: 1
        })
        .is_ok());
}

#[test]
fn release_closes_one_handle_at_a_time_and_refuses_one_not_held() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    c.open(f.ino, FileAccess::READ, &root()).unwrap();
    let release = |access| Release { ino: f.ino, access };
    c.call(release(FileAccess::READ)).unwrap();
    let map = ChunkMap {
        ino: f.ino,
        first: 0,
        count: 1,
    };
    assert!(
        c.call(map.clone()).is_ok(),
        "the create's handle is still open"
    );
    c.call(release(RW)).unwrap();
    assert_eq!(c.call(map), Err(Errno::EBADF));
    assert_eq!(c.call(release(FileAccess::READ)), Err(Errno::EBADF));
}

#[test]
fn release_many_counts_what_it_closed() {
    let node = Node::new();
    let mut c = node.client(1);
    let (a, b) = (c.create(ROOT, "a"), c.create(ROOT, "b"));
    let closed = c.call(ReleaseMany {
        handles: vec![
            (a.ino, RW),
            (b.ino, RW),
            (b.ino, RW),
            (999_999, FileAccess::READ),
        ],
    });
    assert_eq!(closed, Ok(2));
}

#[test]
fn commit_sets_the_size_through_a_handle_and_answers_before_and_after() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    c.allocate(f.ino, 0, 2).unwrap();
    let commit = Commit {
        ino: f.ino,
        size: CHUNK + 10,
        mtime: None,
        cuts: 0,
    };
    let done = c.call(commit.clone()).unwrap();
    assert_eq!((done.before.size, done.after.size), (0, CHUNK + 10));
    assert_eq!(c.call(GetAttr { ino: f.ino }).unwrap().size, CHUNK + 10);
    let mut other = node.client(2);
    assert_eq!(
        other.call(commit),
        Err(Errno::EBADF),
        "no handle of its own"
    );
}

#[test]
fn reclaim_is_refused_outside_a_restarts_grace() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let mut other = node.client(2);
    assert_eq!(
        other.call(Reclaim {
            handles: vec![(f.ino, RW)]
        }),
        Err(Errno::EPERM)
    );
}

// Locks.

#[test]
fn set_lock_gives_one_writer_at_a_time_and_get_lock_names_the_holder() {
    let node = Node::new();
    let (mut a, mut b) = (node.client(1), node.client(2));
    let f = a.create(ROOT, "f");
    b.open(f.ino, RW, &root()).unwrap();
    let whole = lock(LockKind::Write, 0, TO_END);
    assert_eq!(a.call(set_lock(f.ino, 7, whole)), Ok(None));
    let held = b.call(set_lock(f.ino, 8, whole)).unwrap();
    assert_eq!(
        held.map(|l| l.kind),
        Some(LockKind::Write),
        "the conflicting lock is answered"
    );
    let probe = b.call(GetLock {
        ino: f.ino,
        owner: 8,
        lock: lock(LockKind::Read, 10, 20),
    });
    assert_eq!(
        probe.unwrap().map(|l| (l.start, l.kind)),
        Some((0, LockKind::Write))
    );
    assert_eq!(
        a.call(set_lock(f.ino, 7, lock(LockKind::Read, 5, 4))),
        Err(Errno::EINVAL),
        "a range that ends before it starts"
    );
    let mut stranger = node.client(3);
    assert_eq!(
        stranger.call(set_lock(f.ino, 9, whole)),
        Err(Errno::EBADF),
        "only through a handle"
    );
    a.call(set_lock(f.ino, 7, lock(LockKind::Unlock, 0, TO_END)))
        .unwrap();
    assert_eq!(b.call(set_lock(f.ino, 8, whole)), Ok(None));
}

#[test]
fn drop_locks_frees_every_range_of_the_owner() {
    let node = Node::new();
    let (mut a, mut b) = (node.client(1), node.client(2));
    let f = a.create(ROOT, "f");
    b.open(f.ino, RW, &root()).unwrap();
    a.call(set_lock(f.ino, 7, lock(LockKind::Write, 0, 9)))
        .unwrap();
    a.call(set_lock(f.ino, 7, lock(LockKind::Write, 100, 109)))
        .unwrap();
    assert!(b
        .call(set_lock(f.ino, 8, lock(LockKind::Write, 100, 100)))
        .unwrap()
        .is_some());
    a.call(DropLocks {
        ino: f.ino,
        owner: 7,
    })
    .unwrap();
    assert_eq!(
        b.call(set_lock(f.ino, 8, lock(LockKind::Write, 0, TO_END))),
        Ok(None)
    );
}

#[test]
fn cancel_wait_gives_up_a_place_in_the_queue() {
    let node = Node::new();
    let (mut a, mut b, mut c) = (node.client(1), node.client(2), node.client(3));
    let f = a.create(ROOT, "f");
    b.open(f.ino, RW, &root()).unwrap();
    c.open(f.ino, RW, &root()).unwrap();
    let whole = lock(LockKind::Write, 0, TO_END);
    a.call(set_lock(f.ino, 7, whole)).unwrap();
    let waiting = SetLock {
        wait: true,
        ..set_lock(f.ino, 8, whole)
    };
    assert!(b.call(waiting).unwrap().is_some(), "b waits behind a");
    a.call(set_lock(f.ino, 7, lock(LockKind::Unlock, 0, TO_END)))
        .unwrap();
    // Free now, and kept for the waiter that asked first: c, who never waited, is refused.
    let late = set_lock(f.ino, 9, whole);
    assert!(c.call(late.clone()).unwrap().is_some(), "kept for b");
    b.call(CancelWait {
        ino: f.ino,
        owner: 8,
    })
    .unwrap();
    assert_eq!(c.call(late), Ok(None), "b gave its place up");
}

// Chunks.

#[test]
fn chunk_map_goes_through_a_handle_and_is_granted_to_the_attached_data_session() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    c.allocate(f.ino, 0, 2).unwrap();
    let map = ChunkMap {
        ino: f.ino,
        first: 0,
        count: 4,
    };
    let ungranted = c.call(map.clone()).unwrap().chunks;
    assert_eq!(ungranted.len(), 2);
    assert!(ungranted.iter().flat_map(|(_, r)| r).all(|c| c.rkey == 0));
    c.attach_data();
    let granted = c.call(map.clone()).unwrap().chunks;
    assert!(granted.iter().flat_map(|(_, r)| r).all(|c| c.rkey != 0));
    let mut other = node.client(2);
    assert_eq!(other.call(map), Err(Errno::EBADF));
}

#[test]
fn allocate_needs_a_writable_handle_and_fails_with_enospc_when_the_pool_is_full() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let got = c.allocate(f.ino, 0, 4).unwrap();
    assert_eq!(
        got.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    // Allocating what is there already allocates nothing more.
    let free = c.call(GetStatFs {}).unwrap().bytes_free / CHUNK;
    c.allocate(f.ino, 0, 4).unwrap();
    assert_eq!(c.call(GetStatFs {}).unwrap().bytes_free / CHUNK, free);
    assert_eq!(c.allocate(f.ino, 4, CHUNKS as u32), Err(Errno::ENOSPC));

    let g = c.create(ROOT, "g");
    c.call(Release {
        ino: g.ino,
        access: RW,
    })
    .unwrap();
    c.open(g.ino, FileAccess::READ, &root()).unwrap();
    assert_eq!(c.allocate(g.ino, 0, 1), Err(Errno::EBADF));
}

#[test]
fn drop_replicas_keeps_what_a_write_reached() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let map = c.allocate(f.ino, 0, 1).unwrap();
    let only = map[0].1.clone();
    let drop = |reached: Vec<ChunkRef>| DropReplicas {
        ino: f.ino,
        index: 0,
        reached,
    };
    assert_eq!(
        c.call(drop(only.to_vec())),
        Ok(0),
        "the write reached its only copy"
    );
    assert_eq!(c.call(drop(vec![])), Err(Errno::EIO), "a copy must be left");
    let mut reader = node.client(2);
    reader.open(f.ino, FileAccess::READ, &root()).unwrap();
    assert_eq!(reader.call(drop(only.to_vec())), Err(Errno::EBADF));
}

#[test]
fn statfs_counts_the_pool_and_what_is_allocated() {
    let node = Node::new();
    let mut c = node.client(1);
    let before = c.call(GetStatFs {}).unwrap();
    assert_eq!(
        (before.chunk_size, before.bytes_total / CHUNK),
        (CHUNK, CHUNKS)
    );
    assert_eq!(before.bytes_free / CHUNK, CHUNKS);
    assert_eq!(before.replicas, 1);
    let f = c.create(ROOT, "f");
    c.allocate(f.ino, 0, 3).unwrap();
    let after = c.call(GetStatFs {}).unwrap();
    assert_eq!(after.bytes_free / CHUNK, CHUNKS - 3);
    assert_eq!(after.inodes, before.inodes + 1);
}

#[test]
fn list_nodes_names_the_nodes_own_pool() {
    let node = Node::new();
    let mut c = node.client(1);
    let nodes = c.call(ListNodes {}).unwrap();
    assert_eq!(nodes.len(), 1);
    assert!(nodes[0].alive && nodes[0].meta);
    assert_eq!(nodes[0].id, node.0.own_node());
}

#[test]
fn attach_data_names_only_nodes_there_are() {
    let node = Node::new();
    let mut c = node.client(1);
    assert_eq!(
        c.call(AttachData {
            node: 7,
            session: 1
        }),
        Err(Errno::EINVAL)
    );
    c.attach_data();
}

// The dispatch: each call applied once, and not behind its caller's back.

#[test]
fn a_resent_call_gets_its_first_reply_and_is_not_applied_twice() {
    let node = Node::new();
    let mut c = node.client(1);
    let create = Create {
        parent: ROOT,
        name: "f".into(),
        owner: owner(0o644, &root()),
        access: RW,
        caller: root(),
    };
    let first = c.call_as(1, 1, 10_000, create.clone()).unwrap();
    let again = c.call_as(1, 1, 10_000, create.clone()).unwrap();
    assert_eq!(first, again, "the reply it had, not EEXIST");
    assert_eq!(c.names(ROOT), vec![b"f".to_vec()]);
    // Once the client says it has the reply (oldest past it), a copy is not applied.
    c.call_as(2, 2, 10_000, GetStatFs {}).unwrap();
    assert_eq!(c.call_as(1, 1, 10_000, create), Err(Errno::EIO));
}

#[test]
fn a_call_that_arrives_after_its_caller_gave_up_is_not_applied() {
    let node = Node::new();
    let c = node.client(1);
    // The client's clock runs 10 s ahead of ours; the session learns that from a call on time.
    let ahead = clock::now_ms() + 10_000;
    let on_time = Envelope {
        seq: 1,
        oldest: 1,
        sent_ms: ahead,
        budget_ms: 10_000,
    };
    let statfs = seal(&on_time, &encode_call(&GetStatFs {}));
    assert!(decode_reply::<GetStatFs>(&node.handle(&c, &statfs))
        .unwrap()
        .is_ok());
    // Sent 5 s before it was read, with 1 s to answer it in.
    let late = Envelope {
        seq: 2,
        oldest: 2,
        sent_ms: ahead - 5_000,
        budget_ms: 1_000,
    };
    let mkdir = Mkdir {
        parent: ROOT,
        name: "late".into(),
        owner: owner(0o755, &root()),
        caller: root(),
    };
    let reply = node.handle(&c, &seal(&late, &encode_call(&mkdir)));
    assert_eq!(decode_reply::<Mkdir>(&reply).unwrap(), Err(Errno::EIO));
    assert_eq!(node.client(2).lookup(ROOT, "late"), Err(Errno::ENOENT));
}

#[test]
fn a_malformed_call_is_answered_eproto_and_changes_nothing() {
    let node = Node::new();
    let c = node.client(1);
    let envelope = Envelope {
        seq: 1,
        oldest: 1,
        sent_ms: clock::now_ms(),
        budget_ms: 10_000,
    };
    let mut call = encode_call(&Mkdir {
        parent: ROOT,
        name: "x".into(),
        owner: owner(0o755, &root()),
        caller: root(),
    });
    call.truncate(call.len() - 3);
    let reply = node.handle(&c, &seal(&envelope, &call));
    assert_eq!(decode_reply::<Mkdir>(&reply).unwrap(), Err(Errno::EPROTO));
    let no_envelope = node.handle(&c, b"short");
    assert_eq!(no_envelope, Reply::failed(0, Errno::EPROTO).bytes);
}

// The cluster.

#[test]
fn status_lists_nodes_and_sessions_with_what_they_hold_for_root_only() {
    let node = Node::new();
    let (mut a, mut b) = (node.client(1), node.client(2));
    a.create(ROOT, "f");
    let g = b.create(ROOT, "g");
    b.call(set_lock(g.ino, 3, lock(LockKind::Write, 0, TO_END)))
        .unwrap();
    assert_eq!(
        a.call(Status { caller: user(1000) }),
        Err(Errno::EPERM),
        "a user may not see who is connected"
    );
    let s = a.call(Status { caller: root() }).unwrap();
    assert_eq!(s.nodes.len(), 1);
    let own = &s.nodes[0];
    assert!(own.meta && own.state == "up", "{own:?}");
    assert_eq!(own.pool_bytes, CHUNK * CHUNKS);
    assert!(own.free_chunks <= CHUNKS && own.free_bytes <= own.pool_bytes);
    let by_client = |id: u64| s.clients.iter().find(|c| c.client == id).unwrap();
    let (ca, cb) = (by_client(1), by_client(2));
    assert_eq!((ca.open_files, ca.locks), (Some(1), 0), "{ca:?}");
    assert_eq!((cb.open_files, cb.locks), (Some(1), 1), "{cb:?}");
    assert!(ca.connected && cb.connected);
    assert_eq!((s.inodes, s.chunk_size), (3, CHUNK));
}

/// A cut inside a chunk zeroes the rest of that chunk on the node (what was written past the
/// new end, committed or not, must not come back when the file grows), leaves the bytes
/// before the cut and the chunks before it alone, and maps read after it carry its count.
#[test]
fn a_cut_inside_a_chunk_zeroes_its_tail_and_maps_carry_the_count_of_cuts() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let map = c.allocate(f.ino, 0, 2).unwrap();
    let addr = |index: usize| map[index].1[0].addr;
    for index in 0..2 {
        node.0
            .write_pool(addr(index), &vec![0xaa; CHUNK as usize])
            .unwrap();
    }
    let cut_to = |size| SetAttr {
        ino: f.ino,
        changes: AttrChanges {
            size: Some(size),
            ..AttrChanges::default()
        },
        caller: root(),
    };
    c.call(Commit {
        ino: f.ino,
        size: 2 * CHUNK,
        mtime: None,
        cuts: 0,
    })
    .unwrap();
    assert_eq!(c.call(cut_to(CHUNK + 100)).unwrap().size, CHUNK + 100);
    let kept = node.0.pool_bytes(addr(1), CHUNK as usize).unwrap();
    assert!(
        kept[..100].iter().all(|&b| b == 0xaa),
        "bytes before the cut kept"
    );
    assert_eq!(
        kept[100..].iter().position(|&b| b != 0),
        None,
        "the tail past the cut is zeros"
    );
    let first = node.0.pool_bytes(addr(0), CHUNK as usize).unwrap();
    assert!(
        first.iter().all(|&b| b == 0xaa),
        "the chunk before untouched"
    );
    let map = c
        .call(ChunkMap {
            ino: f.ino,
            first: 0,
            count: 2,
        })
        .unwrap();
    assert_eq!((map.cuts, map.chunks.len()), (1, 2));
    // A cut at a chunk's edge zeroes nothing.
    node.0.write_pool(addr(0), &[0xbb; 16]).unwrap();
    c.call(cut_to(2 * CHUNK)).unwrap();
    c.call(cut_to(CHUNK)).unwrap();
    assert_eq!(node.0.pool_bytes(addr(0), 16).unwrap(), vec![0xbb; 16]);
    let map = c
        .call(ChunkMap {
            ino: f.ino,
            first: 0,
            count: 2,
        })
        .unwrap();
    assert_eq!((map.cuts, map.chunks.len()), (3, 1));
}

/// A cut above the size the node knows zeroes past it too: another client's writes past its
/// last commit are there, and the cut holds over them (its commit is refused), so they must
/// not show when the file grows further.
#[test]
fn a_cut_above_the_committed_size_zeroes_uncommitted_bytes_past_it() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let map = c.allocate(f.ino, 0, 1).unwrap();
    let addr = map[0].1[0].addr;
    // Written but committed only up to 10 bytes.
    node.0
        .write_pool(addr, &vec![0xaa; CHUNK as usize])
        .unwrap();
    c.call(Commit {
        ino: f.ino,
        size: 10,
        mtime: None,
        cuts: 0,
    })
    .unwrap();
    c.call(SetAttr {
        ino: f.ino,
        changes: AttrChanges {
            size: Some(100),
            ..AttrChanges::default()
        },
        caller: root(),
    })
    .unwrap();
    let chunk = node.0.pool_bytes(addr, CHUNK as usize).unwrap();
    assert!(chunk[..100].iter().all(|&b| b == 0xaa));
    assert_eq!(chunk[100..].iter().position(|&b| b != 0), None);
}

/// Draining is root's, names a node that exists, and shows in the status.
#[test]
fn drain_is_for_root_and_shows_in_the_status() {
    use rfs_proto::message::Drain;
    let node = Node::new();
    let mut c = node.client(1);
    let own = node.0.own_node();
    let drain = |caller: Caller, node: u32, on: bool| Drain { caller, node, on };
    assert_eq!(c.call(drain(user(1000), own, true)), Err(Errno::EPERM));
    assert_eq!(c.call(drain(root(), 99, true)), Err(Errno::ENOENT));
    c.call(drain(root(), own, true)).unwrap();
    let state = |c: &mut Client<'_>| {
        c.call(Status { caller: root() }).unwrap().nodes[0]
            .state
            .clone()
    };
    assert_eq!(state(&mut c), "draining");
    // Nowhere else to put new chunks.
    let f = c.create(ROOT, "f");
    assert_eq!(c.allocate(f.ino, 0, 1), Err(Errno::ENOSPC));
    c.call(drain(root(), own, false)).unwrap();
    assert_eq!(state(&mut c), "up");
    assert!(c.allocate(f.ino, 0, 1).is_ok());
}

/// A rebalance is root's, and the status says one is going on.
#[test]
fn rebalance_is_for_root_and_shows_in_the_status() {
    use rfs_proto::message::Rebalance;
    let node = Node::new();
    let mut c = node.client(1);
    let rebalancing = |c: &mut Client<'_>| c.call(Status { caller: root() }).unwrap().rebalancing;
    assert!(!rebalancing(&mut c));
    assert_eq!(c.call(Rebalance { caller: user(1000) }), Err(Errno::EPERM));
    assert!(!rebalancing(&mut c), "a refused call starts nothing");
    c.call(Rebalance { caller: root() }).unwrap();
    assert!(rebalancing(&mut c));
}

/// Removing a node is root's, for a node that exists and is not up, forced or not.
#[test]
fn remove_node_is_for_root_and_refuses_an_unknown_node_or_one_up() {
    use rfs_proto::message::RemoveNode;
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    c.allocate(f.ino, 0, 1).unwrap();
    let own = node.0.own_node();
    let remove = |caller: Caller, node: u32, force: bool| RemoveNode {
        caller,
        node,
        force,
    };
    assert_eq!(c.call(remove(user(1000), own, false)), Err(Errno::EPERM));
    assert_eq!(c.call(remove(root(), 99, false)), Err(Errno::ENOENT));
    assert_eq!(c.call(remove(root(), own, false)), Err(Errno::EBUSY));
    assert_eq!(
        c.call(remove(root(), own, true)),
        Err(Errno::EBUSY),
        "force or not"
    );
    let s = c.call(Status { caller: root() }).unwrap();
    assert_eq!(s.nodes.len(), 1, "still listed");
    assert_eq!(
        (s.nodes[0].copies, s.nodes[0].only_copies),
        (1, 1),
        "{:?}",
        s.nodes[0]
    );
}

/// A write that reached a copy a drain has moved since, and missed another copy, names the old
/// copy when it asks for the copies it missed to be dropped: the copy made from the old one
/// stands for it (it was copied after the write landed, the file frozen), so the stale copy
/// goes and the new one stays. Without that, the drop found none of what the write reached
/// and the stale copy stayed, the write lost.
#[test]
fn a_drop_naming_a_copy_a_drain_moved_keeps_the_copy_made_from_it() {
    let node = Node::new();
    let mut c = node.client(1);
    let f = c.create(ROOT, "f");
    let slots: Vec<ChunkRef> = c
        .allocate(f.ino, 0, 3)
        .unwrap()
        .into_iter()
        .map(|(_, r)| ChunkRef { rkey: 0, ..r[0] })
        .collect();
    let (old, stale, new) = (slots[0], slots[1], slots[2]);
    {
        // Chunk 0 had copies `old` (the write reached it) and `stale` (missed it); a drain
        // copied `old` to `new` and dropped `old`.
        let mut st = node.0.meta.state.lock();
        assert!(st.ns.add_replica(f.ino, 0, &old, stale));
        assert!(st.ns.add_replica(f.ino, 0, &old, new));
        st.ns.drop_replicas(f.ino, 0, &[stale, new]).unwrap();
        st.moved.insert((old.node, old.addr), new);
    }
    let dropped = c.call(DropReplicas {
        ino: f.ino,
        index: 0,
        reached: vec![old],
    });
    assert_eq!(dropped, Ok(1), "the stale copy goes");
    let left = node.0.meta.state.lock().ns.replicas(f.ino, 0).unwrap();
    assert_eq!(
        (left.len(), left[0].addr),
        (1, new.addr),
        "the moved copy stays"
    );
}

impl Client<'_> {
    fn get_xattr(&mut self, ino: Ino, name: &str, caller: &Caller) -> Result<Vec<u8>, Errno> {
        let name = name.into();
        let caller = caller.clone();
        self.call(GetXattr { ino, name, caller }).map(|v| v.0)
    }

    fn set_xattr(&mut self, ino: Ino, name: &str, value: &[u8], c: &Caller) -> Result<(), Errno> {
        self.call(SetXattr {
            ino,
            name: name.into(),
            value: XattrValue(value.to_vec()),
            flags: 0,
            caller: c.clone(),
        })
        .map(drop)
    }

    fn list_xattr(&mut self, ino: Ino, caller: &Caller) -> Vec<u8> {
        let caller = caller.clone();
        self.call(ListXattr { ino, caller }).unwrap().0
    }
}

/// Who may read, set, list and remove which extended attributes: `user.` ones by the file's
/// mode bits (and only on files and directories, and in a sticky directory set only by its
/// owner), `trusted.` ones root's alone and hidden from others, `security.` ones read by
/// anyone and set by root; other namespaces are not kept.
#[test]
fn extended_attributes_are_reached_as_the_caller_may() {
    let node = Node::new();
    let mut c = node.client(1);
    let alice = user(1000);
    let f = c.create(ROOT, "f").ino; // root's, 0644
    c.set_xattr(f, "user.a", b"1", &root()).unwrap();
    c.set_xattr(f, "trusted.t", b"2", &root()).unwrap();
    c.set_xattr(f, "security.s", b"3", &root()).unwrap();
    assert_eq!(
        c.get_xattr(f, "user.a", &alice),
        Ok(b"1".to_vec()),
        "read bit"
    );
    assert_eq!(c.set_xattr(f, "user.a", b"x", &alice), Err(Errno::EACCES));
    assert_eq!(
        c.call(RemoveXattr {
            ino: f,
            name: "user.a".into(),
            caller: alice.clone()
        })
        .map(drop),
        Err(Errno::EACCES)
    );
    assert_eq!(c.get_xattr(f, "trusted.t", &alice), Err(Errno::ENODATA));
    assert_eq!(c.set_xattr(f, "trusted.t", b"x", &alice), Err(Errno::EPERM));
    assert_eq!(c.get_xattr(f, "security.s", &alice), Ok(b"3".to_vec()));
    assert_eq!(
        c.set_xattr(f, "security.s", b"x", &alice),
        Err(Errno::EPERM)
    );
    assert_eq!(
        c.set_xattr(f, "system.posix_acl_access", b"x", &root()),
        Err(Errno::EINVAL),
        "not an ACL"
    );
    assert_eq!(
        c.set_xattr(f, "system.other", b"x", &root()),
        Err(Errno::ENOTSUP)
    );
    assert_eq!(c.get_xattr(f, "user.none", &root()), Err(Errno::ENODATA));
    assert_eq!(c.list_xattr(f, &root()), b"security.s\0trusted.t\0user.a\0");
    assert_eq!(
        c.list_xattr(f, &alice),
        b"security.s\0user.a\0",
        "trusted: root's"
    );
    let flags = XATTR_CREATE;
    let again = SetXattr {
        ino: f,
        name: "user.a".into(),
        value: XattrValue(vec![]),
        flags,
        caller: root(),
    };
    assert_eq!(c.call(again).map(drop), Err(Errno::EEXIST));

    // Her own file: hers to change; a symbolic link takes no user attributes.
    let public = c.mkdir_as(&root(), ROOT, "pub", 0o777).unwrap().attr.ino;
    let mine = c.create_as(&alice, public, "mine", 0o600).unwrap().attr.ino;
    c.set_xattr(mine, "user.a", b"mine", &alice).unwrap();
    assert_eq!(c.get_xattr(mine, "user.a", &user(1001)), Err(Errno::EACCES));
    let link = c
        .call(Symlink {
            parent: ROOT,
            name: "l".into(),
            target: "f".into(),
            uid: 0,
            gid: 0,
            caller: root(),
        })
        .unwrap()
        .attr
        .ino;
    assert_eq!(
        c.set_xattr(link, "user.a", b"x", &root()),
        Err(Errno::EPERM)
    );
    assert_eq!(c.get_xattr(link, "user.a", &root()), Err(Errno::ENODATA));
    // A sticky directory anyone may write: only its owner sets its user attributes.
    let tmp = c.mkdir_as(&root(), ROOT, "tmp", 0o1777).unwrap().attr.ino;
    assert_eq!(c.set_xattr(tmp, "user.a", b"x", &alice), Err(Errno::EPERM));
    c.set_xattr(tmp, "user.a", b"x", &root()).unwrap();

    // Another session sees the change (mounts are told of it: tests/tests/xattrs.rs).
    let mut other = node.client(2);
    other.get_xattr(f, "user.a", &root()).unwrap();
    c.set_xattr(f, "user.a", b"new", &root()).unwrap();
    assert_eq!(other.get_xattr(f, "user.a", &root()), Ok(b"new".to_vec()));
}

/// What a write by someone without CAP_FSETID clears (`kill_setid`, which the client asks for
/// where the kernel leaves it to the file system): the set-ID bits and capabilities the node
/// holds now, at a writer's request; anyone else is refused. A writer may remove the
/// capabilities (the kernel does, in the writer's name), not other security attributes.
#[test]
fn a_writer_clears_set_id_bits_and_capabilities() {
    let node = Node::new();
    let mut c = node.client(1);
    let alice = user(1000);
    let f = c.create(ROOT, "f").ino;
    let chmod = |mode| SetAttr {
        ino: f,
        changes: rfs_proto::types::AttrChanges {
            mode: Some(mode),
            ..Default::default()
        },
        caller: root(),
    };
    let kill = |caller: &Caller| SetAttr {
        ino: f,
        changes: rfs_proto::types::AttrChanges {
            kill_setid: true,
            ..Default::default()
        },
        caller: caller.clone(),
    };
    c.call(chmod(0o6777)).unwrap();
    c.set_xattr(f, "security.capability", b"caps", &root())
        .unwrap();
    c.set_xattr(f, "security.other", b"o", &root()).unwrap();
    assert_eq!(c.call(kill(&alice)).unwrap().perm, 0o777);
    assert_eq!(
        c.get_xattr(f, "security.capability", &root()),
        Err(Errno::ENODATA)
    );
    assert_eq!(c.get_xattr(f, "security.other", &root()), Ok(b"o".to_vec()));
    // Set-group-ID without group execute marks mandatory locking: it stays.
    c.call(chmod(0o2744)).unwrap();
    assert_eq!(c.call(kill(&root())).unwrap().perm, 0o2744);
    c.call(chmod(0o4744)).unwrap();
    // (This session holds the file open for writing, which lets it: another does not.)
    let mut other = node.client(2);
    assert_eq!(other.call(kill(&alice)), Err(Errno::EPERM), "not a writer");
    c.call(chmod(0o666)).unwrap();
    c.set_xattr(f, "security.capability", b"caps", &root())
        .unwrap();
    let remove = |name: &str| RemoveXattr {
        ino: f,
        name: name.into(),
        caller: alice.clone(),
    };
    assert_eq!(c.call(remove("security.capability")).map(drop), Ok(()));
    assert_eq!(
        c.call(remove("security.other")).map(drop),
        Err(Errno::EPERM)
    );
}

/// A page of long names fills its message up to the budget, and the MAC every reply is sealed
/// with must still fit: a reply past the message's size is dropped by the RPC layer, and the
/// client takes the empty reply for one altered on the path (the directory could never be
/// listed). The names' length is chosen to leave the least room at a page's end.
#[test]
fn a_readdir_page_of_long_names_fits_its_message_with_its_mac() {
    use rfs_proto::message::METADATA_RPC;
    use rfs_proto::types::DirEntry;
    use rfs_proto::wire::{Wire, Writer, MAX_LIST};
    let node = Node::new();
    let mut c = node.client(1);
    let d = c.mkdir(ROOT, "d");
    let size = |len: usize| {
        let e = DirEntry {
            cookie: 0,
            name: Name(vec![b'a'; len]),
            attr: d,
        };
        let mut w = Writer::default();
        e.put(&mut w);
        w.0.len()
    };
    let max = METADATA_RPC.max_msg;
    // What a page could take before the MAC: past "." and "..", the names.
    let room = max - 3 - 4 - size(1) - size(2);
    // Long enough that the page fills by bytes, not by its count of entries.
    let fills = |l: usize| (MAX_LIST as usize - 2) * size(l) > room;
    let len = (100..=255)
        .filter(|&l| fills(l))
        .min_by_key(|&l| room % size(l))
        .unwrap();
    assert!(
        room % size(len) < rfs_proto::integrity::TAG,
        "a length that tests it"
    );
    for i in 0..room / size(len) + 2 {
        let name = format!("{i:05}{}", "a".repeat(len - 5));
        c.create(d.ino, &name);
    }
    let call = ReadDir {
        ino: d.ino,
        cookie: 0,
        max: MAX_LIST,
        caller: root(),
    };
    c.seq += 1;
    let envelope = Envelope {
        seq: c.seq,
        oldest: c.seq,
        sent_ms: clock::now_ms(),
        budget_ms: 10_000,
    };
    let reply = node.handle(&c, &seal(&envelope, &encode_call(&call)));
    assert!(
        reply.len() + rfs_proto::integrity::TAG <= max,
        "a {}-byte reply and its MAC in a {max}-byte message",
        reply.len()
    );
}

/// POSIX ACLs on the node's own path (what a client that skips its kernel's checks meets): a
/// named user let in and held to the mask, a group whose entry refuses keeping its members
/// from the others' bits, search through a directory by an entry, only the owner setting
/// them, a chmod moving the mask, and a new file taking a default ACL instead of its umask.
#[test]
fn acls_decide_on_the_nodes_path_and_only_owners_set_them() {
    use crate::acl::from_text;
    let node = Node::new();
    let mut c = node.client(1);
    let (alice, bob) = (user(1000), user(2000));
    let carol = Caller {
        groups: vec![1000],
        ..user(3000)
    };
    let d = c.mkdir_as(&root(), ROOT, "d", 0o777).unwrap().attr.ino;
    let f = c.create_as(&alice, d, "f", 0o640).unwrap().attr.ino;
    let acl = |text: &str| from_text(text).to_bytes();
    let set = |c: &mut Client<'_>, ino, name: &str, text: &str, who: &Caller| {
        c.set_xattr(ino, name, &acl(text), who)
    };
    let access = "system.posix_acl_access";
    assert_eq!(c.open(f, FileAccess::READ, &bob), Err(Errno::EACCES));
    let named = "u::rw-,u:2000:rw-,g::r--,m::r--,o::---";
    assert_eq!(set(&mut c, f, access, named, &bob), Err(Errno::EPERM));
    set(&mut c, f, access, named, &alice).unwrap();
    assert_eq!(
        c.get_xattr(f, access, &bob),
        Ok(acl(named)),
        "anyone reads it"
    );
    assert!(c
        .list_xattr(f, &bob)
        .starts_with(b"system.posix_acl_access\0"));
    assert!(c.open(f, FileAccess::READ, &bob).is_ok(), "a named user");
    assert_eq!(
        c.open(f, FileAccess::WRITE, &bob),
        Err(Errno::EACCES),
        "held to the mask"
    );
    let chmod = |c: &mut Client<'_>, ino, mode, who: &Caller| {
        c.call(SetAttr {
            ino,
            changes: AttrChanges {
                mode: Some(mode),
                ..Default::default()
            },
            caller: who.clone(),
        })
    };
    assert_eq!(chmod(&mut c, f, 0o660, &alice).unwrap().perm, 0o660);
    assert!(c.open(f, FileAccess::WRITE, &bob).is_ok(), "the mask moved");
    let masked = "u::rw-,u:2000:rw-,g::r--,m::rw-,o::---";
    assert_eq!(c.get_xattr(f, access, &bob), Ok(acl(masked)));
    // Carol is in alice's group, whose entry refuses her: the others' entry is not hers.
    set(&mut c, f, access, "u::rw-,g::---,m::rw-,o::r--", &alice).unwrap();
    assert_eq!(c.open(f, FileAccess::READ, &carol), Err(Errno::EACCES));
    assert!(c.open(f, FileAccess::READ, &user(4000)).is_ok());
    // Search through a private directory by an entry.
    let private = c.mkdir_as(&alice, d, "p", 0o700).unwrap().attr.ino;
    c.create_as(&alice, private, "in", 0o644).unwrap();
    let lookup = |c: &mut Client<'_>, who: &Caller| {
        c.call(Lookup {
            parent: private,
            name: "in".into(),
            caller: who.clone(),
        })
    };
    assert_eq!(lookup(&mut c, &bob), Err(Errno::EACCES));
    set(
        &mut c,
        private,
        access,
        "u::rwx,u:2000:--x,g::---,m::--x,o::---",
        &alice,
    )
    .unwrap();
    assert!(lookup(&mut c, &bob).is_ok());
    // A default ACL decides a new file's bits instead of its maker's umask.
    let default = "system.posix_acl_default";
    assert_eq!(
        set(&mut c, f, default, named, &alice),
        Err(Errno::EACCES),
        "only directories have one"
    );
    set(
        &mut c,
        private,
        default,
        "u::rwx,u:2000:rw-,g::---,m::rwx,o::---",
        &alice,
    )
    .unwrap();
    let made = c
        .call(Create {
            parent: private,
            name: "new".into(),
            owner: Owner {
                umask: 0o077,
                ..owner(0o666, &alice)
            },
            access: RW,
            caller: alice.clone(),
        })
        .unwrap()
        .attr;
    assert_eq!(
        made.perm, 0o660,
        "the mask is the umask-free mode's group bits"
    );
    assert!(c.open(made.ino, RW, &bob).is_ok(), "bob's inherited entry");
    // Removing the access ACL leaves the mode as it was.
    c.call(RemoveXattr {
        ino: made.ino,
        name: access.into(),
        caller: alice.clone(),
    })
    .unwrap();
    assert_eq!(c.open(made.ino, FileAccess::READ, &bob), Err(Errno::EACCES));
    // With no group bits the ACL is not asked: the others' bits decide (chmod 604).
    set(
        &mut c,
        f,
        access,
        "u::rw-,u:2000:rw-,g::r--,m::r--,o::---",
        &alice,
    )
    .unwrap();
    chmod(&mut c, f, 0o604, &alice).unwrap();
    assert!(c.open(f, FileAccess::READ, &bob).is_ok());
    assert_eq!(c.open(f, FileAccess::WRITE, &bob), Err(Errno::EACCES));
    // Nothing to take away is not an error, and a file has no default ACL to take.
    for name in [access, default] {
        let remove = |c: &mut Client<'_>| {
            c.call(RemoveXattr {
                ino: made.ino,
                name: name.into(),
                caller: alice.clone(),
            })
        };
        assert!(remove(&mut c).is_ok(), "{name}");
    }
}

/// A chmod to set-group-ID by someone outside the file's group (a file made in a set-group-ID
/// directory takes its group, which the maker may not be in) drops the bit, as Linux's does:
/// the node does so whatever a client asks.
#[test]
fn a_chmod_by_a_non_member_drops_set_group_id() {
    let node = Node::new();
    let mut c = node.client(1);
    let alice = user(1000);
    let d = c.mkdir_as(&root(), ROOT, "d", 0o777).unwrap().attr.ino;
    let f = c.create_as(&alice, d, "f", 0o755).unwrap().attr.ino;
    let chgrp = SetAttr {
        ino: f,
        changes: AttrChanges {
            gid: Some(500),
            ..Default::default()
        },
        caller: root(),
    };
    c.call(chgrp).unwrap();
    let chmod = |c: &mut Client<'_>, who: &Caller| {
        c.call(SetAttr {
            ino: f,
            changes: AttrChanges {
                mode: Some(0o2755),
                ..Default::default()
            },
            caller: who.clone(),
        })
        .unwrap()
        .perm
    };
    assert_eq!(chmod(&mut c, &alice), 0o755, "alice is not in group 500");
    let member = Caller {
        groups: vec![500],
        ..alice.clone()
    };
    assert_eq!(chmod(&mut c, &member), 0o2755);
    assert_eq!(chmod(&mut c, &root()), 0o2755);
}
