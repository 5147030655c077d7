//! How a child ended: its exit status, and everything known about a child that failed.

use std::fmt;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use super::method::StartMethod;
use crate::Error;

/// How a child process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExitStatus {
    /// It exited with this code.
    Exited(i32),
    /// A signal (by number) killed it.
    Signaled(i32),
}

impl ExitStatus {
    /// Exited with code 0.
    pub fn success(self) -> bool {
        self == ExitStatus::Exited(0)
    }

    /// The exit code, if it exited.
    pub fn code(self) -> Option<i32> {
        match self {
            ExitStatus::Exited(code) => Some(code),
            ExitStatus::Signaled(_) => None,
        }
    }

    /// The signal that killed it, if one did.
    pub fn signal(self) -> Option<i32> {
        match self {
            ExitStatus::Exited(_) => None,
            ExitStatus::Signaled(signal) => Some(signal),
        }
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitStatus::Exited(code) => write!(f, "exit code {code}"),
            ExitStatus::Signaled(signal) => match Signal::try_from(signal) {
                Ok(name) => write!(f, "killed by signal {signal} ({name})"),
                Err(_) => write!(f, "killed by signal {signal}"),
            },
        }
    }
}

/// What a child was doing when it gave up before running its function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum NotRunStage {
    /// Finding its entry point: the parent's offset must name one this executable registered.
    Entry,
    /// Receiving (deserialising, importing) its argument.
    Argument,
    /// Receiving its start message (the argument's fds did not fit under its fd limit, say).
    StartMessage,
}

impl fmt::Display for NotRunStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NotRunStage::Entry => "could not find it",
            NotRunStage::Argument => "could not receive its argument",
            NotRunStage::StartMessage => "could not receive its start message",
        })
    }
}

/// Everything known about a child that did not exit cleanly: how it was started, how it ended,
/// its panic, and its captured output. `Display` shows all of it, and so does `Debug` (what
/// `unwrap()` prints), because the readable form is what a failing test should show.
#[derive(Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChildError {
    /// The start method.
    pub method: StartMethod,
    /// The child's pid.
    pub pid: u32,
    /// How it ended, if known (`None` when the forkserver died before reporting it).
    pub status: Option<ExitStatus>,
    /// Whether it acknowledged reaching its entry.
    pub started: bool,
    /// The panic message, if its function panicked.
    pub panic_message: Option<String>,
    /// Where it panicked (`file:line:column`).
    pub panic_location: Option<String>,
    /// Why the function never ran, if it did not: the child's error, as the same variant it was
    /// raised as there. For example, an argument that could not be imported in the child (a
    /// [`HostBuffer`](crate::shm::HostBuffer) whose fd is not sealed) is the import's
    /// [`Error::InvalidArgument`].
    pub not_run: Option<Box<Error>>,
    /// What the child was doing when it gave up (for `Display`).
    not_run_stage: Option<NotRunStage>,
    /// The timeout that expired, if it was killed for taking too long.
    pub timed_out: Option<Duration>,
    /// How the child broke the protocol on its channel, if it did: the first packet that was
    /// not one of its reports (undecodable, truncated, or a report sent twice), and how many
    /// more followed. Such a child fails even if its function returned and it exited with 0.
    pub protocol_violation: Option<String>,
    /// The program the child was running instead of this executable, if it was seen to have
    /// replaced itself by `exec` (so its function never returned).
    pub exec_program: Option<String>,
    /// Extra facts for `Display` (what the parent observed).
    observed_notes: Vec<String>,
    /// Whether the child reported how its function ended (for `Display`).
    reported: bool,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

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

/// How the child's function ended, as the child reports it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Outcome {
    /// It returned.
    Returned,
    /// It panicked.
    Panicked {
        message: String,
        location: Option<String>,
    },
    /// The child could not run the function; `error` is the child's own.
    NotRun { stage: NotRunStage, error: Error },
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
            Some(Outcome::Returned) | None => (None, None, None),
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

/// No `source()`: `Display` already shows the child's error (`not_run`).
impl std::error::Error for ChildError {}

impl fmt::Debug for ChildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\n{self}\n")
    }
}

impl fmt::Display for ChildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let method = self.method.name();
        write!(
            f,
            "child process {} (start method {method}) failed",
            self.pid
        )?;
        if let Some(message) = &self.panic_message {
            match &self.panic_location {
                Some(location) => write!(f, ": panicked at {location}: {message}")?,
                None => write!(f, ": panicked: {message}")?,
            }
        } else if let Some(why) = &self.not_run {
            match self.not_run_stage {
                Some(stage) => write!(f, ": its function did not run: {stage}: {why}")?,
                None => write!(f, ": its function did not run: {why}")?,
            }
        }
        if let Some(violation) = &self.protocol_violation {
            write!(
                f,
                "\n  it broke the protocol on its channel (it wrote to the socket vmm-core \
                 reports on): {violation}"
            )?;
        }
        if let Some(program) = &self.exec_program {
            write!(
                f,
                "\n  it replaced itself with another program by exec ({program}), so its \
                 function never returned"
            )?;
        }
        if let Some(after) = self.timed_out {
            write!(f, "\n  timed out after {after:?} and was killed")?;
        }
        if let Some(status) = self.status {
            write!(f, "\n  {status}")?;
        }
        for note in &self.observed_notes {
            write!(f, "\n  {note}")?;
        }
        if self.started
            && !self.reported
            && self.timed_out.is_none()
            && self.exec_program.is_none()
            && self.status.is_some()
        {
            write!(
                f,
                "\n  it ended without reporting how its function ended (it called exit, or \
                 was killed)"
            )?;
        }
        if !self.started {
            write!(
                f,
                "\n  it never acknowledged reaching its entry: the executable did not reach \
                 vmm_core::process::init() (an executable that is not a test binary must call it \
                 first thing in main), or it died while starting"
            )?;
        }
        for (name, text) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            if !text.is_empty() {
                write!(
                    f,
                    "\n---- child {} {name} ----\n{}",
                    self.pid,
                    text.trim_end()
                )?;
            }
        }
        Ok(())
    }
}
