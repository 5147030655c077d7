//! The publisher's errors: what ends it ([`PublishError`]) and what fails for one region and
//! is tried again at the next poll ([`RegionError`]).

use std::time::Duration;

use crate::error::{NameRule, RegistryError};
use crate::handoff_error::ServeError;
use crate::host_stand_in::StandInError;

/// Why the publisher could not start, or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The registry could not be opened (etcd down, TLS refused, a bad configuration).
    #[error("opening the registry")]
    Registry(#[source] RegistryError),
    /// The exporter's listener could not be made.
    #[error("listening for importers")]
    Serve(#[source] ServeError),
    /// The service refused the publisher's connection, or answered out of protocol, at start.
    #[error("connecting to the memory service")]
    Service(#[source] vmm_memd::MemdError),
    /// The service was gone for longer than the reconnect bound (at start: it never
    /// answered). The offers were withdrawn with the publisher.
    #[error("the memory service was gone for {after:?}")]
    ServiceGone {
        /// How long the publisher tried.
        after: Duration,
    },
}

/// Why one region was not (re)published this time; the next poll tries again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// The service refused or failed the attach, detach or renew.
    #[error("the memory service")]
    Memd(#[source] vmm_memd::MemdError),
    /// The registry refused the publish or update.
    #[error("the registry")]
    Registry(#[source] RegistryError),
    /// The stand-in descriptor of a host region could not be made.
    #[error("the host stand-in")]
    StandIn(#[source] StandInError),
    /// The region's name is not a registry name (vmm-memd allows `/`, keys do not): it is
    /// never published.
    #[error("region {region:?} cannot be a registry name ({rule:?})")]
    Name {
        /// The region.
        region: String,
        /// The rule it breaks.
        rule: NameRule,
    },
}

impl From<vmm_memd::MemdError> for RegionError {
    fn from(e: vmm_memd::MemdError) -> Self {
        RegionError::Memd(e)
    }
}

impl RegionError {
    /// Whether the service is gone (reconnect, rather than try this region again).
    pub fn is_service_gone(&self) -> bool {
        matches!(self, RegionError::Memd(vmm_memd::MemdError::ServiceGone(_)))
    }
}
