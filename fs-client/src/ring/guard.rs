//! Shared memory of an application, mapped here under a guard. The application can take a page
//! of it away (punch a hole in its memfd); touching that page again faults it back in, and
//! where it cannot come back (a host with strict overcommit, `vm.overcommit_memory=2`, at its
//! commit limit) the kernel sends SIGBUS, which would kill fs-client and every mount user with
//! it. Under the guard, such a fault maps a spare page of fs-client's own (allocated up front,
//! so mapping it costs no memory) in its place and marks the mapping spoilt; the access goes
//! on, and the ring that owns the mapping ends. Faults anywhere else go to the handler that was
//! there before (Rust's stack-overflow handler, or the default: a crash, as without us); a
//! SIGBUS sent by a process rather than raised by a fault is ignored.

use std::io;
use std::os::fd::IntoRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

use rdmabox::transport::ExternalMemory;
use rfs_io::shm::SharedMemory;

/// How many mappings may be guarded at once (each ring has two; a mount serves 256 rings).
const SLOTS: usize = 1024;

/// One guarded range; `len` 0 when free.
struct Slot {
    taken: AtomicBool,
    start: AtomicUsize,
    len: AtomicUsize,
    spoilt: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // a template for the array, each slot its own
const FREE: Slot = Slot {
    taken: AtomicBool::new(false),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    spoilt: AtomicBool::new(false),
};

static GUARDED: [Slot; SLOTS] = [FREE; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// The page put in place of one that cannot come back: one page of a memfd of our own,
/// allocated up front and shared by every spoilt mapping (what lands there is lost anyway).
static SPARE: AtomicI32 = AtomicI32::new(-1);
/// The SIGBUS disposition before ours, set before ours is installed.
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
/// Whether ours is installed.
static INSTALLED: OnceLock<io::Result<()>> = OnceLock::new();

/// Shared memory mapped under the guard; a read may land in it.
pub(super) struct GuardedMemory {
    slot: usize,
    memory: SharedMemory,
}

impl GuardedMemory {
    /// Guards `memory` (refused when the handler cannot be installed, or every slot is taken).
    pub(super) fn new(memory: SharedMemory) -> io::Result<GuardedMemory> {
        if let Err(e) = INSTALLED.get_or_init(install) {
            return Err(io::Error::new(e.kind(), format!("SIGBUS guard: {e}")));
        }
        let slot = (0..SLOTS)
            .find(|&i| {
                GUARDED[i]
                    .taken
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            })
            .ok_or_else(|| io::Error::other("every guarded mapping slot is taken"))?;
        let s = &GUARDED[slot];
        s.spoilt.store(false, Ordering::Release);
        s.start.store(memory.as_ptr() as usize, Ordering::Release);
        s.len.store(memory.len(), Ordering::Release);
        Ok(GuardedMemory { slot, memory })
    }

    /// Whether a page of it failed to come back (it is ours alone now, not the application's).
    pub(super) fn spoilt(&self) -> bool {
        GUARDED[self.slot].spoilt.load(Ordering::Acquire)
    }
}

impl std::ops::Deref for GuardedMemory {
    type Target = SharedMemory;
    fn deref(&self) -> &SharedMemory {
        &self.memory
    }
}

impl Drop for GuardedMemory {
    fn drop(&mut self) {
        let s = &GUARDED[self.slot];
        s.len.store(0, Ordering::Release);
        s.start.store(0, Ordering::Release);
        s.taken.store(false, Ordering::Release);
        // The mapping goes after this (the field drops once the guard is off).
    }
}

// SAFETY: the mapping stays mapped, read-write, at the same place while `memory` lives (a page
// the guard replaces stays mapped and writable too), and is reached only through raw pointers
// and atomics (SharedMemory's rule).
unsafe impl ExternalMemory for GuardedMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.memory.as_ptr()
    }
    fn len(&self) -> usize {
        self.memory.len()
    }
}

fn install() -> io::Result<()> {
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    };
    PAGE.store(page, Ordering::Release);
    let spare =
        nix::sys::memfd::memfd_create(c"rfs-ring-spare", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    nix::unistd::ftruncate(&spare, page as libc::off_t)?;
    // Written once, so that the page exists before any fault needs it.
    nix::sys::uio::pwrite(&spare, &vec![0u8; page], 0)?;
    SPARE.store(spare.into_raw_fd(), Ordering::Release);
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; `previous` is
    // written by the first call (a query), and leaked so that the handler may read it at any
    // time; ours is an `extern "C"` function of the SA_SIGINFO signature.
    unsafe {
        let previous: &mut libc::sigaction = Box::leak(Box::new(std::mem::zeroed()));
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), previous) != 0 {
            return Err(io::Error::last_os_error());
        }
        PREVIOUS.store(previous, Ordering::Release);
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Async-signal-safe: atomics, mmap and sigaction only.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code <= 0 {
        // Sent by a process (kill, sigqueue): no fault to mend, and nothing to die of.
        return;
    }
    let page = PAGE.load(Ordering::Acquire);
    for s in &GUARDED {
        let len = s.len.load(Ordering::Acquire);
        let start = s.start.load(Ordering::Acquire);
        if len == 0 || addr < start || addr - start >= len || s.len.load(Ordering::Acquire) != len {
            continue;
        }
        // SAFETY: the page lies inside a mapping of ours that stays mapped while guarded;
        // replacing it with our spare page changes no memory Rust code holds references to
        // (shared memory is reached by raw pointers only). A shared mapping of a page that
        // exists charges no memory, so this works where the fault came from memory running out.
        let fixed = unsafe {
            libc::mmap(
                (addr & !(page - 1)) as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                SPARE.load(Ordering::Acquire),
                0,
            )
        };
        if fixed != libc::MAP_FAILED {
            s.spoilt.store(true, Ordering::Release);
            return;
        }
        break;
    }
    pass_on(sig, info, ctx);
}

