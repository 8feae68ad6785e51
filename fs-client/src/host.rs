//! Facts about the host the mount runs on, read from /proc: who a requesting process is (its
//! supplementary groups), whether one of its threads still waits for a lock, and what this
//! kernel does with direct writes.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rfs_proto::types::Caller;

/// How long the supplementary groups read for a process are used again: a create asks twice
/// (its lookup, then the create), and a process making many files asks for each.
const GROUPS_KEPT: Duration = Duration::from_secs(1);

/// Who makes requests, for the metadata node's permission checks. FUSE gives the uid and gid;
/// the supplementary groups are the requesting process's, read from /proc (none if it has
/// exited since). A read costs about 15 us, so they are kept for [`GROUPS_KEPT`] per process
/// and credentials: a process whose groups change meanwhile (or a new one that takes its pid
/// with the same uid and gid) is checked with the old ones that long; its kernel checks it
/// with the new ones (`default_permissions`).
#[derive(Default)]
pub struct Callers {
    /// By (pid, uid, gid): the groups, and when they were read.
    groups: Mutex<HashMap<(u32, u32, u32), KeptGroups>>,
}

type KeptGroups = (Vec<u32>, Instant);

impl Callers {
    /// Most processes whose groups are kept; past it the list starts again.
    const MAX: usize = 1024;

    /// Process `pid`, running as `uid` and `gid`, with its supplementary groups.
    pub fn of(&self, pid: u32, uid: u32, gid: u32) -> Caller {
        let now = Instant::now();
        let kept = self
            .groups
            .lock()
            .unwrap()
            .get(&(pid, uid, gid))
            .and_then(|(g, at)| (now.duration_since(*at) < GROUPS_KEPT).then(|| g.clone()));
        let groups = kept.unwrap_or_else(|| {
            let g = groups_of(pid);
            let mut all = self.groups.lock().unwrap();
            if all.len() >= Self::MAX {
                all.clear();
            }
            all.insert((pid, uid, gid), (g.clone(), now));
            g
        });
        Caller { uid, gid, groups }
    }
}

/// The supplementary groups of process `pid`, from /proc (none if it has exited).
fn groups_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Groups:"))?;
            Some(
                line["Groups:".len()..]
                    .split_whitespace()
                    .filter_map(|g| g.parse().ok())
                    .collect(),
            )
        })
        .unwrap_or_default()
}

/// Whether thread `tid` still waits for the lock it asked for: no signal is pending for it
/// that it neither blocks nor ignores (the kernel, which does not interrupt a request the file
/// system holds, delivers it once the request is answered; a killed process has SIGKILL
/// pending in every thread; one sent to a process of several threads may go to another). A
/// thread we cannot look at (another pid namespace, hidepid, id 0) waits on: it cannot be gone
/// while its request is held, and an EINTR without a signal would reach it as a bogus errno.
pub fn still_waiting(tid: u32) -> bool {
    if tid == 0 {
        return true;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
        return true;
    };
    let mask = |field: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    // A signal sent to the process (alarm, kill) is the thread's too when it is the only one.
    let alone = status
        .lines()
        .any(|l| l.split_whitespace().eq(["Threads:", "1"]));
    let shared = if alone { mask("ShdPnd:") } else { 0 };
    (mask("SigPnd:") | shared) & !mask("SigBlk:") & !mask("SigIgn:") == 0
}

/// Whether this kernel drops the cached pages that a direct write overlaps (Linux 6.6 and
/// later; 6.1 does not, as a reviewer found in the Soft-RoCE VM): on an older one, other
/// handles of the file here would go on reading what they cached before the write, so no
/// handle goes around the page cache.
pub fn direct_writes_drop_cached_pages() -> bool {
    static DROPS: OnceLock<bool> = OnceLock::new();
    *DROPS.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .and_then(|r| kernel_version(&r))
            .is_some_and(|v| v >= (6, 6))
    })
}

/// (major, minor) of a kernel release such as "6.18.44-fc-v657".
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((numbers.next()?.parse().ok()?, numbers.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_give_their_version() {
        assert_eq!(kernel_version("6.18.44-fc-v657\n"), Some((6, 18)));
        assert_eq!(kernel_version("6.1.0-56-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("5.15"), Some((5, 15)));
        assert!(kernel_version("6.6.0") >= Some((6, 6)));
        assert_eq!(kernel_version("6"), None);
        assert_eq!(kernel_version("linux"), None);
    }

    #[test]
    fn a_caller_has_its_process_groups() {
        let me = std::process::id();
        let c = Callers::default().of(me, 0, 0);
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Groups:")).unwrap();
        assert_eq!(c.groups.len(), line.split_whitespace().count() - 1);
        assert!(
            Callers::default().of(u32::MAX, 5, 6).groups.is_empty(),
            "no such process"
        );
    }
}
