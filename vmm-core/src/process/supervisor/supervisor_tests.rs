//! The supervisor on real child processes (`/bin/sleep`, `/bin/true`, `sh`), wrapped in a
//! [`Child`] as spawn and the forkserver wrap theirs: a drop never waits, whatever state the
//! child is in, and every dropped child is reaped; the one report reader; the waiting `end`.

use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::super::ends::ChildEnd;
use super::super::protocol::Report;
use super::child_proc::STATUS_REPORT_GRACE;
use super::*;
use crate::wire;

/// The most a drop may take: it never waits for the child, so this is generous (a loaded
/// machine running the other tests beside).
const DROP_LIMIT: Duration = Duration::from_millis(50);

/// How long a dropped child may take to be reaped in the background.
const REAP_LIMIT: Duration = Duration::from_secs(10);

/// Start `program` as a child of this process; its `std::process::Child` is dropped at once
/// (which neither kills nor waits), so the pid is ours to wrap: the `Child` made of it reaps it.
#[allow(clippy::zombie_processes)]
fn start(program: &str, args: &[&str]) -> Pid {
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    Pid::from_raw(child.id() as i32)
}

/// `pid` held as a spawned child is (ours to reap), with the other end of its channel.
fn ours(pid: Pid) -> (Child, ChildEnd) {
    let (parent, theirs) = ParentEnd::pair().unwrap();
    (Child::ours(pid, parent, Output::new().unwrap()), theirs)
}

/// A sleeping child of ours, held.
fn sleeper() -> (Child, ChildEnd) {
    ours(start("sleep", &["100"]))
}

/// A sleeping child of ours held as a forkserver child is (its status comes in the server's
/// report), with the server's end of its channel.
fn forked_sleeper() -> (Pid, Child, ChildEnd) {
    let pid = start("sleep", &["100"]);
    let (parent, server_end) = ParentEnd::pair().unwrap();
    let child = Child::forked(
        pid,
        sys::pidfd_open(pid).ok(),
        parent,
        Output::new().unwrap(),
    );
    (pid, child, server_end)
}

/// `pid`'s state letter while it is an unreaped child of this process (a zombie included);
/// `None` once it has been reaped (gone, or the pid is another process's now).
fn our_child_state(pid: Pid) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, fields) = stat.rsplit_once(')')?;
    let mut fields = fields.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent: u32 = fields.next()?.parse().ok()?;
    (parent == std::process::id()).then_some(state)
}

/// Wait (at most [`REAP_LIMIT`]) until `check` holds.
fn eventually(mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + REAP_LIMIT;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn wait_state(pid: Pid, state: char) {
    assert!(
        eventually(|| our_child_state(pid) == Some(state)),
        "child {pid} never reached state {state} (it is {:?})",
        our_child_state(pid)
    );
}

fn reaped_eventually(pid: Pid) {
    assert!(
        eventually(|| our_child_state(pid).is_none()),
        "dropped child {pid} was never reaped: it is still our child, in state {:?}",
        our_child_state(pid)
    );
}

/// Drop `child`, and check that the drop returned within [`DROP_LIMIT`].
fn quick_drop(child: Child, what: &str) {
    let t = Instant::now();
    drop(child);
    let took = t.elapsed();
    assert!(took < DROP_LIMIT, "dropping {what} took {took:?}");
}

fn send(channel: &ChildEnd, report: &Report) {
    channel.send(report).unwrap();
}

#[test]
fn a_running_child_is_killed_without_waiting_and_reaped() {
    let (child, _theirs) = sleeper();
    let pid = child.pid();
    assert_eq!(our_child_state(pid).map(|s| s == 'Z'), Some(false));
    quick_drop(child, "a running child");
    reaped_eventually(pid);
}

#[test]
fn a_child_that_ignores_sigterm_is_killed_without_waiting_and_reaped() {
    // An ignored signal stays ignored across exec: this `sleep` ignores SIGTERM.
    let pid = start("sh", &["-c", "trap '' TERM; exec sleep 100"]);
    assert!(
        eventually(|| std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|comm| comm.trim() == "sleep")),
        "sh never exec'd sleep"
    );
    let (child, _theirs) = ours(pid);
    quick_drop(child, "a child that ignores SIGTERM");
    reaped_eventually(pid);
}

