//! Compiles real uses of `#[ipc_test]` (under `cfg(test)`, where the generated `#[test]`s exist)
//! and checks the generated tests by the names libtest lists.
//! The generated tests also run, so each use here is a working example.

// The generated code must be warning-free in test builds (dead_code, unused, non_snake_case).
#![deny(unused, non_snake_case)]

use rstest::rstest;
use vmm_core::process::Context;

const NOT_YET: &str = "";

#[vmm_core::ipc_test]
fn plain(ctx: &Context) {
    let _ = ctx;
}

fn requirement() -> bool {
    NOT_YET.is_empty()
}

/// Every option, a `Result` return, and a private item of the enclosing module in the
/// requirement.
#[vmm_core::ipc_test(
    methods = [spawn],
    skip_unless = requirement(),
    thread_unsafe = "changes the environment",
    timeout = 30,
)]
fn every_option(_ctx: &vmm_core::process::Context) -> Result<(), String> {
    Ok(())
}

mod nested {
    use vmm_core::process::Context;

    fn helper() -> u32 {
        1
    }

    fn check() -> Result<(), &'static str> {
        Ok(())
    }

    /// A body named like a start method, using items of its module and of the parent.
    #[vmm_core::ipc_test(skip_unless = check())]
    pub(crate) fn spawn(ctx: &Context) {
        let _ = (ctx, helper(), super::requirement(), super::NOT_YET);
    }
}

#[vmm_core::ipc_test]
#[cfg(any())]
fn configured_out(ctx: &Context) {
    let _ = ctx;
}

#[rstest]
#[case(1)]
#[case::two(2)]
#[vmm_core::ipc_test(methods = [forkserver, spawn])]
fn with_cases(#[ignore] ctx: &Context, #[case] n: u32) {
    let _ = (ctx, n);
}

#[rstest]
#[vmm_core::ipc_test(methods = [spawn])]
fn with_values(#[ignore] ctx: &Context, #[values(1, 2)] n: u32, #[values("a")] s: &str) {
    let _ = (ctx, n, s);
}

/// `warm` among the methods: its test takes a child from the warm pool, which must run the body's
/// child (the queue proves the function ran there).
#[vmm_core::ipc_test(methods = [warm, spawn])]
fn warm_too(ctx: &Context) {
    fn report(queue: vmm_core::wire::Queue<u32>) {
        queue.put(&std::process::id()).unwrap();
    }
    let queue = vmm_core::wire::Queue::new().unwrap();
    let child = ctx.spawn(report, queue.clone()).unwrap();
    let pid = child.pid();
    child.wait().unwrap();
    assert_eq!(queue.get(std::time::Duration::from_secs(30)).unwrap(), pid);
}

/// A facade that re-exports vmm-core, as a crate wrapping it would. `crate = path` names it,
/// written in any form that resolves next to the function.
mod facade {
    pub(crate) use vmm_core as inner;
}

#[vmm_core::ipc_test(crate = crate::facade::inner, methods = [spawn])]
fn through_facade(ctx: &Context) {
    let _ = ctx;
}

#[vmm_core::ipc_test(crate = facade::inner, methods = [forkserver])]
fn through_facade_relative(ctx: &Context) {
    let _ = ctx;
}

#[vmm_core::ipc_test(crate = self::facade::inner, methods = [spawn], skip_unless = requirement())]
fn through_facade_self(ctx: &Context) {
    let _ = ctx;
}

mod deeper {
    use vmm_core::process::Context;

    #[vmm_core::ipc_test(crate = super::facade::inner, methods = [spawn])]
    fn through_facade_super(ctx: &Context) {
        let _ = ctx;
    }
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
    let mut expected = vec![
        "generated_tests_are_listed",
        "plain::spawn",
        "plain::forkserver",
        "every_option::spawn",
        "nested::spawn::spawn",
        "nested::spawn::forkserver",
        "with_cases::case_1::forkserver",
        "with_cases::case_1::spawn",
        "with_cases::case_2_two::forkserver",
        "with_cases::case_2_two::spawn",
        "with_values::n_1_1::s_1___a__::spawn",
        "with_values::n_2_2::s_1___a__::spawn",
        "warm_too::warm",
        "warm_too::spawn",
        "through_facade::spawn",
        "through_facade_relative::forkserver",
        "through_facade_self::spawn",
        "deeper::through_facade_super::spawn",
    ];
    expected.sort_unstable();
    assert_eq!(listed_tests(), expected);
}
