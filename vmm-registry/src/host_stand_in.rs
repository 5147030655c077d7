//! The host-memory stand-in for a fabric handle: "nodes" played on one machine share host
//! memory (memfds) through the same hand-off as GPU memory, so CI runs the whole path without
//! a GPU.
//!
//! Each chunk's 64-byte handle holds the text `/proc/<pid>/fd/<n>`, NUL-padded: a memfd the
//! exporter holds open. An importer on the same machine, of the same uid or root (the kernel's
//! ptrace rule for `/proc/<pid>/fd`), opens it and maps it. As with a fabric handle, whoever
//! holds the bytes holds the memory, so the bytes cross only the mutual-TLS stream; unlike a
//! fabric handle, the name is good only while the exporter keeps the fd open.
//!
//! A descriptor is hostile until checked: [`chunk_paths`] accepts only the exact form above
//! (so an exporter cannot make an importer open any other file), and the importer maps what
//! it opens only if it is a memfd of the announced size ([`import`]), or, for a vmm-memd
//! chunk, a memfd sealed against writes ([`import_read_only`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::PathBuf;

use vmm_core::cuda::{FabricDescriptor, FabricHandle};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_memd::ReadOnlyChunk;

/// The device UUID a stand-in descriptor names (there is no device: host memory).
pub const STAND_IN_UUID: [u8; 16] = [7; 16];

