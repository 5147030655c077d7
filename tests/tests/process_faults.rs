//! Faults and hostile children: whatever a child does to its channel, whatever dies when, a join
//! returns by its deadline, no child is left a zombie or an orphan, and a failed spawn runs
//! nothing, and a child that floods its captured output costs its parent at most the output cap.
//! Each scenario under every start method where the method matters.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{
    ControlMessage, MsgFlags, SockType, UnixAddr, getsockopt, send, sendmsg, sockopt,
};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::Pid;
use rstest::rstest;
use vmm_core::Error;
use vmm_core::error::ProtocolRule;
use vmm_core::process::{
    Context, ExitStatus, StartMethod, WarmPool, ensure_running, forkserver_pid,
};
use vmm_core::testing::{open_fds, settled_open_fds};
use vmm_core::wire::{Fd, Queue};
use vmm_tests::flood::{Flood, LAST_WORDS, MemoryWatch, PANIC, assert_tail_kept, flood_and_panic};
use vmm_tests::turns::{exclusive, shared};

use vmm_tests::process_table::{gone_within, state};

const TIMEOUT: Duration = Duration::from_secs(30);

/// How much longer than its timeout a join may take: the kill, the reap, a loaded machine.
const JOIN_MARGIN: Duration = Duration::from_secs(4);

fn noop(_: ()) {}

fn hang(_: ()) {
    std::thread::sleep(Duration::from_secs(600));
}

/// The child is neither running nor a zombie: gone from the process table, and for a spawned
/// child (ours to reap) already reaped, so `waitpid` knows no such child.
fn assert_reaped(pid: u32, method: StartMethod) {
    // A forkserver child is reaped by its server, which has reported it by now; allow a moment.
    assert!(
        gone_within(pid, Duration::from_secs(2), false),
        "child {pid} ({method}) is still in the process table, state {:?}",
        state(pid)
    );
    if method != StartMethod::Forkserver {
        assert_eq!(
            waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG)),
            Err(Errno::ECHILD),
            "child {pid} was not reaped by its Process"
        );
    }
}

/// The `SOCK_SEQPACKET` sockets among this process's fds.
fn seqpacket_sockets() -> Vec<RawFd> {
    let mut sockets = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<RawFd>() else {
            continue;
        };
        // SAFETY: borrowed for one getsockopt probe only; a number that is not a socket (the
        // listing's own directory fd, or one closed since) fails with ENOTSOCK or EBADF.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        if getsockopt(&borrowed, sockopt::SockType) == Ok(SockType::SeqPacket) {
            sockets.push(fd);
        }
    }
    sockets
}

/// Of those, the ones whose peer is `parent` (a socketpair's peer credentials are its
/// creator's): in a child whose argument carries none, exactly its channel to the parent
/// (which the runtime knows by number). The peer check keeps out sockets that are not
/// vmm-core's (a warm child on a GPU holds the CUDA driver's too).
fn channels_to(parent: i32) -> Vec<RawFd> {
    seqpacket_sockets()
        .into_iter()
        .filter(|&fd| {
            // SAFETY: as in `seqpacket_sockets`: borrowed for one probe of a listed fd.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            getsockopt(&borrowed, sockopt::PeerCredentials).is_ok_and(|c| c.pid() == parent)
        })
        .collect()
}

