//! Driver operations: vmm-core next to the same `cudarc::driver::sys` calls made directly.
//!
//! For buffers of 1, 4 and 16 chunks (2 MiB each: `allocate` once, then `grow` one chunk at a
//! time; the raw twin makes the same number of `cuMemCreate`s):
//! - export-cold: `buffer.export()` | one `cuMemExportToShareableHandle` per chunk, while no
//!   other exported fd of the allocations is alive: what a program that exports, sends and
//!   drops pays each time (about 0.56 ms a chunk on the H200). Fds closed outside the clock.
//! - export-warm: the same while another exported fd of each allocation is open (the driver
//!   then answers in tens of microseconds). Fds closed outside the clock (raw_vmm.c does the
//!   same).
//! - import: `resource.import(&descriptor)` | per chunk `cuMemImportFromShareableHandle`, one
//!   `cuMemAddressReserve` of the total, per chunk `cuMemMap` + `cuMemSetAccess`. vmm-core has
//!   no public reserve + map + set access without an import or an allocation, so this is
//!   where its map path is measured.
//! - release: dropping the imported buffer | per chunk `cuMemUnmap` + `cuMemRelease`, then
//!   `cuMemAddressFree` (the order vmm-core's handles drop in).
//!
//! And `import/<size>`: the import figure for one chunk of 2 MiB, 64 MiB and 1 GiB.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{
    Device, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};

use crate::host::{MAP_SIZES, size_name};
use crate::raw::{CUdeviceptr, CUmemGenericAllocationHandle, RawCuda};
use crate::report::{Target, row};
use crate::{Group, Kind, key};

/// The group's name.
pub const GROUP: &str = "gpu-driver";

/// Chunk counts of the export / import / release figures.
pub const CHUNKS: [usize; 3] = [1, 4, 16];

/// The driver-op target: within 3% of the raw calls.
pub const TARGET: Target = Target::RatioAtMost(1.03);

/// A vmm-core buffer of `n` chunks of `chunk` bytes: allocate, then grow one chunk at a time.
pub fn chunked(resource: &VirtualMemoryResource, chunk: usize, n: usize) -> VirtualMemoryBuffer {
    let mut buffer = resource.allocate(chunk).expect("allocate");
    for k in 2..=n {
        buffer = resource.grow(&buffer, chunk * k).expect("grow");
    }
    assert_eq!(
        buffer.chunk_sizes(),
        vec![chunk; n],
        "grow made other chunks"
    );
    buffer
}

/// The raw twin of an imported, mapped buffer.
#[derive(Debug)]
pub struct RawImport {
    handles: Vec<CUmemGenericAllocationHandle>,
    va: CUdeviceptr,
}

/// Import every fd, reserve the total, map + set access chunk by chunk.
fn raw_import(cuda: &RawCuda, fds: &[OwnedFd], chunk: usize) -> RawImport {
    let handles: Vec<_> = fds.iter().map(|fd| cuda.import(fd.as_fd())).collect();
    raw_map(cuda, handles, chunk)
}

/// Reserve the total of imported `handles` (`chunk` bytes each), map + set access chunk by
/// chunk.
pub fn raw_map(
    cuda: &RawCuda,
    handles: Vec<CUmemGenericAllocationHandle>,
    chunk: usize,
) -> RawImport {
    let va = cuda.reserve(chunk * handles.len());
    for (i, &handle) in handles.iter().enumerate() {
        let at = va + (i * chunk) as u64;
        cuda.map(at, chunk, handle);
        cuda.set_access(at, chunk);
    }
    RawImport { handles, va }
}

/// Unmap + release chunk by chunk, then free the range.
pub fn raw_release(cuda: &RawCuda, import: RawImport, chunk: usize) {
    for (i, &handle) in import.handles.iter().enumerate() {
        cuda.unmap(import.va + (i * chunk) as u64, chunk);
        cuda.release(handle);
    }
    cuda.free(import.va, chunk * import.handles.len());
}

fn time_import(resource: &VirtualMemoryResource, descriptor: &IpcDescriptor) -> Duration {
    let t = Instant::now();
    let alias = resource.import(descriptor).expect("import");
    let elapsed = t.elapsed();
    drop(alias);
    elapsed
}

fn time_raw_import(cuda: &RawCuda, fds: &[OwnedFd], chunk: usize) -> Duration {
    let t = Instant::now();
    let import = raw_import(cuda, fds, chunk);
    let elapsed = t.elapsed();
    raw_release(cuda, import, chunk);
    elapsed
}

