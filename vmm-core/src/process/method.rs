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