fn raw_packet(fd: RawFd, bytes: &[u8], fds: &[RawFd]) {
    let iov = [std::io::IoSlice::new(bytes)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    sendmsg::<UnixAddr>(fd, &iov, cmsgs, MsgFlags::empty(), None).unwrap();
}

/// The child function: write packets that are not reports on its own channel, then return.
fn scribble_on_own_channel(parent: i32) {
    let sockets = channels_to(parent);
    assert_eq!(sockets.len(), 1, "expected one channel, found {sockets:?}");
    let channel = sockets[0];
    let stdin = File::open("/dev/null").unwrap();
    // An unknown frame byte, a peer-protocol frame (frame byte 0) on a process channel, an
    // inline packet (frame byte 2) that is not postcard for a report, a report variant that does
    // not exist, garbage carrying an fd, and an empty packet.
    raw_packet(channel, &[0xEE, 1, 2, 3], &[]);
    raw_packet(channel, &[0, 1, 2, 3], &[]);
    raw_packet(channel, &[2, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF], &[]);
    raw_packet(channel, &[2, 7], &[]);
    raw_packet(channel, &[2, 0xFF], &[stdin.as_raw_fd()]);
    send(channel, &[], MsgFlags::empty()).unwrap();
    println!("scribbled on fd {channel}");
}

fn assert_protocol_violation(result: vmm_core::Result<ExitStatus>, method: StartMethod) {
    let Err(Error::Child(failure)) = result else {
        panic!("a child that broke the protocol must fail its join, got {result:?}")
    };
    assert_eq!(failure.method, method);
    let violation = failure
        .protocol_violation
        .as_deref()
        .unwrap_or_else(|| panic!("no protocol violation recorded:\n{failure}"));
    assert!(violation.contains("more such packets"), "{violation}");
    assert!(failure.started, "{failure}");
    // It returned and exited cleanly: the violation alone fails it.
    assert_eq!(failure.status, Some(ExitStatus::Exited(0)), "{failure}");
    assert_eq!(failure.panic_message, None, "{failure}");
    assert!(failure.stdout.contains("scribbled on fd"), "{failure}");
    let shown = failure.to_string();
    assert!(
        shown.contains("broke the protocol on its channel"),
        "{shown}"
    );
}

#[vmm_core::all_methods]
#[rstest]
fn a_child_that_writes_garbage_on_its_channel_is_reaped_and_fails(
    #[all_methods] method: StartMethod,
) {
    let _guard = shared();
    let child = Context::new(method)
        .spawn(scribble_on_own_channel, std::process::id() as i32)
        .unwrap();
    let pid = child.pid();
    assert_protocol_violation(child.join(TIMEOUT), method);
    assert_reaped(pid, method);
}

#[vmm_core::all_methods]
#[rstest]
fn a_dropped_child_that_wrote_garbage_on_its_channel_is_reaped(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let child = Context::new(method)
        .spawn(scribble_on_own_channel, std::process::id() as i32)
        .unwrap();
    let pid = child.pid();
    // Let it finish first: the drop must then reap an exited child, not kill a running one.
    match method {
        StartMethod::Spawn | StartMethod::Warm => {
            let deadline = Instant::now() + TIMEOUT;
            while state(pid) != Some('Z') && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(state(pid), Some('Z'), "child {pid} did not exit");
        }
        StartMethod::Forkserver => assert!(gone_within(pid, TIMEOUT, false)),
    }
    drop(child);
    assert_reaped(pid, method);
}

fn exec_sleep(_: ()) {
    let error = std::process::Command::new("sleep").arg("30").exec();
    panic!("exec failed: {error}");
}

#[vmm_core::all_methods]
#[rstest]
fn join_returns_by_its_deadline_when_the_child_execs(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let child = Context::new(method).spawn(exec_sleep, ()).unwrap();
    let pid = child.pid();
    let started = Instant::now();
    let result = child.join(Duration::from_secs(1));
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(1) + JOIN_MARGIN,
        "join(1 s) took {elapsed:?}: it waited for the exec'd program"
    );
    let Err(Error::Child(failure)) = result else {
        panic!("a child that exec'd must fail, got {result:?}")
    };
    assert_eq!(failure.timed_out, Some(Duration::from_secs(1)), "{failure}");
    assert_eq!(failure.status, Some(ExitStatus::Signaled(9)), "{failure}");
    let program = failure.exec_program.as_deref().unwrap_or_default();
    assert!(program.ends_with("/sleep"), "{failure}");
    let shown = failure.to_string();
    for needle in ["timed out after 1s", "by exec", "/sleep"] {
        assert!(shown.contains(needle), "{needle:?} missing from:\n{shown}");
    }
    assert_reaped(pid, method);
}

