//! The GPU backend (issue 26 items 4, 5, 6 and 7 on the GPU path): weights published by one
//! process and attached by another; the service SIGKILLed and restarted, the region attached
//! again with its contents and no reload; sleep and wake at the same device address; a
//! region per device (device 1 where there is one); readers mapped read-only; the digest
//! taken at commit catching a write through a writable mapping of a hostile reader's own;
//! an operator's sleep and wake of a region.
//!
//! Every test but the last needs a GPU: without one it prints one `SKIP` line and passes,
//! and fails instead under `VMM_REQUIRE_GPU=1`. The last checks that a host-only service
//! never loads the CUDA driver (on any machine).

mod common;
#[path = "common/gpu.rs"]
mod gpu_common;

use std::time::Duration;

use common::{Role, ServiceProc, role_args, role_client, say};
use gpu_common::{attached_intact, holds_pattern, on, parse_uuid, publish_gpu, uuid_hex};
use vmm_core::cuda::{Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryResource};
use vmm_core::peer::{Descriptor, PeerMessage};
use vmm_core::testing::{cuda_devices, cuda_vmm_ipc, skip_unless};
use vmm_core::wire::endpoint::ConnectOptions;
use vmm_memd::protocol::{ChunkDigest, Request, Response};
use vmm_memd::{Attached, Client, MemdError, Refusal, RequestRule};

/// Chunk size asked for (the service rounds it up to the granularity, 2 MiB on the H200).
const SIZE: u64 = 3 << 20;

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    match role.as_str() {
        // Publish ARGS[0] on the device with UUID ARGS[1] (2 chunks), say the generation,
        // exit: from then on only the service (and its keeper) hold the memory.
        "gpu-writer" => {
            let client = role_client();
            let generation = publish_gpu(&client, &args[0], parse_uuid(&args[1]), 2, SIZE);
            say(&format!("COMMITTED {generation}"));
        }
        // Attach ARGS[0], check every byte and that the mapping is read-only here, say so.
        "gpu-reader" => {
            let client = role_client();
            let attached = client.attach(&args[0]).unwrap();
            let gpu = attached.gpu.as_ref().unwrap();
            let refused = gpu.buffer().write_at(0, &[1]).is_err();
            say(&format!(
                "READ {} intact={} refused_write={refused}",
                attached.generation,
                attached_intact(&attached)
            ));
        }
        other => panic!("unknown role {other}"),
    }
}

/// Weights published by one process (which then exits) are attached by another with the
/// same bytes, mapped read-only there (our client refuses writes through it), on the device
/// the reply names.
#[test]
fn weights_published_by_one_process_are_attached_by_another() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let uuid = uuid_hex(0);
    let mut writer = Role::spawn("gpu-writer", &service, &["weights", &uuid], false);
    assert_eq!(writer.expect_line(), "COMMITTED 1");
    assert!(writer.wait_success());
    let mut reader = Role::spawn("gpu-reader", &service, &["weights"], false);
    assert_eq!(
        reader.expect_line(),
        "READ 1 intact=true refused_write=true"
    );
    assert!(reader.wait_success());
    let attached = service.connect().attach("weights").unwrap();
    let gpu = attached.gpu.as_ref().unwrap();
    assert_eq!(gpu.device_uuid(), parse_uuid(&uuid));
    assert!(attached.chunks.is_empty());
    assert!(attached.tensor_device_ptr("t1").unwrap() >= gpu.device_ptr() + SIZE);
    assert!(attached_intact(&attached));
}

/// Region "kept" on GPU 0, generation 1 of two chunks, committed by a writer process that has
/// exited since (only the service and its keeper hold the memory): a client of this process,
/// its attachment, and the digests taken at commit.
fn kept_by_an_exited_writer(service: &ServiceProc) -> (Client, Attached, Vec<ChunkDigest>) {
    let uuid = uuid_hex(0);
    let mut writer = Role::spawn("gpu-writer", service, &["kept", &uuid], false);
    assert_eq!(writer.expect_line(), "COMMITTED 1");
    assert!(writer.wait_success());
    let client = service.connect();
    let attached = client.attach("kept").unwrap();
    let digests = client.verify("kept", None).unwrap();
    assert_eq!(digests.len(), 2);
    (client, attached, digests)
}

