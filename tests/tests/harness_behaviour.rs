//! How a failing, leaking or skipped `#[ipc_test]` behaves, observed from outside: each demo
//! test is `#[ignore]`d and run as a subprocess of this test binary by its driver test. A
//! separate test binary from the scenarios, so that these subprocesses' pipes never disturb
//! the scenarios' fd counts.

use std::time::Duration;

use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_tests::{run_own_test, run_own_tests, text};

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

#[rstest::rstest]
#[case("spawn")]
#[case("forkserver")]
fn leftover_child_fails_the_test(#[case] method: &str) {
    let output = run_own_test(&format!("demo_leftover_child::{method}"), &[]);
    let text = text(&output);
    assert!(!output.status.success(), "{text}");
    let line = format!("({method}) was still running when its Process was dropped");
    assert!(text.contains(&line), "{line:?} missing from:\n{text}");
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
    let elapsed = started.elapsed();
    let text = text(&output);
    assert!(!output.status.success(), "{text}");
    // The timeout is 1 s and the child would sleep 600 s; the runner confirms the kill within
    // 5 s (it says otherwise if the child outlives that), so 10 s is ample.
    assert!(
        elapsed < Duration::from_secs(10),
        "the test did not end at its timeout: {elapsed:?}\n{text}"
    );
    assert!(
        text.contains(&format!(
            "demo_timeout::{method} ({method}) timed out after 1s"
        )),
        "{text}"
    );
    let pid = text
        .split("CHILD-PID ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the demo printed its child's pid");
    // The runner's own line, naming the child it killed and seen dead.
    let killed =
        format!("child {pid} ({method}) was still running at the timeout; it has been killed");
    assert!(text.contains(&killed), "{killed:?} missing from:\n{text}");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "child {pid} outlived its test"
    );
}

/// A requirement that holds must run the body: these bodies fail on purpose, so a runner that
/// returned early (a skip that is not reported) would make them pass.
#[ipc_test(skip_unless = true)]
#[ignore = "fails on purpose; driven by a_satisfied_requirement_runs_the_body"]
fn demo_requirement_holds(_ctx: &Context) {
    panic!("the body ran: demo_requirement_holds");
}

#[ipc_test(skip_unless = Ok::<(), String>(()))]
#[ignore = "fails on purpose; driven by a_satisfied_requirement_runs_the_body"]
fn demo_requirement_holds_as_result(_ctx: &Context) {
    panic!("the body ran: demo_requirement_holds_as_result");
}

#[test]
#[ignore = "fails on purpose; driven by a_satisfied_requirement_runs_the_body"]
fn demo_skip_unless_function_holds() {
    if !vmm_core::testing::skip_unless(true) {
        return;
    }
    panic!("the body ran: demo_skip_unless_function_holds");
}

#[rstest::rstest]
#[case("demo_requirement_holds::spawn")]
#[case("demo_requirement_holds::forkserver")]
#[case("demo_requirement_holds_as_result::spawn")]
#[case("demo_requirement_holds_as_result::forkserver")]
#[case("demo_skip_unless_function_holds")]
fn a_satisfied_requirement_runs_the_body(#[case] name: &str) {
    let output = run_own_test(name, &[("VMM_REQUIRE_GPU", None)]);
    let text = text(&output);
    assert!(
        !output.status.success(),
        "the body must run (and fail on purpose):\n{text}"
    );
    let function = name.split("::").next().unwrap();
    assert!(
        text.contains(&format!("the body ran: {function}")),
        "the body's panic is missing:\n{text}"
    );
    assert!(text.contains("1 failed"), "{text}");
    assert!(
        !text.contains("SKIP "),
        "a satisfied requirement skipped:\n{text}"
    );
}

/// Run intervals of the `overlap_demo` tests, one line each, appended to the file this names.
const OVERLAP_LOG_VAR: &str = "VMM_TEST_OVERLAP_LOG";

/// The demo tests of `thread_unsafe_tests_run_alone_and_shared_tests_together`: each records
/// when its body ran. Shared ones sleep 200 ms, so that with 8 test threads they overlap.
mod overlap_demo {
    use std::io::Write;
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use vmm_core::ipc_test;
    use vmm_core::process::Context;

    /// Every demo in this process measures from one epoch.
    static EPOCH: OnceLock<Instant> = OnceLock::new();

    fn run_for(kind: &str, length: Duration) {
        let epoch = *EPOCH.get_or_init(Instant::now);
        let start = epoch.elapsed();
        std::thread::sleep(length);
        let end = epoch.elapsed();
        let Some(path) = std::env::var_os(super::OVERLAP_LOG_VAR) else {
            return;
        };
        let name = std::thread::current().name().unwrap_or("?").to_owned();
        let line = format!("{kind} {name} {} {}\n", start.as_nanos(), end.as_nanos());
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        // One write of one short line under O_APPEND: lines never interleave.
        log.write_all(line.as_bytes()).unwrap();
    }

    #[ipc_test]
    #[ignore = "driven by thread_unsafe_tests_run_alone_and_shared_tests_together"]
    fn a_shared_1(_ctx: &Context) {
        run_for("shared", Duration::from_millis(200));
    }

    #[ipc_test]
    #[ignore = "driven by thread_unsafe_tests_run_alone_and_shared_tests_together"]
    fn a_shared_2(_ctx: &Context) {
        run_for("shared", Duration::from_millis(200));
    }

    #[ipc_test]
    #[ignore = "driven by thread_unsafe_tests_run_alone_and_shared_tests_together"]
    fn a_shared_3(_ctx: &Context) {
        run_for("shared", Duration::from_millis(200));
    }

