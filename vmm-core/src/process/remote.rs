//! A remote call: a registered function, run in a child on an argument's bytes and fds, and
//! how it ended (an [`Outcome`]). One path for both kinds of child: a single-use child runs one call
//! (`Context::spawn`: an `F: Fn(A)`, whose `()` result is empty), a pool worker one per task
//! (`Pool::submit`: an `F: Fn(A) -> R`).
//!
//! The parent side names the function by its entry point ([`registered`]) and makes the
//! [`Call`] (checking first that the code lies where a child can find it); the child side
//! looks the entry point up in its own entry table (`entries::find`) and [`run`]s it.

use std::os::fd::OwnedFd;
use std::panic::{self, AssertUnwindSafe};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::child_runtime;
use super::entries::{self, Entry, register_entry};
use super::protocol::{Call, Outcome, Payload};
use super::status::NotRunStage;
use super::sys;
use crate::Result;
use crate::wire;

/// The entry point for `F` (a `fn(A) -> R` item or a closure that captures nothing), placed in
/// this executable's entry table: what a [`Call`] names, by its offset.
///
/// Taking an `F` proves that the type is inhabited, which [`trampoline`] relies on.
#[inline(always)]
pub(crate) fn registered<F, A, R>(_f: F) -> Entry
where
    F: Fn(A) -> R + Copy,
    A: DeserializeOwned,
    R: Serialize,
{
    register_entry!(trampoline::<F, A, R>);
    trampoline::<F, A, R>
}

/// What a child runs for `F`: receive the argument, call `F`, serialise the result (and drop
/// it). `Err`: the argument could not be received (the error its deserialisation raised, an
/// import's [`Error::InvalidDescriptor`](crate::Error::InvalidDescriptor) say, as that variant); `Ok(Err)`: the result could not
/// be serialised. Reached only through the entry table, for an `F` that [`registered`] was
/// given a value of.
fn trampoline<F, A, R>(args: &[u8], fds: Vec<OwnedFd>) -> Result<Result<(Vec<u8>, Vec<OwnedFd>)>>
where
    F: Fn(A) -> R + Copy,
    A: DeserializeOwned,
    R: Serialize,
{
    let arg: A = wire::decode(args, fds)?;
    // SAFETY: this function is only named by `registered::<F, A, R>`, which was given a value
    // of `F` (a `Copy` type) in a process running this executable, so `F` is inhabited.
    let f: F = unsafe { entries::conjure::<F>() };
    let result: R = f(arg);
    Ok(wire::encode(&result).and_then(|encoded| encoded.into_owned()))
}

impl Call {
    /// A call of `entry` (from [`registered`]; `what` names it in errors), its argument still
    /// empty (see [`with_args`](Self::with_args)).
    ///
    /// A child finds the entry point by its offset from `sys::code_base` in its own copy of the
    /// executable, so both must lie in the main executable's code: otherwise
    /// [`Error::SpawnRefused`](crate::Error::SpawnRefused), before anything is started or sent.
    pub(crate) fn to(entry: Entry, what: &str) -> Result<Call> {
        sys::check_main_text(
            sys::code_base as fn() -> usize as usize,
            "vmm-core's code (is vmm-core linked as a shared library?)",
        )?;
        sys::check_main_text(entry as usize, what)?;
        Ok(Call {
            layout: sys::code_offset(sys::layout_probe as fn() -> usize as usize),
            entry: sys::code_offset(entry as usize),
            args: Payload::default(),
        })
    }

    /// The call with `args` (postcard bytes; the fds travel beside the message) as its argument.
    pub(crate) fn with_args(self, args: Vec<u8>) -> Call {
        Call {
            args: Payload(args),
            ..self
        }
    }
}

/// Run `call` (its argument's fds are `fds`), if its entry point is one this executable
/// registered: a forged offset is refused here, never jumped to. A panic is caught. Returns how
/// it ended and, when it returned, its result's fds (which the [`Outcome::Returned`] report
/// carries beside it); otherwise no fds.
///
/// A `Panicked` child may be in any state: it reports and exits.
pub(crate) fn run(call: &Call, fds: Vec<OwnedFd>) -> (Outcome, Vec<OwnedFd>) {
    let entry = match entries::find(call.layout, call.entry) {
        Ok(entry) => entry,
        Err(error) => {
            let stage = NotRunStage::Entry;
            return (Outcome::NotRun { stage, error }, Vec::new());
        }
    };
    // A panic an earlier call caught itself must not be taken for this one's.
    let _ = child_runtime::take_recorded_panic();
    let outcome = match panic::catch_unwind(AssertUnwindSafe(|| entry(&call.args, fds))) {
        Ok(Ok(Ok((bytes, fds)))) => return (Outcome::Returned(Payload(bytes)), fds),
        Ok(Ok(Err(error))) => Outcome::Unsendable(error),
        Ok(Err(error)) => {
            let stage = NotRunStage::Argument;
            Outcome::NotRun { stage, error }
        }
        Err(payload) => {
            let (message, location) = child_runtime::panic_report(payload.as_ref());
            // The payload may own anything; dropping it could panic again. Leave it.
            std::mem::forget(payload);
            Outcome::Panicked { message, location }
        }
    };
    (outcome, Vec::new())
}
