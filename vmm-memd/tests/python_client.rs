//! The Python client (`python/vmm_memd`) against a real `vmm-memd`: this test executable plays
//! the service (see `common`), publishes a region from Rust, and runs the Python tests
//! (`python/tests/test_memd_*.py`, unittest) with `python3`; then it attaches what Python
//! published and checks it here. Also: `python -m vmm_memd` starts the service, and `pip
//! install ./python` into a fresh venv gives the venv the service and the client.
//!
//! The Python files are embedded in this executable and written to a temporary directory, so a
//! staged copy of it needs only `python3` and numpy (no checkout); the pip install alone needs
//! the checkout (it builds the wheel from it) and skips without one. Without `python3` (3.9+), or
//! without numpy 2.1+ where the service tests need it, a test prints one `SKIP` line and
//! passes, unless `VMM_REQUIRE_PYTHON=1` (or `VMM_REQUIRE_GPU=1`, as for every skip in the GPU
//! runs) asks for a failure instead.

mod common;
#[path = "common/gpu.rs"]
mod gpu_common;
#[path = "common/python.rs"]
mod python;

use std::io::Write;

use common::{ServiceProc, fill_byte, publish};
use python::{DEADLINE, PythonDir, assert_passed, python3_can, run_unless};
use vmm_memd::protocol::Dtype;

/// The `vmm_ipc_peer` package, module by module.
const PEER: &[(&str, &str)] = &include!("../../python/vmm_ipc_peer_files.rs");

/// The `vmm_memd` package (with the CUDA helper it imports for GPU regions).
const MEMD: &[(&str, &str)] = &include!("../../python/vmm_memd_files.rs");

