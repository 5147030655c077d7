//! The parent's side of the forkserver: start it (once per process), ask it for children,
//! notice when it has died and replace it. The server itself is in `server.rs`.
//!
//! The parent keeps one permanent fd for it: the request channel.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, getpid};

use super::ends::{Received, RequestEnd};
use super::hook::{self, ChildKind};
use super::launch::{Launch, launch};
use super::protocol::{ForkReply, ForkRequest, Role};
use super::status::ExitStatus;
use super::supervisor::reap_pid;
use crate::error::{ForkserverFailure, ProtocolRule};
use crate::wire;
use crate::{Error, Result};

/// How long a parent waits for the forkserver to start, or to answer one request.
const SERVER_TIMEOUT: Duration = Duration::from_secs(30);

struct Server {
    pid: Pid,
    requests: RequestEnd,
}

static SERVER: Mutex<Option<Server>> = Mutex::new(None);

fn server_slot() -> MutexGuard<'static, Option<Server>> {
    SERVER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Start this process's forkserver if it is not running, and return its pid.
///
/// Call it before taking an fd baseline: the forkserver's request channel is the one fd the
/// parent keeps for its whole life.
pub fn ensure_running() -> Result<u32> {
    let mut slot = server_slot();
    running(&mut slot).map(|server| server.pid.as_raw() as u32)
}

/// The forkserver's pid, if this process has started one.
pub fn forkserver_pid() -> Option<u32> {
    server_slot()
        .as_ref()
        .map(|server| server.pid.as_raw() as u32)
}

fn running(slot: &mut Option<Server>) -> Result<&Server> {
    // A server that died since the last request has hung up its end: replace it now, rather
    // than send it a request first.
    if let Some(server) = slot.as_ref()
        && wire::wait_hangup(server.requests.as_fd(), Some(Instant::now())).unwrap_or(false)
    {
        let pid = server.pid;
        let why = end(pid);
        eprintln!("vmm-ipc: the forkserver (pid {pid}) is gone ({why}); starting a new one");
        *slot = None;
    }
    if slot.is_none() {
        *slot = Some(start()?);
    }
    Ok(slot.as_ref().expect("just started"))
}

fn start() -> Result<Server> {
    let (requests, theirs) = RequestEnd::pair()?;
    let pid = launch(Launch {
        role: Role::Forkserver,
        channel: theirs.into_fd(),
        output: None,
        args: hook::child_args(ChildKind::Test),
        env: Vec::new(),
    })?;
    match requests.recv(Some(SERVER_TIMEOUT)) {
        Ok(Received {
            message: ForkReply::Ready { .. },
            ..
        }) => Ok(Server { pid, requests }),
        other => {
            let why = end(pid);
            let detail = match other {
                Err(e) => e.to_string(),
                Ok(reply) => format!("unexpected first message {:?}", reply.message),
            };
            Err(Error::forkserver(
                ForkserverFailure::DidNotStart,
                format!(
                    "the forkserver (pid {pid}) did not start ({detail}; {why}); an executable that \
                 is not a test binary must call vmm_core::process::init() first thing in main"
                ),
            ))
        }
    }
}

/// Kill (if needed) and reap a server; say how it ended.
fn end(pid: Pid) -> String {
    let _ = kill(pid, Signal::SIGKILL);
    match reap_pid(pid) {
        Ok(ExitStatus::Exited(code)) => format!("it exited with code {code}"),
        Ok(killed) => format!("it was {killed}"),
        Err(e) => e.to_string(),
    }
}

/// Ask the forkserver for a child that runs on `channel`, writing to `stdout` and `stderr`, with
/// `env` added to its environment. Returns its pid and, where the kernel has them, a pidfd for
/// it.
///
/// A server that has died is reported on stderr, replaced, and asked again once.
pub(crate) fn fork(
    channel: &OwnedFd,
    output: [BorrowedFd<'_>; 2],
    env: &[(String, String)],
) -> Result<(Pid, Option<OwnedFd>)> {
    let mut slot = server_slot();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let server = running(&mut slot)?;
        match request(server, channel, output, env) {
            Ok(forked) => return Ok(forked),
            Err(Error::Disconnected(_)) if attempts < 2 => {
                let pid = server.pid;
                let why = end(pid);
                eprintln!(
                    "vmm-ipc: the forkserver (pid {pid}) is gone ({why}); starting a new one"
                );
                *slot = None;
            }
            Err(Error::Disconnected(_)) => {
                let pid = server.pid;
                let why = end(pid);
                *slot = None;
                return Err(Error::forkserver(
                    ForkserverFailure::Died,
                    format!(
                        "the forkserver (pid {pid}) died while forking a child ({why}), twice in a row"
                    ),
                ));
            }
            // A server that does not answer in time is stuck; a late answer would be taken for
            // the next request's. Replace it.
            Err(Error::Timeout { what, after }) => {
                let pid = server.pid;
                let why = end(pid);
                *slot = None;
                return Err(Error::forkserver(
                    ForkserverFailure::Unresponsive,
                    format!(
                        "the forkserver (pid {pid}) did not answer a fork request ({what} timed out \
                     after {after:?}); it was killed ({why}) with the children it had forked, and \
                     the next request starts a new one"
                    ),
                ));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether this process cannot open one more fd (`EMFILE`).
fn at_fd_limit() -> bool {
    crate::limits::open_fds().is_err_and(|e| e.raw_os_error() == Some(libc::EMFILE))
}

fn request(
    server: &Server,
    channel: &OwnedFd,
    [stdout, stderr]: [BorrowedFd<'_>; 2],
    env: &[(String, String)],
) -> Result<(Pid, Option<OwnedFd>)> {
    let request = ForkRequest {
        parent: getpid().as_raw(),
        env: env.to_vec(),
    };
    server.requests.send_with(
        &request,
        &[channel.as_fd(), stdout, stderr],
        Some(SERVER_TIMEOUT),
    )?;
    let reply = match server.requests.recv(Some(SERVER_TIMEOUT)) {
        Ok(reply) => reply,
        // The reply carries a pidfd; at the fd limit it cannot be installed (MSG_CTRUNC). The
        // child was forked, but it never gets its start message (see `Context::spawn`): it
        // exits without running its function, and the server reaps it.
        Err(Error::Protocol {
            rule: ProtocolRule::Fds,
            message: why,
        }) if at_fd_limit() => {
            return Err(Error::fd_limit(format!(
                "receiving the forkserver's reply, which carries a pidfd for the new child \
                 (that child will exit without running its function; {why})"
            )));
        }
        Err(e) => return Err(e),
    };
    match reply.message {
        ForkReply::Forked { pid } => Ok((Pid::from_raw(pid), reply.fds.into_iter().next())),
        // The server's own error: `Error::Os` for a failed fork (its errno, say EAGAIN at a
        // process limit), `Error::Protocol` for a request it refused.
        ForkReply::Failed(error) => Err(error),
        ForkReply::Ready { .. } => Err(Error::protocol(
            ProtocolRule::Internal,
            "forkserver sent Ready twice",
        )),
    }
}
