//! Fabric handles: vmm-core's fabric export and import next to the same raw driver calls, and
//! fabric hand-offs to a live child next to the POSIX-fd ones of the same run.
//!
//! - `gpu-fabric` (in process, interleaved with the raw twin), for 1, 4 and 16 chunks:
//!   - export: `buffer.export_fabric()` | one `cuMemExportToShareableHandle` (fabric) per
//!     chunk into a preallocated array;
//!   - import: `resource.import_fabric(&descriptor)` | per chunk
//!     `cuMemImportFromShareableHandle` (fabric), one `cuMemAddressReserve` of the total, per
//!     chunk `cuMemMap` + `cuMemSetAccess`. Released outside the clock.
//!   - with two GPUs, `import-remote-owner/1-chunk`: device 0's memory imported for device 1
//!     (the owner is not the importing device), next to the same-device import.
//! - `gpu-fabric-handoff` (a live child, as in `gpu-handoff`): a `FabricDescriptor` through a
//!   `Queue` (the child imports it) next to `gpu-handoff/descriptor/*`, and a Fabric buffer
//!   through the queue (exported on the way, about a microsecond) next to
//!   `gpu-handoff/buffer-cold/*`, the POSIX-fd buffer whose export on the way is the cold one a
//!   program that sends and drops pays, and `gpu-handoff/buffer/*` (warm).
//!
//! Both groups need fabric handles ([`availability`]); where they cannot be used each prints
//! one `SKIP <group>: <reason>` line instead.

use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{
    Device, FabricDescriptor, HandleType, ResourceOptions, Unavailable, VirtualMemoryBuffer,
    VirtualMemoryResource,
};

use crate::driver::{CHUNKS, TARGET, chunked, raw_map, raw_release};
use crate::handoff::{self, bench_live};
use crate::raw::{CUmemFabricHandle, RawCuda};
use crate::report::{Target, row};
use crate::{Group, Kind, key};

/// The in-process group.
pub const GROUP: &str = "gpu-fabric";
/// The hand-off group.
pub const HANDOFF_GROUP: &str = "gpu-fabric-handoff";

/// The fabric export target: at most 150 ns added per chunk to the raw calls. A fabric export
/// takes 60-400 ns, so a ratio against it would be decided by noise; what vmm-core adds (its
/// checks, one context switch, the descriptor's two allocations) is bounded instead.
pub fn export_target(chunks: usize) -> Target {
    Target::AddedPerChunkAtMost { chunks, ns: 150.0 }
}

/// The hand-off target for a Fabric buffer against a POSIX-fd buffer that exports (cold) on
/// the way: well below it.
pub const BUFFER_TARGET: Target = Target::RatioAtMost(0.5);

/// Whether fabric handles can be used here (vmm-core's own check: device 0 offers them and
/// this process has an IMEX channel); `Err` is the reason.
pub fn availability() -> Result<(), Unavailable> {
    vmm_core::cuda::fabric_availability()
}

fn fabric_resource() -> VirtualMemoryResource {
    let device = Device::new(0).expect("device 0");
    VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )
    .expect("fabric resource")
}

