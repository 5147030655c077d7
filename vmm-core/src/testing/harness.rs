//! What vmm-core knows of libtest: the running test's name (libtest names each test's thread
//! after the test), and the argv that makes a re-executed test binary run one test, or none.
//! Installed into `process` as its [`Harness`] before `main`, so that every child started from a
//! test (an `#[ipc_test]` or a plain `#[test]`) gets it.

use crate::process::hook::{self, ChildKind, Harness};

/// The test name a warm child gets in its argv in a test binary: no test has it, so if the
/// child did not take its role before `main` (the hook disabled), libtest runs nothing and the
/// child exits without acknowledging, which the parent reports.
const WARM_PLACEHOLDER: &str = "vmm-ipc-warm-child";

/// The test name a pool worker gets in its argv in a test binary (see [`WARM_PLACEHOLDER`]).
const WORKER_PLACEHOLDER: &str = "vmm-ipc-pool-worker";

/// The running test's name: libtest names each test's thread after the test. `None` on `main`
/// and on vmm-core's own threads (outside libtest).
pub(crate) fn current_test_name() -> Option<String> {
    let thread = std::thread::current();
    let name = thread.name()?;
    (name != "main" && !name.starts_with("vmm-ipc-")).then(|| name.to_owned())
}

/// libtest's argv for a child of `kind`: run exactly the running test, quietly, on one thread;
/// a child of no test gets a placeholder name no test has. Outside a test (no test name on
/// this thread), none.
fn child_args(kind: ChildKind) -> Vec<String> {
    let Some(test) = current_test_name() else {
        return Vec::new();
    };
    let name = match kind {
        ChildKind::Test => test,
        ChildKind::Warm => WARM_PLACEHOLDER.to_owned(),
        ChildKind::PoolWorker => WORKER_PLACEHOLDER.to_owned(),
    };
    ["--exact", &name, "--nocapture", "--test-threads=1", "-q"]
        .map(str::to_owned)
        .to_vec()
}

/// Runs before `main` in every executable that links vmm-core: `process` asks the harness for
/// a child's argv from then on.
extern "C" fn install() {
    hook::install(Harness { child_args });
}

#[used]
#[unsafe(link_section = ".init_array")]
static INSTALL: extern "C" fn() = install;
