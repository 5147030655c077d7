//! The thin unsafe layer of `process`: fork, fd renumbering, pidfds, code addresses, the
//! environment. It depends on nothing else in `process`.
//!
//! Every function here whose soundness depends on its caller is an `unsafe fn` whose `# Safety`
//! section states the contract; each call site says, in a `// SAFETY:` comment, why it holds
//! there. Functions that are sound whatever their arguments stay safe.

use std::ffi::{CStr, c_int, c_void};
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use nix::unistd::{ForkResult, Pid};

use crate::error::SpawnRule;
use crate::{Error, Result};

/// Whether this process has exactly one thread (the caller), as `/proc/self/task` lists them;
/// `false` when that cannot be read.
///
/// A `true` answer stays true until the caller itself starts a thread: only a thread of a
/// process can add one.
pub(crate) fn is_single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| tasks.take(2).count() == 1)
}

/// `fork()`.
///
/// # Safety
/// The calling process must have exactly one thread. The child of a multi-threaded process
/// holds copies of locks (the allocator's, stdio's) that threads absent from it may have held
/// at the fork; the child can then deadlock or corrupt memory in any function that is not
/// async-signal-safe, which is almost all Rust code. With one thread, the child is a
/// consistent copy and may run arbitrary code.
pub(crate) unsafe fn fork_single_threaded() -> Result<ForkResult> {
    // SAFETY: the caller guarantees that this process has one thread, which is what
    // `nix::unistd::fork` requires for the child to run code that is not async-signal-safe.
    unsafe { nix::unistd::fork() }.map_err(|e| Error::errno("fork() in the forkserver", e))
}

/// Make fd `new` refer to what `old` refers to, without CLOEXEC, like dup2(2): whatever `new`
/// referred to before is closed.
///
/// # Safety
/// Fd `new` must not be owned by any object that will be used or dropped again (an `OwnedFd`,
/// `File`, `Channel`...); otherwise that owner would afterwards read, write or close a file it
/// does not own, the I/O-safety violation `OwnedFd` rules out. The standard streams 0, 1 and 2
/// count as unowned: std's handles refer to them by number and are meant to follow a
/// redirection.
pub(crate) unsafe fn dup2_raw(old: RawFd, new: RawFd) -> Result<()> {
    // SAFETY: dup2 itself only changes the fd table (an invalid `old` is an error, EBADF); the
    // caller guarantees that no live owner of `new` is affected by the replacement.
    if unsafe { libc::dup2(old, new) } < 0 {
        return Err(Error::last_os(format!("dup2({old}, {new})")));
    }
    Ok(())
}

/// Close every fd from `first` upwards, like close_range(2).
///
/// # Safety
/// No object that will be used or dropped again may own an fd numbered `first` or higher: it
/// would afterwards use or close a number that is closed, or reused for another file.
pub(crate) unsafe fn close_from(first: RawFd) {
    // SAFETY: close_range takes two numbers and flags and touches nothing but the fd table;
    // the caller guarantees that no live owner of a closed fd remains.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            0,
        )
    };
}

/// Take ownership of an fd known by number only (one a parent handed down at exec or fork),
/// after checking that it is open, and set CLOEXEC on it.
///
/// # Safety
/// Nothing else in this process that will be used or dropped again may own `raw`, and nothing
/// may take ownership of it later (call this once per number): the returned `OwnedFd` becomes
/// its only owner and closes it when dropped.
pub(crate) unsafe fn adopt_inherited_fd(raw: RawFd) -> Result<OwnedFd> {
    nix::fcntl::fcntl(
        // SAFETY: a borrow used only for the F_GETFD probe within this statement; F_GETFD on a
        // number that is not open fails with EBADF and changes nothing.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) },
        nix::fcntl::FcntlArg::F_GETFD,
    )
    .map_err(|e| Error::errno(format!("fcntl({raw}, F_GETFD) on the inherited channel"), e))?;
    // SAFETY: `raw` is open (just checked) and, as the caller guarantees, has no other owner.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(|e| Error::errno("fcntl(F_SETFD, FD_CLOEXEC) on the inherited channel", e))?;
    Ok(fd)
}

/// Remove an environment variable.
///
/// # Safety
/// No other thread may exist in this process (see [`is_single_threaded`]):
/// `std::env::remove_var` races with any other thread that reads or writes the environment,
/// including through libc (`getenv` in a C library), and nothing can rule that out otherwise.
pub(crate) unsafe fn remove_env_single_threaded(key: &str) {
    // SAFETY: the caller guarantees that this is the only thread, so no other thread can
    // read or write the environment concurrently.
    unsafe { std::env::remove_var(key) };
}

/// Set environment variables.
///
/// # Safety
/// No other thread may exist in this process (see [`is_single_threaded`]):
/// `std::env::set_var` races with any other thread that reads or writes the environment,
/// including through libc (`getenv` in a C library), and nothing can rule that out otherwise.
pub(crate) unsafe fn set_env_single_threaded(vars: &[(String, String)]) {
    for (key, value) in vars {
        // SAFETY: the caller guarantees that this is the only thread, so no other thread can
        // read or write the environment concurrently.
        unsafe { std::env::set_var(key, value) };
    }
}