    #[ipc_test(thread_unsafe = "records that nothing overlaps it")]
    #[ignore = "driven by thread_unsafe_tests_run_alone_and_shared_tests_together"]
    fn b_exclusive_1(_ctx: &Context) {
        run_for("exclusive", Duration::from_millis(100));
    }

    #[ipc_test(thread_unsafe = "records that nothing overlaps it")]
    #[ignore = "driven by thread_unsafe_tests_run_alone_and_shared_tests_together"]
    fn b_exclusive_2(_ctx: &Context) {
        run_for("exclusive", Duration::from_millis(100));
    }
}

#[test]
fn thread_unsafe_tests_run_alone_and_shared_tests_together() {
    let log = std::env::temp_dir().join(format!("vmm-overlap-log-{}", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let output = run_own_tests(
        &["overlap_demo::", "--test-threads=8"],
        &[(OVERLAP_LOG_VAR, Some(log.to_str().unwrap()))],
    );
    let recorded = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(output.status.success(), "{}", text(&output));
    // (kind, name, start, end), in nanoseconds from one epoch.
    let intervals: Vec<(String, String, u128, u128)> = recorded
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            assert_eq!(fields.len(), 4, "malformed line {line:?}");
            let start = fields[2].parse().unwrap();
            let end = fields[3].parse().unwrap();
            (fields[0].to_owned(), fields[1].to_owned(), start, end)
        })
        .collect();
    assert_eq!(intervals.len(), 10, "every demo ran once:\n{recorded}");
    let overlap =
        |a: &(String, String, u128, u128), b: &(String, String, u128, u128)| a.2 < b.3 && b.2 < a.3;
    for (i, alone) in intervals.iter().enumerate() {
        if alone.0 != "exclusive" {
            continue;
        }
        for (j, other) in intervals.iter().enumerate() {
            assert!(
                i == j || !overlap(alone, other),
                "thread_unsafe {} overlapped {}:\n{recorded}",
                alone.1,
                other.1
            );
        }
    }
    let shared: Vec<_> = intervals.iter().filter(|i| i.0 == "shared").collect();
    assert_eq!(shared.len(), 6);
    let concurrent = shared
        .iter()
        .enumerate()
        .any(|(i, a)| shared[i + 1..].iter().any(|b| overlap(a, b)));
    assert!(concurrent, "no two shared tests ran at once:\n{recorded}");
}

/// Runs one child under the default timeout; driven with several `VMM_CHILD_TIMEOUT`s.
#[ipc_test(methods = [spawn])]
#[ignore = "driven by child_timeout_from_the_environment"]
fn demo_default_timeout(ctx: &Context) {
    println!("CONTEXT-TIMEOUT {:?}", ctx.timeout());
    ctx.spawn(|_: ()| {}, ()).unwrap().wait().unwrap();
}

/// The same outside `#[ipc_test]`: `Context::new` and `Process::wait`.
#[test]
#[ignore = "driven by child_timeout_from_the_environment"]
fn demo_default_timeout_plain() {
    let ctx = Context::new(vmm_core::process::StartMethod::Spawn);
    println!("CONTEXT-TIMEOUT {:?}", ctx.timeout());
    ctx.spawn(|_: ()| {}, ()).unwrap().wait().unwrap();
}

#[test]
fn child_timeout_from_the_environment() {
    let forever = format!("CONTEXT-TIMEOUT {:?}", Duration::MAX);
    // Too large for a Duration, or infinite: forever, without a panic.
    for value in ["1e30", "18446744073709551616", "inf"] {
        for demo in ["demo_default_timeout::spawn", "demo_default_timeout_plain"] {
            let output = run_own_test(demo, &[("VMM_CHILD_TIMEOUT", Some(value))]);
            let text = text(&output);
            assert!(output.status.success(), "{demo} with {value}:\n{text}");
            assert!(text.contains(&forever), "{demo} with {value}:\n{text}");
        }
    }
    // Values that make no sense fail an #[ipc_test], naming the variable, the value and the
    // rule; plain code warns once and uses 60 s.
    for (value, rule) in [
        ("2^64", "not a number of seconds"),
        ("abc", "not a number of seconds"),
        ("NaN", "NaN"),
        ("-1", "must be positive"),
        ("0", "must be positive"),
    ] {
        let named = format!("VMM_CHILD_TIMEOUT={value:?}: ");
        let output = run_own_test(
            "demo_default_timeout::spawn",
            &[("VMM_CHILD_TIMEOUT", Some(value))],
        );
        let failed = text(&output);
        assert!(!output.status.success(), "{value}:\n{failed}");
        for needle in ["cannot run", named.as_str(), rule] {
            assert!(
                failed.contains(needle),
                "{value}: {needle:?} missing:\n{failed}"
            );
        }
        let output = run_own_test(
            "demo_default_timeout_plain",
            &[("VMM_CHILD_TIMEOUT", Some(value))],
        );
        let warned = text(&output);
        assert!(output.status.success(), "{value}:\n{warned}");
        let warning = format!("vmm-ipc: ignoring {named}");
        assert!(warned.contains(&warning), "{warning:?} missing:\n{warned}");
        assert!(warned.contains(rule), "{warned}");
        assert!(warned.contains("; using 60 s"), "{warned}");
        assert!(warned.contains("CONTEXT-TIMEOUT 60s"), "{warned}");
        assert_eq!(warned.matches("vmm-ipc: ignoring").count(), 1, "{warned}");
    }
}
