//! Which children one `#[ipc_test]` started, so that none outlives it unnoticed.

use std::sync::Mutex;
use std::time::Duration;

use crate::process::tracker::{Fate, TrackedChild, Tracker};

/// How long [`Registry::finish`] waits to see a killed child dead.
const KILL_CONFIRM: Duration = Duration::from_secs(5);

/// The children started through one test's `Context` and its clones.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    entries: Mutex<Vec<TrackedChild>>,
}

impl Tracker for Registry {
    fn track(&self, child: TrackedChild) {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(child);
    }
}

impl Registry {
    /// End the scope: kill and reap children still running (their `Process` was leaked, or the
    /// scope timed out while they ran), and describe every child that was left running. A
    /// child is said to have been killed only once it is seen dead (reaped, or its pidfd
    /// readable), at most [`KILL_CONFIRM`] after the signal.
    pub(crate) fn finish(&self, timed_out: bool) -> Vec<String> {
        let entries = std::mem::take(&mut *self.entries.lock().unwrap_or_else(|e| e.into_inner()));
        for entry in &entries {
            entry.kill_if_running();
        }
        let mut problems = Vec::new();
        for entry in entries {
            let (pid, method) = (entry.pid(), entry.method());
            match entry.fate() {
                Fate::Running => {
                    let dead = entry.take_over(KILL_CONFIRM);
                    let when = if timed_out {
                        "was still running at the timeout"
                    } else {
                        "was still running when the test ended (its Process was never dropped \
                         or joined)"
                    };
                    let end = match dead {
                        Some(true) => "it has been killed".to_owned(),
                        Some(false) => format!(
                            "it was sent SIGKILL but was still alive {KILL_CONFIRM:?} later"
                        ),
                        None => "it was sent SIGKILL (its death could not be watched: no pidfd)"
                            .to_owned(),
                    };
                    problems.push(format!("child {pid} ({method}) {when}; {end}"));
                }
                Fate::DroppedRunning => problems.push(format!(
                    "child {pid} ({method}) was still running when its Process was dropped; join it, \
                     or call kill() first if ending it early is intended"
                )),
                Fate::Finished | Fate::Killed | Fate::Reaped => {}
            }
        }
        problems
    }
}
