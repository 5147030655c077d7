//! Closing fds a peer sent that nobody wants, off the caller's path.
//!
//! `close` of the last reference to a file runs that file's release, which a hostile peer
//! chooses: a FUSE file whose server never answers, or a TCP socket with `SO_LINGER` and unsent
//! data, blocks the closing thread for as long as its owner likes, past every timeout of the
//! receive that refused it. So the fds of a refused message (and the unwanted fds of a message
//! of the wrong kind, and whatever a refused client sent before it was turned away) are handed
//! to a background thread that closes them. A close that blocks there holds up no receive,
//! accept or connect; once a closer has been inside one close for more than [`STUCK`], later
//! fds go to another closer (at most [`MAX_CLOSERS`] threads), so one hostile fd does not keep
//! every later refused fd open either.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The closer threads' name (as `/proc/<pid>/task/<tid>/comm` shows it).
pub(crate) const THREAD_NAME: &str = "vmm-ipc-closer";

/// A closer that has been inside one `close` this long is taken to be stuck on a hostile fd:
/// later fds go to another closer.
const STUCK: Duration = Duration::from_millis(100);

/// The most closer threads: past that many stuck ones, fds queue behind them (each stuck
/// close holds one thread, and a peer can make a handful; the queue is bounded by the fd
/// limit, as every open fd is).
const MAX_CLOSERS: usize = 8;

struct Closer {
    tx: Sender<Vec<OwnedFd>>,
    /// When its current close started, in nanoseconds since [`epoch`] plus one; 0 when idle.
    busy_since: Arc<AtomicU64>,
}

/// Fds handed to [`close_later`] and not closed yet.
static PENDING: AtomicUsize = AtomicUsize::new(0);

/// How many fds handed to [`close_later`] are not closed yet (a close that blocks counts until
/// it returns): what `testing::settled_open_fds` waits for.
pub(crate) fn pending() -> usize {
    PENDING.load(Ordering::Acquire)
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_nanos() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
}

impl Closer {
    fn stuck(&self) -> bool {
        let since = self.busy_since.load(Ordering::Acquire);
        since != 0 && now_nanos().saturating_sub(since) > STUCK.as_nanos() as u64
    }

    fn start() -> Option<Closer> {
        let (tx, rx) = channel::<Vec<OwnedFd>>();
        let busy_since = Arc::new(AtomicU64::new(0));
        let busy = Arc::clone(&busy_since);
        std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(move || {
                for fds in rx {
                    for fd in fds {
                        busy.store(now_nanos(), Ordering::Release);
                        drop(fd);
                        busy.store(0, Ordering::Release);
                        PENDING.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })
            .ok()?;
        Some(Closer { tx, busy_since })
    }
}

/// Close `fds` on a background closer thread (started on first use; another is started when
/// every one is stuck in a close, up to [`MAX_CLOSERS`]). Where no thread can be started, they
/// are closed here: an fd is never kept open.
pub(crate) fn close_later(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    static CLOSERS: Mutex<Vec<Closer>> = Mutex::new(Vec::new());
    let count = fds.len();
    let mut closers = CLOSERS.lock().unwrap_or_else(|e| e.into_inner());
    let free = closers.iter().position(|c| !c.stuck());
    let index = match free {
        Some(i) => i,
        None if closers.len() < MAX_CLOSERS => match Closer::start() {
            Some(closer) => {
                closers.push(closer);
                closers.len() - 1
            }
            None if closers.is_empty() => {
                drop(fds);
                return;
            }
            None => closers.len() - 1,
        },
        None => closers.len() - 1,
    };
    PENDING.fetch_add(count, Ordering::AcqRel);
    if let Err(returned) = closers[index].tx.send(fds) {
        // Its thread is gone (it never is): close them here.
        drop(returned.0);
        PENDING.fetch_sub(count, Ordering::AcqRel);
    }
}
