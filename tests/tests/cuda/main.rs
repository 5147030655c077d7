//! `vmm_core::cuda` on a GPU, in one process and across processes, for both handle types.
//!
//! - in one process: `local` (allocate, copy, export and import, fd accounting), `grow`,
//!   `fabric_local` (fabric descriptors as plain data, which need no GPU, then on a GPU);
//! - across processes, each scenario generated for every start method by `#[ipc_test]`:
//!   `handles` (the scenarios that are the same for POSIX fds and fabric handles, one rstest
//!   case each), `posix_fd`, `fabric`, `fabric_tcp` (a receiver vmm-core did not start),
//!   `refusals` (what an importer refuses, in a child that received a real descriptor) and
//!   `two_gpus`.
//!
//! GPU tests skip (one `SKIP <test>: <reason>` line each) where no GPU with VMM IPC support,
//! fabric support or enough devices is present, and fail there instead under
//! `VMM_REQUIRE_GPU=1`, which the GPU runs set.
//!
//! Turns ([`vmm_tests::turns`]): the same-process tests count this process's fds and reserve
//! address ranges, so each runs [`alone`]; every scenario takes a shared turn, so none runs
//! beside them.

use std::sync::RwLockWriteGuard;
use std::time::Duration;

use vmm_core::Error;
use vmm_core::cuda::{
    Device, HandleType, ResourceOptions, Unavailable, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::testing::{settled_open_fds, skip_unless};
use vmm_tests::filled_in;
use vmm_tests::turns::exclusive;

mod fabric;
mod fabric_local;
mod fabric_tcp;
mod grow;
mod handles;
mod local;
mod posix_fd;
mod refusals;
mod two_gpus;

const TIMEOUT: Duration = Duration::from_secs(60);

/// `Some(turn)` when `requirement` holds: a turn with no scenario running beside it, taken
/// once the warm children that scenarios asked for have started (so that this process's fds
/// stay put). Otherwise skips (or fails under `VMM_REQUIRE_GPU=1`) with the reason.
fn alone(requirement: Result<(), Unavailable>) -> Option<RwLockWriteGuard<'static, ()>> {
    skip_unless(requirement).then(|| {
        let turn = exclusive();
        settled_open_fds().unwrap();
        turn
    })
}

/// A resource of device 0 with default options (POSIX-fd handles).
fn resource() -> VirtualMemoryResource {
    VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap()
}

/// A buffer of `chunks` chunks of the granularity, filled with `pattern(1, ..)`.
fn filled(chunks: usize) -> VirtualMemoryBuffer {
    filled_in(&resource(), chunks)
}

/// A resource of `device` with `options` and fabric handles.
fn fabric_resource(device: usize, options: ResourceOptions) -> VirtualMemoryResource {
    VirtualMemoryResource::new(
        &Device::new(device).unwrap(),
        options.handle_type(HandleType::Fabric),
    )
    .unwrap()
}

/// A Fabric buffer of `chunks` chunks of the granularity, filled with `pattern(1, ..)`.
fn filled_fabric(chunks: usize) -> VirtualMemoryBuffer {
    filled_in(&fabric_resource(0, ResourceOptions::default()), chunks)
}

/// `len` bytes of `buf` from `offset`.
fn read(buf: &VirtualMemoryBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    buf.read_at(offset, &mut out).unwrap();
    out
}

// The helpers below take the refusal a test expects (the variant and its rule) and give back
// its text, for the tests whose point is also what people read. Each one's variant is a
// refusal (`Error::is_refusal`): refused before anything was done.

/// The text of an [`Error::NotExportable`] for `rule` (any other outcome fails the test).
#[track_caller]
fn not_exportable<T: std::fmt::Debug>(
    result: vmm_core::Result<T>,
    rule: vmm_core::error::ExportRule,
) -> String {
    match result {
        Err(refusal @ Error::NotExportable { rule: got, .. }) if got == rule => refusal.to_string(),
        other => panic!("expected NotExportable({rule:?}), got {other:?}"),
    }
}

/// The text of an [`Error::InvalidDescriptor`] for `rule` (any other outcome fails the test).
#[track_caller]
fn descriptor_refused<T: std::fmt::Debug>(
    result: vmm_core::Result<T>,
    rule: vmm_core::error::DescriptorRule,
) -> String {
    match result {
        Err(Error::InvalidDescriptor { rule: got, message }) if got == rule => message,
        other => panic!("expected InvalidDescriptor({rule:?}), got {other:?}"),
    }
}

/// The text of an [`Error::InvalidOption`] of `option` for `rule` (any other outcome fails
/// the test).
#[track_caller]
fn option_refused<T: std::fmt::Debug>(
    result: vmm_core::Result<T>,
    option: &str,
    rule: vmm_core::error::OptionRule,
) -> String {
    match result {
        Err(refusal @ Error::InvalidOption { rule: got, .. }) if got == rule => {
            let Error::InvalidOption { option: got, .. } = &refusal else {
                unreachable!()
            };
            assert_eq!(got, option, "{refusal}");
            refusal.to_string()
        }
        other => panic!("expected InvalidOption({option}, {rule:?}), got {other:?}"),
    }
}

/// The text of an [`Error::GrowRefused`] for `rule` (any other outcome fails the test).
#[track_caller]
fn grow_refused<T: std::fmt::Debug>(
    result: vmm_core::Result<T>,
    rule: vmm_core::error::GrowRule,
) -> String {
    match result {
        Err(refusal @ Error::GrowRefused { rule: got, .. }) if got == rule => refusal.to_string(),
        other => panic!("expected GrowRefused({rule:?}), got {other:?}"),
    }
}

/// The parts of an `Error::Ipc` (any other outcome fails the test).
#[track_caller]
fn ipc<T: std::fmt::Debug>(result: vmm_core::Result<T>) -> (String, String, Error) {
    match result {
        Err(Error::Ipc { op, step, source }) => (op.to_string(), step.to_string(), *source),
        other => panic!("expected Error::Ipc, got {other:?}"),
    }
}
