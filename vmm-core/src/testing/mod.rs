//! The runtime behind [`#[ipc_test]`](crate::ipc_test): skips, the thread-unsafe lock, fd
//! accounting and requirement checks.
//!
//! Environment:
//! - `VMM_REQUIRE_GPU=1` turns every skip into a failure with the same reason.
//! - `VMM_SKIP_LOG=<file>` appends every `SKIP <test>: <reason>` line to that file.
//! - `VMM_CHILD_TIMEOUT=<secs>` is the default timeout of a test and of its children's joins
//!   (see [`parse_timeout`](crate::process::parse_timeout): `inf` is no timeout; a value that
//!   is not a positive number fails every `#[ipc_test]` that runs, naming the value).
//! - `VMM_WARM_DEPTH`, `VMM_WARM_DEVICES`: the warm pool that tests under `warm` take their
//!   children from (see [`WarmOptions`](crate::process::WarmOptions)).

mod exclusive;
mod fds;
mod harness;
mod registry;
mod requirements;
mod runner;
mod skip;
mod spec;

#[doc(hidden)]
pub mod __private;

pub use exclusive::running_ipc_tests;
pub use fds::{closer_threads_started, open_fds, settled_open_fds};
pub use requirements::{
    Requirement, cuda_devices, cuda_fabric, cuda_vmm_ipc, forkserver_available,
};
pub use skip::{REQUIRE_VAR, SKIP_LOG_VAR, skip_unless};
