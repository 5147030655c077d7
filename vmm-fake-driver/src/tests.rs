//! The fake driver's calls made in this process (`libcuda.rs` compiled in as a module), and the
//! embedded library's exports. Loading it as `libcuda.so` under vmm-core is tested by
//! `vmm-memd/tests/python_fake_gpu.rs`.

use std::ffi::{CStr, c_char, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::libcuda::{self as cu, AccessDesc, AllocationProp, Location};

const G: usize = super::GRANULARITY;
const SUCCESS: u32 = 0;
const INVALID_VALUE: u32 = 1;
const INVALID_CONTEXT: u32 = 201;
const ALREADY_MAPPED: u32 = 208;
const INVALID_HANDLE: u32 = 400;
const ILLEGAL_ADDRESS: u32 = 700;
const NOT_SUPPORTED: u32 = 801;

/// Every call vmm-core's driver layer (`vmm-core/src/cuda/driver.rs`) makes, and those the
/// brief adds (release, DtoD, stream sync, error strings).
const EXPORTED: [&str; 29] = [
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetUuid",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
];

#[test]
fn the_library_is_an_elf_that_names_every_call() {
    assert_eq!(&super::LIBCUDA[..4], b"\x7fELF");
    let names = |name: &str| {
        let mut needle = name.as_bytes().to_vec();
        needle.push(0); // a whole name in the dynamic string table
        super::LIBCUDA.windows(needle.len()).any(|w| w == needle)
    };
    for name in EXPORTED.iter().chain(&["cuMemcpyDtoD_v2", "cuMemsetD8_v2"]) {
        assert!(names(name), "{name} is not in the library");
    }
}

#[test]
fn the_constants_are_the_libraries() {
    assert_eq!(super::DEVICE_UUID, cu::UUID);
    assert_eq!(super::DEVICE_NAME, cu::DEVICE_NAME.to_str().unwrap());
    assert_eq!(super::GRANULARITY, cu::GRANULARITY);
    assert_eq!(super::MEMFD_NAME, cu::MEMFD_NAME.to_str().unwrap());
}

#[test]
fn install_writes_an_owner_only_directory_and_an_executable_library() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("vmm-fake-driver-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(super::install(&dir).unwrap(), dir);
    assert_eq!(super::install(&dir).unwrap(), dir); // again: replaced
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("libcuda.so")), 0o755);
    assert_eq!(
        std::fs::read(dir.join("libcuda.so")).unwrap(),
        super::LIBCUDA
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    let path = super::library_path(&dir);
    assert!(path.to_str().unwrap().starts_with(dir.to_str().unwrap()));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn ok(rc: u32) {
    assert_eq!(rc, SUCCESS, "{}", name(rc));
}

fn name(rc: u32) -> String {
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: a live out-pointer.
    assert_eq!(unsafe { cu::cuGetErrorName(rc, &mut text) }, SUCCESS);
    // SAFETY: a static C string of the fake.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// cuInit, the primary context current on this thread.
fn ready() {
    ok(cu::cuInit(0));
    let mut ctx = std::ptr::null_mut();
    // SAFETY: a live out-pointer.
    ok(unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, 0) });
    ok(cu::cuCtxSetCurrent(ctx));
}

const DEVICE_0: Location = Location { type_: 1, id: 0 };

