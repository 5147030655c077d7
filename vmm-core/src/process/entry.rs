//! A child's life once it has its channel: (for a warm child: warm up and say so,) take the
//! start message, acknowledge, run the function (a `remote` call), report how it ended,
//! exit. A child whose first message makes it a pool worker goes on in `task_loop`.

use std::io::Write;

use super::child_runtime::{EXIT_NO_START, EXIT_NOT_RUN, EXIT_PANICKED, record_panics, warm_up};
use super::ends::{ChildEnd, Received};
use super::protocol::{Order, Outcome, Report};
use super::remote;
use super::status::NotRunStage;
use super::task_loop;
use crate::Error;
use crate::error::StartMethod;

/// A warm child: initialise CUDA for `devices`, say so, then wait for the start message like
/// any child (or become a pool worker).
pub(crate) fn run_warm(channel: ChildEnd, devices: &[usize]) -> ! {
    warm_up(devices);
    if channel.send(&Report::Ready).is_err() {
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
pub(crate) fn run_child(channel: ChildEnd, method: StartMethod) -> ! {
    let (start, fds) = loop {
        match channel.recv(None) {
            Ok(Received {
                message: Order::Once(start),
                fds,
            }) => break (start, fds),
            Ok(Received {
                message: Order::Serve(serve),
                fds,
            }) => task_loop::serve(channel, serve, fds),
            // The warm pool asks whether this child is alive before it hands it out.
            Ok(Received {
                message: Order::Ping,
                ..
            }) => {
                if channel.send(&Report::Pong).is_err() {
                    std::process::exit(EXIT_NO_START);
                }
            }
            // The parent gave up on this child before sending the start message.
            Err(Error::Disconnected(_)) => std::process::exit(EXIT_NO_START),
            // A start message that could not be taken (its fds do not fit under this process's
            // fd limit: MSG_CTRUNC, say) or read.
            Err(error) => not_started(&channel, error),
        }
    };
    if channel.send(&Report::Started).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    debug_assert_eq!(start.method, method);
    record_panics();
    // A single-use child's function returns `()`: its result carries no fds.
    let (outcome, _) = remote::run(&start.call, fds);
    finish(channel, outcome)
}

/// The start message arrived but could not be taken: say so, and why, then exit.
pub(crate) fn not_started(channel: &ChildEnd, error: Error) -> ! {
    if channel.send(&Report::Started).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    let outcome = Outcome::NotRun {
        stage: NotRunStage::StartMessage,
        error,
    };
    let _ = channel.send(&Report::Finished(outcome));
    std::process::exit(EXIT_NOT_RUN)
}

/// Report how the function ended and exit with the matching code.
fn finish(channel: ChildEnd, outcome: Outcome) -> ! {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let code = match &outcome {
        Outcome::Returned(_) => 0,
        Outcome::Panicked { .. } => EXIT_PANICKED,
        // `()` cannot fail to serialise; were it to, the function's end is not clean.
        Outcome::NotRun { .. } | Outcome::Unsendable(_) => EXIT_NOT_RUN,
    };
    let _ = channel.send(&Report::Finished(outcome));
    drop(channel);
    std::process::exit(code)
}
