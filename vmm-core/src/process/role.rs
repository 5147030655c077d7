//! How a process that vmm-core started takes its role (child or forkserver): the pre-`main`
//! hook, and [`init`].
//!
//! The role comes from an environment variable, and the environment is the caller's to choose:
//! any process can start any executable that links vmm-core (a daemon, a CLI, a setuid helper)
//! with `VMM_IPC_CHILD` set. So the variable alone grants nothing. A process takes a role only
//! when all of this holds, checked before the fd it names is touched:
//! - it is not a secure-exec process (`AT_SECURE`: setuid, setgid, file capabilities), whose
//!   environment belongs to a less privileged caller;
//! - vmm-core is part of the main executable (not a library loaded into another program);
//! - the fd it names (3 or above) is a Unix `SOCK_SEQPACKET` socket whose peer, by the
//!   kernel's credentials (`SO_PEERCRED`), is this process's parent (the pid the variable
//!   names, and `getppid()`), running as this process's effective uid (not the overflow uid of
//!   an unmapped user).
//!
//! Otherwise the variable is ignored (one line on stderr says why) and the fd is left alone:
//! the program runs as if it were not there. One case is not a stray variable but a child of
//! ours whose parent died before this hook ran (the kernel gave it another parent): the fd is
//! a channel made by the pid the variable names, running as this uid, and that pid is no
//! longer the parent. Such a child exits at once (status 120) without running `main`: a
//! program's `main` run by an orphaned child would be a second instance of the program, with
//! no arguments (a test binary would run its whole suite, whose children could end the same
//! way). A process that takes a role still runs only the entry points its own executable
//! registered (`entries`), whatever its parent sends.

use std::ffi::OsStr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;

use nix::sys::socket::{getsockopt, sockopt};
use nix::unistd::{Pid, getppid};

use super::child_runtime;
use super::ends::{ChildEnd, ServerEnd};
use super::entry;
use super::protocol::{MAX_ROLE_LEN, ROLE_VAR, Role};
use super::{server, sys};
use crate::error::StartMethod;
use crate::wire::endpoint::maybe_overflow_uid;

/// Set (to anything) to keep the pre-`main` hook from taking a child's role, so that only an
/// explicit [`init`] does: for debugging, and for testing what happens without it. The hook
/// still checks and adopts the channel; the role variable stays in the environment.
pub(crate) const NO_AUTO_INIT_VAR: &str = "VMM_IPC_NO_AUTO_INIT";

/// A role the pre-`main` hook accepted but did not take (under [`NO_AUTO_INIT_VAR`]): [`init`]
/// takes it.
static PENDING: Mutex<Option<Accepted>> = Mutex::new(None);

/// A role this process accepted: what it is, its channel (adopted), its parent.
#[derive(Debug)]
struct Accepted {
    role: Role,
    channel: OwnedFd,
    parent: Pid,
}

/// Runs before `main` in every executable that links vmm-core, so that a child (or the
/// forkserver) takes its role before a test harness or `main` starts threads or does work.
extern "C" fn before_main() {
    let Some(value) = std::env::var_os(ROLE_VAR) else {
        return;
    };
    let deferred = std::env::var_os(NO_AUTO_INIT_VAR).is_some();
    // The role variable is ours alone: keep it from reaching the user's code (its own
    // children are started without it anyway), whether or not it is accepted. Removing it needs
    // a single thread; before `main` that is the rule, and a process where a constructor
    // started a thread keeps it.
    if !deferred && sys::is_single_threaded() {
        // SAFETY: this process has one thread (just checked), and this thread starts none
        // before the call returns, so no other thread can read or write the environment.
        unsafe { sys::remove_env_single_threaded(ROLE_VAR) };
    }
    let accepted = match accept(&value) {
        Ok(accepted) => accepted,
        Err(why @ Refusal::Orphaned { .. }) => {
            eprintln!("vmm-ipc: {why}");
            std::process::exit(child_runtime::EXIT_ORPHANED);
        }
        Err(why) => {
            eprintln!("vmm-ipc: ignoring {ROLE_VAR}: {why}");
            return;
        }
    };
    if deferred {
        if let Ok(mut pending) = PENDING.lock() {
            *pending = Some(accepted);
        }
        return;
    }
    take(accepted)
}

#[used]
#[unsafe(link_section = ".init_array")]
static BEFORE_MAIN: extern "C" fn() = before_main;

