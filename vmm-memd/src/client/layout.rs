//! A generation's layout as a sleep and a wake compare it: [`layout_hash`] of its chunk sizes
//! and metadata (and [`layout_hash_on`] of its device), and the [`Placement`] a sleeping
//! mapping keeps for its wake. Below both the attach and the sleep, which use it.

use std::collections::BTreeMap;

use vmm_core::cuda::AddressRange;

use super::mapping::Reservation;
use crate::protocol::{Backend, TensorMeta};

/// The layout hash of a generation: FNV-1a (64-bit) of the postcard encoding of its chunk
/// sizes and its metadata entries in key order. Equal hashes: the same tensors at the same
/// offsets of chunks of the same sizes, so pointers into the old mapping mean the same.
pub fn layout_hash(chunks: &[u64], meta: &BTreeMap<String, TensorMeta>) -> u64 {
    let entries: Vec<(&String, &TensorMeta)> = meta.iter().collect();
    let bytes = postcard::to_allocvec(&(chunks, entries)).unwrap_or_default();
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// [`layout_hash`] of a generation on `backend`: the same for host memory; for a GPU, the
/// device's UUID is hashed on after it (a wake onto another device, or another backend, is
/// a `StaleLayout`).
pub fn layout_hash_on(
    chunks: &[u64],
    meta: &BTreeMap<String, TensorMeta>,
    backend: Backend,
) -> u64 {
    let host = layout_hash(chunks, meta);
    match backend {
        Backend::Host => host,
        Backend::Gpu { uuid } => uuid.iter().fold(host, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        }),
    }
}

/// What a wake needs: the layout and the reservations (host), or the address range the
/// GPU mapping had, still reserved in this process (GPU).
#[derive(Debug)]
pub(crate) struct Placement {
    pub(crate) layout: u64,
    pub(crate) reservations: Vec<Reservation>,
    pub(crate) gpu_range: Option<AddressRange>,
}