/// The child function: hand its channel (every seqpacket socket it has) to a grandchild that
/// sleeps 30 s, write the grandchild's pid to `path`, then return or hang.
fn fork_channel_holder(args: (String, bool)) {
    let (path, hang_after) = args;
    for fd in seqpacket_sockets() {
        // SAFETY: borrowed for one fcntl; the fd is open (just listed) and stays open.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        fcntl(borrowed, FcntlArg::F_SETFD(FdFlag::empty())).unwrap();
    }
    // Never waited for: it must outlive this child (the test kills it by pid).
    #[allow(clippy::zombie_processes)]
    let grandchild = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    std::fs::write(&path, grandchild.id().to_string()).unwrap();
    if hang_after {
        std::thread::sleep(Duration::from_secs(600));
    }
}

fn scratch_path(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vmm-h4-{what}-{}", std::process::id()))
}

/// Kill a process the test made outside vmm-core (by pid: it has no PDEATHSIG).
fn kill_stray(pid_file: &Path) {
    let Ok(text) = std::fs::read_to_string(pid_file) else {
        return;
    };
    let _ = std::fs::remove_file(pid_file);
    if let Ok(pid) = text.trim().parse::<i32>() {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

#[vmm_core::all_methods]
#[rstest]
fn join_returns_by_its_deadline_when_a_grandchild_holds_the_channel(
    #[all_methods] method: StartMethod,
    #[values(false, true)] hang_after: bool,
) {
    let _guard = shared();
    let pid_file = scratch_path(&format!("holder-{method}-{hang_after}"));
    let _ = std::fs::remove_file(&pid_file);
    let path = pid_file.to_str().unwrap().to_owned();
    let child = Context::new(method)
        .spawn(fork_channel_holder, (path, hang_after))
        .unwrap();
    let pid = child.pid();
    let started = Instant::now();
    let result = child.join(Duration::from_secs(1));
    let elapsed = started.elapsed();
    let grandchild = std::fs::read_to_string(&pid_file).unwrap_or_default();
    kill_stray(&pid_file);
    assert!(
        elapsed < Duration::from_secs(1) + JOIN_MARGIN,
        "join(1 s) took {elapsed:?}: it waited for grandchild {grandchild}, which holds the channel"
    );
    assert!(!grandchild.is_empty(), "the child reported no grandchild");
    if hang_after {
        let Err(Error::Child(failure)) = result else {
            panic!("a hanging child must time out, got {result:?}")
        };
        assert_eq!(failure.timed_out, Some(Duration::from_secs(1)), "{failure}");
        assert_eq!(failure.status, Some(ExitStatus::Signaled(9)), "{failure}");
    } else {
        // It returned and exited 0; what a process it forked does with a copy of the channel
        // neither delays nor fails the join.
        assert_eq!(result.unwrap(), ExitStatus::Exited(0));
    }
    assert_reaped(pid, method);
}

fn write_marker(args: (String, u32)) {
    std::fs::write(format!("{}/marker-{}", args.0, args.1), b"ran").unwrap();
}

/// 60 spawns with 0 to 8 fds free under the soft limit: those that fail must not run their
/// function, those that succeed are joined and did run it.
fn spawn_near_the_fd_limit(args: (StartMethod, String)) {
    let (method, dir) = args;
    ensure_running().unwrap();
    let highest = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u64>().ok())
        .max()
        .unwrap();
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, highest + 24, hard).unwrap();
    let ctx = Context::new(method);
    let (mut refused, mut ran) = (Vec::new(), Vec::new());
    for attempt in 0..60u32 {
        let mut fillers = Vec::new();
        while let Ok(file) = File::open("/dev/null") {
            fillers.push(file);
        }
        // Most often 4 free: a forkserver spawn then fails at its last step (the reply's
        // pidfd does not fit) after the server has forked the child.
        let free = [0, 1, 2, 3, 4, 4, 4, 4, 4, 5, 6, 8][attempt as usize % 12];
        fillers.truncate(fillers.len().saturating_sub(free));
        let result = ctx.spawn(write_marker, (dir.clone(), attempt));
        drop(fillers);
        match result {
            Ok(child) => {
                child.join(TIMEOUT).unwrap();
                ran.push(attempt);
            }
            Err(error) => refused.push((attempt, free, error)),
        }
    }
    // A child that a failed spawn left running would write its marker within milliseconds.
    std::thread::sleep(Duration::from_millis(500));
    for attempt in &ran {
        let marker = format!("{dir}/marker-{attempt}");
        assert!(
            Path::new(&marker).exists(),
            "attempt {attempt} was joined but did not run"
        );
    }
    for (attempt, free, error) in &refused {
        let marker = format!("{dir}/marker-{attempt}");
        assert!(
            !Path::new(&marker).exists(),
            "attempt {attempt} ({free} fds free) returned Err ({error}) but its function ran"
        );
    }
    for (attempt, free, error) in &refused {
        assert!(
            matches!(error, Error::FdLimit { .. }),
            "attempt {attempt} ({free} fds free) failed with something other than FdLimit: \
             {error:?}"
        );
    }
    assert!(
        !refused.is_empty() && !ran.is_empty(),
        "the attempts did not reach both outcomes: {} refused, {} ran",
        refused.len(),
        ran.len()
    );
    println!("{} refused, {} ran", refused.len(), ran.len());
}

