//! Compile-fail snapshots of every `#[ipc_test]` error, and a non-test build that must be
//! warning-free. Regenerate snapshots with `TRYBUILD=overwrite cargo test -p vmm-macros --test ui`.

use std::path::Path;
use std::process::Command;

#[test]
fn ui() {
    // trybuild compiles each case with cargo, in this crate's directory. A staged test binary
    // run on a machine without the toolchain or the sources (the GPU machine) cannot do that,
    // nor one started outside cargo (cargo and nextest set CARGO_MANIFEST_DIR for the run).
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo_works = Command::new(env!("CARGO"))
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let under_cargo = std::env::var_os("CARGO_MANIFEST_DIR").is_some();
    if !cargo_works || !under_cargo || !manifest.join("tests/ui").is_dir() {
        eprintln!(
            "SKIP ui: compile-fail tests need cargo and the crate's sources, run through cargo"
        );
        return;
    }
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
