//! The plain data of a failed child process: how it was started ([`StartMethod`]), how it ended
//! ([`ExitStatus`]), and everything known about it ([`ChildError`]).
//!
//! It lives with the error type because [`Error::Child`] carries it; `process` builds it (it
//! alone knows what a child reported) and re-exports it under `vmm_core::process`.

use std::fmt;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use super::Error;

/// How a child process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StartMethod {
    /// fork+exec (`posix_spawn`) of the current executable: a fresh process image.
    Spawn,
    /// A fork of this process's forkserver: a fresh, CUDA-free image forked on request.
    Forkserver,
    /// A child started like `Spawn` (a fresh exec), but ahead of need: it initialised CUDA (where
    /// there is a GPU) while it waited in this process's [warm pool](crate::process::WarmPool). It still
    /// runs exactly one function, so its isolation is spawn's; only the start-up is moved off
    /// the critical path.
    Warm,
}

impl StartMethod {
    /// Every start method, in a fixed order.
    pub const ALL: [StartMethod; 3] = [
        StartMethod::Spawn,
        StartMethod::Forkserver,
        StartMethod::Warm,
    ];

    /// `"spawn"`, `"forkserver"` or `"warm"`.
    pub fn name(self) -> &'static str {
        match self {
            StartMethod::Spawn => "spawn",
            StartMethod::Forkserver => "forkserver",
            StartMethod::Warm => "warm",
        }
    }

    /// Whether a child started this way is a child of this process (which reaps it), rather
    /// than of the forkserver (which reaps it and reports its status).
    pub(crate) fn is_direct_child(self) -> bool {
        !matches!(self, StartMethod::Forkserver)
    }
}

impl fmt::Display for StartMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// [`Error::InvalidDescriptor`] with [`DescriptorRule::Memfd`](super::DescriptorRule::Memfd).
    pub not_run: Option<Box<Error>>,
    /// What the child was doing when it gave up (for `Display`).
    pub(crate) not_run_stage: Option<NotRunStage>,
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
    pub(crate) observed_notes: Vec<String>,
    /// Whether the child reported how its function ended (for `Display`).
    pub(crate) reported: bool,
    /// What it wrote to stdout: the last
    /// [`output_cap()`](crate::process::output_cap) bytes (1 MiB by default), after a line
    /// that says how many bytes before them were cut, if any (a child chooses how much it
    /// writes; its parent reads only that much).
    pub stdout: String,
    /// What it wrote to stderr, kept as [`stdout`](Self::stdout) is: where its panic is.
    pub stderr: String,
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
