//! The forkserver scenarios on host (memfd) buffers, each generated for both start methods by
//! `#[ipc_test]`. They run everywhere, CI included.

use std::time::Duration;

use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_core::process::ensure_running;
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::Queue;
use vmm_tests::pattern;

const LEN: usize = 1 << 20;

fn read_back_and_reply(buf: HostBuffer) {
    assert_eq!(
        buf.to_vec(),
        pattern(1, buf.size()),
        "child did not see the parent's pattern"
    );
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[ipc_test]
fn buffer_as_process_argument(ctx: &Context) {
    let buf = HostBuffer::new(LEN).unwrap();
    buf.write_at(0, &pattern(1, LEN)).unwrap();
    let status = ctx
        .spawn(read_back_and_reply, buf.clone())
        .unwrap()
        .wait()
        .unwrap();
    assert!(status.success());
    assert_eq!(buf.to_vec(), pattern(2, LEN));
}

#[ipc_test(methods = [spawn, forkserver])]
fn buffer_through_queue(ctx: &Context) -> Result<(), vmm_core::Error> {
    let queue: Queue<HostBuffer> = Queue::new()?;
    let child = ctx.spawn(
        |q: Queue<HostBuffer>| read_back_and_reply(q.get(Duration::from_secs(30)).unwrap()),
        queue.clone(),
    )?;
    let buf = HostBuffer::new(LEN)?;
    buf.write_at(0, &pattern(1, LEN))?;
    queue.put(&buf)?;
    child.wait()?;
    assert_eq!(buf.to_vec(), pattern(2, LEN));
    Ok(())
}

#[ipc_test(thread_unsafe = "counts the process's open fds")]
fn fd_count_returns_to_baseline(ctx: &Context) {
    assert_eq!(
        vmm_core::testing::running_ipc_tests(),
        1,
        "a thread_unsafe test must run alone"
    );
    ensure_running().unwrap();
    let buf = HostBuffer::new(LEN).unwrap();
    buf.write_at(0, &pattern(1, LEN)).unwrap();
    let before = settled_open_fds().unwrap();
    let child = ctx.spawn(read_back_and_reply, buf.clone()).unwrap();
    child.wait().unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "passing a buffer to a child leaked fds"
    );
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
        ctx.spawn(fill, (buf.clone(), byte))
            .unwrap()
            .wait()
            .unwrap();
        assert!(buf.to_vec().iter().all(|&b| b == byte));
    }
}

#[test]
fn rstest_cases_times_methods_are_all_listed() {
    let exe = std::env::current_exe().unwrap();
    let listed = std::process::Command::new(exe)
        .args(["--list", "composed::"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    for case in ["case_1", "case_2"] {
        for method in ["spawn", "forkserver"] {
            let name = format!("composed::filled_in_child::{case}::{method}: test");
            assert!(listed.contains(&name), "{name} not listed:\n{listed}");
        }
    }
}
