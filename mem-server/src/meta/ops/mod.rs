//! The metadata operations, one function per request, by family: names (lookups and the
//! directory tree), files (handles and sizes), chunks (maps, allocation, replicas, space),
//! locks, extended attributes, and the cluster's state for its operators. Each runs under the state lock with a [`Ctx`], answers with an [`Answer`], and leaves
//! in [`Effects`] what the service does once the lock is released (callbacks, grants,
//! revocations, freed chunks).

mod chunks;
mod cluster;
mod files;
mod locking;
mod names;
mod xattrs;

use rfs_proto::message::{encode_reply, Call, Made, Request, RequestOp};
use rfs_proto::types::{Attr, Caller, FileAccess, Ino, Name};
use rfs_proto::wire::Wire;
use rfs_proto::Errno;

use super::effects::{Effects, Granting};
use super::sessions::ClientSession;
use super::state::MetaState;
use super::MetaService;
use crate::access::Perms;

pub(super) use files::release;
pub(super) use names::cut_must_wait;

/// What one operation needs: the service's settings, the state (its lock held), the calling
/// session, and where to leave what it changed.
pub(super) struct Ctx<'a> {
    pub(super) svc: &'a MetaService,
    pub(super) st: &'a mut MetaState,
    pub(super) cs: &'a mut ClientSession,
    pub(super) fx: &'a mut Effects,
}

/// A reply, encoded, and the error it carries if it is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) bytes: Vec<u8>,
    pub(crate) errno: Option<Errno>,
}

impl Reply {
    /// The reply to a request with op code `op`: every reply of the service is made here.
    pub(crate) fn new<R: Wire>(op: u8, result: &Result<R, Errno>) -> Reply {
        Reply {
            bytes: encode_reply(op, result),
            errno: result.as_ref().err().copied(),
        }
    }

    pub(crate) fn failed(op: u8, errno: Errno) -> Reply {
        Reply::new::<()>(op, &Err(errno))
    }
}

/// How an operation answers: now, or with a chunk map once its chunks are granted to the
/// caller's data sessions.
pub(super) enum Answer {
    Now(Reply),
    Grant(Granting),
}

/// The answer to `call`: typed by the call, so each request can only get its own kind of reply.
fn answer<C: Call>(_call: &C, result: Result<C::Reply, Errno>) -> Answer {
    Answer::Now(Reply::new(C::OP as u8, &result))
}

/// Applies one request: its answer, and in `cx.fx` what it changed.
pub(super) fn apply(cx: &mut Ctx<'_>, req: &Request) -> Answer {
    match req {
        Request::Lookup(m) => names::lookup(cx, m),
        Request::GetAttr(m) => names::getattr(cx, m),
        Request::SetAttr(m) => names::setattr(cx, m),
        Request::Mknod(m) => names::mknod(cx, m),
        Request::Mkdir(m) => names::mkdir(cx, m),
        Request::Symlink(m) => names::symlink(cx, m),
        Request::Readlink(m) => names::readlink(cx, m),
        Request::Link(m) => names::link(cx, m),
        Request::Unlink(m) => names::unlink(cx, m),
        Request::Rmdir(m) => names::rmdir(cx, m),
        Request::Rename(m) => names::rename(cx, m),
        Request::ReadDir(m) => names::readdir(cx, m),
        Request::Open(m) => files::open(cx, m),
        Request::Create(m) => files::create(cx, m),
        Request::Release(m) => files::release_one(cx, m),
        Request::ReleaseMany(m) => files::release_many(cx, m),
        Request::Commit(m) => files::commit(cx, m),
        Request::Reclaim(m) => files::reclaim(cx, m),
        Request::SetLock(m) => locking::set_lock(cx, m),
        Request::GetLock(m) => locking::get_lock(cx, m),
        Request::CancelWait(m) => locking::cancel_wait(cx, m),
        Request::DropLocks(m) => locking::drop_locks(cx, m),
        Request::ChunkMap(m) => chunks::chunk_map(cx, m),
        Request::Allocate(m) => chunks::allocate(cx, m),
        Request::DropReplicas(m) => chunks::drop_replicas(cx, m),
        Request::GetStatFs(m) => chunks::statfs(cx, m),
        Request::ListNodes(m) => chunks::list_nodes(cx, m),
        Request::AttachData(m) => chunks::attach_data(cx, m),
        Request::Status(m) => cluster::status(cx, m),
        Request::Drain(m) => cluster::drain(cx, m),
        Request::Rebalance(m) => cluster::rebalance(cx, m),
        Request::RemoveNode(m) => cluster::remove_node(cx, m),
        Request::GetXattr(m) => xattrs::get_xattr(cx, m),
        Request::ListXattr(m) => xattrs::list_xattr(cx, m),
        Request::SetXattr(m) => xattrs::set_xattr(cx, m),
        Request::RemoveXattr(m) => xattrs::remove_xattr(cx, m),
    }
}

