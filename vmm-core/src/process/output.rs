//! A child's captured stdout and stderr, and how much of them the parent reads.
//!
//! The files are memfds that the child holds open for writing, so their size is the child's
//! to choose: one `ftruncate` makes a stream 1 TiB long without writing a byte (a sparse file
//! costs the child nothing). So the parent never reads a stream whole and never allocates the
//! size the file reports: it reads at most the [cap](output_cap) (1 MiB by default), from the
//! end, because the end is what holds a panic; the text it keeps begins with one line that
//! says how many bytes were cut. The cap holds for every child vmm-core starts (spawn,
//! forkserver, warm) and for each task of a [`Pool`](super::Pool), and its buffer is reserved
//! fallibly, so that even a cap the program raised past what memory allows is a note in the
//! text, not an abort. (A failed pool task's story joins two such reads, what the task printed
//! and what its worker printed while it was ended: at most twice the cap per stream. A
//! finished task keeps its output until it is joined, so what a program's unjoined tasks hold
//! is the cap times their number, which the program chooses.)

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

use crate::{Error, Result};

/// How many bytes of each captured stream (stdout, stderr) the parent keeps, from the end,
/// unless [`set_output_cap`] says otherwise: 1 MiB, enough for any panic and its backtrace
/// and the last screens of a log, small enough that a failing test's message stays readable
/// and a child cannot make its parent allocate much.
pub const DEFAULT_OUTPUT_CAP: u64 = 1 << 20;

/// The cap in force (see [`set_output_cap`]).
static CAP: AtomicU64 = AtomicU64::new(DEFAULT_OUTPUT_CAP);

/// How many bytes of each captured stream the parent keeps: the last [`output_cap`] bytes,
/// after a line that says how many were cut before them.
pub fn output_cap() -> u64 {
    CAP.load(Ordering::Relaxed)
}

/// Keep the last `bytes` bytes of each captured stream (stdout and stderr of every child and
/// every pool task this process starts from now on; default [`DEFAULT_OUTPUT_CAP`]). A child
/// chooses how long its streams are, so this is the most one child's output costs the parent
/// per stream; `0` keeps only the note of what was cut.
pub fn set_output_cap(bytes: u64) {
    CAP.store(bytes, Ordering::Relaxed);
}

/// A child's captured stdout and stderr: memfds, CLOEXEC, opened for appending (so that a pool
/// can empty them between tasks while the child keeps writing at their end).
#[derive(Debug)]
pub(crate) struct Output {
    stdout: OwnedFd,
    stderr: OwnedFd,
}

impl Output {
    /// Two new, empty output files.
    pub(crate) fn new() -> Result<Output> {
        Ok(Output {
            stdout: output_memfd(c"vmm-ipc-child-stdout")?,
            stderr: output_memfd(c"vmm-ipc-child-stderr")?,
        })
    }

    /// Duplicates of both, for the child's fds 1 and 2.
    pub(crate) fn child_ends(&self) -> Result<(OwnedFd, OwnedFd)> {
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| Error::io("dup", e));
        Ok((dup(&self.stdout)?, dup(&self.stderr)?))
    }

    /// Both, borrowed (to send them to the forkserver).
    pub(crate) fn fds(&self) -> [BorrowedFd<'_>; 2] {
        [self.stdout.as_fd(), self.stderr.as_fd()]
    }

    /// The last [`output_cap`] bytes written so far, left in place.
    pub(crate) fn read(&self) -> (String, String) {
        let cap = output_cap();
        (
            read_tail(&self.stdout, cap, false),
            read_tail(&self.stderr, cap, false),
        )
    }

    /// The last [`output_cap`] bytes written since the last `take`, and empty the files for
    /// what comes next.
    pub(crate) fn take(&self) -> (String, String) {
        let cap = output_cap();
        (
            read_tail(&self.stdout, cap, true),
            read_tail(&self.stderr, cap, true),
        )
    }
}

fn output_memfd(name: &std::ffi::CStr) -> Result<OwnedFd> {
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC)
        .map_err(|e| Error::errno("memfd_create(child output)", e))?;
    // The status flags belong to the open file, which the child's stdout (a dup) shares.
    fcntl(&fd, FcntlArg::F_SETFL(OFlag::O_APPEND))
        .map_err(|e| Error::errno("fcntl(F_SETFL, O_APPEND) on child output", e))?;
    Ok(fd)
}

