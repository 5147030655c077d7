//! The baselines' raw calls: the CUDA driver through `cudarc::driver::sys`, a bare
//! `SCM_RIGHTS` socket, and memfd `mmap`/`munmap`. Every `unsafe` of the bench lives here.
//!
//! These mirror `shared/anchors/raw_vmm.c` and `init_cost.c` call for call: no validation, no
//! RAII, one current context set once. A failing call panics with its name (a bench has no
//! caller to hand an error to).

use std::ffi::{c_int, c_void};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use cudarc::driver::sys;

pub use sys::{CUdeviceptr, CUmemFabricHandle, CUmemGenericAllocationHandle};

fn check(call: &str, rc: sys::CUresult) {
    assert!(
        rc == sys::CUresult::CUDA_SUCCESS,
        "{call} failed: {rc:?} (raw baseline)"
    );
}

/// Whether libcuda can be loaded at all (cudarc panics on the first call otherwise).
pub fn culib_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names; no driver call is made.
    unsafe { sys::is_culib_present() }
}

/// The driver, device 0 and its primary context, set current once, as raw_vmm.c does.
#[derive(Debug)]
pub struct RawCuda {
    ctx: sys::CUcontext,
    prop: sys::CUmemAllocationProp,
    /// The same, shareable by fabric handle instead (`CU_MEM_HANDLE_TYPE_FABRIC`).
    fabric_prop: sys::CUmemAllocationProp,
    access: sys::CUmemAccessDesc,
    granularity: usize,
}

