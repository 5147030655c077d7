//! The forkserver scenarios on host (memfd) buffers, each generated for both start methods by
//! `#[ipc_test]`. They run everywhere, CI included.

use std::time::Duration;

use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{settled_open_fds, warm_forkserver};
use vmm_core::wire::Queue;
use vmm_tests::{pattern, run_own_test, text};

const LEN: usize = 1 << 20;

fn read_back_and_reply(buf: HostBuffer) {
    assert_eq!(buf.to_vec(), pattern(1, buf.len()), "child did not see the parent's pattern");
    buf.write(0, &pattern(2, buf.len())).unwrap();
}

#[ipc_test]
fn buffer_as_process_argument(ctx: &Context) {
    let buf = HostBuffer::new(LEN).unwrap();
    buf.write(0, &pattern(1, LEN)).unwrap();
    let status = ctx.spawn(read_back_and_reply, buf.clone()).unwrap().wait().unwrap();
    assert!(status.success());
    assert_eq!(buf.to_vec(), pattern(2, LEN));
}

#[ipc_test(methods = [spawn, forkserver])]
fn buffer_through_queue(ctx: &Context) -> Result<(), vmm_core::Error> {
    let queue: Queue<HostBuffer> = Queue::new()?;
    let child = ctx.spawn(|q: Queue<HostBuffer>| read_back_and_reply(q.get(Duration::from_secs(30)).unwrap()), queue.clone())?;
    let buf = HostBuffer::new(LEN)?;
    buf.write(0, &pattern(1, LEN))?;
    queue.put(&buf)?;
    child.wait()?;
    assert_eq!(buf.to_vec(), pattern(2, LEN));
    Ok(())
}

#[ipc_test(thread_unsafe = "counts the process's open fds")]
fn fd_count_returns_to_baseline(ctx: &Context) {
    assert_eq!(vmm_core::testing::running_ipc_tests(), 1, "a thread_unsafe test must run alone");
    warm_forkserver().unwrap();
    let buf = HostBuffer::new(LEN).unwrap();
    buf.write(0, &pattern(1, LEN)).unwrap();
    let before = settled_open_fds().unwrap();
    let child = ctx.spawn(read_back_and_reply, buf.clone()).unwrap();
    child.wait().unwrap();
    assert_eq!(settled_open_fds().unwrap(), before, "passing a buffer to a child leaked fds");
}

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
    assert!(!output.status.success(), "the test must fail when its child fails:\n{text}");
    for needle in [
        "the child's deliberate failure",
        "child output before failing",
        &format!("start method {method}"),
        "host_scenarios.rs:",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from the failed test's output:\n{text}");
    }
}

/// A leaked Process fails the test that started it, naming the child.
#[ipc_test]
#[ignore = "fails on purpose; driven by leftover_child_fails_the_test"]
fn demo_leftover_child(ctx: &Context) {
    let child = ctx.spawn(|_: ()| std::thread::sleep(Duration::from_secs(600)), ()).unwrap();
    drop(child);
}

#[test]
fn leftover_child_fails_the_test() {
    let output = run_own_test("demo_leftover_child::forkserver", &[]);
    let text = text(&output);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("was still running when its Process was dropped"), "{text}");
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
    assert!(skipped.status.success(), "a skip passes:\n{}", text(&skipped));
    let line = "SKIP demo_skipped_with_reason::spawn: the demo requirement is not met";
    assert_eq!(stderr.lines().filter(|l| l.starts_with("SKIP ")).collect::<Vec<_>>(), [line]);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{line}\n"));
    let _ = std::fs::remove_file(&log);

    let bool_skip = run_own_test("demo_skipped::forkserver", &[("VMM_REQUIRE_GPU", None)]);
    assert!(bool_skip.status.success());
    assert!(String::from_utf8_lossy(&bool_skip.stderr).contains("SKIP demo_skipped::forkserver: "));

    let required = run_own_test("demo_skipped_with_reason::spawn", &[("VMM_REQUIRE_GPU", Some("1"))]);
    assert!(!required.status.success(), "VMM_REQUIRE_GPU=1 turns a skip into a failure");
    assert!(text(&required).contains("the demo requirement is not met"), "{}", text(&required));
}

/// Shared tests overlap; the thread_unsafe one above asserts it saw none of them.
#[ipc_test]
fn shared_tests_run_concurrently(_ctx: &Context) {
    assert!(vmm_core::testing::running_ipc_tests() >= 1);
    std::thread::sleep(Duration::from_millis(50));
}

mod composed {
    use rstest::rstest;
    use vmm_core::process::Context;
    use vmm_core::shm::HostBuffer;

    fn fill(args: (HostBuffer, u8)) {
        args.0.fill(args.1).unwrap();
    }

    #[rstest]
    #[case(1)]
    #[case(0xEE)]
    #[vmm_core::ipc_test]
    fn filled_in_child(#[ignore] ctx: &Context, #[case] byte: u8) {
        let buf = HostBuffer::new(4096).unwrap();
        ctx.spawn(fill, (buf.clone(), byte)).unwrap().wait().unwrap();
        assert!(buf.to_vec().iter().all(|&b| b == byte));
    }
}

#[test]
fn rstest_cases_times_methods_are_all_listed() {
    let exe = std::env::current_exe().unwrap();
    let listed = std::process::Command::new(exe).args(["--list", "composed::"]).output().unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    for case in ["case_1", "case_2"] {
        for method in ["spawn", "forkserver"] {
            let name = format!("composed::filled_in_child::{case}::{method}: test");
            assert!(listed.contains(&name), "{name} not listed:\n{listed}");
        }
    }
}
