//! [`Context`]: how children are started, and what each is given.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::memfd::{MFdFlags, memfd_create};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::handle::Process;
use super::launch::{self, Launch, current_test_name};
use super::method::StartMethod;
use super::protocol::Start;
use super::tracker::{FateCell, Registry};
use super::{entry, forkserver, sys};
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// The default child timeout: `VMM_CHILD_TIMEOUT` seconds if set (a positive number), else 60 s.
pub fn default_timeout() -> Duration {
    std::env::var("VMM_CHILD_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|secs| secs.is_finite() && *secs > 0.0)
        .map_or(Duration::from_secs(60), Duration::from_secs_f64)
}

/// Starts children with one start method.
///
/// ```no_run
/// use vmm_core::process::{Context, StartMethod};
/// let ctx = Context::new(StartMethod::Spawn);
/// let child = ctx.spawn(|n: u32| assert_eq!(n, 7), 7).unwrap();
/// child.wait().unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Context {
    method: StartMethod,
    timeout: Duration,
    env: Vec<(String, String)>,
    /// Set by `#[ipc_test]`: every child started is recorded so that none outlives the test.
    registry: Option<Arc<Registry>>,
}

impl Context {
    /// A context for `method`, with the [default timeout](default_timeout).
    pub fn new(method: StartMethod) -> Self {
        Context {
            method,
            timeout: default_timeout(),
            env: Vec::new(),
            registry: None,
        }
    }

    /// The start method.
    pub fn method(&self) -> StartMethod {
        self.method
    }

    /// The timeout [`Process::wait`] uses.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Use `timeout` for [`Process::wait`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set an environment variable in every child this context starts (before its function runs).
    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Record every child started through this context (and its clones) in `registry`.
    pub(crate) fn with_registry(mut self, registry: Arc<Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Start a child that runs `f(args)`.
    ///
    /// `f` is a plain `fn` or a non-capturing closure compiled into the main executable: the
    /// child finds it by its offset in its own copy of the executable. A function that lives
    /// elsewhere (in a shared library) is refused with [`Error::InvalidArgument`] before
    /// anything is started. `args` travels serialised, its fds out of band: pass a clone of
    /// anything the parent keeps (buffers and queues are reference-counted handles).
    pub fn spawn<A>(&self, f: fn(A), args: A) -> Result<Process>
    where
        A: Serialize + DeserializeOwned,
    {
        let trampoline: sys::Trampoline = entry::trampoline::<A>;
        // The child finds both functions by their offsets from `code_base`: only addresses in
        // the main executable's code have the same offset in every process running it.
        sys::check_main_text(
            sys::code_base as fn() -> usize as usize,
            "vmm-core's code (is vmm-core linked as a shared library?)",
        )?;
        sys::check_main_text(f as usize, "the child's function passed to Context::spawn")?;
        sys::check_main_text(
            trampoline as usize,
            "the child trampoline for this argument type",
        )?;

        let encoded = wire::encode(&args)?;
        let start = Start {
            layout: sys::code_offset(sys::layout_probe as fn() -> usize as usize),
            trampoline: sys::code_offset(trampoline as usize),
            func: sys::code_offset(f as usize),
            method: self.method,
            env: self.env.clone(),
            args: encoded.bytes().to_vec(),
        };
        let (ours, theirs) = Channel::pair()?;
        // Queued before the child exists: it reads it as soon as it reaches its entry.
        let start = wire::encode(&start)?;
        let fds: Vec<_> = encoded.fds().collect();
        ours.send(start.bytes(), &fds)?;
        drop(encoded);

        let stdout = output_memfd(c"vmm-ipc-child-stdout")?;
        let stderr = output_memfd(c"vmm-ipc-child-stderr")?;
        let (pid, pidfd) = match self.method {
            StartMethod::Spawn => {
                let pid = launch::launch(Launch {
                    role: "spawn",
                    channel: theirs.into_fd(),
                    output: Some((dup(&stdout)?, dup(&stderr)?)),
                    test_name: current_test_name(),
                    env: self.env.clone(),
                })?;
                (pid, None)
            }
            StartMethod::Forkserver => {
                let theirs = theirs.into_fd();
                forkserver::fork(&theirs, &stdout, &stderr)?
            }
        };
        let pidfd = pidfd.map(Arc::new);
        let fate = Arc::new(FateCell::default());
        if let Some(registry) = &self.registry {
            registry.track(pid, self.method, Arc::clone(&fate), pidfd.as_ref());
        }
        Ok(Process::new(
            pid,
            self.method,
            ours,
            (stdout, stderr),
            pidfd,
            fate,
            self.timeout,
        ))
    }
}

fn output_memfd(name: &std::ffi::CStr) -> Result<OwnedFd> {
    memfd_create(name, MFdFlags::MFD_CLOEXEC)
        .map_err(|e| Error::errno("memfd_create(child output)", e))
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd> {
    fd.try_clone().map_err(|e| Error::io("dup", e))
}
