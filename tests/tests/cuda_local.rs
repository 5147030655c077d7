//! Same-process GPU tests of `vmm_core::cuda`: allocate, copy, grow, export and import, and the
//! fd accounting rules (a buffer holds no fd, a descriptor one per chunk, an import none).
//!
//! Each test first checks `cuda_vmm_ipc()`: without a usable GPU it prints one
//! `SKIP <test>: <reason>` line and passes, unless `VMM_REQUIRE_GPU=1`, which makes it fail.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};

use vmm_core::Error;
use vmm_core::cuda::{
    Device, Granularity, HandleType, IpcDescriptor, Location, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource, importer, set_importer,
};
use vmm_core::testing::{cuda_devices, cuda_vmm_ipc, skip_unless};

/// The tests count this process's fds, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// `Some(guard)` when the GPU tests can run; otherwise skips (or fails under
/// `VMM_REQUIRE_GPU=1`) with the reason.
fn require_gpu() -> Option<MutexGuard<'static, ()>> {
    require(cuda_vmm_ipc())
}

/// [`require_gpu`] for another requirement (e.g. `cuda_devices(2)`).
fn require(requirement: Result<(), String>) -> Option<MutexGuard<'static, ()>> {
    skip_unless(requirement).then(|| SERIAL.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The start of an address range of at least `granules` of `r`'s granules that nothing holds:
/// a fresh allocation's range (which the driver chose free), given back at once. A reservation
/// hinted there finds the range free, and so does one hinted right after a buffer placed there.
/// The tests of this file run one at a time (`SERIAL`), so nothing else reserves meanwhile.
fn free_range(r: &VirtualMemoryResource, granules: usize) -> u64 {
    let g = r.granularity();
    let probe = r.allocate((granules + 1) * g).unwrap();
    let start = probe.device_ptr().next_multiple_of(g as u64);
    drop(probe);
    start
}

fn resource() -> VirtualMemoryResource {
    VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap()
}

fn open_fds() -> usize {
    vmm_core::testing::open_fds().unwrap()
}

fn read(buf: &VirtualMemoryBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    buf.read_at(offset, &mut out).unwrap();
    out
}

/// The rule text of an `InvalidArgument` (any other outcome fails the test).
#[track_caller]
fn invalid<T: std::fmt::Debug>(result: vmm_core::Result<T>) -> String {
    match result {
        Err(Error::InvalidArgument(message)) => message,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The parts of an `Error::Ipc` (any other outcome fails the test).
#[track_caller]
fn ipc<T: std::fmt::Debug>(result: vmm_core::Result<T>) -> (String, String, Error) {
    match result {
        Err(Error::Ipc { op, step, source }) => (op.into_owned(), step, *source),
        other => panic!("expected Error::Ipc, got {other:?}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn allocate_fill_and_copy() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let r = resource();
    let g = r.granularity();
    assert!(g >= 4096 && g.is_power_of_two(), "granularity {g}");

    let one = r.allocate(1).unwrap();
    assert_eq!((one.size(), one.chunk_sizes()), (1, vec![g]));
    assert!(!one.is_imported());
    assert_ne!(one.device_ptr(), 0);

    let buf = r.allocate(3 * g / 2).unwrap();
    assert_eq!(buf.chunk_sizes(), vec![2 * g]);
    buf.fill(0xab).unwrap();
    assert!(read(&buf, 0, buf.size()).iter().all(|&b| b == 0xab));
    let data = pattern(10_000, 3);
    buf.write_at(g - 5_000, &data).unwrap();
    assert_eq!(read(&buf, g - 5_000, data.len()), data);
    assert_eq!(read(&buf, g - 5_001, 1), [0xab]);

    let m = invalid(buf.read_at(buf.size() - 1, &mut [0; 2]));
    assert!(
        m.starts_with("read_at: 2 bytes at offset") && m.contains("out of bounds"),
        "{m}"
    );
    let m = invalid(buf.write_at(usize::MAX, &[1]));
    assert!(m.starts_with("write_at: 1 bytes at offset"), "{m}");

    let empty = r.allocate(0).unwrap();
    assert_eq!((empty.size(), empty.device_ptr()), (0, 0));
    empty.fill(1).unwrap();
    let d = empty.export().unwrap();
    assert_eq!((d.fds().count(), d.size()), (0, 0));
    let back = r.import(&d).unwrap();
    assert!(back.is_imported() && back.size() == 0);
}

#[test]
fn grow_in_place_and_by_relocation_are_each_forced() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    // Host memory first: between finding a free range and the grows below, nothing else of
    // this process should be placed (large host allocations are mappings too).
    let (first, second, third) = (pattern(g, 1), pattern(g, 2), pattern(g, 3));

    // In place: the buffer starts a free range, so the range right after it is free too.
    let here = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().address_hint(free_range(&r, 8)),
    )
    .unwrap();
    let a = here.allocate(g).unwrap();
    let b = here.grow(&a, 2 * g).unwrap();
    // By relocation: another allocation takes the range right after `b` (asked for there; if
    // the driver put it elsewhere, the assert below says where).
    let after_b = b.device_ptr() + b.capacity() as u64;
    let blocker = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default()
            .granularity(Granularity::Minimum)
            .address_hint(after_b),
    )
    .unwrap()
    .allocate(g)
    .unwrap();
    let c = here.grow(&b, 3 * g).unwrap();

    // `a` still holds its range, so a relocated `b` could not start where `a` does.
    assert_eq!(
        b.device_ptr(),
        a.device_ptr(),
        "with the range after the buffer free, grow is in place (same address)"
    );
    assert_eq!(b.chunk_sizes(), vec![g, g], "in place adds one chunk");
    assert_eq!(b.capacity(), 2 * g);
    a.write_at(0, &first).unwrap();
    b.write_at(g, &second).unwrap();
    assert_eq!(read(&b, 0, g), first);
    assert_eq!(read(&b, g, g), second);
    // The input stays valid and shares the first chunk (the same mapping, in place).
    a.write_at(0, &[9; 16]).unwrap();
    assert_eq!(read(&b, 0, 16), [9; 16]);
    b.write_at(g - 8, &[7; 16]).unwrap(); // across the chunk boundary
    assert_eq!(read(&a, g - 8, 8), [7; 8]);
    assert_eq!(read(&b, g - 8, 16), [7; 16]);

    // `b` still holds its range too: only an in-place grow could keep its address.
    assert_ne!(
        c.device_ptr(),
        b.device_ptr(),
        "with the range after the buffer taken (wanted at {after_b:#x}, the blocker is at {:#x}), \
         grow relocates",
        blocker.device_ptr()
    );
    assert_eq!(
        c.chunk_sizes(),
        vec![g, g, g],
        "relocation maps every chunk"
    );
    let (c_start, c_end) = (c.device_ptr(), c.device_ptr() + 3 * g as u64);
    let (b_start, b_end) = (b.device_ptr(), b.device_ptr() + 2 * g as u64);
    assert!(
        c_end <= b_start || b_end <= c_start,
        "the relocated range [{c_start:#x}, {c_end:#x}) is new, apart from [{b_start:#x}, \
         {b_end:#x})"
    );
    c.write_at(2 * g, &third).unwrap();
    let mut whole = read(&b, 0, 2 * g);
    whole.extend(&third);
    assert_eq!(
        read(&c, 0, 3 * g),
        whole,
        "the old chunks read the same at the new address"
    );
    // Both old chunks are remapped, not copied: writes through the new range reach the old one.
    c.write_at(0, &[5; 4]).unwrap();
    c.write_at(2 * g - 4, &[6; 4]).unwrap();
    assert_eq!(read(&a, 0, 4), [5; 4]);
    assert_eq!(read(&b, 2 * g - 4, 4), [6; 4]);

    // A grown buffer exports as its chunks and imports as one contiguous range.
    let d = c.export().unwrap();
    assert_eq!(d.chunk_sizes(), &[g, g, g]);
    let imported = r.import(&d).unwrap();
    assert_eq!(read(&imported, 0, 3 * g), read(&c, 0, 3 * g));

    // Grow keeps rules: no shrinking, same handle type, no growing an import.
    let m = invalid(r.grow(&c, g));
    assert_eq!(
        m,
        format!(
            "grow: new size {g} is smaller than the buffer's size {}; grow never shrinks",
            3 * g
        )
    );
    let none = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::None),
    )
    .unwrap();
    let m = invalid(none.grow(&c, 4 * g));
    assert_eq!(
        m,
        "grow: the buffer's handle type is PosixFd, this resource's option `handle_type` is None; \
         the handle type cannot change across a grow"
    );
    let m = invalid(r.grow(&imported, 4 * g));
    assert_eq!(
        m,
        "grow: an imported buffer cannot be grown: its chunks belong to the exporter; grow it \
         there and send the new buffer"
    );
    let m = invalid(none.allocate(1).unwrap().export());
    assert_eq!(
        m,
        "export: the buffer was allocated with handle type None; create its \
         VirtualMemoryResource with HandleType::PosixFd to share it"
    );
    // Within capacity: the same mapping, a larger size.
    let small = r.allocate(1).unwrap();
    let same = r.grow(&small, g).unwrap();
    assert_eq!(same.device_ptr(), small.device_ptr());
    assert_eq!((same.size(), same.chunk_sizes()), (g, vec![g]));
    drop((a, b, blocker));
    assert_eq!(
        read(&c, 0, 4),
        [5; 4],
        "chunks outlive the buffers they came from"
    );
}

