//! The forkserver: a fresh exec of the current executable that forks children on request.
//!
//! It never initialises CUDA and never starts a thread, so every fork copies a small,
//! single-threaded, CUDA-free process. It reaps its children and reports each exit status on the
//! child's own channel (it keeps a copy of the child's end for that), so a parent learns how its
//! child ended without being its parent. It exits when its parent closes the request channel
//! (and is killed if its parent dies); its children die with it.
//!
//! The parent keeps one permanent fd for it: the request channel.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, getpid};

use super::entry::{self, EXIT_NO_START};
use super::launch::{Launch, launch};
use super::protocol::{ForkReply, ForkRequest, Report};
use super::{ExitStatus, StartMethod, sys};
use crate::wire::{self, Channel, Message};
use crate::{Error, Result};

/// How long a parent waits for the forkserver to start, or to answer one request.
const SERVER_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------- server side

/// The forkserver's main loop. Never returns.
pub(crate) fn serve(requests: Channel) -> ! {
    let mut sigchld = SigSet::empty();
    sigchld.add(Signal::SIGCHLD);
    let Ok(old_mask) = sigchld.thread_swap_mask(SigmaskHow::SIG_BLOCK) else {
        std::process::exit(EXIT_NO_START);
    };
    let Ok(reaped) = SignalFd::with_flags(&sigchld, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
    else {
        std::process::exit(EXIT_NO_START);
    };
    if requests
        .send_value(&ForkReply::Ready {
            pid: getpid().as_raw(),
        })
        .is_err()
    {
        std::process::exit(EXIT_NO_START);
    }
    let mut children: HashMap<Pid, Channel> = HashMap::new();
    loop {
        let (request_ready, child_exited) = {
            let mut fds = [
                PollFd::new(requests.as_fd(), PollFlags::POLLIN),
                PollFd::new(reaped.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(_) => shutdown(&mut children),
            }
            let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
            (ready(&fds[0]), ready(&fds[1]))
        };
        if child_exited {
            while let Ok(Some(_)) = reaped.read_signal() {}
            reap(&mut children);
        }
        if request_ready {
            match requests.try_recv() {
                Ok(Some(message)) => fork_one(message, &requests, &mut children, &old_mask),
                Ok(None) => {}
                // The parent is gone: take the children with us.
                Err(_) => shutdown(&mut children),
            }
        }
    }
}

fn fork_one(
    message: Message,
    requests: &Channel,
    children: &mut HashMap<Pid, Channel>,
    old_mask: &SigSet,
) {
    let server = getpid();
    let valid =
        message.fds.len() == 3 && wire::decode::<ForkRequest>(&message.bytes, Vec::new()).is_ok();
    if !valid {
        let reply = ForkReply::Failed(format!(
            "malformed fork request ({} bytes, {} fds; want a ForkRequest and 3 fds)",
            message.bytes.len(),
            message.fds.len()
        ));
        let _ = requests.send_value(&reply);
        return;
    }
    let raw: Vec<_> = message.fds.iter().map(AsRawFd::as_raw_fd).collect();
    match sys::fork_single_threaded() {
        Ok(ForkResult::Child) => {
            // Renumber: stdout, stderr, then the channel at 3; close everything else the
            // server had (its request channel, signalfd, other children's channels).
            std::mem::forget(message);
            let _ = old_mask.thread_set_mask();
            let ok = sys::dup2_raw(raw[1], 1).is_ok() && sys::dup2_raw(raw[2], 2).is_ok();
            let ok = ok && (raw[0] == 3 || sys::dup2_raw(raw[0], 3).is_ok());
            if !ok {
                std::process::exit(EXIT_NO_START);
            }
            sys::close_from(4);
            let Ok(channel) = sys::adopt_inherited_fd(3) else {
                std::process::exit(EXIT_NO_START);
            };
            entry::die_with(server);
            entry::run_child(Channel::from_fd(channel), StartMethod::Forkserver)
        }
        Ok(ForkResult::Parent { child }) => {
            let mut fds = message.fds.into_iter();
            let channel = Channel::from_fd(fds.next().expect("three fds checked"));
            drop(fds); // our copies of the child's stdout and stderr
            let pidfd = sys::pidfd_open(child).ok();
            let reply = ForkReply::Forked {
                pid: child.as_raw(),
            };
            let sent = wire::encode(&reply).and_then(|e| {
                let fds: Vec<_> = pidfd.iter().map(AsFd::as_fd).collect();
                requests.send(e.bytes(), &fds)
            });
            children.insert(child, channel);
            if sent.is_err() {
                shutdown(children);
            }
        }
        Err(e) => {
            let _ = requests.send_value(&ForkReply::Failed(e.to_string()));
        }
    }
}

fn reap(children: &mut HashMap<Pid, Channel>) {
    loop {
        let (pid, status) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => (pid, ExitStatus::Exited(code)),
            Ok(WaitStatus::Signaled(pid, signal, _)) => (pid, ExitStatus::Signaled(signal as i32)),
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => return,
        };
        if let Some(channel) = children.remove(&pid) {
            let _ = channel.send_value(&Report::Exited(status));
        }
    }
}

fn shutdown(children: &mut HashMap<Pid, Channel>) -> ! {
    for pid in children.keys() {
        let _ = kill(*pid, Signal::SIGKILL);
    }
    for pid in children.keys() {
        let _ = waitpid(*pid, None);
    }
    std::process::exit(0)
}

// ---------------------------------------------------------------- parent side

struct Server {
    pid: Pid,
    requests: Channel,
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
    if slot.is_none() {
        *slot = Some(start()?);
    }
    Ok(slot.as_ref().expect("just started"))
}

fn start() -> Result<Server> {
    let (requests, theirs) = Channel::pair()?;
    let pid = launch(Launch {
        role: "forkserver",
        channel: theirs.into_fd(),
        output: None,
        test_name: super::current_test_name(),
        env: Vec::new(),
    })?;
    match requests.recv_value::<ForkReply>(Some(SERVER_TIMEOUT)) {
        Ok(ForkReply::Ready { .. }) => Ok(Server { pid, requests }),
        other => {
            let why = end(pid);
            let detail = match other {
                Err(e) => e.to_string(),
                Ok(reply) => format!("unexpected first message {reply:?}"),
            };
            Err(Error::Forkserver(format!(
                "the forkserver (pid {pid}) did not start ({detail}; {why}); an executable that \
                 is not a test binary must call vmm_core::process::init() first thing in main"
            )))
        }
    }
}

/// Kill (if needed) and reap a server; say how it ended.
fn end(pid: Pid) -> String {
    let _ = kill(pid, Signal::SIGKILL);
    match waitpid(pid, None) {
        Ok(WaitStatus::Exited(_, code)) => format!("it exited with code {code}"),
        Ok(WaitStatus::Signaled(_, signal, _)) => format!("it was killed by {signal}"),
        Ok(other) => format!("wait status {other:?}"),
        Err(e) => format!("waitpid failed: {e}"),
    }
}

/// Ask the forkserver for a child that runs on `channel`, writing to `stdout` and `stderr`.
/// Returns its pid and, where the kernel has them, a pidfd for it.
///
/// A server that has died is reported on stderr, replaced, and asked again once.
pub(crate) fn fork(
    channel: &OwnedFd,
    stdout: &OwnedFd,
    stderr: &OwnedFd,
) -> Result<(Pid, Option<OwnedFd>)> {
    let mut slot = server_slot();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let server = running(&mut slot)?;
        match request(server, channel, stdout, stderr) {
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
                return Err(Error::Forkserver(format!(
                    "the forkserver (pid {pid}) died while forking a child ({why}), twice in a row"
                )));
            }
            Err(e) => return Err(e),
        }
    }
}

fn request(
    server: &Server,
    channel: &OwnedFd,
    stdout: &OwnedFd,
    stderr: &OwnedFd,
) -> Result<(Pid, Option<OwnedFd>)> {
    let request = ForkRequest {
        parent: getpid().as_raw(),
    };
    let encoded = wire::encode(&request)?;
    server.requests.send(
        encoded.bytes(),
        &[channel.as_fd(), stdout.as_fd(), stderr.as_fd()],
    )?;
    let reply = server.requests.recv(Some(SERVER_TIMEOUT))?;
    match wire::decode::<ForkReply>(&reply.bytes, Vec::new())? {
        ForkReply::Forked { pid } => Ok((Pid::from_raw(pid), reply.fds.into_iter().next())),
        ForkReply::Failed(why) => Err(Error::Forkserver(format!("could not fork: {why}"))),
        ForkReply::Ready { .. } => Err(Error::Protocol("forkserver sent Ready twice".into())),
    }
}
