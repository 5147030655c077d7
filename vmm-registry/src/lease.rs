//! The process's one lease: granted at open, kept alive every TTL/3 on the background
//! thread, revoked at a clean shutdown. When it is lost (etcd says it is gone, or no
//! keep-alive succeeded for a whole TTL) the loss is recorded where every caller sees it:
//! from then on the process's locators are unpublished and publishing is refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{LeaseLoss, Op, RegistryError};
use crate::etcd::{Etcd, KeepAlive};

/// Retry a failed keep-alive this soon (or at TTL/3, if sooner).
const RETRY: Duration = Duration::from_millis(500);

/// Whether the lease is still held, shared by the keep-alive task and every caller.
#[derive(Debug, Default)]
pub(crate) struct LeaseState {
    lost: Mutex<Option<LeaseLoss>>,
    changed: Condvar,
    closing: AtomicBool,
}

impl LeaseState {
    pub(crate) fn lose(&self, reason: LeaseLoss) {
        let mut lost = self.lost.lock().unwrap_or_else(PoisonError::into_inner);
        lost.get_or_insert(reason);
        self.changed.notify_all();
    }

    pub(crate) fn lost(&self) -> Option<LeaseLoss> {
        *self.lost.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `Err(LeaseLost)` once the lease is gone.
    pub(crate) fn check(&self) -> Result<(), RegistryError> {
        match self.lost() {
            Some(reason) => Err(RegistryError::LeaseLost { reason }),
            None => Ok(()),
        }
    }

    /// Wait up to `timeout` for the lease to be lost.
    pub(crate) fn wait_lost(&self, timeout: Duration) -> Option<LeaseLoss> {
        let lost = self.lost.lock().unwrap_or_else(PoisonError::into_inner);
        let (lost, _) = self
            .changed
            .wait_timeout_while(lost, timeout, |lost| lost.is_none())
            .unwrap_or_else(PoisonError::into_inner);
        *lost
    }

    /// The registry is shutting down: the keep-alive stops without calling that a loss.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }
}

/// Keep lease `id` (of `ttl`) alive until the registry closes or the lease is lost.
pub(crate) async fn keep_alive(
    client: Etcd,
    id: i64,
    ttl: Duration,
    call_timeout: Duration,
    state: std::sync::Arc<LeaseState>,
) {
    let period = ttl / 3;
    let mut last_ok = Instant::now();
    let mut keeper = client.keep_alive(id);
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        if state.closing() {
            return;
        }
        let deadline = period.min(call_timeout);
        match once(&mut keeper, deadline).await {
            Ok(Some(left)) if left > 0 => {
                last_ok = Instant::now();
                wait = period;
            }
            Ok(Some(_)) => {
                if !state.closing() {
                    state.lose(LeaseLoss::NotFound);
                }
                return;
            }
            Err(RegistryError::Etcd { .. }) if gone(&client, id, deadline).await => {
                // etcd refused the keep-alive, and its TTL query says the lease is not
                // there.
                if !state.closing() {
                    state.lose(LeaseLoss::NotFound);
                }
                return;
            }
            Ok(None) | Err(_) => {
                // etcd unreachable or slow: a new stream next time (`renew` opens one),
                // sooner, until a whole TTL has passed without an answer.
                if last_ok.elapsed() >= ttl {
                    state.lose(LeaseLoss::NoKeepAlive);
                    return;
                }
                wait = period.min(RETRY);
            }
        }
    }
}

/// One keep-alive: the TTL etcd says is left (0: the lease is gone; `None`: the stream
/// ended, as when etcd restarts).
async fn once(keeper: &mut KeepAlive, deadline: Duration) -> Result<Option<i64>, RegistryError> {
    crate::classify::bounded(Op::KeepAlive, deadline, keeper.renew()).await
}

/// Whether etcd says lease `id` no longer exists (its remaining TTL is not positive).
async fn gone(client: &Etcd, id: i64, deadline: Duration) -> bool {
    let asked = crate::classify::bounded(Op::KeepAlive, deadline, client.time_to_live(id)).await;
    asked.is_ok_and(|ttl| ttl <= 0)
}