/// The service SIGKILLed and started again: the GPU region is served again from the keeper's
/// fds (the writer exited long before; nobody reloads), with the same generation, the same
/// bytes and the digests taken at commit; a mapping made before the crash stays valid.
#[test]
fn gpu_region_survives_a_service_sigkill_without_reload() {
    let mut service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let (client, before, digests) = kept_by_an_exited_writer(&service);
    service.signal(libc::SIGKILL);
    let _ = service.child.wait();
    assert!(matches!(client.list(), Err(MemdError::ServiceGone(_))));
    assert!(attached_intact(&before), "a mapping outlives the service");
    service.restart();
    let client = Client::reconnect(
        &service.name(),
        &ConnectOptions::default(),
        Duration::from_secs(5),
    )
    .unwrap();
    let after = client.attach("kept").unwrap();
    assert_eq!(
        after.generation, 1,
        "the same generation: nothing was reloaded"
    );
    assert!(attached_intact(&after));
    assert_eq!(client.verify("kept", None).unwrap(), digests);
    let status = client.status().unwrap();
    assert!(status.regions[0].pending.is_none());
}

/// A graceful stop (SIGTERM), then an upgraded binary (a copy of this executable in another
/// file) started with the same state directory: the GPU region comes back from the keeper's
/// fds with the same generation, bytes and digests, and a mapping made before the stop stays
/// valid throughout (issue 34 item 1, on the GPU).
#[test]
fn gpu_region_survives_a_graceful_stop_and_an_upgraded_binary() {
    let mut service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let (client, before, digests) = kept_by_an_exited_writer(&service);
    drop(client);
    service.signal(libc::SIGTERM);
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    assert!(attached_intact(&before), "a mapping outlives the stop");
    let upgraded = common::ExeCopy::new();
    service.restart_from(&upgraded.path);
    let client = service.connect();
    let after = client.attach("kept").unwrap();
    assert_eq!(
        after.generation, 1,
        "the same generation: nothing was reloaded"
    );
    assert!(attached_intact(&after));
    assert!(attached_intact(&before));
    assert_eq!(client.verify("kept", None).unwrap(), digests);
}

/// Sleep gives the GPU mapping up; wake maps the region at the same device address (the
/// same generation, and after a republish of the same layout, the new one).
#[test]
fn gpu_sleep_and_wake_keep_the_device_address() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let uuid = parse_uuid(&uuid_hex(0));
    let client = service.connect();
    publish_gpu(&client, "kv", uuid, 2, SIZE);
    let attached = client.attach("kv").unwrap();
    let address = attached.gpu.as_ref().unwrap().device_ptr();
    let sleeping = client.sleep(attached).unwrap();
    assert_eq!(sleeping.gpu_address(), Some(address));
    assert!(sleeping.reservations().is_empty());
    // Another allocation of this process asks for exactly the slept range while it sleeps:
    // the range stays reserved, so the driver places it elsewhere and the wake still gets it.
    let squatter = VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().address_hint(address),
    )
    .unwrap()
    .allocate((2 * SIZE) as usize)
    .unwrap();
    assert_ne!(
        squatter.device_ptr(),
        address,
        "the slept range was free to take"
    );
    let woke = client.wake(sleeping).unwrap();
    assert_eq!(woke.gpu.as_ref().unwrap().device_ptr(), address);
    assert!(attached_intact(&woke));
    let sleeping = client.sleep(woke).unwrap();
    let writer = service.connect();
    assert_eq!(publish_gpu(&writer, "kv", uuid, 2, SIZE), 2);
    let woke = client.wake(sleeping).unwrap();
    assert_eq!(
        (woke.generation, woke.gpu.as_ref().unwrap().device_ptr()),
        (2, address)
    );
    assert!(attached_intact(&woke));
}

/// Read-only cannot be enforced on the GPU: a hostile reader imports the fds it was sent
/// with read-write access of its own and writes. The digest taken at commit catches it:
/// `Verify` gives `DigestMismatch` naming the chunk, where it passed before.
#[test]
fn a_write_through_a_hostile_writable_mapping_fails_verify() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let device = Device::new(0).unwrap();
    let uuid = *device.uuid();
    let owner = service.connect();
    let generation = publish_gpu(&owner, "victim", uuid, 2, SIZE);
    assert_eq!(owner.verify("victim", None).unwrap().len(), 2);
    // The hostile reader: an Attach by hand, the fds imported read-write.
    let hostile = service.connect();
    let bytes = postcard::to_allocvec(&Request::Attach {
        region: "victim".into(),
        generation: None,
    })
    .unwrap();
    let Response::AttachedGpu {
        chunks, meta_pages, ..
    } = hostile.request_raw(&bytes).unwrap()
    else {
        panic!("not a GPU attach");
    };
    for _ in 0..meta_pages {
        hostile.session().recv_data().unwrap();
    }
    let mut fds = Vec::new();
    for _ in &chunks {
        match hostile.session().recv_message().unwrap() {
            PeerMessage::Descriptor(Descriptor::Cuda(d)) => fds.extend(d.into_fds()),
            other => panic!("{other:?}"),
        }
    }
    let second = &fds[1];
    let len = chunks[1] as usize;
    let descriptor = IpcDescriptor::from_fds(
        &[std::os::fd::AsFd::as_fd(second)],
        &[len],
        HandleType::PosixFd,
        len,
    )
    .unwrap();
    let writable = VirtualMemoryResource::new(&device, ResourceOptions::default())
        .unwrap()
        .import(&descriptor)
        .unwrap();
    writable.write_at(len / 2, &[0x5a, 0xa5]).unwrap();
    match owner.verify("victim", Some(generation)) {
        Err(MemdError::Refused(Refusal::DigestMismatch {
            chunk,
            generation: g,
            ..
        })) => assert_eq!((chunk, g), (1, generation)),
        other => panic!("{other:?}"),
    }
    // Our own client still maps it read-only and refuses to write through it.
    let attached = owner.attach("victim").unwrap();
    let gpu = attached.gpu.as_ref().unwrap();
    assert!(gpu.is_read_only());
    assert!(gpu.buffer().write_at(0, &[0]).is_err());
    assert!(gpu.buffer().fill(0).is_err());
}

