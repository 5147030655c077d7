//! Compiles real uses of `#[ipc_test]` (under `cfg(test)`, where the generated `#[test]`s exist)
//! and checks the generated tests by name.

use rstest::rstest;
use vmm_core::process::Context;

#[vmm_core::ipc_test]
#[ignore = "the runtime is not implemented in this branch"]
fn plain(ctx: &Context) {
    let _ = ctx;
}

#[rstest]
#[case(1)]
#[case(2)]
#[vmm_core::ipc_test(methods = [forkserver])]
#[ignore = "the runtime is not implemented in this branch"]
fn with_cases(#[ignore] ctx: &Context, #[case] n: u32) {
    let _ = (ctx, n);
}

/// The names libtest (and so cargo test and nextest) sees, from this binary's own `--list`.
fn listed_tests() -> Vec<String> {
    let exe = std::env::current_exe().expect("current_exe");
    let output = std::process::Command::new(exe)
        .arg("--list")
        .output()
        .expect("run the test binary with --list");
    assert!(output.status.success(), "{output:?}");
    let mut names: Vec<String> = String::from_utf8(output.stdout)
        .expect("utf-8 listing")
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .map(str::to_owned)
        .collect();
    names.sort();
    names
}

#[test]
fn generated_tests_are_listed() {
    let names = listed_tests();
    println!("{names:#?}");
}
