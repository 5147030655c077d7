//! A pool worker's life (the child side of [`Pool`](super::Pool)): warm up, say it serves, then
//! run one task after another, as they arrive on its task socket, until the parent closes it.
//! Reports go on the worker's channel.
//!
//! Each task's argument is received (fds imported) for that task alone and moved into the
//! function, so whatever it holds (a mapping, an fd) is released when the function returns;
//! the result is serialised and dropped before the report goes out. A task that panics ends the
//! worker (its state may be broken): it reports the panic and exits, and the parent replaces it.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};

use super::child_runtime::{self, EXIT_NO_START, EXIT_NOT_RUN, EXIT_PANICKED};
use super::protocol::{Call, Payload, Report, Serve, TaskOutcome};
use super::remote::{self, Ended};
use super::status::NotRunStage;
use crate::Error;
use crate::error::ProtocolRule;
use crate::wire::{self, Channel};

/// Serve tasks until the pool closes its end of the task socket, whose other end came with
/// `serve` (in `fds`); report each on `channel`. Never returns.
pub(crate) fn serve(channel: Channel, serve: Serve, fds: Vec<OwnedFd>) -> ! {
    let tasks = match <[OwnedFd; 1]>::try_from(fds) {
        Ok([fd]) => Channel::from_fd(fd),
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
    if channel.send_value(&Report::Serving).is_err() {
        std::process::exit(EXIT_NO_START);
    }
    loop {
        let received = match tasks.recv(None) {
            // The pool was dropped (or replaced this worker): done.
            Err(Error::Disconnected(_)) => std::process::exit(0),
            received => received,
        };
        let task = received.and_then(|message| {
            wire::decode::<Call>(&message.bytes, Vec::new()).map(|task| (task, message.fds))
        });
        match task {
            Ok((task, fds)) => run_task(&channel, &task, fds),
            // A task that could not be taken (its fds do not fit under this process's fd limit,
            // say) or read: report it, then go on (the packet was consumed).
            Err(error) => report(
                &channel,
                TaskOutcome::NotRun {
                    stage: NotRunStage::StartMessage,
                    error,
                },
                &[],
            ),
        }
    }
}

/// Run one task and report how it ended; exit if it panicked.
fn run_task(channel: &Channel, task: &Call, fds: Vec<OwnedFd>) {
    match remote::run(task, fds) {
        Ended::Returned(bytes, fds) => {
            let fds: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
            report(channel, TaskOutcome::Returned(Payload(bytes)), &fds);
        }
        Ended::Unsendable(error) => report(channel, TaskOutcome::Unsendable(error), &[]),
        Ended::NotRun { stage, error } => {
            report(channel, TaskOutcome::NotRun { stage, error }, &[])
        }
        Ended::Panicked { message, location } => {
            report(channel, TaskOutcome::Panicked { message, location }, &[]);
            std::process::exit(EXIT_PANICKED);
        }
    }
}

/// Send a task's report (after flushing what the task printed, so that the parent reads it
/// with the report). A result whose fds cannot be sent (more than a message carries) is
/// reported as [`TaskOutcome::Unsendable`] instead. A report that cannot be sent at all ends
/// the worker: the parent sees it die and fails the task.
fn report(channel: &Channel, outcome: TaskOutcome, fds: &[std::os::fd::BorrowedFd<'_>]) {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let sent = wire::encode(&Report::TaskDone(outcome)).and_then(|encoded| {
        if encoded.fd_count() != 0 {
            return Err(Error::protocol(
                ProtocolRule::Fds,
                "a task report carries fds of its own",
            ));
        }
        channel.send(encoded.bytes(), fds)
    });
    match sent {
        Ok(()) => {}
        Err(Error::Disconnected(_)) => std::process::exit(0),
        Err(error) if !fds.is_empty() => report(channel, TaskOutcome::Unsendable(error), &[]),
        Err(error) => {
            eprintln!("vmm-ipc: a pool worker could not report its task: {error}");
            std::process::exit(EXIT_NOT_RUN)
        }
    }
}
