//! What an importer refuses, each case in a child that received a real descriptor from its
//! parent (the situation the checks exist for: the descriptor is another process's data), under
//! both start methods. Each case asserts the error's variant and its rule text, and that nothing
//! is left behind: the child's fd count is back to its baseline (a child is single-threaded
//! here, so its count is exact). Refusals made before any driver call are typed refusals
//! ([`Error::is_refusal`]) from validation; refusals by the driver are `Error::Ipc` naming the chunk and step.
//!
//! Skipped (one `SKIP` line each) where no GPU with VMM IPC support is present; failures under
//! `VMM_REQUIRE_GPU=1`.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};

use serde::{Deserialize, Serialize};
use vmm_core::cuda::{
    Device, DeviceIdentity, HandleType, IpcDescriptor, Location, ResourceOptions,
    VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::process::Context;
use vmm_core::wire::{self, Fd};
use vmm_core::{Error, ipc_test};
use vmm_tests::turns::shared;
use vmm_tests::{contents, pattern};

use super::{descriptor_refused, filled, ipc, not_exportable, option_refused, resource};
use vmm_core::error::{DescriptorRule, DeviceWanted, ExportRule, OptionRule};

fn open_fds() -> usize {
    vmm_core::testing::open_fds().unwrap()
}

/// A descriptor's wire form, field for field: what a peer process sends, and so what it can
/// forge. Decoded from a real descriptor's message, edited, and decoded again as an
/// `IpcDescriptor` by `vmm_core::wire::decode`, exactly as an arriving descriptor is.
#[derive(Serialize, Deserialize)]
struct DescriptorFields {
    handle_type: u32,
    size: u64,
    chunk_sizes: Vec<u64>,
    device: Option<DeviceIdentity>,
    location: Location,
    fds: Vec<Fd>,
}

/// Duplicates of a message's fds, as a receiver gets them.
fn received<'a>(fds: impl Iterator<Item = BorrowedFd<'a>>) -> Vec<OwnedFd> {
    fds.map(|fd| fd.try_clone_to_owned().unwrap()).collect()
}

/// `descriptor` as it would arrive after a peer changed its fields with `edit`.
fn forged(descriptor: &IpcDescriptor, edit: impl FnOnce(&mut DescriptorFields)) -> IpcDescriptor {
    let encoded = wire::encode(descriptor).unwrap();
    let mut fields: DescriptorFields =
        wire::decode(encoded.bytes(), received(encoded.fds())).unwrap();
    drop(encoded);
    edit(&mut fields);
    let encoded = wire::encode(&fields).unwrap();
    wire::decode(encoded.bytes(), received(encoded.fds())).unwrap()
}

/// The mirror is the wire form (checked without a GPU: a descriptor of any fd will do), so the
/// GPU tests below forge exactly the field they mean to.
#[test]
fn forged_fields_arrive_as_forged() {
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let g = 2 << 20;
    let plain = IpcDescriptor::from_fds(
        &[file.as_fd(), file.as_fd()],
        &[g, g],
        HandleType::PosixFd,
        5,
    )
    .unwrap();
    let same = forged(&plain, |_| {});
    assert_eq!(
        (same.chunk_sizes(), same.size(), same.handle_type()),
        (&[g, g][..], 5, HandleType::PosixFd)
    );
    assert_eq!((same.device(), same.location()), (None, Location::Device));
    assert_eq!(same.fds().count(), 2);
    let identity = DeviceIdentity {
        ordinal: 3,
        uuid: [0xa5; 16],
    };
    let edited = forged(&plain, |fields| {
        fields.device = Some(identity);
        fields.location = Location::HostNuma(1);
    });
    assert_eq!(edited.device(), Some(identity));
    assert_eq!(edited.location(), Location::HostNuma(1));
    assert_eq!(edited.chunk_sizes(), &[g, g]);
    assert_eq!(
        vmm_core::cuda::format_uuid(&identity.uuid),
        "GPU-a5a5a5a5-a5a5-a5a5-a5a5-a5a5a5a5a5a5"
    );
}

