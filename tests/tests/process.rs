//! vmm-core's own cross-process tests: every scenario under both cold start methods, and the
//! ones where it could differ under warm too.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use rstest::rstest;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use vmm_core::Error;
use vmm_core::error::{DescriptorRule, ProtocolRule};
use vmm_core::process::ensure_running;
use vmm_core::process::{Context, StartMethod, forkserver_pid};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::{Fd, Queue};
use vmm_tests::pattern;
use vmm_tests::turns::{exclusive, shared};

const TIMEOUT: Duration = Duration::from_secs(30);

fn read_back_and_reply(buf: HostBuffer) {
    assert!(buf.is_imported());
    assert_eq!(
        buf.to_vec(),
        pattern(1, buf.size()),
        "child did not see the parent's pattern"
    );
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[vmm_core::all_methods]
#[rstest]
fn host_buffer_as_argument(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let buf = HostBuffer::new(1 << 20).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    let status = Context::new(method)
        .spawn(read_back_and_reply, buf.clone())
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    assert!(status.success());
    assert_eq!(buf.to_vec(), pattern(2, buf.size()));
}

fn read_from_queue(queue: Queue<HostBuffer>) {
    let buf = queue.get(TIMEOUT).unwrap();
    read_back_and_reply(buf);
}

#[vmm_core::all_methods]
#[rstest]
fn host_buffer_through_queue(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let queue = Queue::new().unwrap();
    let child = Context::new(method)
        .spawn(read_from_queue, queue.clone())
        .unwrap();
    let buf = HostBuffer::new(64 << 10).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    queue.put(&buf).unwrap();
    child.join(TIMEOUT).unwrap();
    assert_eq!(buf.to_vec(), pattern(2, buf.size()));
}

#[vmm_core::all_methods]
#[rstest]
fn fd_count_returns_to_baseline(#[all_methods] method: StartMethod) {
    let _guard = exclusive();
    ensure_running().unwrap();
    let buf = HostBuffer::new(1 << 16).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    // Warm-up round: lazily created process-wide state (the launcher thread) is not a leak.
    Context::new(method)
        .spawn(read_back_and_reply, buf.clone())
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();

    let before = settled_open_fds().unwrap();
    let child = Context::new(method)
        .spawn(read_back_and_reply, buf.clone())
        .unwrap();
    child.join(TIMEOUT).unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds leaked by passing a buffer to a child"
    );
    // An unjoined Process dropped mid-run leaks nothing either.
    drop(Context::new(method).spawn(hang, ()).unwrap());
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds leaked by dropping a running child"
    );
}

fn panics(message: String) {
    println!("about to panic on stdout");
    eprintln!("about to panic on stderr");
    panic!("{message}");
}

#[vmm_core::all_methods]
#[rstest]
fn child_panic_is_reported(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let child = Context::new(method)
        .spawn(panics, "the child's own words".to_owned())
        .unwrap();
    let Err(Error::Child(failure)) = child.join(TIMEOUT) else {
        panic!("a panicking child must fail")
    };
    assert_eq!(failure.method, method);
    assert_eq!(
        failure.panic_message.as_deref(),
        Some("the child's own words")
    );
    assert!(
        failure
            .panic_location
            .as_deref()
            .unwrap()
            .contains("process.rs"),
        "{failure}"
    );
    assert!(
        failure.stdout.contains("about to panic on stdout"),
        "{failure}"
    );
    assert!(
        failure.stderr.contains("about to panic on stderr"),
        "{failure}"
    );
    assert_eq!(failure.status.and_then(|s| s.code()), Some(101));
    let shown = failure.to_string();
    for needle in [
        "the child's own words",
        "about to panic on stdout",
        method.name(),
        "exit code 101",
    ] {
        assert!(shown.contains(needle), "{needle:?} missing from:\n{shown}");
    }
}

