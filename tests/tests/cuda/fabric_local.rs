//! Fabric handles in one process: the descriptor as plain data (serde in JSON and postcard,
//! `from_handles`, no handle byte in `Debug` or errors), which need no GPU; then, on a GPU with
//! fabric support and an IMEX channel, allocate, export, import, the refusals, the lifetime
//! rules (a handle does not keep memory alive; a buffer in flight is kept until imported).
//!
//! The GPU tests first check `cuda_fabric()`: where fabric handles cannot be used they print one
//! `SKIP <test>: <reason>` line and pass, unless `VMM_REQUIRE_GPU=1`, which makes them fail.

use std::time::Duration;

use vmm_core::Error;
use vmm_core::cuda::{
    Device, FabricDescriptor, FabricHandle, HandleType, IpcDescriptor, ResourceOptions,
    Unavailable, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::testing::cuda_fabric;
use vmm_core::wire::{decode, encode};

use super::{alone, descriptor_refused, ipc, not_exportable, read};
use vmm_core::error::{DescriptorRule, ExportRule};

const G: usize = 2 << 20;

fn resource(handle_type: HandleType) -> VirtualMemoryResource {
    VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().handle_type(handle_type),
    )
    .unwrap()
}

fn open_fds() -> usize {
    vmm_core::testing::open_fds().unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

/// A Fabric buffer of `chunks` chunks (allocate, then grow), filled with `pattern(.., 1)`.
fn filled(r: &VirtualMemoryResource, chunks: usize) -> VirtualMemoryBuffer {
    let g = r.granularity();
    let mut buf = r.allocate(g).unwrap();
    for n in 2..=chunks {
        buf = r.grow(&buf, n * g).unwrap();
    }
    buf.write_at(0, &pattern(buf.size(), 1)).unwrap();
    buf
}

/// Handle bytes that are easy to spot in any rendering: 0xC3 everywhere but a counter.
fn secret(n: u8) -> FabricHandle {
    let mut bytes = [0xC3u8; 64];
    bytes[0] = n;
    FabricHandle::from_bytes(bytes)
}

/// Every way a handle's bytes could show up in text: hex (either case), decimal lists.
fn assert_no_handle_bytes(text: &str) {
    for leak in [
        "c3c3", "C3C3", "195, 195", "195,195", "[195", "0xc3", "0xC3",
    ] {
        assert!(
            !text.contains(leak),
            "handle bytes ({leak:?}) appear in: {text}"
        );
    }
}

fn two_chunk_descriptor() -> FabricDescriptor {
    FabricDescriptor::from_handles(&[secret(1), secret(2)], &[G, G], G + 7, [0x11; 16]).unwrap()
}

#[test]
fn descriptor_round_trips_through_json_and_postcard() {
    let d = two_chunk_descriptor();
    assert_eq!(d.handles(), &[secret(1), secret(2)]);
    assert_eq!((d.chunk_sizes(), d.size()), (&[G, G][..], G + 7));
    assert_eq!((d.owner_uuid(), d.owner_ordinal()), (&[0x11; 16], None));
    assert_eq!(d.handle_type(), HandleType::Fabric);

    let json = serde_json::to_string(&d).unwrap();
    // Human-readable formats carry each handle as 128 hex digits.
    let hex = format!("{:02x}{}", 1, "c3".repeat(63));
    assert!(json.contains(&format!("\"{hex}\"")), "{json}");
    let back: FabricDescriptor = serde_json::from_str(&json).unwrap();
    assert_eq!(back, d);

    let bytes = postcard::to_stdvec(&d).unwrap();
    assert_eq!(postcard::from_bytes::<FabricDescriptor>(&bytes).unwrap(), d);
    // Through vmm-core's own transport too: in band, no fd.
    let encoded = encode(&d).unwrap();
    assert_eq!(encoded.fd_count(), 0, "a fabric descriptor carries no fd");
    assert_eq!(
        decode::<FabricDescriptor>(encoded.bytes(), Vec::new()).unwrap(),
        d
    );
    // A handle alone, and its raw bytes, for transports of one's own.
    let h: FabricHandle =
        serde_json::from_str(&serde_json::to_string(&secret(9)).unwrap()).unwrap();
    assert_eq!(h, secret(9));
    assert_eq!(FabricHandle::from(*h.as_bytes()), h);
}

#[test]
fn debug_and_errors_never_show_handle_bytes() {
    let d = two_chunk_descriptor();
    let debug = format!("{d:?} {:?} {:#?}", secret(3), d);
    assert_no_handle_bytes(&debug);
    assert!(
        debug.contains("<2 fabric handle(s), redacted>") && debug.contains("2097152"),
        "{debug}"
    );

    // Refusals of from_handles, of serde input in both formats, and what a failed import
    // would wrap: none quotes a handle.
    let mut errors = vec![
        FabricDescriptor::from_handles(&[secret(1)], &[G, G], G, [0; 16])
            .unwrap_err()
            .to_string(),
        FabricDescriptor::from_handles(&[secret(1)], &[G], G + 1, [0; 16])
            .unwrap_err()
            .to_string(),
    ];
    let json = serde_json::to_string(&d).unwrap();
    let short = json.replacen(&"c3".repeat(63), &"c3".repeat(62), 1);
    let odd = json.replacen(&"c3".repeat(63), &format!("{}zz", "c3".repeat(62)), 1);
    let posix = json.replacen("\"handle_type\":8", "\"handle_type\":1", 1);
    let wrong_counts = json.replacen(
        &format!("\"chunk_sizes\":[{G},{G}]"),
        &format!("\"chunk_sizes\":[{G}]"),
        1,
    );
    for bad in [&short, &odd, &posix, &wrong_counts] {
        assert_ne!(bad, &json, "the test's edit did not apply");
        let err = serde_json::from_str::<FabricDescriptor>(bad).unwrap_err();
        errors.push(err.to_string());
    }
    let mut bytes = postcard::to_stdvec(&d).unwrap();
    bytes[0] = 1; // the handle type: PosixFd
    errors.push(
        decode::<FabricDescriptor>(&bytes, Vec::new())
            .unwrap_err()
            .to_string(),
    );
    for error in &errors {
        assert_no_handle_bytes(error);
    }
    assert!(
        errors[0].contains("1 handle(s) for 2 chunk(s)"),
        "{}",
        errors[0]
    );
    assert!(
        errors.iter().any(|e| e.contains("128 hex digits")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e
                .contains("handle type 1 (PosixFd): a FabricDescriptor carries fabric handles")),
        "{errors:?}"
    );
}

#[test]
fn without_fabric_the_requirement_is_a_reason_not_a_panic() {
    let Err(reason) = cuda_fabric() else {
        return;
    };
    assert!(!reason.to_string().is_empty());
    match vmm_core::cuda::availability() {
        // A GPU, but no fabric: the reason names what is missing.
        Ok(()) => assert!(
            matches!(
                reason,
                Unavailable::NoImexChannel { .. } | Unavailable::NoFabric { .. }
            ),
            "{reason:?}"
        ),
        // No usable GPU: the fabric requirement fails for the same reason.
        Err(cuda) => assert_eq!(reason.to_string(), cuda.to_string()),
    }
}

#[test]
fn fabric_export_and_import_alias_the_memory_and_hold_no_fd() {
    let Some(_gpu) = alone(cuda_fabric()) else {
        return;
    };
    let device = Device::new(0).unwrap();
    assert!(device.supports_fabric().unwrap());
    device.check_fabric().unwrap();
    let r = resource(HandleType::Fabric);
    // Warm up: the driver opens its own fds on first use.
    drop(
        r.import_fabric(&r.allocate(1).unwrap().export_fabric().unwrap())
            .unwrap(),
    );

    let baseline = open_fds();
    let a = filled(&r, 3);
    let d = a.export_fabric().unwrap();
    assert_eq!(open_fds(), baseline, "a fabric export makes no fd");
    assert_eq!(d.handles().len(), 3);
    assert_eq!(d.chunk_sizes(), a.chunk_sizes());
    assert_eq!(d.size(), a.size());
    assert_eq!(d.device().unwrap().uuid, *device.uuid());
    assert_eq!(d.owner_ordinal(), Some(0));
    assert_ne!(d.handles()[0], d.handles()[1], "one handle per chunk");

    // Plain data: any transport, e.g. JSON text.
    let d: FabricDescriptor = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
    let b = r.import_fabric(&d).unwrap();
    assert_eq!(open_fds(), baseline, "an import holds no fd");
    assert!(b.is_imported());
    assert_eq!(b.handle_type(), HandleType::Fabric);
    assert_ne!(b.device_ptr(), a.device_ptr());
    assert_eq!(b.chunk_sizes(), a.chunk_sizes());
    assert_eq!(read(&b, 0, b.size()), pattern(a.size(), 1));

    a.write_at(100, b"from a").unwrap();
    assert_eq!(read(&b, 100, 6), b"from a");
    let across = a.chunk_sizes()[0] - 3;
    b.write_at(across, b"from b").unwrap();
    assert_eq!(read(&a, across, 6), b"from b");

    // Into this process's importer, found by the owner's UUID.
    let c = VirtualMemoryBuffer::import_fabric(&d).unwrap();
    assert_eq!(read(&c, across, 6), b"from b");

    // The alias outlives the exporter: an import holds its own reference.
    drop(a);
    b.fill(0x5A).unwrap();
    assert_eq!(read(&c, 0, 4), [0x5A; 4]);
    drop((b, c));
    assert_eq!(open_fds(), baseline);
}

#[test]
fn a_fabric_handle_does_not_keep_memory_alive() {
    let Some(_gpu) = alone(cuda_fabric()) else {
        return;
    };
    let r = resource(HandleType::Fabric);
    let a = filled(&r, 1);
    let d = a.export_fabric().unwrap();
    // The exporter lets go before anyone imported: the memory is freed.
    drop(a);
    let (op, step, source) = ipc(r.import_fabric(&d));
    eprintln!("import of a released fabric handle: {step}: {source}");
    assert_eq!(op, "import");
    assert_eq!(step, format!("while importing chunk 1 of 1 ({G} bytes)"));
    assert!(
        matches!(&source, Error::Cuda { call, .. } if call == "cuMemImportFromShareableHandle"),
        "{source:?}"
    );
    assert_no_handle_bytes(&format!("{source} {step}"));
}

#[test]
fn a_fabric_buffer_in_flight_is_kept_until_the_receiver_imports() {
    let Some(_gpu) = alone(cuda_fabric()) else {
        return;
    };
    let r = resource(HandleType::Fabric);
    let a = filled(&r, 2);

    // The message carries the handles in band and one acknowledgement fd, whatever the chunks.
    let encoded = encode(&a).unwrap();
    assert_eq!(encoded.fd_count(), 1);
    assert_eq!(a.pending_imports(), 1);
    let err = a.wait_imported(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    // A message dropped unread lets go too.
    drop(encoded);
    a.wait_imported(Duration::from_secs(10)).unwrap();
    assert_eq!(a.pending_imports(), 0);

    // The sender drops its only handle while the message is in flight: the memory stays
    // until the receiver has imported it.
    let encoded = encode(&a).unwrap();
    let bytes = encoded.bytes().to_vec();
    let fds = encoded
        .fds()
        .map(|fd| fd.try_clone_to_owned().unwrap())
        .collect();
    // (The message's own copy of the ack fd closes here; `fds` holds the receiver's.)
    drop(encoded);
    drop(a);
    let b: VirtualMemoryBuffer = decode(&bytes, fds).unwrap();
    assert!(b.is_imported());
    assert_eq!(b.handle_type(), HandleType::Fabric);
    assert_eq!(read(&b, 0, b.size()), pattern(b.size(), 1));
}

#[test]
fn fabric_refusals_name_the_rule_and_leave_nothing_behind() {
    let Some(_gpu) = alone(cuda_fabric()) else {
        return;
    };
    let r = resource(HandleType::Fabric);
    let min = r.min_granularity();
    let a = filled(&r, 1);
    let g = a.chunk_sizes()[0];
    let good = a.export_fabric().unwrap();
    let handle = good.handles()[0];
    let uuid = *good.owner_uuid();
    // Warm up the importer (and the driver's own fds).
    drop(r.import_fabric(&good).unwrap());
    let baseline = open_fds();

    // Export the wrong way.
    let m = not_exportable(a.export(), ExportRule::HandleType);
    assert!(
        m.contains("handle type Fabric") && m.contains("export_fabric"),
        "{m}"
    );
    let posix = resource(HandleType::PosixFd).allocate(1).unwrap();
    let m = not_exportable(posix.export_fabric(), ExportRule::HandleType);
    assert!(
        m.starts_with("export_fabric: the buffer was allocated with handle type PosixFd")
            && m.contains("HandleType::Fabric"),
        "{m}"
    );
    let imported = r.import_fabric(&good).unwrap();
    let m = not_exportable(imported.export_fabric(), ExportRule::Imported);
    assert!(
        m.starts_with("export_fabric: an imported buffer cannot be exported again"),
        "{m}"
    );
    let m = not_exportable(
        encode(&imported).map(|e| e.fd_count()),
        ExportRule::Imported,
    );
    assert!(
        m.contains("an imported buffer cannot be exported again"),
        "{m}"
    );
    drop(imported);

    // Layouts from_handles accepts (it knows no granularity) but import refuses.
    let m = descriptor_refused(
        r.import_fabric(
            &FabricDescriptor::from_handles(&[handle], &[min / 2], min / 2, uuid).unwrap(),
        ),
        DescriptorRule::ChunkSize,
    );
    assert_eq!(
        m,
        format!(
            "invalid FabricDescriptor: chunk 1 of 1 has size {}, not a multiple of the \
             allocation granularity {min}",
            min / 2
        )
    );
    // Memory whose owner this process does not see (here: a real handle under a UUID no device
    // has) is imported for the resource's device, over the fabric; the buffer names the owner.
    let elsewhere = FabricDescriptor::from_handles(&[handle], &[g], g, [0xEE; 16]).unwrap();
    let remote = r.import_fabric(&elsewhere).unwrap();
    assert_eq!(remote.device(), r.device());
    assert_eq!(remote.owner_uuid(), [0xEE; 16]);
    assert_eq!(read(&remote, 0, g), read(&a, 0, g));
    drop(remote);
    // Without a resource: mapped for device 0, as no device here is the owner.
    let remote = VirtualMemoryBuffer::import_fabric(&elsewhere).unwrap();
    assert_eq!(remote.device().ordinal(), 0);
    assert_eq!(remote.owner_uuid(), [0xEE; 16]);
    drop(remote);
    // Memory of this device says so.
    assert_eq!(a.owner_uuid(), *a.device().uuid());
    // A POSIX-fd descriptor claiming fabric is refused by the fd path.
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let m = descriptor_refused(
        IpcDescriptor::from_fds(
            &[std::os::fd::AsFd::as_fd(&file)],
            &[g],
            HandleType::Fabric,
            g,
        )
        .map(drop),
        DescriptorRule::HandleType,
    );
    assert!(
        m.contains("handle type Fabric: only PosixFd descriptors"),
        "{m}"
    );
    drop(file);

    // A forged handle: the driver refuses it at the first step, and nothing stays.
    let forged = FabricHandle::from_bytes(std::array::from_fn(|i| (i as u8).wrapping_mul(37)));
    let (op, step, source) = ipc(r.import_fabric(
        &FabricDescriptor::from_handles(&[handle, forged], &[g, g], 2 * g, uuid).unwrap(),
    ));
    eprintln!("forged fabric handle refused {step}: {source}");
    assert_eq!(op, "import");
    assert_eq!(step, format!("while importing chunk 2 of 2 ({g} bytes)"));

    // A chunk claimed larger than it is: fails at map time, rolled back.
    let (op, step, source) = ipc(
        r.import_fabric(&FabricDescriptor::from_handles(&[handle], &[2 * g], 2 * g, uuid).unwrap())
    );
    eprintln!("oversized fabric chunk refused {step}: {source}");
    assert_eq!(op, "import");
    assert_eq!(
        step,
        format!("while mapping chunk 1 of 1 ({} bytes)", 2 * g)
    );

    assert_eq!(open_fds(), baseline, "refusals leave no fd behind");
    // The exporter's memory is untouched and still importable.
    a.fill(0x42).unwrap();
    let alias = r.import_fabric(&good).unwrap();
    assert_eq!(read(&alias, g - 1, 1), [0x42]);
}

#[test]
fn posix_fd_and_fabric_exports_both_ways_and_travels_by_fd() {
    let Some(_gpu) = alone(cuda_fabric()) else {
        return;
    };
    let r = resource(HandleType::PosixFdAndFabric);
    let a = filled(&r, 2);
    let by_fd = r.import(&a.export().unwrap()).unwrap();
    let by_fabric = r.import_fabric(&a.export_fabric().unwrap()).unwrap();
    a.write_at(5, b"both").unwrap();
    assert_eq!(read(&by_fd, 5, 4), b"both");
    assert_eq!(read(&by_fabric, 5, 4), b"both");
    assert_eq!(a.export().unwrap().handle_type(), HandleType::PosixFd);
    // Sent as a value it travels by fd (one per chunk), as a PosixFd buffer does.
    let encoded = encode(&a).unwrap();
    assert_eq!(encoded.fd_count(), 2);
    assert_eq!(a.pending_imports(), 0);
}
