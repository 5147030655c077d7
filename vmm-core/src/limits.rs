//! What the kernel lets this process hold: open fds against `RLIMIT_NOFILE`.
//!
//! Below every other module, errors included (they use it to say which limit was hit), so it
//! knows nothing of errors, channels, buffers or tests.

use nix::sys::resource::{Resource, getrlimit};

/// The number of open fds of this process: entries of `/proc/self/fd`, not counting the one
/// the listing itself holds open. `None` when the listing cannot be opened (at the fd limit, for
/// one).
pub(crate) fn open_fds() -> std::io::Result<usize> {
    let entries = std::fs::read_dir("/proc/self/fd")?;
    // The directory stream's own fd is listed too.
    Ok(entries.count().saturating_sub(1))
}

/// The soft `RLIMIT_NOFILE`.
pub(crate) fn nofile_soft_limit() -> u64 {
    getrlimit(Resource::RLIMIT_NOFILE).map_or(u64::MAX, |(soft, _)| soft)
}
