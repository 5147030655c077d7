//! The process's one lease, and what rides on it: granted at open, kept alive every TTL/3 on
//! the background thread, revoked at a clean shutdown.
//!
//! An etcd that does not answer (down, restarting, SIGSTOPped, a dead link) is not a lost
//! lease. etcd keeps its leases across a restart and gives each a fresh TTL when its leader
//! is elected, so a client that gave up during an outage would unpublish a live exporter
//! about a TTL after etcd came back. The keep-alive therefore keeps trying, with backoff,
//! for as long as it takes, and counts the lease lost only when etcd itself answers that it
//! is gone: a keep-alive answered with TTL 0 (etcd's answer for a lease it does not have), or
//! a keep-alive etcd refused after which its `LeaseTimeToLive` says the lease is not there.
//! A transport error, a timeout or `Unavailable` never ends the lease.
//!
//! When etcd does say so, the locators that were on the lease went with it (etcd deleted
//! them): the loss is reported ([`LeaseEvent::Lost`]), a new lease is granted
//! ([`LeaseEvent::Granted`]), and every locator this process had published is put again
//! under it, each reported ([`LeaseEvent::Republished`], or [`LeaseEvent::NotRepublished`]
//! when its name was taken meanwhile). For that the registry remembers what it published:
//! the last value of each name, written under the same lock as every publish, update and
//! unpublish, so the republish never resurrects a name that was unpublished, nor an old value.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::core::{Core, Expect};
use crate::error::{LeaseLoss, Op, RegistryError};
use crate::etcd::KeepAlive;
use crate::lease_state::LeaseEvent;

/// The first retry of a failed keep-alive (or grant) comes this soon; each further one
/// twice as late, up to [`RETRY_MAX`] (or TTL/3, if sooner).
const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two tries while etcd does not answer: short enough that a lease
/// etcd restored at its return is renewed well within its TTL.
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Waits between tries: [`RETRY_FIRST`], doubling up to a cap.
struct Backoff {
    next: Duration,
    cap: Duration,
}

impl Backoff {
    fn new(period: Duration) -> Backoff {
        let cap = period.min(RETRY_MAX);
        Backoff {
            next: RETRY_FIRST.min(cap),
            cap,
        }
    }

    fn next(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.cap);
        wait
    }
}

/// Keep the process's lease alive until the registry closes; when etcd says it is gone,
/// grant a new one and publish again what was on it.
pub(crate) async fn keep_alive(core: Arc<Core>) {
    let state = &core.lease;
    let period = core.ttl / 3;
    // Each call gets no longer than a period: a renewal that hangs must not delay the next.
    let deadline = period.min(core.call_timeout);
    loop {
        let id = state.id();
        if !hold(&core, id, period, deadline).await || state.closing() {
            return;
        }
        state.lose(id, LeaseLoss::NotFound).await;
        let Some(new) = grant(&core, period, deadline).await else {
            return;
        };
        state.granted(new).await;
    }
}

/// Renew lease `id` every `period` (after a failure sooner, with backoff, for as long as
/// etcd does not answer), publishing again after each renewal what waits to be. `true` once
/// etcd answered that the lease is gone; `false` when the registry closes.
async fn hold(core: &Core, id: i64, period: Duration, deadline: Duration) -> bool {
    let state = &core.lease;
    let mut keeper = core.client.keep_alive(id);
    let mut backoff = Backoff::new(period);
    // Right after a grant, the lost locators go back at once.
    republish(core, id, Instant::now() + period, deadline).await;
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        if state.closing() {
            return false;
        }
        match once(&mut keeper, deadline).await {
            Ok(Some(left)) if left > 0 => {
                let renewed = Instant::now();
                backoff = Backoff::new(period);
                republish(core, id, renewed + period, deadline).await;
                wait = period.saturating_sub(renewed.elapsed());
            }
            // etcd's answer for a lease it does not have (expired on its clock, or revoked).
            Ok(Some(_)) => return true,
            // etcd refused the keep-alive, and its TTL query says the lease is not there.
            Err(RegistryError::Etcd { .. }) if gone(core, id, deadline).await => return true,
            // etcd unreachable, slow, restarting, or refusing for another reason: not an
            // answer about the lease. Try again (`renew` opens a new stream), with backoff.
            Ok(None) | Err(_) => wait = backoff.next(),
        }
    }
}

