//! Host shared memory (memfd) with the export/import model of the CUDA path.
//!
//! The GPU-less twin of [`cuda`](crate::cuda): a [`HostBuffer`] is a sealed memfd mapped shared;
//! [`HostBuffer::export`] gives a [`HostDescriptor`] that alone owns a fresh fd for it, and
//! [`HostBuffer::import`] maps the same pages in any process that receives the descriptor. Both
//! travel through [`wire`](crate::wire) (Process arguments, Queue items), which is how CI exercises
//! the cross-process machinery without a GPU.

mod buffer;
mod host_descriptor;
mod map;

use std::sync::atomic::{AtomicUsize, Ordering};

pub use buffer::HostBuffer;
pub use host_descriptor::HostDescriptor;

/// The largest host buffer this process imports unless told otherwise: 64 GiB (on 64-bit
/// platforms; 1 GiB on 32-bit ones).
///
/// A buffer's size is the sender's choice, and mapping it costs the importer address space
/// even when the memfd is sparse: without a cap, two sealed 60 TiB memfds exhaust a 47-bit
/// address space. The cap is the importer's: raise it per import with
/// [`HostBuffer::import_capped`], or for the whole process with [`set_max_import_size`]
/// (which also covers buffers that arrive as [`wire`](crate::wire) values).
pub const DEFAULT_MAX_IMPORT_SIZE: usize = if usize::BITS >= 64 {
    (64u64 << 30) as usize
} else {
    1 << 30
};

static MAX_IMPORT_SIZE: AtomicUsize = AtomicUsize::new(DEFAULT_MAX_IMPORT_SIZE);

/// The cap on the size of a host buffer that [`HostBuffer::import`] maps (and that a
/// [`HostBuffer`] arriving through [`wire`](crate::wire) may have): [`DEFAULT_MAX_IMPORT_SIZE`]
/// unless [`set_max_import_size`] changed it. A larger one is refused with
/// [`Error::LimitExceeded`](crate::Error::LimitExceeded) before anything is mapped.
pub fn max_import_size() -> usize {
    MAX_IMPORT_SIZE.load(Ordering::Relaxed)
}

/// Set the cap of [`max_import_size`] for this process (from code only: no environment
/// variable changes it). Returns the previous cap. For one import, prefer
/// [`HostBuffer::import_capped`].
pub fn set_max_import_size(bytes: usize) -> usize {
    MAX_IMPORT_SIZE.swap(bytes, Ordering::Relaxed)
}

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
    use crate::error::DescriptorRule;
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
    fn word_copies_at_every_alignment_match_a_plain_model() {
        // Sizes and ranges that start and end inside words, cover whole ones, or both.
        for size in [1usize, 7, 8, 9, 23, 64, 100] {
            let buf = HostBuffer::new(size).unwrap();
            let mut model = vec![0u8; size];
            for offset in 0..size {
                for len in 0..=(size - offset).min(20) {
                    let data: Vec<u8> = (0..len)
                        .map(|i| (offset * 31 + i * 7 + len) as u8)
                        .collect();
                    buf.write_at(offset, &data).unwrap();
                    model[offset..offset + len].copy_from_slice(&data);
                    let mut out = vec![0xEEu8; len];
                    buf.read_at(offset, &mut out).unwrap();
                    assert_eq!(out, data, "size {size}, {len} bytes at {offset}");
                }
            }
            assert_eq!(buf.to_vec(), model, "size {size}");
            buf.fill(0x5A).unwrap();
            assert_eq!(buf.try_to_vec().unwrap(), vec![0x5A; size]);
        }
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
        let err = alias.export().unwrap_err();
        assert!(
            matches!(
                &err,
                Error::NotExportable {
                    rule: crate::error::ExportRule::Imported,
                    ..
                }
            ),
            "{err:?}"
        );
        // What to do instead, as people read it.
        assert!(err.to_string().contains("forward the descriptor"), "{err}");
    }

    #[test]
    fn unsealed_short_or_non_memfd_files_are_refused() {
        let fd =
            nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
        nix::unistd::ftruncate(&fd, 4096).unwrap();
        let unsealed = HostDescriptor::from_fd(std::os::fd::AsFd::as_fd(&fd), 4096).unwrap();
        let err = HostBuffer::import(&unsealed).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidDescriptor { rule: DescriptorRule::Memfd, message: m } if m.contains("not sealed")),
            "{err:?}"
        );
        let buf = HostBuffer::new(100).unwrap();
        let mut short = buf.export().unwrap();
        short.size = 200;
        let err = HostBuffer::import(&short).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidDescriptor { rule: DescriptorRule::Size, message: m } if m.contains("says 200 bytes but its file holds 100")),
            "{err:?}"
        );
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let not_memfd = HostDescriptor::from_fd(std::os::fd::AsFd::as_fd(&file), 16).unwrap();
        let err = HostBuffer::import(&not_memfd).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidDescriptor { rule: DescriptorRule::Memfd, message: m } if m.contains("not a memfd")),
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