#[test]
fn grow_onto_another_device_is_refused() {
    let Some(_gpu) = require(cuda_devices(2)) else {
        return;
    };
    let r = resource();
    let g = r.granularity();
    let other =
        VirtualMemoryResource::new(&Device::new(1).unwrap(), ResourceOptions::default()).unwrap();
    let buf = r.allocate(g).unwrap();
    buf.fill(0x3c).unwrap();
    let before = open_fds();
    let m = invalid(other.grow(&buf, 2 * g));
    assert_eq!(
        m,
        "grow: the buffer is on device 0, this resource allocates on device 1"
    );
    assert_eq!(open_fds(), before, "a refused grow takes no fd");
    // The buffer is untouched and grows on its own device.
    let grown = r.grow(&buf, 2 * g).unwrap();
    assert_eq!(read(&grown, g - 1, 1), [0x3c]);
}

#[test]
fn grow_with_another_location_is_refused() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    let host_options = ResourceOptions::default()
        .location(Location::HostNuma(0))
        // The location rule is checked first; no host chunk is ever made here, so the
        // handle type that host memory supports does not matter.
        .handle_type(HandleType::None);
    if !device.supports_host_numa_vmm().unwrap() {
        // No resource can have another location on this device: that is refused up front.
        let m = invalid(VirtualMemoryResource::new(&device, host_options));
        assert_eq!(
            m,
            format!(
                "option `location`: host NUMA node 0 is not offered by the driver on device 0 \
                 ({})",
                device.name()
            )
        );
        eprintln!(
            "note: device 0 has no host NUMA VMM; only the up-front refusal of the location ran"
        );
        return;
    }
    let host = VirtualMemoryResource::new(&device, host_options).unwrap();
    let buf = r.allocate(g).unwrap();
    let before = open_fds();
    let m = invalid(host.grow(&buf, 2 * g));
    assert_eq!(
        m,
        "grow: the buffer's location is Device, this resource's option `location` is HostNuma(0)"
    );
    assert_eq!(open_fds(), before, "a refused grow takes no fd");
}

