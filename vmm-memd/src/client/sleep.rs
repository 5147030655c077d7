//! Sleep and wake at stable addresses (host backend): [`Client::sleep`] gives a region's
//! memory up (the lease ends, the mappings become `PROT_NONE` reservations of the same
//! addresses) and [`Client::wake`] maps the region's current generation at those addresses
//! again, if its layout (chunk sizes and metadata, [`layout_hash`](crate::layout_hash)) is
//! the one that slept; otherwise [`MemdError::StaleLayout`], and the reservations stay.

use vmm_core::cuda::AddressRange;

use super::attach::Attached;
use super::connection::Client;
use super::layout::{Placement, layout_hash_on};
use super::mapping::Reservation;
use crate::error::{MemdError, Refusal, RequestRule, Result};
use crate::protocol::{Backend, Request};

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

    /// The reserved address ranges, one per chunk (where a wake maps them; none for a GPU
    /// region).
    pub fn reservations(&self) -> &[Reservation] {
        &self.placement.reservations
    }

    /// A GPU region's device address before the sleep, where a wake maps it again (`None`
    /// for a host region). The range stays reserved in this process while it sleeps, so no
    /// other allocation can take it.
    pub fn gpu_address(&self) -> Option<u64> {
        self.placement
            .gpu_range
            .as_ref()
            .map(AddressRange::device_ptr)
    }
}

/// A discard sleep that did not happen: why, and the attachment when it is untouched (the
/// service refused to end its lease so).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct SleepFailed {
    /// Why (`Refused(AccessDenied)` without the region's write right).
    pub error: MemdError,
    /// The attachment, still mapped and leased (`None` if unmapping it failed after the
    /// lease ended).
    pub attached: Option<Attached>,
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
    ///
    /// A GPU region's mapping is unmapped and its chunks released here, while its address
    /// range stays reserved in this process (`VirtualMemoryBuffer::into_address_range`); the
    /// wake maps the region's generation into that range, so device pointers into it stay
    /// good. A mapping shared with a clone of its buffer cannot be taken apart:
    /// [`MemdError::MappingShared`].
    pub fn sleep(&self, attached: Attached) -> Result<Sleeping> {
        let lease = attached.lease;
        let sleeping = self.unmap(attached)?;
        match self.detach_lease(lease) {
            Ok(()) | Err(MemdError::ServiceGone(_) | MemdError::Refused(_)) => Ok(sleeping),
            Err(e) => Err(e),
        }
    }

    /// [`sleep`](Self::sleep), and let the service free the memory (a *discard* sleep, for
    /// memory whose contents need not survive, such as a KV cache): once every lease on the
    /// generation has ended (every mapper asleep or gone) the service closes its chunks, and
    /// the memory goes as soon as no process maps it. The generation stays; the next wake
    /// (anyone's attach) makes its chunks again, zeroed, and maps them at the slept
    /// addresses. The quota stays charged meanwhile, so the wake cannot be refused for it.
    ///
    /// The lease is ended first: a refusal (`AccessDenied` without the region's write right)
    /// comes back in [`SleepFailed`] with the attachment untouched. A lease already gone
    /// (expired, the service gone) is no failure: this is then a plain sleep.
    pub fn sleep_discard(
        &self,
        attached: Attached,
    ) -> std::result::Result<Sleeping, Box<SleepFailed>> {
        match self.request(&Request::Discard {
            lease: attached.lease,
        }) {
            Ok(_)
            | Err(MemdError::ServiceGone(_))
            | Err(MemdError::Refused(Refusal::InvalidRequest {
                rule: RequestRule::NoSuchLease,
                ..
            })) => {}
            Err(error) => {
                return Err(Box::new(SleepFailed {
                    error,
                    attached: Some(attached),
                }));
            }
        }
        self.unmap(attached).map_err(|error| {
            Box::new(SleepFailed {
                error,
                attached: None,
            })
        })
    }

    /// Give `attached`'s memory up, keeping its addresses (host) or its address range (GPU).
    fn unmap(&self, attached: Attached) -> Result<Sleeping> {
        let (sizes, backend) = match &attached.gpu {
            Some(g) => (
                g.chunk_sizes().to_vec(),
                Backend::Gpu {
                    uuid: g.device_uuid(),
                },
            ),
            None => (
                attached.chunks.iter().map(|c| c.len() as u64).collect(),
                Backend::Host,
            ),
        };
        let layout = layout_hash_on(&sizes, &attached.meta, backend);
        let gpu_range = match attached.gpu {
            Some(g) => Some(
                g.into_address_range()
                    .map_err(|_| MemdError::MappingShared {
                        region: attached.region.clone(),
                    })?,
            ),
            None => None,
        };
        let mut reservations = Vec::with_capacity(attached.chunks.len());
        for chunk in attached.chunks {
            reservations.push(chunk.into_reservation()?);
        }
        Ok(Sleeping {
            region: attached.region,
            generation: attached.generation,
            placement: Placement {
                layout,
                reservations,
                gpu_range,
            },
        })
    }

    /// Wake `sleeping`: attach its region's current generation and map it at the slept
    /// addresses, if its layout is the one that slept ([`MemdError::StaleLayout`]
    /// otherwise: nothing is mapped, the lease it took is given back).
    pub fn wake(&self, sleeping: Sleeping) -> std::result::Result<Attached, Box<WakeFailed>> {
        let _turn = self.turn();
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