#[test]
fn a_stopped_child_is_killed_without_waiting_and_reaped() {
    let (child, _theirs) = sleeper();
    let pid = child.pid();
    kill(pid, Signal::SIGSTOP).unwrap();
    wait_state(pid, 'T');
    quick_drop(child, "a stopped child");
    reaped_eventually(pid);
}

#[test]
fn a_killed_child_still_dying_is_reaped() {
    let (child, _theirs) = sleeper();
    let pid = child.pid();
    child.kill().unwrap();
    quick_drop(child, "a child killed an instant before");
    reaped_eventually(pid);
}

#[test]
fn a_zombie_nobody_noticed_is_reaped_by_the_drop_itself() {
    let (child, _theirs) = ours(start("true", &[]));
    let pid = child.pid();
    wait_state(pid, 'Z');
    assert!(child.exited_at().is_none() && !child.ended());
    quick_drop(child, "a zombie");
    assert_eq!(our_child_state(pid), None, "a zombie is reaped at once");
}

#[test]
fn an_exited_child_seen_exiting_but_not_reaped_is_reaped_by_the_drop_itself() {
    let (mut child, _theirs) = ours(start("true", &[]));
    let pid = child.pid();
    assert!(
        eventually(|| child.poll_exited()),
        "its pidfd never said so"
    );
    assert!(child.exited_at().is_some() && !child.ended());
    assert_eq!(our_child_state(pid), Some('Z'));
    quick_drop(child, "an exited child");
    assert_eq!(
        our_child_state(pid),
        None,
        "an exited child is reaped at once"
    );
}

#[test]
fn a_child_without_a_pidfd_is_reaped_by_polling() {
    let pid = start("sleep", &["100"]);
    let (parent, _theirs) = ParentEnd::pair().unwrap();
    let child = Child::new(pid, Reaper::Us, None, parent, Output::new().unwrap());
    quick_drop(child, "a child without a pidfd");
    reaped_eventually(pid);
}

