//! [`MemdPublisher`]: follows what a vmm-memd service holds for the publisher's uid and keeps
//! the registry and the exporter's offers in step with it, one poll at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_memd::{Client, MemdError, Refusal};

use crate::error::RegistryError;
use crate::keys::check_name;
use crate::lease_state::LeaseEvent;
use crate::locator::{ExportedObject, HandleKind};
use crate::registry::Registry;
use crate::serve::ExportServer;

use super::attach_held::{Attachment, attach, detach};
use super::event::{PublishEvent, Withdrawal};
use super::held::Held;
use super::publish_error::{PublishError, RegionError};
use super::publisher_config::{PublisherConfig, Regions};
use super::service_link::ServiceLink;

/// How often a publisher whose service is gone looks again (its backoff decides whether it
/// connects then).
const WHILE_DOWN: Duration = Duration::from_millis(50);

/// Why the connection to the service is dropped.
#[derive(Debug)]
enum Dropped {
    /// The service is gone (it died, or stops).
    Gone,
    /// A reply broke off part way: what comes next on the connection cannot be trusted.
    OutOfStep,
}

impl From<MemdError> for Dropped {
    fn from(_: MemdError) -> Dropped {
        // Any failure of a request that is not a refusal leaves the connection unusable.
        Dropped::Gone
    }
}

/// A region offered and, once the registry took it, published.
#[derive(Debug)]
struct Slot {
    held: Held,
    published: bool,
}

/// Publishes a vmm-memd service's regions: for each region the service lets this process's
/// uid read (and the configuration selects), it attaches the current generation (a lease,
/// renewed every TTL/3), offers its descriptor on a mutual-TLS [`ExportServer`] and publishes
/// its [`Locator`](crate::Locator) under the owner's prefix. At each poll a new generation is
/// attached, offered in place of the old one (an importer asking for the old one is refused as
/// stale), its locator updated, and the old lease ended; a region gone from the service's
/// list (deleted, or not readable) is withdrawn and unpublished.
///
/// The service gone (it died, it restarts): what is offered stays offered (the publisher holds
/// the host chunks' fds, so the memory and the stand-in's names stay good), the publisher
/// reconnects with backoff for [`PublisherConfig::reconnect_within`] and attaches every region
/// again. A GPU region's fabric handles die with the service's allocation: it is withdrawn
/// until the service can share it again.
#[derive(Debug)]
pub struct MemdPublisher {
    link: ServiceLink,
    registry: Registry,
    server: ExportServer,
    owner: String,
    addr: SocketAddr,
    exporter_name: String,
    regions: Regions,
    poll: Duration,
    slots: BTreeMap<String, Slot>,
    /// Keys to unpublish again (an unpublish that failed).
    unpublish: BTreeSet<String>,
    /// Failures already reported once (a name that cannot be a key, an unshareable
    /// generation), so the log is not a repeat of them.
    reported: BTreeSet<(String, u64)>,
    lease_ttl: Option<Duration>,
    renewed: Instant,
}

impl MemdPublisher {
    /// Connect to the service (waiting up to the reconnect bound for it), open the registry
    /// (grants the lease) and listen for importers. Nothing is published before the first
    /// [`poll`](Self::poll).
    pub fn start(config: PublisherConfig) -> Result<MemdPublisher, PublishError> {
        let link = ServiceLink::connect(config.service, config.connect, config.reconnect_within)?;
        let owner = config.registry.owner().to_owned();
        let registry = Registry::open(config.registry).map_err(PublishError::Registry)?;
        let server = ExportServer::bind(config.listen, &config.exporter, config.handoff_timeout)
            .map_err(PublishError::Serve)?;
        let addr = config.advertise.unwrap_or(server.local_addr());
        Ok(MemdPublisher {
            link,
            registry,
            server,
            owner,
            addr,
            exporter_name: config.exporter_name,
            regions: config.regions,
            poll: config.poll,
            slots: BTreeMap::new(),
            unpublish: BTreeSet::new(),
            reported: BTreeSet::new(),
            lease_ttl: None,
            renewed: Instant::now(),
        })
    }

