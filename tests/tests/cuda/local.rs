//! Same-process GPU tests of `vmm_core::cuda`: allocate, copy, export and import (growing is
//! `grow`'s), and the fd accounting rules (a buffer holds no fd, a descriptor one per chunk, an
//! import none).
//!
//! Each test first checks `cuda_vmm_ipc()`: without a usable GPU it prints one
//! `SKIP <test>: <reason>` line and passes, unless `VMM_REQUIRE_GPU=1`, which makes it fail.

use std::collections::BTreeSet;

use vmm_core::Error;
use vmm_core::cuda::{
    Device, Granularity, HandleType, IpcDescriptor, Location, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource, importer, set_importer,
};
use vmm_core::testing::cuda_vmm_ipc;

use super::{alone, descriptor_refused, ipc, not_exportable, option_refused, read, resource};
use vmm_core::error::{DescriptorRule, ExportRule, OptionRule};

pub(super) fn open_fds() -> usize {
    vmm_core::testing::open_fds().unwrap()
}

pub(super) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The start of an address range of at least `granules` of `r`'s granules that nothing holds:
/// a fresh allocation's range (which the driver chose free), given back at once. A reservation
/// hinted there finds the range free, and so does one hinted right after a buffer placed there.
/// The same-process tests run alone (`alone`), so nothing else reserves meanwhile.
pub(super) fn free_range(r: &VirtualMemoryResource, granules: usize) -> u64 {
    let g = r.granularity();
    let probe = r.allocate((granules + 1) * g).unwrap();
    let start = probe.device_ptr().next_multiple_of(g as u64);
    drop(probe);
    start
}

#[test]
fn allocate_fill_and_copy() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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

    let size = buf.size();
    let err = buf.read_at(size - 1, &mut [0; 2]).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfBounds { op, offset, len: 2, size: s }
            if op == "read_at" && *offset == size - 1 && *s == size),
        "{err:?}"
    );
    let err = buf.write_at(usize::MAX, &[1]).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfBounds { op, offset: usize::MAX, len: 1, .. }
            if op == "write_at"),
        "{err:?}"
    );

    let empty = r.allocate(0).unwrap();
    assert_eq!((empty.size(), empty.device_ptr()), (0, 0));
    empty.fill(1).unwrap();
    let d = empty.export().unwrap();
    assert_eq!((d.fds().count(), d.size()), (0, 0));
    let back = r.import(&d).unwrap();
    assert!(back.is_imported() && back.size() == 0);
}

#[test]
fn copy_from_copies_on_the_device_across_chunk_boundaries() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
        return;
    };
    let r = resource();
    let g = r.granularity();
    // The source: one chunk of 4 granules, a pattern in it.
    let src = r.allocate(4 * g).unwrap();
    let data = pattern(4 * g, 7);
    src.write_at(0, &data).unwrap();
    // The destination: two chunks of 2 granules (two exports imported as one buffer), so the
    // copy crosses a chunk boundary of one side in the middle of the other's chunk.
    let (left, right) = (r.allocate(2 * g).unwrap(), r.allocate(2 * g).unwrap());
    let (dl, dr) = (left.export().unwrap(), right.export().unwrap());
    let fds: Vec<_> = dl.fds().chain(dr.fds()).collect();
    let both = IpcDescriptor::from_fds(&fds, &[2 * g, 2 * g], HandleType::PosixFd, 4 * g).unwrap();
    let dst = r.import(&both).unwrap();
    assert_eq!(dst.chunk_sizes(), vec![2 * g, 2 * g]);
    dst.copy_from(&src).unwrap();
    assert_eq!(read(&dst, 0, 4 * g), data);
    assert_eq!(read(&right, 0, 2 * g), data[2 * g..]);
    // And back, from two chunks into one.
    src.fill(0).unwrap();
    src.copy_from(&dst).unwrap();
    assert_eq!(read(&src, 0, 4 * g), data);

    // Refused before any driver call: another size, a read-only destination.
    let small = r.allocate(g).unwrap();
    option_refused(small.copy_from(&src), "src", OptionRule::Conflict);
    let reader = VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().read_only(true),
    )
    .unwrap();
    let read_only = reader.import(&src.export().unwrap()).unwrap();
    option_refused(read_only.copy_from(&dst), "read_only", OptionRule::Conflict);
    assert_eq!(read(&src, 0, 4 * g), data, "a refused copy wrote nothing");
}

#[test]
fn export_import_alias_sees_writes_both_ways() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
        return;
    };
    let r = resource();
    let a = r.allocate(1).unwrap();
    let b = r.import(&a.export().unwrap()).unwrap();
    let fds = open_fds();
    let m = not_exportable(b.export(), ExportRule::Imported);
    // What to do instead, as people read it.
    assert!(
        m.starts_with("export: an imported buffer cannot be exported again")
            && m.contains("forward the descriptor")
            && m.contains("copy"),
        "{m}"
    );
    let m = not_exportable(
        vmm_core::wire::encode(&b).map(|e| e.fd_count()),
        ExportRule::Imported,
    );
    assert!(
        m.starts_with("vmm_core::cuda::VirtualMemoryBuffer: an imported buffer cannot be")
            && m.contains("forward the descriptor"),
        "{m}"
    );
    assert_eq!(open_fds(), fds, "a refused export takes no fd");
}

