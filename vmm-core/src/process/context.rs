//! [`Context`]: how children are started, and what each is given.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::ends::{ParentEnd, Sealed};
use super::hook::{self, ChildKind};
use super::launch::{self, Launch};
use super::output::Output;
use super::process_handle::Process;
use super::protocol::{Call, Order, Role, Start};
use super::supervisor::{Child, NewChild};
use super::timeout::default_timeout;
use super::tracker::{FateCell, TrackedChild, Tracker};
use super::warm::WarmPool;
use super::{forkserver, remote};
use crate::error::StartMethod;
use crate::trace;
use crate::wire;
use crate::{Error, Result};

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
    /// Set by `#[ipc_test]`: told of every child started, so that none outlives the test.
    tracker: Option<Arc<dyn Tracker>>,
}

impl Context {
    /// A context for `method`, with the [default timeout](default_timeout).
    pub fn new(method: StartMethod) -> Self {
        Self::with_method_and_timeout(method, default_timeout())
    }

    /// A context for `method` with `timeout`, the environment not consulted.
    pub(crate) fn with_method_and_timeout(method: StartMethod, timeout: Duration) -> Self {
        Context {
            method,
            timeout,
            env: Vec::new(),
            tracker: None,
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

    /// Use `timeout` for [`Process::wait`] (`Duration::MAX`: wait forever).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set an environment variable in every child this context starts, as the child is made
    /// (at exec; a forkserver child as it is forked), before anything of it runs. A key that is
    /// empty or holds `=` or NUL, a value with NUL, and vmm-core's role variable make
    /// [`spawn`](Self::spawn) fail with [`Error::SpawnRefused`].
    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Tell `tracker` of every child started through this context (and its clones).
    pub(crate) fn with_tracker(mut self, tracker: Arc<dyn Tracker>) -> Self {
        self.tracker = Some(tracker);
        self
    }

    /// Start a child that runs `f(args)`.
    ///
    /// `f` is a `fn` item or a closure that captures nothing (a zero-sized type: a function
    /// pointer does not compile), compiled into the main executable. The child finds it by its
    /// type: instantiating `spawn` for `f` registers an entry point for it in the executable's
    /// entry table, and a child runs only entry points found there (a forged one is refused
    /// without being called). Code that lives elsewhere (in a shared library) is refused with
    /// [`Error::SpawnRefused`] before anything is started. `args` travels serialised, its
    /// fds out of band: pass a clone of anything the parent keeps (buffers and queues are
    /// reference-counted handles).
    ///
    /// `Ok` means the child is running (or has run) `f` and is held by the returned
    /// [`Process`]. `Err` means `f` never runs: a child that was already made when the error
    /// happened (a forkserver fork whose reply could not be received at the fd limit, say)
    /// never gets its start message and exits without running it. (A child that dies before
    /// its start message is sent, because it never reached its entry say, is returned: it ran
    /// nothing, and [`Process::join`] reports how it ended.)
    ///
    /// A function pointer does not name a function by its type, so it does not compile:
    ///
    /// ```compile_fail,E0080
    /// # use vmm_core::process::{Context, StartMethod};
    /// let f: fn(u32) = |n| assert_eq!(n, 7);
    /// Context::new(StartMethod::Spawn).spawn(f, 7).unwrap();
    /// ```
    pub fn spawn<F, A>(&self, f: F, args: A) -> Result<Process>
    where
        F: Fn(A) + Copy,
        A: Serialize + DeserializeOwned,
    {
        // Entered here, so that the export of a buffer argument nests in it; `pid` once made.
        let span = trace::span!(
            INFO,
            "process.spawn",
            method = self.method.name(),
            pid = trace::Empty
        );
        let entry = remote::registered::<F, A, ()>(f);
        let what = "the child's entry point for this function";
        // Checked before anything is encoded or made (see `Call::new`).
        let call = Call::to(entry, what)?;
        launch::check_env(&self.env)?;

        let encoded = wire::encode(&args)?;
        let start = Order::Once(Start {
            call: call.with_args(encoded.bytes().to_vec()),
            method: self.method,
        });
        let start = Sealed::new(&start)?;
        let new_child = make(self.method, &self.env, hook::child_args(ChildKind::Test))?;
        let pid = new_child.child.pid();
        trace::record!(span, "pid", pid.as_raw());
        let fate = Arc::new(FateCell::default());
        let process = Process::new(
            new_child.child,
            self.method,
            new_child.ready,
            Arc::clone(&fate),
            self.timeout,
        );
        // The child does nothing until its start message arrives, and it is sent only now that
        // the child is known and held by `process`: if anything above failed, the child (if
        // one was made: a forkserver fork whose reply could not be read, say) sees its channel
        // close and exits without running `f`. So `Err` from here means `f` never runs.
        let fds: Vec<_> = encoded.fds().collect();
        match process.send_start(&start, &fds) {
            // Disconnected: the child is already gone (it died starting, or never reached its
            // entry); it cannot run `f`, and `join` tells its story.
            Ok(()) | Err(Error::Disconnected(_)) => {}
            Err(error) => {
                process.abandon();
                return Err(error);
            }
        }
        drop(fds);
        drop(encoded);
        if let Some(tracker) = &self.tracker {
            tracker.track(TrackedChild::new(pid, self.method, fate, process.pidfd()));
        }
        Ok(process)
    }
}

/// Make a child with `method` that waits for its first message. `env` reaches a spawned or
/// warm child at exec (a forkserver child from the server, as it forks); `args` is a spawned
/// child's argv after `argv[0]` (see `hook::child_args`).
pub(crate) fn make(
    method: StartMethod,
    env: &[(String, String)],
    args: Vec<String>,
) -> Result<NewChild> {
    let child = match method {
        StartMethod::Spawn => {
            let (ours, theirs) = ParentEnd::pair()?;
            let output = Output::new()?;
            let pid = launch::launch(Launch {
                role: Role::Spawn,
                channel: theirs.into_fd(),
                output: Some(output.child_ends()?),
                args,
                env: env.to_vec(),
            })?;
            Child::ours(pid, ours, output)
        }
        StartMethod::Forkserver => {
            let (ours, theirs) = ParentEnd::pair()?;
            let output = Output::new()?;
            let (pid, pidfd) = forkserver::fork(&theirs.into_fd(), output.fds(), env)?;
            Child::forked(pid, pidfd, ours, output)
        }
        StartMethod::Warm => return WarmPool::global().take(env),
    };
    Ok(NewChild {
        child,
        ready: false,
    })
}