    /// Where the exporter listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The registry this publisher publishes in (its lease, a watch).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Each region published now, and its generation.
    pub fn published(&self) -> Vec<(String, u64)> {
        self.slots
            .iter()
            .filter(|(_, slot)| slot.published)
            .map(|(region, slot)| (region.clone(), slot.held.generation))
            .collect()
    }

    /// One round: bring the offers and the registry in step with the service, renew the
    /// service's leases when due, and report what changed, what hand-offs ended and what
    /// happened to the registry lease. [`PublishError::ServiceGone`] (gone for the whole
    /// bound) ends the publisher; a region's failure is an event, tried again next time. An
    /// etcd outage ends nothing (the registry keeps its lease alive through it), nor does a
    /// lease etcd says is gone: the registry publishes every locator again under a new one.
    pub fn poll(&mut self) -> Result<Vec<PublishEvent>, PublishError> {
        let mut events = Vec::new();
        self.lease_events(&mut events);
        self.retry_unpublish(&mut events);
        if let Some((client, fresh)) = self.link.take()? {
            match self.sync(&client, fresh, &mut events) {
                Ok(()) => self.link.restore(client),
                Err(gone) => {
                    drop(client);
                    self.service_gone(gone, &mut events);
                }
            }
        }
        while let Some(served) = self.server.next_served(Duration::ZERO) {
            events.push(PublishEvent::Served(served));
        }
        Ok(events)
    }

    /// Poll until `stop` is set (checked every 100 ms at least), passing every event to
    /// `report`, waiting between polls the poll interval (a third of the service's lease TTL
    /// if shorter; less while the service is gone).
    pub fn run(
        &mut self,
        stop: &AtomicBool,
        mut report: impl FnMut(&PublishEvent),
    ) -> Result<(), PublishError> {
        while !stop.load(Ordering::SeqCst) {
            for event in self.poll()? {
                report(&event);
            }
            let until = Instant::now() + self.tick();
            loop {
                let now = Instant::now();
                if now >= until || stop.load(Ordering::SeqCst) {
                    break;
                }
                let wait = (until - now).min(Duration::from_millis(100));
                if let Some(served) = self.server.next_served(wait) {
                    report(&PublishEvent::Served(served));
                }
            }
        }
        Ok(())
    }

    /// Stop: withdraw every offer and revoke the registry lease (every locator of this
    /// publisher disappears at once); the service's leases end with the connection.
    pub fn close(mut self) -> Result<(), PublishError> {
        for region in std::mem::take(&mut self.slots).into_keys() {
            self.server.withdraw(&ExportedObject::Region(region));
        }
        self.registry.close().map_err(PublishError::Registry)
    }

    fn tick(&self) -> Duration {
        let mut tick = self.poll;
        if let Some(ttl) = self.lease_ttl {
            tick = tick.min(ttl / 3);
        }
        if self.slots.values().any(|s| s.held.lease.is_none()) {
            tick = tick.min(WHILE_DOWN);
        }
        tick.max(Duration::from_millis(1))
    }

