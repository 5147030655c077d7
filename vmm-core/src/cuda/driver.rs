//! The driver layer: one thin checked wrapper per CUDA driver call that `cuda` uses.
//!
//! This is the only module of `cuda` with `unsafe`. Every wrapper initialises the driver first
//! (once per process, after checking that libcuda loads, so a machine without it gets an `Err`
//! rather than cudarc's panic), passes only pointers to live locals, and turns a non-success
//! `CUresult` into [`Error::Cuda`] carrying the call's name and the error's name.
//!
//! Calls that need a current context (copies, memsets, VMM calls) leave that to the caller
//! ([`super::device::Device::make_current`]); these wrappers only translate.

use std::ffi::{CStr, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::resource::Location;
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
            code: result as u32,
        })
    }
}

/// Load libcuda and `cuInit(0)` once per process; later calls return the first outcome.
pub(crate) fn init() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen libcuda under its usual names; no driver call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "libcuda could not be loaded (no NVIDIA driver on this machine, or \
                        libcuda.so.1 is not on the loader path)"
                    .to_owned(),
            );
        }
        // SAFETY: libcuda is present, so cudarc's lazy symbol lookup succeeds; cuInit takes
        // only flags, which must be 0.
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| e.to_string())
    })
    .clone()
    .map_err(Error::CudaUnavailable)
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

/// `cuCtxSetCurrent`.
pub(crate) fn ctx_set_current(ctx: Context) -> Result<()> {
    init()?;
    // SAFETY: `ctx` is a retained primary context (never released), or the context that was
    // current on this thread when a `CurrentContext` guard was made and that the guard now
    // restores (null unbinds); the driver validates the handle either way.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx.0) })
}

/// `cuCtxSynchronize`: waits for the current context's work (memsets, staged copies).
pub(crate) fn ctx_synchronize() -> Result<()> {
    init()?;
    // SAFETY: no arguments; acts on the calling thread's current context.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// The allocation properties for `location`, with POSIX-fd export requested when `posix_fd`.
pub(crate) fn allocation_prop(location: CUmemLocation, posix_fd: bool) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if posix_fd {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        },
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

/// The driver's form of `location`; `device` is the ordinal that [`Location::Device`] means.
pub(crate) fn to_sys_location(location: Location, device: i32) -> CUmemLocation {
    match location {
        Location::Device => device_location(device),
        Location::HostNuma(node) => CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
            id: node,
        },
    }
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

/// `cuMemRelease`.
pub(crate) fn mem_release(handle: CUmemGenericAllocationHandle) -> Result<()> {
    init()?;
    // SAFETY: the caller (an RAII handle) releases each handle it created or imported once.
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

/// `cuMemAddressFree`, with exactly the pointer and size that `address_reserve` gave.
pub(crate) fn address_free(ptr: CUdeviceptr, size: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller (an RAII handle) frees each reservation once, nothing mapped in it.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, size)
    })
}

/// `cuMemMap` of all of `handle` at `ptr`.
pub(crate) fn mem_map(
    ptr: CUdeviceptr,
    size: usize,
    handle: CUmemGenericAllocationHandle,
) -> Result<()> {
    init()?;
    // SAFETY: `ptr..ptr+size` lies in a live reservation (the caller's RAII handle holds it).
    check("cuMemMap", unsafe {
        sys::cuMemMap(ptr, size, 0, handle, 0)
    })
}

/// `cuMemUnmap`.
pub(crate) fn mem_unmap(ptr: CUdeviceptr, size: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller (an RAII handle) unmaps exactly the range it mapped, once.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) })
}

/// `cuMemSetAccess` for every descriptor in `descs`.
pub(crate) fn mem_set_access(
    ptr: CUdeviceptr,
    size: usize,
    descs: &[CUmemAccessDesc],
) -> Result<()> {
    init()?;
    // SAFETY: `descs` is a live slice of `descs.len()` initialised descriptors.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
    })
}

