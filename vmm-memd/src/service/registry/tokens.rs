//! Commit tokens: a writer names its pending generation with a token of its choosing, so
//! that after a commit whose reply it lost (the connection cut, a timeout, the service
//! killed) it can ask whether that generation landed instead of publishing it twice or not
//! at all.
//!
//! A region remembers the tokens of its latest [`MAX_LANDED_TOKENS`] tokened commits, and the
//! keeper keeps each held generation's token, so a restart forgets none of those. A pending
//! generation's token answers `Pending`: the writer's connection is open and has not
//! committed; once that connection ends the generation is freed and the token is unknown.

use super::{Region, Registry, pending_of};
use crate::error::{Refusal, RequestRule, Right};
use crate::identity::Identity;
use crate::protocol::{CommitState, MAX_LANDED_TOKENS};

/// `token` landed as `generation` of `r`.
pub(super) fn landed(r: &mut Region, token: [u8; 16], generation: u64) {
    if r.landed.iter().any(|&(t, _)| t == token) {
        return;
    }
    if r.landed.len() == MAX_LANDED_TOKENS {
        r.landed.pop_front();
    }
    r.landed.push_back((token, generation));
}

impl Registry {
    /// Name `conn`'s pending generation of `region` with `token`.
    pub(crate) fn set_token(
        &self,
        conn: u64,
        region: &str,
        token: [u8; 16],
    ) -> Result<(), Refusal> {
        let mut state = self.lock();
        let known = state.regions.get(region).is_some_and(|r| {
            r.landed.iter().any(|&(t, _)| t == token)
                || r.generations.values().any(|g| g.token == Some(token))
                || r.pending
                    .as_ref()
                    .is_some_and(|(_, _, g)| g.token == Some(token))
        });
        let generation = pending_of(&mut state, conn, region)?;
        if known {
            return Err(Refusal::InvalidRequest {
                rule: RequestRule::Token,
                detail: format!("{region:?} knows this token already: choose a new one"),
            });
        }
        generation.token = Some(token);
        Ok(())
    }

    /// What became of `region`'s generation named `token` (the write right needed: a
    /// region `who` may not read is no region).
    pub(crate) fn commit_state(
        &self,
        who: &Identity,
        region: &str,
        token: [u8; 16],
    ) -> Result<CommitState, Refusal> {
        let state = self.lock();
        let none = || Refusal::NoSuchRegion {
            region: region.to_owned(),
        };
        let r = state.regions.get(region).ok_or_else(none)?;
        if !r.may(who, Right::Write) {
            return Err(match r.may(who, Right::Read) {
                true => Refusal::AccessDenied {
                    region: region.to_owned(),
                    right: Right::Write,
                    uid: who.uid,
                },
                false => none(),
            });
        }
        let landed = r
            .landed
            .iter()
            .find(|&&(t, _)| t == token)
            .map(|&(_, generation)| generation)
            .or_else(|| {
                r.generations
                    .iter()
                    .find(|(_, g)| g.token == Some(token))
                    .map(|(&n, _)| n)
            });
        Ok(match landed {
            Some(generation) => CommitState::Landed { generation },
            None if r
                .pending
                .as_ref()
                .is_some_and(|(_, _, g)| g.token == Some(token)) =>
            {
                CommitState::Pending
            }
            None => CommitState::Unknown,
        })
    }
}
