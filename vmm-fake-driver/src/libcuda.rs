//! A fake `libcuda.so`: the CUDA driver calls vmm-core's driver layer makes (and a few more:
//! device-to-device copies, stream sync, context release, error strings), over host memory, so that the real service, vmm-core and the
//! Python client can exchange "GPU" memory on a machine without a GPU.
//!
//! Built by this crate's `build.rs` on its own (`rustc --crate-type cdylib`, std only, no
//! crates): cudarc `dlopen`s `libcuda.so` by name, so a process started with this file's
//! directory first in `LD_LIBRARY_PATH` gets it instead of the real driver. Also compiled into
//! this crate's unit tests as a module, which is how clippy sees it and how its refusals are
//! tested without loading it.
//!
//! The model, and why:
//! - **One device**, ordinal 0, with the fixed [`UUID`] the Python fake of cuda.bindings
//!   (`python/tests/fake_cuda`) has too: a region one side publishes names a device the other
//!   side has.
//! - **A physical allocation is a memfd** named [`MEMFD_NAME`], and an exported POSIX fd is a
//!   duplicate of it, as in the Python fake: an fd either fake exported imports in the other,
//!   and both refuse any other fd (not a memfd of that name), as the driver refuses an fd that
//!   is no exported allocation.
//! - **Device addresses are host addresses**: a reservation is a `PROT_NONE` range of this
//!   process, a mapping is the memfd mapped `MAP_SHARED | MAP_FIXED` into it (still
//!   `PROT_NONE`, as the real device has no access before `cuMemSetAccess`), and access is
//!   `mprotect` (`PROT_READ` for read-only). Copies and memsets are plain memory operations,
//!   after the range is checked to be mapped with the access they need: where the real device
//!   would fault, the call fails with `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! - **No fabric**: the device says it has no fabric handles, and every fabric request is
//!   `CUDA_ERROR_NOT_SUPPORTED`, so a service reports `fabric: false`.
//! - Refusals the real driver makes where they are cheap to make: calls before `cuInit`, unknown
//!   handles, sizes and addresses that are not multiples of the 2 MiB granularity, maps outside
//!   a reservation or over a mapping, copies without a current context.
//!
//! The signatures are cudarc's bindings for CUDA 13 (`cudarc::driver::sys`): C enums are
//! `c_uint`, `CUdevice` is `c_int`, device pointers and allocation handles are `u64`. cudarc
//! resolves each symbol on its first call (and panics if it is missing), so the fake exports
//! every call the driver layer can make.
// The driver's names.
#![allow(non_snake_case)]
// The safety contract of each exported function is the CUDA driver API's for that call (valid
// out-pointers, live handles): the real driver's documentation, not repeated here.
#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