#[vmm_core::all_methods]
#[rstest]
fn a_spawn_that_fails_at_the_fd_limit_never_runs_its_function(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let dir = scratch_path(&format!("markers-{method}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let result = Context::new(StartMethod::Spawn)
        .spawn(
            spawn_near_the_fd_limit,
            (method, dir.to_str().unwrap().to_owned()),
        )
        .unwrap()
        .join(TIMEOUT);
    let _ = std::fs::remove_dir_all(&dir);
    result.unwrap();
}

#[vmm_core::all_methods]
#[rstest]
fn duration_max_is_forever_for_join_wait_and_with_timeout(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let ctx = Context::new(method);
    let status = ctx.spawn(noop, ()).unwrap().join(Duration::MAX).unwrap();
    assert_eq!(status, ExitStatus::Exited(0));
    let ctx = ctx.with_timeout(Duration::MAX);
    assert_eq!(ctx.timeout(), Duration::MAX);
    assert!(ctx.spawn(noop, ()).unwrap().wait().unwrap().success());
    // Dropped unjoined under a forever timeout: killed and reaped, no panic.
    let child = ctx.spawn(hang, ()).unwrap();
    let pid = child.pid();
    drop(child);
    assert_reaped(pid, method);
}

#[test]
fn forkserver_killed_between_requests_and_during_one() {
    let _guard = exclusive();
    let ctx = Context::new(StartMethod::Forkserver);
    ensure_running().unwrap();
    // Warm-up: lazily created process-wide state (the launcher thread) is not a leak.
    ctx.spawn(noop, ()).unwrap().join(TIMEOUT).unwrap();
    let before = settled_open_fds().unwrap();

    // Killed while one of its children runs: the child dies with it, and its join says why.
    let first = forkserver_pid().unwrap();
    let running = ctx.spawn(hang, ()).unwrap();
    let running_pid = running.pid();
    kill(Pid::from_raw(first as i32), Signal::SIGKILL).unwrap();
    let started = Instant::now();
    let result = running.join(TIMEOUT);
    assert!(started.elapsed() < JOIN_MARGIN, "{:?}", started.elapsed());
    let Err(Error::Child(failure)) = result else {
        panic!("a child whose forkserver died must fail, got {result:?}")
    };
    assert_eq!(failure.status, None, "{failure}");
    assert!(
        failure
            .to_string()
            .contains("the forkserver died before reporting it"),
        "{failure}"
    );
    assert!(gone_within(running_pid, Duration::from_secs(5), true));

    // Between requests: the next spawn starts a new server and works.
    ctx.spawn(noop, ()).unwrap().join(TIMEOUT).unwrap();
    let second = forkserver_pid().unwrap();
    assert_ne!(second, first);
    assert!(
        gone_within(first, Duration::from_secs(5), false),
        "server {first} not reaped"
    );

    // During one: the server is stopped, a spawn sends it a request and waits for the reply,
    // and the server is killed. The spawn is answered by a new server.
    kill(Pid::from_raw(second as i32), Signal::SIGSTOP).unwrap();
    let spawner = std::thread::spawn(move || {
        Context::new(StartMethod::Forkserver)
            .spawn(noop, ())
            .and_then(|child| child.join(TIMEOUT))
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !spawner.is_finished(),
        "the spawn did not wait for the stopped server"
    );
    kill(Pid::from_raw(second as i32), Signal::SIGKILL).unwrap();
    let answered = spawner.join().unwrap();
    assert_eq!(answered.unwrap(), ExitStatus::Exited(0));
    let third = forkserver_pid().unwrap();
    assert_ne!(third, second);
    assert!(
        gone_within(second, Duration::from_secs(5), false),
        "server {second} not reaped"
    );

    ensure_running().unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds leaked across forkserver deaths"
    );
}

fn get_one(args: (Queue<u32>, Queue<()>)) {
    args.1.put(&()).unwrap();
    let item = args.0.get(TIMEOUT).unwrap();
    panic!("the getter was to be killed while it waited, but it got {item}");
}

fn collect(args: (Queue<u32>, Queue<Vec<u32>>, usize)) {
    let (queue, results, count) = args;
    let got: Vec<u32> = (0..count).map(|_| queue.get(TIMEOUT).unwrap()).collect();
    results.put(&got).unwrap();
}

fn put_until_killed(args: (Queue<Vec<u8>>, Queue<()>)) {
    let (queue, ready) = args;
    ready.put(&()).unwrap();
    for round in 0u8.. {
        // Spilled items (larger than one packet carries) and small ones, so that the kill
        // lands in either kind of put, or blocked on a full queue.
        let len = if round % 2 == 0 { 200 << 10 } else { 512 };
        queue.put(&vec![round; len]).unwrap();
    }
}

#[rstest]
fn a_child_killed_in_queue_get_or_put_leaves_the_queue_working(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    let ctx = Context::new(method);

    // Killed while blocked in get.
    let (queue, ready) = (Queue::<u32>::new().unwrap(), Queue::new().unwrap());
    let getter = ctx.spawn(get_one, (queue.clone(), ready.clone())).unwrap();
    ready.get(TIMEOUT).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    getter.kill().unwrap();
    let Err(Error::Child(failure)) = getter.join(TIMEOUT) else {
        panic!("a killed child fails its join")
    };
    assert_eq!(failure.status, Some(ExitStatus::Signaled(9)), "{failure}");
    let results = Queue::new().unwrap();
    let collector = ctx
        .spawn(collect, (queue.clone(), results.clone(), 10))
        .unwrap();
    for item in 0..10 {
        queue.put(&item).unwrap();
    }
    assert_eq!(results.get(TIMEOUT).unwrap(), (0..10).collect::<Vec<_>>());
    collector.join(TIMEOUT).unwrap();

    // Killed in the middle of putting (or blocked in put on a full queue).
    let (queue, ready) = (Queue::<Vec<u8>>::new().unwrap(), Queue::new().unwrap());
    let putter = ctx
        .spawn(put_until_killed, (queue.clone(), ready.clone()))
        .unwrap();
    ready.get(TIMEOUT).unwrap();
    for _ in 0..5 {
        queue.get(TIMEOUT).unwrap();
    }
    putter.kill().unwrap();
    assert!(putter.join(TIMEOUT).is_err_and(|e| matches!(
        e,
        Error::Child(ref failure) if failure.status == Some(ExitStatus::Signaled(9))
    )));
    // Every item that made it in is whole, and the queue works on for another process.
    while let Some(item) = queue.try_get().unwrap() {
        let len = item.len();
        assert!(len == 200 << 10 || len == 512, "an item of {len} bytes");
        assert!(item.iter().all(|&b| b == item[0]), "a torn item");
    }
    let (numbers, results) = (Queue::<u32>::new().unwrap(), Queue::new().unwrap());
    let collector = ctx
        .spawn(collect, (numbers.clone(), results.clone(), 3))
        .unwrap();
    queue.put(&vec![1; 300 << 10]).unwrap();
    assert_eq!(queue.get(TIMEOUT).unwrap(), vec![1; 300 << 10]);
    for item in [7, 8, 9] {
        numbers.put(&item).unwrap();
    }
    assert_eq!(results.get(TIMEOUT).unwrap(), [7, 8, 9]);
    collector.join(TIMEOUT).unwrap();
}

fn must_not_run(fds: Vec<Fd>) {
    panic!("ran with {} fds that could not have arrived", fds.len());
}

fn memfd_at_or_above(min: RawFd) -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create(c"arg", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    let high = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(min)).unwrap();
    drop(fd);
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) just returned this new fd; nothing else owns it.
    unsafe { std::os::fd::FromRawFd::from_raw_fd(high) }
}

