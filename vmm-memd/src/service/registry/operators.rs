//! The requests of the service's operators on the registry as a whole (its admins: see
//! `identity::Admins`): release every region, replace a region's ACL (its owner may too), set
//! a uid's quota at run time. Each is kept by the keeper (deletions as `Forget`s, an ACL in
//! the records of the region's generations, quotas in the service's settings record) and
//! shows as an event with the caller's uid, pid and whether it is an admin.

use super::kept::{keep, keep_settings};
use super::{Registry, prune, remove_region};
use crate::error::{Refusal, Right};
use crate::identity::Identity;
use crate::protocol::Acl;
use crate::trace::event;

impl Registry {
    /// Delete every region without a writer at work or waiting (an admin's `ReleaseAll`):
    /// (regions deleted, regions left busy).
    pub(crate) fn release_all(&self, who: &Identity) -> Result<(u32, u32), Refusal> {
        if !who.admin {
            return Err(Refusal::NotAdmin { uid: who.uid });
        }
        let mut state = self.lock();
        let free: Vec<String> = state
            .regions
            .iter()
            .filter(|(_, r)| r.pending.is_none() && r.waiting.is_empty())
            .map(|(name, _)| name.clone())
            .collect();
        let busy = (state.regions.len() - free.len()) as u32;
        for name in &free {
            remove_region(&mut state, name);
        }
        let regions = free.len() as u32;
        event!(
            INFO,
            "memd.release_all",
            uid = who.uid,
            pid = who.pid,
            admin = who.admin,
            regions,
            busy
        );
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        Ok((regions, busy))
    }

    /// Replace `region`'s ACL with `acl` (its owner or an admin): a region `who` may not see
    /// is `NoSuchRegion`, one it sees but does not own `NotAdmin`. The keeper is sent every
    /// generation's record again, with the new ACL.
    pub(crate) fn set_acl(&self, who: &Identity, region: &str, acl: Acl) -> Result<(), Refusal> {
        acl.check()?;
        let mut state = self.lock();
        let r = state
            .regions
            .get_mut(region)
            .filter(|r| r.operable(who, Right::Read))
            .ok_or_else(|| Refusal::NoSuchRegion {
                region: region.to_owned(),
            })?;
        if !who.admin && who.uid != r.owner {
            return Err(Refusal::NotAdmin { uid: who.uid });
        }
        r.acl = acl;
        let numbers: Vec<u64> = r.generations.keys().copied().collect();
        event!(
            INFO,
            "memd.acl",
            region,
            uid = who.uid,
            pid = who.pid,
            admin = who.admin,
            read = r.acl.read.len(),
            write = r.acl.write.len(),
            delete = r.acl.delete.len()
        );
        for number in numbers {
            keep(&mut state, region, number);
        }
        self.changed.notify_all();
        Ok(())
    }

    /// Set `uid`'s quota to `bytes`, or give it back the policy's (`None`): admins only. The
    /// keeper is sent the service's settings again.
    pub(crate) fn set_quota(
        &self,
        who: &Identity,
        uid: u32,
        bytes: Option<u64>,
    ) -> Result<(), Refusal> {
        if !who.admin {
            return Err(Refusal::NotAdmin { uid: who.uid });
        }
        let mut state = self.lock();
        match bytes {
            Some(bytes) => state.quotas.insert(uid, bytes),
            None => state.quotas.remove(&uid),
        };
        event!(
            INFO,
            "memd.quota",
            target_uid = uid,
            bytes = bytes.unwrap_or(0),
            default = bytes.is_none(),
            uid = who.uid,
            pid = who.pid,
            admin = who.admin
        );
        keep_settings(&mut state);
        // A writer waiting for room may fit now.
        self.changed.notify_all();
        Ok(())
    }
}
