//! A child's life once it has its channel: (for a warm child: warm up and say so,) take the
//! start message, acknowledge, run the function through its trampoline, report how it ended,
//! exit. A child whose first message makes it a pool worker goes on in `worker`.

use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::panic::{self, AssertUnwindSafe};

use super::child::{
    EXIT_NO_START, EXIT_NOT_RUN, EXIT_PANICKED, panic_report, record_panics, warm_up,
};
use super::method::StartMethod;
use super::protocol::{Begin, Report, Start};
use super::status::{NotRunStage, Outcome};
use super::{sys, worker};
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// A warm child: initialise CUDA for `devices`, say so, then wait for the start message like
/// any child (or become a pool worker).
pub(crate) fn run_warm(channel: Channel, devices: &[usize]) -> ! {
    warm_up(devices);
    if channel.send_value(&Report::Ready).is_err() {
        // The parent dropped this child while it warmed up.
        std::process::exit(EXIT_NO_START);
    }
    run_child(channel, StartMethod::Warm)
}

/// Run the child: take the start message, acknowledge, run the function, report, exit.
///
/// The start message comes once the parent holds this child; until then the child waits. A
/// channel that closes first means the parent's `spawn` failed (or a warm child was never
/// used): exit without running anything.
pub(crate) fn run_child(channel: Channel, method: StartMethod) -> ! {
    let (message, start) = loop {
        let message = match channel.recv(None) {
            Ok(message) => message,
            // The parent gave up on this child before sending the start message.
            Err(Error::Disconnected(_)) => std::process::exit(EXIT_NO_START),
            // A start message that could not be taken: its fds do not fit under this
            // process's fd limit (MSG_CTRUNC), say.
            Err(error) => not_started(&channel, error),
        };
        match wire::decode::<Begin>(&message.bytes, Vec::new()) {
            Ok(Begin::Once(start)) => break (message, start),
            Ok(Begin::Serve(serve)) => worker::serve(channel, serve, message.fds),
            // The warm pool asks whether this child is alive before it hands it out.
            Ok(Begin::Ping) => {
                if channel.send_value(&Report::Pong).is_err() {
                    std::process::exit(EXIT_NO_START);
                }
            }
            Err(error) => not_started(&channel, error),
        }
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
pub(crate) fn not_started(channel: &Channel, error: Error) -> ! {
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
pub(crate) fn set_env(env: &[(String, String)]) -> Result<()> {
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
            let (message, location) = panic_report(payload.as_ref());
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