/// export / import for 1, 4, 16 chunks, each next to its raw twin.
pub fn gpu_fabric(c: &mut Criterion, cuda: &RawCuda) {
    for n in CHUNKS {
        row(
            &key(GROUP, &format!("export/{n}-chunk/vmm-core")),
            &key(GROUP, &format!("export/{n}-chunk/raw")),
            export_target(n),
        );
        row(
            &key(GROUP, &format!("import/{n}-chunk/vmm-core")),
            &key(GROUP, &format!("import/{n}-chunk/raw")),
            TARGET,
        );
    }
    let resource = fabric_resource();
    let chunk = (2usize << 20)
        .next_multiple_of(resource.granularity())
        .next_multiple_of(cuda.granularity());

    let mut group = Group::new(c, GROUP, Kind::InProcess);
    for n in CHUNKS {
        let buffer = chunked(&resource, chunk, n);
        cuda.make_current();
        let handles: Vec<_> = (0..n).map(|_| cuda.create_fabric(chunk)).collect();

        let mut exported: Vec<CUmemFabricHandle> = Vec::with_capacity(n);
        group.bench_pair(
            &format!("export/{n}-chunk"),
            (&format!("export/{n}-chunk/vmm-core"), || {
                let t = Instant::now();
                let descriptor = buffer.export_fabric().expect("export_fabric");
                let elapsed = t.elapsed();
                drop(descriptor);
                elapsed
            }),
            (&format!("export/{n}-chunk/raw"), || {
                cuda.make_current();
                let t = Instant::now();
                for &handle in &handles {
                    exported.push(cuda.export_fabric(handle));
                }
                let elapsed = t.elapsed();
                exported.clear();
                elapsed
            }),
        );

        let descriptor = buffer.export_fabric().expect("export_fabric");
        cuda.make_current();
        let fabric: Vec<CUmemFabricHandle> =
            handles.iter().map(|&h| cuda.export_fabric(h)).collect();
        group.bench_pair(
            &format!("import/{n}-chunk"),
            (&format!("import/{n}-chunk/vmm-core"), || {
                let t = Instant::now();
                let alias = resource.import_fabric(&descriptor).expect("import_fabric");
                let elapsed = t.elapsed();
                drop(alias);
                elapsed
            }),
            (&format!("import/{n}-chunk/raw"), || {
                cuda.make_current();
                let t = Instant::now();
                let imported = fabric.iter().map(|h| cuda.import_fabric(h)).collect();
                let import = raw_map(cuda, imported, chunk);
                let elapsed = t.elapsed();
                raw_release(cuda, import, chunk);
                elapsed
            }),
        );

        cuda.make_current();
        for handle in handles {
            cuda.release(handle);
        }
    }
    bench_remote_owner(&mut group, &resource, chunk);
    group.finish();
}

/// `import-remote-owner/1-chunk`: device 0's memory imported for device 1 (the owner is not the
/// importing device; the driver maps it over NVLink), next to `import/1-chunk/vmm-core` of the
/// same run. Needs two GPUs; one `SKIP` line otherwise.
fn bench_remote_owner(group: &mut Group<'_>, owner: &VirtualMemoryResource, chunk: usize) {
    let id = "import-remote-owner/1-chunk";
    if Device::count().unwrap_or(0) < 2 {
        eprintln!("SKIP {GROUP}/{id}: needs two CUDA devices");
        return;
    }
    row(
        &key(GROUP, id),
        &key(GROUP, "import/1-chunk/vmm-core"),
        Target::None,
    );
    let importer = VirtualMemoryResource::new(
        &Device::new(1).expect("device 1"),
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )
    .expect("fabric resource on device 1");
    let buffer = chunked(owner, chunk, 1);
    let descriptor = buffer.export_fabric().expect("export_fabric");
    group.bench(id, || {
        let t = Instant::now();
        let alias = importer
            .import_fabric(&descriptor)
            .expect("import_fabric of device 0's memory for device 1");
        let elapsed = t.elapsed();
        drop(alias);
        elapsed
    });
}

/// A Fabric descriptor and a Fabric buffer handed to a live child under both methods; rows
/// against the POSIX-fd hand-offs of `gpu-handoff` (run before, in the same process).
pub fn gpu_fabric_handoff(c: &mut Criterion) {
    for method in handoff::METHODS {
        row(
            &key(HANDOFF_GROUP, &format!("descriptor/{method}")),
            &key(handoff::GROUP, &format!("descriptor/{method}")),
            Target::None,
        );
        row(
            &key(HANDOFF_GROUP, &format!("buffer/{method}")),
            &key(handoff::GROUP, &format!("buffer-cold/{method}")),
            BUFFER_TARGET,
        );
        row(
            &key(HANDOFF_GROUP, &format!("buffer/{method}")),
            &key(handoff::GROUP, &format!("buffer/{method}")),
            Target::None,
        );
    }
    let resource = fabric_resource();
    let size = (2usize << 20).next_multiple_of(resource.granularity());
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor: Option<FabricDescriptor> = Some(buffer.export_fabric().expect("export"));
    let buffer: Option<VirtualMemoryBuffer> = Some(buffer);

    let mut group = Group::new(c, HANDOFF_GROUP, Kind::Processes);
    for method in handoff::METHODS {
        bench_live(
            &mut group,
            &format!("descriptor/{method}"),
            method,
            &descriptor,
        );
    }
    for method in handoff::METHODS {
        bench_live(&mut group, &format!("buffer/{method}"), method, &buffer);
    }
    group.finish();
    // Every child has imported (each hand-off waited for its ack); nothing is kept for them.
    if let Some(buffer) = &buffer {
        buffer
            .wait_imported(Duration::from_secs(10))
            .expect("fabric hand-off children are done with the buffer");
    }
}
