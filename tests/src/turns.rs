//! Turns between the tests of one test executable: `cargo test` (and `.gpu/run.sh`) run them on
//! threads of one process, so a test that counts this process's fds, kills its forkserver or
//! reconfigures its warm pool runs alone ([`exclusive`]), and the tests beside which it must not
//! run take a [`shared`] turn. Under nextest every test has a process of its own anyway.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The one lock of this process's turns (it guards no data, so a panic poisons nothing).
static TURNS: RwLock<()> = RwLock::new(());

/// A turn beside other shared turns, never beside an exclusive one.
pub fn shared() -> RwLockReadGuard<'static, ()> {
    TURNS.read().unwrap_or_else(|e| e.into_inner())
}

/// A turn alone: no other turn of this process runs meanwhile.
pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    TURNS.write().unwrap_or_else(|e| e.into_inner())
}