/// A pidfd for a child of this process that has not been reaped (so `pid` is still it).
pub(crate) fn pidfd_open(pid: Pid) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; it touches no memory.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(Error::last_os(format!("pidfd_open({pid})")));
    }
    // SAFETY: the kernel just returned this fd (CLOEXEC by definition of pidfds); nothing else
    // knows it yet.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A new eventfd (counter 0), CLOEXEC and non-blocking: a wake-up a poller can wait on.
pub(crate) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: eventfd takes a counter value and flags and returns a new fd or -1; it touches no
    // memory.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(Error::last_os("eventfd"));
    }
    // SAFETY: the kernel just returned this fd; nothing else knows it yet.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Send SIGKILL through a pidfd: cannot hit a recycled pid.
pub(crate) fn pidfd_kill(pidfd: &OwnedFd) -> Result<()> {
    // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo, no flags; it
    // reads no memory of ours.
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

// ---------------------------------------------------------------- code addresses

/// The reference point for code addresses: a function's offset from it is the same in every
/// process running this executable, whatever ASLR did, provided both lie in the main
/// executable (see [`check_main_text`]).
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

/// The address ranges of the main executable's code in this process: its executable
/// (`PF_X`) `PT_LOAD` segments, where the loader mapped them. Computed once.
///
/// Empty when they cannot be found, so that nothing passes [`check_main_text`] then.
fn main_text() -> &'static [Range<usize>] {
    static TEXT: OnceLock<Vec<Range<usize>>> = OnceLock::new();
    TEXT.get_or_init(|| {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        // SAFETY: `first_object` matches the callback type, and `data` is a pointer to
        // `ranges`, which outlives the call and is accessed only through that pointer during it.
        unsafe { libc::dl_iterate_phdr(Some(first_object), (&raw mut ranges).cast::<c_void>()) };
        ranges
    })
}

/// `dl_iterate_phdr` callback: record the executable segments of the first object reported,
/// which is the main program (dl_iterate_phdr(3)), then stop.
///
/// # Safety
/// As `dl_iterate_phdr` calls it: `info` valid for the call, `data` a `*mut Vec<Range<usize>>`
/// that nothing else accesses during the call.
unsafe extern "C" fn first_object(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut c_void,
) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid `info` for the duration of the callback.
    let info = unsafe { &*info };
    // SAFETY: `data` is the `&mut Vec` that `main_text` passed, exclusively ours during the call.
    let ranges = unsafe { &mut *data.cast::<Vec<Range<usize>>>() };
    if info.dlpi_phdr.is_null() {
        return 1;
    }
    // SAFETY: `dlpi_phdr` points to the object's `dlpi_phnum` program headers, which the loader
    // keeps mapped for as long as the object is loaded (the main program: always).
    let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum.into()) };
    for header in headers {
        if header.p_type == libc::PT_LOAD && header.p_flags & libc::PF_X != 0 {
            let start = (info.dlpi_addr as usize).wrapping_add(header.p_vaddr as usize);
            ranges.push(start..start.saturating_add(header.p_memsz as usize));
        }
    }
    1
}

/// The file of the loaded object that contains `address`, if the loader knows one.
fn object_containing(address: usize) -> Option<String> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables and writes `info`, a valid `Dl_info`.
    let found = unsafe { libc::dladdr(address as *const c_void, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it filled `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a non-null `dli_fname` is a NUL-terminated string owned by the loader, valid
    // while the object stays loaded; it is copied at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

/// `Ok` when `address` lies in the main executable's code (see [`main_text`]); otherwise
/// [`Error::SpawnRefused`] ([`SpawnRule::Entry`]) naming `what`, the rule, and where the address lies instead.
///
/// A child finds a function by its offset from [`code_base`] in its own copy of the main
/// executable; code elsewhere (a shared library, mapped at another address in every process)
/// has no such offset.
pub(crate) fn check_main_text(address: usize, what: &str) -> Result<()> {
    if main_text().iter().any(|text| text.contains(&address)) {
        return Ok(());
    }
    let location = match object_containing(address) {
        Some(file) if !file.is_empty() => format!("it lies in {file}"),
        _ => "the loader knows no object there".to_owned(),
    };
    Err(Error::SpawnRefused {
        rule: SpawnRule::Entry,
        message: format!(
            "{what} (at {address:#x}) is not in the main executable's code ({location}): a \
             child finds its function by its offset in its own copy of the main executable, so \
             it must be a plain fn or non-capturing closure compiled into the executable, not \
             code from a shared library"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_text_holds_this_executable_and_not_libc() {
        for address in [
            code_base as fn() -> usize as usize,
            layout_probe as fn() -> usize as usize,
            main_text_holds_this_executable_and_not_libc as fn() as usize,
        ] {
            check_main_text(address, "a function of this executable").unwrap();
        }
        // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads the loader's
        // tables; the address is compared, never called.
        let getpid = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) } as usize;
        assert_ne!(getpid, 0);
        let refused = check_main_text(getpid, "getpid");
        assert!(
            matches!(&refused, Err(Error::SpawnRefused { rule: SpawnRule::Entry, message: m })
                if m.contains("libc")),
            "{refused:?}"
        );
    }
}
