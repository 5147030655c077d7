//! Closing fds a peer sent that nobody wants, off the caller's path.
//!
//! `close` of the last reference to a file runs that file's release, which a hostile peer
//! chooses: a FUSE file whose server never answers, or a TCP socket with `SO_LINGER` and unsent
//! data, blocks the closing thread for as long as its owner likes, past every timeout of the
//! receive that refused it. So the fds of a refused message (and the unwanted fds of a message
//! of the wrong kind, and whatever a refused client sent before it was turned away) are handed
//! to one background thread that closes them. A close that blocks there holds up only later
//! closes of refused fds, never a receive, an accept or a connect.

use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::sync::mpsc::{Sender, channel};

/// The closer thread's name (as `/proc/<pid>/task/<tid>/comm` shows it).
pub(crate) const THREAD_NAME: &str = "vmm-ipc-closer";

/// Close `fds` on the background closer thread (started on first use). Where no thread can be
/// started, they are closed here: an fd is never kept open.
pub(crate) fn close_later(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    static CLOSER: Mutex<Option<Sender<Vec<OwnedFd>>>> = Mutex::new(None);
    let mut closer = CLOSER.lock().unwrap_or_else(|e| e.into_inner());
    let fds = match closer.as_ref() {
        Some(tx) => match tx.send(fds) {
            Ok(()) => return,
            // The thread is gone (it never is, but a send hands the fds back if so).
            Err(returned) => returned.0,
        },
        None => fds,
    };
    let (tx, rx) = channel::<Vec<OwnedFd>>();
    let started = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(move || {
            for fds in rx {
                drop(fds);
            }
        });
    if started.is_err() {
        drop(fds);
        return;
    }
    // A send to a live receiver cannot fail; if it did, the fds come back and close here.
    if let Err(returned) = tx.send(fds) {
        drop(returned.0);
    }
    *closer = Some(tx);
}
