//! Rust and the standard-library Python peer exchanging fabric descriptors (protocol version 2,
//! `CUDA_FABRIC`: one 64-byte fabric handle per chunk, no fds), both ways, over a named
//! endpoint and over TCP loopback with the byte-stream framing:
//!
//! - a `cuda.bindings` exporter (`python/vmm_ipc_cuda.py`) gives a fabric buffer to a Rust
//!   importer (`VirtualMemoryBuffer::import_fabric`), which checks its pattern and writes its
//!   mark; the Python side checks the mark in its own mapping;
//! - a Rust export (`export_fabric`) is imported by `cuda.bindings`, which writes its mark; the
//!   Rust side checks it.
//!
//! The exporter keeps its buffer until the importer's `DATA` reply: a fabric handle keeps
//! nothing alive. Skipped (one `SKIP` line each) where fabric handles cannot be used (no GPU,
//! no fabric support, no IMEX channel) or `python3` cannot import `cuda.bindings`; a failure
//! under `VMM_REQUIRE_GPU=1`. The Python files are embedded, as in `peer_python.rs`.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::cuda::{
    Device, HandleType, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::peer::Session;
use vmm_core::testing::{cuda_fabric, settled_open_fds, skip_unless};
use vmm_core::wire::endpoint::{Listener, Name};
use vmm_tests::{PythonDir, own_uid, pattern, python3_can, unique_name};

const TIMEOUT: Duration = Duration::from_secs(60);

const PEER: &str = include_str!("../../python/vmm_ipc_peer.py");
const CUDA: &str = include_str!("../../python/vmm_ipc_cuda.py");
const ROLES: &str = include_str!("../../python/tests/peer_roles.py");

/// The Rust v2 API these tests use, in one place.
mod v2 {
    use std::io::{Read, Write};

    use vmm_core::cuda::FabricDescriptor;
    use vmm_core::peer::stream::{StreamReader, StreamWriter};
    use vmm_core::peer::{PeerMessage, Session};
    use vmm_core::{Error, Result};

    /// Send a fabric descriptor on an endpoint connection.
    pub fn send(conn: &Session, descriptor: &FabricDescriptor) -> Result<()> {
        conn.send_descriptor(descriptor)
    }

    /// Receive a fabric descriptor on an endpoint connection.
    pub fn recv(conn: &Session) -> Result<FabricDescriptor> {
        conn.recv_descriptor()?.into_fabric()
    }

    /// Write a fabric descriptor as one message on a byte stream.
    pub fn write_fabric(stream: &mut impl Write, descriptor: &FabricDescriptor) -> Result<()> {
        StreamWriter::new(stream).write_descriptor(descriptor)
    }

    /// Write a DATA message on a byte stream.
    pub fn write_data(stream: &mut impl Write, bytes: &[u8]) -> Result<()> {
        StreamWriter::new(stream).write_data(bytes)
    }

    /// Read one message from a byte stream: a fabric descriptor.
    pub fn read_fabric(stream: &mut impl Read) -> Result<FabricDescriptor> {
        match StreamReader::new(stream).read_message()? {
            PeerMessage::Descriptor(d) => d.into_fabric(),
            PeerMessage::Data(b) => Err(Error::Protocol(format!(
                "expected a CUDA_FABRIC message, got DATA of {} bytes",
                b.len()
            ))),
        }
    }

    /// Read one message from a byte stream: DATA.
    pub fn read_data(stream: &mut impl Read) -> Result<Vec<u8>> {
        match StreamReader::new(stream).read_message()? {
            PeerMessage::Data(b) => Ok(b),
            PeerMessage::Descriptor(d) => Err(Error::Protocol(format!(
                "expected DATA, got a descriptor ({d:?})"
            ))),
        }
    }
}

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn python_dir() -> PythonDir {
    let files = [
        ("vmm_ipc_peer.py", PEER),
        ("vmm_ipc_cuda.py", CUDA),
        ("peer_roles.py", ROLES),
    ];
    PythonDir::new("peer-python-fabric", files)
}

