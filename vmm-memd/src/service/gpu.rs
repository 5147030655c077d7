//! The service's GPU backend: chunks made with `cuMemCreate` through vmm-core, exported as
//! POSIX fds that the service then holds (the exported fd keeps the memory, which
//! `tests/gpu_held_fd.rs` proves; the allocation's own handle is released at once, except for
//! fabric-shareable chunks, whose fabric handles are exported from it), and digests of
//! committed chunks (taken in the background after a commit: `registry/hashing.rs`). Nothing here runs, and no CUDA context is made, until the first request
//! for a GPU region: a host-only service never loads the driver.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

use vmm_core::cuda::{
    Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};

use crate::error::{GpuOp, Refusal};
use crate::protocol::ChunkDigest;
use crate::service::generation::ChunkFd;

/// How much of a chunk one copy to the host reads while hashing: 16 MiB.
const HASH_PIECE: usize = 16 << 20;

/// One device's resources: one that allocates (fd-shareable, and fabric-shareable where
/// the device and this process support it) and one that maps read-only (to hash).
#[derive(Debug, Clone)]
struct DeviceResources {
    allocate: VirtualMemoryResource,
    read: VirtualMemoryResource,
    fabric: bool,
}

/// The devices the service has used, by UUID, made on first use.
#[derive(Debug, Default)]
pub(crate) struct Gpus {
    devices: Mutex<HashMap<[u8; 16], DeviceResources>>,
}

impl Gpus {
    fn resources(&self, uuid: &[u8; 16]) -> Result<DeviceResources, Refusal> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = devices.get(uuid) {
            return Ok(r.clone());
        }
        let none = |_| Refusal::NoSuchDevice { uuid: *uuid };
        let device = Device::by_uuid(uuid).map_err(none)?;
        // Fabric where the device and this process can (an IMEX channel): the chunks can
        // then also be exported as fabric handles; the service itself holds POSIX fds.
        let fabric = device.check_fabric().is_ok();
        let handle_type = match fabric {
            true => HandleType::PosixFdAndFabric,
            false => HandleType::PosixFd,
        };
        let allocate = VirtualMemoryResource::new(
            &device,
            ResourceOptions::default().handle_type(handle_type),
        )
        .map_err(none)?;
        let read = VirtualMemoryResource::new(&device, ResourceOptions::default().read_only(true))
            .map_err(none)?;
        let made = DeviceResources {
            allocate,
            read,
            fabric,
        };
        devices.insert(*uuid, made.clone());
        Ok(made)
    }

    /// `sizes` rounded up to device `uuid`'s granularity, and whether its chunks are made
    /// fabric-shareable. Loads the driver on first use.
    pub(crate) fn rounded(&self, uuid: &[u8; 16], sizes: &[u64]) -> Result<Vec<u64>, Refusal> {
        let granularity = self.resources(uuid)?.allocate.granularity() as u64;
        sizes
            .iter()
            .map(|&s| {
                s.div_ceil(granularity)
                    .checked_mul(granularity)
                    .ok_or(Refusal::InvalidRequest {
                        rule: crate::error::RequestRule::Chunks,
                        detail: format!("a chunk of {s} bytes overflows when rounded up"),
                    })
            })
            .collect()
    }

    /// This process's ordinal for device `uuid`, where the service has opened it already
    /// (`None` otherwise: this never loads the driver).
    pub(crate) fn opened_ordinal(&self, uuid: &[u8; 16]) -> Option<usize> {
        let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.get(uuid).map(|r| r.allocate.device().ordinal())
    }

    /// Whether device `uuid`'s chunks are made fabric-shareable.
    pub(crate) fn fabric(&self, uuid: &[u8; 16]) -> bool {
        self.resources(uuid).is_ok_and(|r| r.fabric)
    }

    /// A fresh chunk of `len` bytes (a multiple of the granularity) on device `uuid`, as the
    /// exported fd that keeps it; filled with zeros when `zeroed` (`cuMemCreate` does not
    /// clear memory). Where the chunk is fabric-shareable the allocation itself comes too
    /// (fabric handles are exported from it; it is not kept across a restart); otherwise it
    /// is released at once and the fd alone keeps the memory.
    pub(crate) fn create(
        &self,
        uuid: &[u8; 16],
        len: u64,
        zeroed: bool,
    ) -> Result<(OwnedFd, Option<VirtualMemoryBuffer>), Refusal> {
        let failed = |e: vmm_core::Error| Refusal::DeviceFailed {
            device: *uuid,
            op: GpuOp::Allocate,
            error: e.to_string(),
        };
        let resources = self.resources(uuid)?;
        // Linux on 64-bit only (lib.rs): a u64 fits a usize.
        let buffer = resources.allocate.allocate(len as usize).map_err(failed)?;
        if zeroed {
            buffer.fill(0).map_err(failed)?;
        }
        let descriptor = buffer.export().map_err(failed)?;
        let fd = descriptor.into_fds().pop().ok_or(Refusal::DeviceFailed {
            device: *uuid,
            op: GpuOp::Allocate,
            error: "the export gave no fd".into(),
        })?;
        Ok((fd, resources.fabric.then_some(buffer)))
    }

    /// A fabric-shareable copy of the chunk `fd` (`len` bytes) on device `uuid`, made on the
    /// device: a fresh chunk ([`create`](Self::create)) with the bytes copied in, as its fd
    /// and its allocation (what fabric handles are exported from); `None` where this device's
    /// chunks are not fabric-shareable. For a generation taken back from the keeper: its
    /// chunks are imports of the fds it held, and an import cannot be exported again.
    pub(crate) fn fabric_copy(
        &self,
        uuid: &[u8; 16],
        fd: &OwnedFd,
        len: u64,
    ) -> Result<Option<(OwnedFd, VirtualMemoryBuffer)>, Refusal> {
        let resources = self.resources(uuid)?;
        if !resources.fabric {
            return Ok(None);
        }
        let source = map_read_only(&resources.read, uuid, fd, len)?;
        let (copy, allocation) = self.create(uuid, len, false)?;
        let allocation = allocation.ok_or(Refusal::DeviceFailed {
            device: *uuid,
            op: GpuOp::Allocate,
            error: "a fabric-shareable chunk came without its allocation".into(),
        })?;
        allocation
            .copy_from(&source)
            .map_err(|e| Refusal::DeviceFailed {
                device: *uuid,
                op: GpuOp::Copy,
                error: e.to_string(),
            })?;
        Ok(Some((copy, allocation)))
    }

    /// The SHA-256 digest of each chunk's bytes, read through a read-only mapping of its
    /// own; given up (`None`) once `stopped()` says so: it is asked
    /// between 16 MiB pieces, so a service stopping does not wait for a whole pass.
    pub(crate) fn digests_until(
        &self,
        uuid: &[u8; 16],
        chunks: &[(ChunkFd, u64)],
        stopped: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<ChunkDigest>>, Refusal> {
        let resources = self.resources(uuid)?;
        let mut digests = Vec::with_capacity(chunks.len());
        for (fd, len) in chunks {
            let mapped = map_read_only(&resources.read, uuid, fd, *len)?;
            match digest(&mapped, uuid, stopped)? {
                Some(d) => digests.push(d),
                None => return Ok(None),
            }
        }
        Ok(Some(digests))
    }
}