impl RawCuda {
    /// `cuInit`, `cuDeviceGet(0)`, `cuDevicePrimaryCtxRetain`, `cuCtxSetCurrent`, and the
    /// granularity of a device allocation shareable by POSIX fd.
    pub fn init() -> Result<RawCuda, String> {
        let (device, ctx) = init_context()?;
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        };
        let prop = sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes:
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        };
        let access = sys::CUmemAccessDesc {
            location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut granularity = 0usize;
        // SAFETY: `granularity` is a live out-pointer and `prop` a live, initialised struct.
        let rc = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemGetAllocationGranularity: {rc:?}"));
        }
        let fabric_prop = sys::CUmemAllocationProp {
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            ..prop
        };
        Ok(RawCuda {
            ctx,
            prop,
            fabric_prop,
            access,
            granularity,
        })
    }

    /// The minimum allocation granularity (2 MiB on the H200).
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Make the primary context current on the calling thread (criterion runs on one thread,
    /// but a bench may be entered from another).
    pub fn make_current(&self) {
        // SAFETY: `ctx` came from cuDevicePrimaryCtxRetain and is never released.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) });
    }

    /// `cuMemCreate`.
    pub fn create(&self, size: usize) -> CUmemGenericAllocationHandle {
        let mut handle = 0;
        // SAFETY: `handle` is a live out-pointer and `prop` a live, initialised struct.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &self.prop, 0)
        });
        handle
    }

    /// `cuMemRelease`.
    pub fn release(&self, handle: CUmemGenericAllocationHandle) {
        // SAFETY: callers release each handle they created or imported exactly once.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
    }

    /// `cuMemExportToShareableHandle` as a POSIX fd.
    pub fn export(&self, handle: CUmemGenericAllocationHandle) -> OwnedFd {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX fds the driver writes an `int` through the pointer to live `fd`.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        });
        assert!(fd >= 0, "cuMemExportToShareableHandle gave fd {fd}");
        // SAFETY: on success the driver hands us a new open fd that nothing else owns.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    /// `cuMemImportFromShareableHandle` (the fd value cast to a pointer; the fd stays ours).
    pub fn import(&self, fd: BorrowedFd<'_>) -> CUmemGenericAllocationHandle {
        let mut handle = 0;
        // SAFETY: the driver takes the fd *value* as the pointer and never dereferences it;
        // `fd` is open for the call and `handle` is a live out-pointer.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        });
        handle
    }

    /// `cuMemCreate` of an allocation shareable by fabric handle (needs an IMEX channel).
    pub fn create_fabric(&self, size: usize) -> CUmemGenericAllocationHandle {
        let mut handle = 0;
        // SAFETY: `handle` is a live out-pointer and `fabric_prop` a live, initialised struct.
        check("cuMemCreate (fabric)", unsafe {
            sys::cuMemCreate(&mut handle, size, &self.fabric_prop, 0)
        });
        handle
    }

    /// `cuMemExportToShareableHandle` as a fabric handle (64 bytes, nothing to close).
    pub fn export_fabric(&self, handle: CUmemGenericAllocationHandle) -> CUmemFabricHandle {
        let mut fabric = CUmemFabricHandle { data: [0; 64] };
        // SAFETY: for fabric handles the driver writes one `CUmemFabricHandle` through the
        // pointer to live `fabric`; callers pass a live handle.
        check("cuMemExportToShareableHandle (fabric)", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fabric as *mut CUmemFabricHandle).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        });
        fabric
    }

    /// `cuMemImportFromShareableHandle` of a fabric handle.
    pub fn import_fabric(&self, fabric: &CUmemFabricHandle) -> CUmemGenericAllocationHandle {
        let mut handle = 0;
        // SAFETY: the driver reads one `CUmemFabricHandle` through the pointer, which points
        // at a live one it does not keep; `handle` is a live out-pointer.
        check("cuMemImportFromShareableHandle (fabric)", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                (fabric as *const CUmemFabricHandle)
                    .cast_mut()
                    .cast::<c_void>(),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            )
        });
        handle
    }

    /// `cuMemAddressReserve` anywhere, default alignment.
    pub fn reserve(&self, size: usize) -> CUdeviceptr {
        let mut ptr = 0;
        // SAFETY: `ptr` is a live out-pointer; no hint.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        });
        ptr
    }

    /// `cuMemAddressFree`.
    pub fn free(&self, ptr: CUdeviceptr, size: usize) {
        // SAFETY: callers free exactly a range they reserved, with nothing mapped in it.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr, size)
        });
    }

    /// `cuMemMap` of all of `handle` at `ptr`.
    pub fn map(&self, ptr: CUdeviceptr, size: usize, handle: CUmemGenericAllocationHandle) {
        // SAFETY: callers map inside a range they reserved and keep reserved until unmapped.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        });
    }

    /// `cuMemSetAccess`: read-write for device 0.
    pub fn set_access(&self, ptr: CUdeviceptr, size: usize) {
        // SAFETY: one live, initialised access descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &self.access, 1)
        });
    }

    /// `cuMemUnmap`.
    pub fn unmap(&self, ptr: CUdeviceptr, size: usize) {
        // SAFETY: callers unmap exactly a range they mapped, once.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) });
    }

    /// `cuMemGetInfo`: device 0's free and total memory in bytes, as the driver counts them
    /// (every process's allocations). Makes the primary context current first.
    pub fn mem_info(&self) -> (usize, usize) {
        self.make_current();
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two live out-pointers; a context is current on this thread.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        });
        (free, total)
    }
}

/// `cuInit`, `cuDeviceGet(0)`, `cuDevicePrimaryCtxRetain`, `cuCtxSetCurrent`: what
/// init_cost.c's `cuda` child does, and all the GPU-child baseline process does.
pub fn init_context() -> Result<(sys::CUdevice, sys::CUcontext), String> {
    if !culib_present() {
        return Err("libcuda could not be loaded (no NVIDIA driver on this machine)".to_owned());
    }
    let call = |name: &str, rc: sys::CUresult| {
        if rc == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{name}: {rc:?}"))
        }
    };
    // SAFETY: libcuda is present; cuInit takes only flags, which must be 0.
    call("cuInit", unsafe { sys::cuInit(0) })?;
    let mut device = 0;
    // SAFETY: `device` is a live out-pointer.
    call("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, 0) })?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `ctx` is a live out-pointer.
    call("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    // SAFETY: `ctx` was just retained and is never released.
    call("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
    Ok((device, ctx))
}

/// A bare `AF_UNIX`/`SOCK_STREAM` socketpair, CLOEXEC, as raw_vmm.c uses.
pub fn socketpair() -> (OwnedFd, OwnedFd) {
    let mut sv = [-1 as c_int; 2];
    // SAFETY: `sv` is a live array of two ints for the kernel to fill.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: both fds were just created and nothing else owns them.
    unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) }
}

