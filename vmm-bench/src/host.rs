//! The host-memory (memfd) twins of the driver and hand-off figures: what the bench measures
//! on a machine without a GPU.
//!
//! - export: `HostBuffer::export` (a fresh fd: reopen through `/proc/self/map_files` where the
//!   kernel allows it, else `dup` of the kept memfd) next to the same reopen or `dup`, bare.
//! - import: `HostBuffer::import` (fstat, seal check, mmap) next to a bare `mmap`.
//! - release: dropping the imported buffer (munmap) next to a bare `munmap`.
//! - hand-off: a `HostDescriptor` / `HostBuffer` through a `Queue` to a live child that maps,
//!   drops and acknowledges, next to a bare socket + `mmap`/`munmap` + 1-byte ack.

use std::fs::OpenOptions;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::time::Instant;

use criterion::Criterion;
use vmm_core::shm::HostBuffer;

use crate::handoff::{RawWork, bench_handoffs, rows};
use crate::raw;
use crate::report::{Target, row};
use crate::{Group, Kind, key};

/// The host driver-twin group.
pub const DRIVER_GROUP: &str = "host-driver";
/// The host hand-off group.
pub const HANDOFF_GROUP: &str = "host-handoff";

/// Sizes of the import (map) figures: 2 MiB, 64 MiB, 1 GiB.
pub const MAP_SIZES: [usize; 3] = [2 << 20, 64 << 20, 1 << 30];

/// `2MiB`, `64MiB`, `1GiB`.
pub fn size_name(size: usize) -> String {
    if size >= 1 << 30 && size.is_multiple_of(1 << 30) {
        format!("{}GiB", size >> 30)
    } else {
        format!("{}MiB", size >> 20)
    }
}

/// A raw memfd mapped shared: the twin of a `HostBuffer`, exported the same way.
#[derive(Debug)]
struct RawHost {
    fd: OwnedFd,
    ptr: std::ptr::NonNull<std::ffi::c_void>,
    size: usize,
    reopen: bool,
}

impl RawHost {
    fn new(size: usize) -> RawHost {
        let fd = raw::sealed_memfd(size);
        let ptr = raw::mmap_shared(fd.as_fd(), size);
        RawHost {
            fd,
            ptr,
            size,
            // Export the way HostBuffer does on this machine.
            reopen: vmm_core::shm::buffers_hold_no_fd(),
        }
    }

    /// A fresh fd for the memory: `open(/proc/self/map_files/..)` or `dup`.
    fn export(&self) -> OwnedFd {
        if self.reopen {
            let start = self.ptr.as_ptr() as usize;
            let path = format!("/proc/self/map_files/{start:x}-{:x}", start + self.size);
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(path)
                .expect("open map_files")
                .into()
        } else {
            self.fd.try_clone().expect("dup")
        }
    }
}

impl Drop for RawHost {
    fn drop(&mut self) {
        raw::munmap(self.ptr, self.size);
    }
}

/// export / import (per size) / release, vmm-core next to the bare syscalls.
pub fn driver(c: &mut Criterion) {
    let g = DRIVER_GROUP;
    for op in ["export", "release"] {
        row(
            &key(g, &format!("{op}/vmm-core")),
            &key(g, &format!("{op}/raw")),
            Target::None,
        );
    }
    for size in MAP_SIZES {
        let s = size_name(size);
        row(
            &key(g, &format!("import/{s}/vmm-core")),
            &key(g, &format!("import/{s}/raw")),
            Target::None,
        );
    }

    let size = MAP_SIZES[0];
    let buffer = HostBuffer::new(size).expect("host buffer");
    let twin = RawHost::new(size);
    let mut group = Group::new(c, g, Kind::InProcess);
    group.bench_pair(
        "export",
        ("export/vmm-core", || {
            let t = Instant::now();
            let descriptor = buffer.export().expect("export");
            let elapsed = t.elapsed();
            drop(descriptor);
            elapsed
        }),
        ("export/raw", || {
            let t = Instant::now();
            let fd = twin.export();
            let elapsed = t.elapsed();
            drop(fd);
            elapsed
        }),
    );
    for size in MAP_SIZES {
        let s = size_name(size);
        let buffer = HostBuffer::new(size).expect("host buffer");
        let descriptor = buffer.export().expect("export");
        let fd = raw::sealed_memfd(size);
        group.bench_pair(
            &format!("import/{s}"),
            (&format!("import/{s}/vmm-core"), || {
                let t = Instant::now();
                let alias = HostBuffer::import(&descriptor).expect("import");
                let elapsed = t.elapsed();
                drop(alias);
                elapsed
            }),
            (&format!("import/{s}/raw"), || {
                let t = Instant::now();
                let ptr = raw::mmap_shared(fd.as_fd(), size);
                let elapsed = t.elapsed();
                raw::munmap(ptr, size);
                elapsed
            }),
        );
    }
    let descriptor = buffer.export().expect("export");
    let fd = twin.export();
    group.bench_pair(
        "release",
        ("release/vmm-core", || {
            let alias = HostBuffer::import(&descriptor).expect("import");
            let t = Instant::now();
            drop(alias);
            t.elapsed()
        }),
        ("release/raw", || {
            let ptr = raw::mmap_shared(fd.as_fd(), size);
            let t = Instant::now();
            raw::munmap(ptr, size);
            t.elapsed()
        }),
    );
    group.finish();
}

/// A 2 MiB host buffer handed to a live child, both methods, next to a bare socket.
pub fn handoff(c: &mut Criterion) {
    rows(HANDOFF_GROUP, Target::None);
    let size = 2 << 20;
    let buffer = HostBuffer::new(size).expect("host buffer");
    let descriptor = Some(buffer.export().expect("export"));
    let buffer = Some(buffer);
    let twin = RawHost::new(size);
    let fd = twin.export();

    let mut group = Group::new(c, HANDOFF_GROUP, Kind::Processes);
    bench_handoffs(
        &mut group,
        (&descriptor, &buffer),
        (RawWork::Host, &fd, size),
        || twin.export(),
    );
    group.finish();
}
