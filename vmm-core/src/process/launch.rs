//! fork+exec of the current executable, through `posix_spawn` on one long-lived thread.
//!
//! `posix_spawn` (vfork-style in glibc) never copies the parent's address space, so a parent
//! that has initialised CUDA is never forked. Launches from any thread but the main one happen
//! on one launcher thread that lives as long as the process, because `PR_SET_PDEATHSIG` fires
//! when the *thread* that started a child exits: a child started from a short-lived test thread
//! would otherwise be killed when that thread ends. The main thread launches by itself: its end
//! is the process's (returning from `main` exits), and the hop to the launcher thread and back
//! cost about 100 us a child (two thread wake-ups; measured by vmm-bench's `spawn-started`
//! split), at worst until the child had run, when the launcher got the CPU back only then. (A C
//! `main` that calls `pthread_exit` while other threads run would take its children with it.)

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::OnceLock;
use std::sync::mpsc::{self, Sender};

use nix::fcntl::OFlag;
use nix::spawn::{PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags, posix_spawn};
use nix::sys::signal::SigSet;
use nix::sys::stat::Mode;
use nix::unistd::{Pid, getpid};

use super::protocol::{ROLE_VAR, Role};
use crate::error::{ForkserverFailure, SpawnRule};
use crate::{Error, Result};

/// What to start: a child or a forkserver, and what it inherits.
#[derive(Debug)]
pub(crate) struct Launch {
    /// What the process is to be (the role variable says it, with the channel's fd).
    pub role: Role,
    /// The child's end of its channel; inherited at the same number.
    pub channel: OwnedFd,
    /// Where the child's stdout and stderr go; `None` inherits the parent's.
    pub output: Option<(OwnedFd, OwnedFd)>,
    /// The child's argv after `argv[0]` (see [`hook::child_args`](super::hook::child_args)).
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
}

type Job = Box<dyn FnOnce() + Send>;

fn launcher() -> Result<&'static Sender<Job>> {
    static LAUNCHER: OnceLock<std::result::Result<Sender<Job>, String>> = OnceLock::new();
    LAUNCHER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("vmm-ipc-launcher".into())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map(|_| tx)
                .map_err(|e| format!("could not start the launcher thread: {e}"))
        })
        .as_ref()
        .map_err(|e| Error::forkserver(ForkserverFailure::Launcher, e.clone()))
}

/// Start `launch` from the launcher thread, then (still on that thread) hand the outcome to
/// `then`; returns once the job is queued. `then` must not wait for anything that waits for the
/// launcher thread (a synchronous [`launch`]): it would wait for itself.
pub(crate) fn launch_then(
    launch: Launch,
    then: impl FnOnce(Result<Pid>) + Send + 'static,
) -> Result<()> {
    launcher()?
        .send(Box::new(move || then(spawn_now(launch))))
        .map_err(|_| Error::forkserver(ForkserverFailure::Launcher, "the launcher thread is gone"))
}

/// Start `launch` (from the launcher thread, unless this is the main thread: module docs) and
/// return the child's pid.
pub(crate) fn launch(launch: Launch) -> Result<Pid> {
    if nix::unistd::gettid() == getpid() {
        return spawn_now(launch);
    }
    let (tx, rx) = mpsc::sync_channel(1);
    launch_then(launch, move |launched| {
        let _ = tx.send(launched);
    })?;
    rx.recv().map_err(|_| {
        Error::forkserver(
            ForkserverFailure::Launcher,
            "the launcher thread dropped a request",
        )
    })?
}

/// Whether `key=value` can be set in a child's environment: a key that is not empty and has no
/// `=` or NUL, a value without NUL, and not the role variable (a child's role is vmm-core's to
/// give, never an environment setting's).
pub(crate) fn valid_env(key: &str, value: &str) -> bool {
    !key.is_empty() && !key.contains(['=', '\0']) && !value.contains('\0') && key != ROLE_VAR
}

