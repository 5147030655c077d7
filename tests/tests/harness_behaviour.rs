//! How a failing, leaking or skipped `#[ipc_test]` behaves, observed from outside: each demo
//! test is `#[ignore]`d and run as a subprocess of this test binary by its driver test. A
//! separate test binary from the scenarios, so that these subprocesses' pipes never disturb
//! the scenarios' fd counts.

use std::time::Duration;

use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_tests::{run_own_test, text};

fn fails_loudly(_: ()) {
    println!("child output before failing");
    panic!("the child's deliberate failure");
}

/// Fails on purpose; run only as a subprocess by `child_failure_fails_the_test`.
#[ipc_test]
#[ignore = "fails on purpose; driven by child_failure_fails_the_test"]
fn demo_failing_child(ctx: &Context) {
    ctx.spawn(fails_loudly, ()).unwrap().wait().unwrap();
}

#[rstest::rstest]
#[case("spawn")]
#[case("forkserver")]
fn child_failure_fails_the_test(#[case] method: &str) {
    let output = run_own_test(&format!("demo_failing_child::{method}"), &[]);
    let text = text(&output);
    assert!(
        !output.status.success(),
        "the test must fail when its child fails:\n{text}"
    );
    for needle in [
        "the child's deliberate failure",
        "child output before failing",
        &format!("start method {method}"),
        "harness_behaviour.rs:",
    ] {
        assert!(
            text.contains(needle),
            "{needle:?} missing from the failed test's output:\n{text}"
        );
    }
}

/// A leaked Process fails the test that started it, naming the child.
#[ipc_test]
#[ignore = "fails on purpose; driven by leftover_child_fails_the_test"]
fn demo_leftover_child(ctx: &Context) {
    let child = ctx
        .spawn(|_: ()| std::thread::sleep(Duration::from_secs(600)), ())
        .unwrap();
    drop(child);
}

#[test]
fn leftover_child_fails_the_test() {
    let output = run_own_test("demo_leftover_child::forkserver", &[]);
    let text = text(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains("was still running when its Process was dropped"),
        "{text}"
    );
}

#[ipc_test(skip_unless = false)]
#[ignore = "skips on purpose; driven by skip_prints_one_line_and_require_gpu_fails"]
fn demo_skipped(_ctx: &Context) {
    unreachable!("a skipped test's body never runs");
}

#[ipc_test(skip_unless = Err::<(), _>("the demo requirement is not met"))]
#[ignore = "skips on purpose; driven by skip_prints_one_line_and_require_gpu_fails"]
fn demo_skipped_with_reason(_ctx: &Context) {
    unreachable!("a skipped test's body never runs");
}

#[test]
fn skip_prints_one_line_and_require_gpu_fails() {
    let log = std::env::temp_dir().join(format!("vmm-skip-log-{}", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let log_str = log.to_str().unwrap();
    let skipped = run_own_test(
        "demo_skipped_with_reason::spawn",
        &[("VMM_REQUIRE_GPU", None), ("VMM_SKIP_LOG", Some(log_str))],
    );
    let stderr = String::from_utf8_lossy(&skipped.stderr);
    assert!(
        skipped.status.success(),
        "a skip passes:\n{}",
        text(&skipped)
    );
    let line = "SKIP demo_skipped_with_reason::spawn: the demo requirement is not met";
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.starts_with("SKIP "))
            .collect::<Vec<_>>(),
        [line]
    );
    assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{line}\n"));
    let _ = std::fs::remove_file(&log);

    let bool_skip = run_own_test("demo_skipped::forkserver", &[("VMM_REQUIRE_GPU", None)]);
    assert!(bool_skip.status.success());
    assert!(String::from_utf8_lossy(&bool_skip.stderr).contains("SKIP demo_skipped::forkserver: "));

    let required = run_own_test(
        "demo_skipped_with_reason::spawn",
        &[("VMM_REQUIRE_GPU", Some("1"))],
    );
    assert!(
        !required.status.success(),
        "VMM_REQUIRE_GPU=1 turns a skip into a failure"
    );
    assert!(
        text(&required).contains("the demo requirement is not met"),
        "{}",
        text(&required)
    );
}

/// Blocks past its timeout with a child running; run only by `timeout_ends_the_test_and_its_children`.
#[ipc_test(methods = [forkserver, spawn], timeout = 1)]
#[ignore = "times out on purpose; driven by timeout_ends_the_test_and_its_children"]
fn demo_timeout(ctx: &Context) {
    let child = ctx
        .spawn(|_: ()| std::thread::sleep(Duration::from_secs(600)), ())
        .unwrap();
    println!("CHILD-PID {}", child.pid());
    std::thread::sleep(Duration::from_secs(600));
    drop(child);
}

#[rstest::rstest]
#[case("spawn")]
#[case("forkserver")]
fn timeout_ends_the_test_and_its_children(#[case] method: &str) {
    let started = std::time::Instant::now();
    let output = run_own_test(&format!("demo_timeout::{method}"), &[]);
    let text = text(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the test did not end at its timeout"
    );
    assert!(text.contains("timed out after 1s"), "{text}");
    let pid = text
        .split("CHILD-PID ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the demo printed its child's pid");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "child {pid} outlived its test"
    );
}
