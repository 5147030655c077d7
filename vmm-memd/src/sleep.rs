//! Sleep and wake at stable addresses (host backend): [`Client::sleep`] gives a region's
//! memory up (the lease ends, the mappings become `PROT_NONE` reservations of the same
//! addresses) and [`Client::wake`] maps the region's current generation at those addresses
//! again, if its layout (chunk sizes and metadata, [`layout_hash`]) is the one that slept;
//! otherwise [`MemdError::StaleLayout`], and the reservations stay.

use std::collections::BTreeMap;

use crate::client::{Attached, Client};
use crate::error::{MemdError, Result};
use crate::mapping::Reservation;
use crate::protocol::TensorMeta;

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

/// What a wake needs: the layout and the reservations.
#[derive(Debug)]
pub(crate) struct Placement {
    pub(crate) layout: u64,
    pub(crate) reservations: Vec<Reservation>,
}

/// A region asleep in this process: its chunks' addresses held, no memory, no lease.
#[derive(Debug)]
pub struct Sleeping {
    /// The region.
    pub region: String,
    /// The generation that slept.
    pub generation: u64,
    placement: Placement,
}

impl Sleeping {
    /// The layout hash of what slept.
    pub fn layout(&self) -> u64 {
        self.placement.layout
    }

    /// The reserved address ranges, one per chunk (where a wake maps them).
    pub fn reservations(&self) -> &[Reservation] {
        &self.placement.reservations
    }
}

/// A wake that did not happen: why, and the sleeper (its reservations kept) to try again.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct WakeFailed {
    /// Why ([`MemdError::StaleLayout`] for another layout).
    pub error: MemdError,
    /// The region, still asleep.
    pub sleeping: Sleeping,
}

impl Client {
    /// Put `attached` to sleep: its memory is unmapped while its addresses stay reserved
    /// (`PROT_NONE`), and its lease ends (so the service may free a retired generation). A
    /// lease the service no longer has (the service gone, the lease expired) is no failure.
    pub fn sleep(&self, attached: Attached) -> Result<Sleeping> {
        let sizes: Vec<u64> = attached.chunks.iter().map(|c| c.len() as u64).collect();
        let layout = layout_hash(&sizes, &attached.meta);
        let lease = attached.lease;
        let mut reservations = Vec::with_capacity(attached.chunks.len());
        for chunk in attached.chunks {
            reservations.push(chunk.into_reservation()?);
        }
        match self.detach_lease(lease) {
            Ok(()) | Err(MemdError::ServiceGone(_) | MemdError::Refused(_)) => {}
            Err(e) => return Err(e),
        }
        Ok(Sleeping {
            region: attached.region,
            generation: attached.generation,
            placement: Placement {
                layout,
                reservations,
            },
        })
    }

    /// Wake `sleeping`: attach its region's current generation and map it at the slept
    /// addresses, if its layout is the one that slept ([`MemdError::StaleLayout`]
    /// otherwise: nothing is mapped, the lease it took is given back).
    pub fn wake(&self, sleeping: Sleeping) -> std::result::Result<Attached, Box<WakeFailed>> {
        let Sleeping {
            region,
            generation,
            placement,
        } = sleeping;
        let mut place = Some(placement);
        match self.attach_placed(&region, None, &mut place) {
            Ok(attached) => Ok(attached),
            Err(error) => Err(Box::new(WakeFailed {
                error,
                sleeping: Sleeping {
                    region,
                    generation,
                    placement: place.expect("attach_placed keeps the placement"),
                },
            })),
        }
    }
}
