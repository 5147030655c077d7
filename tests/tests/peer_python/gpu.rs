//! `cuda.bindings` on the Python side, over a named endpoint, both ways: one rstest case per
//! handle type, POSIX fds (docs/protocol.md version 1) and fabric handles (version 2).

use rstest::rstest;
use vmm_core::cuda::{
    Device, FabricDescriptor, HandleType, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource,
};
use vmm_core::peer::Session;
use vmm_core::testing::{cuda_fabric, cuda_vmm_ipc, skip_unless};
use vmm_core::wire::endpoint::Listener;
use vmm_tests::turns::exclusive;
use vmm_tests::{own_uid, pattern, python3_can};

use super::{TIMEOUT, finish_ok, python_dir, role, twice_with_baseline, unique, v2};

/// The GPU peer can run with POSIX fds: a GPU for vmm-core, and `cuda.bindings` in python3.
fn python_cuda() -> Result<(), String> {
    cuda_vmm_ipc()?;
    python3_can(
        "import cuda.bindings.driver",
        "python3 (3.9+) cannot import cuda.bindings (pip install cuda-python)",
    )
}

/// Fabric handles work here for vmm-core (a GPU with fabric support and an IMEX channel), and
/// `python3` (3.9+) imports a `cuda.bindings` that knows fabric handles.
pub(super) fn python_fabric() -> Result<(), String> {
    cuda_fabric()?;
    python3_can(
        "from cuda.bindings import driver; \
         driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC",
        "python3 (3.9+) cannot import a cuda.bindings with fabric handles \
         (pip install cuda-python)",
    )
}

/// What a case of `handle_type` needs, its two seeds and its Python roles' names: the peer's
/// roles take the transport (`endpoint`) first for fabric handles.
struct Case {
    requirement: fn() -> Result<(), String>,
    seeds: [u8; 2],
    exporter: &'static str,
    importer: &'static str,
    transport: &'static [&'static str],
}

fn case(handle_type: HandleType) -> Case {
    match handle_type {
        HandleType::Fabric => Case {
            requirement: python_fabric,
            seeds: [90, 100],
            exporter: "fabric-exporter",
            importer: "fabric-importer",
            transport: &["endpoint"],
        },
        _ => Case {
            requirement: python_cuda,
            seeds: [50, 60],
            exporter: "cuda-exporter",
            importer: "cuda-importer",
            transport: &[],
        },
    }
}

/// A fabric resource of device 0.
pub(super) fn fabric_resource() -> VirtualMemoryResource {
    VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )
    .unwrap()
}

/// The Rust importer's half of a fabric exchange: import, check the exporter's pattern, write
/// the mark (seed + 1).
pub(super) fn import_check_mark(descriptor: &FabricDescriptor, seed: u8) {
    assert_eq!(descriptor.chunk_sizes().len(), 2);
    assert_eq!(
        descriptor.owner_uuid(),
        Device::new(0).unwrap().uuid(),
        "the Python exporter names its device as the owner"
    );
    let debug = format!("{descriptor:?}");
    assert!(debug.contains("redacted"), "{debug}");
    let buf = VirtualMemoryBuffer::import_fabric(descriptor).unwrap();
    check_and_mark(&buf, seed);
}

/// The Rust importer's half of a POSIX-fd exchange on `conn`, as [`import_check_mark`]; the
/// import is kept (until the exchange ends).
fn import_posix_check_mark(conn: &Session, seed: u8) -> VirtualMemoryBuffer {
    let descriptor = conn.recv_descriptor().unwrap().into_cuda().unwrap();
    // Two chunks: the import maps them back to back as one range.
    assert_eq!(descriptor.chunk_sizes().len(), 2);
    let identity = descriptor
        .device()
        .expect("the Python exporter names its device");
    assert_eq!(&identity.uuid, Device::new(0).unwrap().uuid());
    let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
    drop(descriptor);
    check_and_mark(&buf, seed);
    buf
}

/// The exporter's pattern is in `buf`; then write the mark (seed + 1).
fn check_and_mark(buf: &VirtualMemoryBuffer, seed: u8) {
    let mut contents = vec![0u8; buf.size()];
    buf.read_at(0, &mut contents).unwrap();
    assert_eq!(
        contents,
        pattern(seed, buf.size()),
        "the exporter's pattern"
    );
    buf.write_at(0, &pattern(seed + 1, buf.size())).unwrap();
}