#[test]
fn export_import_alias_sees_writes_both_ways() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let r = resource();
    let a = r.allocate(3 * r.granularity()).unwrap();
    a.fill(0).unwrap();
    let d = a.export().unwrap();
    assert_eq!(d.fds().count(), 1);
    assert_eq!(d.device().unwrap().uuid, *a.device().uuid());
    let b = r.import(&d).unwrap();
    drop(d);
    assert!(b.is_imported());
    assert_ne!(b.device_ptr(), a.device_ptr());
    assert_eq!(b.size(), a.size());

    a.write_at(100, b"from a").unwrap();
    assert_eq!(read(&b, 100, 6), b"from a");
    b.write_at(200, b"from b").unwrap();
    assert_eq!(read(&a, 200, 6), b"from b");
    b.fill(0x11).unwrap();
    assert_eq!(read(&a, a.size() - 1, 1), [0x11]);

    // The alias outlives the exporter's handle.
    drop(a);
    assert_eq!(read(&b, 200, 6), [0x11; 6]);
}

#[test]
fn imported_buffer_cannot_be_exported_again() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let r = resource();
    let a = r.allocate(1).unwrap();
    let b = r.import(&a.export().unwrap()).unwrap();
    let fds = open_fds();
    let m = invalid(b.export());
    assert!(
        m.starts_with("export: an imported buffer cannot be exported again")
            && m.contains("forward the descriptor")
            && m.contains("copy"),
        "{m}"
    );
    let m = invalid(vmm_core::wire::encode(&b).map(|e| e.fd_count()));
    assert!(
        m.starts_with("vmm_core::cuda::VirtualMemoryBuffer: an imported buffer cannot be")
            && m.contains("forward the descriptor"),
        "{m}"
    );
    assert_eq!(open_fds(), fds, "a refused export takes no fd");
}