/// `cuMemsetD8_v2` (asynchronous for device memory: callers synchronise).
pub(crate) fn memset_d8(ptr: CUdeviceptr, byte: u8, count: usize) -> Result<()> {
    init()?;
    // SAFETY: the caller checked `ptr..ptr+count` lies in one mapped chunk it keeps alive.
    check("cuMemsetD8_v2", unsafe {
        sys::cuMemsetD8_v2(ptr, byte, count)
    })
}

/// `cuMemcpyHtoD_v2` from `src`.
pub(crate) fn memcpy_htod(dst: CUdeviceptr, src: &[u8]) -> Result<()> {
    init()?;
    // SAFETY: `src` is live for the call (pageable copies are staged before return); the
    // caller checked `dst..dst+src.len()` lies in one mapped chunk it keeps alive.
    check("cuMemcpyHtoD_v2", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast::<c_void>(), src.len())
    })
}

/// `cuMemcpyDtoH_v2` into `dst` (synchronous for pageable memory).
pub(crate) fn memcpy_dtoh(dst: &mut [u8], src: CUdeviceptr) -> Result<()> {
    init()?;
    // SAFETY: `dst` is live and writable for `dst.len()` bytes; the caller checked
    // `src..src+dst.len()` lies in one mapped chunk it keeps alive.
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
    })
}

/// `cuMemExportToShareableHandle` as a POSIX fd, owned (and made close-on-exec) at once.
///
/// On failure also returns the `errno` seen right after the call, which tells a hit fd limit
/// (`EMFILE`) apart from a driver refusal.
pub(crate) fn export_posix_fd(
    handle: CUmemGenericAllocationHandle,
) -> std::result::Result<OwnedFd, (Error, std::io::Error)> {
    init().map_err(|e| (e, std::io::Error::from_raw_os_error(0)))?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes an `int` through
    // the pointer; `fd` is a live `c_int`.
    let rc = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    let errno = std::io::Error::last_os_error();
    check("cuMemExportToShareableHandle", rc).map_err(|e| (e, errno))?;
    if fd < 0 {
        return Err((
            Error::CudaContract {
                call: "cuMemExportToShareableHandle".into(),
                detail: format!("gave fd {fd}"),
            },
            std::io::Error::from_raw_os_error(libc::EBADF),
        ));
    }
    // SAFETY: on success the driver hands the caller a new open fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_cloexec(&fd).map_err(|e| (e, std::io::Error::from_raw_os_error(0)))?;
    Ok(fd)
}

/// The driver does not promise `O_CLOEXEC`; every fd of this crate is close-on-exec.
fn set_cloexec(fd: &OwnedFd) -> Result<()> {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
        .map(drop)
        .map_err(|e| Error::errno("fcntl(F_SETFD, FD_CLOEXEC) on an exported fd", e))
}

/// `cuMemImportFromShareableHandle` of a POSIX fd; the driver does not take the fd.
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

/// `cuMemGetAllocationPropertiesFromHandle`.
pub(crate) fn allocation_properties(
    handle: CUmemGenericAllocationHandle,
) -> Result<CUmemAllocationProp> {
    init()?;
    let mut prop = allocation_prop(device_location(-1), false);
    // SAFETY: `prop` is a live, initialised out-struct of the right type.
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
    fn closed_fd_is_not_open() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(fd_flags(file.as_raw_fd()).is_ok());
        // Numbers that no test opens (a just-closed one could be reused by a parallel test).
        let m = fd_flags(-1).unwrap_err().to_string();
        assert!(
            m.contains("F_GETFD") && m.contains("Bad file descriptor"),
            "{m}"
        );
        assert!(fd_flags(i32::MAX - 7).is_err());
    }

    #[test]
    fn init_without_cuda_is_an_error_not_a_panic() {
        // SAFETY: see `init`.
        if unsafe { sys::is_culib_present() } {
            return;
        }
        let err = init().unwrap_err();
        assert!(err.to_string().contains("libcuda"), "{err}");
        assert!(device_count().is_err());
    }
}
