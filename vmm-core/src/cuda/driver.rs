//! The driver layer: one thin checked wrapper per CUDA driver call that `cuda` uses.
//!
//! This is the only module of `cuda` that calls into the driver. Every wrapper initialises the
//! driver first (once per process, after checking that libcuda loads, so a machine without it
//! gets an `Err` rather than cudarc's panic), passes only pointers to live locals, and turns a
//! non-success `CUresult` into [`Error::Cuda`] carrying the call's name and the error's name.
//!
//! It sees only driver types (`CUdeviceptr`, `CUmemLocation`, ...): the API's own types
//! ([`Location`](super::Location), [`Access`](super::Access)) are translated above it.
//!
//! Safety is owned where the precondition is: a wrapper whose soundness depends on what its
//! arguments name (a handle that must still be live, a device range that must be mapped, a
//! context that must not be destroyed) is an `unsafe fn` whose `# Safety` section says exactly
//! what the caller guarantees; each call site says why it holds there. Wrappers that take only
//! plain values, fds the type system keeps open, and out-pointers to locals are safe: the driver
//! checks such arguments itself.
//!
//! Calls that need a current context (copies, memsets, VMM calls) leave that to the caller
//! ([`super::device::Device::make_current`]); these wrappers only translate.

use std::ffi::{CStr, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use cudarc::driver::sys;
use nix::errno::Errno;

use crate::error::{ContractBreach, CudaCode, Unavailable};
use crate::{Error, Result};

pub(crate) use sys::{
    CUdevice, CUdevice_attribute, CUdeviceptr, CUmemAccessDesc, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation,
};

/// The error's name as the driver spells it, or the enum's name if the driver does not know it.
fn error_name(result: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `name` is a live out-pointer; the driver stores a pointer to a static string or
    // leaves it null (for an unknown code). Only called after libcuda loaded (see `check`).
    let rc = unsafe { sys::cuGetErrorName(result, &mut name) };
    if rc == sys::CUresult::CUDA_SUCCESS && !name.is_null() {
        // SAFETY: a non-null result of cuGetErrorName is a NUL-terminated static string.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{result:?}")
    }
}

/// `Ok` for `CUDA_SUCCESS`, else [`Error::Cuda`] naming `call`.
fn check(call: &'static str, result: sys::CUresult) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            call: call.into(),
            name: error_name(result),
            code: CudaCode(result as u32),
        })
    }
}

/// Load libcuda and `cuInit(0)` once per process; later calls return the first outcome.
pub(crate) fn init() -> Result<()> {
    // `None`: no libcuda; `Some(result)`: what cuInit returned.
    static INIT: OnceLock<Option<sys::CUresult>> = OnceLock::new();
    let outcome = INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen libcuda under its usual names; no driver call is made.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        // SAFETY: libcuda is present, so cudarc's lazy symbol lookup succeeds; cuInit takes
        // only flags, which must be 0.
        Some(unsafe { sys::cuInit(0) })
    });
    match *outcome {
        None => Err(Error::CudaUnavailable(Unavailable::NoDriver)),
        Some(result) => {
            check("cuInit", result).map_err(|e| Error::CudaUnavailable(Unavailable::from_error(e)))
        }
    }
}

/// A retained primary context. The handle is process-wide and never released (one per device).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Context(sys::CUcontext);

// SAFETY: a CUcontext is an opaque process-wide handle; the driver API lets any thread make it
// current and use it. We never dereference it.
unsafe impl Send for Context {}
// SAFETY: as above; shared references only copy the handle value.
unsafe impl Sync for Context {}

/// `cuDeviceGetCount`.
pub(crate) fn device_count() -> Result<i32> {
    init()?;
    let mut count = 0;
    // SAFETY: `count` is a live out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`.
pub(crate) fn device_get(ordinal: i32) -> Result<CUdevice> {
    init()?;
    let mut device = 0;
    // SAFETY: `device` is a live out-pointer.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal)
    })?;
    Ok(device)
}

/// `cuDeviceGetName`.
pub(crate) fn device_name(device: CUdevice) -> Result<String> {
    init()?;
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, device)
    })?;
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// `cuDeviceGetAttribute`.
pub(crate) fn device_attribute(device: CUdevice, attribute: CUdevice_attribute) -> Result<i32> {
    init()?;
    let mut value = 0;
    // SAFETY: `value` is a live out-pointer.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, device)
    })?;
    Ok(value)
}

