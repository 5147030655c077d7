//! Two GPUs: importing memory of the other device, over POSIX fds and fabric handles, and
//! memory whose owner the importer cannot see. Skipped (fail under `VMM_REQUIRE_GPU=1`) with
//! fewer than two GPUs: `bash .gpu/run.sh tests --skip two_gpus` on a one-GPU machine.

use cudarc::driver::sys;
use vmm_core::Error;
use vmm_core::cuda::{
    Access, Device, FabricDescriptor, IpcDescriptor, Location, PeerAccess, ResourceOptions,
    VirtualMemoryBuffer, VirtualMemoryResource, importer, set_importer,
};
use vmm_core::error::{DescriptorRule, DeviceWanted};
use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_core::testing::open_fds;
use vmm_core::wire::Queue;
use vmm_tests::turns::shared;
use vmm_tests::{check, contents, pattern, with_context_of};

use super::{TIMEOUT, fabric_resource};

/// Register an importer of `home` that maps arriving buffers read-write for `peer` too.
fn map_arrivals_for_the_peer_too(home: &Device, peer: &Device) {
    set_importer(
        &VirtualMemoryResource::new(
            home,
            ResourceOptions::default().peer(peer.ordinal(), Access::ReadWrite),
        )
        .unwrap(),
    );
}

fn import_on_the_other_device(args: (IpcDescriptor, String)) {
    let (descriptor, exporter_uuid) = args;
    // CUDA_VISIBLE_DEVICES=1,0 here: this process's device 0 is the exporter's device 1, and
    // the exporter's device 0 (where the memory lives) is device 1.
    let peer = Device::new(0).unwrap();
    assert_ne!(
        peer.uuid_string(),
        exporter_uuid,
        "device order was not swapped"
    );
    let home = Device::by_uuid(&descriptor.device().unwrap().uuid).unwrap();
    assert_eq!(home.uuid_string(), exporter_uuid);
    assert_eq!(home.ordinal(), 1);

    // Until one is registered, arriving buffers go to a default resource: no peer access.
    assert!(
        importer(&home, Location::Device)
            .unwrap()
            .options()
            .peers
            .is_empty()
    );
    // Register an importer that maps arriving buffers for the peer too.
    map_arrivals_for_the_peer_too(&home, &peer);
    assert_eq!(
        importer(&home, Location::Device).unwrap().options().peers,
        [PeerAccess {
            device: peer.ordinal(),
            access: Access::ReadWrite
        }]
    );
    let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
    assert_eq!(buf.device(), &home, "imported on the exporter's device");
    assert_eq!(contents(&buf), pattern(1, buf.size()));

    // The peer device reads and writes through the mapping, with its own context current.
    let (ptr, size) = (buf.device_ptr(), buf.size());
    let mut seen = vec![0u8; size];
    let written = pattern(4, size);
    let mut peer_access = 0;
    with_context_of(&peer, || {
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: peer.ordinal() as i32,
        };
        // SAFETY: live out-pointer and location; `ptr` is `buf`'s mapping, alive for the call.
        check("cuMemGetAccess (peer)", unsafe {
            sys::cuMemGetAccess(&mut peer_access, &location, ptr)
        });
        // SAFETY: `ptr..ptr + size` is `buf`'s mapping, alive for the call and mapped with
        // read-write access for `peer`; `seen` is writable for `size` bytes.
        check("cuMemcpyDtoH (peer)", unsafe {
            sys::cuMemcpyDtoH_v2(seen.as_mut_ptr().cast(), ptr, size)
        });
        // SAFETY: as above; `written` is readable for `size` bytes, and `with_context_of`
        // synchronises before `buf` can go.
        check("cuMemcpyHtoD (peer)", unsafe {
            sys::cuMemcpyHtoD_v2(ptr, written.as_ptr().cast(), size)
        });
    });
    assert_eq!(
        peer_access,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64,
        "the importer granted the peer read-write access on the mapping"
    );
    assert_eq!(seen, pattern(1, size), "the peer read the exporter's data");
    assert_eq!(
        contents(&buf),
        written,
        "the peer's write reached the memory"
    );
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_devices(2))]
fn two_gpus_import_from_the_other_device_with_peer_access(ctx: &Context) {
    let _turn = shared();
    let device = Device::new(0).unwrap();
    let resource = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().peer(1, Access::ReadWrite),
    )
    .unwrap();
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    let child_ctx = ctx.clone().with_env("CUDA_VISIBLE_DEVICES", "1,0");
    child_ctx
        .spawn(
            import_on_the_other_device,
            (buf.export().unwrap(), device.uuid_string()),
        )
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(4, buf.size()));
}