/// The SHA-256 of `len` zero bytes: a remade chunk's digest.
pub(crate) fn zero_digest(len: u64) -> ChunkDigest {
    let zeros = vec![0u8; HASH_PIECE];
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut left = len as usize;
    while left > 0 {
        let n = left.min(HASH_PIECE);
        context.update(&zeros[..n]);
        left -= n;
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(context.finish().as_ref());
    out
}

/// Import one chunk (fd, length) read-only.
fn map_read_only(
    resource: &VirtualMemoryResource,
    uuid: &[u8; 16],
    fd: &OwnedFd,
    len: u64,
) -> Result<VirtualMemoryBuffer, Refusal> {
    let failed = |e: vmm_core::Error| Refusal::DeviceFailed {
        device: *uuid,
        op: GpuOp::Import,
        error: e.to_string(),
    };
    let len = len as usize;
    let descriptor =
        IpcDescriptor::from_fds(&[fd.as_fd()], &[len], HandleType::PosixFd, len).map_err(failed)?;
    resource.import(&descriptor).map_err(failed)
}

/// SHA-256 of a mapped chunk's bytes, copied to the host a piece at a time; `None` once
/// `stopped()` (asked before each piece).
fn digest(
    buffer: &VirtualMemoryBuffer,
    uuid: &[u8; 16],
    stopped: &dyn Fn() -> bool,
) -> Result<Option<ChunkDigest>, Refusal> {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut piece = vec![0u8; HASH_PIECE.min(buffer.size())];
    let mut offset = 0;
    while offset < buffer.size() {
        if stopped() {
            return Ok(None);
        }
        let n = piece.len().min(buffer.size() - offset);
        buffer
            .read_at(offset, &mut piece[..n])
            .map_err(|e| Refusal::DeviceFailed {
                device: *uuid,
                op: GpuOp::Read,
                error: e.to_string(),
            })?;
        context.update(&piece[..n]);
        offset += n;
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(context.finish().as_ref());
    Ok(Some(out))
}