impl Ctx<'_> {
    /// Who makes a call that looks in or changes directory `dir`, if `check` lets them; and
    /// the directory.
    fn in_dir(
        &self,
        caller: &Caller,
        dir: Ino,
        check: fn(&Perms, &Caller) -> Result<(), Errno>,
    ) -> Result<(Caller, Attr), Errno> {
        let c = self.svc.policy.caller(caller)?;
        let d = self.st.ns.perms(dir)?;
        check(&d, &c)?;
        Ok((c, d.attr))
    }

    /// What `name` in `parent` is now, if anything.
    fn target(&self, parent: Ino, name: &Name) -> Option<Attr> {
        self.st.ns.lookup(parent, name).ok()
    }

    /// Whether the session holds a writable handle of `ino`.
    fn writable(&self, ino: Ino) -> bool {
        self.cs.open.get(&ino).is_some_and(|h| h.writable > 0)
    }

    /// The session took a handle of `ino` for `access`.
    fn opened(&mut self, ino: Ino, access: FileAccess) {
        let h = self.cs.open.entry(ino).or_default();
        h.all += 1;
        h.writable += (access.contains(FileAccess::WRITE)) as u32;
        self.st.holders.opened(self.cs.id, ino);
    }

    /// What the session is told, it may cache: it is told again when that changes. A name
    /// looked up or made in a directory `dir`, its kernel may keep.
    fn told(&mut self, r: Result<Attr, Errno>, dir: Option<Ino>) -> Result<Attr, Errno> {
        if let Ok(a) = &r {
            self.st.holders.saw(self.cs.id, a.ino);
            dir.inspect(|&d| self.st.holders.looked_in(self.cs.id, d));
        }
        r
    }

    /// Directory `dir`'s attributes after a change the session made in it: it may keep them,
    /// so it is told when they change again.
    fn dir_after(&mut self, dir: Ino) -> Result<Attr, Errno> {
        let a = self.st.ns.getattr(dir)?;
        self.st.holders.saw(self.cs.id, dir);
        Ok(a)
    }

    /// The answer to a call that added a name to `dir` (see [`Self::told`] and
    /// [`Self::dir_after`]).
    fn made(&mut self, r: Result<Attr, Errno>, dir: Ino) -> Result<Made, Errno> {
        let attr = self.told(r, Some(dir))?;
        let dir = self.dir_after(dir)?;
        Ok(Made { attr, dir })
    }

    /// A chunk map to answer with once it is granted; read now, so granted with this free
    /// number (see [`MetaState::frees`]).
    fn granting(
        &self,
        op: RequestOp,
        ino: Ino,
        writable: bool,
        chunks: Vec<(u64, rfs_proto::types::Replicas)>,
    ) -> Answer {
        Answer::Grant(Granting {
            op,
            writable,
            seq: self.st.frees,
            stamp: self.st.alloc.stamp(),
            cuts: self.st.ns.getattr(ino).map_or(0, |a| a.cuts),
            chunks,
            opened: None,
        })
    }
}
