//! What a process does ahead of its first VMM use, so that the first import a warm child makes
//! costs what later ones do.
//!
//! Retaining a primary context is not all of CUDA's start-up: a process's first allocation,
//! export, import, mapping and copy each cost more than the second (on an H200,
//! `gpu/diag/first_use.py` measured about 250 us more for the whole first cycle: the copies
//! twice as slow, the export 110 us slower). A warm child pays that while it waits instead, by
//! running one whole cycle on each device: allocate one chunk, export it as an fd, import that
//! back, map it, write a byte, then let all of it go.

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
