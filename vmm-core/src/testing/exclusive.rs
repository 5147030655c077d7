//! `thread_unsafe`: one such test at a time, with no other `#[ipc_test]` beside it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static TURNS: RwLock<()> = RwLock::new(());
static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// Held while an `#[ipc_test]` body runs.
#[derive(Debug)]
pub(crate) enum Turn {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Exclusive(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

/// Wait for this test's turn: exclusive for a `thread_unsafe` test, shared otherwise.
pub(crate) fn take_turn(exclusive: bool) -> Turn {
    // A panicking test poisons nothing that matters here: the lock guards no data.
    let turn = if exclusive {
        Turn::Exclusive(TURNS.write().unwrap_or_else(|e| e.into_inner()))
    } else {
        Turn::Shared(TURNS.read().unwrap_or_else(|e| e.into_inner()))
    };
    RUNNING.fetch_add(1, Ordering::SeqCst);
    turn
}

impl Drop for Turn {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How many `#[ipc_test]` bodies are running in this process right now (the caller's included).
///
/// A `thread_unsafe` test always sees 1.
pub fn running_ipc_tests() -> usize {
    RUNNING.load(Ordering::SeqCst)
}
