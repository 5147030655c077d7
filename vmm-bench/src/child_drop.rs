//! What dropping a running child costs the code that drops it.
//!
//! - host-drop: a `Process` whose child is running (it has acknowledged its start and sleeps
//!   in its function), dropped unjoined: the drop kills it and hands it to vmm-core's orphan
//!   queue, never waiting for it (`drop/{spawn,forkserver}`). Interleaved with it, the same
//!   child killed and joined (`kill-join/{spawn,forkserver}`): the blocking kill + reap that a
//!   drop did before the orphan queue (for a forkserver child, until the server's report of
//!   its status). And, for the floor of a blocking kill + reap, a bare `std::process::Child` of
//!   `sleep` killed and waited for (`command-kill-wait`). Only the drop, the kill + join or
//!   the kill + wait is timed; the child's start is not.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::process::{Context, Process, StartMethod, ensure_running};
use vmm_core::wire::Queue;

use crate::report::{Target, row};
use crate::{CHILD_WAIT, Group, Kind, Settings, key};

/// The group.
pub const GROUP: &str = "host-drop";

/// The methods whose children are measured.
const METHODS: [StartMethod; 2] = [StartMethod::Spawn, StartMethod::Forkserver];

fn ack_then_hang(ack: Queue<u8>) {
    ack.put(&1).expect("drop child: ack");
    std::thread::sleep(Duration::from_secs(600));
}

/// A child of `method` that runs (it acknowledged its start), untimed.
fn running(method: StartMethod, ack: &Queue<u8>) -> Process {
    let process = Context::new(method)
        .spawn(ack_then_hang, ack.clone())
        .expect("start child");
    ack.get(CHILD_WAIT).expect("child ack");
    process
}

/// `sleep 600`, once it has exec'd (untimed), killed and waited for.
fn command_kill_wait() -> Duration {
    let mut child = Command::new("sleep")
        .arg("600")
        .stdin(Stdio::null())
        .spawn()
        .expect("start sleep");
    let comm = format!("/proc/{}/comm", child.id());
    while std::fs::read_to_string(&comm).map_or(true, |c| c.trim() != "sleep") {
        std::thread::yield_now();
    }
    let t = Instant::now();
    child.kill().expect("kill sleep");
    child.wait().expect("wait for sleep");
    t.elapsed()
}

/// Dropping a running child, next to killing and joining it.
pub fn host_drop(c: &mut Criterion) {
    for method in METHODS {
        let figure = key(GROUP, &format!("drop/{}", method.name()));
        row(
            &figure,
            &key(GROUP, &format!("kill-join/{}", method.name())),
            Target::None,
        );
        row(&figure, &key(GROUP, "command-kill-wait"), Target::None);
    }
    ensure_running().expect("start the forkserver");
    let ack = Queue::new().expect("queue");
    let mut group = Group::new(c, GROUP, Kind::Processes);
    // Every iteration starts a child or two outside the clock, which criterion does not see:
    // short times keep the group to seconds.
    if Settings::from_env().quick {
        group.times(Duration::from_millis(10), Duration::from_millis(50));
    } else {
        group.times(Duration::from_millis(50), Duration::from_millis(300));
    }
    for method in METHODS {
        let name = method.name();
        group.bench_pair(
            name,
            (&format!("drop/{name}"), || {
                let process = running(method, &ack);
                let t = Instant::now();
                drop(process);
                t.elapsed()
            }),
            (&format!("kill-join/{name}"), || {
                let process = running(method, &ack);
                let t = Instant::now();
                process.kill().expect("kill child");
                // A killed child is an error: its story is what the join returns.
                let _ = process.join(CHILD_WAIT);
                t.elapsed()
            }),
        );
    }
    group.bench("command-kill-wait", command_kill_wait);
    group.finish();
}
