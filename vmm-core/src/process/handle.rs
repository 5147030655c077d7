//! The parent's handle on a child: join with a timeout, kill, and what a failure looks like.

use std::fmt;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::protocol::{Outcome, Report};
use super::tracker::{Fate, FateCell};
use super::{StartMethod, sys};
use crate::wire::{self, Channel};
use crate::{Error, Result};

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

/// Everything known about a child that did not exit cleanly: how it was started, how it ended,
/// its panic, and its captured output. `Display` shows all of it, and so does `Debug` (what
/// `unwrap()` prints), because the readable form is what a failing test should show.
#[derive(Clone, Serialize, Deserialize)]
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
    /// Why the function never ran, if it did not (for example, its argument did not arrive).
    pub not_run: Option<String>,
    /// The timeout that expired, if it was killed for taking too long.
    pub timed_out: Option<Duration>,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

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
            write!(f, ": its function did not run: {why}")?;
        }
        if let Some(after) = self.timed_out {
            write!(f, "\n  timed out after {after:?} and was killed")?;
        }
        match self.status {
            Some(status) => write!(f, "\n  {status}")?,
            None => write!(
                f,
                "\n  exit status unknown (the forkserver died before reporting it)"
            )?,
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

/// A running child process.
///
/// Dropping a `Process` that was not joined kills and reaps the child, so a child never
/// outlives the code that started it. Its stdout and stderr are captured; on a clean exit
/// [`join`](Self::join) replays them into this process's (test-captured) stdout and stderr,
/// on failure they are part of the [`ChildError`].
#[derive(Debug)]
pub struct Process {
    pid: Pid,
    method: StartMethod,
    channel: Channel,
    stdout: OwnedFd,
    stderr: OwnedFd,
    /// Forkserver children: the server reaps them, so signal through a pidfd (never a
    /// recycled pid). Spawned children are ours until we reap them.
    pidfd: Option<Arc<OwnedFd>>,
    /// Shared with the registry of the `#[ipc_test]` that started it, if any.
    fate: Arc<FateCell>,
    default_timeout: Duration,
    started: bool,
    outcome: Option<Outcome>,
    status: Option<ExitStatus>,
    /// The forkserver died before reporting the status: it will never be known.
    status_lost: bool,
}

impl Process {
    pub(crate) fn new(
        pid: Pid,
        method: StartMethod,
        channel: Channel,
        (stdout, stderr): (OwnedFd, OwnedFd),
        pidfd: Option<Arc<OwnedFd>>,
        fate: Arc<FateCell>,
        default_timeout: Duration,
    ) -> Process {
        Process {
            pid,
            method,
            channel,
            stdout,
            stderr,
            pidfd,
            fate,
            default_timeout,
            started: false,
            outcome: None,
            status: None,
            status_lost: false,
        }
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid.as_raw() as u32
    }

    /// The start method it was started with.
    pub fn method(&self) -> StartMethod {
        self.method
    }

    /// Kill the child (SIGKILL). It is reaped by [`join`](Self::join) or on drop.
    pub fn kill(&self) -> Result<()> {
        if self.finished() {
            return Ok(());
        }
        self.fate.set(Fate::Killed);
        self.signal_kill()
    }

    fn signal_kill(&self) -> Result<()> {
        if self.fate.get() == Fate::Reaped {
            return Ok(());
        }
        match &self.pidfd {
            Some(pidfd) => sys::pidfd_kill(pidfd),
            None if self.method == StartMethod::Spawn => match kill(self.pid, Signal::SIGKILL) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
                Err(e) => Err(Error::errno(format!("kill({}, SIGKILL)", self.pid), e)),
            },
            // No pidfd (old kernel): the server may have reaped it and the pid been reused;
            // only signal while the server has not reported its exit, which we just checked.
            None => kill(self.pid, Signal::SIGKILL).or(Ok(())),
        }
    }

    /// Wait up to the default timeout (`VMM_CHILD_TIMEOUT`, else 60 s); see [`join`](Self::join).
    pub fn wait(self) -> Result<ExitStatus> {
        let timeout = self.default_timeout;
        self.join(timeout)
    }

    /// Wait for the child to exit, at most `timeout`; past it, kill and reap it.
    ///
    /// `Ok` only for a child that acknowledged its start, returned from its function and exited
    /// with code 0; anything else is [`Error::Child`] with the whole story.
    pub fn join(mut self, timeout: Duration) -> Result<ExitStatus> {
        let timed_out = self.wait_until(Some(Instant::now() + timeout))?;
        if self.fate.get() == Fate::Running {
            self.fate.set(Fate::Finished);
        }
        let clean = self.started
            && self.outcome == Some(Outcome::Returned)
            && self.status.is_some_and(ExitStatus::success)
            && !timed_out;
        let (stdout, stderr) = (read_all(&self.stdout), read_all(&self.stderr));
        if clean {
            print!("{stdout}");
            eprint!("{stderr}");
            return Ok(ExitStatus::Exited(0));
        }
        let (panic_message, panic_location, not_run) = match self.outcome.take() {
            Some(Outcome::Panicked { message, location }) => (Some(message), location, None),
            Some(Outcome::NotRun(why)) => (None, None, Some(why)),
            _ => (None, None, None),
        };
        Err(Error::Child(Box::new(ChildError {
            method: self.method,
            pid: self.pid(),
            status: self.status,
            started: self.started,
            panic_message,
            panic_location,
            not_run,
            timed_out: timed_out.then_some(timeout),
            stdout,
            stderr,
        })))
    }

    /// Whether the child's end is known (its status, or that it never will be).
    fn finished(&self) -> bool {
        self.status.is_some() || self.status_lost
    }

    /// Read reports until the exit status is known. Past `deadline`, kill and keep reading.
    /// Returns whether the deadline passed.
    fn wait_until(&mut self, deadline: Option<Instant>) -> Result<bool> {
        let mut timed_out = false;
        // Sleep until the channel hangs up: the child closes its end when it exits, and the
        // forkserver closes its copy once it has reported the exit status. One wake-up for the
        // child's whole life; its reports are read afterwards.
        while !wire::wait_hangup(self.channel.as_fd(), deadline.filter(|_| !timed_out))? {
            timed_out = true;
            self.signal_kill()?;
        }
        while !self.finished() {
            match self.channel.try_recv() {
                Ok(Some(message)) => match wire::decode::<Report>(&message.bytes, Vec::new())? {
                    Report::Started => self.started = true,
                    Report::Finished(outcome) => self.outcome = Some(outcome),
                    Report::Exited(status) => self.status = Some(status),
                },
                // Every report has been read: a spawned child has exited, reap it; for a
                // forkserver child it means the server died before reporting the status.
                Ok(None) | Err(Error::Disconnected(_)) => match self.method {
                    StartMethod::Spawn if self.fate.get() == Fate::Reaped => {
                        self.status_lost = true
                    }
                    StartMethod::Spawn => self.status = Some(reap(self.pid)?),
                    StartMethod::Forkserver => self.status_lost = true,
                },
                Err(e) => return Err(e),
            }
        }
        Ok(timed_out)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if !self.finished() {
            if self.fate.get() == Fate::Running {
                self.fate.set(Fate::DroppedRunning);
            }
            let _ = self.signal_kill();
            let _ = self.wait_until(None);
        } else if self.fate.get() == Fate::Running {
            self.fate.set(Fate::Finished);
        }
    }
}

fn reap(pid: Pid) -> Result<ExitStatus> {
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return Ok(ExitStatus::Exited(code)),
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                return Ok(ExitStatus::Signaled(signal as i32));
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(Error::errno(format!("waitpid({pid})"), e)),
        }
    }
}

fn read_all(fd: &OwnedFd) -> String {
    let Ok(file) = fd.try_clone().map(File::from) else {
        return "(captured output unreadable: dup failed)".to_owned();
    };
    let mut out = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    let mut offset = 0u64;
    while let Ok(n @ 1..) = file.read_at(&mut buf, offset) {
        out.extend_from_slice(&buf[..n]);
        offset += n as u64;
    }
    String::from_utf8_lossy(&out).into_owned()
}
