//! The GPU path end to end without a GPU: the real `vmm-memd` and vmm-core run on a fake
//! `libcuda.so` (`vmm-fake-driver`: one device, allocations that are memfds, device addresses
//! that are host addresses), the real Python client (`python/vmm_memd`) on the fake
//! cuda.bindings (`python/tests/fake_cuda`, the same model and device UUID). So the bytes the
//! service sends for a GPU region meet the Python client on every commit, in CI, where before
//! they met it only on a GPU machine (issue 32: the service's `CUDA_VMM` descriptors named no
//! device, and the Python client refused them; a Python forgery of the service had named one).
//!
//! Each test's body runs in a fresh exec of this test executable on the fake driver
//! (`common/fake_driver.rs`); the service it starts inherits it.
//!
//! Needs `python3` (3.9+; not numpy) for the service test: SKIP without it, a failure under
//! `VMM_REQUIRE_PYTHON=1` (or `VMM_REQUIRE_GPU=1`).

mod common;
#[path = "common/fake_driver.rs"]
mod fake_driver;
#[path = "common/gpu.rs"]
mod gpu_common;
#[path = "common/python.rs"]
mod python;

use std::os::fd::{AsFd, AsRawFd};

use common::ServiceProc;
use fake_driver::on_fake_driver;
use python::PythonDir;
use vmm_core::cuda::{Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryResource};
use vmm_fake_driver::{DEVICE_UUID, GRANULARITY};

/// The `vmm_ipc_peer` package, module by module.
const PEER: &[(&str, &str)] = &include!("../../python/vmm_ipc_peer_files.rs");

/// The `vmm_memd` package (with the CUDA helper it imports for GPU regions).
const MEMD: &[(&str, &str)] = &include!("../../python/vmm_memd_files.rs");

/// The tests, and the fake cuda.bindings they put first on the path.
const FILES: [(&str, &str); 4] = [
    (
        "test_memd_gpu_service.py",
        include_str!("../../python/tests/test_memd_gpu_service.py"),
    ),
    (
        "fake_cuda/cuda/__init__.py",
        include_str!("../../python/tests/fake_cuda/cuda/__init__.py"),
    ),
    (
        "fake_cuda/cuda/bindings/__init__.py",
        include_str!("../../python/tests/fake_cuda/cuda/bindings/__init__.py"),
    ),
    (
        "fake_cuda/cuda/bindings/driver.py",
        include_str!("../../python/tests/fake_cuda/cuda/bindings/driver.py"),
    ),
];

