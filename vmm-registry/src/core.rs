//! The registry's operations as `async fn`s on its etcd client, each bounded by its deadline.
//! The blocking [`Registry`](crate::Registry) runs them on its background thread; the
//! `async` feature offers them directly.

use std::time::Duration;

use crate::classify::{bounded, classify, within};
use crate::config::RegistryConfig;
use crate::error::{ConfigError, Op, RegistryError};
use crate::etcd::{Etcd, delete_if, put_if, when_absent, when_lease};
use crate::keys::{check_name, domain_prefix, export_key};
use crate::lease_state::{LeaseState, Record};
use crate::locator::{Entry, Locator, decode};

/// What a successful publish wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The key.
    pub key: String,
    /// The revision that wrote it.
    pub revision: i64,
}

/// Every locator of a domain at one revision, and the values that were refused.
#[derive(Debug, Default)]
pub struct Listing {
    /// The locators that passed every check.
    pub entries: Vec<Entry>,
    /// Keys whose values were refused, and why.
    pub refused: Vec<(String, crate::ValueError)>,
    /// The revision read at (a watch goes on from the next one).
    pub revision: i64,
}

/// An open registry's shared state: the client, the names, the lease (which changes only
/// when etcd says the one held is gone) and what was published under it.
pub(crate) struct Core {
    pub(crate) client: Etcd,
    pub(crate) domain: String,
    pub(crate) owner: String,
    pub(crate) ttl: Duration,
    pub(crate) call_timeout: Duration,
    pub(crate) lease: LeaseState,
}