fn hang(_: ()) {
    std::thread::sleep(Duration::from_secs(600));
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[vmm_core::all_methods]
#[rstest]
fn hanging_child_is_killed_at_timeout(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let child = Context::new(method).spawn(hang, ()).unwrap();
    let pid = child.pid();
    let started = Instant::now();
    let Err(Error::Child(failure)) = child.join(Duration::from_millis(300)) else {
        panic!("must time out")
    };
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(failure.timed_out, Some(Duration::from_millis(300)));
    assert_eq!(
        failure.status.and_then(|s| s.signal()),
        Some(9),
        "{failure}"
    );
    assert!(failure.to_string().contains("timed out"), "{failure}");
    // Reaped: no zombie, no stray process.
    assert!(!alive(pid), "child {pid} is still in the process table");
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap()
        .trim()
        .to_owned()
}

fn noop(_: ()) {}

#[test]
fn forkserver_is_single_threaded_cuda_free_and_restarts() {
    let _guard = exclusive();
    let ctx = Context::new(StartMethod::Forkserver);
    ctx.spawn(noop, ()).unwrap().join(TIMEOUT).unwrap();
    let server = forkserver_pid().expect("the forkserver is running");
    assert_eq!(status_field(server, "Threads:"), "1");
    let maps = std::fs::read_to_string(format!("/proc/{server}/maps")).unwrap();
    assert!(!maps.contains("libcuda"), "the forkserver mapped libcuda");
    let cmdline = std::fs::read(format!("/proc/{server}/cmdline")).unwrap();
    assert!(!cmdline.is_empty());

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // The next spawn notices, starts a new server and succeeds.
    ctx.spawn(noop, ()).unwrap().join(TIMEOUT).unwrap();
    let restarted = forkserver_pid().unwrap();
    assert_ne!(restarted, server);
    assert!(!alive(server), "the killed forkserver was not reaped");
}

fn echo_large(queues: (Queue<Vec<u8>>, Queue<Vec<u8>>)) {
    let item = queues.0.get(TIMEOUT).unwrap();
    queues.1.put(&item).unwrap();
}

#[rstest]
fn eight_mib_message_arrives_intact(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    let (to_child, from_child) = (Queue::new().unwrap(), Queue::new().unwrap());
    let child = Context::new(method)
        .spawn(echo_large, (to_child.clone(), from_child.clone()))
        .unwrap();
    let big = pattern(7, 8 << 20);
    to_child.put(&big).unwrap();
    let back = from_child.get(TIMEOUT).unwrap();
    child.join(TIMEOUT).unwrap();
    assert!(back == big, "8 MiB message changed on its way");
}

fn memfd_holding(i: usize) -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    let mut file = File::from(fd);
    std::io::Write::write_all(&mut file, i.to_string().as_bytes()).unwrap();
    file.into()
}

fn check_fds(queues: (Queue<Vec<Fd>>, Queue<usize>)) {
    let fds = queues.0.get(TIMEOUT).unwrap();
    for (i, fd) in fds.iter().enumerate() {
        let mut text = String::new();
        let mut file = File::from(fd.as_fd().try_clone_to_owned().unwrap());
        std::io::Seek::rewind(&mut file).unwrap();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, i.to_string(), "fd #{i} is not the file that was sent");
    }
    queues.1.put(&fds.len()).unwrap();
}

#[rstest]
fn two_hundred_fds_arrive(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    let (to_child, from_child) = (Queue::new().unwrap(), Queue::new().unwrap());
    let child = Context::new(method)
        .spawn(check_fds, (to_child.clone(), from_child.clone()))
        .unwrap();
    let fds: Vec<Fd> = (0..200).map(|i| Fd::from(memfd_holding(i))).collect();
    to_child.put(&fds).unwrap();
    assert_eq!(from_child.get(TIMEOUT).unwrap(), 200);
    child.join(TIMEOUT).unwrap();
}

