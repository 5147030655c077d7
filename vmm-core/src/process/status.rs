//! How a child ended, as the parent assembles it: the child's report (the protocol's
//! [`Outcome`]) and what the parent saw ([`Observed`]) make a [`ChildError`]. The data types
//! themselves live in `crate::error` (an [`Error::Child`](crate::Error::Child) carries them).

use std::time::Duration;

pub(crate) use super::protocol::Outcome;
pub(crate) use crate::error::NotRunStage;
use crate::error::StartMethod;
pub use crate::error::{ChildError, ExitStatus};

/// What the parent saw of a child besides its reports: the facts a [`ChildError`] adds to
/// them.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    /// See [`ChildError::protocol_violation`].
    pub protocol_violation: Option<String>,
    /// See [`ChildError::exec_program`].
    pub exec_program: Option<String>,
    /// Why the exit status is unknown, when it is.
    pub status_unknown: Option<String>,
    /// The child closed its channel while it was still running.
    pub channel_closed_early: bool,
    /// Anything else worth saying (what a pool worker was doing, say), one line each.
    pub notes: Vec<String>,
}

impl ChildError {
    /// Assemble one; `outcome` (what the child reported, if anything) fills the panic or
    /// not-run fields.
    pub(crate) fn new(
        (method, pid): (StartMethod, u32),
        (status, started): (Option<ExitStatus>, bool),
        outcome: Option<Outcome>,
        timed_out: Option<Duration>,
        observed: Observed,
        (stdout, stderr): (String, String),
    ) -> ChildError {
        let reported = outcome.is_some();
        let (panic_message, panic_location, not_run) = match outcome {
            Some(Outcome::Panicked { message, location }) => (Some(message), location, None),
            Some(Outcome::NotRun { stage, error }) => (None, None, Some((stage, Box::new(error)))),
            // A single-use child's `()` cannot fail to serialise; were it to, the function ran
            // but did not end cleanly, and the parent has no result to receive.
            Some(Outcome::Unsendable(error)) => {
                (None, None, Some((NotRunStage::Argument, Box::new(error))))
            }
            Some(Outcome::Returned(_)) | None => (None, None, None),
        };
        let (not_run_stage, not_run) = not_run.unzip();
        let mut observed_notes = Vec::new();
        if let Some(why) = observed.status_unknown {
            observed_notes.push(format!("exit status unknown: {why}"));
        }
        if observed.channel_closed_early && observed.exec_program.is_none() {
            observed_notes.push(
                "it closed its channel while still running (an exec, or a close of an fd it \
                 does not own), so it could not report how its function ended"
                    .to_owned(),
            );
        }
        observed_notes.extend(observed.notes);
        ChildError {
            method,
            pid,
            status,
            started,
            panic_message,
            panic_location,
            not_run,
            not_run_stage,
            timed_out,
            protocol_violation: observed.protocol_violation,
            exec_program: observed.exec_program,
            observed_notes,
            reported,
            stdout,
            stderr,
        }
    }
}