#[test]
fn many_children_dropped_at_once_from_several_threads_are_all_reaped() {
    const THREADS: usize = 4;
    const EACH: usize = 16;
    let children: Vec<Vec<(Child, ChildEnd)>> = (0..THREADS)
        .map(|_| (0..EACH).map(|_| sleeper()).collect())
        .collect();
    let pids: Vec<Pid> = children.iter().flatten().map(|(c, _)| c.pid()).collect();
    let slowest = std::thread::scope(|scope| {
        let threads: Vec<_> = children
            .into_iter()
            .map(|batch| {
                scope.spawn(move || {
                    let mut slowest = Duration::ZERO;
                    for (child, _theirs) in batch {
                        let t = Instant::now();
                        drop(child);
                        slowest = slowest.max(t.elapsed());
                    }
                    slowest
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .max()
            .unwrap()
    });
    assert!(
        slowest < DROP_LIMIT,
        "the slowest of {} drops took {slowest:?}",
        THREADS * EACH
    );
    for pid in pids {
        reaped_eventually(pid);
    }
}

#[test]
fn a_dropped_forkserver_child_awaits_the_servers_report_in_the_background() {
    // This test plays the forkserver: it reaps the child and reports its status.
    let pid = start("sleep", &["100"]);
    let (parent, server_end) = ParentEnd::pair().unwrap();
    let pidfd = sys::pidfd_open(pid).ok();
    let child = Child::forked(pid, pidfd, parent, Output::new().unwrap());
    quick_drop(child, "a forkserver child");
    let status = reap_pid(pid).unwrap();
    assert_eq!(status, ExitStatus::Signaled(9), "the drop killed it");
    // Until its report comes, the orphan holds the channel.
    std::thread::sleep(Duration::from_millis(20));
    assert!(!wire::wait_hangup(server_end.as_fd(), Some(Instant::now())).unwrap());
    send(&server_end, &Report::Exited(status));
    // Report taken, the orphan is done with: its end of the channel closes.
    let deadline = Instant::now() + REAP_LIMIT;
    assert!(
        wire::wait_hangup(server_end.as_fd(), Some(deadline)).unwrap(),
        "the orphan never took the server's report"
    );
}

#[test]
fn the_orphan_queue_empties_and_its_reaper_ends() {
    for _ in 0..4 {
        let (child, _theirs) = sleeper();
        quick_drop(child, "a running child");
    }
    // Other tests may drop children meanwhile: the queue still empties within the limit.
    assert!(settle_orphans(REAP_LIMIT), "the orphan queue did not empty");
}

#[test]
fn end_waits_for_the_status_a_caller_asked_for() {
    let (mut child, _theirs) = sleeper();
    let pid = child.pid();
    child.end(false);
    assert_eq!(child.status(), Some(ExitStatus::Signaled(9)));
    assert_eq!(our_child_state(pid), None, "end reaped it");
    drop(child);

    // With `let_exit`, a child that exits by itself keeps its own status.
    let (mut child, _theirs) = ours(start("sh", &["-c", "exit 3"]));
    let t = Instant::now();
    child.end(true);
    assert_eq!(child.status(), Some(ExitStatus::Exited(3)));
    assert!(t.elapsed() < STATUS_REPORT_GRACE, "it was not let exit");
}

#[test]
fn an_ending_advances_without_waiting_until_the_status_is_known() {
    let (mut child, _theirs) = sleeper();
    let mut ending = child.start_ending(false);
    let t = Instant::now();
    let mut rounds = 0;
    while !child.advance_ending(&mut ending) {
        rounds += 1;
        let watch = child.ending_watch(&ending);
        assert!(
            watch.fds().count() == 1,
            "a child of ours is watched by its pidfd"
        );
        watch.wait();
    }
    assert!(t.elapsed() < REAP_LIMIT);
    assert!(rounds < 100, "{rounds} rounds: the watch did not sleep");
    assert_eq!(child.status(), Some(ExitStatus::Signaled(9)));
}

#[test]
fn reports_are_read_in_order_until_the_closure_stops() {
    let (mut child, theirs) = sleeper();
    for report in [Report::Ready, Report::Started, Report::Serving] {
        send(&theirs, &report);
    }
    let mut seen = Vec::new();
    let read = child.read_reports(None, |packet| {
        let Packet::Report(report, _) = packet else {
            panic!("not a report: {packet:?}")
        };
        let stop = matches!(report, Report::Started);
        seen.push(format!("{report:?}"));
        if stop { Flow::Stop } else { Flow::Continue }
    });
    assert!(matches!(read, Read::Stopped), "{read:?}");
    assert_eq!(seen, ["Ready", "Started"]);
    let read = child.read_reports(None, |packet| {
        seen.push(format!("{packet:?}"));
        Flow::Continue
    });
    assert!(matches!(read, Read::Drained), "{read:?}");
    assert_eq!(seen.len(), 3);
    assert!(seen[2].contains("Serving"), "{seen:?}");
}

#[test]
fn a_packet_that_is_not_a_report_is_handed_over_and_reading_goes_on() {
    let (mut child, theirs) = sleeper();
    theirs.channel().send(&[0xFF; 7], &[]).unwrap();
    send(&theirs, &Report::Pong);
    let mut seen = Vec::new();
    let read = child.read_reports(None, |packet| {
        seen.push(packet);
        Flow::Continue
    });
    assert!(matches!(read, Read::Drained), "{read:?}");
    assert!(matches!(seen[0], Packet::NotAReport(_)), "{seen:?}");
    assert!(
        matches!(seen[1], Packet::Report(Report::Pong, _)),
        "{seen:?}"
    );
}

#[test]
fn a_hang_up_comes_after_what_was_queued_before_it() {
    let (mut child, theirs) = sleeper();
    send(&theirs, &Report::Ready);
    drop(theirs);
    let mut seen = 0;
    let read = child.read_reports(Some(Instant::now() + REAP_LIMIT), |_| {
        seen += 1;
        Flow::Continue
    });
    assert!(matches!(read, Read::HungUp), "{read:?}");
    assert_eq!(seen, 1);
}

#[test]
fn reading_waits_until_a_deadline_for_a_packet() {
    let (mut child, theirs) = sleeper();
    let t = Instant::now();
    let read = child.read_reports(Some(t + Duration::from_millis(30)), |_| Flow::Stop);
    assert!(matches!(read, Read::Drained), "{read:?}");
    assert!(t.elapsed() >= Duration::from_millis(30));
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        send(&theirs, &Report::Pong);
        theirs
    });
    let mut pong = false;
    let read = child.read_reports(Some(Instant::now() + REAP_LIMIT), |packet| {
        pong = matches!(packet, Packet::Report(Report::Pong, _));
        Flow::Stop
    });
    assert!(matches!(read, Read::Stopped) && pong, "{read:?}");
    drop(sender.join().unwrap());
}

#[test]
fn the_forkservers_exit_report_is_the_childs_status_not_the_readers_business() {
    let (pid, mut child, server_end) = forked_sleeper();
    send(&server_end, &Report::Started);
    send(&server_end, &Report::Exited(ExitStatus::Exited(4)));
    let mut seen = Vec::new();
    let read = child.read_reports(None, |packet| {
        seen.push(format!("{packet:?}"));
        Flow::Continue
    });
    assert!(matches!(read, Read::Exited), "{read:?}");
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(child.status(), Some(ExitStatus::Exited(4)));
    // A second `Exited` is not the server's: the reader hands it over.
    send(&server_end, &Report::Exited(ExitStatus::Exited(5)));
    let read = child.read_reports(None, |packet| {
        seen.push(format!("{packet:?}"));
        Flow::Continue
    });
    assert!(matches!(read, Read::Drained), "{read:?}");
    assert!(seen[1].contains("Exited"), "{seen:?}");
    assert_eq!(child.status(), Some(ExitStatus::Exited(4)));
    // Its end is "known" (the forged report said so): clean up the real process here.
    drop(child);
    kill(pid, Signal::SIGKILL).unwrap();
    reap_pid(pid).unwrap();
}

#[test]
fn end_takes_a_forkserver_childs_status_from_the_servers_report() {
    let (pid, mut child, server_end) = forked_sleeper();
    // This thread plays the server: it reaps the child once killed, and reports.
    let server = std::thread::spawn(move || {
        let status = reap_pid(pid).unwrap();
        send(&server_end, &Report::Exited(status));
        server_end
    });
    child.end(false);
    assert_eq!(child.status(), Some(ExitStatus::Signaled(9)));
    drop(server.join().unwrap());
}

#[test]
fn a_forkserver_childs_status_is_lost_when_the_server_hangs_up_first() {
    let (pid, mut child, server_end) = forked_sleeper();
    // A server that reaps the child and dies without reporting.
    let server = std::thread::spawn(move || {
        reap_pid(pid).unwrap();
        drop(server_end);
    });
    let t = Instant::now();
    child.end(false);
    assert!(
        t.elapsed() < STATUS_REPORT_GRACE,
        "the hang-up was not seen"
    );
    assert_eq!(child.status(), None);
    assert_eq!(
        child.lost(),
        Some("the forkserver died before reporting it"),
        "{child:?}"
    );
    server.join().unwrap();
}