/// Start a child, under a soft fd limit of 32, whose argument carries 50 fds (they live at
/// numbers above the limit, opened before it was lowered).
///
/// A message owns the fds it carries (a duplicate each, made as the argument is encoded), so a
/// parent under the limit cannot even make the message: `spawn` fails with `Error::FdLimit`,
/// and nothing starts or leaks. A forkserver started under the limit makes children under it
/// while the parent has room again: such a child cannot receive its start message (MSG_CTRUNC),
/// reports that, and runs nothing.
fn start_a_child_whose_argument_cannot_fit(method: StartMethod) {
    let fds: Vec<Fd> = (0..50).map(|_| Fd::from(memfd_at_or_above(200))).collect();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 32, hard).unwrap();
    // This process's forkserver starts now, under the limit, and its children inherit it.
    ensure_running().unwrap();
    if method == StartMethod::Forkserver {
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    }
    let before = open_fds().unwrap();
    let spawned = Context::new(method).spawn(must_not_run, fds);
    if method == StartMethod::Spawn {
        match spawned {
            Err(Error::FdLimit { soft_limit: 32, .. }) => {}
            other => panic!("a message that cannot own its fds must be refused, got {other:?}"),
        }
        // The 50 fds were the argument's, dropped with it; nothing else stayed open.
        assert_eq!(open_fds().unwrap() + 50, before, "fds leaked");
        return;
    }
    let result = spawned.unwrap().join(TIMEOUT);
    let Err(Error::Child(failure)) = result else {
        panic!("a child that could not take its start message must fail, got {result:?}")
    };
    assert!(failure.started, "{failure}");
    assert_eq!(failure.panic_message, None, "{failure}");
    assert_eq!(failure.status, Some(ExitStatus::Exited(122)), "{failure}");
    match failure.not_run.as_deref() {
        Some(Error::Protocol {
            rule: ProtocolRule::Fds,
            message,
        }) => assert!(message.contains("MSG_CTRUNC"), "{message}"),
        other => panic!("expected the receive's Protocol error (MSG_CTRUNC), got {other:?}"),
    }
    assert!(
        failure
            .to_string()
            .contains("its function did not run: could not receive its start message"),
        "{failure}"
    );
    // The 50 fds were the argument's, closed once sent; nothing else stayed open.
    assert_eq!(open_fds().unwrap() + 50, before, "fds leaked");
}

