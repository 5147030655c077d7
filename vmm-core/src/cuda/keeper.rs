//! Keeps what a message needs alive until its receiver is done with it: how a fabric buffer
//! sent as a value (a process argument, a `Queue` item) keeps its memory until the receiver
//! has imported it, since a fabric handle, unlike an fd in flight, keeps nothing alive.
//!
//! The message carries the write end of a fresh pipe; the receiver closes it once it has
//! imported (or failed to, or dropped the message unread: closing the message's fds closes
//! it too). The sender gives the read end and a value to keep (a clone of the buffer) to
//! this module, whose one thread per process (started on first use) polls every read end and
//! drops the value when its pipe reports the hang-up. Knows nothing of buffers: it keeps any
//! `Send` value.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::{Error, Result};

/// One kept value and the pipe end whose hang-up releases it.
struct Entry {
    key: usize,
    watch: OwnedFd,
    /// Dropped (on the keeper's thread) once `watch` reports a hang-up.
    _value: Box<dyn Send>,
}

struct Keeper {
    entries: Mutex<Sender<Entry>>,
    /// Written (one byte) after each registration, so the thread's `poll` returns and takes it.
    wake: UnixStream,
    /// How many values are kept per key.
    pending: Mutex<HashMap<usize, usize>>,
    released: Condvar,
}

static KEEPER: Mutex<Option<&'static Keeper>> = Mutex::new(None);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update below is a single insert, push or decrement: valid after any panic.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The process's keeper, its thread started on first use.
fn keeper() -> Result<&'static Keeper> {
    let mut slot = lock(&KEEPER);
    if let Some(keeper) = *slot {
        return Ok(keeper);
    }
    let (wake, woken) =
        UnixStream::pair().map_err(|e| Error::io("socketpair for the fabric keeper", e))?;
    for end in [&wake, &woken] {
        end.set_nonblocking(true)
            .map_err(|e| Error::io("O_NONBLOCK on the fabric keeper's socket", e))?;
    }
    let (sender, receiver) = mpsc::channel();
    let keeper: &'static Keeper = Box::leak(Box::new(Keeper {
        entries: Mutex::new(sender),
        wake,
        pending: Mutex::new(HashMap::new()),
        released: Condvar::new(),
    }));
    std::thread::Builder::new()
        .name("vmm-fabric-keeper".to_owned())
        .spawn(move || run(keeper, receiver, woken))
        .map_err(|e| Error::io("starting the fabric keeper thread", e))?;
    *slot = Some(keeper);
    Ok(keeper)
}

/// Keep `value` until every copy of the write end of the pipe whose read end is `watch` has
/// been closed; count it under `key` (see [`wait_released`]) meanwhile.
pub(crate) fn keep_until_closed(key: usize, value: Box<dyn Send>, watch: OwnedFd) -> Result<()> {
    let keeper = keeper()?;
    *lock(&keeper.pending).entry(key).or_insert(0) += 1;
    let entry = Entry {
        key,
        watch,
        _value: value,
    };
    if let Err(mpsc::SendError(entry)) = lock(&keeper.entries).send(entry) {
        // The thread is gone (it never returns; only a panic could end it): keep nothing.
        release(keeper, entry.key);
        return Err(Error::FabricKeeperStopped);
    }
    // A full socket means a wake-up is pending already.
    let _ = (&keeper.wake).write(&[1]);
    Ok(())
}

/// How many values are kept under `key` now.
pub(crate) fn pending(key: usize) -> usize {
    match *lock(&KEEPER) {
        Some(keeper) => lock(&keeper.pending).get(&key).copied().unwrap_or(0),
        None => 0,
    }
}

/// Wait until nothing is kept under `key`, at most `timeout` (`Duration::MAX`: no limit);
/// [`Error::Timeout`] naming how many are left otherwise.
pub(crate) fn wait_released(key: usize, timeout: Duration) -> Result<()> {
    let Some(keeper) = *lock(&KEEPER) else {
        return Ok(());
    };
    let deadline = Instant::now().checked_add(timeout);
    let mut pending = lock(&keeper.pending);
    loop {
        let left = pending.get(&key).copied().unwrap_or(0);
        if left == 0 {
            return Ok(());
        }
        let wait = match deadline {
            None => Duration::from_secs(3600),
            Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                Some(wait) if !wait.is_zero() => wait,
                _ => {
                    return Err(Error::Timeout {
                        what: format!(
                            "{left} receiver(s) of a fabric buffer to import it (or drop it)"
                        ),
                        after: timeout,
                    });
                }
            },
        };
        pending = keeper
            .released
            .wait_timeout(pending, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn release(keeper: &Keeper, key: usize) {
    let mut pending = lock(&keeper.pending);
    if let Some(count) = pending.get_mut(&key) {
        *count -= 1;
        if *count == 0 {
            pending.remove(&key);
        }
    }
    drop(pending);
    keeper.released.notify_all();
}

/// The keeper's thread: poll the wake-up socket and every kept pipe end; drop each value whose
/// pipe hung up. Never returns.
fn run(keeper: &'static Keeper, receiver: Receiver<Entry>, woken: UnixStream) {
    let mut entries: Vec<Entry> = Vec::new();
    loop {
        loop {
            match receiver.try_recv() {
                Ok(entry) => entries.push(entry),
                Err(TryRecvError::Empty) => break,
                // `keeper` is leaked, so its sender lives for the process.
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let mut fds = Vec::with_capacity(entries.len() + 1);
        fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
        fds.extend(
            entries
                .iter()
                .map(|e| PollFd::new(e.watch.as_fd(), PollFlags::POLLIN)),
        );
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            // Not expected (the fds are ours and open); do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
        // A hang-up (POLLHUP), or anything else that makes the end readable, ends the wait.
        let done: Vec<bool> = fds[1..]
            .iter()
            .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        // Drain the wake-ups (non-blocking: stops at WouldBlock).
        let mut bytes = [0u8; 64];
        while matches!((&woken).read(&mut bytes), Ok(n) if n > 0) {}
        let mut kept = Vec::with_capacity(entries.len());
        let mut finished = Vec::new();
        for (entry, done) in entries.drain(..).zip(done) {
            if done {
                finished.push(entry.key);
                // The value is dropped here, on this thread, before it is counted out: once
                // `wait_released` returns, the keeper holds nothing of it.
                drop(entry);
            } else {
                kept.push(entry);
            }
        }
        entries = kept;
        for key in finished {
            release(keeper, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Sets its flag when dropped.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_value_is_kept_until_every_write_end_is_closed() {
        // A key no buffer can have (buffers use the address of their shared state).
        let key = 1;
        let dropped = Arc::new(AtomicBool::new(false));
        let (reader, writer) = std::io::pipe().unwrap();
        let copy = writer.try_clone().unwrap();
        keep_until_closed(key, Box::new(Flag(dropped.clone())), reader.into()).unwrap();
        assert_eq!(pending(key), 1);
        let err = wait_released(key, Duration::from_millis(20)).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { what, .. } if what.starts_with("1 receiver(s) of a fabric buffer")),
            "{err:?}"
        );
        drop(writer);
        // One copy of the write end (a receiver's) is still open.
        assert!(wait_released(key, Duration::from_millis(20)).is_err());
        assert!(!dropped.load(Ordering::SeqCst));
        drop(copy);
        wait_released(key, Duration::from_secs(10)).unwrap();
        assert!(dropped.load(Ordering::SeqCst), "dropped before counted out");
        assert_eq!(pending(key), 0);
        // Nothing kept: returns at once, also with no limit.
        wait_released(key, Duration::MAX).unwrap();
    }
}