/// Why a stand-in descriptor could not be made or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StandInError {
    /// The descriptor's layout was refused (no chunk, more chunks than a descriptor holds, a
    /// chunk of no bytes).
    #[error("the stand-in descriptor's layout is refused")]
    Layout(#[source] Box<vmm_core::Error>),
    /// Handle `chunk` is not `/proc/<pid>/fd/<n>`: refused before anything is opened.
    #[error("handle {chunk} does not name /proc/<pid>/fd/<n>")]
    NotAnFdPath {
        /// The chunk's index.
        chunk: usize,
    },
    /// The named fd could not be opened (the exporter is gone or closed it, or this process
    /// may not look into the exporter's fds).
    #[error("opening {path:?}")]
    Open {
        /// The path.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// The opened file could not be mapped as host memory (not a memfd, too short, unsealed).
    #[error("mapping {path:?}")]
    Map {
        /// The path.
        path: PathBuf,
        /// What vmm-core said.
        #[source]
        source: Box<vmm_core::Error>,
    },
    /// The opened file is not a committed vmm-memd chunk (a memfd sealed against writes and
    /// resizing, at least the chunk's size).
    #[error("mapping {path:?} read-only")]
    MapReadOnly {
        /// The path.
        path: PathBuf,
        /// What vmm-memd's reader said.
        #[source]
        source: Box<vmm_memd::MemdError>,
    },
    /// [`import`] takes a descriptor of one chunk.
    #[error("{0} chunks: this import maps one")]
    ChunkCount(usize),
}

/// A stand-in descriptor of `chunks` (each an fd this process holds open, and its size in
/// bytes), back to back: one handle naming `/proc/<this pid>/fd/<n>` per chunk.
pub fn describe(chunks: &[(BorrowedFd<'_>, usize)]) -> Result<FabricDescriptor, StandInError> {
    let pid = std::process::id();
    let handles: Vec<FabricHandle> = chunks
        .iter()
        .map(|(fd, _)| {
            let path = format!("/proc/{pid}/fd/{}", fd.as_raw_fd());
            let mut bytes = [0u8; 64];
            // At most 6 + 10 + 4 + 10 bytes: a u32 pid and a non-negative i32 fd.
            bytes[..path.len()].copy_from_slice(path.as_bytes());
            FabricHandle::from_bytes(bytes)
        })
        .collect();
    let sizes: Vec<usize> = chunks.iter().map(|&(_, size)| size).collect();
    let total = sizes.iter().sum();
    FabricDescriptor::from_handles(&handles, &sizes, total, STAND_IN_UUID)
        .map_err(|e| StandInError::Layout(Box::new(e)))
}

/// The path each handle of a stand-in descriptor names, checked to be exactly
/// `/proc/<digits>/fd/<digits>` followed by NUL bytes only.
pub fn chunk_paths(descriptor: &FabricDescriptor) -> Result<Vec<PathBuf>, StandInError> {
    descriptor
        .handles()
        .iter()
        .enumerate()
        .map(|(chunk, handle)| {
            parse_path(handle.as_bytes()).ok_or(StandInError::NotAnFdPath { chunk })
        })
        .collect()
}

fn parse_path(bytes: &[u8]) -> Option<PathBuf> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    if bytes[end..].iter().any(|&b| b != 0) {
        return None;
    }
    let text = std::str::from_utf8(&bytes[..end]).ok()?;
    let (pid, fd) = text.strip_prefix("/proc/")?.split_once("/fd/")?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    (digits(pid) && digits(fd)).then(|| PathBuf::from(text))
}

fn open(path: PathBuf, write: bool) -> Result<(PathBuf, std::fs::File), StandInError> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(&path)
    {
        Ok(file) => Ok((path, file)),
        Err(source) => Err(StandInError::Open { path, source }),
    }
}

/// Map the one chunk a stand-in descriptor names, read-write: what an importer of a plain
/// exported host buffer does.
pub fn import(descriptor: &FabricDescriptor) -> Result<HostBuffer, StandInError> {
    let mut paths = chunk_paths(descriptor)?;
    if paths.len() != 1 {
        return Err(StandInError::ChunkCount(paths.len()));
    }
    let (path, file) = open(paths.remove(0), true)?;
    HostDescriptor::from_fd(file.as_fd(), descriptor.size())
        .and_then(|host| HostBuffer::import(&host))
        .map_err(|e| StandInError::Map {
            path,
            source: Box::new(e),
        })
}

/// Map every chunk a stand-in descriptor names read-only, each checked to be a committed
/// vmm-memd chunk (a memfd sealed against writes: its bytes cannot change while mapped), in
/// chunk order: what an importer of a published vmm-memd region does.
pub fn import_read_only(descriptor: &FabricDescriptor) -> Result<Vec<ReadOnlyChunk>, StandInError> {
    chunk_paths(descriptor)?
        .into_iter()
        .zip(descriptor.chunk_sizes())
        .map(|(path, &size)| {
            let (path, file) = open(path, false)?;
            ReadOnlyChunk::map(file.as_fd(), size).map_err(|e| StandInError::MapReadOnly {
                path,
                source: Box::new(e),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_fd_paths_are_accepted() {
        let padded = |s: &str| {
            let mut b = [0u8; 64];
            b[..s.len()].copy_from_slice(s.as_bytes());
            b
        };
        assert_eq!(
            parse_path(&padded("/proc/12/fd/3")),
            Some(PathBuf::from("/proc/12/fd/3"))
        );
        for hostile in [
            "/etc/shadow",
            "/proc/12/fd/../../1/environ",
            "/proc/self/fd/3",
            "/proc/12/fd/",
            "/proc//fd/3",
            "/proc/12/fd/3x",
        ] {
            assert_eq!(parse_path(&padded(hostile)), None, "{hostile}");
        }
        // Bytes after the NUL are refused too (nothing hides behind the name).
        let mut trailing = padded("/proc/12/fd/3");
        trailing[40] = b'x';
        assert_eq!(parse_path(&trailing), None);
    }

    #[test]
    fn a_hostile_descriptor_opens_nothing_and_a_writable_memfd_is_not_read_only() {
        // A descriptor naming another file is refused before anything is opened.
        let mut bytes = [0u8; 64];
        bytes[..11].copy_from_slice(b"/etc/passwd");
        let hostile = FabricDescriptor::from_handles(
            &[FabricHandle::from_bytes(bytes)],
            &[64],
            64,
            STAND_IN_UUID,
        )
        .expect("a descriptor");
        assert!(matches!(
            import_read_only(&hostile),
            Err(StandInError::NotAnFdPath { chunk: 0 })
        ));
        assert!(matches!(
            import(&hostile),
            Err(StandInError::NotAnFdPath { chunk: 0 })
        ));
        // A memfd anyone may still write is no committed chunk: not mapped read-only.
        let buf = HostBuffer::new(4096).expect("a host buffer");
        let exported = buf.export().expect("export");
        let fd = exported.fd().expect("its fd");
        let descriptor = describe(&[(fd, 4096)]).expect("describe");
        assert!(matches!(
            import_read_only(&descriptor),
            Err(StandInError::MapReadOnly { .. })
        ));
        // It is a plain exported buffer, which the read-write import maps.
        buf.write_at(0, b"seen").expect("write");
        let mut seen = [0u8; 4];
        import(&descriptor)
            .expect("the read-write import")
            .read_at(0, &mut seen)
            .expect("read");
        assert_eq!(&seen, b"seen");
    }
}