    /// The step with the service on `client` (`fresh`: just connected); `Err` when the
    /// service turned out to be gone (or out of step).
    fn sync(
        &mut self,
        client: &Client,
        fresh: bool,
        events: &mut Vec<PublishEvent>,
    ) -> Result<(), Dropped> {
        if fresh {
            // The leases ended with the old connection; attach everything again.
            for slot in self.slots.values_mut() {
                slot.held.lease = None;
            }
            events.push(PublishEvent::Reconnected);
        }
        let listed = client.list()?;
        let mut wanted = BTreeMap::new();
        for summary in listed {
            if summary.generation == 0 || !self.regions.includes(&summary.region) {
                continue;
            }
            match check_name(&summary.region) {
                Ok(()) => {
                    wanted.insert(summary.region, summary.generation);
                }
                Err(rule) => {
                    if self.reported.insert((summary.region.clone(), 0)) {
                        events.push(PublishEvent::Failed {
                            region: summary.region.clone(),
                            error: RegionError::Name {
                                region: summary.region,
                                rule,
                            },
                        });
                    }
                }
            }
        }
        let gone: Vec<String> = self
            .slots
            .keys()
            .filter(|region| !wanted.contains_key(*region))
            .cloned()
            .collect();
        for region in gone {
            if let Some(slot) = self.slots.remove(&region)
                && let Some(lease) = slot.held.lease
                && let Err(MemdError::ServiceGone(_)) = detach(client, lease)
            {
                self.withdraw(region, Withdrawal::Gone, events);
                return Err(Dropped::Gone);
            }
            self.withdraw(region, Withdrawal::Gone, events);
        }
        for (region, generation) in wanted {
            let due = self
                .slots
                .get(&region)
                .is_none_or(|slot| slot.held.generation != generation || slot.held.lease.is_none());
            if due {
                match attach(client, &region) {
                    Ok(attachment) => self.offer(client, &region, attachment, events),
                    Err(e) if e.is_service_gone() => return Err(Dropped::Gone),
                    Err(RegionError::Memd(MemdError::Refused(Refusal::FabricUnavailable {
                        ..
                    }))) => {
                        // Reported once per generation (by the withdrawal, if it was offered).
                        let first = self.reported.insert((region.clone(), generation));
                        if self.slots.contains_key(&region) {
                            self.withdraw(region, Withdrawal::NotShareable, events);
                        } else if first {
                            events.push(PublishEvent::Unpublished {
                                region,
                                why: Withdrawal::NotShareable,
                            });
                        }
                        continue;
                    }
                    // Deleted or made unreadable since the list: gone at the next poll.
                    Err(RegionError::Memd(MemdError::Refused(
                        Refusal::NoSuchRegion { .. } | Refusal::NoSuchGeneration { .. },
                    ))) => continue,
                    // The reply broke off part way: the connection is out of step, so it is
                    // made again (and every region attached again).
                    Err(RegionError::Memd(e)) if !matches!(e, MemdError::Refused(_)) => {
                        events.push(PublishEvent::Failed {
                            region,
                            error: RegionError::Memd(e),
                        });
                        return Err(Dropped::OutOfStep);
                    }
                    Err(error) => {
                        events.push(PublishEvent::Failed { region, error });
                        continue;
                    }
                }
            }
            self.publish_if_due(&region, events);
        }
        if let Some(ttl) = self.lease_ttl
            && self.renewed.elapsed() >= ttl / 3
            && self.slots.values().any(|s| s.held.lease.is_some())
        {
            self.renewed = Instant::now();
            client.renew()?;
        }
        Ok(())
    }

    /// Offer a freshly attached generation in place of what was offered of `region`, update
    /// its locator, then end the old lease.
    fn offer(
        &mut self,
        client: &Client,
        region: &str,
        attachment: Attachment,
        events: &mut Vec<PublishEvent>,
    ) {
        let Attachment { mut held, ttl } = attachment;
        self.lease_ttl = Some(self.lease_ttl.map_or(ttl, |t| t.min(ttl)));
        let object = ExportedObject::Region(region.to_owned());
        self.server.offer_with_metadata(
            object,
            held.generation,
            held.descriptor.clone(),
            std::mem::take(&mut held.metadata),
        );
        let new = Slot {
            held,
            published: false,
        };
        let old = self.slots.insert(region.to_owned(), new);
        let slot = self.slots.get_mut(region).expect("just inserted");
        if let Some(old) = old {
            if old.published {
                if old.held.generation == slot.held.generation {
                    // The same generation attached again (after a reconnect): same locator.
                    slot.published = true;
                } else {
                    let locator =
                        slot.held
                            .locator(&self.owner, region, self.addr, &self.exporter_name);
                    match self.registry.update(region, &locator) {
                        Ok(_) => {
                            slot.published = true;
                            events.push(PublishEvent::Updated {
                                region: region.to_owned(),
                                generation: slot.held.generation,
                            });
                        }
                        // Taken away behind our back: published afresh below.
                        Err(RegistryError::NotPublishedHere { .. }) => {}
                        Err(e) => events.push(PublishEvent::Failed {
                            region: region.to_owned(),
                            error: RegionError::Registry(e),
                        }),
                    }
                }
            }
            if let Some(lease) = old.held.lease {
                // Best effort: a lease the service no longer knows is no loss.
                let _ = detach(client, lease);
            }
        }
    }

