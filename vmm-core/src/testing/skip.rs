//! Skipping a test whose requirement is not met, loudly.

use std::io::Write;

use super::requirements::Requirement;

/// The variable that turns every skip into a failure (GPU runs set it).
pub const REQUIRE_VAR: &str = "VMM_REQUIRE_GPU";
/// If set, every skip line is also appended to the file it names.
pub const SKIP_LOG_VAR: &str = "VMM_SKIP_LOG";

/// Report a skip: one `SKIP <test>: <reason>` line on the real stderr (libtest's capture only
/// sees `print!`/`eprint!`, not writes to the handle), and in `VMM_SKIP_LOG`. Under
/// `VMM_REQUIRE_GPU=1` it panics with the same reason instead.
pub(crate) fn skip(test: &str, reason: &str) {
    let line = format!("SKIP {test}: {reason}\n");
    if std::env::var(REQUIRE_VAR).is_ok_and(|v| v == "1") {
        panic!("{test} would be skipped, but {REQUIRE_VAR}=1 requires it to run: {reason}");
    }
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os(SKIP_LOG_VAR) {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut log| log.write_all(line.as_bytes()));
        if let Err(e) = appended {
            let _ = writeln!(
                std::io::stderr(),
                "vmm-ipc: could not append to {SKIP_LOG_VAR}={path:?}: {e}"
            );
        }
    }
}

/// For plain `#[test]`s: `true` when `requirement` holds; otherwise report the skip for the
/// running test (one `SKIP` line, `VMM_SKIP_LOG`) and return `false`, or fail under
/// `VMM_REQUIRE_GPU=1`.
///
/// ```no_run
/// // The first lines of a `#[test] fn needs_a_gpu()`:
/// if !vmm_core::testing::skip_unless(vmm_core::testing::cuda_vmm_ipc()) {
///     return;
/// }
/// // ... the test itself
/// ```
pub fn skip_unless(requirement: impl Requirement) -> bool {
    match requirement.check() {
        Ok(()) => true,
        Err(reason) => {
            let name =
                super::harness::current_test_name().unwrap_or_else(|| "<unnamed test>".into());
            skip(&name, &reason);
            false
        }
    }
}