/// What vmm-core's GPU tests do first, on the fake: the availability check passes, no fabric;
/// a buffer allocated, grown to two chunks, written across the boundary, exported (one memfd
/// of the fake per chunk), imported read-only and read back; an fd that is no exported
/// allocation refused by the driver.
#[test]
fn vmm_cores_gpu_path_runs_on_the_fake_driver() {
    on_fake_driver("vmm_cores_gpu_path_runs_on_the_fake_driver", || {
        vmm_core::testing::cuda_vmm_ipc().expect("vmm-core's GPU check passes on the fake");
        let device = Device::new(0).unwrap();
        let fabric = device.check_fabric().unwrap_err();
        assert!(
            matches!(fabric, vmm_core::Error::FabricUnsupported { .. }),
            "{fabric:?}"
        );
        let resource = VirtualMemoryResource::new(&device, ResourceOptions::default()).unwrap();
        assert_eq!(resource.granularity(), GRANULARITY);
        let small = resource.allocate(GRANULARITY).unwrap();
        let buffer = resource.grow(&small, 2 * GRANULARITY).unwrap();
        assert_eq!(buffer.chunk_sizes(), [GRANULARITY; 2]);
        let bytes = gpu_common::pattern(1, 0, buffer.size());
        buffer.write_at(0, &bytes).unwrap();

        let descriptor = buffer.export().unwrap();
        for fd in descriptor.fds() {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
            assert_eq!(link.to_str(), Some("/memfd:fake-cuda (deleted)"));
        }
        let reader =
            VirtualMemoryResource::new(&device, ResourceOptions::default().read_only(true))
                .unwrap();
        let imported = reader.import(&descriptor).unwrap();
        assert!(imported.is_imported());
        let mut read = vec![0u8; imported.size()];
        imported.read_at(0, &mut read).unwrap();
        assert!(read == bytes, "the import reads other bytes");
        let mut across = [0u8; 8];
        imported.read_at(GRANULARITY - 4, &mut across).unwrap();
        assert_eq!(across, bytes[GRANULARITY - 4..GRANULARITY + 4]);
        assert!(
            imported.write_at(0, b"x").is_err(),
            "read-only refuses writes"
        );
        // Written through the exporter, seen through the import: one memory.
        buffer.fill(7).unwrap();
        imported.read_at(GRANULARITY - 4, &mut across).unwrap();
        assert_eq!(across, [7; 8]);

        // A memfd that is no exported allocation (a host region's chunk, say).
        let memfd = nix::sys::memfd::memfd_create(
            c"vmm-memd-chunk",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .unwrap();
        nix::unistd::ftruncate(&memfd, GRANULARITY as i64).unwrap();
        let forged = IpcDescriptor::from_fds(
            &[memfd.as_fd()],
            &[GRANULARITY],
            HandleType::PosixFd,
            GRANULARITY,
        )
        .unwrap();
        let err = reader.import(&forged).unwrap_err();
        assert!(
            err.to_string().contains("cuMemImportFromShareableHandle"),
            "{err}"
        );
    });
}

/// Bytes Python publishes under `host` (`HOST_BYTES` in `test_memd_gpu_service.py`).
fn host_bytes() -> Vec<u8> {
    (0..4096).map(|i| i as u8).collect()
}

/// Bytes Python copies from its device memory under `device` (`DEVICE_BYTES`).
fn device_bytes() -> Vec<u8> {
    (0..256u32).map(|i| ((i * 7 + 3) % 256) as u8).collect()
}

/// The real service on the fake driver, the real Python client on the fake cuda.bindings: a
/// GPU region Rust published attaches in Python (read-only, the bytes, verified); Python
/// publishes one (from host and device memory) and attaches it back, fills a writer's two
/// chunks; Python sleeps and wakes GPU regions at a stable device address (the same
/// generation, a republished one, a changed layout refused with the range kept, a discard
/// sleep woken to zeros, a hinted reservation kept out of the slept range); then Rust
/// attaches what Python published and reads its bytes.
#[test]
fn python_and_rust_exchange_gpu_regions_through_the_service_on_fake_drivers() {
    let test = "python_and_rust_exchange_gpu_regions_through_the_service_on_fake_drivers";
    if !python::run_unless(test, python::python3()) {
        return;
    }
    on_fake_driver(test, || {
        let service = ServiceProc::start(&[]);
        let rust = service.connect();
        let pid = std::process::id();
        let region = format!("rust-gpu-for-python-{pid}");
        let generation = gpu_common::publish_gpu(&rust, &region, DEVICE_UUID, 2, 3 << 20);
        let from_python = format!("python-gpu-for-rust-{pid}");
        let py = PythonDir::new("fake-gpu", &[PEER, MEMD, &FILES]);
        let env = [
            ("VMM_MEMD_SOCKET", service.socket.clone()),
            ("VMM_MEMD_GPU_REGION", format!("{region}:{generation}")),
            ("VMM_MEMD_GPU_FROM_PYTHON", from_python.clone()),
        ];
        let (ok, out) = py.unittest(&["test_memd_gpu_service"], &env);
        assert!(ok && out.contains("\nOK"), "{out}");
        python::assert_passed(
            &out,
            &[
                "test_a_region_rust_published_attaches_here_read_only",
                "test_a_region_published_here_attaches_back_and_verifies",
                "test_a_writer_fills_two_chunks_commits_and_aborts",
                "test_the_fake_refuses_an_fd_that_is_no_allocation",
                "test_a_sleep_and_wake_keep_the_device_address_and_the_bytes",
                "test_a_republished_layout_wakes_onto_the_new_generation_at_the_same_address",
                "test_a_changed_layout_is_stale_and_the_range_stays_reserved",
                "test_a_discard_sleep_wakes_to_zeros_at_the_same_address",
            ],
        );

        // What Python published, attached here: read-only, no fabric, the bytes.
        let attached = rust
            .attach(&from_python)
            .expect("attach Python's GPU region");
        let gpu = attached.gpu.as_ref().expect("a GPU region");
        assert!(gpu.is_read_only() && !gpu.fabric());
        assert_eq!(gpu.device_uuid(), DEVICE_UUID);
        let read = |key: &str| {
            let meta = &attached.meta[key];
            let at = gpu.chunk_offset(meta.chunk as usize).unwrap() + meta.offset;
            let mut bytes = vec![0u8; meta.len as usize];
            gpu.buffer().read_at(at as usize, &mut bytes).unwrap();
            bytes
        };
        assert_eq!(read("host"), host_bytes());
        assert_eq!(read("device"), device_bytes());
        rust.verify(&from_python, None)
            .expect("Python's bytes are those digested at its commit");
    });
}