/// Take this process's role if vmm-core started it as a child or forkserver (then it never
/// returns); otherwise do nothing.
///
/// Every executable that links vmm-core already does this before `main`, through an
/// `.init_array` hook, which is also where the role is checked and its channel adopted (so
/// this function never takes an fd by number). Call it anyway as the first line of `main` in
/// binaries that start children (examples, bench mains): it documents the requirement, and it
/// takes a role the hook accepted but deferred (`VMM_IPC_NO_AUTO_INIT`).
pub fn init() {
    let pending = PENDING.lock().ok().and_then(|mut pending| pending.take());
    if let Some(accepted) = pending {
        take(accepted);
    }
}

/// Why the role variable was ignored (one line on stderr says it): see the module docs.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error(
        "this is a secure-exec process (setuid, setgid or file capabilities), whose environment \
         is its caller's"
    )]
    SecureExec,
    #[error("vmm-core is not part of the main executable here")]
    NotInMainExecutable,
    /// Not a value `Role::encode` writes; shown up to [`MAX_ROLE_LEN`] characters.
    #[error("malformed value {0:?}")]
    Malformed(String),
    #[error("it names pid {named} as the parent, and this process's parent is {actual}")]
    NotTheParent { named: Pid, actual: Pid },
    /// Not ignored: the process exits (see the module docs).
    #[error(
        "this child's parent (pid {parent}, whose channel it holds) exited before it started: \
         exiting without running main"
    )]
    Orphaned { parent: Pid },
    #[error("fd {0} is not open")]
    NotOpen(i32),
    #[error("fd {0} is not a socket")]
    NotASocket(i32),
    #[error("fd {0} is not a Unix SOCK_SEQPACKET socket")]
    NotSeqpacket(i32),
    /// A call that reads the fd's metadata failed.
    #[error("{call} on fd {fd}: {errno}")]
    Unreadable {
        call: &'static str,
        fd: i32,
        errno: nix::errno::Errno,
    },
    #[error("fd {fd}'s peer is pid {peer}, not the parent (pid {parent})")]
    PeerNotTheParent { fd: i32, peer: i32, parent: Pid },
    #[error("fd {fd}'s peer runs as uid {peer}, and this process as uid {euid}")]
    PeerUid { fd: i32, peer: u32, euid: u32 },
    #[error(
        "this process runs as the overflow uid {0} (its user is not mapped in its user \
         namespace, or /proc/sys/kernel/overflowuid cannot be read), so its parent cannot be \
         told apart from other unmapped users"
    )]
    OverflowUid(u32),
    #[error("fd {fd} is unusable: {error}")]
    Unusable { fd: i32, error: crate::Error },
}

/// Become what `accepted` says. Never returns.
fn take(accepted: Accepted) -> ! {
    child_runtime::die_with(accepted.parent);
    match accepted.role {
        Role::Spawn => entry::run_child(ChildEnd::from_fd(accepted.channel), StartMethod::Spawn),
        Role::Forkserver => server::serve(ServerEnd::from_fd(accepted.channel)),
        Role::Warm { devices } => entry::run_warm(ChildEnd::from_fd(accepted.channel), &devices),
    }
}

/// Check the role variable's `value` and what it names (see the module docs); adopt its
/// channel if everything holds. `Err` says why not; nothing is touched then.
fn accept(value: &OsStr) -> Result<Accepted, Refusal> {
    // SAFETY: getauxval reads the auxiliary vector the kernel gave this process; no
    // precondition.
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        return Err(Refusal::SecureExec);
    }
    if sys::check_main_text(sys::code_base as fn() -> usize as usize, "vmm-core").is_err() {
        return Err(Refusal::NotInMainExecutable);
    }
    let (role, fd, parent) = Role::parse(value.as_bytes()).ok_or_else(|| {
        Refusal::Malformed(value.to_string_lossy().chars().take(MAX_ROLE_LEN).collect())
    })?;
    let parent = Pid::from_raw(parent as i32);
    check_channel(fd, parent)?;
    // SAFETY: `fd` is open (checked), is a Unix socket whose peer is our parent (checked), and
    // was named by the role variable, which only this function reads, once per process (from
    // the pre-`main` hook). An fd open since exec cannot have been returned by any open or dup
    // in this process, and before `main` nothing else has had a chance to take it.
    let channel =
        unsafe { sys::adopt_inherited_fd(fd) }.map_err(|error| Refusal::Unusable { fd, error })?;
    Ok(Accepted {
        role,
        channel,
        parent,
    })
}