/// The packaging, and the tests.
const FILES: [(&str, &str); 16] = [
    (
        "pyproject.toml",
        include_str!("../../python/pyproject.toml"),
    ),
    ("README.md", include_str!("../../python/README.md")),
    (
        "test_memd_service.py",
        include_str!("../../python/tests/test_memd_service.py"),
    ),
    (
        "test_memd_codec.py",
        include_str!("../../python/tests/test_memd_codec.py"),
    ),
    (
        "test_memd_client.py",
        include_str!("../../python/tests/test_memd_client.py"),
    ),
    (
        "test_memd_hostile.py",
        include_str!("../../python/tests/test_memd_hostile.py"),
    ),
    (
        "test_memd_restart.py",
        include_str!("../../python/tests/test_memd_restart.py"),
    ),
    (
        "test_memd_install.py",
        include_str!("../../python/tests/test_memd_install.py"),
    ),
    (
        "test_memd_sleep.py",
        include_str!("../../python/tests/test_memd_sleep.py"),
    ),
    (
        "test_memd_gpu_fake.py",
        include_str!("../../python/tests/test_memd_gpu_fake.py"),
    ),
    (
        "test_memd_gpu_torch.py",
        include_str!("../../python/tests/test_memd_gpu_torch.py"),
    ),
    (
        "test_memd_torch.py",
        include_str!("../../python/tests/test_memd_torch.py"),
    ),
    (
        "test_memd_keep_alive.py",
        include_str!("../../python/tests/test_memd_keep_alive.py"),
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

/// `python3` (3.9+) with numpy 2.1+ (DLPack 1.0: read-only arrays).
fn python3_with_numpy() -> Result<(), String> {
    python3_can("", "no python3 (3.9 or newer) on PATH").and_then(|()| {
        python3_can(
            "import numpy; assert tuple(map(int, numpy.__version__.split('.')[:2])) >= (2, 1)",
            "python3 has no numpy 2.1 or newer (python3 -m pip install numpy)",
        )
    })
}

#[test]
fn the_python_client_publishes_attaches_and_refuses_against_the_service() {
    let test = "the_python_client_publishes_attaches_and_refuses_against_the_service";
    if !run_unless(test, python3_with_numpy()) {
        return;
    }
    let service = ServiceProc::start(&[]);
    let rust = service.connect();
    let region = format!("rust-for-python-{}", std::process::id());
    let size = 10_000u64;
    let generation = publish(&rust, &region, 1, size);
    let py = PythonDir::new("client", &[PEER, MEMD, &FILES]);
    let env = [
        ("VMM_MEMD_SOCKET", service.socket.clone()),
        ("VMM_MEMD_QUOTA", "1073741824".to_owned()),
        (
            "VMM_MEMD_RUST_REGION",
            format!("{region}:{size}:{}", fill_byte(generation)),
        ),
    ];
    let (ok, out) = py.unittest(
        &[
            "test_memd_codec",
            "test_memd_client",
            "test_memd_hostile",
            "test_memd_gpu_fake",
            "test_memd_sleep",
            "test_memd_torch",
        ],
        &env,
    );
    assert!(ok && out.contains("\nOK"), "{out}");
    assert_passed(
        &out,
        &[
            "test_published_arrays_come_back_zero_copy_and_read_only",
            "test_an_array_keeps_its_mapping_alive_and_lets_it_go",
            "test_a_reader_cannot_write_through_the_mapping",
            "test_a_legacy_consumer_gets_the_unversioned_capsule_zero_copy",
            "test_bfloat16_and_other_dtypes_travel_as_buffer_dtype_shape",
            "test_refusals_arrive_typed",
            "test_a_kept_view_makes_the_commit_still_mapped_until_it_goes",
            "test_a_region_rust_published_reads_here",
            "test_publish_for_rust",
            "test_hostile_replies_are_refused",
            "test_a_chunk_not_sealed_against_writes_is_not_mapped",
            "test_a_truncated_reply_is_refused",
            "test_unknown_variants_are_refused",
            "test_chunks_are_imported_read_only_and_exported_by_dlpack_on_the_device",
            "test_another_device_or_a_mismatched_chunk_is_refused_and_the_lease_given_back",
            "test_a_refused_discard_sleep_leaves_the_attachment_mapped_and_leased",
            "test_a_wake_the_driver_refuses_keeps_the_range_and_gives_the_lease_back",
            "test_a_driver_refusal_is_typed_and_leaves_nothing",
            "test_without_cuda_bindings_a_gpu_region_is_GpuRegion",
            "test_host_and_cuda_arrays_are_copied_in_described_and_committed",
            "test_a_reply_with_smaller_chunks_aborts_and_a_non_contiguous_array_is_refused",
            "test_the_layout_hash_is_vmm_memds",
            "test_wake_maps_the_next_generation_at_the_same_addresses",
            "test_another_layout_is_stale_and_the_region_stays_asleep",
            "test_a_discard_sleep_wakes_to_zeroed_memory",
            "test_a_closed_sleeper_gives_its_addresses_back_and_cannot_wake",
            "test_tensors_go_in_order_at_aligned_offsets_of_one_chunk",
            "test_a_new_chunk_starts_when_the_next_tensor_would_pass_chunk_bytes",
            "test_a_tensor_larger_than_chunk_bytes_gets_a_chunk_of_its_own_size",
            "test_every_tensor_lies_inside_its_chunk_for_random_state_dicts",
            "test_tied_weights_are_stored_once_under_both_names",
            "test_tensors_without_bytes_take_no_room",
            "test_more_chunks_than_a_generation_holds_is_too_many_chunks",
            "test_the_default_packs_a_llama_into_few_chunks",
            "test_bad_names_and_sizes_are_refused",
            "test_a_dtype_vmm_memd_cannot_name_is_unsupported_dtype",
            "test_a_tokened_commit_is_known_and_its_token_is_not_taken_twice",
        ],
    );
    // Where python3 has torch (the GPU machine), a state dict on a host region, bound to a
    // model built on the meta device, ran too.
    if python3_can("import torch", "").is_ok() {
        assert_passed(
            &out,
            &[
                "test_a_model_built_on_meta_runs_on_the_published_state_zero_copy",
                "test_views_scalars_empty_tensors_and_several_chunks_round_trip",
                "test_what_cannot_be_published_is_refused_typed_before_anything_is_sent",
                "test_tensors_that_do_not_fit_the_model_are_state_dict_mismatch",
                "test_tensors_are_views_of_one_import_per_chunk_and_odd_offsets_still_work",
                "test_a_model_with_load_state_dict_hooks_is_bound_through_load_state_dict",
            ],
        );
    }
    // Another uid's view needs root (and a python3 that uid 65534 can run): where CI asks for
    // the Python tests to run, as root, it must have run.
    if common::is_root() && std::env::var("VMM_REQUIRE_PYTHON").is_ok_and(|v| v == "1") {
        assert_passed(&out, &["test_acls_give_reads_and_refuse_writes_typed"]);
    }
    // What Python published, read by Rust: the metadata as Python wrote it, the bytes.
    let attached = rust
        .attach(&format!("{region}-from-python"))
        .expect("attach Python's region");
    let meta = &attached.meta["pattern"];
    assert_eq!(
        (meta.dtype, meta.shape.as_slice()),
        (Dtype::U8, &[4096u64][..])
    );
    let expected: Vec<u8> = (0..4096).map(|i| i as u8).collect();
    assert_eq!(attached.tensor("pattern").unwrap(), expected.as_slice());
}

/// `python -m vmm_memd` (with `VMM_MEMD_BIN` naming this test executable, which plays
/// `vmm-memd`) serves on the socket `Client.connect()` uses when given none, and stops on
/// SIGTERM with status 0; its defaults and its typed error without a `vmm-memd`
/// (`test_memd_service.py`).
#[test]
fn python_m_vmm_memd_serves_the_clients_default_socket() {
    let test = "python_m_vmm_memd_serves_the_clients_default_socket";
    if !run_unless(test, python3_can("", "no python3 (3.9 or newer) on PATH")) {
        return;
    }
    let py = PythonDir::new("python-m", &[PEER, MEMD, &FILES]);
    let env = [
        ("VMM_MEMD_BIN", common::test_exe().display().to_string()),
        (common::PROGRAM_VAR, "vmm-memd".to_owned()),
    ];
    let (ok, out) = py.unittest(&["test_memd_service"], &env);
    assert!(ok && out.contains("\nOK"), "{out}");
    assert_passed(
        &out,
        &[
            "test_the_client_and_the_service_default_to_the_same_socket",
            "test_the_command_adds_only_what_the_arguments_leave_out",
            "test_the_program_is_found_in_the_first_directory_that_has_it",
            "test_a_missing_program_is_typed_and_says_where_it_looked",
            "test_python_m_vmm_memd_without_the_program_exits_127_and_says_why",
            "test_python_m_vmm_memd_serves_a_client_that_names_no_socket",
        ],
    );
}

/// `pip install ./python` into a fresh venv (`test_memd_install.py`): maturin, fetched from
/// PyPI by pip, builds the wheel with the `vmm-memd` and `vmm-memctl` programs in it, in
/// release, in this workspace's target directory (`CARGO_TARGET_DIR`: what an earlier release
/// build compiled is reused); then `python -m vmm_memd` from the venv serves, the venv's
/// Python publishes and attaches a host region, and SIGTERM stops the service with status 0.
///
/// Needs the checkout (a staged test executable has none), `python3` that makes a venv with
/// pip, and a package index for maturin: each missing is one `SKIP` line, a failure only under
/// `VMM_REQUIRE_PYTHON=1` (CI; the GPU runs, staged without a checkout, do not set it).
#[test]
fn pip_install_gives_a_fresh_venv_the_service_and_the_client() {
    let test = "pip_install_gives_a_fresh_venv_the_service_and_the_client";
    if !run_unless(test, python3_can("", "no python3 (3.9 or newer) on PATH")) {
        return;
    }
    let skip = |why: &str, out: &str| {
        assert!(
            std::env::var("VMM_REQUIRE_PYTHON").map_or(true, |v| v != "1"),
            "{test}: skipped under VMM_REQUIRE_PYTHON=1: {why}\n{out}"
        );
        let _ = std::io::stderr().write_all(format!("SKIP {test}: {why}\n").as_bytes());
    };
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../python");
    if !source.join("pyproject.toml").exists() {
        return skip(&format!("no checkout at {}", source.display()), "");
    }
    // The workspace's target directory (CARGO_TARGET_TMPDIR is its `tmp/`).
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .to_owned();
    let py = PythonDir::new("install", &[PEER, MEMD, &FILES]);
    let env = [
        ("VMM_PYTHON_SOURCE", source.display().to_string()),
        ("CARGO_TARGET_DIR", target.display().to_string()),
    ];
    let started = std::time::Instant::now();
    let (ok, out) = py.unittest_within(
        &["test_memd_install"],
        &env,
        std::time::Duration::from_secs(1500),
    );
    assert!(ok && out.contains("\nOK"), "{out}");
    for why in [
        "cannot make a venv with pip here",
        "cannot fetch maturin for the build",
    ] {
        if out.contains(why) {
            return skip(why, &out);
        }
    }
    assert_passed(
        &out,
        &[
            "test_the_venv_has_the_packages_and_the_programs",
            "test_python_m_vmm_memd_serves_what_the_venv_publishes_and_attaches",
        ],
    );
    println!("{test}: {:.0?} in all\n{out}", started.elapsed());
}

#[test]
fn a_python_reader_sees_service_gone_and_reattaches_after_a_restart() {
    let test = "a_python_reader_sees_service_gone_and_reattaches_after_a_restart";
    if !run_unless(test, python3_with_numpy()) {
        return;
    }
    let mut service = ServiceProc::start(&[]);
    let py = PythonDir::new("restart", &[PEER, MEMD, &FILES]);
    let control = py.0.join("control");
    std::fs::create_dir(&control).unwrap();
    let env = [
        ("VMM_MEMD_SOCKET", service.socket.clone()),
        ("VMM_MEMD_RESTART_DIR", control.display().to_string()),
    ];
    let (ok, out) = std::thread::scope(|scope| {
        let python = scope.spawn(|| py.unittest(&["test_memd_restart"], &env));
        // Python has published, attached and made its array: kill the service under it.
        let ready = common::until(DEADLINE, || {
            control.join("ready").exists() || python.is_finished()
        });
        assert!(ready.is_some(), "the Python reader never got ready");
        if control.join("ready").exists() {
            service.signal(libc::SIGKILL);
            service.child.wait().unwrap();
            service.restart();
            std::fs::write(control.join("restarted"), b"").unwrap();
        }
        python.join().unwrap()
    });
    assert!(ok && out.contains("\nOK"), "{out}");
    assert_passed(
        &out,
        &["test_a_restart_is_service_gone_and_the_mapping_stays"],
    );
}

/// The Python client renews its leases by itself (`test_memd_keep_alive.py`): against two
/// services of short TTLs (400 ms and 30 ms), a lease kept for 5 TTLs and lost by TTL once
/// renewal is off, renewals every 10 ms that never come between a call and its reply, and
/// none while a call holds the connection.
#[test]
fn the_python_client_keeps_its_leases_alive() {
    let test = "the_python_client_keeps_its_leases_alive";
    if !run_unless(test, python3_with_numpy()) {
        return;
    }
    let slow = ServiceProc::start(&["--lease-ttl-ms", "400"]);
    let fast = ServiceProc::start(&["--lease-ttl-ms", "30"]);
    let py = PythonDir::new("keep-alive", &[PEER, MEMD, &FILES]);
    let env = [
        ("VMM_MEMD_SOCKET_TTL_400", slow.socket.clone()),
        ("VMM_MEMD_SOCKET_TTL_30", fast.socket.clone()),
    ];
    let (ok, out) = py.unittest(&["test_memd_keep_alive"], &env);
    assert!(ok && out.contains("\nOK"), "{out}");
    assert_passed(
        &out,
        &[
            "test_a_client_keeps_its_lease_past_the_ttl_until_told_not_to",
            "test_renewals_never_come_between_a_call_and_its_reply",
            "test_a_renewal_waits_for_the_call_that_holds_the_connection",
            "test_closing_a_client_ends_its_renewal_thread",
        ],
    );
}

/// A GPU region published from Rust, attached from Python on the real driver and given to
/// torch by DLPack (`test_memd_gpu_torch.py`): zero-copy, the bytes Rust wrote, read-only for
/// the device, valid after the lease. Needs a GPU, and `python3` with torch (CUDA) and
/// cuda.bindings: SKIP otherwise, a failure under `VMM_REQUIRE_GPU=1`.
#[test]
fn torch_attaches_a_gpu_region_zero_copy_from_python() {
    let test = "torch_attaches_a_gpu_region_zero_copy_from_python";
    let service = ServiceProc::start(&[]);
    if !vmm_core::testing::skip_unless(vmm_core::testing::cuda_vmm_ipc()) {
        return;
    }
    let torch = python3_can(
        "import torch, numpy; from cuda.bindings import driver; assert torch.cuda.is_available()",
        "python3 has no torch with CUDA, numpy or cuda.bindings",
    );
    if !run_unless(test, torch) {
        return;
    }
    let rust = service.connect();
    let region = format!("gpu-for-torch-{}", std::process::id());
    let uuid = gpu_common::parse_uuid(&gpu_common::uuid_hex(0));
    let generation = gpu_common::publish_gpu(&rust, &region, uuid, 2, 3 << 20);
    let py = PythonDir::new("torch", &[PEER, MEMD, &FILES]);
    let env = [
        ("VMM_MEMD_SOCKET", service.socket.clone()),
        ("VMM_MEMD_GPU_REGION", format!("{region}:{generation}")),
    ];
    let (ok, out) = py.unittest(&["test_memd_gpu_torch"], &env);
    assert!(ok && out.contains("\nOK"), "{out}");
    assert_passed(
        &out,
        &[
            "test_torch_gets_the_mapping_zero_copy_with_what_rust_published",
            "test_torch_tensors_published_from_python_come_back_equal",
            "test_a_torch_tensor_over_a_slept_region_reads_the_woken_generation",
        ],
    );
    println!("{out}");
}

/// The request bytes the Python codec's tests expect (`test_memd_codec.py`) are what postcard
/// writes for the same values here.
#[test]
fn the_python_codecs_golden_requests_are_postcards() {
    use vmm_memd::protocol::{Acl, Backend, Principal, Request, TensorMeta};
    let bytes = |r: &Request| postcard::to_allocvec(r).unwrap();
    let begin = Request::Begin {
        region: "r".into(),
        chunks: vec![4096, 1],
        acl: Acl {
            read: vec![Principal::Uid(7)],
            write: vec![],
            delete: vec![Principal::Gid(128)],
        },
        wait_ms: 5,
    };
    assert_eq!(
        bytes(&begin),
        b"\x02\x01r\x02\x80\x20\x01\x01\x00\x07\x00\x01\x01\x80\x01\x05"
    );
    let meta = TensorMeta {
        chunk: 1,
        offset: 256,
        len: 8,
        dtype: Dtype::BF16,
        shape: vec![2, 2],
    };
    assert_eq!(
        bytes(&Request::PutMeta(vec![("k".into(), meta)])),
        b"\x03\x01\x01k\x01\x80\x02\x08\x09\x02\x02\x02"
    );
    let uuid: [u8; 16] = std::array::from_fn(|i| i as u8);
    let begin_on = Request::BeginOn {
        region: "r".into(),
        chunks: vec![4096],
        acl: Acl::default(),
        wait_ms: 5,
        backend: Backend::Gpu { uuid },
    };
    let mut expected = b"\x0b\x01r\x01\x80\x20\x00\x00\x00\x05\x01".to_vec();
    expected.extend_from_slice(&uuid);
    assert_eq!(bytes(&begin_on), expected);
    // A commit token: 16 bytes as they are (`encode_token`, `encode_commit_state`).
    let mut expected = b"\x11".to_vec();
    expected.extend_from_slice(&uuid);
    assert_eq!(bytes(&Request::Token { token: uuid }), expected);
    let mut expected = b"\x12\x01r".to_vec();
    expected.extend_from_slice(&uuid);
    let state = Request::CommitState {
        region: "r".into(),
        token: uuid,
    };
    assert_eq!(bytes(&state), expected);
    // An operator's release of everything (`encode_release_all`), and its reply and refusal
    // (which the Python client decodes as `Released` and `NotAdmin`).
    assert_eq!(bytes(&Request::ReleaseAll), b"\x13");
    let reply = vmm_memd::protocol::Response::Released {
        regions: 3,
        busy: 1,
    };
    assert_eq!(postcard::to_allocvec(&reply).unwrap(), b"\x10\x03\x01");
    let refused = vmm_memd::protocol::Response::Refused(vmm_memd::Refusal::NotAdmin { uid: 7 });
    assert_eq!(postcard::to_allocvec(&refused).unwrap(), b"\x00\x0e\x07");
}

/// The layout hash the Python client takes before a sleep (`vmm_memd.layout_hash`, and
/// `layout_hash_on` for a GPU region, checked with these values in `test_memd_sleep.py`) is
/// vmm-memd's.
#[test]
fn the_python_layout_hash_is_vmm_memds() {
    use std::collections::BTreeMap;
    use vmm_memd::protocol::{Backend, TensorMeta};
    let tensor = |chunk, offset, len, dtype, shape: &[u64]| TensorMeta {
        chunk,
        offset,
        len,
        dtype,
        shape: shape.to_vec(),
    };
    let meta = BTreeMap::from([
        ("b".to_owned(), tensor(1, 16, 8, Dtype::F32, &[2])),
        ("a".to_owned(), tensor(0, 0, 4096, Dtype::U8, &[4096])),
    ]);
    assert_eq!(
        vmm_memd::layout_hash(&[4096, 8192], &meta),
        16_243_066_540_437_555_579
    );
    // On a GPU (`vmm_memd.layout_hash_on`, the fake driver's UUID 0..=15), and on the host.
    let uuid: [u8; 16] = std::array::from_fn(|i| i as u8);
    assert_eq!(
        vmm_memd::layout_hash_on(&[4096, 8192], &meta, Backend::Gpu { uuid }),
        6_180_394_435_458_095_547
    );
    assert_eq!(
        vmm_memd::layout_hash_on(&[4096, 8192], &meta, Backend::Host),
        16_243_066_540_437_555_579
    );
}
