//! Why a child could not be made by the forkserver (or the launcher thread that starts
//! spawned children) ([`Error::Forkserver`](super::Error::Forkserver)).

use serde::{Deserialize, Serialize};

/// What went wrong with the forkserver or the launcher thread; the error's message names the
/// pid and how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ForkserverFailure {
    /// The launcher thread (which starts every spawned child, and the forkserver) could not be
    /// started, is gone, or dropped a request.
    Launcher,
    /// The forkserver did not start: it exited, or its first message was not `Ready` (an
    /// executable that is not a test binary must call `vmm_core::process::init()` first).
    DidNotStart,
    /// The forkserver died while forking a child, twice in a row (it was restarted once).
    Died,
    /// The forkserver did not answer a fork request in time; it was killed with the children
    /// it had forked, and the next request starts a new one.
    Unresponsive,
}