#[test]
fn malformed_descriptors_are_refused_and_nothing_stays_mapped() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
        return;
    };
    let r = resource();
    let g = r.min_granularity();
    let a = r.allocate(g).unwrap();
    let good = a.export().unwrap();
    let fd = good.fds().next().unwrap();
    let baseline = open_fds();

    let refused = |d: &IpcDescriptor, expect: &str| {
        let m = descriptor_refused(r.import(d), DescriptorRule::ChunkSize);
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
    let m = descriptor_refused(
        IpcDescriptor::from_fds(&[fd], &[g], HandleType::PosixFd, g + 1),
        DescriptorRule::Size,
    );
    assert!(
        m.contains(&format!("size {} exceeds the {g} bytes", g + 1)),
        "{m}"
    );
    let m = descriptor_refused(
        IpcDescriptor::from_fds(&[fd], &[g, g], HandleType::PosixFd, g),
        DescriptorRule::Fds,
    );
    assert!(m.contains("1 fd(s) for 2 chunk(s)"), "{m}");
    let m = descriptor_refused(
        IpcDescriptor::from_fds(&[fd], &[g], HandleType::None, g),
        DescriptorRule::HandleType,
    );
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
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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
    // same-process tests run alone (`alone`); the limit is restored before any assert.
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
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
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

/// A sleep and wake at the same addresses: `into_address_range` unmaps a buffer and keeps
/// its range reserved (a clone of the buffer refuses it), an allocation hinted at the range
/// meanwhile is placed elsewhere, and `import_at` maps the memory there again with its bytes.
/// A range of the wrong size is refused before any driver call, and a failed mapping gives
/// the range back, unmapped, to use again.
#[test]
fn a_buffer_unmapped_into_its_range_is_imported_there_again() {
    let Some(_gpu) = alone(cuda_vmm_ipc()) else {
        return;
    };
    let device = Device::new(0).unwrap();
    let r = resource();
    let g = r.granularity();
    let src = r.allocate(2 * g).unwrap();
    src.write_at(0, &pattern(2 * g, 9)).unwrap();
    let descriptor = src.export().unwrap();
    let alias = r.import(&descriptor).unwrap();
    let ptr = alias.device_ptr();
    // Another handle lives: the buffer comes back unchanged.
    let clone = alias.clone();
    let alias = alias.into_address_range().unwrap_err();
    assert_eq!(alias.device_ptr(), ptr);
    drop(clone);
    let range = alias.into_address_range().unwrap();
    assert_eq!((range.device_ptr(), range.size()), (ptr, 2 * g));
    // The range stays taken while nothing is mapped in it.
    let hinted =
        VirtualMemoryResource::new(&device, ResourceOptions::default().address_hint(ptr)).unwrap();
    let squatter = hinted.allocate(2 * g).unwrap();
    assert_ne!(
        squatter.device_ptr(),
        ptr,
        "the kept range was free to take"
    );
    // A descriptor of another size: refused, the range given back.
    let small = r.allocate(g).unwrap().export().unwrap();
    let failed = r.import_at(&small, range).unwrap_err();
    let (e, range) = *failed;
    assert!(
        matches!(
            &e,
            Error::InvalidDescriptor {
                rule: DescriptorRule::Size,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(range.device_ptr(), ptr);
    // The wake: the same addresses, the same bytes.
    let back = r.import_at(&descriptor, range).unwrap();
    assert_eq!(back.device_ptr(), ptr);
    assert_eq!(read(&back, 0, 2 * g), pattern(2 * g, 9));
    drop(back);
    // A mapping that fails part way gives the range back unmapped: chunk 2 claims twice its
    // size, so mapping it fails after chunk 1 was mapped; then the real descriptor maps.
    let three = r.allocate(3 * g).unwrap();
    let three_descriptor = three.export().unwrap();
    let range = r
        .import(&three_descriptor)
        .unwrap()
        .into_address_range()
        .unwrap();
    let ptr = range.device_ptr();
    let twice = r
        .grow(&r.allocate(g).unwrap(), 2 * g)
        .unwrap()
        .export()
        .unwrap();
    let fds: Vec<_> = twice.fds().collect();
    let forged = IpcDescriptor::from_fds(&fds, &[g, 2 * g], HandleType::PosixFd, 3 * g).unwrap();
    let (e, range) = *r.import_at(&forged, range).unwrap_err();
    assert!(matches!(&e, Error::Ipc { .. }), "{e:?}");
    assert_eq!(range.device_ptr(), ptr);
    let again = r.import_at(&three_descriptor, range).unwrap();
    assert_eq!(again.device_ptr(), ptr);
}