fn fabric_import_on_the_other_device(args: (FabricDescriptor, FabricDescriptor, String)) {
    let (descriptor, other_device, exporter_uuid) = args;
    // CUDA_VISIBLE_DEVICES=1,0 here: this process's device 0 is the exporter's device 1, and
    // the exporter's device 0 (where the memory lives) is device 1.
    let peer = Device::new(0).unwrap();
    assert_ne!(
        peer.uuid_string(),
        exporter_uuid,
        "device order was not swapped"
    );
    let home = Device::by_uuid(descriptor.owner_uuid()).unwrap();
    assert_eq!((home.uuid_string(), home.ordinal()), (exporter_uuid, 1));

    // Another device's memory: memory of the exporter's device 1 (this process's device 0)
    // imported for this process's device 1, over the fabric; the buffer names its owner.
    let on_home = VirtualMemoryResource::new(&home, ResourceOptions::default()).unwrap();
    let across = on_home.import_fabric(&other_device).unwrap();
    assert_eq!(across.device(), &home);
    assert_eq!(across.owner_uuid(), *peer.uuid());
    assert_eq!(contents(&across), pattern(5, across.size()));
    drop(across);
    // Found by UUID, it imports on its own device.
    let other = VirtualMemoryBuffer::import_fabric(&other_device).unwrap();
    assert_eq!(other.device(), &peer);
    assert_eq!(contents(&other), pattern(5, other.size()));

    // Arriving buffers for `home` are mapped for the peer too.
    map_arrivals_for_the_peer_too(&home, &peer);
    assert_eq!(
        importer(&home, Location::Device)
            .unwrap()
            .options()
            .peers
            .len(),
        1
    );
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap();
    assert_eq!(buf.device(), &home, "imported on the owner's device");
    assert_eq!(contents(&buf), pattern(1, buf.size()));

    // The peer device reads and writes through the mapping, with its own context current.
    let (ptr, size) = (buf.device_ptr(), buf.size());
    let mut seen = vec![0u8; size];
    let written = pattern(4, size);
    with_context_of(&peer, || {
        // SAFETY: `ptr..ptr + size` is `buf`'s mapping, alive for the call and mapped with
        // read-write access for `peer`; `seen` is writable for `size` bytes.
        check("cuMemcpyDtoH (peer)", unsafe {
            sys::cuMemcpyDtoH_v2(seen.as_mut_ptr().cast(), ptr, size)
        });
        // SAFETY: as above; `written` is readable for `size` bytes, and `with_context_of`
        // synchronises before `buf` can go.
        check("cuMemcpyHtoD (peer)", unsafe {
            sys::cuMemcpyHtoD_v2(ptr, written.as_ptr().cast(), size)
        });
    });
    assert_eq!(seen, pattern(1, size), "the peer read the exporter's data");
    assert_eq!(
        contents(&buf),
        written,
        "the peer's write reached the memory"
    );
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2).and_then(|()| vmm_core::testing::cuda_fabric()))]
fn two_gpus_fabric_import_on_the_owners_device_with_peer_access(ctx: &Context) {
    let _turn = shared();
    let resource = fabric_resource(0, ResourceOptions::default().peer(1, Access::ReadWrite));
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    let on_one = fabric_resource(1, ResourceOptions::default());
    let other = on_one.allocate(on_one.granularity()).unwrap();
    other.write_at(0, &pattern(5, other.size())).unwrap();
    let exporter_uuid = buf.device().uuid_string();
    ctx.clone()
        .with_env("CUDA_VISIBLE_DEVICES", "1,0")
        .spawn(
            fabric_import_on_the_other_device,
            (
                buf.export_fabric().unwrap(),
                other.export_fabric().unwrap(),
                exporter_uuid,
            ),
        )
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(4, buf.size()));
}

/// The exporter of a remote-owner hand-off, seeing only its own GPU: fill a fabric buffer
/// with `pattern(7, ..)`, send its descriptor, and once the importer says it wrote its mark,
/// send back the first bytes it finds.
fn export_and_report_mark(args: (Queue<FabricDescriptor>, Queue<()>, Queue<Vec<u8>>)) {
    let (descriptors, marked, seen) = args;
    assert_eq!(
        Device::count().unwrap(),
        1,
        "the exporter sees more than its GPU"
    );
    let resource = fabric_resource(0, ResourceOptions::default());
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(7, buf.size())).unwrap();
    descriptors.put(&buf.export_fabric().unwrap()).unwrap();
    marked.get(TIMEOUT).unwrap();
    seen.put(&contents(&buf)[..16].to_vec()).unwrap();
}

