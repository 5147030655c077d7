//! A child's life once it has its channel: (for a warm child: warm up and say so,) take the
//! start message, acknowledge, run the function (a `remote` call), report how it ended,
//! exit. A child whose first message makes it a pool worker goes on in `task_loop`.

use std::io::Write;
use std::os::fd::OwnedFd;

use super::StartMethod;
use super::child_runtime::{EXIT_NO_START, EXIT_NOT_RUN, EXIT_PANICKED, record_panics, warm_up};
use super::protocol::{Begin, Report, Start};
use super::remote::{self, Ended};
use super::status::{NotRunStage, Outcome};
use super::task_loop;
use crate::Error;
use crate::wire::{self, Channel};

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
            Ok(Begin::Serve(serve)) => task_loop::serve(channel, serve, message.fds),
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
    record_panics();
    let outcome = run_function(&start, message.fds);
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

/// Run the start message's call and say how it ended, as the parent's [`Outcome`].
fn run_function(start: &Start, fds: Vec<OwnedFd>) -> Outcome {
    match remote::run(&start.call, fds) {
        // A `()` result: nothing to send back.
        Ended::Returned(..) => Outcome::Returned,
        Ended::NotRun { stage, error } => Outcome::NotRun { stage, error },
        Ended::Panicked { message, location } => Outcome::Panicked { message, location },
        // Serialising `()` cannot fail; were it to, the function ran but its end is not clean.
        Ended::Unsendable(error) => Outcome::NotRun {
            stage: NotRunStage::Argument,
            error,
        },
    }
}