#[test]
fn malformed_descriptors_are_refused_and_nothing_stays_mapped() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let r = resource();
    let g = r.min_granularity();
    let a = r.allocate(g).unwrap();
    let good = a.export().unwrap();
    let fd = good.fds().next().unwrap();
    let baseline = open_fds();

    let refused = |d: &IpcDescriptor, expect: &str| {
        let m = invalid(r.import(d));
        assert!(
            m.starts_with("invalid IpcDescriptor: ") && m.contains(expect),
            "{m}"
        );
    };
    // Layouts that from_fds accepts (it knows no granularity) but import refuses.
    refused(
        &IpcDescriptor::from_fds(&[fd], &[g + 1], HandleType::PosixFd, 1).unwrap(),
        &format!(
            "chunk 1 of 1 has size {}, not a multiple of the allocation granularity {g}",
            g + 1
        ),
    );
    refused(
        &IpcDescriptor::from_fds(&[fd, fd], &[g, g / 2], HandleType::PosixFd, 1).unwrap(),
        &format!("chunk 2 of 2 has size {}, not a multiple", g / 2),
    );
    // Layouts refused already when the descriptor is built.
    let m = invalid(IpcDescriptor::from_fds(
        &[fd],
        &[g],
        HandleType::PosixFd,
        g + 1,
    ));
    assert!(
        m.contains(&format!("size {} exceeds the {g} bytes", g + 1)),
        "{m}"
    );
    let m = invalid(IpcDescriptor::from_fds(
        &[fd],
        &[g, g],
        HandleType::PosixFd,
        g,
    ));
    assert!(m.contains("1 fd(s) for 2 chunk(s)"), "{m}");
    let m = invalid(IpcDescriptor::from_fds(&[fd], &[g], HandleType::None, g));
    assert!(
        m.contains("only PosixFd descriptors can be imported"),
        "{m}"
    );

    // Valid layout, but the fd is no CUDA allocation: refused by the driver at the first step.
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let not_cuda = IpcDescriptor::from_fds(
        &[fd, std::os::fd::AsFd::as_fd(&file)],
        &[g, g],
        HandleType::PosixFd,
        2 * g,
    )
    .unwrap();
    let (op, step, source) = ipc(r.import(&not_cuda));
    assert_eq!(op, "import");
    assert_eq!(step, format!("while importing chunk 2 of 2 ({g} bytes)"));
    assert!(
        matches!(&source, Error::Cuda { call, .. } if call == "cuMemImportFromShareableHandle"),
        "{source:?}"
    );
    drop((not_cuda, file));

    // A chunk claimed larger than it is fails only at map time: see
    // `a_map_failure_rolls_back_the_reservation_the_mappings_and_the_fds`.

    assert_eq!(open_fds(), baseline, "failed imports leave no fd behind");
    // The exporter's memory is untouched and still importable.
    a.fill(0x42).unwrap();
    let alias = r.import(&good).unwrap();
    assert_eq!(read(&alias, g - 1, 1), [0x42]);
}