/// The importer, seeing only the other GPU: the owner is not among its devices, and the
/// memory is mapped for its own device over the fabric.
fn import_remote_and_mark(args: (FabricDescriptor, Queue<()>)) {
    let (descriptor, marked) = args;
    assert_eq!(
        Device::count().unwrap(),
        1,
        "the importer sees more than its GPU"
    );
    assert!(
        Device::by_uuid(descriptor.owner_uuid()).is_err(),
        "the importer sees the owner's GPU"
    );
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap();
    assert_eq!(buf.owner_uuid(), *descriptor.owner_uuid());
    assert_ne!(buf.device().uuid(), descriptor.owner_uuid());
    assert_eq!(contents(&buf), pattern(7, buf.size()), "the owner's data");
    buf.write_at(0, &[0xA5; 16]).unwrap();
    drop(buf);
    marked.put(&()).unwrap();
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2).and_then(|()| vmm_core::testing::cuda_fabric()))]
fn two_gpus_fabric_import_of_memory_whose_owner_the_importer_cannot_see(ctx: &Context) {
    let _turn = shared();
    let (descriptors, marked, seen) = (
        Queue::new().unwrap(),
        Queue::new().unwrap(),
        Queue::new().unwrap(),
    );
    let exporter = ctx
        .clone()
        .with_env("CUDA_VISIBLE_DEVICES", "0")
        .spawn(
            export_and_report_mark,
            (descriptors.clone(), marked.clone(), seen.clone()),
        )
        .unwrap();
    let descriptor = descriptors.get(TIMEOUT).unwrap();
    ctx.clone()
        .with_env("CUDA_VISIBLE_DEVICES", "1")
        .spawn(import_remote_and_mark, (descriptor, marked.clone()))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        seen.get(TIMEOUT).unwrap(),
        [0xA5; 16],
        "the importer's mark"
    );
    exporter.wait().unwrap();
}

/// The exporter of a POSIX-fd descriptor in the same setup: it keeps its buffer until told.
fn export_posix_and_wait(args: (Queue<vmm_core::cuda::IpcDescriptor>, Queue<()>)) {
    let (descriptors, done) = args;
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let buf = resource.allocate(resource.granularity()).unwrap();
    descriptors.put(&buf.export().unwrap()).unwrap();
    done.get(TIMEOUT).unwrap();
}

/// A POSIX-fd descriptor of a GPU this process cannot see: refused before any driver call,
/// with an error that says why, and its fd closed with it.
fn import_posix_of_a_hidden_gpu(descriptor: vmm_core::cuda::IpcDescriptor) {
    let here = Device::new(0).unwrap();
    let resource = VirtualMemoryResource::new(&here, ResourceOptions::default()).unwrap();
    let before = open_fds().unwrap();
    match VirtualMemoryBuffer::import(&descriptor) {
        Err(Error::NoSuchDevice {
            wanted: DeviceWanted::Uuid(uuid),
            ..
        }) => assert_ne!(&uuid, here.uuid(), "the hidden GPU is the one asked for"),
        Err(other) => panic!("expected NoSuchDevice by UUID, got {other:?}"),
        Ok(_) => panic!("a POSIX-fd descriptor of a hidden GPU was imported"),
    }
    match resource.import(&descriptor) {
        Err(Error::InvalidDescriptor {
            rule: DescriptorRule::Location,
            message: m,
        }) => assert!(
            m.contains("live on the exporter's device") && m.contains(&here.uuid_string()),
            "{m}"
        ),
        other => panic!("expected the device refusal, got {other:?}"),
    }
    assert_eq!(
        open_fds().unwrap(),
        before,
        "a refusal opened or closed fds"
    );
    drop(descriptor);
    assert_eq!(
        open_fds().unwrap(),
        before - 1,
        "the descriptor's fd stayed open"
    );
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2))]
fn two_gpus_posix_fd_descriptor_of_a_gpu_the_importer_cannot_see_is_refused(ctx: &Context) {
    let _turn = shared();
    let (descriptors, done) = (Queue::new().unwrap(), Queue::new().unwrap());
    let exporter = ctx
        .clone()
        .with_env("CUDA_VISIBLE_DEVICES", "0")
        .spawn(export_posix_and_wait, (descriptors.clone(), done.clone()))
        .unwrap();
    let descriptor = descriptors.get(TIMEOUT).unwrap();
    let importer = ctx
        .clone()
        .with_env("CUDA_VISIBLE_DEVICES", "1")
        .spawn(import_posix_of_a_hidden_gpu, descriptor)
        .unwrap()
        .wait();
    done.put(&()).unwrap();
    importer.unwrap();
    exporter.wait().unwrap();
}
