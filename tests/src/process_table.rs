//! Where a process stands in the process table, read from `/proc`, for the tests that prove a
//! child was killed and reaped (`process_faults`, `warm`, `pool`).

use std::time::{Duration, Instant};

/// `/proc/<pid>/stat`'s state letter, or `None` once the pid is gone.
pub fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Wait up to `limit` for `pid` to leave the process table (or, with `zombie_ok`, to be a
/// zombie: dead, its reaping left to its parent); whether it did.
pub fn gone_within(pid: u32, limit: Duration, zombie_ok: bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        match state(pid) {
            None => return true,
            Some('Z') if zombie_ok => return true,
            Some(_) if Instant::now() >= deadline => return false,
            Some(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// The pids of `parent`'s children, from every `/proc/<pid>/stat` (zombies included): for the
/// tests that count how many processes something started.
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // After the command name: state, then the parent's pid.
            stat.rsplit_once(')')
                .and_then(|(_, fields)| fields.split_ascii_whitespace().nth(1)?.parse().ok())
                == Some(parent)
        })
        .collect()
}
