//! Host shared memory (memfd) with the export/import model of the CUDA path.
//!
//! The GPU-less twin of [`cuda`](crate::cuda): a [`HostBuffer`] is a sealed memfd mapped shared;
//! [`HostBuffer::export`] gives a [`HostDescriptor`] that alone owns a fresh fd for it, and
//! [`HostBuffer::import`] maps the same pages in any process that receives the descriptor. Both
//! travel through [`wire`](crate::wire) (Process arguments, Queue items), which is how CI exercises
//! the cross-process machinery without a GPU.

mod buffer;
mod descriptor;
mod map;

pub use buffer::HostBuffer;
pub use descriptor::HostDescriptor;

/// Whether a [`HostBuffer`] can hold no fd: the kernel lets this process reopen its own
/// mappings through `/proc/self/map_files` (root or `CAP_CHECKPOINT_RESTORE`). Where it cannot,
/// each buffer keeps its memfd open so that it can still export.
pub fn buffers_hold_no_fd() -> bool {
    map::reopen_supported()
}