#[test]
fn more_fds_than_one_message_carries_is_refused() {
    let _guard = shared();
    let queue: Queue<Vec<Fd>> = Queue::new().unwrap();
    let fds: Vec<Fd> = (0..254).map(|i| Fd::from(memfd_holding(i))).collect();
    match queue.put(&fds) {
        Err(Error::TooManyFds {
            count: 254,
            max: 253,
        }) => {}
        other => panic!("expected TooManyFds, got {other:?}"),
    }
    // Nothing was half-sent.
    assert!(queue.try_get().unwrap().is_none());
    // At the limit it goes through, whole.
    let fds: Vec<Fd> = fds.into_iter().take(253).collect();
    queue.put(&fds).unwrap();
    assert_eq!(queue.get(TIMEOUT).unwrap().len(), 253);
}

fn grandchild(args: (HostDescriptor, Queue<u32>)) {
    let buf = HostBuffer::import(&args.0).unwrap();
    buf.fill(0x33).unwrap();
    args.1.put(&std::process::id()).unwrap();
}

fn middle(args: (StartMethod, HostDescriptor, Queue<u32>)) {
    let (method, descriptor, queue) = args;
    Context::new(method)
        .spawn(grandchild, (descriptor, queue))
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
}

#[vmm_core::all_methods]
#[rstest]
fn nested_children(#[all_methods] outer: StartMethod, #[all_methods] inner: StartMethod) {
    let _guard = shared();
    let buf = HostBuffer::new(4096).unwrap();
    let queue = Queue::new().unwrap();
    let child = Context::new(outer)
        .spawn(middle, (inner, buf.export().unwrap(), queue.clone()))
        .unwrap();
    let middle_pid = child.pid();
    child.join(TIMEOUT).unwrap();
    let grandchild_pid = queue.get(TIMEOUT).unwrap();
    assert_ne!(grandchild_pid, middle_pid);
    assert!(buf.to_vec().iter().all(|&b| b == 0x33));
}

fn start_hanging_grandchild(args: (StartMethod, Queue<u32>)) {
    let (method, queue) = args;
    let grandchild = Context::new(method)
        .spawn(report_and_hang, queue.clone())
        .unwrap();
    std::mem::forget(grandchild);
    std::thread::sleep(Duration::from_secs(600));
}

