//! What `#[ipc_test]` expands to. Not a public API: names and signatures may change.

use std::fmt::Debug;

pub use super::Requirement;
pub use crate::process::{Context, StartMethod};

/// The attribute's options for one generated test (one start method).
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// `module_path!()` inside the generated module (`crate::path::to::function_name`).
    pub module_path: &'static str,
    /// The annotated function's name.
    pub function: &'static str,
    /// This generated test's start method.
    pub method: StartMethod,
    /// `timeout = SECS`, if given.
    pub timeout_secs: Option<u64>,
    /// `thread_unsafe = "reason"`, if given.
    pub thread_unsafe: Option<&'static str>,
}

/// What a test body may return: `()` or `Result<(), E: Debug>`.
pub trait TestReturn {
    /// `Err(message)` when the body failed.
    fn into_result(self) -> Result<(), String>;
}

impl TestReturn for () {
    fn into_result(self) -> Result<(), String> {
        Ok(())
    }
}

impl<E: Debug> TestReturn for Result<(), E> {
    fn into_result(self) -> Result<(), String> {
        self.map_err(|e| format!("{e:?}"))
    }
}

/// Run one generated test: check the requirement, take the thread-unsafe lock, run the body with
/// a [`Context`] for `spec.method` under the test's timeout, then kill and reap whatever children
/// the body left. Panics (fails the test) on a failed body, a failed or leftover child, a timeout,
/// or a skip under `VMM_REQUIRE_GPU=1`.
pub fn run<Q, B, R>(spec: Spec, requirement: Q, body: B)
where
    Q: FnOnce() -> Result<(), String>,
    B: FnOnce(&Context) -> R + Send + 'static,
    R: TestReturn,
{
    super::runner::run(spec, requirement, move |ctx: &Context| {
        body(ctx).into_result()
    })
}
