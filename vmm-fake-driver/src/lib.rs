//! A fake CUDA driver (`libcuda.so`) for tests of the GPU path on machines without a GPU.
//!
//! The library is `src/libcuda.rs`, compiled by `build.rs` into a cdylib and embedded here
//! ([`LIBCUDA`]). cudarc (with `dynamic-loading`) `dlopen`s `libcuda.so` by name, so a process
//! started with the directory [`install`] wrote it to first in `LD_LIBRARY_PATH`
//! ([`library_path`]) runs vmm-core's whole driver layer on it: one device with the UUID
//! [`DEVICE_UUID`] and the name [`DEVICE_NAME`], allocations that are memfds (an exported POSIX
//! fd is a duplicate of one), device addresses that are host addresses. The dynamic loader
//! reads `LD_LIBRARY_PATH` once, when a process starts: set it for a child, not for the
//! running process.
//!
//! Python's fake of cuda.bindings (`python/tests/fake_cuda`) models allocations the same way and
//! has the same device UUID, so a Python process on that fake and a Rust process on this one
//! exchange GPU regions through the real service. See `src/libcuda.rs` for what the fake
//! refuses and why.

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The fake `libcuda.so`, as built for this target.
pub const LIBCUDA: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libcuda.so"));

/// The fake device's UUID (the Python fake's too: bytes 0 to 15).
pub const DEVICE_UUID: [u8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// The fake device's name (`cuDeviceGetName`): how a test checks that the fake, not a real
/// driver, was loaded.
pub const DEVICE_NAME: &str = "vmm-fake-driver";

/// The fake device's allocation granularity (minimum and recommended): 2 MiB, the H200's.
pub const GRANULARITY: usize = 2 << 20;

/// The name of the memfd behind every allocation of either fake (`/proc/PID/fd` shows
/// `/memfd:fake-cuda (deleted)`); an fd to import must be one of these.
pub const MEMFD_NAME: &str = "fake-cuda";

/// Write the fake as `libcuda.so` (mode 0755) into `dir`, made owner-only (0700) if it does not
/// exist; returns `dir`, the directory to put first in `LD_LIBRARY_PATH`. An existing
/// `libcuda.so` there is replaced (by a rename: a process that has it loaded keeps its copy).
pub fn install(dir: &Path) -> io::Result<PathBuf> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        made => made?,
    }
    let partial = dir.join(format!(".libcuda.so.{}", std::process::id()));
    let _ = std::fs::remove_file(&partial);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&partial)?;
    io::Write::write_all(&mut file, LIBCUDA)?;
    // The mode asked for at open is masked by the umask: set it exactly.
    file.set_permissions(std::fs::Permissions::from_mode(0o755))?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&partial, dir.join("libcuda.so"))?;
    Ok(dir.to_path_buf())
}

/// `LD_LIBRARY_PATH` for a child that must load the fake from `dir`: `dir`, then whatever this
/// process's `LD_LIBRARY_PATH` holds (a real driver's directory there comes after the fake).
pub fn library_path(dir: &Path) -> OsString {
    let mut path = OsString::from(dir);
    if let Some(rest) = std::env::var_os("LD_LIBRARY_PATH").filter(|r| !r.is_empty()) {
        path.push(":");
        path.push(rest);
    }
    path
}

#[cfg(test)]
#[path = "libcuda.rs"]
mod libcuda;

#[cfg(test)]
mod tests;
