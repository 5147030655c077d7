//! The child side: take the role named by the environment, run the function, report, exit.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::Signal;
use nix::unistd::{Pid, getppid};

use super::protocol::{Outcome, ROLE_VAR, Report, Start};
use super::{StartMethod, forkserver, sys};
use crate::wire::{self, Channel};

/// Exit codes of a child that did not get as far as its function.
pub(crate) const EXIT_ORPHANED: i32 = 120;
pub(crate) const EXIT_NO_START: i32 = 121;
pub(crate) const EXIT_PANICKED: i32 = 101;
pub(crate) const EXIT_NOT_RUN: i32 = 122;

static ROLE_TAKEN: AtomicBool = AtomicBool::new(false);

/// Set (to anything) to keep the pre-`main` hook from taking a child's role, so that only an
/// explicit [`init`](super::init) does: for debugging, and for testing what happens without it.
pub(crate) const NO_AUTO_INIT_VAR: &str = "VMM_IPC_NO_AUTO_INIT";

/// Called from the `.init_array` hook.
pub(crate) fn init_before_main() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    if std::env::var_os(NO_AUTO_INIT_VAR).is_some() {
        return;
    }
    sys::remove_env_before_main(ROLE_VAR);
    take_role(&role);
}

/// Take this process's role if it was started as a child or forkserver; see `process::init`.
pub(crate) fn init() {
    if ROLE_TAKEN.load(Ordering::Acquire) {
        return;
    }
    if let Ok(role) = std::env::var(ROLE_VAR) {
        take_role(&role);
    }
}

fn take_role(value: &str) {
    let parsed = (|| {
        let mut parts = value.splitn(3, ':');
        let kind = parts.next()?;
        let fd = parts.next()?.parse().ok()?;
        let parent = parts.next()?.parse().ok()?;
        Some((kind, fd, Pid::from_raw(parent)))
    })();
    let Some((kind, fd, parent)) = parsed else {
        eprintln!("vmm-ipc: ignoring malformed {ROLE_VAR}={value:?}");
        return;
    };
    if ROLE_TAKEN.swap(true, Ordering::AcqRel) {
        return;
    }
    let channel = match sys::adopt_inherited_fd(fd) {
        Ok(fd) => Channel::from_fd(fd),
        Err(e) => {
            eprintln!("vmm-ipc: {ROLE_VAR} names fd {fd}, which is unusable: {e}");
            std::process::exit(EXIT_NO_START);
        }
    };
    die_with(parent);
    match kind {
        "spawn" => run_child(channel, StartMethod::Spawn),
        "forkserver" => forkserver::serve(channel),
        other => {
            eprintln!("vmm-ipc: unknown role {other:?} in {ROLE_VAR}");
            std::process::exit(EXIT_NO_START);
        }
    }
}

/// Be killed when `parent` dies; exit now if it already has.
pub(crate) fn die_with(parent: Pid) {
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    if getppid() != parent {
        std::process::exit(EXIT_ORPHANED);
    }
}

/// The first panic of this child, recorded by the hook for the report.
static FIRST_PANIC: Mutex<Option<(String, Option<String>)>> = Mutex::new(None);

fn record_panics() {
    let default = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        let message = info
            .payload_as_str()
            .map_or_else(|| "Box<dyn Any>".to_owned(), str::to_owned);
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
        if let Ok(mut first) = FIRST_PANIC.lock() {
            first.get_or_insert((message, location));
        }
        default(info);
    }));
}

/// Run the child: take the start message, acknowledge, run the function, report, exit.
pub(crate) fn run_child(channel: Channel, method: StartMethod) -> ! {
    let Ok(message) = channel.recv(None) else {
        // The parent went away before sending the start message.
        std::process::exit(EXIT_NO_START);
    };
    let start: Start = match wire::decode(&message.bytes, Vec::new()) {
        Ok(start) => start,
        Err(e) => {
            eprintln!("vmm-ipc: malformed start message: {e}");
            std::process::exit(EXIT_NO_START);
        }
    };
    if channel.send_value(&Report::Started).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    debug_assert_eq!(start.method, method);
    sys::set_env_single_threaded(&start.env);
    record_panics();
    let outcome = run_function(&start, message.fds);
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let code = match &outcome {
        Outcome::Returned => 0,
        Outcome::Panicked { .. } => EXIT_PANICKED,
        Outcome::NotRun(_) => EXIT_NOT_RUN,
    };
    let _ = channel.send_value(&Report::Finished(outcome));
    drop(channel);
    std::process::exit(code)
}

fn run_function(start: &Start, fds: Vec<OwnedFd>) -> Outcome {
    let (trampoline, func) = match sys::resolve_entry(start.layout, start.trampoline, start.func) {
        Ok(entry) => entry,
        Err(e) => return Outcome::NotRun(e.to_string()),
    };
    match panic::catch_unwind(AssertUnwindSafe(|| trampoline(func, &start.args, fds))) {
        Ok(Ok(())) => Outcome::Returned,
        Ok(Err(message)) => Outcome::NotRun(message),
        Err(payload) => {
            let recorded = FIRST_PANIC.lock().ok().and_then(|mut first| first.take());
            let (message, location) = recorded.unwrap_or_else(|| {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "Box<dyn Any>".to_owned());
                (message, None)
            });
            Outcome::Panicked { message, location }
        }
    }
}

/// The function every child runs first: receive the argument, call the user's `fn(A)`.
pub(crate) fn trampoline<A: serde::de::DeserializeOwned>(
    func: usize,
    args: &[u8],
    fds: Vec<OwnedFd>,
) -> Result<(), String> {
    let arg: A =
        wire::decode(args, fds).map_err(|e| format!("could not receive the argument: {e}"))?;
    // SAFETY: the parent sent the offset of a `fn(A)` with this same `A`: `Context::spawn`
    // computes both offsets from one generic instantiation.
    unsafe { sys::call_fn_at::<A>(func, arg) };
    Ok(())
}
