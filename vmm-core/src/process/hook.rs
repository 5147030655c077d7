//! What a re-executed child needs from the program it re-executes: its argv.
//!
//! A spawned, warm or pool child is a fresh exec of this executable. It takes its role before
//! `main` (the pre-`main` hook), so its argv matters only when it does not (the hook deferred,
//! `VMM_IPC_NO_AUTO_INIT`): then a test harness runs, and the argv must make it run the
//! parent's test alone, or nothing. Which arguments do that is the harness's business, not
//! `process`'s: the harness installs a [`Harness`] here (`vmm_core::testing` installs libtest's,
//! before `main`), and without one a child gets no arguments.

use std::sync::OnceLock;

/// What kind of child an argv is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChildKind {
    /// A child (or the forkserver) of the code running on this thread: a harness re-runs the
    /// running test in it.
    Test,
    /// A child started ahead of need, for the warm pool: it belongs to no test.
    Warm,
    /// A pool worker: it belongs to no test.
    PoolWorker,
}

/// The harness this executable runs under, as `process` needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Harness {
    /// The argv after `argv[0]` of a child of this kind started from the calling thread.
    pub child_args: fn(ChildKind) -> Vec<String>,
}

static HARNESS: OnceLock<Harness> = OnceLock::new();

/// Install `harness` (the first one installed stays).
pub(crate) fn install(harness: Harness) {
    let _ = HARNESS.set(harness);
}

/// The argv after `argv[0]` for a child of `kind` started from the calling thread: the installed
/// harness's, else none.
pub(crate) fn child_args(kind: ChildKind) -> Vec<String> {
    HARNESS
        .get()
        .map_or_else(Vec::new, |harness| (harness.child_args)(kind))
}