/// Fabric handles work here for vmm-core (a GPU with fabric support and an IMEX channel), and
/// `python3` (3.9+) imports a `cuda.bindings` that knows fabric handles.
fn python_fabric() -> Result<(), String> {
    cuda_fabric()?;
    python3_can(
        "from cuda.bindings import driver; \
         driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC",
        "python3 (3.9+) cannot import a cuda.bindings with fabric handles \
         (pip install cuda-python)",
    )
}

/// `peer_roles.py ROLE ARGS...`, started.
fn role(dir: &PythonDir, role: &str, args: &[&str]) -> Child {
    Command::new("python3")
        .arg("peer_roles.py")
        .arg(role)
        .args(args)
        .current_dir(&dir.0)
        .env("PYTHONPATH", &dir.0)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Wait for `child` with a deadline (killing it past that); its output, checked for success
/// and an `OK` line.
fn finish_ok(mut child: Child) -> String {
    let deadline = Instant::now() + TIMEOUT;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().unwrap();
    let out = text(&output);
    assert!(
        output.status.success() && out.contains("OK "),
        "the Python peer failed ({}):\n{out}",
        output.status
    );
    out
}

/// The Python peer's TCP connection, or a failure with its output if it exits (or takes
/// longer than [`TIMEOUT`]) without connecting.
fn accept_tcp(listener: &TcpListener, child: &mut Child) -> TcpStream {
    listener.set_nonblocking(true).unwrap();
    let started = Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                stream.set_read_timeout(Some(TIMEOUT)).unwrap();
                stream.set_write_timeout(Some(TIMEOUT)).unwrap();
                return stream;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
        if child.try_wait().unwrap().is_some() || started.elapsed() > TIMEOUT {
            let _ = child.kill();
            let mut out = String::new();
            if let Some(stdout) = child.stdout.take() {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
            panic!("the Python peer never connected:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn unique(tag: &str) -> Name {
    unique_name("peer-python-fabric", tag)
}

/// Run `exchange` twice: the first run opens whatever the driver keeps open for the life of
/// the process; the second must leave the fd count where it found it.
fn twice_with_baseline(mut exchange: impl FnMut(u8)) {
    exchange(90);
    let before = settled_open_fds().unwrap();
    exchange(100);
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds after the exchange"
    );
}

fn fabric_resource() -> VirtualMemoryResource {
    VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )
    .unwrap()
}

/// The Rust importer's half: import, check the exporter's pattern, write the mark (seed + 1).
fn import_check_mark(descriptor: &vmm_core::cuda::FabricDescriptor, seed: u8) {
    assert_eq!(descriptor.chunk_sizes().len(), 2);
    assert_eq!(
        descriptor.owner_uuid(),
        Device::new(0).unwrap().uuid(),
        "the Python exporter names its device as the owner"
    );
    let debug = format!("{descriptor:?}");
    assert!(debug.contains("redacted"), "{debug}");
    let buf = VirtualMemoryBuffer::import_fabric(descriptor).unwrap();
    let mut contents = vec![0u8; buf.size()];
    buf.read_at(0, &mut contents).unwrap();
    assert_eq!(
        contents,
        pattern(seed, buf.size()),
        "the exporter's pattern"
    );
    buf.write_at(0, &pattern(seed + 1, buf.size())).unwrap();
}

/// A grown Rust fabric buffer (two chunks, a size that is not a chunk multiple) with
/// `pattern(seed)`.
fn rust_export(resource: &VirtualMemoryResource, seed: u8) -> VirtualMemoryBuffer {
    let g = resource.granularity();
    let buf = resource.allocate(g).unwrap();
    let buf = resource.grow(&buf, 2 * g - 4096).unwrap();
    assert_eq!(buf.chunk_sizes().len(), 2);
    buf.write_at(0, &pattern(seed, buf.size())).unwrap();
    buf
}

fn check_mark(buf: &VirtualMemoryBuffer, seed: u8) {
    let mut contents = vec![0u8; buf.size()];
    buf.read_at(0, &mut contents).unwrap();
    assert_eq!(contents, pattern(seed + 1, buf.size()), "Python's mark");
}

#[test]
fn python_fabric_export_to_rust_over_an_endpoint() {
    let _serial = serial();
    if !skip_unless(python_fabric()) {
        return;
    }
    let py = python_dir();
    twice_with_baseline(|seed| {
        let name = unique("py-exports");
        let listener = Listener::bind(&name).unwrap();
        let seed_arg = seed.to_string();
        let child = role(
            &py,
            "fabric-exporter",
            &["endpoint", &name.to_string(), &own_uid(), &seed_arg, "2"],
        );
        let conn = Session::accept(&listener, Some(TIMEOUT)).unwrap();
        let descriptor = v2::recv(&conn).unwrap();
        import_check_mark(&descriptor, seed);
        conn.send_data(b"written").unwrap();
        let out = finish_ok(child);
        assert!(out.contains("OK exported 2 fabric chunk(s)"), "{out}");
        drop((conn, listener));
    });
}

#[test]
fn rust_fabric_export_to_python_over_an_endpoint() {
    let _serial = serial();
    if !skip_unless(python_fabric()) {
        return;
    }
    let py = python_dir();
    let resource = fabric_resource();
    let g = resource.granularity();
    twice_with_baseline(|seed| {
        let name = unique("rust-exports");
        let listener = Listener::bind(&name).unwrap();
        let buf = rust_export(&resource, seed);
        let seed_arg = seed.to_string();
        let child = role(
            &py,
            "fabric-importer",
            &["endpoint", &name.to_string(), &own_uid(), &seed_arg],
        );
        let conn = Session::accept(&listener, Some(TIMEOUT)).unwrap();
        v2::send(&conn, &buf.export_fabric().unwrap()).unwrap();
        // The buffer stays until the importer says it has imported (and written).
        assert_eq!(conn.recv_data().unwrap(), b"written");
        let out = finish_ok(child);
        assert!(
            out.contains(&format!(
                "OK imported 2 fabric chunk(s), {} bytes over endpoint",
                2 * g - 4096
            )),
            "{out}"
        );
        check_mark(&buf, seed);
        drop((buf, conn, listener));
    });
}

#[test]
fn python_fabric_export_to_rust_over_tcp() {
    let _serial = serial();
    if !skip_unless(python_fabric()) {
        return;
    }
    let py = python_dir();
    twice_with_baseline(|seed| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seed_arg = seed.to_string();
        let mut child = role(
            &py,
            "fabric-exporter",
            &["tcp", &addr, &own_uid(), &seed_arg, "2"],
        );
        let mut stream = accept_tcp(&listener, &mut child);
        let descriptor = v2::read_fabric(&mut stream).unwrap();
        import_check_mark(&descriptor, seed);
        v2::write_data(&mut stream, b"written").unwrap();
        let out = finish_ok(child);
        assert!(out.contains("OK exported 2 fabric chunk(s)"), "{out}");
        assert!(out.contains("over tcp"), "{out}");
        drop((stream, listener));
    });
}

#[test]
fn rust_fabric_export_to_python_over_tcp() {
    let _serial = serial();
    if !skip_unless(python_fabric()) {
        return;
    }
    let py = python_dir();
    let resource = fabric_resource();
    let g = resource.granularity();
    twice_with_baseline(|seed| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let buf = rust_export(&resource, seed);
        let seed_arg = seed.to_string();
        let mut child = role(
            &py,
            "fabric-importer",
            &["tcp", &addr, &own_uid(), &seed_arg],
        );
        let mut stream = accept_tcp(&listener, &mut child);
        v2::write_fabric(&mut stream, &buf.export_fabric().unwrap()).unwrap();
        assert_eq!(v2::read_data(&mut stream).unwrap(), b"written");
        let out = finish_ok(child);
        assert!(
            out.contains(&format!(
                "OK imported 2 fabric chunk(s), {} bytes over tcp",
                2 * g - 4096
            )),
            "{out}"
        );
        check_mark(&buf, seed);
        drop((buf, stream, listener));
    });
}
