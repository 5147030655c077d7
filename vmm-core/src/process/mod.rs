//! Start methods (spawn, forkserver, warm), [`Process`], [`Pool`], and the child entry.
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
//! - **warm**: a child started the way spawn starts one, but ahead of need: it waits in this
//!   process's [warm pool](WarmPool) with CUDA already initialised (where there is a GPU; the
//!   devices and the pool's depth are [`WarmOptions`]), and `spawn` hands it the function. It
//!   still runs exactly one function, so the isolation is spawn's; only the start-up moved off
//!   the critical path. A replacement starts in the background; a waiting child that died is
//!   found, reaped and replaced, never handed out.
//!
//! ```no_run
//! use std::time::Duration;
//! use vmm_core::process::{Context, StartMethod, WarmPool};
//!
//! fn child(n: u32) {
//!     assert_eq!(n, 7); // CUDA is initialised here already, on a GPU machine
//! }
//!
//! fn main() -> vmm_core::Result<()> {
//!     vmm_core::process::init();
//!     WarmPool::global().fill()?; // optional: start the pool now and wait until it is ready
//!     let ctx = Context::new(StartMethod::Warm);
//!     ctx.spawn(child, 7)?.join(Duration::from_secs(10))?;
//!     Ok(())
//! }
//! ```
//!
//! For programs that run many short jobs, a [`Pool`] keeps warm workers that run one task after
//! another (`fn(A) -> R`, typed results; whatever a task's argument carries is released when the
//! task ends).
//!
//! Either way, once the child exists and the parent holds it in a [`Process`], the parent sends
//! a start message (the argument, fds out of band) on the child's own socketpair; the child
//! waits for it, acknowledges, runs `f(arg)` and reports how it ended. A child whose start
//! message never comes (because `spawn` failed after it was made) exits without running `f`,
//! so a `spawn` that returns `Err` never runs `f`. A child dies with its parent
//! (`PR_SET_PDEATHSIG`), and a dropped, unjoined [`Process`] kills it without waiting (one
//! supervisor reaps every dropped child in the background, as soon as the kernel has ended it);
//! the parent watches the child process itself, so no use of its channel can keep a join from
//! its deadline or leave a zombie.
//!
//! # Threat model
//!
//! A process vmm-core starts is a child of the process that started it, of the same
//! executable, and nothing else may make one: the parent is trusted, everything else that can
//! reach a process (its environment, an fd it inherited, what a task does inside it) is not.
//! What the checks stop:
//! - **Taking over any executable through the environment.** Every executable that links
//!   vmm-core carries a pre-`main` hook that reads `VMM_IPC_CHILD`. The variable alone grants
//!   nothing: it is ignored in a secure-exec process (`AT_SECURE`: setuid, setgid, file
//!   capabilities), where vmm-core is not part of the main executable (a library loaded into
//!   another program), and unless the fd it names is a Unix `SOCK_SEQPACKET` socket whose peer,
//!   by the kernel's `SO_PEERCRED`, is this process's parent running as this process's
//!   effective uid (never the overflow uid of an unmapped user). The fd is checked before it is
//!   touched, and adopted only there, before `main`: [`init`] never takes an fd by number.
//! - **Running code of a sender's choosing.** A child runs only entry points its own
//!   executable registered: each `Context::spawn` and `Pool::submit` instantiation places its
//!   trampoline in a linker-built table, and an offset that is not in it (a forged one, one
//!   at `abort`, a wild one) is refused with a `NotRun` report and a clean exit, never called.
//!   The function a child runs is named by its type (a `fn` item or a closure that captures
//!   nothing), so there is no second address to forge.
//! - **Setting a child's environment by message.** A start message carries no environment: a
//!   child gets [`Context::with_env`]'s variables where it is made (at exec, or from the
//!   forkserver as it forks), and the role variable cannot be among them.
//! - **A task that runs twice.** A pool hands a task to another worker only if the kernel
//!   still holds it unread in the dead worker's task socket; nothing a task does to its own
//!   process can make one that may have run look unread.
//! - **Payloads in diagnostics.** Errors and protocol-violation messages show a message's
//!   length, never its bytes (an argument or result may be a fabric handle: a bearer token).
//!
//! What they do not stop: the parent itself (it chooses what its children run, among the
//! entry points it registered), and another process of the same uid that can `ptrace` a child
//! (the kernel's rules, not vmm-core's, decide that).