/// `Ok` when fd `fd` is a Unix `SOCK_SEQPACKET` socket whose peer (by `SO_PEERCRED`) is
/// `parent`, which is this process's parent and runs as this process's effective uid (not
/// the overflow uid). Only reads the fd's metadata. [`Refusal::Orphaned`] when all of it holds
/// but `parent` is no longer this process's parent.
fn check_channel(fd: i32, parent: Pid) -> Result<(), Refusal> {
    let channel = check_socket(fd, parent);
    let actual = getppid();
    if actual != parent {
        return Err(match channel {
            Ok(()) => Refusal::Orphaned { parent },
            Err(_) => Refusal::NotTheParent {
                named: parent,
                actual,
            },
        });
    }
    channel
}

/// `Ok` when fd `fd` is a Unix `SOCK_SEQPACKET` socket whose peer (by `SO_PEERCRED`) is
/// `parent`, running as this process's effective uid (not the overflow uid).
fn check_socket(fd: i32, parent: Pid) -> Result<(), Refusal> {
    // SAFETY: F_GETFD on any number only reads the fd table (EBADF for one not open).
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(Refusal::NotOpen(fd));
    }
    // SAFETY: `fd` is open (just checked) and stays open for this function: nothing in this
    // process closes an fd it does not own, and no code has owned this one yet (see `accept`).
    let socket = unsafe { BorrowedFd::borrow_raw(fd) };
    let unreadable = |call| move |errno| Refusal::Unreadable { call, fd, errno };
    let stat = nix::sys::stat::fstat(socket).map_err(unreadable("fstat"))?;
    if stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(Refusal::NotASocket(fd));
    }
    let domain = socket_option(socket, libc::SO_DOMAIN).map_err(unreadable("SO_DOMAIN"))?;
    let kind = socket_option(socket, libc::SO_TYPE).map_err(unreadable("SO_TYPE"))?;
    if domain != libc::AF_UNIX || kind != libc::SOCK_SEQPACKET {
        return Err(Refusal::NotSeqpacket(fd));
    }
    let peer = getsockopt(&socket, sockopt::PeerCredentials).map_err(unreadable("SO_PEERCRED"))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if peer.pid() != parent.as_raw() {
        return Err(Refusal::PeerNotTheParent {
            fd,
            peer: peer.pid(),
            parent,
        });
    }
    if peer.uid() != euid {
        return Err(Refusal::PeerUid {
            fd,
            peer: peer.uid(),
            euid,
        });
    }
    if maybe_overflow_uid(euid) {
        return Err(Refusal::OverflowUid(euid));
    }
    Ok(())
}

/// An `int` socket option of `socket`.
fn socket_option(
    socket: BorrowedFd<'_>,
    option: libc::c_int,
) -> Result<libc::c_int, nix::errno::Errno> {
    let mut value: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes to `value`, an int that lives across the
    // call, and `len` says its size; `socket` is a borrowed, open fd.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SOL_SOCKET,
            option,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    if rc < 0 {
        return Err(nix::errno::Errno::last());
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_value_is_refused_before_anything_is_touched() {
        // Checked after the secure-exec and main-executable checks, which hold in a test binary.
        let value = format!("spawn:3:{}", "9".repeat(4 * MAX_ROLE_LEN));
        match accept(OsStr::new(&value)) {
            Err(Refusal::Malformed(shown)) => assert_eq!(shown.len(), MAX_ROLE_LEN),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_role_naming_another_parent_is_refused() {
        // Well formed, but not this process's parent.
        let value = Role::Spawn.encode(3, getppid().as_raw() as u32 + 1);
        assert!(matches!(
            accept(OsStr::new(&value)),
            Err(Refusal::NotTheParent { .. })
        ));
    }

    #[test]
    fn a_role_naming_an_fd_that_is_not_open_is_refused() {
        let value = Role::Forkserver.encode(1_000_000, getppid().as_raw() as u32);
        assert!(matches!(
            accept(OsStr::new(&value)),
            Err(Refusal::NotOpen(1_000_000))
        ));
    }

    #[test]
    fn a_role_naming_a_pipe_is_refused() {
        let (read, _write) = nix::unistd::pipe().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&read);
        let value = Role::Warm { devices: vec![0] }.encode(fd, getppid().as_raw() as u32);
        assert!(matches!(
            accept(OsStr::new(&value)),
            Err(Refusal::NotASocket(refused)) if refused == fd
        ));
    }
}