/// `cuDeviceGetUuid_v2`: the identity that survives `CUDA_VISIBLE_DEVICES` renumbering.
pub(crate) fn device_uuid(device: CUdevice) -> Result<[u8; 16]> {
    init()?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a live out-pointer to a 16-byte struct.
    check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(&mut uuid, device)
    })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// `cuDevicePrimaryCtxRetain`. Callers retain once per device and keep it for the process.
pub(crate) fn primary_ctx_retain(device: CUdevice) -> Result<Context> {
    init()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a live out-pointer.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    Ok(Context(ctx))
}

impl Context {
    /// Whether two handles name the same context.
    pub(crate) fn is(&self, other: &Context) -> bool {
        self.0 == other.0
    }
}

/// `cuCtxGetCurrent`: the calling thread's current context (a null handle when none is).
pub(crate) fn ctx_get_current() -> Result<Context> {
    init()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a live out-pointer.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(Context(ctx))
}

/// `cuCtxSetCurrent`: bind `ctx` to the calling thread (a null context unbinds).
///
/// # Safety
///
/// `ctx` must be null or a context that is alive for the whole call: a primary context that is
/// still retained, or a context nobody has destroyed (`cuCtxDestroy`) or released since it was
/// read with [`ctx_get_current`]. The driver cannot check a destroyed context's handle; using
/// one is use after free inside the driver.
pub(crate) unsafe fn ctx_set_current(ctx: Context) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees `ctx` is null or a live context; the call takes it by value.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx.0) })
}

/// `cuCtxSynchronize`: waits for the current context's work (memsets, staged copies).
pub(crate) fn ctx_synchronize() -> Result<()> {
    init()?;
    // SAFETY: no arguments; acts on the calling thread's current context.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// The allocation properties for `location`, with the export handle types `handle_types` (the
/// driver's `CUmemAllocationHandleType` bit mask: 0 none, 1 POSIX fd, 8 fabric) requested.
pub(crate) fn allocation_prop(location: CUmemLocation, handle_types: u32) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType(handle_types),
        location,
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// A device location (`id` = device ordinal).
pub(crate) fn device_location(ordinal: i32) -> CUmemLocation {
    CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// A host location on NUMA node `node`.
pub(crate) fn host_numa_location(node: i32) -> CUmemLocation {
    CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
        id: node,
    }
}

/// Whether two driver locations are the same place.
pub(crate) fn same_location(a: &CUmemLocation, b: &CUmemLocation) -> bool {
    a.type_ == b.type_ && a.id == b.id
}

/// A readable form of a driver location, for errors: `device 1`, `host NUMA node 0`.
pub(crate) fn describe_location(location: &CUmemLocation) -> String {
    match location.type_ {
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => format!("device {}", location.id),
        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA => {
            format!("host NUMA node {}", location.id)
        }
        other => format!("{other:?} {}", location.id),
    }
}

/// Read-write (or read-only) access for device `ordinal`.
pub(crate) fn access_desc(ordinal: i32, read_write: bool) -> CUmemAccessDesc {
    CUmemAccessDesc {
        location: device_location(ordinal),
        flags: if read_write {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
        },
    }
}

/// Whether `desc` grants read access only.
pub(crate) fn access_is_read_only(desc: &CUmemAccessDesc) -> bool {
    desc.flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
}

/// `cuMemGetAllocationGranularity` (minimum when `!recommended`).
pub(crate) fn allocation_granularity(
    prop: &CUmemAllocationProp,
    recommended: bool,
) -> Result<usize> {
    init()?;
    let option = if recommended {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut granularity = 0usize;
    // SAFETY: `granularity` is a live out-pointer and `prop` a live, fully initialised struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut granularity, prop, option)
    })?;
    Ok(granularity)
}

/// `cuMemCreate`: a physical allocation of `size` bytes.
pub(crate) fn mem_create(
    size: usize,
    prop: &CUmemAllocationProp,
) -> Result<CUmemGenericAllocationHandle> {
    init()?;
    let mut handle = 0;
    // SAFETY: `handle` is a live out-pointer and `prop` a live, fully initialised struct.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut handle, size, prop, 0)
    })?;
    Ok(handle)
}