/// Hands a fault that is not ours to the disposition before ours.
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let previous = PREVIOUS.load(Ordering::Acquire);
    if previous.is_null() {
        return default_and_refault(sig);
    }
    // SAFETY: set once, before our handler was installed, and never freed.
    let previous = unsafe { *previous };
    let handler = previous.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        return default_and_refault(sig);
    }
    if previous.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: an SA_SIGINFO handler has this signature, as the kernel would call it.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a plain handler has this signature.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

/// The default action: returning re-runs the faulting access, which then kills the process
/// as an unhandled fault does.
fn default_and_refault(sig: libc::c_int) {
    // SAFETY: signal() with SIG_DFL is async-signal-safe and has no memory preconditions.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, OwnedFd};

    use nix::sys::memfd::{memfd_create, MFdFlags};
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};

    /// A memfd of two pages mapped shared, without seals (so the test can take its second
    /// page away), and the descriptor.
    fn two_pages() -> (OwnedFd, *mut u8, usize) {
        let page = PAGE.load(Ordering::Acquire).max(4096);
        let fd = memfd_create(c"guard-test", MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&fd, 2 * page as libc::off_t).unwrap();
        // SAFETY: a new shared mapping of a memfd of ours.
        let ptr = unsafe {
            mmap(
                None,
                std::num::NonZeroUsize::new(2 * page).unwrap(),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .unwrap();
        (fd, ptr.as_ptr().cast(), page)
    }

    #[test]
    fn a_page_that_cannot_come_back_is_replaced_and_the_mapping_spoilt() {
        let memory = rfs_io::shm::SharedMemory::create(c"guarded", 8192).unwrap();
        let guarded = GuardedMemory::new(memory).unwrap();
        assert!(!guarded.spoilt());
        // A range past the end of its file faults with SIGBUS as a page that cannot come back
        // does: map one, under a guard slot of its own, and touch it.
        let (fd, ptr, page) = two_pages();
        nix::unistd::ftruncate(&fd, page as libc::off_t).unwrap();
        let s = &GUARDED[guarded.slot];
        s.start.store(ptr as usize, Ordering::Release);
        s.len.store(2 * page, Ordering::Release);
        // Sent, not raised by a fault: ignored (neither fatal nor a spoilt mapping).
        // SAFETY: raise has no memory preconditions.
        assert_eq!(unsafe { libc::raise(libc::SIGBUS) }, 0);
        assert!(!guarded.spoilt());
        // SAFETY: inside the test's mapping; its second page now lies past the file's end.
        unsafe {
            ptr.add(page + 8).write_volatile(42);
            assert_eq!(ptr.add(page + 8).read_volatile(), 42, "the spare page now");
            ptr.write_volatile(7);
        }
        assert!(guarded.spoilt());
        let mut first = [0u8; 1];
        nix::sys::uio::pread(&fd, &mut first, 0).unwrap();
        assert_eq!(first, [7], "the first page is still the file's");
        drop(guarded);
        assert_eq!(s.len.load(Ordering::Acquire), 0, "the slot is free again");
    }

    #[test]
    fn a_fault_outside_every_guarded_mapping_still_kills() {
        let _installed = GuardedMemory::new(SharedMemory::create(c"g", 4096).unwrap()).unwrap();
        let (fd, ptr, page) = two_pages();
        nix::unistd::ftruncate(&fd, page as libc::off_t).unwrap();
        // SAFETY: the child only writes memory and exits; the parent waits for it.
        match unsafe { libc::fork() } {
            0 => {
                // SAFETY: past the file's end: SIGBUS, which nothing guards.
                unsafe { ptr.add(page).write_volatile(1) };
                // SAFETY: _exit is async-signal-safe; reached only if the fault was survived.
                unsafe { libc::_exit(0) }
            }
            child => {
                let mut status = 0;
                // SAFETY: waits for our own child.
                assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
                assert!(libc::WIFSIGNALED(status), "status {status:#x}");
                assert_eq!(libc::WTERMSIG(status), libc::SIGBUS);
            }
        }
    }
}
