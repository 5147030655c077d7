//! What `#[ipc_test]` expands to. Not a public API: names and signatures may change.
//!
//! The expansion names exactly these paths: `Spec`, `run`, `Requirement`, `Context`,
//! `StartMethod`, `TestReturn`.

pub use super::requirements::Requirement;
pub use super::spec::{Spec, TestReturn};
pub use crate::process::{Context, StartMethod};

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