/// Pinned memory on device 0, exportable as `handle_types`.
fn prop(handle_types: u32) -> AllocationProp {
    AllocationProp {
        type_: 1,
        requested_handle_types: handle_types,
        location: DEVICE_0,
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

fn create(size: usize, handle_types: u32) -> Result<u64, u32> {
    let mut handle = 0;
    // SAFETY: live pointers.
    match unsafe { cu::cuMemCreate(&mut handle, size, &prop(handle_types), 0) } {
        SUCCESS => Ok(handle),
        rc => Err(rc),
    }
}

fn export(handle: u64) -> Result<OwnedFd, u32> {
    let mut fd: i32 = -1;
    // SAFETY: a pointer to one int, as a POSIX fd export takes.
    match unsafe { cu::cuMemExportToShareableHandle((&raw mut fd).cast(), handle, 1, 0) } {
        // SAFETY: a fresh fd the fake handed over.
        SUCCESS => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        rc => Err(rc),
    }
}

fn import(fd: i32) -> Result<u64, u32> {
    let mut handle = 0;
    // SAFETY: the fd travels by value; a live out-pointer.
    match unsafe { cu::cuMemImportFromShareableHandle(&mut handle, fd as usize as *mut c_void, 1) }
    {
        SUCCESS => Ok(handle),
        rc => Err(rc),
    }
}

fn reserve(size: usize) -> u64 {
    let mut va = 0;
    // SAFETY: a live out-pointer.
    ok(unsafe { cu::cuMemAddressReserve(&mut va, size, 0, 0, 0) });
    va
}

fn set_access(va: u64, size: usize, flags: u32) -> u32 {
    let desc = AccessDesc {
        location: DEVICE_0,
        flags,
    };
    // SAFETY: one live descriptor.
    unsafe { cu::cuMemSetAccess(va, size, &desc, 1) }
}

fn htod(va: u64, bytes: &[u8]) -> u32 {
    // SAFETY: a live host buffer of that length.
    unsafe { cu::cuMemcpyHtoD_v2(va, bytes.as_ptr().cast(), bytes.len()) }
}

fn dtoh(va: u64, len: usize) -> Result<Vec<u8>, u32> {
    let mut bytes = vec![0u8; len];
    // SAFETY: a live host buffer of that length.
    match unsafe { cu::cuMemcpyDtoH_v2(bytes.as_mut_ptr().cast(), va, len) } {
        SUCCESS => Ok(bytes),
        rc => Err(rc),
    }
}

#[test]
fn an_export_imports_maps_and_reads_back_and_read_only_refuses_writes() {
    ready();
    let exporter = create(2 * G, 1).unwrap();
    let fd = export(exporter).unwrap();
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert_eq!(link.to_str().unwrap(), "/memfd:fake-cuda (deleted)");
    let imported = import(fd.as_raw_fd()).unwrap();
    // An import cannot be exported again; its location is device 0.
    assert_eq!(export(imported).unwrap_err(), INVALID_VALUE);
    let mut got = prop(1);
    got.location.id = 7;
    // SAFETY: a live out-struct.
    ok(unsafe { cu::cuMemGetAllocationPropertiesFromHandle(&mut got, imported) });
    let location = (got.location.type_, got.location.id);
    assert_eq!(
        (got.type_, got.requested_handle_types, location),
        (1, 0, (1, 0))
    );

    // The exporter's mapping, read-write, filled; the import's, read-only, reads it.
    let writable = reserve(2 * G);
    ok(cu::cuMemMap(writable, 2 * G, 0, exporter, 0));
    assert_eq!(htod(writable, b"before access"), ILLEGAL_ADDRESS);
    ok(set_access(writable, 2 * G, 3));
    let pattern: Vec<u8> = (0..2 * G).map(|i| (i % 251) as u8).collect();
    ok(htod(writable, &pattern));
    ok(cu::cuMemsetD8_v2(writable + G as u64 - 2, 0xab, 4));
    ok(cu::cuMemcpyDtoD_v2(writable + 8, writable, 8));
    let readable = reserve(2 * G);
    ok(cu::cuMemMap(readable, 2 * G, 0, imported, 0));
    ok(set_access(readable, 2 * G, 1));
    let read = dtoh(readable, 2 * G).unwrap();
    assert_eq!(&read[8..16], &pattern[..8]);
    assert_eq!(&read[G - 2..G + 2], &[0xab; 4]);
    assert_eq!(&read[G + 2..], &pattern[G + 2..]);
    // Device addresses are host addresses: the import's pages are the export's.
    // SAFETY: mapped readable just above.
    assert_eq!(unsafe { *(readable as *const u8).add(20) }, pattern[20]);
    assert_eq!(htod(readable, b"x"), ILLEGAL_ADDRESS);
    assert_eq!(cu::cuMemsetD8_v2(readable, 0, 1), ILLEGAL_ADDRESS);

    // Release before unmap is allowed (the mapping keeps the memory), as the driver's is.
    ok(cu::cuMemRelease(imported));
    assert_eq!(dtoh(readable, 4).unwrap(), &pattern[..4]);
    assert_eq!(cu::cuMemAddressFree(readable, 2 * G), INVALID_VALUE); // still mapped
    ok(cu::cuMemUnmap(readable, 2 * G));
    assert_eq!(dtoh(readable, 4).unwrap_err(), INVALID_VALUE);
    ok(cu::cuMemAddressFree(readable, 2 * G));
    ok(cu::cuMemUnmap(writable, 2 * G));
    ok(cu::cuMemAddressFree(writable, 2 * G));
    ok(cu::cuMemRelease(exporter));
    assert_eq!(cu::cuMemRelease(exporter), INVALID_VALUE);
}

#[test]
fn what_the_driver_refuses_is_refused() {
    ready();
    assert_eq!(create(G + 4096, 1).unwrap_err(), INVALID_VALUE);
    assert_eq!(create(G, 8).unwrap_err(), NOT_SUPPORTED); // no fabric handles
    let unshareable = create(G, 0).unwrap();
    assert_eq!(export(unshareable).unwrap_err(), INVALID_VALUE);
    // Fds that are no allocation's: a file, a pipe, a closed number.
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    assert_eq!(import(file.as_raw_fd()).unwrap_err(), INVALID_VALUE);
    let (reader, _writer) = std::io::pipe().unwrap();
    assert_eq!(import(reader.as_raw_fd()).unwrap_err(), INVALID_VALUE);
    assert_eq!(import(i32::MAX - 9).unwrap_err(), INVALID_VALUE);
    // Maps: an unknown handle, outside a reservation, over a mapping, unaligned.
    let va = reserve(2 * G);
    assert_eq!(cu::cuMemMap(va, G, 0, 1 << 40, 0), INVALID_HANDLE);
    assert_eq!(
        cu::cuMemMap(va + G as u64, 2 * G, 0, unshareable, 0),
        INVALID_VALUE
    );
    assert_eq!(cu::cuMemMap(va + 4096, G, 0, unshareable, 0), INVALID_VALUE);
    ok(cu::cuMemMap(va, G, 0, unshareable, 0));
    assert_eq!(cu::cuMemMap(va, G, 0, unshareable, 0), ALREADY_MAPPED);
    // Access and unmap only on whole mappings.
    assert_eq!(set_access(va, 2 * G, 3), INVALID_VALUE);
    assert_eq!(cu::cuMemUnmap(va, 2 * G), INVALID_VALUE);
    ok(set_access(va, G, 3));
    // Copies need a current context; this thread's is left as it was on other threads.
    ok(cu::cuCtxSetCurrent(std::ptr::null_mut()));
    assert_eq!(htod(va, b"x"), INVALID_CONTEXT);
    assert_eq!(cu::cuCtxSynchronize(), INVALID_CONTEXT);
    ready();
    ok(htod(va, b"x"));
    ok(cu::cuCtxSynchronize());
    ok(cu::cuMemUnmap(va, G));
    ok(cu::cuMemAddressFree(va, 2 * G));
    ok(cu::cuMemRelease(unshareable));
    // Unknown codes have no name.
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: a live out-pointer.
    let rc = unsafe { cu::cuGetErrorName(12345, &mut text) };
    assert_eq!(rc, INVALID_VALUE);
    assert!(text.is_null());
    assert_eq!(name(NOT_SUPPORTED), "CUDA_ERROR_NOT_SUPPORTED");
}

#[test]
fn the_device_is_the_python_fakes() {
    ready();
    let mut uuid = [0u8; 16];
    // SAFETY: a live 16-byte out-pointer.
    ok(unsafe { cu::cuDeviceGetUuid_v2(&mut uuid, 0) });
    assert_eq!(uuid, super::DEVICE_UUID);
    let mut name = [0 as c_char; 8];
    // SAFETY: a live buffer of that length.
    ok(unsafe { cu::cuDeviceGetName(name.as_mut_ptr(), 8, 0) });
    // SAFETY: NUL-terminated within the buffer.
    assert_eq!(unsafe { CStr::from_ptr(name.as_ptr()) }, c"vmm-fak");
    let attribute = |attribute| {
        let mut value = -1;
        // SAFETY: a live out-pointer.
        ok(unsafe { cu::cuDeviceGetAttribute(&mut value, attribute, 0) });
        value
    };
    assert_eq!((attribute(102), attribute(103), attribute(128)), (1, 1, 0));
    let mut count = 0;
    // SAFETY: a live out-pointer.
    ok(unsafe { cu::cuDeviceGetCount(&mut count) });
    assert_eq!(count, 1);
    let mut granularity = 0;
    // SAFETY: live pointers.
    ok(unsafe { cu::cuMemGetAllocationGranularity(&mut granularity, &prop(1), 0) });
    assert_eq!(granularity, G);
}
