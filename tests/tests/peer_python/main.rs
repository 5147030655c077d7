//! Rust and the standard-library Python peer (the `python/vmm_ipc_peer` package) speaking
//! docs/protocol.md, as processes that did not start each other.
//!
//! - `host` (runs everywhere, CI included): a Rust listener serves a memfd buffer to the Python
//!   peer; a Python memfd exporter sends to a Rust importer; a Python listener serves a Rust
//!   client; the peer's own unit tests (version 2's fabric descriptors and byte streams
//!   included), and `vmm_ipc_cuda.py`'s against a fake `cuda.bindings`.
//! - `gpu`: a `cuda.bindings` exporter gives a VMM buffer to a Rust importer, and a Rust export
//!   is imported by `cuda.bindings`, over a named endpoint, one rstest case per handle type:
//!   POSIX fds (version 1) and fabric handles (version 2, `CUDA_FABRIC`: one 64-byte handle per
//!   chunk, no fds; the exporter keeps its buffer until the importer's `DATA` reply, as a
//!   fabric handle keeps nothing alive).
//! - `fabric_tcp`: the fabric exchanges both ways over TCP loopback, with the byte-stream
//!   framing.
//! - `tls`: the Python peer's mutual TLS, against certificates made in the test.
//!
//! Each side checks the other's pattern in its own mapping, and this process's fds end where
//! they started, so the tests run one at a time ([`vmm_tests::turns::exclusive`]). GPU tests
//! skip (one `SKIP` line each) without a GPU (for fabric: without fabric support or an IMEX
//! channel), or without a `cuda.bindings` in `python3` that knows the handle type; a failure
//! under `VMM_REQUIRE_GPU=1`.
//!
//! The Python files are embedded in this executable and written to a temporary directory, so
//! a staged copy of it needs only `python3` (no checkout, no `CARGO_MANIFEST_DIR`).

use std::io::BufReader;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use vmm_core::testing::settled_open_fds;
use vmm_core::wire::endpoint::Name;
use vmm_tests::endpoint::finish;
use vmm_tests::{PythonDir, python3_can, unique_name};

mod fabric_tcp;
mod gpu;
mod host;
mod tls;
mod tls_interop;

const TIMEOUT: Duration = Duration::from_secs(60);

/// The `vmm_ipc_peer` package, module by module (`python/vmm_ipc_peer_files.rs`).
const PEER: &[(&str, &str)] = &include!("../../../python/vmm_ipc_peer_files.rs");
const CUDA: &str = include_str!("../../../python/vmm_ipc_cuda.py");
const ROLES: &str = include_str!("../../../python/tests/peer_roles.py");
const FIXTURES: &str = include_str!("../../../python/tests/peer_fixtures.py");
const UNIT: &str = include_str!("../../../python/tests/test_vmm_ipc_peer.py");
const UNIT_ATTACKS: &str = include_str!("../../../python/tests/test_vmm_ipc_attacks.py");
const UNIT_AVAILABILITY: &str = include_str!("../../../python/tests/test_vmm_ipc_availability.py");
const UNIT_CUDA: &str = include_str!("../../../python/tests/test_vmm_ipc_cuda.py");
const UNIT_FABRIC: &str = include_str!("../../../python/tests/test_vmm_ipc_fabric.py");
const UNIT_TLS: &str = include_str!("../../../python/tests/test_vmm_ipc_tls.py");
const FAKE_CUDA: [(&str, &str); 3] = [
    (
        "fake_cuda/cuda/__init__.py",
        include_str!("../../../python/tests/fake_cuda/cuda/__init__.py"),
    ),
    (
        "fake_cuda/cuda/bindings/__init__.py",
        include_str!("../../../python/tests/fake_cuda/cuda/bindings/__init__.py"),
    ),
    (
        "fake_cuda/cuda/bindings/driver.py",
        include_str!("../../../python/tests/fake_cuda/cuda/bindings/driver.py"),
    ),
];

/// The Rust v2 API these tests use, in one place.
mod v2 {
    use std::io::{Read, Write};

    use vmm_core::cuda::FabricDescriptor;
    use vmm_core::error::ProtocolRule;
    use vmm_core::peer::PeerMessage;
    use vmm_core::peer::Session;
    use vmm_core::peer::stream::{StreamReader, StreamWriter};
    use vmm_core::wire::{CallerAuthenticated, TimedStream};
    use vmm_core::{Error, Result};

    /// Send a fabric descriptor on an endpoint connection.
    pub fn send(conn: &Session, descriptor: &FabricDescriptor) -> Result<()> {
        conn.send_descriptor(descriptor)
    }