/// The text of an output file's last `cap` bytes (lossy UTF-8; a hole at their start
/// skipped), after a line that says how many bytes before them were cut, if any; with
/// `truncate`, empty the file afterwards.
///
/// The file's size is read once, and at most `cap` bytes are read from `size - cap`: a child
/// that keeps writing (a pool worker's stray thread) or grows the file meanwhile adds nothing,
/// and one that shrinks it ends the read early.
pub(crate) fn read_tail(fd: &OwnedFd, cap: u64, truncate: bool) -> String {
    // Most children print nothing: one fstat, no read.
    let size = match nix::sys::stat::fstat(fd) {
        Ok(st) => u64::try_from(st.st_size).unwrap_or(0),
        Err(e) => return format!("(captured output unreadable: fstat failed: {e})"),
    };
    if size == 0 {
        return String::new();
    }
    let Ok(file) = fd.try_clone().map(File::from) else {
        return "(captured output unreadable: dup failed)".to_owned();
    };
    let start = past_hole(fd, size.saturating_sub(cap), size);
    // At most `cap`, which the parent chose; never the size the child chose.
    let want = usize::try_from(size - start).unwrap_or(usize::MAX);
    let mut kept = Vec::new();
    if kept.try_reserve_exact(want).is_err() {
        if truncate {
            let _ = file.set_len(0);
        }
        return format!(
            "(captured output not read: {size} bytes, and {want} bytes for its tail could not \
             be allocated)"
        );
    }
    read_at_most(&file, start, want, &mut kept);
    if truncate {
        let _ = file.set_len(0);
    }
    // A cut may fall inside a character: drop its continuation bytes with the rest of the cut.
    let mut cut = start;
    if start > 0 {
        let partial = kept
            .iter()
            .take(3)
            .take_while(|&&b| b & 0xC0 == 0x80)
            .count();
        kept.drain(..partial);
        cut += partial as u64;
    }
    let read = kept.len();
    let text = match String::from_utf8(kept) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    };
    if cut == 0 {
        return text;
    }
    format!(
        "[vmm-ipc: {cut} bytes cut; the last {read} bytes follow (output cap {cap} bytes)]\n{text}"
    )
}

/// The first offset from `start` (at most `size`) where `fd` holds data: a hole (what an
/// `ftruncate` added and nothing wrote) reads as zeros that say nothing, so a tail that begins
/// in one is kept from its end. `start` where that cannot be told. (`lseek` moves the offset
/// the child's stream shares, which no one uses: the stream is `O_APPEND`, reads are `pread`.)
fn past_hole(fd: &OwnedFd, start: u64, size: u64) -> u64 {
    let Ok(offset) = libc::off_t::try_from(start) else {
        return start;
    };
    match nix::unistd::lseek(fd, offset, nix::unistd::Whence::SeekData) {
        Ok(data) => u64::try_from(data).map_or(start, |data| data.clamp(start, size)),
        // Nothing but hole from `start` to the end.
        Err(nix::errno::Errno::ENXIO) => size,
        Err(_) => start,
    }
}

/// Append to `out` what `file` holds from `offset`, at most `len` bytes (less at its end, or
/// if a read fails), without growing `out` past its reserved capacity.
fn read_at_most(file: &File, mut offset: u64, len: usize, out: &mut Vec<u8>) {
    let mut chunk = [0u8; 64 * 1024];
    let end = out.len() + len;
    while out.len() < end {
        let room = (end - out.len()).min(chunk.len());
        match file.read_at(&mut chunk[..room], offset) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&chunk[..n]);
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(bytes: &[u8]) -> OwnedFd {
        let fd = output_memfd(c"test").unwrap();
        File::from(fd.try_clone().unwrap())
            .write_all_at(bytes, 0)
            .unwrap();
        fd
    }

    #[test]
    fn short_output_is_kept_whole_and_taking_empties_the_file() {
        let fd = file_with(b"hello\n");
        assert_eq!(read_tail(&fd, 1 << 20, false), "hello\n");
        assert_eq!(read_tail(&fd, 6, true), "hello\n");
        assert_eq!(read_tail(&fd, 6, false), "");
    }

    #[test]
    fn long_output_keeps_its_tail_and_says_what_was_cut() {
        let fd = file_with(b"0123456789");
        assert_eq!(
            read_tail(&fd, 4, false),
            "[vmm-ipc: 6 bytes cut; the last 4 bytes follow (output cap 4 bytes)]\n6789"
        );
        assert_eq!(
            read_tail(&fd, 0, false),
            "[vmm-ipc: 10 bytes cut; the last 0 bytes follow (output cap 0 bytes)]\n"
        );
    }

    #[test]
    fn a_cut_inside_a_character_drops_the_rest_of_it() {
        // "é" is two bytes: a cap of 2 on "aé!" starts inside it.
        let fd = file_with("aé!".as_bytes());
        assert_eq!(
            read_tail(&fd, 2, false),
            "[vmm-ipc: 3 bytes cut; the last 1 bytes follow (output cap 2 bytes)]\n!"
        );
    }

    #[test]
    fn a_sparse_terabyte_costs_one_cap_and_its_hole_is_skipped() {
        let fd = file_with(b"");
        let file = File::from(fd.try_clone().unwrap());
        file.set_len(1 << 40).unwrap();
        let text = read_tail(&fd, 4096, false);
        assert_eq!(
            text,
            format!(
                "[vmm-ipc: {} bytes cut; the last 0 bytes follow (output cap 4096 bytes)]\n",
                1u64 << 40
            )
        );
        file.write_all_at(b"last words", 1 << 40).unwrap();
        let text = read_tail(&fd, 4096, true);
        assert_eq!(
            text,
            format!(
                "[vmm-ipc: {} bytes cut; the last 10 bytes follow (output cap 4096 bytes)]\nlast words",
                1u64 << 40
            )
        );
        assert_eq!(nix::sys::stat::fstat(&fd).unwrap().st_size, 0);
    }

    #[test]
    fn written_zeros_are_kept() {
        let fd = file_with(&[0, 0, b'a']);
        assert_eq!(read_tail(&fd, 2, false).as_bytes().last(), Some(&b'a'));
        assert!(read_tail(&fd, 2, false).ends_with("\n\0a"));
    }
}
