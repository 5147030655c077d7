//! Start methods (spawn, forkserver), processes, child entry.

/// How a child process is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum StartMethod {
    /// fork+exec of the current executable.
    Spawn,
    /// A fork of the per-parent forkserver.
    Forkserver,
}

/// Starts children with one start method.
#[derive(Debug, Clone)]
pub struct Context {
    method: StartMethod,
}

impl Context {
    /// A context for `method`.
    pub fn new(method: StartMethod) -> Self {
        Context { method }
    }

    /// The start method.
    pub fn method(&self) -> StartMethod {
        self.method
    }
}

/// Everything known about a failed child.
#[derive(Debug, thiserror::Error)]
#[error("child failed")]
pub struct ChildError {}

/// Divert into the child role if this process was started as a child.
pub fn init() {}
