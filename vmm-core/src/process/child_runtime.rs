//! What every child process vmm-core starts does, whatever its role: the exit codes of a child
//! that did not get as far as its function, dying with its parent, recording its first panic
//! for the report, and warming up CUDA (warm children and pool workers).

use std::panic;
use std::sync::Mutex;

use nix::sys::signal::Signal;
use nix::unistd::{Pid, getppid};

/// Exit codes of a child that did not get as far as its function.
pub(crate) const EXIT_ORPHANED: i32 = 120;
pub(crate) const EXIT_NO_START: i32 = 121;
pub(crate) const EXIT_PANICKED: i32 = 101;
pub(crate) const EXIT_NOT_RUN: i32 = 122;

/// Be killed when `parent` dies; exit now if it already has.
pub(crate) fn die_with(parent: Pid) {
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    if getppid() != parent {
        std::process::exit(EXIT_ORPHANED);
    }
}

/// The first panic of this child, recorded by the hook for the report.
static FIRST_PANIC: Mutex<Option<(String, Option<String>)>> = Mutex::new(None);

/// Record the first panic of this process (message and location) for the report, before the
/// default hook prints it. Installed once per process.
pub(crate) fn record_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(install_panic_recorder);
}

/// The first panic recorded since the last call, if any.
pub(crate) fn take_recorded_panic() -> Option<(String, Option<String>)> {
    FIRST_PANIC.lock().ok().and_then(|mut first| first.take())
}

fn install_panic_recorder() {
    let default = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        let message = info
            .payload_as_str()
            .map_or_else(|| "Box<dyn Any>".to_owned(), str::to_owned);
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
        if let Ok(mut first) = FIRST_PANIC.lock() {
            first.get_or_insert((message, location));
        }
        default(info);
    }));
}

/// Retain the primary context of each of `devices` (CUDA ordinals), so that the function this
/// process runs later finds CUDA initialised. Where CUDA cannot be used (no driver, no device)
/// it does nothing, and a device this process does not see is skipped: warming up saves time,
/// it never makes a child fail. Any other failure is one line on stderr (which the parent
/// captures and shows if the child's function fails) and the device is skipped.
pub(crate) fn warm_up(devices: &[usize]) {
    if devices.is_empty() {
        return;
    }
    let Ok(count) = crate::cuda::Device::count() else {
        return;
    };
    for &ordinal in devices.iter().filter(|&&d| d < count) {
        // Retains the primary context (kept for the process's life) and makes it current for
        // the moment; the guard restores this thread's previous (no) context.
        let warmed = crate::cuda::Device::new(ordinal).and_then(|device| device.make_current());
        if let Err(error) = warmed {
            eprintln!("vmm-ipc: warming up CUDA device {ordinal} failed: {error}");
        }
    }
}

/// The message and location of the panic that unwound with `payload`: as the hook recorded
/// them, else the payload's message without a location.
pub(crate) fn panic_report(payload: &(dyn std::any::Any + Send)) -> (String, Option<String>) {
    take_recorded_panic().unwrap_or_else(|| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "Box<dyn Any>".to_owned());
        (message, None)
    })
}
