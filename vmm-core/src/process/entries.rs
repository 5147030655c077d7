//! The entry points this executable registered: the only code a child (or a pool worker) runs
//! on its parent's word.
//!
//! A parent names the function a child runs by its offset in the executable, and the child
//! turns the offset back into an address. An offset is a number on a socket, so a child never
//! calls it directly: it calls it only if it is one of the entry points in a table that the
//! linker built from this executable's own code, and refuses anything else (a forged offset,
//! `std::process::abort`'s, a wild one) without calling it.
//!
//! Each entry point is a trampoline monomorphised for one user function, argument and result
//! type (`remote::trampoline::<F, A, R>`). The function `F` is a zero-sized type (a `fn` item
//! or a closure that captures nothing), so the trampoline itself names the function: there is
//! no second, unchecked address. Instantiating `Context::spawn` or `Pool::submit` for an `F`
//! places the trampoline's address in a linker section (`vmm_ipc_entries`, `SHF_GNU_RETAIN` so
//! that no `--gc-sections` drops it); the linker gathers every such address of the executable between
//! `__start_<section>` and `__stop_<section>`. The table is data of the executable, relocated
//! by the loader before any code runs, and nothing at run time adds to it.

use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use super::sys;
use crate::error::ProtocolRule;
use crate::{Error, Result};

/// An entry point: receive the argument (postcard bytes and its fds), run the function it was
/// registered for, serialise its result. `Err` when the argument could not be received;
/// `Ok(Err)` when the result could not be serialised; else the result's bytes and its fds
/// (owned copies). A single-use child's function returns `()`, whose bytes are empty.
pub(crate) type Entry =
    fn(args: &[u8], fds: Vec<OwnedFd>) -> Result<Result<(Vec<u8>, Vec<OwnedFd>)>>;

/// Place the address of the function `$entry` (a path, with its generic arguments) in the
/// entry table's linker section. Expands to a statement; the code it emits does nothing at run
/// time.
///
/// Only functions of type [`Entry`] may be placed there: [`find`] calls what it finds there as
/// that type.
macro_rules! register_entry {
    ($entry:path) => {
        // SAFETY: the assembly only emits data into another section (an address the loader
        // relocates); it runs no instruction, touches no register, memory or stack.
        unsafe {
            ::std::arch::asm!(
                ".pushsection vmm_ipc_entries,\"awR\",%progbits",
                ".balign 8",
                ".8byte {entry}",
                ".popsection",
                entry = sym $entry,
                options(nomem, nostack, preserves_flags)
            )
        }
    };
}
pub(crate) use register_entry;

/// The entry table's section.
pub(crate) const SECTION: &str = "vmm_ipc_entries";

// The bounds the linker defines for the section (a section with a C-identifier name).
unsafe extern "C" {
    #[link_name = "__start_vmm_ipc_entries"]
    static START: [usize; 0];
    #[link_name = "__stop_vmm_ipc_entries"]
    static STOP: [usize; 0];
}

/// The entry table: every address in the section, sorted (a zero anchors the section, so that
/// it exists in an executable that starts no child; it is left out). Built once.
fn table() -> &'static [usize] {
    static TABLE: OnceLock<Vec<usize>> = OnceLock::new();
    TABLE.get_or_init(|| {
        // The anchor lives here, with the code that reads the section, so that whatever links
        // this code also links a section for `__start_`/`__stop_` to bound.
        // SAFETY: emits one zero word into the section; runs nothing.
        unsafe {
            std::arch::asm!(
                ".pushsection vmm_ipc_entries,\"awR\",%progbits",
                ".balign 8",
                ".8byte 0",
                ".popsection",
                options(nomem, nostack, preserves_flags)
            )
        };
        // SAFETY: the linker defines both symbols as the bounds of the section, which holds
        // only 8-byte-aligned words (every entry and the anchor are `.balign 8` + `.8byte`),
        // and the section is data of this executable for the life of the process.
        unsafe { sorted_words(&raw const START, &raw const STOP) }
    })
}

/// The non-zero words from `start` to `stop`, sorted and deduplicated (an entry instantiated
/// in several places is registered once per place).
///
/// # Safety
/// `start..stop` must be a readable, 8-byte-aligned range of `usize` words that lives (and is
/// not written) for the rest of the process.
unsafe fn sorted_words(start: *const [usize; 0], stop: *const [usize; 0]) -> Vec<usize> {
    let start = start.cast::<usize>();
    let stop = stop.cast::<usize>();
    // SAFETY: both bound the same section (the caller's contract), `stop` not before `start`.
    let len = usize::try_from(unsafe { stop.offset_from(start) }).unwrap_or(0);
    // SAFETY: the caller guarantees `len` readable, aligned words from `start` that live on.
    let words = unsafe { std::slice::from_raw_parts(start, len) };
    let mut table: Vec<usize> = words.iter().copied().filter(|&w| w != 0).collect();
    table.sort_unstable();
    table.dedup();
    table
}

