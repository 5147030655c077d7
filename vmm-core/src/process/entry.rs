//! A child's life once it has its channel: take the start message, acknowledge, run the
//! function through its trampoline, report how it ended, exit.

use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Mutex;

use nix::sys::signal::Signal;
use nix::unistd::{Pid, getppid};

use super::method::StartMethod;
use super::protocol::{Report, Start};
use super::status::{NotRunStage, Outcome};
use super::sys;
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// Exit codes of a child that did not get as far as its function.
pub(crate) const EXIT_ORPHANED: i32 = 120;
pub(crate) const EXIT_NO_START: i32 = 121;
pub(crate) const EXIT_PANICKED: i32 = 101;
pub(crate) const EXIT_NOT_RUN: i32 = 122;

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
///
/// The start message comes once the parent holds this child; until then the child waits. A
/// channel that closes first means the parent's `spawn` failed: exit without running anything.
pub(crate) fn run_child(channel: Channel, method: StartMethod) -> ! {
    let (message, start) = match channel.recv(None) {
        Ok(message) => match wire::decode::<Start>(&message.bytes, Vec::new()) {
            Ok(start) => (message, start),
            Err(error) => not_started(&channel, error),
        },
        // The parent gave up on this child before sending the start message.
        Err(Error::Disconnected(_)) => std::process::exit(EXIT_NO_START),
        // A start message that could not be taken: its fds do not fit under this process's fd
        // limit (MSG_CTRUNC), say.
        Err(error) => not_started(&channel, error),
    };
    if channel.send_value(&Report::Started).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    debug_assert_eq!(start.method, method);
    let outcome = match set_env(&start.env) {
        Ok(()) => {
            record_panics();
            run_function(&start, message.fds)
        }
        Err(error) => Outcome::NotRun {
            stage: NotRunStage::Environment,
            error,
        },
    };
    finish(channel, outcome)
}

/// The start message arrived but could not be taken: say so, and why, then exit.
fn not_started(channel: &Channel, error: Error) -> ! {
    if channel.send_value(&Report::Started).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    let outcome = Outcome::NotRun {
        stage: NotRunStage::StartMessage,
        error,
    };
    let _ = channel.send_value(&Report::Finished(outcome));
    std::process::exit(EXIT_NOT_RUN)
}

/// Report how the function ended and exit with the matching code.
fn finish(channel: Channel, outcome: Outcome) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let code = match &outcome {
        Outcome::Returned => 0,
        Outcome::Panicked { .. } => EXIT_PANICKED,
        Outcome::NotRun { .. } => EXIT_NOT_RUN,
    };
    let _ = channel.send_value(&Report::Finished(outcome));
    drop(channel);
    std::process::exit(code)
}

/// Give the child the environment variables its parent asked for, before its function runs.
///
/// A spawned child already has them (they were in its environment at exec); a forkserver child
/// sets them here, as a fork of a single-threaded server that has started no thread yet.
fn set_env(env: &[(String, String)]) -> Result<()> {
    let missing: Vec<(String, String)> = env
        .iter()
        .filter(|(key, value)| std::env::var_os(key).as_deref() != Some(OsStr::new(value)))
        .cloned()
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !sys::is_single_threaded() {
        return Err(Error::InvalidArgument(format!(
            "the child must set {} environment variable(s) its parent asked for, but has \
             several threads, where changing the environment is unsound; an executable that is \
             not a test binary must call vmm_core::process::init() first thing in main",
            missing.len()
        )));
    }
    // SAFETY: this process has one thread (just checked), and this thread starts none before
    // the call returns, so no other thread can read or write the environment meanwhile.
    unsafe { sys::set_env_single_threaded(&missing) };
    Ok(())
}

fn run_function(start: &Start, fds: Vec<OwnedFd>) -> Outcome {
    // SAFETY: `start` arrived on the channel our parent handed down at exec or fork; only the
    // parent holds its other end. The parent built it in `Context::spawn` from
    // `entry::trampoline::<A>` (a `Trampoline`), after `check_main_text` found that trampoline
    // in the main executable's code, with `code_offset` in a process running this executable.
    let entry = unsafe { sys::resolve_entry(start.layout, start.trampoline, start.func) };
    let (trampoline, func) = match entry {
        Ok(entry) => entry,
        Err(error) => {
            return Outcome::NotRun {
                stage: NotRunStage::Entry,
                error,
            };
        }
    };
    // SAFETY: `Context::spawn` computed `start.func` from its `f: fn(A)` and `start.trampoline`
    // from `trampoline::<A>` with the same `A`, both checked to lie in the main executable's
    // code, whose layout is the same here (`resolve_entry` checked the layout); so `func` is
    // the address of a `fn(A)` for the trampoline's `A`.
    let called = panic::catch_unwind(AssertUnwindSafe(|| unsafe {
        trampoline(func, &start.args, fds)
    }));
    match called {
        Ok(Ok(())) => Outcome::Returned,
        Ok(Err(error)) => Outcome::NotRun {
            stage: NotRunStage::Argument,
            error,
        },
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
///
/// An argument that cannot be received is the error its deserialisation raised (an import's
/// [`Error::InvalidArgument`], say), as that variant.
///
/// # Safety
/// `func` must be the address, in this process, of a function of type `fn(A)` with this `A`.
pub(crate) unsafe fn trampoline<A: serde::de::DeserializeOwned>(
    func: usize,
    args: &[u8],
    fds: Vec<OwnedFd>,
) -> Result<()> {
    let arg: A = wire::decode(args, fds)?;
    // SAFETY: the caller guarantees that `func` is a `fn(A)` with this `A`.
    unsafe { sys::call_fn_at::<A>(func, arg) };
    Ok(())
}
