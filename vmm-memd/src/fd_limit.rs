//! The `vmm-memd` program and its keeper raise their soft `RLIMIT_NOFILE` to the hard one at
//! start (common practice for a server that uses no `select`): the service holds one fd per
//! chunk, per connection and per peer pidfd, and its caps on descriptor fds in flight are
//! derived from the soft limit (half of it in all, a quarter of that per uid: vmm-core's
//! `FdBudget`), as is the kernel's limit on them. Where the hard limit is 1024 too (the usual
//! soft limit), that is 512 in all and 128 per uid; a hard limit below 512 leaves a uid a
//! share smaller than a region's largest reply (`MAX_CHUNKS` descriptors), and such a reply is
//! refused (`FdsInFlight` with scope `Uid`).

/// Raise the soft `RLIMIT_NOFILE` to the hard one (nothing when it cannot be read or set).
pub(crate) fn raise() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a live local.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