#[rstest]
fn a_start_message_whose_fds_do_not_fit_is_a_typed_error_and_leaks_nothing(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] method: StartMethod,
) {
    let _guard = shared();
    Context::new(StartMethod::Spawn)
        .spawn(start_a_child_whose_argument_cannot_fit, method)
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
}

fn report_and_hang(queue: Queue<u32>) {
    queue.put(&std::process::id()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

fn start_grandchild_and_hang(args: (StartMethod, Queue<u32>, Queue<Option<u32>>)) {
    let (method, grandchildren, servers) = args;
    let grandchild = Context::new(method)
        .spawn(report_and_hang, grandchildren)
        .unwrap();
    servers.put(&forkserver_pid()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
    drop(grandchild);
}

#[rstest]
fn no_orphan_when_the_intermediate_is_sigkilled(
    #[values(StartMethod::Spawn, StartMethod::Forkserver)] inner: StartMethod,
) {
    let _guard = shared();
    let (grandchildren, servers) = (Queue::new().unwrap(), Queue::new().unwrap());
    let intermediate = Context::new(StartMethod::Spawn)
        .spawn(
            start_grandchild_and_hang,
            (inner, grandchildren.clone(), servers.clone()),
        )
        .unwrap();
    let grandchild = grandchildren.get(TIMEOUT).unwrap();
    let server = servers.get(TIMEOUT).unwrap();
    assert_eq!(server.is_some(), inner == StartMethod::Forkserver);
    assert!(
        state(grandchild).is_some_and(|s| s != 'Z'),
        "grandchild not running"
    );
    kill(Pid::from_raw(intermediate.pid() as i32), Signal::SIGKILL).unwrap();
    for (what, pid) in [("grandchild", Some(grandchild)), ("forkserver", server)] {
        let Some(pid) = pid else { continue };
        assert!(
            gone_within(pid, Duration::from_secs(5), true),
            "the {what} {pid} outlived its SIGKILLed parent (state {:?})",
            state(pid)
        );
    }
    let Err(Error::Child(failure)) = intermediate.join(TIMEOUT) else {
        panic!("a SIGKILLed child fails its join")
    };
    assert_eq!(failure.status, Some(ExitStatus::Signaled(9)), "{failure}");
}

/// The parent's side, in a process of its own: start a child under `method` that floods its
/// output as `flood` says and panics, and join it with this process's address space limited
/// far below the flood (see `vmm_tests::flood`). The forkserver and the warm pool are started
/// before the limit, as a long-lived parent has them.
fn join_a_flooding_child_under_a_memory_limit((method, flood): (StartMethod, Flood)) {
    match method {
        StartMethod::Forkserver => drop(ensure_running().unwrap()),
        StartMethod::Warm => drop(WarmPool::global().fill().unwrap()),
        StartMethod::Spawn => {}
    }
    let watch = MemoryWatch::limit_and_start();
    let result = Context::new(method)
        .spawn(flood_and_panic, flood)
        .unwrap()
        .join(TIMEOUT);
    watch.assert_peak_stayed_low(&format!("{method}, {flood:?}"));
    let Err(Error::Child(failure)) = result else {
        panic!("a child that panicked must fail its join, got {result:?}")
    };
    assert_eq!(failure.panic_message.as_deref(), Some(PANIC), "{failure}");
    assert_eq!(failure.status, Some(ExitStatus::Exited(101)));
    assert_tail_kept("stdout", &failure.stdout, flood, None);
    assert_tail_kept("stderr", &failure.stderr, flood, Some(LAST_WORDS));
    // The default panic hook printed the panic last: the kept tail has it.
    assert_tail_kept("stderr", &failure.stderr, flood, Some(PANIC));
}

/// A child that truncates its captured stdout and stderr to a terabyte (sparse: it costs the
/// child nothing), or writes 4 MiB to each, then panics: its parent reads the last
/// `output_cap()` bytes of each, which hold the panic, says how much it cut, and its memory
/// stays within a limit far below the flood (a parent that read it whole aborted on 1 TiB).
#[vmm_core::all_methods]
#[rstest]
fn a_child_that_floods_its_captured_output_costs_its_parent_one_cap(
    #[all_methods] method: StartMethod,
    #[values(Flood::Sparse, Flood::Written)] flood: Flood,
) {
    let _guard = shared();
    // The parent under attack is a child of its own, so that its limit binds nothing else; its
    // warm children initialise no GPU under that limit.
    Context::new(StartMethod::Spawn)
        .with_env("VMM_WARM_DEVICES", "none")
        .spawn(join_a_flooding_child_under_a_memory_limit, (method, flood))
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
}