/// `cuMemRelease`: give up one reference to a physical allocation (the memory itself is freed
/// once no mapping of it is left either).
///
/// # Safety
///
/// `handle` must have come from [`mem_create`], [`import_posix_fd`] or [`import_fabric`] in this
/// process and not have been released yet, and the caller must not use it again: allocation
/// handles are the driver's pointers, so a second release (or a release of a handle the driver
/// has since handed out again to someone else) frees what another owner still uses.
pub(crate) unsafe fn mem_release(handle: CUmemGenericAllocationHandle) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees `handle` is live and released only by this call.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemAddressReserve`: a virtual range of `size` bytes, at `hint` if the driver can.
pub(crate) fn address_reserve(
    size: usize,
    alignment: usize,
    hint: CUdeviceptr,
) -> Result<CUdeviceptr> {
    init()?;
    let mut ptr = 0;
    // SAFETY: `ptr` is a live out-pointer; `hint` is only a request, not dereferenced.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, size, alignment, hint, 0)
    })?;
    Ok(ptr)
}

/// `cuMemAddressFree`: give an address range back.
///
/// # Safety
///
/// `ptr` and `size` must be exactly what one [`address_reserve`] returned and was asked for,
/// the range must not have been freed yet, nothing may be mapped in it any more (every
/// [`mem_map`] in it undone by [`mem_unmap`]), and nobody may use an address in it afterwards:
/// the driver may hand the range out again, to this process's next reservation or to another
/// library's.
pub(crate) unsafe fn address_free(ptr: CUdeviceptr, size: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees an exact, live, unmapped reservation that it gives up.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, size)
    })
}

/// `cuMemMap`: map all `size` bytes of `handle` at `ptr`.
///
/// # Safety
///
/// - `ptr..ptr + size` must lie inside a reservation the caller owns (from [`address_reserve`],
///   not yet freed, and not to be freed before the range is unmapped), and nothing may be
///   mapped there yet: mapping over another owner's range would make its addresses show this
///   memory.
/// - `handle` must be a live allocation (see [`mem_release`]). Its size need not be known: the
///   driver refuses to map more than the allocation holds (an imported chunk's size is only
///   what the exporter claimed).
pub(crate) unsafe fn mem_map(
    ptr: CUdeviceptr,
    size: usize,
    handle: CUmemGenericAllocationHandle,
) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees an owned, unmapped range and a live handle.
    check("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size, 0, handle, 0)
    })
}

/// `cuMemUnmap`.
///
/// # Safety
///
/// `ptr..ptr + size` must be exactly a range the caller mapped with one [`mem_map`] and has not
/// unmapped, and no work that touches it may still be queued, nor any address in it be used
/// afterwards (until it is mapped again).
pub(crate) unsafe fn mem_unmap(ptr: CUdeviceptr, size: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees an exact mapping of its own that nothing uses any more.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) })
}

/// `cuMemSetAccess` for every descriptor in `descs`.
///
/// # Safety
///
/// `ptr..ptr + size` must be mapped (by [`mem_map`]) by the caller, who keeps the mapping for
/// the whole call: access is per mapping, and granting it on a range someone else mapped
/// changes who may read and write their memory.
pub(crate) unsafe fn mem_set_access(
    ptr: CUdeviceptr,
    size: usize,
    descs: &[CUmemAccessDesc],
) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees the range is its own live mapping; `descs` is a live
    // slice of `descs.len()` initialised descriptors.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
    })
}

/// `cuMemsetD8_v2`: set `count` bytes at `ptr` to `byte`. Asynchronous for device memory.
///
/// # Safety
///
/// `ptr..ptr + count` must lie inside one mapping that the current context's device may write,
/// and the caller must keep that mapping alive until the memset has finished (it synchronises,
/// [`ctx_synchronize`], before the mapping can be unmapped, also when a later call fails).
pub(crate) unsafe fn memset_d8(ptr: CUdeviceptr, byte: u8, count: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees a writable mapped range that outlives the queued work.
    check("cuMemsetD8_v2", unsafe {
        sys::cuMemsetD8_v2(ptr, byte, count)
    })
}

/// `cuMemcpyHtoD_v2` from `src` to `dst`. From pageable memory the call returns once `src` is
/// staged; the write to the device may still be under way.
///
/// # Safety
///
/// `dst..dst + src.len()` must lie inside one mapping that the current context's device may
/// write, and the caller must keep that mapping alive until the copy has finished (it
/// synchronises, [`ctx_synchronize`], before the mapping can be unmapped, also when a later
/// call fails).
pub(crate) unsafe fn memcpy_htod(dst: CUdeviceptr, src: &[u8]) -> Result<()> {
    init()?;
    // SAFETY: `src` is live and readable for `src.len()` bytes for the call (pageable copies
    // are staged before return); the caller guarantees the device range.
    check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast::<c_void>(), src.len())
    })
}

/// `cuMemcpyDtoH_v2` from `src` into `dst` (synchronous: to pageable memory it returns once
/// the data is in `dst`).
///
/// # Safety
///
/// `src..src + dst.len()` must lie inside one mapping that the current context's device may
/// read, kept alive by the caller for the call.
pub(crate) unsafe fn memcpy_dtoh(dst: &mut [u8], src: CUdeviceptr) -> Result<()> {
    init()?;
    // SAFETY: `dst` is live and writable for `dst.len()` bytes, and the driver writes no more;
    // the caller guarantees the device range.
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
    })
}

/// `cuMemcpyDtoD_v2` of `count` bytes from `src` to `dst`, queued on the null stream (the
/// caller synchronises).
///
/// # Safety
///
/// `src..src + count` must lie inside one mapping that the current context's device may read
/// and `dst..dst + count` inside one it may write, both kept alive by the caller until the
/// copy has finished (it synchronises, [`ctx_synchronize`], before either can be unmapped,
/// also when a later call fails).
pub(crate) unsafe fn memcpy_dtod(dst: CUdeviceptr, src: CUdeviceptr, count: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller guarantees both device ranges.
    check("cuMemcpyDtoD_v2", unsafe {
        sys::cuMemcpyDtoD_v2(dst, src, count)
    })
}

const EXPORT_CALL: &str = "cuMemExportToShareableHandle";

/// `cuMemExportToShareableHandle` as a POSIX fd, owned (and made close-on-exec) at once.
///
/// A failure because the process is at its fd limit is [`Error::FdLimit`] (see
/// [`export_failure`]); any other failure is the call's [`Error::Cuda`].
///
/// # Safety
///
/// `handle` must be a live allocation (see [`mem_release`]) for the whole call.
pub(crate) unsafe fn export_posix_fd(handle: CUmemGenericAllocationHandle) -> Result<OwnedFd> {
    init()?;
    let mut fd: std::ffi::c_int = -1;
    // errno after the call tells a hit fd limit apart from a driver refusal, but only if the
    // call is what set it: nothing clears errno, so an EMFILE left by an earlier failure (of
    // anything, on this thread) would otherwise read as this call's.
    Errno::set_raw(0);
    // SAFETY: the caller guarantees `handle` is live; for
    // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes one `int` through the pointer,
    // and `fd` is a live `c_int`.
    let rc = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    let errno = Errno::last_raw();
    if let Err(error) = check(EXPORT_CALL, rc) {
        return Err(export_failure(error, errno, crate::limits::open_fds));
    }
    if fd < 0 {
        return Err(Error::CudaContract {
            call: EXPORT_CALL.into(),
            breach: ContractBreach::NegativeFd { fd },
        });
    }
    // SAFETY: on success the driver hands the caller a new open fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_cloexec(&fd)?;
    Ok(fd)
}

/// The error for a failed export: [`Error::FdLimit`] when the process ran out of fds, else
/// `error` (the call's own).
///
/// The driver reports a hit fd limit as an ordinary failure; what tells it apart is `errno`
/// right after the call (cleared before it) being `EMFILE`, or, since the driver need not leave
/// errno behind, `count_fds` (which needs an fd itself: `/proc/self/fd`) failing with `EMFILE`.
fn export_failure(
    error: Error,
    errno: i32,
    count_fds: impl FnOnce() -> std::io::Result<usize>,
) -> Error {
    let at_limit =
        errno == libc::EMFILE || count_fds().is_err_and(|e| e.raw_os_error() == Some(libc::EMFILE));
    if at_limit {
        Error::fd_limit(format!(
            "{EXPORT_CALL} needs a fresh fd for each exported chunk ({error})"
        ))
    } else {
        error
    }
}

/// The driver does not promise `O_CLOEXEC`; every fd of this crate is close-on-exec.
fn set_cloexec(fd: &OwnedFd) -> Result<()> {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
        .map(drop)
        .map_err(|e| Error::errno("fcntl(F_SETFD, FD_CLOEXEC) on an exported fd", e))
}

/// `cuMemImportFromShareableHandle` of a POSIX fd; the driver does not take the fd.
///
/// Safe: `fd` is open for the call (the borrow says so), and the driver checks that it is an
/// exported allocation: any other fd is refused with an error (`CUDA_ERROR_INVALID_VALUE` or
/// similar), which is how a forged descriptor ends.
pub(crate) fn import_posix_fd(fd: BorrowedFd<'_>) -> Result<CUmemGenericAllocationHandle> {
    init()?;
    let mut handle = 0;
    // SAFETY: for POSIX fds the driver takes the fd *value* cast to a pointer and never
    // dereferences it; `fd` stays open for the call; `handle` is a live out-pointer.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(handle)
}

/// The size of a fabric handle (`CUmemFabricHandle`).
pub(crate) const FABRIC_HANDLE_LEN: usize = 64;

/// `cuMemExportToShareableHandle` as a fabric handle: 64 bytes of plain data (no fd, nothing
/// to close).
///
/// # Safety
///
/// `handle` must be a live allocation (see [`mem_release`]) for the whole call.
pub(crate) unsafe fn export_fabric(
    handle: CUmemGenericAllocationHandle,
) -> Result<[u8; FABRIC_HANDLE_LEN]> {
    init()?;
    let mut fabric = sys::CUmemFabricHandle {
        data: [0; FABRIC_HANDLE_LEN],
    };
    // SAFETY: the caller guarantees `handle` is live; for CU_MEM_HANDLE_TYPE_FABRIC the driver
    // writes one `CUmemFabricHandle` (64 bytes) through the pointer, and `fabric` is a live one.
    check(EXPORT_CALL, unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            0,
        )
    })?;
    Ok(fabric.data)
}

/// `cuMemImportFromShareableHandle` of a fabric handle.
///
/// Safe: the driver reads the 64 bytes `fabric` points at for the call and checks them: bytes
/// that name no exported allocation (forged, or of memory the exporter has released) are
/// refused with an error, which is how a forged descriptor ends.
pub(crate) fn import_fabric(
    fabric: &[u8; FABRIC_HANDLE_LEN],
) -> Result<CUmemGenericAllocationHandle> {
    init()?;
    let fabric = sys::CUmemFabricHandle { data: *fabric };
    let mut handle = 0;
    // SAFETY: for CU_MEM_HANDLE_TYPE_FABRIC the driver reads one `CUmemFabricHandle` through
    // the pointer, and `fabric` is a live one that the driver does not keep; `handle` is a live
    // out-pointer.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            (&fabric as *const sys::CUmemFabricHandle)
                .cast_mut()
                .cast::<c_void>(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        )
    })?;
    Ok(handle)
}

/// `cuMemGetAllocationPropertiesFromHandle`.
///
/// # Safety
///
/// `handle` must be a live allocation (see [`mem_release`]) for the whole call.
pub(crate) unsafe fn allocation_properties(
    handle: CUmemGenericAllocationHandle,
) -> Result<CUmemAllocationProp> {
    init()?;
    let mut prop = allocation_prop(device_location(-1), 0);
    // SAFETY: the caller guarantees `handle` is live; `prop` is a live, initialised
    // out-struct of the right type.
    check("cuMemGetAllocationPropertiesFromHandle", unsafe {
        sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle)
    })?;
    Ok(prop)
}

/// Whether `fd` is an open descriptor in this process: its flags (`fcntl(F_GETFD)`), or the
/// error (`EBADF` for a closed number).
///
/// Not a driver call, but the one check that needs a raw fd: a descriptor's fds are checked
/// before the driver sees them, and a closed number must be answered, not assumed.
pub(crate) fn fd_flags(fd: RawFd) -> Result<i32> {
    // SAFETY: F_GETFD only reads the descriptor table; any int is a valid argument (EBADF for
    // one that is not open).
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags == -1 {
        Err(Error::last_os(format!("fcntl({fd}, F_GETFD)")))
    } else {
        Ok(flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_codes_are_the_drivers() {
        use sys::CUresult as R;
        for (code, result) in [
            (CudaCode::INVALID_VALUE, R::CUDA_ERROR_INVALID_VALUE),
            (CudaCode::OUT_OF_MEMORY, R::CUDA_ERROR_OUT_OF_MEMORY),
            (CudaCode::NOT_INITIALIZED, R::CUDA_ERROR_NOT_INITIALIZED),
            (CudaCode::NO_DEVICE, R::CUDA_ERROR_NO_DEVICE),
            (CudaCode::INVALID_DEVICE, R::CUDA_ERROR_INVALID_DEVICE),
            (CudaCode::NOT_PERMITTED, R::CUDA_ERROR_NOT_PERMITTED),
            (CudaCode::NOT_SUPPORTED, R::CUDA_ERROR_NOT_SUPPORTED),
        ] {
            assert_eq!(code, CudaCode(result as u32), "{result:?}");
        }
    }

    #[test]
    fn closed_fd_is_not_open() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(fd_flags(file.as_raw_fd()).is_ok());
        // Numbers that no test opens (a just-closed one could be reused by a parallel test).
        for closed in [-1, i32::MAX - 7] {
            let err = fd_flags(closed).unwrap_err();
            assert!(
                matches!(&err, Error::Os { op, .. } if op == &format!("fcntl({closed}, F_GETFD)")),
                "{err:?}"
            );
            assert_eq!(err.raw_os_error(), Some(libc::EBADF));
        }
    }

    fn refused() -> Error {
        Error::Cuda {
            call: EXPORT_CALL.into(),
            name: "CUDA_ERROR_INVALID_VALUE".to_owned(),
            code: CudaCode::INVALID_VALUE,
        }
    }

    fn emfile() -> std::io::Result<usize> {
        Err(std::io::Error::from_raw_os_error(libc::EMFILE))
    }

    #[test]
    fn export_at_the_fd_limit_is_fd_limit() {
        // errno says EMFILE: the fd count is not even needed.
        let err = export_failure(refused(), libc::EMFILE, || unreachable!());
        let Error::FdLimit { op, soft_limit, .. } = &err else {
            panic!("{err:?}")
        };
        assert!(
            op.contains(EXPORT_CALL)
                && op.contains("a fresh fd for each exported chunk")
                && op.contains("CUDA_ERROR_INVALID_VALUE"),
            "{op}"
        );
        assert_eq!(*soft_limit, crate::limits::nofile_soft_limit());
        assert!(err.to_string().contains("RLIMIT_NOFILE"), "{err}");
        // errno left clear, but not even /proc/self/fd can be opened.
        let err = export_failure(refused(), 0, emfile);
        assert!(matches!(err, Error::FdLimit { .. }), "{err:?}");
        assert_eq!(err.raw_os_error(), Some(libc::EMFILE));
    }

    #[test]
    fn other_export_failures_stay_the_drivers() {
        let err = export_failure(refused(), 0, || Ok(10));
        assert!(
            matches!(&err, Error::Cuda { call, name, code: CudaCode::INVALID_VALUE }
                if call == EXPORT_CALL && name == "CUDA_ERROR_INVALID_VALUE"),
            "{err:?}"
        );
        // Another errno (stale or not) and another failure to count are not the fd limit.
        let err = export_failure(refused(), libc::ENOMEM, || {
            Err(std::io::Error::from_raw_os_error(libc::EACCES))
        });
        assert!(matches!(err, Error::Cuda { .. }), "{err:?}");
    }

    #[test]
    fn init_without_cuda_is_an_error_not_a_panic() {
        // SAFETY: see `init`.
        if unsafe { sys::is_culib_present() } {
            return;
        }
        let err = init().unwrap_err();
        assert!(
            matches!(&err, Error::CudaUnavailable(Unavailable::NoDriver))
                && err.to_string().contains("libcuda could not be loaded"),
            "{err:?}"
        );
        assert!(matches!(device_count(), Err(Error::CudaUnavailable(_))));
    }
}
