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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::wire::{decode, encode};

    #[test]
    fn alias_sees_writes_both_ways() {
        let buf = HostBuffer::new(10_000).unwrap();
        let alias = HostBuffer::import(&buf.export().unwrap()).unwrap();
        assert_ne!(alias.as_ptr(), buf.as_ptr());
        buf.write_at(9_990, b"0123456789").unwrap();
        let mut out = [0u8; 10];
        alias.read_at(9_990, &mut out).unwrap();
        assert_eq!(&out, b"0123456789");
        alias.fill(3).unwrap();
        assert!(buf.to_vec().iter().all(|&b| b == 3));
    }

    #[test]
    fn out_of_bounds_copies_are_refused() {
        let buf = HostBuffer::new(16).unwrap();
        assert!(buf.write_at(10, &[0; 7]).is_err());
        assert!(buf.read_at(usize::MAX, &mut [0; 2]).is_err());
    }

    #[test]
    fn an_imported_buffer_is_not_exported_again() {
        let buf = HostBuffer::new(16).unwrap();
        let alias = HostBuffer::import(&buf.export().unwrap()).unwrap();
        let err = alias.export().unwrap_err().to_string();
        assert!(err.contains("forward the descriptor"), "{err}");
    }

    #[test]
    fn unsealed_short_or_non_memfd_files_are_refused() {
        let fd =
            nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&fd, 4096).unwrap();
        let unsealed = HostDescriptor::from_fd(std::os::fd::AsFd::as_fd(&fd), 4096).unwrap();
        let err = HostBuffer::import(&unsealed).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("not sealed")),
            "{err:?}"
        );
        let buf = HostBuffer::new(100).unwrap();
        let mut short = buf.export().unwrap();
        short.size = 200;
        let err = HostBuffer::import(&short).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("says 200 bytes but its file holds 100")),
            "{err:?}"
        );
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let not_memfd = HostDescriptor::from_fd(std::os::fd::AsFd::as_fd(&file), 16).unwrap();
        let err = HostBuffer::import(&not_memfd).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("not a memfd")),
            "{err:?}"
        );
    }

    #[test]
    fn empty_buffers_export_and_import_as_empty() {
        let empty = HostBuffer::new(0).unwrap();
        let descriptor = empty.export().unwrap();
        assert!(descriptor.fd().is_none());
        assert!(HostBuffer::import(&descriptor).unwrap().is_empty());
    }

    #[test]
    fn buffers_serialise_by_export_and_refuse_other_formats() {
        let buf = HostBuffer::new(64).unwrap();
        buf.fill(9).unwrap();
        let encoded = encode(&buf).unwrap();
        assert_eq!(encoded.fd_count(), 1);
        let fds = encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect();
        let received: HostBuffer = decode(encoded.bytes(), fds).unwrap();
        assert!(received.is_imported());
        assert_eq!(received.to_vec(), vec![9; 64]);
        let err = serde_json::to_string(&buf).unwrap_err().to_string();
        assert!(err.contains("vmm_core::wire"), "{err}");
    }
}
