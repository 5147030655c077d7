//! The forkserver itself: a fresh exec of the current executable that forks children on request.
//!
//! It never initialises CUDA and never starts a thread, so every fork copies a small,
//! single-threaded, CUDA-free process. It reaps its children and reports each exit status on the
//! child's own channel (it keeps a copy of the child's end for that), so a parent learns how its
//! child ended without being its parent. It exits when its parent closes the request channel
//! (and is killed if its parent dies); its children die with it.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, getpid};

use super::child_runtime::{self, EXIT_NO_START};
use super::ends::{ChildEnd, Received, ServerEnd};
use super::entry;
use super::protocol::{ForkReply, ForkRequest, Report};
use super::supervisor::exit_status;
use super::{launch, sys};
use crate::Error;
use crate::error::ProtocolRule;
use crate::error::StartMethod;

/// The forkserver's main loop. Never returns.
///
/// Refuses to serve (exits) unless this process has a single thread: it forks, and only a
/// single-threaded process may fork and go on running ordinary code in the child.
pub(crate) fn serve(requests: ServerEnd) -> ! {
    if !sys::is_single_threaded() {
        eprintln!(
            "vmm-ipc: the forkserver must be single-threaded, and this process has several \
             threads; an executable that is not a test binary must call \
             vmm_core::process::init() first thing in main"
        );
        std::process::exit(EXIT_NO_START);
    }
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
        .send(&ForkReply::Ready {
            pid: getpid().as_raw(),
        })
        .is_err()
    {
        std::process::exit(EXIT_NO_START);
    }
    let mut children: HashMap<Pid, ChildEnd> = HashMap::new();
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
                Ok(Some(request)) => fork_one(request, &requests, &mut children, &old_mask),
                Ok(None) => {}
                // A request that could not be taken whole (its fds do not fit under this
                // server's fd limit: MSG_CTRUNC) or read was consumed: refuse it, and serve on.
                Err(error @ Error::Protocol { .. }) => {
                    let _ = requests.send(&ForkReply::Failed(error));
                }
                // The parent is gone: take the children with us.
                Err(_) => shutdown(&mut children),
            }
        }
    }
}

/// Aborts the process if dropped: held by a forked child for as long as the server's frames
/// (and the fds their objects own) lie below it on the stack, so that a panic can never unwind
/// into them. The child leaves only through `process::exit`, which drops nothing.
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        std::process::abort();
    }
}

fn fork_one(
    received: Received<ForkRequest>,
    requests: &ServerEnd,
    children: &mut HashMap<Pid, ChildEnd>,
    old_mask: &SigSet,
) {
    let server = getpid();
    let Received {
        message: request,
        fds,
    } = received;
    if fds.len() != 3 {
        let reply = ForkReply::Failed(Error::protocol(
            ProtocolRule::Internal,
            format!(
                "malformed fork request ({} fds; want 3: the child's channel, stdout, stderr)",
                fds.len()
            ),
        ));
        let _ = requests.send(&reply);
        return;
    }
    let raw: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    // SAFETY: `serve` checked that this process had one thread when it started, and the server
    // starts none: it only polls, reads and writes its sockets, forks and reaps (it never
    // initialises CUDA or anything else that could start a thread).
    match unsafe { sys::fork_single_threaded() } {
        Ok(ForkResult::Child) => {
            // From here on this child never returns into, or unwinds through, the server's
            // frames: it leaves through `run_child`, which exits the process (dropping
            // nothing), or aborts. So the objects there that own fds (the request channel, the
            // signalfd, other children's channels) are never used or dropped again, and the
            // fds below may be renumbered and closed under them.
            let _no_unwind = AbortOnUnwind;
            // Its fds are renumbered below; the request must never close them.
            std::mem::forget(fds);
            let _ = old_mask.thread_set_mask();
            // Renumber: stdout, stderr, then the channel at 3.
            // SAFETY: 1 and 2 are the standard streams, which std refers to by number and
            // which are meant to follow redirection; the sources are the request's fds, open
            // (they were forgotten, not dropped).
            let ok =
                unsafe { sys::dup2_raw(raw[1], 1).is_ok() && sys::dup2_raw(raw[2], 2).is_ok() };
            // SAFETY: any object that owns fd 3 lives in the server's frames, never used or
            // dropped again (above); a received fd is never 0, 1 or 2 (the server's standard
            // streams are open), so `raw[0]` survived the two dup2 calls above.
            let ok = ok && (raw[0] == 3 || unsafe { sys::dup2_raw(raw[0], 3).is_ok() });
            if !ok {
                std::process::exit(EXIT_NO_START);
            }
            // Close everything else the server had (its request channel, signalfd, other
            // children's channels, the request's original fds).
            // SAFETY: every owner of an fd from 4 up lives in the server's frames, never used
            // or dropped again (above), or was forgotten (the request's fds).
            unsafe { sys::close_from(4) };
            // SAFETY: fd 3 is now the child's channel; whatever owned the number before lives in
            // the server's frames (never used or dropped again) or was forgotten (the request's),
            // and this is the one adoption of fd 3 in this child.
            let Ok(channel) = (unsafe { sys::adopt_inherited_fd(3) }) else {
                std::process::exit(EXIT_NO_START);
            };
            child_runtime::die_with(server);
            // The environment the parent asked for, set as the child is made (a start message
            // carries none). Only the parent that started this server sends requests.
            let env: Vec<_> = request
                .env
                .into_iter()
                .filter(|(key, value)| launch::valid_env(key, value))
                .collect();
            // SAFETY: this child of a single-threaded server (see `serve`) has one thread and
            // has started none.
            unsafe { sys::set_env_single_threaded(&env) };
            entry::run_child(ChildEnd::from_fd(channel), StartMethod::Forkserver)
        }
        Ok(ForkResult::Parent { child }) => {
            let mut fds = fds.into_iter();
            let channel = ChildEnd::from_fd(fds.next().expect("three fds checked"));
            drop(fds); // our copies of the child's stdout and stderr
            let pidfd = sys::pidfd_open(child).ok();
            let reply = ForkReply::Forked {
                pid: child.as_raw(),
            };
            let pidfds: Vec<_> = pidfd.iter().map(AsFd::as_fd).collect();
            let sent = requests.send_with(&reply, &pidfds, None);
            children.insert(child, channel);
            if sent.is_err() {
                shutdown(children);
            }
        }
        Err(e) => {
            let _ = requests.send(&ForkReply::Failed(e));
        }
    }
}

fn reap(children: &mut HashMap<Pid, ChildEnd>) {
    loop {
        let (pid, status) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
            Ok(status) => match (status.pid(), exit_status(status)) {
                (Some(pid), Some(exited)) => (pid, exited),
                _ => continue,
            },
            Err(Errno::EINTR) => continue,
            Err(_) => return,
        };
        if let Some(channel) = children.remove(&pid) {
            let _ = channel.send(&Report::Exited(status));
        }
    }
}

fn shutdown(children: &mut HashMap<Pid, ChildEnd>) -> ! {
    for pid in children.keys() {
        let _ = kill(*pid, Signal::SIGKILL);
    }
    for pid in children.keys() {
        let _ = waitpid(*pid, None);
    }
    std::process::exit(0)
}
