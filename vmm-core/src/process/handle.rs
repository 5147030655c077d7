//! The parent's handle on a child ([`Process`]): join with a timeout, kill, reap.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use super::method::StartMethod;
use super::protocol::Report;
use super::status::{ChildError, ExitStatus, Outcome};
use super::sys;
use super::tracker::{Fate, FateCell};
use crate::wire::{self, Channel};
use crate::{Error, Result};

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
            && matches!(self.outcome, Some(Outcome::Returned))
            && self.status.is_some_and(ExitStatus::success)
            && !timed_out;
        let (stdout, stderr) = (read_all(&self.stdout), read_all(&self.stderr));
        if clean {
            print!("{stdout}");
            eprint!("{stderr}");
            return Ok(ExitStatus::Exited(0));
        }
        Err(Error::Child(Box::new(ChildError::new(
            (self.method, self.pid()),
            (self.status, self.started),
            self.outcome.take(),
            timed_out.then_some(timeout),
            (stdout, stderr),
        ))))
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