fn refuse_forged_origin(descriptor: IpcDescriptor) {
    let resource = resource();
    let device = resource.device().clone();
    let chunks = descriptor.chunk_sizes().len();
    let identity = descriptor.device().expect("an export names its device");
    assert_eq!(identity.uuid, *device.uuid());

    // Control: the fields round-trip unchanged into a descriptor that imports (so the mirror
    // above is the wire form, and the refusals below are the edits').
    let same = forged(&descriptor, |_| {});
    assert_eq!(
        (same.device(), same.location(), same.chunk_sizes()),
        (
            descriptor.device(),
            Location::Device,
            descriptor.chunk_sizes()
        )
    );
    let buf = resource.import(&same).unwrap();
    assert_eq!(contents(&buf), pattern(1, buf.size()));
    drop((buf, same));
    // Every device of this process known before the baseline (the importer below looks them
    // all up by UUID).
    for ordinal in 0..Device::count().unwrap() {
        Device::new(ordinal).unwrap();
    }
    let before = open_fds();

    // Another device's UUID (no GPU has this one: every byte of the real one inverted).
    let uuid = identity.uuid.map(|b| !b);
    let elsewhere = forged(&descriptor, |fields| {
        fields.device = Some(DeviceIdentity { ordinal: 3, uuid })
    });
    assert_eq!(
        open_fds(),
        before + chunks,
        "the forged descriptor's own fds"
    );
    let m = descriptor_refused(resource.import(&elsewhere), DescriptorRule::Location);
    assert_eq!(
        m,
        format!(
            "invalid IpcDescriptor: its chunks live on the exporter's device 3 ({}), but this \
             resource is on device 0 ({}, {}); import with a VirtualMemoryResource for that \
             device",
            vmm_core::cuda::format_uuid(&uuid),
            device.name(),
            device.uuid_string()
        )
    );
    // This process's importer looks the device up by UUID, and finds none.
    let m = match VirtualMemoryBuffer::import(&elsewhere) {
        Err(
            refusal @ Error::NoSuchDevice {
                wanted: DeviceWanted::Uuid(wanted),
                ..
            },
        ) if wanted == uuid => refusal.to_string(),
        other => panic!("expected NoSuchDevice by UUID, got {other:?}"),
    };
    assert_eq!(
        m,
        format!(
            "no CUDA device in this process has UUID {}; check CUDA_VISIBLE_DEVICES",
            vmm_core::cuda::format_uuid(&uuid)
        )
    );

    // Another location: host memory, offered to a resource that maps device memory.
    let on_host = forged(&descriptor, |fields| {
        fields.location = Location::HostNuma(0)
    });
    let m = descriptor_refused(resource.import(&on_host), DescriptorRule::Location);
    assert_eq!(
        m,
        "invalid IpcDescriptor: its location is HostNuma(0), this resource's option `location` \
         is Device"
    );
    drop((elsewhere, on_host));
    assert_eq!(open_fds(), before, "a refused descriptor left fds behind");
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn forged_device_or_location_is_refused_before_any_driver_call(ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    ctx.spawn(refuse_forged_origin, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}

fn refuse_on_the_other_device(descriptor: IpcDescriptor) {
    let here = resource();
    let other_device = Device::new(1).unwrap();
    let other = VirtualMemoryResource::new(&other_device, ResourceOptions::default()).unwrap();
    let g = descriptor.chunk_sizes()[0];
    // Warm up both devices (the driver opens its own fds on a device's first use), then take
    // the baseline.
    drop(
        other
            .import(&other.allocate(1).unwrap().export().unwrap())
            .unwrap(),
    );
    drop(here.import(&descriptor).unwrap());
    let before = open_fds();

    // Built from the fds alone, it names no device, so nothing can be checked before the
    // driver says where the chunk lives.
    let fds: Vec<_> = descriptor.fds().collect();
    let anonymous = IpcDescriptor::from_fds(
        &fds,
        descriptor.chunk_sizes(),
        HandleType::PosixFd,
        descriptor.size(),
    )
    .unwrap();
    assert_eq!(anonymous.device(), None);
    let (op, step, source) = ipc(other.import(&anonymous));
    assert_eq!(op, "import");
    assert_eq!(
        step,
        format!("while checking the location of chunk 1 of 2 ({g} bytes)")
    );
    let m = descriptor_refused::<()>(Err(source), DescriptorRule::Location);
    assert_eq!(
        m,
        format!(
            "the chunk lives on device 0, but this resource maps device 1 ({}); import with a \
             VirtualMemoryResource for the chunk's device",
            other_device.name()
        )
    );
    assert_eq!(open_fds(), before + 2, "the failed import holds no fd");
    // On its own device the same descriptor imports.
    let buf = here.import(&anonymous).unwrap();
    assert_eq!(contents(&buf), pattern(1, buf.size()));
    drop((buf, anonymous));
    assert_eq!(open_fds(), before, "fds back to the baseline");
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2))]
fn two_gpus_descriptor_without_identity_is_refused_on_the_other_device_after_import(ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    ctx.spawn(refuse_on_the_other_device, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}

fn refuse_unshareable(descriptor: IpcDescriptor) {
    let device = Device::new(0).unwrap();
    let none = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::None),
    )
    .unwrap();
    // Warm up (the driver's own fds), then take the baseline.
    drop(resource().import(&descriptor).unwrap());
    let unshareable = none.allocate(1).unwrap();
    unshareable.fill(0x77).unwrap();
    let before = open_fds();

    let m = option_refused(
        none.import(&descriptor),
        "handle_type",
        OptionRule::Conflict,
    );
    assert_eq!(
        m,
        "import: this resource's option `handle_type` is None, so its buffers are not \
         shareable; import with a VirtualMemoryResource created with HandleType::PosixFd"
    );
    // A fabric descriptor is refused the same way, before its (forged) handle reaches the driver.
    let forged = vmm_core::cuda::FabricDescriptor::from_handles(
        &[vmm_core::cuda::FabricHandle::from_bytes([0x5a; 64])],
        &[descriptor.chunk_sizes()[0]],
        1,
        *device.uuid(),
    )
    .unwrap();
    assert_eq!(
        option_refused(
            none.import_fabric(&forged),
            "handle_type",
            OptionRule::Conflict
        ),
        "import_fabric: this resource's option `handle_type` is None, so its buffers are not \
         shareable; import with a VirtualMemoryResource created with HandleType::Fabric"
    );
    let rule = "export: the buffer was allocated with handle type None; create its \
                VirtualMemoryResource with HandleType::PosixFd to share it";
    assert_eq!(
        not_exportable(unshareable.export(), ExportRule::HandleType),
        rule
    );
    // Sending exports on the way: refused the same way.
    assert_eq!(
        not_exportable(
            wire::encode(&unshareable).map(|e| e.fd_count()),
            ExportRule::HandleType
        ),
        rule
    );
    assert_eq!(open_fds(), before, "a refusal left fds behind");
    // Both still work for what they can do.
    let mut byte = [0u8];
    unshareable.read_at(0, &mut byte).unwrap();
    assert_eq!(byte, [0x77]);
    let buf = resource().import(&descriptor).unwrap();
    assert_eq!(contents(&buf), pattern(1, buf.size()));
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn handle_type_none_neither_imports_nor_exports(ctx: &Context) {
    let _turn = shared();
    let buf = filled(1);
    ctx.spawn(refuse_unshareable, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}

/// Above the kernel's largest fd number (`fs.nr_open` is at most 2147483584 on 64-bit Linux),
/// so never an open fd.
const NEVER_OPEN: RawFd = i32::MAX - 7;
/// Linux's `EBADF`.
const EBADF: i32 = 9;

fn refuse_foreign_fds(descriptor: IpcDescriptor) {
    let r = resource();
    let g = descriptor.chunk_sizes()[0];
    // Warm up (the driver's own fds), then take the baseline.
    drop(r.import(&descriptor).unwrap());
    let host = vmm_core::shm::HostBuffer::new(g).unwrap().export().unwrap();
    let memfd = host.fd().expect("a non-empty host buffer has a memfd");
    let null = std::fs::File::open("/dev/null").unwrap();
    let real = descriptor.fds().next().unwrap();
    let before = open_fds();

    // A host buffer's memfd as the only chunk: the driver refuses it at the first step.
    let from_memfd = IpcDescriptor::from_fds(&[memfd], &[g], HandleType::PosixFd, g).unwrap();
    let (op, step, source) = ipc(r.import(&from_memfd));
    assert_eq!(
        (op.as_str(), step.as_str()),
        (
            "import",
            format!("while importing chunk 1 of 1 ({g} bytes)").as_str()
        )
    );
    assert!(
        matches!(&source, Error::Cuda { call, .. } if call == "cuMemImportFromShareableHandle"),
        "{source:?}"
    );
    // /dev/null as chunk 2, after a real chunk 1 (imported, then released on the failure).
    let with_null =
        IpcDescriptor::from_fds(&[real, null.as_fd()], &[g, g], HandleType::PosixFd, 2 * g)
            .unwrap();
    let (op, step, source) = ipc(r.import(&with_null));
    assert_eq!(
        (op.as_str(), step.as_str()),
        (
            "import",
            format!("while importing chunk 2 of 2 ({g} bytes)").as_str()
        )
    );
    assert!(
        matches!(&source, Error::Cuda { call, .. } if call == "cuMemImportFromShareableHandle"),
        "{source:?}"
    );
    assert_eq!(open_fds(), before + 3, "failed imports hold no fd");
    drop((from_memfd, with_null));
    assert_eq!(open_fds(), before, "fds back to the baseline");

    // A number that is no open fd: from_fds cannot duplicate it.
    // SAFETY: `NEVER_OPEN` is above the largest fd number the kernel hands out, so it is not
    // (and never becomes) an open fd of this process: nothing that owns an fd is aliased, and
    // the only use of the borrow, a dup (F_DUPFD_CLOEXEC), fails with EBADF.
    let closed = unsafe { BorrowedFd::borrow_raw(NEVER_OPEN) };
    match IpcDescriptor::from_fds(&[real, closed], &[g, g], HandleType::PosixFd, 2 * g) {
        Err(Error::Os { op, source }) => {
            assert_eq!(op, format!("duplicating fd {NEVER_OPEN} of chunk 2 of 2"));
            assert_eq!(source.raw_os_error(), Some(EBADF), "{source}");
        }
        other => panic!("expected Error::Os (EBADF), got {other:?}"),
    }
    assert_eq!(
        open_fds(),
        before,
        "the duplicate of chunk 1 was closed when chunk 2 failed"
    );

    // The real descriptor still imports.
    let buf = r.import(&descriptor).unwrap();
    assert_eq!(contents(&buf), pattern(1, buf.size()));
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn non_cuda_and_bad_fds_are_refused_and_leave_nothing(ctx: &Context) {
    let _turn = shared();
    let buf = filled(1);
    ctx.spawn(refuse_foreign_fds, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}