fn report_and_hang(queue: Queue<u32>) {
    queue.put(&std::process::id()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[vmm_core::all_methods]
#[rstest]
fn children_die_with_their_parent(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let queue = Queue::new().unwrap();
    let child = Context::new(method)
        .spawn(start_hanging_grandchild, (method, queue.clone()))
        .unwrap();
    let grandchild = queue.get(TIMEOUT).unwrap();
    assert!(alive(grandchild));
    child.kill().unwrap();
    drop(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(grandchild) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Its parent (or that parent's forkserver) is gone, so it was killed; init reaps it.
    assert!(
        !alive(grandchild) || status_field(grandchild, "State:").starts_with('Z'),
        "orphan {grandchild} survived"
    );
}

fn report_argv_and_env(queue: Queue<(Vec<String>, bool)>) {
    let cmdline = std::fs::read("/proc/self/cmdline").unwrap();
    let argv = cmdline
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned());
    let role_var_gone = std::env::var_os("VMM_IPC_CHILD").is_none();
    queue.put(&(argv.skip(1).collect(), role_var_gone)).unwrap();
}

#[test]
fn spawn_child_gets_minimal_argv_and_clean_env() {
    let _guard = shared();
    let queue = Queue::new().unwrap();
    Context::new(StartMethod::Spawn)
        .spawn(report_argv_and_env, queue.clone())
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    let (argv, role_var_gone) = queue.get(TIMEOUT).unwrap();
    let expected = [
        "--exact",
        "spawn_child_gets_minimal_argv_and_clean_env",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ];
    assert_eq!(argv, expected);
    assert!(role_var_gone, "the child kept its role variable");
}

#[test]
fn child_that_never_reaches_its_entry_is_an_error() {
    if std::env::var_os("VMM_IPC_CHILD").is_some() {
        // We are the child, started with the pre-main hook disabled: exit without taking the role.
        return;
    }
    let _guard = shared();
    let ctx = Context::new(StartMethod::Spawn).with_env("VMM_IPC_NO_AUTO_INIT", "1");
    let result = ctx.spawn(noop, ()).unwrap().join(TIMEOUT);
    let Err(Error::Child(failure)) = result else {
        panic!("a child that never acknowledged must fail, got {result:?}")
    };
    assert!(!failure.started);
    let shown = failure.to_string();
    assert!(
        shown.contains("never acknowledged") && shown.contains("vmm_core::process::init()"),
        "{shown}"
    );
}

fn produce(args: (Queue<Item>, u32)) {
    let (queue, producer) = args;
    for item in 0..100 {
        queue.put(&(producer, item)).unwrap();
    }
}

/// (producer, item number)
type Item = (u32, u32);

fn consume(args: (Queue<Item>, Queue<Vec<Item>>)) {
    let (queue, results) = args;
    let mut got = Vec::new();
    // Every consumer stops after a quiet spell once the producers are done.
    while let Ok(item) = queue.get(Duration::from_millis(500)) {
        got.push(item);
    }
    results.put(&got).unwrap();
}

#[rstest]
fn queue_delivers_each_item_to_exactly_one_getter(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    let ctx = Context::new(method);
    let (queue, results) = (Queue::new().unwrap(), Queue::new().unwrap());
    let consumers: Vec<_> = (0..3)
        .map(|_| {
            ctx.spawn(consume, (queue.clone(), results.clone()))
                .unwrap()
        })
        .collect();
    let producers: Vec<_> = (0..3)
        .map(|p| ctx.spawn(produce, (queue.clone(), p)).unwrap())
        .collect();
    for child in producers.into_iter().chain(consumers) {
        child.join(TIMEOUT).unwrap();
    }
    let mut all: Vec<(u32, u32)> = (0..3).flat_map(|_| results.get(TIMEOUT).unwrap()).collect();
    all.sort_unstable();
    let expected: Vec<(u32, u32)> = (0..3).flat_map(|p| (0..100).map(move |i| (p, i))).collect();
    assert_eq!(all, expected, "every item exactly once");
}

/// What the receiver saw: the receive's error (if it failed), and its open fds before and after.
type Received = (Option<Error>, usize, usize);

fn receive_with_too_few_fd_slots(args: (Queue<Vec<Fd>>, Queue<Received>)) {
    let (queue, report) = args;
    let open = vmm_core::testing::open_fds().unwrap();
    // Take every free fd slot but two: the 10 fds that arrive do not fit, so the kernel
    // truncates the control message (MSG_CTRUNC) after installing two of them.
    let mut fillers = Vec::new();
    while let Ok(file) = File::open("/dev/null") {
        fillers.push(file);
        if fillers.len() > 100_000 {
            break;
        }
    }
    fillers.truncate(fillers.len() - 2);
    let outcome = queue.get(TIMEOUT);
    drop(fillers);
    let after = vmm_core::testing::open_fds().unwrap();
    let error = match outcome {
        Ok(fds) => panic!("unexpectedly received {} fds", fds.len()),
        Err(e) => e,
    };
    report.put(&(Some(error), open, after)).unwrap();
}

fn with_fd_limit(args: (u64, Queue<Vec<Fd>>, Queue<Received>)) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, args.0, hard).unwrap();
    receive_with_too_few_fd_slots((args.1, args.2));
}

#[rstest]
fn truncated_control_message_is_an_error_and_leaks_nothing(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    let (queue, report) = (Queue::new().unwrap(), Queue::new().unwrap());
    // A low soft limit keeps the child from opening a million fillers.
    let child = Context::new(method)
        .spawn(with_fd_limit, (256, queue.clone(), report.clone()))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let fds: Vec<Fd> = (0..10).map(|i| Fd::from(memfd_holding(i))).collect();
    queue.put(&fds).unwrap();
    child.join(TIMEOUT).unwrap();
    let (error, before, after) = report.get(TIMEOUT).unwrap();
    // The rule broken: the fds did not all arrive, and those that did were closed.
    match error {
        Some(Error::Protocol {
            rule: ProtocolRule::Fds,
            message,
        }) => {
            for needle in ["MSG_CTRUNC", "did not all arrive", "were closed"] {
                assert!(
                    message.contains(needle),
                    "{needle:?} missing from: {message}"
                );
            }
        }
        other => panic!("expected the receive's Protocol error (MSG_CTRUNC), got {other:?}"),
    }
    assert_eq!(before, after, "fds leaked by a truncated message");
}

#[test]
fn a_host_buffer_holds_no_fd_where_the_kernel_allows() {
    let _guard = exclusive();
    if !vmm_core::shm::buffers_hold_no_fd() {
        eprintln!("host buffers keep their memfd here (no /proc/self/map_files access)");
        return;
    }
    let before = settled_open_fds().unwrap();
    let buf = HostBuffer::new(1 << 20).unwrap();
    assert_eq!(settled_open_fds().unwrap(), before, "a buffer holds no fd");
    let descriptor = buf.export().unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before + 1,
        "a descriptor holds exactly one"
    );
    let alias = HostBuffer::import(&descriptor).unwrap();
    drop(descriptor);
    assert_eq!(settled_open_fds().unwrap(), before, "an import holds no fd");
    drop((buf, alias));
}

