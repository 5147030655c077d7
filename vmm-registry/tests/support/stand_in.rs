//! The host-memory stand-in for a fabric handle, across "nodes" on one machine (as
//! tests/tests/tls does in the scenario suite): the exporter's memfd is named in the handle's
//! 64 bytes (`/proc/<pid>/fd/<n>`), and an importer of the same uid (or root) opens and maps
//! it. Whoever holds the bytes holds the memory, as with a fabric handle; the bytes cross only
//! the mutual-TLS stream.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use vmm_core::cuda::{FabricDescriptor, FabricHandle};
use vmm_core::shm::{HostBuffer, HostDescriptor};

/// An exported host buffer of `size` bytes filled with `pattern(1, size)`, the stand-in
/// descriptor naming its memfd, and the fd (the name is good while it is open).
pub fn export(size: usize) -> (HostBuffer, FabricDescriptor, OwnedFd) {
    let buf = HostBuffer::new(size).expect("a host buffer");
    buf.write_at(0, &vmm_tests::pattern(1, size))
        .expect("fill it");
    let exported = buf.export().expect("export it");
    let fd = exported
        .fd()
        .expect("an exported buffer holds its fd")
        .try_clone_to_owned()
        .expect("dup the fd");
    let descriptor = descriptor_for(&fd, size, size);
    (buf, descriptor, fd)
}

/// A stand-in descriptor naming `fd` in this process, announcing `size` bytes in one chunk of
/// `chunk` bytes.
pub fn descriptor_for(fd: &OwnedFd, size: usize, chunk: usize) -> FabricDescriptor {
    let path = format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd());
    let mut bytes = [0u8; 64];
    bytes[..path.len()].copy_from_slice(path.as_bytes());
    FabricDescriptor::from_handles(&[FabricHandle::from_bytes(bytes)], &[chunk], size, [7; 16])
        .expect("a stand-in descriptor")
}

/// Map the memory a stand-in descriptor names: what an importer does.
pub fn import(descriptor: &FabricDescriptor) -> std::io::Result<HostBuffer> {
    let bytes = descriptor.handles()[0].as_bytes();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let path = std::str::from_utf8(&bytes[..end]).map_err(std::io::Error::other)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let host =
        HostDescriptor::from_fd(file.as_fd(), descriptor.size()).map_err(std::io::Error::other)?;
    HostBuffer::import(&host).map_err(std::io::Error::other)
}