/// raw_vmm.c's `send_fd`: one `sendmsg` of the size (8 bytes) with the fd in `SCM_RIGHTS`.
pub fn send_fd(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>, size: usize) {
    let bytes = size.to_ne_bytes();
    let iov = [IoSlice::new(&bytes)];
    let mut control = [0u8; 64];
    // SAFETY: CMSG_SPACE only computes a length.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) } as usize;
    assert!(space <= control.len());
    // SAFETY: an all-zero msghdr is valid (no name, no iov, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `control`, which holds at least one cmsghdr plus an int; the
    // header pointer is non-null because msg_controllen >= CMSG_SPACE(sizeof int).
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<c_int>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` and everything it points at (`iov`, `bytes`, `control`) are live.
    let sent = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, 0) };
    assert!(sent >= 0, "sendmsg: {}", std::io::Error::last_os_error());
}

/// raw_vmm.c's `recv_fd`: the fd (received CLOEXEC) and the size, or `None` at end of stream.
pub fn recv_fd(sock: BorrowedFd<'_>) -> Option<(OwnedFd, usize)> {
    let mut bytes = [0u8; 8];
    let mut iov = [IoSliceMut::new(&mut bytes)];
    let mut control = [0u8; 64];
    // SAFETY: an all-zero msghdr is valid (no name, no iov, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr().cast();
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` and the buffers it points at are live and writable.
    let got = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got <= 0 {
        return None;
    }
    // SAFETY: the kernel filled `msg`; CMSG_FIRSTHDR reads only within msg_controllen.
    let header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if header.is_null() {
        return None;
    }
    // SAFETY: the first (only) cmsg is the SCM_RIGHTS with one int that send_fd wrote.
    let raw = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<c_int>()) };
    // SAFETY: SCM_RIGHTS installed a fresh fd in this process that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    Some((fd, usize::from_ne_bytes(bytes)))
}

/// Write the 1-byte acknowledgement.
pub fn ack(sock: BorrowedFd<'_>) {
    let ok = 1u8;
    // SAFETY: one live byte.
    let n = unsafe { libc::write(sock.as_raw_fd(), (&ok as *const u8).cast(), 1) };
    assert_eq!(n, 1, "write(ack): {}", std::io::Error::last_os_error());
}

/// Read the 1-byte acknowledgement.
pub fn wait_ack(sock: BorrowedFd<'_>) {
    let mut ok = 0u8;
    // SAFETY: one live, writable byte.
    let n = unsafe { libc::read(sock.as_raw_fd(), (&mut ok as *mut u8).cast(), 1) };
    assert_eq!(n, 1, "read(ack): {}", std::io::Error::last_os_error());
}

/// A shared read-write `mmap` of the first `len` bytes of `fd`.
pub fn mmap_shared(fd: BorrowedFd<'_>, len: usize) -> NonNull<c_void> {
    // SAFETY: a fresh mapping at an address of the kernel's choosing, aliasing nothing.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert!(
        ptr != libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    NonNull::new(ptr).expect("mmap returned null")
}

/// `munmap` of a mapping made by [`mmap_shared`].
pub fn munmap(ptr: NonNull<c_void>, len: usize) {
    // SAFETY: callers pass exactly what mmap_shared returned, once, and hold no reference in it.
    let rc = unsafe { libc::munmap(ptr.as_ptr(), len) };
    assert_eq!(rc, 0, "munmap: {}", std::io::Error::last_os_error());
}

/// A sealed (against shrink and grow) memfd of `len` bytes: the raw twin of a HostBuffer's file.
pub fn sealed_memfd(len: usize) -> OwnedFd {
    // SAFETY: the name is a NUL-terminated literal.
    let fd = unsafe {
        libc::memfd_create(
            c"vmm-bench-raw".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscalls on an fd we own.
    let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
    assert_eq!(rc, 0, "ftruncate: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    let rc = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    assert_eq!(rc, 0, "F_ADD_SEALS: {}", std::io::Error::last_os_error());
    fd
}