/// The one failure that only the mapping step can find: a descriptor (built from real fds) that
/// claims a chunk larger than the allocation behind its fd. Nothing before `cuMemMap` can tell:
/// the driver reports no allocation's size from its handle (`CUmemAllocationProp` has no size),
/// and `cuMemMap` documents that offset + size must lie within the allocation.
#[test]
fn a_map_failure_rolls_back_the_reservation_the_mappings_and_the_fds() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    let src = r.grow(&r.allocate(g).unwrap(), 2 * g).unwrap();
    assert_eq!(src.chunk_sizes(), vec![g, g]);
    src.write_at(0, &pattern(2 * g, 5)).unwrap();
    let good = src.export().unwrap();
    let hint = free_range(&r, 8);
    let hinted =
        VirtualMemoryResource::new(&device, ResourceOptions::default().address_hint(hint)).unwrap();
    // Control: with the range free, the driver reserves an import's range at the hint.
    let control = hinted.import(&good).unwrap();
    assert_eq!(
        control.device_ptr(),
        hint,
        "precondition: a reservation hinted at a free range is placed there"
    );
    drop(control);
    let baseline = open_fds();

    // Chunk 2 claims twice its real size: both chunks import, the 3-granule range is reserved,
    // chunk 1 is mapped, and mapping chunk 2 fails.
    let fds: Vec<_> = good.fds().collect();
    let forged = IpcDescriptor::from_fds(&fds, &[g, 2 * g], HandleType::PosixFd, 3 * g).unwrap();
    assert_eq!(open_fds(), baseline + 2, "the forged descriptor's own fds");
    let (op, step, source) = ipc(hinted.import(&forged));
    assert_eq!(op, "import");
    assert_eq!(
        step,
        format!("while mapping chunk 2 of 2 ({} bytes)", 2 * g),
        "the error names the step and the chunk"
    );
    assert!(
        matches!(&source, Error::Cuda { call, .. } if call == "cuMemMap"),
        "{source:?}"
    );
    assert_eq!(open_fds(), baseline + 2, "the failed import holds no fd");
    drop(forged);
    assert_eq!(open_fds(), baseline, "fds back to the baseline");

    // Rolled back: chunk 1 was unmapped and the range given back, so the same import is placed
    // at the hint again (a range still reserved or mapped there would push it elsewhere).
    let again = hinted.import(&good).unwrap();
    assert_eq!(
        again.device_ptr(),
        hint,
        "the failed import left its reservation (or a mapping) at the hint"
    );
    assert_eq!(read(&again, 0, 2 * g), pattern(2 * g, 5));
    // The exporter's memory is untouched.
    assert_eq!(read(&src, 0, 2 * g), pattern(2 * g, 5));
}

