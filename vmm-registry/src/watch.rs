//! Watching a domain: list it, then watch from the listing's revision + 1, so no change
//! between the two is missed. The watch runs on the background thread and resumes by itself
//! after etcd restarts (from the revision after the last one delivered, so nothing is lost
//! or delivered twice), and lists again when etcd compacted the revisions it needed. A value
//! that fails its checks is reported as refused, and the watch goes on.

use std::sync::mpsc;
use std::time::Duration;

use tokio::sync::oneshot;
use vmm_etcd_api::mvccpb::event::EventType;

use crate::core::{Listing, list};
use crate::error::{Op, RegistryError, ValueError};
use crate::etcd::Etcd;
use crate::keys::{domain_prefix, split_key};
use crate::locator::{Entry, decode};

/// The longest pause between attempts to watch again while etcd is unreachable.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// One change seen by a [`Watch`].
#[derive(Debug)]
pub enum WatchEvent {
    /// A locator was published (or replaced).
    Put(Entry),
    /// A locator was removed (unpublished, or its exporter's lease ended).
    Deleted {
        /// Its owner.
        owner: String,
        /// Its name.
        name: String,
        /// The revision that removed it.
        revision: i64,
    },
    /// A value was refused; the watch goes on.
    Refused {
        /// The key it was written under.
        key: String,
        /// The revision that wrote it.
        revision: i64,
        /// Why it was refused.
        error: ValueError,
    },
    /// etcd compacted the revisions the watch needed: this is the whole domain now, and the
    /// watch goes on from it.
    Relisted(Listing),
}

/// A domain's locators as they change. Dropping it stops the watch.
#[derive(Debug)]
pub struct Watch {
    initial: Listing,
    events: mpsc::Receiver<WatchEvent>,
    _stop: oneshot::Sender<()>,
}

impl Watch {
    /// The listing the watch started from.
    pub fn initial(&self) -> &Listing {
        &self.initial
    }

    /// The next change, waiting up to `timeout`; `Ok(None)` if none came by then,
    /// [`RegistryError::Closed`] once the registry is gone.
    pub fn next_timeout(&self, timeout: Duration) -> Result<Option<WatchEvent>, RegistryError> {
        match self.events.recv_timeout(timeout) {
            Ok(event) => Ok(Some(event)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(RegistryError::Closed),
        }
    }
}

/// Where a watch task delivers its events: a blocking [`Watch`]'s channel, or an async one's.
#[derive(Debug)]
pub(crate) enum Sink {
    Blocking(mpsc::Sender<WatchEvent>),
    #[cfg(feature = "async")]
    Async(tokio::sync::mpsc::UnboundedSender<WatchEvent>),
}

impl Sink {
    /// Deliver `event`; `false` once the receiver is gone.
    fn send(&self, event: WatchEvent) -> bool {
        match self {
            Sink::Blocking(tx) => tx.send(event).is_ok(),
            #[cfg(feature = "async")]
            Sink::Async(tx) => tx.send(event).is_ok(),
        }
    }
}

/// Start watching `domain`: list it (within `deadline`), then hand the rest to a task on
/// `runtime`, from the listing's revision + 1, or from `from` when given (a revision the
/// caller saw before; a compacted one makes the first event [`WatchEvent::Relisted`]).
/// The task ends when the returned sender is dropped.
pub(crate) async fn start(
    client: Etcd,
    domain: String,
    deadline: Duration,
    runtime: tokio::runtime::Handle,
    from: Option<i64>,
    sink: Sink,
) -> Result<(Listing, oneshot::Sender<()>), RegistryError> {
    let initial = list(&client, &domain, deadline, Op::Watch).await?;
    let (stop, stopped) = oneshot::channel();
    let from = from.unwrap_or(initial.revision + 1).max(1);
    runtime.spawn(async move {
        tokio::select! {
            _ = stopped => {}
            () = follow(client, domain, from, deadline, sink) => {}
        }
    });
    Ok((initial, stop))
}

/// [`start`] for a blocking [`Watch`].
pub(crate) async fn start_blocking(
    client: Etcd,
    domain: String,
    deadline: Duration,
    runtime: tokio::runtime::Handle,
    from: Option<i64>,
) -> Result<Watch, RegistryError> {
    let (events, receiver) = mpsc::channel();
    let (initial, stop) = start(
        client,
        domain,
        deadline,
        runtime,
        from,
        Sink::Blocking(events),
    )
    .await?;
    Ok(Watch {
        initial,
        events: receiver,
        _stop: stop,
    })
}

/// Deliver every change from revision `next` on, until the receiver is gone.
async fn follow(client: Etcd, domain: String, mut next: i64, deadline: Duration, events: Sink) {
    let prefix = domain_prefix(&domain).into_bytes();
    let mut backoff = Duration::from_millis(100);
    loop {
        let opened = crate::classify::bounded(
            Op::Watch,
            deadline,
            client.watch_prefix(prefix.clone(), next),
        )
        .await;
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(_) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        // The stream ends (an error, or etcd gone) or asks to be replaced (compaction).
        while let Ok(Some(response)) = stream.message().await {
            backoff = Duration::from_millis(100);
            if response.compact_revision > 0 {
                // The revisions we need are gone: take the whole domain as it is now.
                match list(&client, &domain, deadline, Op::Watch).await {
                    Ok(listing) => {
                        next = listing.revision + 1;
                        if !events.send(WatchEvent::Relisted(listing)) {
                            return;
                        }
                    }
                    Err(_) => tokio::time::sleep(backoff).await,
                }
                break;
            }
            if response.canceled {
                break;
            }
            for event in &response.events {
                let Some(kv) = &event.kv else { continue };
                let revision = kv.mod_revision;
                if revision < next {
                    // Delivered before the stream was replaced.
                    continue;
                }
                let delivered = match event.r#type() {
                    EventType::Put => match decode(&domain, &kv.key, &kv.value, revision) {
                        Ok(entry) => WatchEvent::Put(entry),
                        Err(error) => refused(&kv.key, revision, error),
                    },
                    EventType::Delete => match split_key(&domain, &kv.key) {
                        Some((owner, name)) => WatchEvent::Deleted {
                            owner: owner.to_owned(),
                            name: name.to_owned(),
                            revision,
                        },
                        None => refused(&kv.key, revision, ValueError::Key),
                    },
                };
                if !events.send(delivered) {
                    return;
                }
            }
            if let Some(last) = response
                .events
                .iter()
                .filter_map(|e| e.kv.as_ref())
                .map(|kv| kv.mod_revision)
                .max()
            {
                next = next.max(last + 1);
            }
        }
        tokio::time::sleep(backoff).await;
    }
}

fn refused(key: &[u8], revision: i64, error: ValueError) -> WatchEvent {
    WatchEvent::Refused {
        key: String::from_utf8_lossy(key).into_owned(),
        revision,
        error,
    }
}
