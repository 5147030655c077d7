//! What the publisher reports as it goes: one event per change it made or met, so a program
//! can log it (`vmm-memd-publish` prints one line each) and a test can wait for it.

use std::fmt;

use crate::serve::{Outcome, Served};

use super::publish_error::RegionError;

/// Why a region's locator was taken down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Withdrawal {
    /// The service no longer lists it for the publisher's uid: deleted, or not readable.
    Gone,
    /// Its current generation cannot be handed to another node (a GPU generation without
    /// fabric handles, as after a restart of the service).
    NotShareable,
    /// etcd said the publisher's registry lease is gone (it expired on etcd's clock, or was
    /// revoked), and the locator went with it. The offer stays: the registry grants a new
    /// lease and publishes the locator again ([`PublishEvent::Republished`]).
    LeaseLost,
}

/// One thing the publisher did or met.
#[derive(Debug)]
pub enum PublishEvent {
    /// A region's locator was published at `generation`.
    Published {
        /// The region.
        region: String,
        /// The generation.
        generation: u64,
    },
    /// A region's locator was updated to a new `generation` (the old one is no longer
    /// offered: an importer holding its locator is refused as stale).
    Updated {
        /// The region.
        region: String,
        /// The new generation.
        generation: u64,
    },
    /// A region's offer was withdrawn and its locator unpublished.
    Unpublished {
        /// The region.
        region: String,
        /// Why.
        why: Withdrawal,
    },
    /// The registry granted a new lease, `lease`, in place of one etcd said is gone; the
    /// locators are published again under it.
    LeaseGranted {
        /// The new lease (etcd's id).
        lease: i64,
    },
    /// A region's locator, gone with a lost lease, was published again under the new one.
    Republished {
        /// The region.
        region: String,
        /// The generation published.
        generation: u64,
    },
    /// One region failed this time (tried again at the next poll).
    Failed {
        /// The region.
        region: String,
        /// Why.
        error: RegionError,
    },
    /// The service is gone: what is offered stays offered (the memory is held), while the
    /// publisher reconnects.
    ServiceGone,
    /// The service answers again: every region is attached again.
    Reconnected,
    /// A hand-off to an importer ended.
    Served(Served),
}

impl fmt::Display for PublishEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PublishEvent::Published { region, generation } => {
                write!(f, "published {region} {generation}")
            }
            PublishEvent::Updated { region, generation } => {
                write!(f, "updated {region} {generation}")
            }
            PublishEvent::Unpublished { region, why } => {
                let why = match why {
                    Withdrawal::Gone => "gone",
                    Withdrawal::NotShareable => "not-shareable",
                    Withdrawal::LeaseLost => "lease-lost",
                };
                write!(f, "unpublished {region} {why}")
            }
            PublishEvent::LeaseGranted { lease } => write!(f, "lease {lease}"),
            PublishEvent::Republished { region, generation } => {
                write!(f, "republished {region} {generation}")
            }
            PublishEvent::Failed { region, error } => {
                write!(f, "failed {region}: {error}")?;
                let mut source = std::error::Error::source(error);
                while let Some(cause) = source {
                    write!(f, ": {cause}")?;
                    source = cause.source();
                }
                Ok(())
            }
            PublishEvent::ServiceGone => f.write_str("service-gone"),
            PublishEvent::Reconnected => f.write_str("reconnected"),
            PublishEvent::Served(served) => {
                let (region, generation) = match &served.request {
                    Some((crate::ExportedObject::Region(region), generation)) => {
                        (region.as_str(), *generation)
                    }
                    _ => ("-", 0),
                };
                let outcome = match &served.outcome {
                    Outcome::Acknowledged => "acknowledged".to_owned(),
                    Outcome::ImportFailed => "import-failed".to_owned(),
                    Outcome::Refused { serving } => format!("refused serving={serving:?}"),
                    Outcome::Failed(error) => format!("failed: {error}"),
                };
                write!(
                    f,
                    "served {region} {generation} to {} {outcome}",
                    served.importer
                )
            }
        }
    }
}
