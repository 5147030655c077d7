//! The start methods.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How a child process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StartMethod {
    /// fork+exec (`posix_spawn`) of the current executable: a fresh process image.
    Spawn,
    /// A fork of this process's forkserver: a fresh, CUDA-free image forked on request.
    Forkserver,
    /// A child started like `Spawn` (a fresh exec), but ahead of need: it initialised CUDA (where
    /// there is a GPU) while it waited in this process's [warm pool](super::warm_pool). It still
    /// runs exactly one function, so its isolation is spawn's; only the start-up is moved off
    /// the critical path.
    Warm,
}

impl StartMethod {
    /// Every start method, in a fixed order.
    pub const ALL: [StartMethod; 3] = [
        StartMethod::Spawn,
        StartMethod::Forkserver,
        StartMethod::Warm,
    ];

    /// `"spawn"`, `"forkserver"` or `"warm"`.
    pub fn name(self) -> &'static str {
        match self {
            StartMethod::Spawn => "spawn",
            StartMethod::Forkserver => "forkserver",
            StartMethod::Warm => "warm",
        }
    }

    /// Whether a child started this way is a child of this process (which reaps it), rather
    /// than of the forkserver (which reaps it and reports its status).
    pub(crate) fn is_direct_child(self) -> bool {
        !matches!(self, StartMethod::Forkserver)
    }
}

impl fmt::Display for StartMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