/// A grown Rust buffer (two chunks, a size that is not a chunk multiple) with `pattern(seed)`.
pub(super) fn rust_export(resource: &VirtualMemoryResource, seed: u8) -> VirtualMemoryBuffer {
    let g = resource.granularity();
    let buf = resource.allocate(g).unwrap();
    let buf = resource.grow(&buf, 2 * g - 4096).unwrap();
    assert_eq!(buf.chunk_sizes().len(), 2);
    buf.write_at(0, &pattern(seed, buf.size())).unwrap();
    buf
}

/// Python's mark (seed + 1) is in `buf`.
pub(super) fn check_mark(buf: &VirtualMemoryBuffer, seed: u8) {
    let mut contents = vec![0u8; buf.size()];
    buf.read_at(0, &mut contents).unwrap();
    assert_eq!(contents, pattern(seed + 1, buf.size()), "Python's mark");
}

#[rstest]
#[case::posix_fd(HandleType::PosixFd)]
#[case::fabric(HandleType::Fabric)]
fn python_exports_to_rust_over_an_endpoint(#[case] handle_type: HandleType) {
    // Every test counts fds or starts processes: one at a time.
    let _turn = exclusive();
    let case = case(handle_type);
    if !skip_unless((case.requirement)()) {
        return;
    }
    let py = python_dir();
    twice_with_baseline(case.seeds, |seed| {
        let name = unique("py-exports");
        let listener = Listener::bind(&name).unwrap();
        let (name_arg, uid, seed_arg) = (name.to_string(), own_uid(), seed.to_string());
        let args = [name_arg.as_str(), &uid, &seed_arg, "2"];
        let child = role(&py, case.exporter, &[case.transport, &args].concat());
        let conn = Session::accept(&listener, Some(TIMEOUT)).unwrap();
        let kept = match handle_type {
            HandleType::Fabric => {
                import_check_mark(&v2::recv(&conn).unwrap(), seed);
                None
            }
            _ => Some(import_posix_check_mark(&conn, seed)),
        };
        conn.send_data(b"written").unwrap();
        let out = finish_ok(child, TIMEOUT);
        let exported = match handle_type {
            HandleType::Fabric => "OK exported 2 fabric chunk(s)",
            _ => "OK exported 2 chunk(s)",
        };
        assert!(out.contains(exported), "{out}");
        drop((kept, conn, listener));
    });
}

#[rstest]
#[case::posix_fd(HandleType::PosixFd)]
#[case::fabric(HandleType::Fabric)]
fn rust_exports_to_python_over_an_endpoint(#[case] handle_type: HandleType) {
    // Every test counts fds or starts processes: one at a time.
    let _turn = exclusive();
    let case = case(handle_type);
    if !skip_unless((case.requirement)()) {
        return;
    }
    let py = python_dir();
    let resource = match handle_type {
        HandleType::Fabric => fabric_resource(),
        _ => VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default())
            .unwrap(),
    };
    let g = resource.granularity();
    twice_with_baseline(case.seeds, |seed| {
        let name = unique("rust-exports");
        let listener = Listener::bind(&name).unwrap();
        let buf = rust_export(&resource, seed);
        let (name_arg, uid, seed_arg) = (name.to_string(), own_uid(), seed.to_string());
        let args: [&str; 3] = [&name_arg, &uid, &seed_arg];
        let child = role(&py, case.importer, &[case.transport, &args].concat());
        let conn = Session::accept(&listener, Some(TIMEOUT)).unwrap();
        match handle_type {
            HandleType::Fabric => v2::send(&conn, &buf.export_fabric().unwrap()).unwrap(),
            _ => {
                let descriptor = buf.export().unwrap();
                conn.send_descriptor(&descriptor).unwrap();
                drop(descriptor);
            }
        }
        // The buffer stays until the importer says it has imported (and written).
        assert_eq!(conn.recv_data().unwrap(), b"written");
        let out = finish_ok(child, TIMEOUT);
        let imported = match handle_type {
            HandleType::Fabric => {
                format!(
                    "OK imported 2 fabric chunk(s), {} bytes over endpoint",
                    2 * g - 4096
                )
            }
            _ => format!("OK imported 2 chunk(s), {} bytes", 2 * g - 4096),
        };
        assert!(out.contains(&imported), "{out}");
        check_mark(&buf, seed);
        drop((buf, conn, listener));
    });
}
