//! File locks (POSIX record locks and flock, as the client maps them): taken, tested and
//! dropped only through a handle (the open is where access was checked); after a restart,
//! only taken back (`reclaim`) until the grace period is over.

use rfs_proto::locks::LockKind;
use rfs_proto::message::{CancelWait, DropLocks, GetLock, SetLock};
use rfs_proto::Errno;

use super::{answer, Answer, Ctx};

pub(super) fn set_lock(cx: &mut Ctx<'_>, m: &SetLock) -> Answer {
    let r = match (m.reclaim, cx.svc.recovery.reclaiming()) {
        _ if !m.lock.is_valid() => Err(Errno::EINVAL),
        // Only a file the session has open: the open is where access was checked.
        _ if !cx.cs.open.contains_key(&m.ino) => Err(Errno::EBADF),
        // An unlock only removes: it needs no grace period to wait out.
        (false, true) if m.lock.kind != LockKind::Unlock => Err(Errno::EAGAIN),
        (true, false) => Err(Errno::EPERM),
        _ => {
            let now = std::time::Instant::now();
            let (r, woken) = cx
                .st
                .locks
                .set(m.ino, cx.cs.id, m.owner, m.lock, m.wait, now);
            cx.fx.woken.extend(woken);
            r
        }
    };
    answer(m, r)
}

pub(super) fn get_lock(cx: &mut Ctx<'_>, m: &GetLock) -> Answer {
    let r = match cx.svc.recovery.reclaiming() {
        _ if !m.lock.is_valid() => Err(Errno::EINVAL),
        _ if !cx.cs.open.contains_key(&m.ino) => Err(Errno::EBADF),
        true => Err(Errno::EAGAIN),
        false => Ok(cx.st.locks.conflict(m.ino, cx.cs.id, m.owner, &m.lock)),
    };
    answer(m, r)
}

pub(super) fn cancel_wait(cx: &mut Ctx<'_>, m: &CancelWait) -> Answer {
    let woken = cx.st.locks.cancel_wait(m.ino, cx.cs.id, m.owner);
    cx.fx.woken.extend(woken);
    answer(m, Ok(()))
}

pub(super) fn drop_locks(cx: &mut Ctx<'_>, m: &DropLocks) -> Answer {
    let woken = cx.st.locks.drop_on(m.ino, cx.cs.id, Some(m.owner));
    cx.fx.woken.extend(woken);
    answer(m, Ok(()))
}