#[test]
fn fds_exist_only_while_a_descriptor_lives() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let r = resource();
    let g = r.granularity();
    // Warm up: the driver opens its own device fds on first use.
    drop(r.import(&r.allocate(1).unwrap().export().unwrap()).unwrap());

    let baseline = open_fds();
    let a = r.allocate(g).unwrap();
    let a = r.grow(&a, 2 * g).unwrap();
    assert_eq!(open_fds(), baseline, "a buffer holds no fd");
    let d = a.export().unwrap();
    assert_eq!(open_fds(), baseline + 2, "one fd per chunk");
    let e = a.export().unwrap();
    assert_eq!(open_fds(), baseline + 4, "each export makes fresh fds");
    drop(e);
    let b = r.import(&d).unwrap();
    drop(d);
    assert_eq!(open_fds(), baseline, "an import holds no fd");

    // Over the wire: the message owns the fresh fds, the received buffer none.
    let encoded = vmm_core::wire::encode(&a).unwrap();
    assert_eq!(encoded.fd_count(), 2);
    let fds = encoded
        .fds()
        .map(|fd| fd.try_clone_to_owned().unwrap())
        .collect();
    let c: VirtualMemoryBuffer = vmm_core::wire::decode(encoded.bytes(), fds).unwrap();
    drop(encoded);
    assert_eq!(open_fds(), baseline, "decode closes the fds once imported");
    assert!(c.is_imported());
    a.fill(3).unwrap();
    assert_eq!(read(&c, 2 * g - 1, 1), [3]);
    assert_eq!(read(&b, 0, 1), [3]);
    drop((a, b, c));
    assert_eq!(open_fds(), baseline);
}

