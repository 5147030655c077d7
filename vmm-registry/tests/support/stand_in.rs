//! The host-memory stand-in for a fabric handle in tests: a buffer to export, described and
//! imported by the library's `vmm_registry::host_stand_in` (which the memory service's
//! publisher uses too).

use std::os::fd::{AsFd, OwnedFd};

use vmm_core::cuda::FabricDescriptor;
use vmm_core::shm::HostBuffer;
use vmm_registry::host_stand_in;

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
    let descriptor = host_stand_in::describe(&[(fd.as_fd(), size)]).expect("a stand-in descriptor");
    (buf, descriptor, fd)
}

/// Map the memory a stand-in descriptor names: what an importer does.
pub fn import(descriptor: &FabricDescriptor) -> Result<HostBuffer, host_stand_in::StandInError> {
    host_stand_in::import(descriptor)
}