    /// Publish `region`'s locator if the registry does not have it yet.
    fn publish_if_due(&mut self, region: &str, events: &mut Vec<PublishEvent>) {
        let Some(slot) = self.slots.get_mut(region) else {
            return;
        };
        if slot.published {
            return;
        }
        let locator = slot
            .held
            .locator(&self.owner, region, self.addr, &self.exporter_name);
        match self.registry.publish(region, &locator) {
            Ok(_) => {
                slot.published = true;
                self.unpublish.remove(region);
                events.push(PublishEvent::Published {
                    region: region.to_owned(),
                    generation: slot.held.generation,
                });
            }
            // Ours already (an update that failed, then this): replace it.
            Err(RegistryError::Duplicate { .. })
                if self.registry.update(region, &locator).is_ok() =>
            {
                slot.published = true;
                events.push(PublishEvent::Updated {
                    region: region.to_owned(),
                    generation: slot.held.generation,
                });
            }
            Err(e) => events.push(PublishEvent::Failed {
                region: region.to_owned(),
                error: RegionError::Registry(e),
            }),
        }
    }

    /// Withdraw `region`'s offer, unpublish it, and report it.
    fn withdraw(&mut self, region: String, why: Withdrawal, events: &mut Vec<PublishEvent>) {
        self.slots.remove(&region);
        self.server
            .withdraw(&ExportedObject::Region(region.clone()));
        if self.registry.unpublish(&region).is_err() {
            self.unpublish.insert(region.clone());
        }
        events.push(PublishEvent::Unpublished { region, why });
    }

    /// Report what happened to the registry lease, region by region. The registry itself
    /// publishes every locator again under its new lease; a locator it could not publish
    /// again (its name taken meanwhile) is published afresh at the next sync.
    fn lease_events(&mut self, events: &mut Vec<PublishEvent>) {
        for event in self.registry.lease_events() {
            match event {
                LeaseEvent::Lost { unpublished, .. } => {
                    for region in unpublished {
                        events.push(PublishEvent::Unpublished {
                            region,
                            why: Withdrawal::LeaseLost,
                        });
                    }
                }
                LeaseEvent::Granted { lease } => events.push(PublishEvent::LeaseGranted { lease }),
                LeaseEvent::Republished { name, locator, .. } => {
                    events.push(PublishEvent::Republished {
                        region: name,
                        generation: locator.generation,
                    });
                }
                LeaseEvent::NotRepublished { name, error } => {
                    if let Some(slot) = self.slots.get_mut(&name) {
                        slot.published = false;
                    }
                    events.push(PublishEvent::Failed {
                        region: name,
                        error: RegionError::Registry(error),
                    });
                }
            }
        }
    }

    fn retry_unpublish(&mut self, events: &mut Vec<PublishEvent>) {
        for region in std::mem::take(&mut self.unpublish) {
            if let Err(error) = self.registry.unpublish(&region) {
                self.unpublish.insert(region.clone());
                events.push(PublishEvent::Failed {
                    region,
                    error: RegionError::Registry(error),
                });
            }
        }
    }

    /// The connection is dropped, and the leases with it. When the service is gone, host
    /// memory stays offered (the fds hold it); fabric handles die with the service's
    /// allocation, so those are withdrawn.
    fn service_gone(&mut self, why: Dropped, events: &mut Vec<PublishEvent>) {
        self.link.lost();
        for slot in self.slots.values_mut() {
            slot.held.lease = None;
        }
        if let Dropped::OutOfStep = why {
            return;
        }
        events.push(PublishEvent::ServiceGone);
        let fabric: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, slot)| slot.held.handle == HandleKind::Fabric)
            .map(|(region, _)| region.clone())
            .collect();
        for region in fabric {
            self.withdraw(region, Withdrawal::NotShareable, events);
        }
    }
}