    /// Receive a fabric descriptor on an endpoint connection.
    pub fn recv(conn: &Session) -> Result<FabricDescriptor> {
        conn.recv_descriptor()?.into_fabric()
    }

    // The byte streams here are loopback TCP to a Python process this test started and checked
    // (its uid, its output): the test vouches for the peer (`CallerAuthenticated`). The same
    // exchange across users or machines is `tls_interop`'s, over mutual TLS.

    /// Write a fabric descriptor as one message on a byte stream.
    pub fn write_fabric(
        stream: &mut (impl Write + TimedStream),
        descriptor: &FabricDescriptor,
    ) -> Result<()> {
        StreamWriter::new(CallerAuthenticated::new(stream)).write_descriptor(descriptor)
    }

    /// Write a DATA message on a byte stream.
    pub fn write_data(stream: &mut (impl Write + TimedStream), bytes: &[u8]) -> Result<()> {
        StreamWriter::new(CallerAuthenticated::new(stream)).write_data(bytes)
    }

    /// Read one message from a byte stream: a fabric descriptor.
    pub fn read_fabric(stream: &mut (impl Read + TimedStream)) -> Result<FabricDescriptor> {
        match StreamReader::new(CallerAuthenticated::new(stream)).read_message()? {
            PeerMessage::Descriptor(d) => d.into_fabric(),
            PeerMessage::Data(b) => Err(Error::Protocol {
                rule: ProtocolRule::UnexpectedKind,
                message: format!(
                    "expected a CUDA_FABRIC message, got DATA of {} bytes",
                    b.len()
                ),
            }),
        }
    }

    /// Read one message from a byte stream: DATA.
    pub fn read_data(stream: &mut (impl Read + TimedStream)) -> Result<Vec<u8>> {
        match StreamReader::new(CallerAuthenticated::new(stream)).read_message()? {
            PeerMessage::Data(b) => Ok(b),
            PeerMessage::Descriptor(d) => Err(Error::Protocol {
                rule: ProtocolRule::UnexpectedKind,
                message: format!("expected DATA, got a descriptor ({d:?})"),
            }),
        }
    }
}

/// The Python files, in a fresh directory for one test.
fn python_dir() -> PythonDir {
    let files = [
        ("vmm_ipc_cuda.py", CUDA),
        ("peer_roles.py", ROLES),
        ("peer_fixtures.py", FIXTURES),
        ("test_vmm_ipc_peer.py", UNIT),
        ("test_vmm_ipc_attacks.py", UNIT_ATTACKS),
        ("test_vmm_ipc_availability.py", UNIT_AVAILABILITY),
        ("test_vmm_ipc_cuda.py", UNIT_CUDA),
        ("test_vmm_ipc_fabric.py", UNIT_FABRIC),
        ("test_vmm_ipc_tls.py", UNIT_TLS),
    ];
    PythonDir::new(
        "peer-python",
        PEER.iter().copied().chain(files).chain(FAKE_CUDA),
    )
}

/// `python3` can run here (3.9+, for socket.send_fds).
fn python3() -> Result<(), String> {
    python3_can("", "no python3 (3.9 or newer) on PATH")
}

/// `python3 ARGS...` in `dir`, with the directory on `PYTHONPATH` and stdout and stderr piped.
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

/// Wait for `child` with a deadline (killing it past that); all it wrote (what is left in
/// `rest`, its stdout where the test took it to read a line first, included), checked for
/// success and an `OK` line.
fn finish_ok_after(child: Child, within: Duration, rest: Option<BufReader<ChildStdout>>) -> String {
    let (output, out) = finish(child, rest, within);
    assert!(
        output.status.success() && out.contains("OK "),
        "the Python peer failed ({}):\n{out}",
        output.status
    );
    out
}

/// [`finish_ok_after`] with nothing read from the child's stdout yet.
fn finish_ok(child: Child, within: Duration) -> String {
    finish_ok_after(child, within, None)
}

/// A fresh abstract endpoint name of this suite.
fn unique(tag: &str) -> Name {
    unique_name("peer-python", tag)
}

/// Run `exchange` with each of `seeds`: the first run opens whatever the driver keeps open for
/// the life of the process (its first import's fds); the second must leave the fd count where
/// it found it.
fn twice_with_baseline(seeds: [u8; 2], mut exchange: impl FnMut(u8)) {
    exchange(seeds[0]);
    let before = settled_open_fds().unwrap();
    exchange(seeds[1]);
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds after the exchange"
    );
}