/// The open fd numbers of this process, from `/proc/self/fd`, without the listing's own.
fn open_fd_numbers() -> BTreeSet<u64> {
    // The listing takes the lowest free number: find it first, so it can be left out.
    let probe = std::fs::File::open("/dev/null").unwrap();
    let listing_fd = std::os::fd::AsRawFd::as_raw_fd(&probe) as u64;
    drop(probe);
    let mut numbers: BTreeSet<u64> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .map(|entry| {
            entry
                .unwrap()
                .file_name()
                .to_str()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    numbers.remove(&listing_fd);
    numbers
}

/// The soft `RLIMIT_NOFILE` under which exactly `free` more fds can be opened (the limit caps fd
/// numbers, not the count, so holes below the highest open fd count too).
fn limit_leaving(free: usize) -> u64 {
    let open = open_fd_numbers();
    let last_free = (0..).filter(|n| !open.contains(n)).nth(free - 1).unwrap();
    last_free + 1
}

#[test]
fn export_at_the_fd_limit_is_fd_limit_and_leaks_nothing() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let r = resource();
    let g = r.granularity();
    let mut buf = r.allocate(g).unwrap();
    for chunks in 2..=4 {
        buf = r.grow(&buf, chunks * g).unwrap();
    }
    drop(buf.export().unwrap()); // warm up the export path
    let baseline = open_fds();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    // Room for two more fds: chunks 1 and 2 export, a later one hits the limit. The other
    // tests of this file are serialised by `SERIAL`; the limit is restored before any assert.
    let low = limit_leaving(2);
    assert!(low < soft, "the limit {soft} leaves fewer than 2 fds free");
    setrlimit(Resource::RLIMIT_NOFILE, low, hard).unwrap();
    let result = buf.export();
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    let (op, step, source) = ipc(result);
    eprintln!("export at the fd limit fails {step}: {source}");
    assert_eq!(op, "export");
    assert!(
        step.starts_with("while exporting chunk ") && step.ends_with(&format!(" of 4 ({g} bytes)")),
        "{step}"
    );
    let Error::FdLimit { op, soft_limit, .. } = &source else {
        panic!("expected FdLimit, got {source:?}")
    };
    assert_eq!(*soft_limit, low, "the limit in force when export failed");
    assert!(op.contains("cuMemExportToShareableHandle"), "{op}");
    assert!(source.to_string().contains("RLIMIT_NOFILE"), "{source}");
    assert_eq!(
        open_fds(),
        baseline,
        "a failed export closes the fds it took"
    );
    // With the limit restored, the same buffer exports.
    assert_eq!(buf.export().unwrap().fds().count(), 4);
}

/// Restores the default importer of device 0 when dropped, so that a failing test leaves the
/// other tests of this process the importer they expect.
struct RestoreDefaultImporter(VirtualMemoryResource);

impl Drop for RestoreDefaultImporter {
    fn drop(&mut self) {
        set_importer(&self.0);
    }
}

#[test]
fn arriving_buffers_are_imported_into_the_registered_importer() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    let a = r.allocate(2 * g).unwrap();
    a.write_at(0, &pattern(2 * g, 7)).unwrap();

    // Unregistered: a default-options resource (no peers, no alignment, no hint).
    let default = importer(&device, Location::Device).unwrap();
    assert_eq!(default.options(), &ResourceOptions::default());
    assert_eq!(default.device(), &device);
    let plain = VirtualMemoryBuffer::import(&a.export().unwrap()).unwrap();
    assert!(plain.is_imported());
    assert_eq!(read(&plain, 0, 2 * g), pattern(2 * g, 7));

    // Registered: every arriving buffer is imported into it. Its alignment shows on each
    // reservation it makes (a hint could be ignored; an alignment is kept). 64 MiB is 32
    // granules: three imports in a row (whose reservations would otherwise lie a few granules
    // apart) all landing on it by chance is not a plausible way for this test to pass.
    const ALIGN: usize = 64 << 20;
    let options = ResourceOptions::default()
        .granularity(Granularity::Minimum)
        .alignment(ALIGN);
    let custom = VirtualMemoryResource::new(&device, options.clone()).unwrap();
    let restore = RestoreDefaultImporter(default);
    set_importer(&custom);
    assert_eq!(
        importer(&device, Location::Device).unwrap().options(),
        &options
    );

    let imported = VirtualMemoryBuffer::import(&a.export().unwrap()).unwrap();
    assert_eq!(
        imported.device_ptr() % ALIGN as u64,
        0,
        "{:#x}",
        imported.device_ptr()
    );
    assert_eq!(read(&imported, 0, 2 * g), pattern(2 * g, 7));

    // A buffer decoded from wire goes the same way.
    let encoded = vmm_core::wire::encode(&a).unwrap();
    let fds = encoded
        .fds()
        .map(|fd| fd.try_clone_to_owned().unwrap())
        .collect();
    let decoded: VirtualMemoryBuffer = vmm_core::wire::decode(encoded.bytes(), fds).unwrap();
    drop(encoded);
    assert!(decoded.is_imported());
    assert_eq!(
        decoded.device_ptr() % ALIGN as u64,
        0,
        "{:#x}",
        decoded.device_ptr()
    );
    decoded.write_at(g - 2, b"wire").unwrap();
    assert_eq!(read(&a, g - 2, 4), b"wire");

    // And through the trait shared with host buffers.
    let via_trait =
        <VirtualMemoryBuffer as vmm_core::SharedBuffer>::import(&a.export().unwrap()).unwrap();
    assert_eq!(via_trait.device_ptr() % ALIGN as u64, 0);

    // Registering again replaces it; buffers imported already keep their mapping.
    drop(restore);
    assert_eq!(
        importer(&device, Location::Device).unwrap().options(),
        &ResourceOptions::default()
    );
    assert_eq!(read(&imported, g - 2, 4), b"wire");
}

/// vmm-core makes its device's context current only for the calls that need it, and leaves the
/// calling thread's context as it found it (here: none, on a fresh thread).
#[test]
fn the_calling_threads_context_is_left_as_it_was() {
    let Some(_gpu) = require_gpu() else {
        return;
    };
    std::thread::spawn(|| {
        let r = resource();
        let buf = r.allocate(1).unwrap();
        buf.fill(1).unwrap();
        let descriptor = buf.export().unwrap();
        let alias = r.import(&descriptor).unwrap();
        assert_eq!(read(&alias, 0, 1), [1]);
        drop((alias, descriptor, buf));
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live out-pointer; libcuda is loaded and initialised (require_gpu passed).
        let rc = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) };
        assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        assert!(
            ctx.is_null(),
            "vmm-core left its context current on the calling thread"
        );
    })
    .join()
    .unwrap();
}
