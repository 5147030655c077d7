//! Rust and the standard-library Python peer (`python/vmm_ipc_peer.py`) speaking
//! docs/protocol.md over named endpoints, as processes that did not start each other.
//!
//! Host path (runs everywhere, CI included): a Rust listener serves a memfd buffer to the
//! Python peer; a Python memfd exporter sends to a Rust importer; a Python listener serves a
//! Rust client; the peer's own unit tests (version 2's fabric descriptors and byte streams
//! included), and `vmm_ipc_cuda.py`'s against a fake `cuda.bindings`. GPU (skipped without a
//! GPU, or without `cuda.bindings` in `python3`): a `cuda.bindings` exporter gives a VMM
//! buffer to a Rust importer, and a Rust export is imported by `cuda.bindings`. Each side
//! checks the other's pattern in its own mapping, and this process's fds end where they
//! started. (The fabric interop tests, both ways over an endpoint and over TCP, wait in
//! `peer_python_fabric.rs.pending` for the Rust side of protocol version 2.)
//!
//! The Python files are embedded in this executable and written to a temporary directory, so
//! a staged copy of it needs only `python3` (no checkout, no `CARGO_MANIFEST_DIR`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource};
use vmm_core::peer::Session;
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{cuda_vmm_ipc, settled_open_fds, skip_unless};
use vmm_core::wire::endpoint::{Listener, Name};
use vmm_tests::{PythonDir, own_uid, pattern, python3_can, unique_name};