/// Sent as a host descriptor, received as a mapped host buffer, which is what a
/// `HostBuffer` argument does: the child imports the fd it receives, with import's checks.
enum Mapped {
    Sending(HostDescriptor),
    Received(#[allow(dead_code)] HostBuffer),
}

impl Serialize for Mapped {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Mapped::Sending(descriptor) => descriptor.serialize(serializer),
            Mapped::Received(buffer) => buffer.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Mapped {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        HostBuffer::deserialize(deserializer).map(Mapped::Received)
    }
}

fn must_not_run(_: Mapped) {
    panic!("the function ran although its argument could not be imported");
}

#[rstest]
fn an_argument_the_child_cannot_import_fails_with_the_import_error(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    // A memfd with no seals: import refuses it (its owner could shrink it under the mapping).
    let memfd =
        nix::sys::memfd::memfd_create(c"unsealed", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    nix::unistd::ftruncate(&memfd, 4096).unwrap();
    let unsealed = HostDescriptor::from_fd(memfd.as_fd(), 4096).unwrap();

    let result = Context::new(method)
        .spawn(must_not_run, Mapped::Sending(unsealed))
        .unwrap()
        .join(TIMEOUT);
    let Err(Error::Child(failure)) = result else {
        panic!("a child whose argument cannot be imported must fail, got {result:?}")
    };
    assert!(failure.started, "{failure}");
    assert_eq!(failure.panic_message, None, "{failure}");
    assert_eq!(
        failure.status.and_then(|s| s.code()),
        Some(122),
        "{failure}"
    );
    match failure.not_run.as_deref() {
        Some(Error::InvalidDescriptor {
            rule: DescriptorRule::Memfd,
            message,
        }) => {
            assert!(message.contains("not sealed"), "{message}")
        }
        other => panic!("expected the import's InvalidDescriptor, got {other:?}"),
    }
    assert!(
        matches!(&failure.not_run, Some(e) if matches!(**e, Error::InvalidDescriptor { .. })),
        "{failure}"
    );
    let shown = failure.to_string();
    for needle in [
        "its function did not run: could not receive its argument: host descriptor's fd",
        "not sealed",
        method.name(),
    ] {
        assert!(shown.contains(needle), "{needle:?} missing from:\n{shown}");
    }
}

fn report_env(queue: Queue<Option<String>>) {
    queue
        .put(&std::env::var("VMM_TEST_CHILD_ENV").ok())
        .unwrap();
}

#[vmm_core::all_methods]
#[rstest]
fn with_env_reaches_the_child_before_its_function(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let queue = Queue::new().unwrap();
    Context::new(method)
        .with_env("VMM_TEST_CHILD_ENV", format!("set for {method}"))
        .spawn(report_env, queue.clone())
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    assert_eq!(
        queue.get(TIMEOUT).unwrap(),
        Some(format!("set for {method}"))
    );
}
