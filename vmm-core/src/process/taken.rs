//! How many tasks a pool worker has taken off its channel: a counter in a page of shared memory
//! (a sealed memfd) that the worker bumps before it runs each task and the pool reads when the
//! worker dies.
//!
//! A worker that dies with a task sent but not counted never ran any of it (the count goes up
//! before the task's argument is even decoded), so the pool can hand that task to another
//! worker instead of failing it; a counted one may have run, and fails. This matters because a
//! worker killed while idle can look alive for a while: its pidfd turns readable and its
//! channel hangs up only once its teardown ends, which for a process holding a CUDA context
//! takes hundreds of milliseconds. The counter costs the task path nothing but one store: no
//! message, no wake-up of the parent.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::shm::{HostBuffer, HostDescriptor};
use crate::{Error, Result};

/// One worker's count of tasks taken. Both sides map the same 8 bytes.
#[derive(Debug, Clone)]
pub(crate) struct TakenCount {
    /// 8 bytes, page-aligned (a mapping's start), accessed only as one `AtomicU64`.
    memory: HostBuffer,
}

impl TakenCount {
    /// A fresh count of zero (the pool's side).
    pub(crate) fn new() -> Result<TakenCount> {
        Ok(TakenCount {
            memory: HostBuffer::new(size_of::<u64>())?,
        })
    }

    /// A fresh fd for the worker (sent with its `Serve`).
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        self.memory
            .export()?
            .fd
            .ok_or_else(|| Error::Protocol("a task count's memory has no fd to send".to_owned()))
    }

    /// The worker's side: map the memfd that came with its `Serve`. Refused (as any host import
    /// is) unless it is a memfd sealed against resizing that holds 8 bytes.
    pub(crate) fn import(fd: &OwnedFd) -> Result<TakenCount> {
        let descriptor = HostDescriptor::from_fd(fd.as_fd(), size_of::<u64>())?;
        Ok(TakenCount {
            memory: HostBuffer::import(&descriptor)?,
        })
    }

    fn counter(&self) -> &AtomicU64 {
        let ptr = self.memory.as_ptr() as *mut u64;
        // SAFETY: `memory` is a live shared mapping of exactly 8 bytes that starts a page, so
        // `ptr` is valid and aligned for a u64 for as long as `self` (which keeps the mapping)
        // lives. Every access to these bytes, in this process and the other, is through this
        // one `AtomicU64` (`HostBuffer`'s own copies never touch a count's memory), so no
        // non-atomic access races with it.
        unsafe { AtomicU64::from_ptr(ptr) }
    }

    /// How many tasks the worker has taken.
    pub(crate) fn get(&self) -> u64 {
        self.counter().load(Ordering::Acquire)
    }

    /// Count one more task taken (the worker, before it runs the task).
    pub(crate) fn bump(&self) {
        self.counter().fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_shared_through_its_fd() {
        let pool_side = TakenCount::new().unwrap();
        let fd = pool_side.export().unwrap();
        let worker_side = TakenCount::import(&fd).unwrap();
        drop(fd);
        assert_eq!(pool_side.get(), 0);
        worker_side.bump();
        worker_side.bump();
        assert_eq!(pool_side.get(), 2);
    }

    #[test]
    fn a_memfd_too_small_or_unsealed_is_refused() {
        let fd = nix::sys::memfd::memfd_create(c"not-a-count", nix::sys::memfd::MFdFlags::empty())
            .unwrap();
        nix::unistd::ftruncate(&fd, 8).unwrap();
        assert!(matches!(
            TakenCount::import(&fd),
            Err(Error::InvalidArgument(_))
        ));
    }
}