/// export / import / release for 1, 4, 16 chunks, and import for 2 MiB, 64 MiB, 1 GiB.
pub fn gpu_driver(c: &mut Criterion, cuda: &RawCuda) {
    for n in CHUNKS {
        for op in ["export-cold", "export-warm", "import", "release"] {
            row(
                &key(GROUP, &format!("{op}/{n}-chunk/vmm-core")),
                &key(GROUP, &format!("{op}/{n}-chunk/raw")),
                TARGET,
            );
        }
    }
    for size in MAP_SIZES {
        let s = size_name(size);
        row(
            &key(GROUP, &format!("import/{s}/vmm-core")),
            &key(GROUP, &format!("import/{s}/raw")),
            TARGET,
        );
    }

    let device = Device::new(0).expect("device 0");
    let resource =
        VirtualMemoryResource::new(&device, ResourceOptions::default()).expect("resource");
    let chunk = (2usize << 20)
        .next_multiple_of(resource.granularity())
        .next_multiple_of(cuda.granularity());

    let mut group = Group::new(c, GROUP, Kind::InProcess);
    for n in CHUNKS {
        let buffer = chunked(&resource, chunk, n);
        cuda.make_current();
        let handles: Vec<_> = (0..n).map(|_| cuda.create(chunk)).collect();

        // Each figure runs interleaved with its raw twin: their ratio is what counts. Cold
        // first: no exported fd of these allocations exists yet, and each iteration closes
        // the fds it made before the next.
        let mut exported: Vec<OwnedFd> = Vec::with_capacity(n);
        let mut export_pair = |group: &mut Group<'_>, figure: &str| {
            group.bench_pair(
                &format!("{figure}/{n}-chunk"),
                (&format!("{figure}/{n}-chunk/vmm-core"), || {
                    let t = Instant::now();
                    let descriptor = buffer.export().expect("export");
                    let elapsed = t.elapsed();
                    drop(descriptor);
                    elapsed
                }),
                (&format!("{figure}/{n}-chunk/raw"), || {
                    cuda.make_current();
                    let t = Instant::now();
                    for &handle in &handles {
                        exported.push(cuda.export(handle));
                    }
                    let elapsed = t.elapsed();
                    exported.clear();
                    elapsed
                }),
            );
        };
        export_pair(&mut group, "export-cold");
        // Warm: one exported fd of every allocation stays open from here on (the descriptor
        // and fds the import figures use).
        let descriptor = buffer.export().expect("export");
        let fds: Vec<OwnedFd> = handles.iter().map(|&h| cuda.export(h)).collect();
        export_pair(&mut group, "export-warm");
        group.bench_pair(
            &format!("import/{n}-chunk"),
            (&format!("import/{n}-chunk/vmm-core"), || {
                time_import(&resource, &descriptor)
            }),
            (&format!("import/{n}-chunk/raw"), || {
                cuda.make_current();
                time_raw_import(cuda, &fds, chunk)
            }),
        );
        group.bench_pair(
            &format!("release/{n}-chunk"),
            (&format!("release/{n}-chunk/vmm-core"), || {
                let alias = resource.import(&descriptor).expect("import");
                let t = Instant::now();
                drop(alias);
                t.elapsed()
            }),
            (&format!("release/{n}-chunk/raw"), || {
                cuda.make_current();
                let import = raw_import(cuda, &fds, chunk);
                let t = Instant::now();
                raw_release(cuda, import, chunk);
                t.elapsed()
            }),
        );

        drop(fds);
        cuda.make_current();
        for handle in handles {
            cuda.release(handle);
        }
    }

    for size in MAP_SIZES {
        let s = size_name(size);
        let size = size.next_multiple_of(chunk);
        let buffer = resource.allocate(size).expect("allocate");
        let descriptor = buffer.export().expect("export");
        cuda.make_current();
        let handle = cuda.create(size);
        let fds = vec![cuda.export(handle)];
        group.bench_pair(
            &format!("import/{s}"),
            (&format!("import/{s}/vmm-core"), || {
                time_import(&resource, &descriptor)
            }),
            (&format!("import/{s}/raw"), || {
                cuda.make_current();
                time_raw_import(cuda, &fds, size)
            }),
        );
        drop(fds);
        cuda.make_current();
        cuda.release(handle);
    }
    group.finish();
}
