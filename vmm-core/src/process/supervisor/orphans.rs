//! The orphan queue: dropped children whose end was not known, killed, reaped (or their
//! report awaited) in the background, by sweeps and by one reaper thread.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::super::ends::ParentEnd;
use super::super::sys;
use super::child_proc::{Proc, REAP_POLL};
use super::ending::{Ending, Watch, wait_any};

/// A dropped child whose end was not known yet: killed, to be reaped (or its report awaited).
#[derive(Debug)]
struct Orphan {
    proc: Proc,
    /// A forkserver child's channel, for the server's report.
    channel: Option<Arc<ParentEnd>>,
    ending: Ending,
}

impl Orphan {
    /// Whether its end is known now (see [`Ending::advance`]).
    fn advance(&mut self) -> bool {
        self.ending.advance(&mut self.proc, self.channel.as_deref())
    }

    /// What to poll for its next step.
    fn watch(&self) -> Watch {
        self.ending.watch(&self.proc, self.channel.as_ref())
    }
}

/// How long the background reaper waits for a new orphan once the queue is empty, before it
/// ends: a program that drops children one after another starts it once, not once a drop.
const REAPER_LINGER: Duration = Duration::from_millis(500);

/// The process-wide orphan queue, and its background reaper.
#[derive(Debug)]
struct Orphans {
    list: Vec<Orphan>,
    /// A reaper thread is running (it clears this, under the lock, as it ends).
    reaping: bool,
    /// The running reaper's wake-up (an eventfd), if one could be made; closed when it ends.
    wake: Option<Arc<OwnedFd>>,
    /// The reaper is to end as soon as the queue is empty, without lingering
    /// ([`settle_orphans`]).
    end_when_empty: bool,
}

static ORPHANS: Mutex<Orphans> = Mutex::new(Orphans {
    list: Vec::new(),
    reaping: false,
    wake: None,
    end_when_empty: false,
});

/// How many orphans are queued (so that a new child looks at the queue only when it holds
/// some).
static QUEUED: AtomicUsize = AtomicUsize::new(0);

fn orphans() -> MutexGuard<'static, Orphans> {
    ORPHANS.lock().unwrap_or_else(|e| e.into_inner())
}

impl Orphans {
    /// Advance every orphan without waiting; forget those whose end is known.
    fn sweep(&mut self) {
        self.list.retain_mut(|orphan| !orphan.advance());
        QUEUED.store(self.list.len(), Ordering::Relaxed);
    }

    /// Have a reaper running, and tell it of what was queued.
    fn ensure_reaper(&mut self) {
        if self.reaping {
            self.wake_reaper();
            return;
        }
        // Without an eventfd (at the fd limit) the reaper looks for new orphans every
        // REAP_POLL instead.
        self.wake = sys::eventfd().ok().map(Arc::new);
        let started = std::thread::Builder::new()
            .name("vmm-ipc-reaper".into())
            .spawn(reap_in_background);
        match started {
            Ok(_) => self.reaping = true,
            // Swept on the next drop, the next child, or by `settle_orphans`.
            Err(_) => self.wake = None,
        }
    }

    fn wake_reaper(&self) {
        if let Some(wake) = &self.wake {
            let _ = nix::unistd::write(wake, &1u64.to_ne_bytes());
        }
    }
}

/// Take `proc` (killed now) into the orphan queue, unless it can be reaped at once.
pub(super) fn adopt(proc: Proc, channel: Option<Arc<ParentEnd>>) {
    let mut proc = proc;
    let ending = Ending::start(&mut proc, false);
    let mut orphan = Orphan {
        proc,
        channel,
        ending,
    };
    if orphan.advance() {
        return;
    }
    let mut orphans = orphans();
    orphans.sweep();
    orphans.list.push(orphan);
    QUEUED.store(orphans.list.len(), Ordering::Relaxed);
    orphans.ensure_reaper();
}

/// Reap the orphans that have exited, without waiting (and without waiting for the queue's
/// lock either: whoever holds it is sweeping).
pub(crate) fn reap_orphans() {
    if QUEUED.load(Ordering::Relaxed) == 0 {
        return;
    }
    if let Ok(mut orphans) = ORPHANS.try_lock() {
        orphans.sweep();
    }
}

/// The background reaper: sweep, then sleep on the orphans until one may have ended (or a new
/// one comes); gone once the queue has been empty for [`REAPER_LINGER`] (at once when
/// [`settle_orphans`] asks).
fn reap_in_background() {
    let mut empty_since: Option<Instant> = None;
    loop {
        let (watches, wake, mut cap) = {
            let mut orphans = orphans();
            orphans.sweep();
            let mut cap = None;
            if orphans.list.is_empty() {
                let since = *empty_since.get_or_insert_with(Instant::now);
                if orphans.end_when_empty || since.elapsed() >= REAPER_LINGER {
                    orphans.reaping = false;
                    orphans.end_when_empty = false;
                    // Closes the eventfd: its last reference (ours went with the last round).
                    orphans.wake = None;
                    return;
                }
                cap = Some(since + REAPER_LINGER);
            } else {
                empty_since = None;
            }
            let watches: Vec<Watch> = orphans.list.iter().map(Orphan::watch).collect();
            (watches, orphans.wake.clone(), cap)
        };
        if wake.is_none() {
            // Nothing tells it of new orphans: it looks for them.
            let tick = Instant::now() + REAP_POLL;
            cap = Some(cap.map_or(tick, |c| c.min(tick)));
        }
        wait_any(&watches, wake.as_deref().map(AsFd::as_fd), cap);
        if let Some(wake) = &wake {
            let mut drained = [0u8; 8];
            let _ = nix::unistd::read(wake, &mut drained);
        }
    }
}

/// Wait, at most `limit`, until the orphan queue is empty and its reaper gone (so that the fds
/// they held are closed): for fd accounting. Whether it is.
pub(crate) fn settle_orphans(limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        {
            let mut orphans = orphans();
            orphans.sweep();
            if orphans.list.is_empty() && !orphans.reaping {
                return true;
            }
            if orphans.list.is_empty() && !orphans.end_when_empty {
                // It lingers, or sleeps on fds of orphans swept meanwhile: it is to end now.
                orphans.end_when_empty = true;
                orphans.wake_reaper();
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
