//! The runtime behind `#[ipc_test]`: fd accounting, requirement checks.

mod fds;

#[doc(hidden)]
pub mod __private;

pub use crate::process::ensure_running as warm_forkserver;
pub use fds::{open_fds, settled_open_fds};