/// `Ok` when every variable of `env` is [valid](valid_env); else [`Error::SpawnRefused`]
/// naming the first that is not.
pub(crate) fn check_env(env: &[(String, String)]) -> Result<()> {
    match env.iter().find(|(key, value)| !valid_env(key, value)) {
        None => Ok(()),
        Some((key, _)) => Err(Error::SpawnRefused {
            rule: SpawnRule::Environment,
            message: format!(
                "environment variable {key:?} cannot be given to a child: a key must be \
                 non-empty without '=' or NUL, a value without NUL, and {ROLE_VAR} is \
                 vmm-core's own"
            ),
        }),
    }
}

fn cstring(bytes: &[u8]) -> Result<CString> {
    CString::new(bytes).map_err(|_| Error::SpawnRefused {
        rule: SpawnRule::Environment,
        message: "argument or environment contains a NUL byte".into(),
    })
}

fn spawn_now(launch: Launch) -> Result<Pid> {
    let channel = launch.channel.as_raw_fd();
    let mut actions = PosixSpawnFileActions::init()
        .map_err(|e| Error::errno("posix_spawn_file_actions_init", e))?;
    // dup2 onto itself clears CLOEXEC in the child only (glibc >= 2.29), so no other child
    // started meanwhile by another thread can inherit this fd.
    actions
        .add_dup2(channel, channel)
        .map_err(|e| Error::errno("posix_spawn_file_actions_adddup2(channel)", e))?;
    // A child never reads the parent's stdin (a test runner's terminal, say).
    actions
        .add_open(0, c"/dev/null", OFlag::O_RDONLY, Mode::empty())
        .map_err(|e| Error::errno("posix_spawn_file_actions_addopen(stdin)", e))?;
    if let Some((stdout, stderr)) = &launch.output {
        actions
            .add_dup2(stdout.as_raw_fd(), 1)
            .map_err(|e| Error::errno("posix_spawn_file_actions_adddup2(stdout)", e))?;
        actions
            .add_dup2(stderr.as_raw_fd(), 2)
            .map_err(|e| Error::errno("posix_spawn_file_actions_adddup2(stderr)", e))?;
    }
    let mut attr = PosixSpawnAttr::init().map_err(|e| Error::errno("posix_spawnattr_init", e))?;
    attr.set_sigmask(&SigSet::empty())
        .map_err(|e| Error::errno("posix_spawnattr_setsigmask", e))?;
    attr.set_flags(PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK)
        .map_err(|e| Error::errno("posix_spawnattr_setflags", e))?;

    let argv0 = std::env::args_os()
        .next()
        .unwrap_or_else(|| OsString::from("vmm-ipc-child"));
    let mut argv = vec![cstring(argv0.as_bytes())?];
    for arg in &launch.args {
        argv.push(cstring(arg.as_bytes())?);
    }
    let mut env = Vec::new();
    for (key, value) in std::env::vars_os() {
        if key == ROLE_VAR || launch.env.iter().any(|(k, _)| key == k.as_str()) {
            continue;
        }
        let mut pair = key.as_bytes().to_vec();
        pair.push(b'=');
        pair.extend_from_slice(value.as_bytes());
        env.push(cstring(&pair)?);
    }
    for (key, value) in &launch.env {
        env.push(cstring(format!("{key}={value}").as_bytes())?);
    }
    let role = launch.role.encode(channel, getpid().as_raw() as u32);
    env.push(cstring(format!("{ROLE_VAR}={role}").as_bytes())?);

    posix_spawn(c"/proc/self/exe", &actions, &attr, &argv, &env).map_err(|e| {
        Error::errno(
            format!(
                "posix_spawn(/proc/self/exe) for a {} child",
                launch.role.name()
            ),
            e,
        )
    })
    // `launch` drops here: the parent's copies of the child's channel and output fds close.
}
