//! Compile-fail snapshots of every `#[ipc_test]` error, and a non-test build that must be
//! warning-free. Regenerate snapshots with `TRYBUILD=overwrite cargo test -p vmm-macros --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