/// The device's UUID: the Python fake's (`UUID = bytes(range(16))`).
pub const UUID: [u8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
/// The device's name (`cuDeviceGetName`): a test can tell the fake from a real driver by it.
pub const DEVICE_NAME: &CStr = c"vmm-fake-driver";
/// Allocation granularity, minimum and recommended: the H200's.
pub const GRANULARITY: usize = 2 << 20;
/// The name of every allocation's memfd, in both fakes (`/proc/self/fd` shows `memfd:NAME`).
pub const MEMFD_NAME: &CStr = c"fake-cuda";

type CUresult = c_uint;
type CUdevice = c_int;
type CUdeviceptr = u64;
type Handle = u64;
type CUcontext = *mut c_void;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const ALREADY_MAPPED: CUresult = 208;
const OPERATING_SYSTEM: CUresult = 304;
const INVALID_HANDLE: CUresult = 400;
const ILLEGAL_ADDRESS: CUresult = 700;
const NOT_SUPPORTED: CUresult = 801;

/// Each code this fake returns: its name and its description.
const ERRORS: [(CUresult, &CStr, &CStr); 11] = [
    (SUCCESS, c"CUDA_SUCCESS", c"no error"),
    (
        INVALID_VALUE,
        c"CUDA_ERROR_INVALID_VALUE",
        c"invalid argument",
    ),
    (OUT_OF_MEMORY, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (
        NOT_INITIALIZED,
        c"CUDA_ERROR_NOT_INITIALIZED",
        c"initialization error",
    ),
    (
        INVALID_DEVICE,
        c"CUDA_ERROR_INVALID_DEVICE",
        c"invalid device ordinal",
    ),
    (
        INVALID_CONTEXT,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        ALREADY_MAPPED,
        c"CUDA_ERROR_ALREADY_MAPPED",
        c"resource already mapped",
    ),
    (
        OPERATING_SYSTEM,
        c"CUDA_ERROR_OPERATING_SYSTEM",
        c"OS call failed",
    ),
    (
        INVALID_HANDLE,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        ILLEGAL_ADDRESS,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        NOT_SUPPORTED,
        c"CUDA_ERROR_NOT_SUPPORTED",
        c"operation not supported",
    ),
];

// The driver's enum values used here.
const ATTRIBUTE_VMM: c_uint = 102;
const ATTRIBUTE_POSIX_FD: c_uint = 103;
const HANDLE_POSIX_FD: c_uint = 1;
const HANDLE_FABRIC: c_uint = 8;
const LOCATION_DEVICE: c_uint = 1;
const ALLOCATION_PINNED: c_uint = 1;
const ACCESS_NONE: c_uint = 0;
const ACCESS_READ: c_uint = 1;
const ACCESS_READWRITE: c_uint = 3;
const STREAM_LEGACY: usize = 1;
const STREAM_PER_THREAD: usize = 2;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Location {
    pub type_: c_uint,
    pub id: c_int,
}

/// `CUmemAllocationProp`.
#[repr(C)]
pub struct AllocationProp {
    pub type_: c_uint,
    pub requested_handle_types: c_uint,
    pub location: Location,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
pub struct AccessDesc {
    pub location: Location,
    pub flags: c_uint,
}

// libc, declared here: the fake links nothing but std.
unsafe extern "C" {
    fn memfd_create(name: *const c_char, flags: c_uint) -> c_int;
    fn mmap(
        addr: *mut c_void,
        len: usize,
        prot: c_int,
        flags: c_int,
        fd: c_int,
        off: i64,
    ) -> *mut c_void;
    fn munmap(addr: *mut c_void, len: usize) -> c_int;
    fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int;
}
const MFD_CLOEXEC: c_uint = 1;
const PROT_NONE: c_int = 0;
const PROT_READ: c_int = 1;
const PROT_WRITE: c_int = 2;
const MAP_SHARED: c_int = 0x01;
const MAP_PRIVATE: c_int = 0x02;
const MAP_FIXED: c_int = 0x10;
const MAP_ANONYMOUS: c_int = 0x20;
const MAP_NORESERVE: c_int = 0x4000;
const MAP_FIXED_NOREPLACE: c_int = 0x10_0000;
const MAP_FAILED: *mut c_void = !0usize as *mut c_void;

/// A physical allocation: its memfd (mapped, exported by `dup`), its size, the handle types
/// requested at `cuMemCreate` (none for an import: an import cannot be exported again).
struct Allocation {
    memfd: OwnedFd,
    size: usize,
    requested: c_uint,
}

/// A mapping of (all or the start of) an allocation, and the access set on it.
struct Mapping {
    size: usize,
    access: c_uint,
}

struct State {
    initialized: bool,
    next_handle: Handle,
    allocations: BTreeMap<Handle, Allocation>,
    /// Reserved ranges: start -> size.
    reservations: BTreeMap<u64, usize>,
    /// Mapped ranges: start -> mapping.
    mappings: BTreeMap<u64, Mapping>,
    primary_retains: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    initialized: false,
    next_handle: 1,
    allocations: BTreeMap::new(),
    reservations: BTreeMap::new(),
    mappings: BTreeMap::new(),
    primary_retains: 0,
});

/// The primary context's handle: the address of this static (never dereferenced).
static PRIMARY: u8 = 0;

thread_local! {
    /// Whether the primary context is current on this thread.
    static CURRENT: Cell<bool> = const { Cell::new(false) };
}

fn primary() -> CUcontext {
    (&raw const PRIMARY).cast_mut().cast()
}

type Outcome = Result<(), CUresult>;

fn code(outcome: Outcome) -> CUresult {
    outcome.err().unwrap_or(SUCCESS)
}

/// The state, once `cuInit` has run.
fn initialized() -> Result<MutexGuard<'static, State>, CUresult> {
    let state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if state.initialized {
        Ok(state)
    } else {
        Err(NOT_INITIALIZED)
    }
}

/// The state, for a call that needs a current context (copies, memsets, synchronisation).
fn in_context() -> Result<MutexGuard<'static, State>, CUresult> {
    let state = initialized()?;
    if CURRENT.with(Cell::get) {
        Ok(state)
    } else {
        Err(INVALID_CONTEXT)
    }
}

