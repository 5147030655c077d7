//! The thin unsafe layer of `process`: fork, fd renumbering, pidfds, code addresses, the
//! pre-`main` hook. Everything above it is safe code.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::unistd::{ForkResult, Pid};

use crate::{Error, Result};

/// `fork()` for the forkserver only.
///
/// Callers must be single-threaded (the forkserver is, by construction), so the child can run
/// arbitrary code: no lock can be held by a thread that does not exist in the child.
pub(crate) fn fork_single_threaded() -> Result<ForkResult> {
    // SAFETY: the forkserver never starts a thread (see forkserver::serve), so the child gets a
    // consistent copy of every lock and allocator state.
    unsafe { nix::unistd::fork() }.map_err(|e| Error::errno("fork", e))
}

/// Make `new` refer to what `old` refers to (clearing CLOEXEC on `new`), like dup2(2).
pub(crate) fn dup2_raw(old: RawFd, new: RawFd) -> Result<()> {
    // SAFETY: dup2 only changes the fd table; `new` is a standard stream or a number this
    // process reserves for itself in a freshly forked child.
    if unsafe { libc::dup2(old, new) } < 0 {
        return Err(Error::last_os(format!("dup2({old}, {new})")));
    }
    Ok(())
}

/// Close every fd from `first` upwards (close_range(2)); used in a forked child.
pub(crate) fn close_from(first: RawFd) {
    // SAFETY: called in a freshly forked, single-threaded child that owns no Rust object
    // referring to those fds any more (the parent's handles are forgotten by the caller).
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            0,
        )
    };
}

/// A pidfd for a child of this process that has not been reaped (so `pid` is still it).
pub(crate) fn pidfd_open(pid: Pid) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(Error::last_os(format!("pidfd_open({pid})")));
    }
    // SAFETY: the kernel just returned this fd (CLOEXEC by definition of pidfds).
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Send SIGKILL through a pidfd: cannot hit a recycled pid.
pub(crate) fn pidfd_kill(pidfd: &OwnedFd) -> Result<()> {
    // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        // ESRCH: it has exited already, which is what we wanted.
        if err.raw_os_error() != Some(libc::ESRCH) {
            return Err(Error::io("pidfd_send_signal(SIGKILL)", err));
        }
    }
    Ok(())
}

/// The reference point for code addresses: a function's offset from it is the same in every
/// process running this executable, whatever ASLR did.
#[inline(never)]
pub(crate) fn code_base() -> usize {
    std::hint::black_box(0x5eed_0001)
}

/// A second marker: its offset from [`code_base`] tells whether another process runs the same
/// executable image (a mismatch means the offsets we send would point at garbage there).
#[inline(never)]
pub(crate) fn layout_probe() -> usize {
    std::hint::black_box(0x5eed_0002)
}

/// The offset of a code address from [`code_base`].
pub(crate) fn code_offset(address: usize) -> isize {
    address.wrapping_sub(code_base as fn() -> usize as usize) as isize
}

/// The trampoline every child runs: deserialise the argument, call the user's function.
pub(crate) type Trampoline = fn(func: usize, args: &[u8], fds: Vec<OwnedFd>) -> Result<(), String>;

/// Turn offsets received from the parent back into the trampoline and the user function.
///
/// `layout` is the parent's offset of [`layout_probe`]; a mismatch is refused.
pub(crate) fn resolve_entry(
    layout: isize,
    trampoline: isize,
    func: isize,
) -> Result<(Trampoline, usize)> {
    let here = code_offset(layout_probe as fn() -> usize as usize);
    if here != layout {
        return Err(Error::Protocol(format!(
            "the child runs a different executable image than its parent (layout {here} vs \
             {layout}); was the binary rebuilt while the test ran?"
        )));
    }
    let base = code_base as fn() -> usize as usize;
    let trampoline_addr = base.wrapping_add(trampoline as usize);
    // SAFETY: the parent computed `trampoline` from a `Trampoline` fn pointer in the same
    // executable image (checked through `layout` above), so base + offset is that function here.
    let trampoline: Trampoline =
        unsafe { std::mem::transmute::<usize, Trampoline>(trampoline_addr) };
    Ok((trampoline, base.wrapping_add(func as usize)))
}

/// Call a `fn(A)` given its address.
///
/// # Safety
/// `address` must be the address of a `fn(A)` in this executable, with this exact `A`.
pub(crate) unsafe fn call_fn_at<A>(address: usize, arg: A) {
    // SAFETY: guaranteed by the caller.
    let f: fn(A) = unsafe { std::mem::transmute::<usize, fn(A)>(address) };
    f(arg)
}

/// Remove an environment variable while the process is still single-threaded (before `main`).
pub(crate) fn remove_env_before_main(key: &str) {
    // SAFETY: only called from the `.init_array` hook, which runs before `main` and therefore
    // before any other thread exists that could read the environment concurrently.
    unsafe { std::env::remove_var(key) };
}

/// Runs before `main` in every executable that links vmm-core, so that a child (or the
/// forkserver) takes its role before a test harness or `main` starts threads or does work.
extern "C" fn before_main() {
    super::entry::init_before_main();
}

#[used]
#[unsafe(link_section = ".init_array")]
static BEFORE_MAIN: extern "C" fn() = before_main;

/// Take ownership of the channel fd a parent handed down at exec, named in our role variable.
///
/// Checked to be open; called once per process (the role is taken once).
pub(crate) fn adopt_inherited_fd(raw: RawFd) -> Result<OwnedFd> {
    nix::fcntl::fcntl(
        // SAFETY: only used for the F_GETFD probe below, within this statement.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) },
        nix::fcntl::FcntlArg::F_GETFD,
    )
    .map_err(|e| Error::errno(format!("fcntl({raw}, F_GETFD) on the inherited channel"), e))?;
    // SAFETY: the parent passed this fd to this process at exec for exactly this use, the role
    // variable that names it is read once per process, and nothing else in the process knows
    // the number, so this is the only owner.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(|e| Error::errno("fcntl(F_SETFD, FD_CLOEXEC) on the inherited channel", e))?;
    Ok(fd)
}

/// Set environment variables while the process is single-threaded (a child before it runs the
/// user's function).
pub(crate) fn set_env_single_threaded(vars: &[(String, String)]) {
    for (key, value) in vars {
        // SAFETY: called in a child before the user's function runs: either before `main`, or
        // right after fork in the single-threaded forkserver's child, or from `init()`, which
        // is documented to be the first line of `main`; no other thread exists yet.
        unsafe { std::env::set_var(key, value) };
    }
}