/// The address here of the code at `offset` (from [`sys::code_base`]), once the executable's
/// layout is found to match the parent's (`layout`: the parent's offset of
/// [`sys::layout_probe`]).
fn address(layout: isize, offset: isize) -> Result<usize> {
    let here = sys::code_offset(sys::layout_probe as fn() -> usize as usize);
    if here != layout {
        return Err(Error::protocol(
            ProtocolRule::Entry,
            format!(
                "the child runs a different executable image than its parent (layout {here} vs \
             {layout}); was the binary rebuilt while the test ran?"
            ),
        ));
    }
    Ok((sys::code_base as fn() -> usize as usize).wrapping_add(offset as usize))
}

/// The entry point at `offset`, if this executable registered one there.
pub(crate) fn find(layout: isize, offset: isize) -> Result<Entry> {
    let address = address(layout, offset)?;
    if table().binary_search(&address).is_err() {
        return Err(Error::protocol(
            ProtocolRule::Entry,
            format!(
                "the parent asked for an entry at offset {offset:#x}, which is not an entry point \
             this executable registered (section {SECTION}); refused without calling it"
            ),
        ));
    }
    // SAFETY: `address` is in the entry table, into which only `register_entry!` writes, and
    // only `remote::registered` uses that macro, with an `Entry` (see there). A function
    // pointer and a code address are the same size.
    Ok(unsafe { std::mem::transmute::<usize, Entry>(address) })
}

/// The one value of the zero-sized function type `F`, made from nothing.
///
/// Fails to compile (when instantiated) for an `F` that is not zero-sized: a function pointer
/// or a closure that captures something cannot be named by its type alone.
///
/// # Safety
/// A value of `F` must have existed in some process running this executable (so `F` is
/// inhabited), and `F` is `Copy`: all values of a zero-sized `Copy` type are the same, and
/// copying one is allowed.
pub(crate) unsafe fn conjure<F: Copy>() -> F {
    const {
        assert!(
            size_of::<F>() == 0,
            "the function a child or a pool task runs must be a fn item or a closure that \
             captures nothing (not a fn pointer): the child finds it by its type alone"
        )
    };
    // SAFETY: `F` is zero-sized (checked at compile time), so reading one from a dangling but
    // aligned pointer reads no memory, and it is inhabited and `Copy` (the caller's contract),
    // so the value read is a copy of the one that existed.
    unsafe { std::ptr::NonNull::<F>::dangling().as_ptr().read() }
}

#[cfg(test)]
mod tests {
    //! A hostile parent, from outside: this test executable is started as a child (our
    //! socketpair, `VMM_IPC_CHILD` set by hand, `std::process::Command`), and we send it start
    //! messages whose entry offsets point at code it never registered.

    use std::os::fd::AsRawFd;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use super::super::StartMethod;
    use super::super::child_runtime::EXIT_NOT_RUN;
    use super::super::ends::{ParentEnd, TaskSender};
    use super::super::protocol::{Call, Order, Payload, ROLE_VAR, Report, Role, Start};
    use super::super::status::{NotRunStage, Outcome};
    use super::super::{remote, sys};
    use super::*;
    use crate::wire;

    const WAIT: Duration = Duration::from_secs(30);

    /// Not registered, but with exactly an entry point's type: it must never run either.
    fn lookalike(_: &[u8], _: Vec<OwnedFd>) -> Result<Result<(Vec<u8>, Vec<OwnedFd>)>> {
        std::process::exit(77)
    }

