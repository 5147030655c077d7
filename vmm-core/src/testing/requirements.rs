//! Requirement checks for `skip_unless`: they never panic, and their error is the reason.

use std::fmt::Display;

use crate::error::Unavailable;

/// What `skip_unless = EXPR` (and [`skip_unless`](crate::testing::skip_unless)) accepts: `bool`, or
/// `Result<(), impl Display>` whose error is the reason to skip.
pub trait Requirement {
    /// `Err(reason)` when the test must be skipped.
    fn check(self) -> Result<(), String>;
}

impl Requirement for bool {
    fn check(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err("requirement evaluated to false".to_owned())
        }
    }
}

impl<E: Display> Requirement for Result<(), E> {
    fn check(self) -> Result<(), String> {
        self.map_err(|e| e.to_string())
    }
}

/// The forkserver can be started (and is, afterwards).
pub fn forkserver_available() -> Result<(), String> {
    crate::process::ensure_running()
        .map(drop)
        .map_err(|e| e.to_string())
}

/// The CUDA VMM IPC path can run here: libcuda loads, a device exists, and it supports virtual
/// memory management and POSIX-fd handles. The error says which check failed.
pub fn cuda_vmm_ipc() -> Result<(), Unavailable> {
    crate::cuda::availability()
}

/// Fabric handles can be used here: [`cuda_vmm_ipc`] holds, device 0 offers fabric handles,
/// and this process has an IMEX channel (a trial fabric allocation and export succeed; see
/// `vmm_core::cuda::Device::check_fabric`). The error says which is missing.
pub fn cuda_fabric() -> Result<(), Unavailable> {
    crate::cuda::fabric_availability()
}

/// At least `n` CUDA devices with VMM IPC support.
pub fn cuda_devices(n: usize) -> Result<(), Unavailable> {
    cuda_vmm_ipc()?;
    let count = crate::cuda::Device::count().map_err(Unavailable::from_error)?;
    if count < n {
        return Err(Unavailable::TooFewDevices {
            needed: n,
            found: count,
        });
    }
    Ok(())
}