/// One service serves every device: a region lives on the device its first `BeginOn` named
/// (device 1 here), its replies name that device's UUID, readers map it there; another
/// device for the same region is refused. Needs two GPUs: with one it prints a `SKIP` line
/// and passes even under `VMM_REQUIRE_GPU=1` (which still fails it without any GPU).
#[test]
fn regions_live_on_the_device_they_were_created_on() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    if let Err(reason) = cuda_devices(2) {
        let test = std::thread::current().name().unwrap_or("").to_owned();
        eprintln!("SKIP {test}: {reason}");
        return;
    }
    let (zero, one) = (parse_uuid(&uuid_hex(0)), parse_uuid(&uuid_hex(1)));
    let client = service.connect();
    publish_gpu(&client, "on-one", one, 2, SIZE);
    publish_gpu(&client, "on-zero", zero, 1, SIZE);
    let attached = client.attach("on-one").unwrap();
    let gpu = attached.gpu.as_ref().unwrap();
    assert_eq!(gpu.device_uuid(), one);
    assert_eq!(gpu.buffer().device().ordinal(), 1);
    assert!(holds_pattern(gpu, 1));
    let other = client.attach("on-zero").unwrap();
    assert_eq!(other.gpu.as_ref().unwrap().buffer().device().ordinal(), 0);
    match client.begin("on-one", &[SIZE], on(zero)) {
        Err(MemdError::Refused(Refusal::InvalidRequest {
            rule: RequestRule::Backend,
            ..
        })) => {}
        other => panic!("{:?}", other.map(|w| w.generation())),
    }
}

/// A service that has served host regions only has not loaded the CUDA driver (no
/// `libcuda` in its mappings): the GPU backend opens devices on the first GPU request.
#[test]
fn a_host_only_service_never_loads_cuda() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    common::publish(&client, "host", 2, 4096);
    let attached = client.attach("host").unwrap();
    assert!(attached.gpu.is_none());
    assert!(client.verify("host", None).unwrap().is_empty());
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", service.child.id())).unwrap();
    assert!(!maps.contains("libcuda"), "{maps}");
}

/// The discard sleep on the GPU: once the only mapper sleeps with discard, the service lets
/// the chunks go; a wake makes them again (`cuMemCreate`, then zeros: the driver does not
/// clear memory) at the same device address, and their digests are those of zeros.
#[test]
fn gpu_discard_sleep_frees_and_wake_makes_zeroed_memory_at_the_same_address() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let uuid = parse_uuid(&uuid_hex(0));
    let client = service.connect();
    publish_gpu(&client, "kv", uuid, 2, SIZE);
    let attached = client.attach("kv").unwrap();
    let address = attached.gpu.as_ref().unwrap().device_ptr();
    client.verify("kv", None).unwrap();
    let fds = settled_fd_count(&service);
    let sleeping = client.sleep_discard(attached).unwrap();
    assert_eq!(settled_fd_count(&service), fds - 2, "both chunks let go");
    let woke = client.wake(sleeping).unwrap();
    let gpu = woke.gpu.as_ref().unwrap();
    assert_eq!((woke.generation, gpu.device_ptr()), (1, address));
    assert!(gpu_common::zeroed(gpu));
    assert_eq!(client.verify("kv", None).unwrap().len(), 2);
}

/// The service's fd count once it holds still (two reads 50 ms apart agree): a connection's
/// passing fds (its pidfd, a closer's) must not be counted as a chunk.
fn settled_fd_count(service: &ServiceProc) -> usize {
    let mut last = service.fd_count();
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(50));
        let now = service.fd_count();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// An operator's sleep and wake of a GPU region (`vmm-memctl sleep`/`wake`; the same shared