/// Grant a lease of the registry's TTL, trying with backoff until etcd grants one; `None`
/// when the registry closes first (a lease granted then is revoked at once).
async fn grant(core: &Core, period: Duration, deadline: Duration) -> Option<i64> {
    let ttl = i64::try_from(core.ttl.as_secs()).unwrap_or(i64::MAX);
    let mut backoff = Backoff::new(period);
    loop {
        if core.lease.closing() {
            return None;
        }
        match crate::classify::bounded(Op::KeepAlive, deadline, core.client.grant(ttl)).await {
            Ok(id) if core.lease.closing() => {
                // Best effort: unrevoked, it expires within its TTL.
                let _ =
                    crate::classify::bounded(Op::Revoke, deadline, core.client.revoke(id)).await;
                return None;
            }
            Ok(id) => return Some(id),
            Err(_) => tokio::time::sleep(backoff.next()).await,
        }
    }
}

/// Publish again, under lease `id`, every record not on it, until `until`; what fails for
/// etcd's or the network's reasons waits for the next renewal.
async fn republish(core: &Core, id: i64, until: Instant, deadline: Duration) {
    let state = &core.lease;
    let Ok(mut records) = tokio::time::timeout(deadline, state.records.lock()).await else {
        return;
    };
    let pending: Vec<String> = records
        .iter()
        .filter(|(_, record)| record.lease != Some(id))
        .map(|(name, _)| name.clone())
        .collect();
    for name in pending {
        if state.closing() || state.id() != id || Instant::now() >= until {
            return;
        }
        let Some(record) = records.get_mut(&name) else {
            continue;
        };
        match core
            .put_record(
                Op::Publish,
                &name,
                &record.locator,
                id,
                Expect::Absent,
                deadline,
            )
            .await
        {
            Ok(published) => {
                record.lease = Some(id);
                state.push(LeaseEvent::Republished {
                    name,
                    lease: id,
                    locator: record.locator.clone(),
                    revision: published.revision,
                });
            }
            Err(
                error @ (RegistryError::Duplicate { .. } | RegistryError::PermissionDenied { .. }),
            ) => {
                records.remove(&name);
                state.push(LeaseEvent::NotRepublished { name, error });
            }
            // Unreachable, slow, or the new lease gone too: the next renewal says which.
            Err(_) => return,
        }
    }
}

/// One keep-alive: the TTL etcd says is left (0: the lease is gone; `None`: the stream
/// ended, as when etcd restarts).
async fn once(keeper: &mut KeepAlive, deadline: Duration) -> Result<Option<i64>, RegistryError> {
    crate::classify::bounded(Op::KeepAlive, deadline, keeper.renew()).await
}

/// Whether etcd says lease `id` no longer exists (its remaining TTL is not positive).
async fn gone(core: &Core, id: i64, deadline: Duration) -> bool {
    let asked =
        crate::classify::bounded(Op::KeepAlive, deadline, core.client.time_to_live(id)).await;
    asked.is_ok_and(|ttl| ttl <= 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease_state::{LeaseState, MAX_LEASE_EVENTS};

    #[test]
    fn the_backoff_doubles_up_to_a_second_or_the_period() {
        let mut backoff = Backoff::new(Duration::from_secs(10) / 3);
        let waits: Vec<u64> = (0..6).map(|_| backoff.next().as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        // TTL 2 s: never longer than a period, so a renewal is due before the lease could end.
        let mut backoff = Backoff::new(Duration::from_secs(2) / 3);
        let waits: Vec<u64> = (0..5).map(|_| backoff.next().as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 666, 666]);
    }

    #[test]
    fn a_loss_refuses_publishing_until_the_grant_and_is_reported_in_order() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let state = LeaseState::new(7);
        assert!(state.check().is_ok());
        runtime.block_on(state.lose(7, LeaseLoss::NotFound));
        assert!(matches!(
            state.check(),
            Err(RegistryError::LeaseLost {
                reason: LeaseLoss::NotFound
            })
        ));
        runtime.block_on(state.granted(8));
        assert!(state.check().is_ok());
        assert_eq!(state.id(), 8);
        assert!(matches!(
            state.events().as_slice(),
            [
                LeaseEvent::Lost { lease: 7, .. },
                LeaseEvent::Granted { lease: 8 }
            ]
        ));
        assert!(state.next_event(Duration::ZERO).is_none());
    }

    #[test]
    fn unread_events_are_capped_oldest_first() {
        let state = LeaseState::new(1);
        for lease in 0..=MAX_LEASE_EVENTS as i64 {
            state.push(LeaseEvent::Granted { lease });
        }
        let events = state.events();
        assert_eq!(events.len(), MAX_LEASE_EVENTS);
        assert!(matches!(events[0], LeaseEvent::Granted { lease: 1 }));
    }
}