/// What a put requires of its key.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Expect {
    /// Absent (a publish, or a republish after a lost lease): else `Duplicate`.
    Absent,
    /// On this lease (an update of our own key): else `NotPublishedHere`.
    OnLease(i64),
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("domain", &self.domain)
            .field("owner", &self.owner)
            .field("lease_id", &self.lease.id())
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Connect and grant the lease: a real request, so an etcd that is down, or refuses our
    /// certificate, fails the open within its deadline.
    pub(crate) async fn open(config: RegistryConfig) -> Result<Core, RegistryError> {
        config.check()?;
        let ttl = config.lease_ttl;
        let open = async {
            // A TLS refusal, either way, with rustls's error intact.
            crate::tls_probe::probe(&config.endpoints, &config.tls).await?;
            // The channel connects at its first call: the grant.
            let client = Etcd::connect(&config)?;
            let lease_id = client
                .grant(i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX))
                .await
                .map_err(|e| classify(Op::Open, e))?;
            Ok::<_, RegistryError>((client, lease_id))
        };
        let (client, lease_id) = tokio::time::timeout(config.open_timeout, open)
            .await
            .map_err(|_| RegistryError::Deadline {
                op: Op::Open,
                after: config.open_timeout,
            })??;
        Ok(Core {
            client,
            domain: config.domain,
            owner: config.owner,
            ttl,
            call_timeout: config.call_timeout,
            lease: LeaseState::new(lease_id),
        })
    }

    fn own_key(&self, name: &str) -> Result<String, RegistryError> {
        check_name(name).map_err(|rule| ConfigError::Name {
            what: "export name",
            name: name.to_owned(),
            rule,
        })?;
        Ok(export_key(&self.domain, &self.owner, name))
    }

    /// Publish `locator` as `name` under this owner, attached to the lease; refused if the
    /// name is taken ([`RegistryError::Duplicate`]). Remembered, so that it is published
    /// again if etcd ever says the lease is gone.
    pub(crate) async fn publish(
        &self,
        name: &str,
        locator: &Locator,
    ) -> Result<Published, RegistryError> {
        let deadline = self.call_timeout;
        within(Op::Publish, deadline, async {
            let mut records = self.lease.records.lock().await;
            self.lease.check()?;
            let lease = self.lease.id();
            let published = self
                .put_record(Op::Publish, name, locator, lease, Expect::Absent, deadline)
                .await?;
            records.insert(
                name.to_owned(),
                Record {
                    locator: locator.clone(),
                    lease: Some(lease),
                },
            );
            Ok(published)
        })
        .await
    }

    /// Replace the value of this process's locator `name` with `locator`, still under the
    /// process's lease, by a transaction that compares the key's lease with ours: a key that
    /// is absent, or another process's, is left alone ([`RegistryError::NotPublishedHere`]).
    /// A locator of ours that went with a lost lease and waits to be published again is
    /// absent from etcd: it is put back now, with the new value, if its name is still free.
    pub(crate) async fn update(
        &self,
        name: &str,
        locator: &Locator,
    ) -> Result<Published, RegistryError> {
        let deadline = self.call_timeout;
        within(Op::Update, deadline, async {
            let mut records = self.lease.records.lock().await;
            self.lease.check()?;
            let lease = self.lease.id();
            let expect = match records.get(name) {
                Some(record) if record.lease != Some(lease) => Expect::Absent,
                // An absent key compares as lease 0, which no granted lease is.
                _ => Expect::OnLease(lease),
            };
            let published = self
                .put_record(Op::Update, name, locator, lease, expect, deadline)
                .await
                .map_err(|e| match e {
                    RegistryError::Duplicate { key } => RegistryError::NotPublishedHere { key },
                    e => e,
                })?;
            records.insert(
                name.to_owned(),
                Record {
                    locator: locator.clone(),
                    lease: Some(lease),
                },
            );
            Ok(published)
        })
        .await
    }

    /// Put `locator` as this owner's `name` on `lease`, if the key is as `expect` says
    /// (else `Duplicate` or `NotPublishedHere`), within `deadline`: what publish, update and
    /// the republish after a lost lease share. The caller holds the records' lock.
    pub(crate) async fn put_record(
        &self,
        op: Op,
        name: &str,
        locator: &Locator,
        lease: i64,
        expect: Expect,
        deadline: Duration,
    ) -> Result<Published, RegistryError> {
        if locator.owner != self.owner {
            return Err(RegistryError::NotOurOwner {
                ours: self.owner.clone(),
                in_locator: locator.owner.clone(),
            });
        }
        let key = self.own_key(name)?;
        let value = locator.encode()?;
        let condition = match expect {
            Expect::Absent => when_absent(key.clone()),
            Expect::OnLease(lease) => when_lease(key.clone(), lease),
        };
        let txn = put_if(condition, key.clone(), value, lease);
        let response = bounded(op, deadline, self.client.txn(txn)).await?;
        if !response.succeeded {
            return Err(match expect {
                Expect::Absent => RegistryError::Duplicate { key },
                Expect::OnLease(_) => RegistryError::NotPublishedHere { key },
            });
        }
        let revision = response.header.map_or(0, |h| h.revision);
        Ok(Published { key, revision })
    }

    /// Remove this process's locator `name`; `false` when there was none on its lease. It is
    /// forgotten first, so a lease lost meanwhile never brings it back.
    pub(crate) async fn unpublish(&self, name: &str) -> Result<bool, RegistryError> {
        let key = self.own_key(name)?;
        let deadline = self.call_timeout;
        within(Op::Unpublish, deadline, async {
            let mut records = self.lease.records.lock().await;
            records.remove(name);
            let txn = delete_if(when_lease(key.clone(), self.lease.id()), key);
            let response = bounded(Op::Unpublish, deadline, self.client.txn(txn)).await?;
            Ok(response.succeeded)
        })
        .await
    }

    /// The locator `owner` published as `name`, checked; `None` when there is none.
    pub(crate) async fn resolve(
        &self,
        owner: &str,
        name: &str,
    ) -> Result<Option<Entry>, RegistryError> {
        for (what, n) in [("owner", owner), ("export name", name)] {
            check_name(n).map_err(|rule| ConfigError::Name {
                what,
                name: n.to_owned(),
                rule,
            })?;
        }
        let key = export_key(&self.domain, owner, name);
        let response = bounded(
            Op::Resolve,
            self.call_timeout,
            self.client.get(key.clone().into_bytes()),
        )
        .await?;
        let Some(kv) = response.kvs.first() else {
            return Ok(None);
        };
        decode(&self.domain, &kv.key, &kv.value, kv.mod_revision)
            .map(Some)
            .map_err(|source| RegistryError::Value { key, source })
    }

    /// Every locator of the domain.
    pub(crate) async fn list(&self) -> Result<Listing, RegistryError> {
        list(&self.client, &self.domain, self.call_timeout, Op::List).await
    }

    /// Revoke the lease: every locator of this process disappears at once.
    pub(crate) async fn revoke(&self) -> Result<(), RegistryError> {
        self.lease.close();
        bounded(
            Op::Revoke,
            self.call_timeout,
            self.client.revoke(self.lease.id()),
        )
        .await?;
        Ok(())
    }
}

/// Every locator under `domain`'s prefix, checked one by one.
pub(crate) async fn list(
    client: &Etcd,
    domain: &str,
    deadline: Duration,
    op: Op,
) -> Result<Listing, RegistryError> {
    let prefix = domain_prefix(domain).into_bytes();
    let response = bounded(op, deadline, client.get_prefix(prefix)).await?;
    let mut listing = Listing {
        revision: response.header.map_or(0, |h| h.revision),
        ..Listing::default()
    };
    for kv in &response.kvs {
        match decode(domain, &kv.key, &kv.value, kv.mod_revision) {
            Ok(entry) => listing.entries.push(entry),
            Err(why) => listing
                .refused
                .push((String::from_utf8_lossy(&kv.key).into_owned(), why)),
        }
    }
    Ok(listing)
}
