//! How a process that vmm-core started takes its role (child or forkserver): the pre-`main`
//! hook, and [`init`] for executables where such hooks do not run.

use std::sync::atomic::{AtomicBool, Ordering};

use nix::unistd::Pid;

use super::child::{self, EXIT_NO_START};
use super::entry;
use super::method::StartMethod;
use super::protocol::ROLE_VAR;
use super::{server, sys};
use crate::wire::Channel;

static ROLE_TAKEN: AtomicBool = AtomicBool::new(false);

/// Set (to anything) to keep the pre-`main` hook from taking a child's role, so that only an
/// explicit [`init`] does: for debugging, and for testing what happens without it.
pub(crate) const NO_AUTO_INIT_VAR: &str = "VMM_IPC_NO_AUTO_INIT";

/// Runs before `main` in every executable that links vmm-core, so that a child (or the
/// forkserver) takes its role before a test harness or `main` starts threads or does work.
extern "C" fn before_main() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    if std::env::var_os(NO_AUTO_INIT_VAR).is_some() {
        return;
    }
    // The role variable is ours alone: keep it from reaching the user's code (its own
    // children are started without it anyway). Removing it needs a single thread; before
    // `main` that is the rule, and a process where a constructor started a thread keeps it.
    if sys::is_single_threaded() {
        // SAFETY: this process has one thread (just checked), and this thread starts none
        // before the call returns, so no other thread can read or write the environment.
        unsafe { sys::remove_env_single_threaded(ROLE_VAR) };
    }
    take_role(&role);
}

#[used]
#[unsafe(link_section = ".init_array")]
static BEFORE_MAIN: extern "C" fn() = before_main;

/// Take this process's role if vmm-core started it as a child or forkserver (then it never
/// returns); otherwise do nothing.
///
/// Every executable that links vmm-core already does this before `main`, through an
/// `.init_array` hook. Call it anyway as the first line of `main` in binaries that start
/// children (examples, bench mains): it documents the requirement and keeps working where
/// such hooks do not run.
pub fn init() {
    if ROLE_TAKEN.load(Ordering::Acquire) {
        return;
    }
    if let Ok(role) = std::env::var(ROLE_VAR) {
        take_role(&role);
    }
}

fn take_role(value: &str) {
    let parsed = (|| {
        let mut parts = value.splitn(4, ':');
        let kind = parts.next()?;
        let fd = parts.next()?.parse().ok()?;
        let parent = parts.next()?.parse().ok()?;
        Some((kind, fd, Pid::from_raw(parent), parts.next()))
    })();
    let Some((kind, fd, parent, arg)) = parsed else {
        eprintln!("vmm-ipc: ignoring malformed {ROLE_VAR}={value:?}");
        return;
    };
    if ROLE_TAKEN.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: the parent handed this process fd `fd` open across exec for this use alone and
    // named it in the role variable. A number that has been open since exec cannot have been
    // returned by any open or dup in this process, so no other owner exists unless code read
    // the role variable, and only this function does, once per process (`ROLE_TAKEN`).
    let channel = match unsafe { sys::adopt_inherited_fd(fd) } {
        Ok(fd) => Channel::from_fd(fd),
        Err(e) => {
            eprintln!("vmm-ipc: {ROLE_VAR} names fd {fd}, which is unusable: {e}");
            std::process::exit(EXIT_NO_START);
        }
    };
    child::die_with(parent);
    match kind {
        "spawn" => entry::run_child(channel, StartMethod::Spawn),
        "forkserver" => server::serve(channel),
        "warm" => {
            let devices = parse_devices(arg.unwrap_or(""));
            entry::run_warm(channel, &devices)
        }
        other => {
            eprintln!("vmm-ipc: unknown role {other:?} in {ROLE_VAR}");
            std::process::exit(EXIT_NO_START);
        }
    }
}

/// A warm child's devices, as the role variable lists them (`0,1`; empty for none). Entries
/// that are not numbers are ignored: warming up is an optimisation, never a reason to fail.
fn parse_devices(list: &str) -> Vec<usize> {
    list.split(',')
        .filter_map(|d| d.trim().parse().ok())
        .collect()
}
