//! Space this mount is about to give back. The kernel sends a file's RELEASE after close(2)
//! has returned, and the release gives back the chunks allocated ahead of the file's writer
//! (up to 16): a writer that runs out of space moments after another file's close waits for
//! those chunks instead of failing with ENOSPC while they are on their way back.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long an allocation that found no space waits for this mount's releases, and how
/// recent a close must be for its release to be waited for. It is spent only when the pool is
/// short just after another file's close (a file merely held open is not waited for): a
/// release is a few calls, and this covers a loaded machine's scheduling delays.
pub(crate) const SPACE_WAIT: Duration = Duration::from_secs(2);

/// Releases of files we had chunks allocated for: those under way, and how many ended.
#[derive(Default)]
pub(crate) struct GivingBack {
    state: Mutex<Releases>,
    ended: Condvar,
}

#[derive(Default)]
struct Releases {
    under_way: usize,
    ended: u64,
}

impl GivingBack {
    /// A release that may give chunks back has begun: it ends when the guard goes, once the
    /// release has reached the metadata node (or failed).
    pub(crate) fn begin(&self) -> Releasing<'_> {
        self.state.lock().unwrap().under_way += 1;
        Releasing(self)
    }

    /// How many releases have ended: what [`Self::wait`] compares with.
    pub(crate) fn ended(&self) -> u64 {
        self.state.lock().unwrap().ended
    }

    /// Waits until a release has ended since `seen` (then space may have come back: true),
    /// or until `deadline`, or until nothing may give space back any more: no release under
    /// way and `others_closing()` false (no release is on its way from the kernel).
    pub(crate) fn wait(
        &self,
        seen: u64,
        deadline: Instant,
        others_closing: impl Fn() -> bool,
    ) -> bool {
        // Closes of other files do not signal: they are looked at again every few
        // milliseconds.
        const LOOK_AGAIN: Duration = Duration::from_millis(20);
        loop {
            let idle = {
                let s = self.state.lock().unwrap();
                if s.ended != seen {
                    return true;
                }
                s.under_way == 0
            };
            // Outside our lock: `others_closing` takes the file system's.
            if idle && !others_closing() {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let s = self.state.lock().unwrap();
            if s.ended != seen {
                return true;
            }
            let nap = (deadline - now).min(LOOK_AGAIN);
            drop(self.ended.wait_timeout(s, nap).unwrap());
        }
    }
}

/// A release under way (see [`GivingBack::begin`]).
pub(crate) struct Releasing<'a>(&'a GivingBack);

impl Drop for Releasing<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap();
        s.under_way -= 1;
        s.ended += 1;
        self.0.ended.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_wait_ends_with_a_release_at_its_deadline_or_when_nothing_can_give_back() {
        let g = Arc::new(GivingBack::default());
        let far = Instant::now() + Duration::from_secs(60);
        // Nothing under way, nothing closing: no wait at all.
        assert!(!g.wait(g.ended(), far, || false));
        // A release under way ends on another thread.
        let seen = g.ended();
        let (began, go) = std::sync::mpsc::channel();
        let ender = {
            let g = g.clone();
            std::thread::spawn(move || {
                let releasing = g.begin();
                began.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(30));
                drop(releasing);
            })
        };
        go.recv().unwrap();
        assert!(g.wait(seen, far, || false));
        ender.join().unwrap();
        // One ended since: no wait.
        assert!(g.wait(seen, far, || false));
        // Another file is closing and its release never comes: the deadline.
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(!g.wait(g.ended(), soon, || true));
        assert!(Instant::now() >= soon);
    }
}
