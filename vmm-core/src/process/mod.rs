//! Start methods (spawn, forkserver), processes, child entry.

/// Everything known about a failed child.
#[derive(Debug, thiserror::Error)]
#[error("child failed")]
pub struct ChildError {}

/// Divert into the child role if this process was started as a child.
pub fn init() {}