/// Write `value` through the caller's out-pointer.
///
/// # Safety
/// `out` is null (refused) or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Outcome {
    if out.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Read the caller's in-pointer.
///
/// # Safety
/// `ptr` is null (refused) or valid for a read of `T`.
unsafe fn get<'a, T>(ptr: *const T) -> Result<&'a T, CUresult> {
    // SAFETY: null or valid for a read by the caller's contract.
    unsafe { ptr.as_ref() }.ok_or(INVALID_VALUE)
}

fn device(dev: CUdevice) -> Outcome {
    if dev == 0 {
        Ok(())
    } else {
        Err(INVALID_DEVICE)
    }
}

fn device_location(location: &Location) -> Outcome {
    if location.type_ != LOCATION_DEVICE {
        return Err(INVALID_VALUE);
    }
    device(location.id)
}

fn aligned(value: u64) -> bool {
    value.is_multiple_of(GRANULARITY as u64)
}

// ---- errors, init, devices, contexts ------------------------------------------------------

/// The error's name (`name`) or description, through `out`; a code this fake never returns is
/// `CUDA_ERROR_INVALID_VALUE` with a null string, as the driver answers for an unknown code.
fn error_text(error: CUresult, name: bool, out: *mut *const c_char) -> CUresult {
    let found = ERRORS.iter().find(|(c, _, _)| *c == error);
    let text = found.map_or(std::ptr::null(), |&(_, n, d)| {
        if name { n } else { d }.as_ptr()
    });
    // SAFETY: `out` is the caller's out-pointer (cuGetErrorName/String's contract).
    match unsafe { put(out, text) } {
        Ok(()) if found.is_some() => SUCCESS,
        Ok(()) => INVALID_VALUE,
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    error_text(error, true, pStr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    error_text(error, false, pStr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return INVALID_VALUE;
    }
    STATE.lock().unwrap_or_else(|e| e.into_inner()).initialized = true;
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: the caller's out-pointer.
    code(unsafe { put(version, 13000) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    code(initialized().and_then(|_| {
        // SAFETY: the caller's out-pointer.
        unsafe { put(count, 1) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    code(initialized().and_then(|_| {
        device(ordinal)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(dev, 0) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    code(initialized().and_then(|_| {
        device(dev)?;
        let len = usize::try_from(len).map_err(|_| INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(INVALID_VALUE);
        }
        let bytes = DEVICE_NAME.to_bytes();
        let n = bytes.len().min(len - 1);
        // SAFETY: the caller's buffer holds `len` bytes; `n + 1 <= len` are written.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr().cast(), name, n);
            name.add(n).write(0);
        }
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_uint,
    dev: CUdevice,
) -> CUresult {
    code(initialized().and_then(|_| {
        device(dev)?;
        // VMM and POSIX-fd handles: yes. Everything else (fabric handles, host NUMA VMM, ...)
        // reads 0: not supported.
        let value = matches!(attrib, ATTRIBUTE_VMM | ATTRIBUTE_POSIX_FD) as c_int;
        // SAFETY: the caller's out-pointer.
        unsafe { put(pi, value) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    code(initialized().and_then(|_| {
        device(dev)?;
        // SAFETY: the caller's out-pointer (a 16-byte CUuuid).
        unsafe { put(uuid, UUID) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: forwarded with the caller's contract.
    unsafe { cuDeviceGetUuid_v2(uuid, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    code(initialized().and_then(|mut state| {
        device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(pctx, primary()) }?;
        state.primary_retains += 1;
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    code(initialized().and_then(|mut state| {
        device(dev)?;
        state.primary_retains = state
            .primary_retains
            .checked_sub(1)
            .ok_or(INVALID_CONTEXT)?;
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    code(initialized().and_then(|_| {
        if !ctx.is_null() && ctx != primary() {
            return Err(INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(!ctx.is_null()));
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    code(initialized().and_then(|_| {
        let ctx = match CURRENT.with(Cell::get) {
            true => primary(),
            false => std::ptr::null_mut(),
        };
        // SAFETY: the caller's out-pointer.
        unsafe { put(pctx, ctx) }
    }))
}

/// Work is never queued (every copy is done when it returns): only the context is checked.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    code(in_context().map(drop))
}

/// As [`cuCtxSynchronize`]; the null, legacy and per-thread default streams are the only
/// streams there are.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    code(in_context().and(match stream as usize {
        0 | STREAM_LEGACY | STREAM_PER_THREAD => Ok(()),
        _ => Err(INVALID_HANDLE),
    }))
}

// ---- physical allocations -------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const AllocationProp,
    option: c_uint,
) -> CUresult {
    code(initialized().and_then(|_| {
        // SAFETY: the caller's in-pointer.
        device_location(&unsafe { get(prop) }?.location)?;
        if option > 1 {
            return Err(INVALID_VALUE);
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(granularity, GRANULARITY) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut Handle,
    size: usize,
    prop: *const AllocationProp,
    flags: u64,
) -> CUresult {
    code(initialized().and_then(|mut state| {
        // SAFETY: the caller's in-pointer.
        let prop = unsafe { get(prop) }?;
        if flags != 0 || prop.type_ != ALLOCATION_PINNED || size == 0 || !aligned(size as u64) {
            return Err(INVALID_VALUE);
        }
        device_location(&prop.location)?;
        if prop.requested_handle_types & HANDLE_FABRIC != 0 {
            return Err(NOT_SUPPORTED);
        }
        if prop.requested_handle_types & !HANDLE_POSIX_FD != 0 {
            return Err(INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated name and plain flags.
        let fd = unsafe { memfd_create(MEMFD_NAME.as_ptr(), MFD_CLOEXEC) };
        if fd < 0 {
            return Err(OUT_OF_MEMORY);
        }
        // SAFETY: a fresh fd that nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let file = File::from(memfd);
        file.set_len(size as u64).map_err(|_| OUT_OF_MEMORY)?;
        let id = state.next_handle;
        // SAFETY: the caller's out-pointer.
        unsafe { put(handle, id) }?;
        state.next_handle += 1;
        let allocation = Allocation {
            memfd: file.into(),
            size,
            requested: prop.requested_handle_types,
        };
        state.allocations.insert(id, allocation);
        Ok(())
    }))
}

/// Frees the handle. The memory itself lives on in mappings of it and in exported fds (the
/// kernel holds the memfd), as the driver's does.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: Handle) -> CUresult {
    code(initialized().and_then(|mut state| {
        state
            .allocations
            .remove(&handle)
            .map(drop)
            .ok_or(INVALID_VALUE)
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut AllocationProp,
    handle: Handle,
) -> CUresult {
    code(initialized().and_then(|state| {
        let allocation = state.allocations.get(&handle).ok_or(INVALID_VALUE)?;
        let value = AllocationProp {
            type_: ALLOCATION_PINNED,
            requested_handle_types: allocation.requested,
            location: Location {
                type_: LOCATION_DEVICE,
                id: 0,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        };
        // SAFETY: the caller's out-pointer.
        unsafe { put(prop, value) }
    }))
}

/// A POSIX fd: a duplicate of the allocation's memfd (refused for an import, or for an
/// allocation made without `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). Fabric handles: not
/// supported.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: Handle,
    handle_type: c_uint,
    flags: u64,
) -> CUresult {
    code(initialized().and_then(|state| {
        let allocation = state.allocations.get(&handle).ok_or(INVALID_VALUE)?;
        match handle_type {
            _ if flags != 0 => Err(INVALID_VALUE),
            HANDLE_FABRIC => Err(NOT_SUPPORTED),
            HANDLE_POSIX_FD if allocation.requested & HANDLE_POSIX_FD != 0 => {
                // A failure leaves errno (EMFILE at the fd limit), as the driver's does.
                let fd = allocation.memfd.try_clone().map_err(|_| OPERATING_SYSTEM)?;
                let raw = fd.into_raw_fd();
                // SAFETY: for a POSIX fd the caller passes a pointer to one `int`.
                unsafe { put(shareable.cast::<c_int>(), raw) }.inspect_err(|_| {
                    // SAFETY: `raw` was just made and is not handed out.
                    drop(unsafe { OwnedFd::from_raw_fd(raw) });
                })
            }
            _ => Err(INVALID_VALUE),
        }
    }))
}

/// Whether `fd` is an allocation's memfd: a memfd named [`MEMFD_NAME`] by either fake.
fn is_fake_allocation(fd: c_int) -> bool {
    let expected = format!(
        "/memfd:{} (deleted)",
        MEMFD_NAME.to_str().unwrap_or_default()
    );
    std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok_and(|target| target == *expected)
}

/// A POSIX fd, passed by value (cast to a pointer) and left open: the import holds a duplicate
/// of it. Refused unless it is an allocation's memfd whose size is a multiple of the
/// granularity. Fabric handles: not supported.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut Handle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    code(initialized().and_then(|mut state| {
        match handle_type {
            HANDLE_POSIX_FD => {}
            HANDLE_FABRIC => return Err(NOT_SUPPORTED),
            _ => return Err(INVALID_VALUE),
        }
        let fd = c_int::try_from(os_handle as usize).map_err(|_| INVALID_VALUE)?;
        if fd < 0 || !is_fake_allocation(fd) {
            return Err(INVALID_VALUE);
        }
        // SAFETY: `fd` is open (its /proc link was just read) and only borrowed for the dup.
        let memfd = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map_err(|_| OPERATING_SYSTEM)?;
        let file = File::from(memfd);
        let size = file.metadata().map_err(|_| OPERATING_SYSTEM)?.len();
        if size == 0 || !aligned(size) {
            return Err(INVALID_VALUE);
        }
        let id = state.next_handle;
        // SAFETY: the caller's out-pointer (a plain write, no handle is dereferenced).
        unsafe { put(handle, id) }?;
        state.next_handle += 1;
        let allocation = Allocation {
            memfd: file.into(),
            size: size as usize,
            requested: 0,
        };
        state.allocations.insert(id, allocation);
        Ok(())
    }))
}

// ---- address ranges and mappings ---------------------------------------------------------

/// `size` bytes of fresh `PROT_NONE` address space at `at` (exactly there, with `fixed`),
/// or `None`.
fn reserve_range(at: u64, size: usize, fixed: c_int) -> Option<u64> {
    let flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | fixed;
    // SAFETY: an anonymous mapping; with MAP_FIXED only over a range this fake owns (see
    // callers), with MAP_FIXED_NOREPLACE never over anything.
    let got = unsafe { mmap(at as *mut c_void, size, PROT_NONE, flags, -1, 0) };
    (got != MAP_FAILED).then_some(got as u64)
}

/// Give address space back.
fn unmap_range(at: u64, size: usize) {
    if size > 0 {
        // SAFETY: only ranges this fake reserved and nobody uses any more (see callers).
        unsafe { munmap(at as *mut c_void, size) };
    }
}

/// A reservation at `hint` when that range is free, else anywhere, aligned to `alignment`.
fn reserve_aligned(size: usize, alignment: usize, hint: u64) -> Option<u64> {
    if hint != 0 && hint.is_multiple_of(alignment as u64) {
        match reserve_range(hint, size, MAP_FIXED_NOREPLACE) {
            Some(got) if got == hint => return Some(got),
            // A kernel without MAP_FIXED_NOREPLACE places it elsewhere: give that back.
            Some(elsewhere) => unmap_range(elsewhere, size),
            None => {}
        }
    }
    let padded = size.checked_add(alignment)?;
    let start = reserve_range(0, padded, 0)?;
    let aligned_start = start.next_multiple_of(alignment as u64);
    let head = (aligned_start - start) as usize;
    unmap_range(start, head);
    unmap_range(aligned_start + size as u64, padded - head - size);
    Some(aligned_start)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    code(initialized().and_then(|mut state| {
        let alignment = match alignment {
            0 => GRANULARITY,
            a if a.is_power_of_two() && aligned(a as u64) => a,
            _ => return Err(INVALID_VALUE),
        };
        if flags != 0 || size == 0 || !aligned(size as u64) {
            return Err(INVALID_VALUE);
        }
        let va = reserve_aligned(size, alignment, addr).ok_or(OUT_OF_MEMORY)?;
        // SAFETY: the caller's out-pointer.
        if let Err(e) = unsafe { put(ptr, va) } {
            unmap_range(va, size);
            return Err(e);
        }
        state.reservations.insert(va, size);
        Ok(())
    }))
}

/// Exactly a reservation, with nothing mapped in it any more.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    code(initialized().and_then(|mut state| {
        if state.reservations.get(&ptr) != Some(&size) {
            return Err(INVALID_VALUE);
        }
        if state
            .mappings
            .range(ptr..ptr + size as u64)
            .next()
            .is_some()
        {
            return Err(INVALID_VALUE);
        }
        state.reservations.remove(&ptr);
        unmap_range(ptr, size);
        Ok(())
    }))
}

impl State {
    /// Whether `ptr..ptr + size` lies inside one reservation.
    fn reserved(&self, ptr: u64, size: usize) -> bool {
        self.reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&start, &len)| ptr + size as u64 <= start + len as u64)
    }

    /// Whether any mapping overlaps `ptr..ptr + size`.
    fn overlaps_mapping(&self, ptr: u64, size: usize) -> bool {
        let end = ptr + size as u64;
        let before = self.mappings.range(..ptr).next_back();
        before.is_some_and(|(&start, m)| start + m.size as u64 > ptr)
            || self.mappings.range(ptr..end).next().is_some()
    }

    /// The starts of the mappings that exactly cover `ptr..ptr + size`, back to back.
    fn whole_mappings(&self, ptr: u64, size: usize) -> Result<Vec<u64>, CUresult> {
        let end = ptr.checked_add(size as u64).ok_or(INVALID_VALUE)?;
        let mut at = ptr;
        let mut starts = Vec::new();
        for (&start, mapping) in self.mappings.range(ptr..end) {
            if start != at {
                return Err(INVALID_VALUE);
            }
            at += mapping.size as u64;
            starts.push(start);
        }
        if at != end || starts.is_empty() {
            return Err(INVALID_VALUE);
        }
        Ok(starts)
    }

    /// Whether `ptr..ptr + len` is mapped throughout with `access` (read: any access; write:
    /// read-write). An unmapped byte is `CUDA_ERROR_INVALID_VALUE`; a byte without that
    /// access is `CUDA_ERROR_ILLEGAL_ADDRESS` (where the real device faults).
    fn accessible(&self, ptr: u64, len: usize, write: bool) -> Outcome {
        let end = ptr.checked_add(len as u64).ok_or(INVALID_VALUE)?;
        let mut at = ptr;
        while at < end {
            let (&start, mapping) = self
                .mappings
                .range(..=at)
                .next_back()
                .ok_or(INVALID_VALUE)?;
            let mapping_end = start + mapping.size as u64;
            if mapping_end <= at {
                return Err(INVALID_VALUE);
            }
            let allowed = match write {
                true => mapping.access == ACCESS_READWRITE,
                false => mapping.access != ACCESS_NONE,
            };
            if !allowed {
                return Err(ILLEGAL_ADDRESS);
            }
            at = mapping_end;
        }
        Ok(())
    }
}

/// All of an allocation (or its first `size` bytes), at a granularity-aligned address inside a
/// reservation where nothing is mapped; no access yet.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: Handle,
    flags: u64,
) -> CUresult {
    code(initialized().and_then(|mut state| {
        let allocation = state.allocations.get(&handle).ok_or(INVALID_HANDLE)?;
        if offset != 0 || flags != 0 || size == 0 || size > allocation.size {
            return Err(INVALID_VALUE);
        }
        if !aligned(ptr) || !aligned(size as u64) || !state.reserved(ptr, size) {
            return Err(INVALID_VALUE);
        }
        if state.overlaps_mapping(ptr, size) {
            return Err(ALREADY_MAPPED);
        }
        let fd = allocation.memfd.as_raw_fd();
        let flags = MAP_SHARED | MAP_FIXED;
        // SAFETY: over part of a reservation of this fake where nothing is mapped (checked).
        let got = unsafe { mmap(ptr as *mut c_void, size, PROT_NONE, flags, fd, 0) };
        if got == MAP_FAILED {
            return Err(OUT_OF_MEMORY);
        }
        let mapping = Mapping {
            size,
            access: ACCESS_NONE,
        };
        state.mappings.insert(ptr, mapping);
        Ok(())
    }))
}

/// Whole mappings, back to back; their range goes back to being reserved.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    code(initialized().and_then(|mut state| {
        let starts = state.whole_mappings(ptr, size)?;
        reserve_range(ptr, size, MAP_FIXED).ok_or(OUT_OF_MEMORY)?;
        for start in starts {
            state.mappings.remove(&start);
        }
        Ok(())
    }))
}

/// Access for device 0 on whole mappings: `mprotect` (read-only is `PROT_READ`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const AccessDesc,
    count: usize,
) -> CUresult {
    code(initialized().and_then(|mut state| {
        if desc.is_null() || count == 0 {
            return Err(INVALID_VALUE);
        }
        // SAFETY: the caller passes `count` descriptors at `desc`.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        let mut access = ACCESS_NONE;
        for d in descs {
            device_location(&d.location)?;
            if !matches!(d.flags, ACCESS_NONE | ACCESS_READ | ACCESS_READWRITE) {
                return Err(INVALID_VALUE);
            }
            access = d.flags;
        }
        let starts = state.whole_mappings(ptr, size)?;
        let prot = match access {
            ACCESS_READWRITE => PROT_READ | PROT_WRITE,
            ACCESS_READ => PROT_READ,
            _ => PROT_NONE,
        };
        // SAFETY: whole mappings of this fake (checked).
        if unsafe { mprotect(ptr as *mut c_void, size, prot) } != 0 {
            return Err(OPERATING_SYSTEM);
        }
        for start in starts {
            if let Some(mapping) = state.mappings.get_mut(&start) {
                mapping.access = access;
            }
        }
        Ok(())
    }))
}

// ---- copies --------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    count: usize,
) -> CUresult {
    code(in_context().and_then(|state| {
        state.accessible(dst, count, true)?;
        if count > 0 && src.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: `dst` is mapped writable for `count` bytes (checked, and the lock keeps it
        // so); the caller's `src` holds `count` bytes.
        unsafe { std::ptr::copy(src.cast::<u8>(), dst as *mut u8, count) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    count: usize,
) -> CUresult {
    code(in_context().and_then(|state| {
        state.accessible(src, count, false)?;
        if count > 0 && dst.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: `src` is mapped readable for `count` bytes (checked, and the lock keeps it
        // so); the caller's `dst` has room for `count` bytes.
        unsafe { std::ptr::copy(src as *const u8, dst.cast::<u8>(), count) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, count: usize) -> CUresult {
    code(in_context().and_then(|state| {
        state.accessible(src, count, false)?;
        state.accessible(dst, count, true)?;
        // SAFETY: both ranges are mapped for `count` bytes, `dst` writable (checked, and the
        // lock keeps them so); `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, count: usize) -> CUresult {
    code(in_context().and_then(|state| {
        state.accessible(dst, count, true)?;
        // SAFETY: `dst` is mapped writable for `count` bytes (checked, and the lock keeps it so).
        unsafe { std::ptr::write_bytes(dst as *mut u8, value, count) };
        Ok(())
    }))
}
