//! What a process does ahead of its first VMM use, so that the first import a warm child makes
//! costs what later ones do.
//!
//! Retaining a primary context is not all of CUDA's start-up: the first allocation, export,
//! import and mapping of a process set up more (the driver's per-process memory-management
//! state), and a warm child that only retained its context paid that inside its function (tens
//! of ms on an H200: `gpu/diag/first_use.py` shows each step). So a warm child also runs one
//! whole cycle on each device while it waits: allocate one chunk, export it as an fd, import
//! that back, map it, write a byte, then let all of it go.

use super::{Device, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource};
use crate::Result;

/// Allocate, export, import, map and write one chunk of `device`'s memory, then release it all.
pub(crate) fn prime_vmm(device: &Device) -> Result<()> {
    let resource = VirtualMemoryResource::new(device, ResourceOptions::default())?;
    let own = resource.allocate(resource.granularity())?;
    let descriptor = own.export()?;
    let alias = VirtualMemoryBuffer::import(&descriptor)?;
    alias.write_at(0, &[1])?;
    Ok(())
}
