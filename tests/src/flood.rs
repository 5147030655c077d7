//! Children that flood their captured stdout and stderr, and what their parent must have paid
//! for it (`process_faults` for `Process` under every start method, `pool` for tasks).
//!
//! A child's output files are memfds it holds open for writing, so it chooses their size: one
//! `ftruncate` makes them a terabyte without writing a byte. The parent must keep only the
//! tail (where the panic is), say how much it cut, and never allocate what the file's size
//! says. The parent here is held to that by the kernel: its address space is limited
//! (`RLIMIT_AS`) to what it has mapped plus [`HEADROOM`], far below a terabyte, so a parent
//! that reads a flooded stream whole aborts on a failed allocation; and its peak resident
//! memory (`VmHWM`) may rise by at most [`PEAK_RISE`] while it reads.

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use serde::{Deserialize, Serialize};

/// The size a [`Flood::Sparse`] child truncates its streams to.
pub const TERABYTE: u64 = 1 << 40;

/// How much a [`Flood::Written`] child writes to each stream.
pub const WRITTEN: usize = 4 << 20;

/// What a flooding child writes to stderr last, before it panics or returns.
pub const LAST_WORDS: &str = "last words after the flood";

/// A flooding child's panic message.
pub const PANIC: &str = "panicked after flooding its output";

/// What a flooding child that does not panic returns.
pub const RETURNED: u32 = 7;

/// Address space a parent under attack may map beyond what it has mapped when the limit is
/// set: room for its own threads and for reading the capped output, a tiny fraction of a
/// flood.
pub const HEADROOM: u64 = 512 << 20;

/// How far the parent's peak resident memory may rise while it reads flooded output: a few
/// caps' worth (1 MiB each by default), far below the 4 MiB written and the terabyte truncated.
pub const PEAK_RISE: u64 = 64 << 20;

/// How a child floods its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Flood {
    /// `ftruncate` stdout and stderr to [`TERABYTE`] (a sparse file: it costs the child
    /// nothing), then write [`LAST_WORDS`] at its end.
    Sparse,
    /// Write [`WRITTEN`] bytes to each stream, then [`LAST_WORDS`].
    Written,
}

impl Flood {
    /// The fewest bytes each stream holds afterwards.
    pub fn size(self) -> u64 {
        match self {
            Flood::Sparse => TERABYTE,
            Flood::Written => WRITTEN as u64,
        }
    }
}

/// The child: [`flood_task`], then panic.
pub fn flood_and_panic(flood: Flood) {
    flood_task((flood, true));
}

/// The pool task (and the child's body): flood stdout and stderr as `flood` says, write
/// [`LAST_WORDS`] to stderr, then panic with [`PANIC`] if `panic`, else return [`RETURNED`].
pub fn flood_task((flood, panic): (Flood, bool)) -> u32 {
    use std::io::Write;
    use std::os::fd::AsFd;
    match flood {
        Flood::Sparse => {
            let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
            for fd in [stdout.as_fd(), stderr.as_fd()] {
                nix::unistd::ftruncate(fd, TERABYTE as i64).expect("ftruncate a captured stream");
            }
        }
        Flood::Written => {
            let line = [b'x'; 1023];
            for _ in 0..WRITTEN / 1024 {
                let mut out = std::io::stdout().lock();
                out.write_all(&line).unwrap();
                out.write_all(b"\n").unwrap();
                let mut err = std::io::stderr().lock();
                err.write_all(&line).unwrap();
                err.write_all(b"\n").unwrap();
            }
        }
    }
    std::io::stdout().flush().unwrap();
    eprintln!("{LAST_WORDS}");
    if panic {
        panic!("{PANIC}");
    }
    RETURNED
}

/// A field of `/proc/self/status` that counts memory (`VmSize`, `VmRSS`, `VmHWM`), in bytes.
pub fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().unwrap();
    kib << 10
}

/// This process's memory, watched while it reads a flooding child's output.
#[derive(Debug)]
pub struct MemoryWatch {
    rss_before: u64,
}

impl MemoryWatch {
    /// Limit this process's address space to what it maps now plus [`HEADROOM`] (for good:
    /// call it in a process of its own), and start watching its peak resident memory (reset
    /// to what is resident now, by `/proc/self/clear_refs`).
    pub fn limit_and_start() -> MemoryWatch {
        let (_, hard) = getrlimit(Resource::RLIMIT_AS).unwrap();
        let limit = status_bytes("VmSize") + HEADROOM;
        setrlimit(Resource::RLIMIT_AS, limit.min(hard), hard).unwrap();
        std::fs::write("/proc/self/clear_refs", "5").expect("reset VmHWM");
        MemoryWatch {
            rss_before: status_bytes("VmRSS"),
        }
    }

    /// The peak resident memory rose by at most [`PEAK_RISE`] since the start.
    pub fn assert_peak_stayed_low(&self, what: &str) {
        let rise = status_bytes("VmHWM").saturating_sub(self.rss_before);
        assert!(
            rise <= PEAK_RISE,
            "{what}: the parent's peak resident memory rose by {rise} bytes (at most {PEAK_RISE})"
        );
    }
}

/// How many bytes the parent's note at the head of `text` says it cut, if it cut any.
pub fn bytes_cut(text: &str) -> Option<u64> {
    let rest = text.strip_prefix("[vmm-ipc: ")?;
    rest.split_once(" bytes cut")?.0.parse().ok()
}

/// A stream of a child that flooded it as `flood` says, as its parent kept it: the tail (with
/// `last`, written after the flood, in it), at most the cap, and a note that says at least the rest was cut.
pub fn assert_tail_kept(name: &str, text: &str, flood: Flood, last: Option<&str>) {
    let cap = vmm_core::process::output_cap();
    let head: String = text.chars().take(200).collect();
    assert!(
        text.len() as u64 <= cap + 200,
        "{name}: {} bytes kept, more than the cap of {cap} and a note; it starts {head:?}",
        text.len()
    );
    let cut = bytes_cut(text).unwrap_or_else(|| panic!("{name}: no note of a cut: {head:?}"));
    assert!(
        cut >= flood.size() - cap,
        "{name}: {cut} bytes cut of at least {}",
        flood.size()
    );
    if let Some(last) = last {
        // Written after the flood, so in the tail the parent kept (the head was cut).
        let tail: String = text
            .chars()
            .rev()
            .take(300)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        assert!(
            text.contains(last),
            "{name}: {last:?} is not in what was kept, which ends {tail:?}"
        );
    }
}
