//! A pool worker's life (the child side of [`Pool`](super::Pool)): warm up, say it serves, then
//! run one task after another, as they arrive on its task socket, until the parent closes it.
//! Reports go on the worker's channel.
//!
//! Each task's argument is received (fds imported) for that task alone and moved into the
//! function, so whatever it holds (a mapping, an fd) is released when the function returns;
//! the result is serialised and dropped before the report goes out. A task that panics ends the
//! worker (its state may be broken): it reports the panic and exits, and the parent replaces it.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::child_runtime::{self, EXIT_NO_START, EXIT_NOT_RUN, EXIT_PANICKED};
use super::ends::{ChildEnd, Received, TaskReceiver};
use super::protocol::{Call, Outcome, Report, Serve};
use super::remote;
use super::status::NotRunStage;
use crate::Error;

/// Serve tasks until the pool closes its end of the task socket, whose other end came with
/// `serve` (in `fds`); report each on `channel`. Never returns.
pub(crate) fn serve(channel: ChildEnd, serve: Serve, fds: Vec<OwnedFd>) -> ! {
    let tasks = match <[OwnedFd; 1]>::try_from(fds) {
        Ok([fd]) => TaskReceiver::from_fd(fd),
        Err(fds) => {
            // The pool reports a worker that dies while it starts, with what it printed.
            eprintln!(
                "vmm-ipc: a pool worker's Serve carries {} fds, not the one of its task socket",
                fds.len()
            );
            std::process::exit(EXIT_NOT_RUN);
        }
    };
    child_runtime::warm_up(&serve.devices);
    child_runtime::record_panics();
    if channel.send(&Report::Serving).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    loop {
        match tasks.recv(None) {
            Ok(Received { message: task, fds }) => run_task(&channel, &task, fds),
            // The pool was dropped (or replaced this worker): done.
            Err(Error::Disconnected(_)) => std::process::exit(0),
            // A task that could not be taken (its fds do not fit under this process's fd limit,
            // say) or read: report it, then go on (the packet was consumed).
            Err(error) => report(
                &channel,
                Outcome::NotRun {
                    stage: NotRunStage::StartMessage,
                    error,
                },
                &[],
            ),
        }
    }
}

/// Run one task and report how it ended; exit if it panicked.
fn run_task(channel: &ChildEnd, task: &Call, fds: Vec<OwnedFd>) {
    let (outcome, fds) = remote::run(task, fds);
    let panicked = matches!(outcome, Outcome::Panicked { .. });
    let fds: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    report(channel, outcome, &fds);
    if panicked {
        std::process::exit(EXIT_PANICKED);
    }
}

/// Send a task's report (after flushing what the task printed, so that the parent reads it
/// with the report). A result whose fds cannot be sent (more than a message carries) is
/// reported as [`Outcome::Unsendable`] instead. A report that cannot be sent at all ends
/// the worker: the parent sees it die and fails the task.
fn report(channel: &ChildEnd, outcome: Outcome, fds: &[BorrowedFd<'_>]) {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    match channel.send_with(&Report::Finished(outcome), fds, None) {
        Ok(()) => {}
        Err(Error::Disconnected(_)) => std::process::exit(0),
        Err(error) if !fds.is_empty() => report(channel, Outcome::Unsendable(error), &[]),
        Err(error) => {
            eprintln!("vmm-ipc: a pool worker could not report its task: {error}");
            std::process::exit(EXIT_NOT_RUN)
        }
    }
}
