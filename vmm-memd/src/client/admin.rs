//! The operator's requests, for [`Client`]: on a whole region, [`Client::sleep_region`] and
//! [`Client::wake_region`] (what `vmm-memctl sleep` and `wake` send) and [`Client::set_acl`]
//! (`acl`); on the whole service, [`Client::set_quota`] (`quota`) and [`Client::release_all`]
//! (`release --all`). Kept apart from the writer's and the reader's files.

use super::connection::{Client, expect_reply};
use crate::error::Result;
use crate::protocol::{Acl, Request, Response};

/// What [`Client::sleep_region`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionSlept {
    /// The generation put to sleep (the region's current one).
    pub generation: u64,
    /// Leases that still hold it: its memory goes when they end (0: it is gone now).
    pub leases: u32,
}

/// What [`Client::wake_region`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionWoke {
    /// The generation woken (the region's current one).
    pub generation: u64,
    /// Whether its chunks were made again, zeroed (`false`: a sleep still waiting for leases
    /// was called off and the contents stayed).
    pub zeroed: bool,
}

/// What [`Client::release_all`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Regions deleted.
    pub regions: u32,
    /// Regions left because a writer was at work on them or waiting for them.
    pub busy: u32,
}

impl Client {
    /// Replace `region`'s ACL with `acl` (its owner or an admin of the service; kept across
    /// restarts): a region the caller may not see is
    /// [`Refusal::NoSuchRegion`](crate::Refusal::NoSuchRegion), one it sees but does not own
    /// [`Refusal::NotAdmin`](crate::Refusal::NotAdmin).
    pub fn set_acl(&self, region: &str, acl: &Acl) -> Result<()> {
        let reply = self.request(&Request::SetAcl {
            region: region.to_owned(),
            acl: acl.clone(),
        })?;
        expect_reply!(reply, Response::Done => ())
    }

    /// Set `uid`'s quota to `bytes`, or give it back the service's own for it (`None`): an
    /// admin's request ([`Refusal::NotAdmin`](crate::Refusal::NotAdmin) for anyone else),
    /// kept across restarts.
    pub fn set_quota(&self, uid: u32, bytes: Option<u64>) -> Result<()> {
        let reply = self.request(&Request::SetQuota { uid, bytes })?;
        expect_reply!(reply, Response::Done => ())
    }

    /// Delete every region of the service (an operator's request: the caller's uid or one of
    /// its groups must be an admin of the service, else
    /// [`Refusal::NotAdmin`](crate::Refusal::NotAdmin)): their names go now, their memory as
    /// their last leases end, and the keeper holds none of it any more. A region with a
    /// writer at work or waiting is left and counted in [`Released::busy`].
    pub fn release_all(&self) -> Result<Released> {
        let reply = self.request(&Request::ReleaseAll)?;
        expect_reply!(reply, Response::Released { regions, busy } => Released { regions, busy })
    }

    /// Put `region`'s current generation to a discard sleep without holding a lease (needs
    /// the region's write right; its owner has it): the service frees its memory once no
    /// lease holds it; its number, metadata, chunk sizes and quota charge stay, and the next
    /// attach (or [`wake_region`](Self::wake_region)) makes it again, zeroed. Readers that
    /// still map it keep what they map. A generation already asleep stays so.
    pub fn sleep_region(&self, region: &str) -> Result<RegionSlept> {
        let reply = self.request(&Request::Sleep {
            region: region.to_owned(),
        })?;
        expect_reply!(reply, Response::Slept { generation, leases } => {
            RegionSlept { generation, leases }
        })
    }

    /// Wake `region`'s current generation now (needs the write right): a generation asleep
    /// gets its chunks again, zeroed, so that the next attach does not wait for them; a
    /// sleep still waiting for leases is called off. Refused with
    /// [`RequestRule::NotAsleep`](crate::RequestRule::NotAsleep) for one that is awake.
    pub fn wake_region(&self, region: &str) -> Result<RegionWoke> {
        let reply = self.request(&Request::Wake {
            region: region.to_owned(),
        })?;
        expect_reply!(reply, Response::Woke { generation, zeroed } => {
            RegionWoke { generation, zeroed }
        })
    }
}