    /// Start this executable by hand as a `spawn` child on a socketpair of ours (its role
    /// variable set, its end inherited): our end and the child.
    fn start_child() -> (ParentEnd, std::process::Child) {
        let (ours, theirs) = ParentEnd::pair().unwrap();
        let theirs = theirs.into_fd();
        let raw = theirs.as_raw_fd();
        let mut command = Command::new("/proc/self/exe");
        command
            .args(["--exact", "no-such-test"])
            .env(ROLE_VAR, Role::Spawn.encode(raw, std::process::id()))
            .env_remove("VMM_IPC_NO_AUTO_INIT")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: the closure only calls fcntl (async-signal-safe) on an fd open in the child.
        unsafe {
            command.pre_exec(move || {
                if libc::fcntl(raw, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap();
        drop(theirs);
        (ours, child)
    }

    /// Start this executable as a `spawn` child on our socketpair, send it a start message
    /// for `entry` (an offset) with `args`, and return what it reported and how it exited.
    fn run_forged(entry: isize, args: &[u8]) -> (Outcome, std::process::ExitStatus) {
        let (ours, mut child) = start_child();
        let start = Order::Once(Start {
            call: Call {
                layout: sys::code_offset(sys::layout_probe as fn() -> usize as usize),
                entry,
                args: Payload(args.to_vec()),
            },
            method: StartMethod::Spawn,
        });
        ours.send(&start).unwrap();
        assert!(matches!(
            ours.recv(Some(WAIT)).unwrap().message,
            Report::Started
        ));
        let Report::Finished(outcome) = ours.recv(Some(WAIT)).unwrap().message else {
            panic!("the child did not report how it finished");
        };
        (outcome, child.wait().unwrap())
    }

    #[track_caller]
    fn assert_refused(entry: isize) {
        let args = wire::encode(&7u32).unwrap();
        let (outcome, status) = run_forged(entry, args.bytes());
        match outcome {
            Outcome::NotRun {
                stage: NotRunStage::Entry,
                error,
            } => assert!(
                error
                    .to_string()
                    .contains("not an entry point this executable registered"),
                "{error}"
            ),
            other => panic!("a forged entry ran or failed otherwise: {other:?}"),
        }
        assert_eq!(
            status.signal(),
            None,
            "the child died of a signal: {status:?}"
        );
        assert_eq!(status.code(), Some(EXIT_NOT_RUN), "{status:?}");
    }

    #[test]
    fn an_entry_offset_at_abort_is_refused_without_a_signal() {
        assert_refused(sys::code_offset(std::process::abort as fn() -> ! as usize));
    }

    #[test]
    fn a_wild_entry_offset_is_refused_without_a_signal() {
        assert_refused(0x7ead_beef);
        assert_refused(isize::MIN);
        assert_refused(-1);
    }

    #[test]
    fn an_unregistered_function_of_the_entry_type_is_refused() {
        assert_refused(sys::code_offset(lookalike as Entry as usize));
    }

    #[test]
    fn a_registered_entry_runs_positive_control() {
        fn seven(n: u32) {
            if n != 7 {
                std::process::exit(78);
            }
        }
        let registered = remote::registered::<_, u32, ()>(seven);
        let args = wire::encode(&7u32).unwrap();
        let (outcome, status) = run_forged(sys::code_offset(registered as usize), args.bytes());
        assert!(
            matches!(&outcome, Outcome::Returned(p) if p.is_empty()),
            "{outcome:?}"
        );
        assert_eq!(status.code(), Some(0), "{status:?}");
    }

    #[test]
    fn a_forged_task_entry_is_refused_and_the_worker_serves_on() {
        use super::super::protocol::Serve;
        use std::os::fd::AsFd;

        let (ours, mut child) = start_child();
        let (tasks, worker_end) = TaskSender::pair().unwrap();
        let serve = Order::Serve(Serve { devices: vec![] });
        ours.send_with(&serve, &[worker_end.as_fd()], None).unwrap();
        drop(worker_end);
        assert!(matches!(
            ours.recv(Some(WAIT)).unwrap().message,
            Report::Serving
        ));
        let layout = sys::code_offset(sys::layout_probe as fn() -> usize as usize);
        let args = wire::encode(&7u32).unwrap().bytes().to_vec();
        for entry in [
            sys::code_offset(std::process::abort as fn() -> ! as usize),
            0x7ead_beef,
        ] {
            let task = Call {
                layout,
                entry,
                args: Payload(args.clone()),
            };
            tasks.send(&task).unwrap();
            match ours.recv(Some(WAIT)).unwrap().message {
                Report::Finished(Outcome::NotRun {
                    stage: NotRunStage::Entry,
                    ..
                }) => {}
                other => panic!("a forged task entry ran or failed otherwise: {other:?}"),
            }
        }
        drop(tasks);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{status:?}");
    }

    #[test]
    fn the_table_holds_registered_entries_and_no_zero() {
        fn registered_here(_: ()) {}
        let entry = remote::registered::<_, (), ()>(registered_here) as usize;
        assert!(table().binary_search(&entry).is_ok());
        assert!(!table().contains(&0));
    }
}
