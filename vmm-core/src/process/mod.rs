//! Start methods (spawn, forkserver), [`Process`], and the child entry.
//!
//! ```no_run
//! use std::time::Duration;
//! use vmm_core::process::{Context, StartMethod};
//! use vmm_core::shm::HostBuffer;
//!
//! fn child(buf: HostBuffer) {
//!     buf.fill(0xAB).unwrap();
//! }
//!
//! fn main() -> vmm_core::Result<()> {
//!     vmm_core::process::init(); // first line of main in a non-test binary
//!     let buf = HostBuffer::new(4096)?;
//!     let ctx = Context::new(StartMethod::Forkserver);
//!     ctx.spawn(child, buf.clone())?.join(Duration::from_secs(10))?;
//!     assert_eq!(buf.to_vec()[0], 0xAB);
//!     Ok(())
//! }
//! ```
//!
//! How a child is made:
//! - **spawn**: `posix_spawn` of `/proc/self/exe` (the same executable image, whatever happened
//!   to its path) from a long-lived launcher thread, with argv `--exact <running test>
//!   --nocapture --test-threads=1 -q` in a test binary and the role and channel fd in one
//!   environment variable. The child takes its role before `main` (an `.init_array` hook that
//!   every executable linking vmm-core carries), so no test harness runs in it.
//! - **forkserver**: one server per parent, started lazily by spawn, CUDA-free and
//!   single-threaded, forks each child on request and reports its exit status.
//!
//! Either way the parent sends a start message (the argument, fds out of band) on the child's
//! own socketpair, the child acknowledges, runs `f(arg)` and reports how it ended. A child dies
//! with its parent (`PR_SET_PDEATHSIG`), and a dropped, unjoined [`Process`] kills and reaps it.

mod child;
mod entry;
mod forkserver;
mod launch;
mod protocol;
mod sys;
mod tracker;

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::memfd::{MFdFlags, memfd_create};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use child::{ChildError, ExitStatus, Process};
pub use forkserver::{ensure_running, forkserver_pid};

use crate::wire::{self, Channel};
use crate::{Error, Result};
use launch::Launch;
use protocol::Start;
pub(crate) use tracker::Registry;

/// How a child process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StartMethod {
    /// fork+exec (`posix_spawn`) of the current executable: a fresh process image.
    Spawn,
    /// A fork of this process's forkserver: a fresh, CUDA-free image forked on request.
    Forkserver,
}

impl StartMethod {
    /// Every start method, in a fixed order.
    pub const ALL: [StartMethod; 2] = [StartMethod::Spawn, StartMethod::Forkserver];

    /// `"spawn"` or `"forkserver"`.
    pub fn name(self) -> &'static str {
        match self {
            StartMethod::Spawn => "spawn",
            StartMethod::Forkserver => "forkserver",
        }
    }
}

impl fmt::Display for StartMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Take this process's role if vmm-core started it as a child or forkserver (then it never
/// returns); otherwise do nothing.
///
/// Every executable that links vmm-core already does this before `main`, through an
/// `.init_array` hook. Call it anyway as the first line of `main` in binaries that start
/// children (examples, bench mains): it documents the requirement and keeps working where
/// such hooks do not run.
pub fn init() {
    entry::init();
}

/// The default child timeout: `VMM_CHILD_TIMEOUT` seconds if set (a positive number), else 60 s.
pub fn default_timeout() -> Duration {
    std::env::var("VMM_CHILD_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|secs| secs.is_finite() && *secs > 0.0)
        .map_or(Duration::from_secs(60), Duration::from_secs_f64)
}

/// The running test's name: libtest names each test's thread after the test.
pub(crate) fn current_test_name() -> Option<String> {
    let thread = std::thread::current();
    let name = thread.name()?;
    (name != "main" && !name.starts_with("vmm-ipc-")).then(|| name.to_owned())
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
    /// `f` is a plain `fn` or a non-capturing closure: the child finds it in its own copy of this
    /// executable. `args` travels serialised, its fds out of band: pass a clone of anything
    /// the parent keeps (buffers and queues are reference-counted handles).
    pub fn spawn<A>(&self, f: fn(A), args: A) -> Result<Process>
    where
        A: Serialize + DeserializeOwned,
    {
        let encoded = wire::encode(&args)?;
        let trampoline: sys::Trampoline = entry::trampoline::<A>;
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
        let fate = Arc::new(tracker::FateCell::default());
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