// Inside, each file one job; dependencies point down this list, never back up:
// - pool/: `Pool` (mod), `TaskHandle` (task_handle), the waiters' event loop, dispatch and
//   replacement of the dead (events), a worker's reports (report); below them `PoolState`
//   (pool_state: the one owner of the workers' slots, the task table and queue), then `Worker`
//   (worker: one worker's state, start and end, and the dying: a worker whose exit status a
//   task's error awaits, ended without waiting), then `TaskMessage` (task_message: a task on its
//   way to a worker, and the redelivery cap)
// - context: `Context` (what the parent does to start a child), `make` (a child of any
//   method, waiting for its first message)
// - process_handle: `Process` (a single-use child's reports; join, kill)
// - warm/: `WarmPool` (mod), `WarmOptions` (warm_options), one waiting child (waiting)
// - forkserver: the parent's side of the forkserver (start it, ask it for a child)
// - role: the pre-`main` hook and `init`: a started process takes its role
// - server: the forkserver's own loop (forks children)
// - entry: a child's life: (warm-up,) start message, its call, report, exit
// - task_loop: a pool worker's life (the child's side): warm-up, then calls from its task socket
//   until it closes
// - remote: one remote call (the entry point registered for a function, the `Call` naming it,
//   running it in the child), for single-use children and pool tasks alike
// - entries: the entry table (what a child may run on its parent's word) and its lookup
// - child_runtime: what every child does (exit codes, die with the parent, record panics, warm
//   up)
// - tracker: a child's fate, and the `Tracker` a `Context` tells of each child it starts
//   (`testing` keeps `#[ipc_test]`'s registry behind it)
// - supervisor: `Child`, the one held child (pid, pidfd, channel, output, what is known of
//   its end), and everything done to one: who reaps it, the one loop that reads its reports
//   (`read_reports`), kill, reap, ending it with or without waiting (`end`, `Ending`), and the
//   orphan queue that kills and reaps a dropped child in the background (a drop never waits).
//   One noun for it: every holder keeps a `Child` and is named for what it is to it: `Process`
//   (the user's handle, public), `NewChild` (just made, not yet handed over), `WaitingChild`
//   (in the warm pool), a pool's `Worker` (a child plus its task socket) and `Dying` worker;
//   `TrackedChild` is a tracker's view of one, from outside. Inside supervisor/, bottom up:
//   child_proc (what is known of a child's end; kill, reap, wait by deadline), report_reader
//   (the one read loop), ending (ending without waiting, and what to poll), orphans (the
//   orphan queue and its reaper thread); its unit tests, on real child processes, are
//   supervisor_tests
// - output: a child's captured stdout and stderr, read from the end up to the output cap
// - launch: posix_spawn of /proc/self/exe on the launcher thread
// - hook: the argv a re-executed child needs, from the harness (`testing` installs libtest's)
// - ends: the typed ends of each socket (a parent's end sends only orders and reads only
//   reports, and so on), so that no end can send the other direction's messages
// - protocol: the messages, one type per direction (`Order`, `Report`, `Call`, `ForkRequest`,
//   `ForkReply`), the one `Outcome` of a call, and the `Role` a started process takes from its
//   role variable (whose device list is capped by warm/warm_options's plain constants, the one
//   edge up this list); status: `ChildError` assembled from an outcome and what the parent saw
//   (`ChildError`, `ExitStatus` and `StartMethod` are plain data in `crate::error`)
// - timeout: `VMM_CHILD_TIMEOUT`, default_timeout
// - sys: the thin unsafe layer (fork, fd renumbering, pidfds, code addresses, environment)
mod child_runtime;
mod context;
mod ends;
mod entries;
mod entry;
mod forkserver;
pub(crate) mod hook;
mod launch;
mod output;
mod pool;
mod process_handle;
mod protocol;
mod remote;
mod role;
mod server;
mod status;
mod supervisor;
mod sys;
mod task_loop;
mod timeout;
pub(crate) mod tracker;
mod warm;

pub(crate) use supervisor::settle_orphans;

pub use crate::error::StartMethod;
pub use context::Context;
pub use forkserver::{ensure_running, forkserver_pid};
pub use output::{DEFAULT_OUTPUT_CAP, output_cap, set_output_cap};
pub use pool::{Pool, TaskHandle};
pub use process_handle::Process;
pub use protocol::{MAX_DEVICE_ORDINAL, MAX_DEVICES};
pub use role::init;
pub use status::{ChildError, ExitStatus};
pub use timeout::{
    FALLBACK_TIMEOUT, MAX_TIMEOUT, TIMEOUT_VAR, default_timeout, parse_timeout, try_default_timeout,
};
pub use warm::{DEFAULT_DEPTH, DEPTH_VAR, DEVICES_VAR, MAX_DEPTH, WarmOptions, WarmPool};