const PEER: &str = include_str!("../../python/vmm_ipc_peer.py");
const CUDA: &str = include_str!("../../python/vmm_ipc_cuda.py");
const ROLES: &str = include_str!("../../python/tests/peer_roles.py");
const UNIT: &str = include_str!("../../python/tests/test_vmm_ipc_peer.py");
const UNIT_CUDA: &str = include_str!("../../python/tests/test_vmm_ipc_cuda.py");
const UNIT_FABRIC: &str = include_str!("../../python/tests/test_vmm_ipc_fabric.py");
const FAKE_CUDA: [(&str, &str); 3] = [
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

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn python_dir() -> PythonDir {
    let files = [
        ("vmm_ipc_peer.py", PEER),
        ("vmm_ipc_cuda.py", CUDA),
        ("peer_roles.py", ROLES),
        ("test_vmm_ipc_peer.py", UNIT),
        ("test_vmm_ipc_cuda.py", UNIT_CUDA),
        ("test_vmm_ipc_fabric.py", UNIT_FABRIC),
    ];
    PythonDir::new("peer-python", files.into_iter().chain(FAKE_CUDA))
}

/// `python3` can run here (3.9+, for socket.send_fds).
fn python3() -> Result<(), String> {
    python3_can("", "no python3 (3.9 or newer) on PATH")
}

/// The GPU peer can run: a GPU for vmm-core, and `cuda.bindings` in python3.
fn python_cuda() -> Result<(), String> {
    cuda_vmm_ipc()?;
    python3_can(
        "import cuda.bindings.driver",
        "python3 (3.9+) cannot import cuda.bindings (pip install cuda-python)",
    )
}

fn python(dir: &PythonDir, args: &[&str]) -> Command {
    let dir = &dir.0;
    let mut command = Command::new("python3");
    command
        .args(args)
        .current_dir(dir)
        .env("PYTHONPATH", dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// `peer_roles.py ROLE ARGS...`, started.
fn role(dir: &PythonDir, role: &str, args: &[&str]) -> Child {
    let mut all = vec!["peer_roles.py", role];
    all.extend_from_slice(args);
    python(dir, &all).spawn().unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Wait for `child` with a deadline (killing it past that); its output (after `seen`, what
/// was read from its stdout already), checked for success and an `OK` line.
fn finish_ok(child: Child, within: Duration) -> String {
    finish_ok_after(child, within, "")
}

fn finish_ok_after(mut child: Child, within: Duration, seen: &str) -> String {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().unwrap();
    let out = format!("{seen}{}", text(&output));
    assert!(
        output.status.success() && out.contains("OK "),
        "the Python peer failed ({}):\n{out}",
        output.status
    );
    out
}

fn unique(tag: &str) -> Name {
    unique_name("peer-python", tag)
}

#[test]
fn python_unit_tests() {
    // Every test counts fds or starts processes: one at a time.
    let _serial = serial();
    if !skip_unless(python3()) {
        return;
    }
    // The protocol peer's tests, and vmm_ipc_cuda's logic against a fake cuda.bindings.
    let py = python_dir();
    let output = python(
        &py,
        &[
            "-m",
            "unittest",
            "-v",
            "test_vmm_ipc_peer",
            "test_vmm_ipc_cuda",
            "test_vmm_ipc_fabric",
        ],
    )
    .output()
    .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("\nOK"), "{out}");
    assert!(
        out.contains("test_a_two_chunk_export_is_imported_over_an_endpoint")
            && out.contains("test_a_memfd_travels_both_ways_and_nothing_leaks")
            && out.contains("test_every_receipt_check_of_cuda_fabric")
            && out.contains("test_a_fabric_export_is_imported_over_tcp"),
        "{out}"
    );
}

#[test]
fn a_rust_listener_serves_a_host_buffer_to_the_python_peer() {
    // Every test counts fds or starts processes: one at a time.
    let _serial = serial();
    if !skip_unless(python3()) {
        return;
    }
    let py = python_dir();
    let dir = std::env::temp_dir().join(format!("vmm-peer-owner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for name in [unique("host"), Name::path(dir.join("owner.sock"))] {
        let before = settled_open_fds().unwrap();
        let listener = Listener::bind(&name).unwrap();
        let buf = HostBuffer::new(3 << 20).unwrap();
        buf.write_at(0, &pattern(20, buf.size())).unwrap();
        let child = role(
            &py,
            "host-client",
            &[&name.to_string(), &own_uid(), "20", "21"],
        );
        let pid = child.id() as i32;
        let conn = Session::accept(&listener, Some(Duration::from_secs(30))).unwrap();
        assert_eq!(conn.peer().pid, pid, "the kernel names the Python process");
        let descriptor = buf.export().unwrap();
        conn.send_descriptor(&descriptor).unwrap();
        drop(descriptor);
        assert_eq!(conn.recv_data().unwrap(), b"done");
        let out = finish_ok(child, Duration::from_secs(30));
        assert!(out.contains("OK mapped 3145728 bytes"), "{out}");
        assert_eq!(buf.to_vec(), pattern(21, buf.size()), "Python's writes");
        drop((conn, listener, buf));
        assert_eq!(settled_open_fds().unwrap(), before, "fds after {name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_python_memfd_exporter_sends_to_a_rust_importer() {
    // Every test counts fds or starts processes: one at a time.
    let _serial = serial();
    if !skip_unless(python3()) {
        return;
    }
    let py = python_dir();
    let name = unique("exporter");
    let before = settled_open_fds().unwrap();
    let listener = Listener::bind(&name).unwrap();
    let size = 1_000_003; // not a page multiple: the import maps exactly the size
    let child = role(
        &py,
        "host-exporter",
        &[&name.to_string(), &own_uid(), &size.to_string(), "30"],
    );
    let conn = Session::accept(&listener, Some(Duration::from_secs(30))).unwrap();
    let descriptor = conn.recv_descriptor().unwrap().into_host().unwrap();
    assert_eq!(descriptor.size(), size);
    let buf = HostBuffer::import(&descriptor).unwrap();
    drop(descriptor);
    assert_eq!(buf.to_vec(), pattern(30, size), "the exporter's pattern");
    buf.write_at(0, &pattern(31, size)).unwrap();
    conn.send_data(b"written").unwrap();
    let out = finish_ok(child, Duration::from_secs(30));
    assert!(out.contains("the importer wrote them"), "{out}");
    drop((buf, conn, listener));
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn a_python_listener_serves_a_rust_client() {
    // Every test counts fds or starts processes: one at a time.
    let _serial = serial();
    if !skip_unless(python3()) {
        return;
    }
    let py = python_dir();
    let name = unique("py-listener");
    let before = settled_open_fds().unwrap();
    let mut child = role(&py, "host-listener", &[&name.to_string(), "65536", "40"]);
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "READY" {
        line.clear();
        assert_ne!(stdout.read_line(&mut line).unwrap(), 0, "the listener died");
    }
    // The Rust client checks the Python listener's credentials (our uid) and is admitted.
    let conn = Session::connect(&name).unwrap();
    assert_eq!(conn.peer().pid, child.id() as i32);
    let buf = HostBuffer::import(&conn.recv_descriptor().unwrap().into_host().unwrap()).unwrap();
    assert_eq!(buf.to_vec(), pattern(40, 65536));
    buf.write_at(0, &pattern(41, 65536)).unwrap();
    conn.send_data(b"done").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    drop(stdout);
    let out = finish_ok_after(child, Duration::from_secs(30), &rest);
    assert!(out.contains("OK served"), "{out}");
    drop((buf, conn));
    assert_eq!(settled_open_fds().unwrap(), before);
}

// ---------------------------------------------------------------------------------------------
// GPU: cuda.bindings on the Python side.

/// Run `exchange` twice: the first run opens whatever the driver keeps open for the life of
/// the process (its first import's fds); the second must leave the fd count where it found it.
fn twice_with_baseline(mut exchange: impl FnMut(u8)) {
    exchange(50);
    let before = settled_open_fds().unwrap();
    exchange(60);
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds after the exchange"
    );
}

#[test]
fn a_python_cuda_exporter_gives_a_vmm_buffer_to_a_rust_importer() {
    // Every test counts fds or starts processes: one at a time.
    let _serial = serial();
    if !skip_unless(python_cuda()) {
        return;
    }
    let py = python_dir();
    let device = Device::new(0).unwrap();
    twice_with_baseline(|seed| {
        let name = unique("cuda-exporter");
        let listener = Listener::bind(&name).unwrap();
        // Two chunks: the import maps them back to back as one range.
        let child = role(
            &py,
            "cuda-exporter",
            &[&name.to_string(), &own_uid(), &seed.to_string(), "2"],
        );
        let conn = Session::accept(&listener, Some(Duration::from_secs(60))).unwrap();
        let descriptor = conn.recv_descriptor().unwrap().into_cuda().unwrap();
        assert_eq!(descriptor.chunk_sizes().len(), 2);
        let identity = descriptor
            .device()
            .expect("the Python exporter names its device");
        assert_eq!(&identity.uuid, device.uuid());
        let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
        drop(descriptor);
        let mut contents = vec![0u8; buf.size()];
        buf.read_at(0, &mut contents).unwrap();
        assert_eq!(
            contents,
            pattern(seed, buf.size()),
            "the exporter's pattern"
        );
        buf.write_at(0, &pattern(seed + 1, buf.size())).unwrap();
        conn.send_data(b"written").unwrap();
        let out = finish_ok(child, Duration::from_secs(60));
        assert!(out.contains("OK exported 2 chunk(s)"), "{out}");
        drop((buf, conn, listener));
    });
}

#[test]
fn a_rust_vmm_export_is_imported_by_python_cuda_bindings() {
    // Every test counts fds or starts processes: one at a time.
    let _serial = serial();
    if !skip_unless(python_cuda()) {
        return;
    }
    let py = python_dir();
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let g = resource.granularity();
    twice_with_baseline(|seed| {
        let name = unique("cuda-importer");
        let listener = Listener::bind(&name).unwrap();
        // A grown buffer (two chunks), whose size is not a chunk multiple.
        let buf = resource.allocate(g).unwrap();
        let buf = resource.grow(&buf, 2 * g - 4096).unwrap();
        assert_eq!(buf.chunk_sizes().len(), 2);
        buf.write_at(0, &pattern(seed, buf.size())).unwrap();
        let child = role(
            &py,
            "cuda-importer",
            &[&name.to_string(), &own_uid(), &seed.to_string()],
        );
        let conn = Session::accept(&listener, Some(Duration::from_secs(60))).unwrap();
        let descriptor = buf.export().unwrap();
        conn.send_descriptor(&descriptor).unwrap();
        drop(descriptor);
        assert_eq!(conn.recv_data().unwrap(), b"written");
        let out = finish_ok(child, Duration::from_secs(60));
        assert!(
            out.contains(&format!("OK imported 2 chunk(s), {} bytes", 2 * g - 4096)),
            "{out}"
        );
        let mut contents = vec![0u8; buf.size()];
        buf.read_at(0, &mut contents).unwrap();
        assert_eq!(contents, pattern(seed + 1, buf.size()), "Python's writes");
        drop((buf, conn, listener));
    });
}