/// code as on the host): the sleep lets the chunks go at once (no lease), the wake makes them
/// again before anyone attaches, and the next attach reads zeros that verify.
#[test]
fn an_operators_sleep_and_wake_of_a_gpu_region() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let uuid = parse_uuid(&uuid_hex(0));
    let client = service.connect();
    publish_gpu(&client, "kv", uuid, 2, SIZE);
    // The digests taken (the background pass holds the chunks while it reads them).
    client.verify("kv", None).unwrap();
    let fds = settled_fd_count(&service);
    assert_eq!(client.sleep_region("kv").unwrap().leases, 0);
    assert_eq!(settled_fd_count(&service), fds - 2, "both chunks let go");
    assert!(client.wake_region("kv").unwrap().zeroed);
    assert_eq!(
        settled_fd_count(&service),
        fds,
        "made again before any attach"
    );
    let attached = client.attach("kv").unwrap();
    assert!(gpu_common::zeroed(attached.gpu.as_ref().unwrap()));
    assert_eq!(client.verify("kv", None).unwrap().len(), 2);
}

/// The quota on the GPU counts rounded bytes and refuses before any chunk is created: a
/// 1-byte chunk is charged a whole granule, and a `Begin` that would pass the quota (1 GiB
/// here) is `QuotaExceeded` with the service holding no fd more.
#[test]
fn a_gpu_begin_over_the_quota_is_refused_before_allocating() {
    let service = ServiceProc::start(&[]);
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let uuid = parse_uuid(&uuid_hex(0));
    let client = service.connect();
    let writer = client.begin("tiny", &[1], on(uuid)).unwrap();
    let granule = writer.gpu().unwrap().chunk_sizes()[0];
    assert!(granule > 1 && granule.is_power_of_two());
    writer.commit().unwrap();
    assert_eq!(client.status().unwrap().used, granule);
    client.verify("tiny", None).unwrap();
    let fds = settled_fd_count(&service);
    match client.begin("big", &[1 << 30], on(uuid)) {
        Err(MemdError::Refused(Refusal::QuotaExceeded { used, asked, .. })) => {
            assert_eq!((used, asked), (granule, 1 << 30))
        }
        other => panic!("{:?}", other.map(|w| w.generation())),
    }
    assert_eq!(service.fd_count(), fds);
    assert_eq!(client.status().unwrap().used, granule);
}

/// Where the device and the processes have fabric support (an IMEX channel; `SKIP`
/// otherwise): `AttachFabric` gives the chunks as fabric handles that import (read-only here)
/// to the published bytes. After a SIGKILL and restart of the service, whose keeper holds fds
/// only, the same request copies the generation into fabric-shareable chunks: the same
/// generation, the same bytes and digests, an fd attach beside it, the quota unchanged, and
/// it holds over a second restart (the keeper holds the copies).
#[test]
fn fabric_handles_where_the_fabric_is_there() {
    let mut service = ServiceProc::start(&[]);
    if !skip_unless(vmm_core::testing::cuda_fabric()) {
        return;
    }
    let device = Device::new(0).unwrap();
    let client = service.connect();
    publish_gpu(&client, "fab", *device.uuid(), 2, SIZE);
    assert!(client.attach("fab").unwrap().gpu.unwrap().fabric());
    let attached = client.attach_fabric("fab", None).unwrap();
    assert_eq!(attached.descriptor.handles().len(), 2);
    let reader =
        VirtualMemoryResource::new(&device, ResourceOptions::default().read_only(true)).unwrap();
    let mapped = reader.import_fabric(&attached.descriptor).unwrap();
    let sizes = attached.descriptor.chunk_sizes().to_vec();
    let mut offset = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let mut bytes = vec![0u8; len];
        mapped.read_at(offset, &mut bytes).unwrap();
        assert_eq!(bytes, gpu_common::pattern(1, i, len));
        offset += len;
    }
    let digests = client.verify("fab", None).unwrap();
    let used = client.status().unwrap().used;
    drop((mapped, attached, client));
    for restart in 1..=2 {
        service.signal(libc::SIGKILL);
        let _ = service.child.wait();
        service.restart();
        let client = service.connect();
        let attached = client.attach_fabric("fab", None).unwrap_or_else(|e| {
            panic!("restart {restart}: a kept generation as fabric handles: {e:?}")
        });
        assert_eq!(
            attached.generation, 1,
            "restart {restart}: nothing reloaded"
        );
        let mapped = reader.import_fabric(&attached.descriptor).unwrap();
        let mut offset = 0;
        for (i, &len) in sizes.iter().enumerate() {
            let mut bytes = vec![0u8; len];
            mapped.read_at(offset, &mut bytes).unwrap();
            assert_eq!(
                bytes,
                gpu_common::pattern(1, i, len),
                "restart {restart}, chunk {i}"
            );
            offset += len;
        }
        assert!(attached_intact(&client.attach("fab").unwrap()));
        assert_eq!(client.verify("fab", None).unwrap(), digests);
        assert_eq!(client.status().unwrap().used, used);
    }
}
