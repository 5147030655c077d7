//! Requirement checks for `skip_unless`: they never panic, and their error is the reason.

/// The forkserver can be started (and is, afterwards).
pub fn forkserver_available() -> Result<(), String> {
    crate::process::ensure_running()
        .map(drop)
        .map_err(|e| e.to_string())
}
