//! What a publisher is started with: the service it reads, the registry it publishes in, the
//! listener importers fetch from, and which regions.

use std::net::SocketAddr;
use std::time::Duration;

use vmm_core::wire::endpoint::{ConnectOptions, Name};
use vmm_core::wire::tls::TlsOptions;

use crate::config::RegistryConfig;

/// How often the service is asked what it holds, by default: 1 s.
pub const DEFAULT_POLL: Duration = Duration::from_secs(1);

/// How long the service may be gone before the publisher gives up, by default: 60 s.
pub const DEFAULT_RECONNECT_WITHIN: Duration = Duration::from_secs(60);

/// How long one hand-off message may take, by default: 10 s.
pub const DEFAULT_HANDOFF_TIMEOUT: Duration = Duration::from_secs(10);

/// Which regions to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Regions {
    /// Every region the service lists for the publisher's uid.
    All,
    /// These regions, when the service lists them for the publisher's uid.
    Named(Vec<String>),
}

impl Regions {
    pub(crate) fn includes(&self, region: &str) -> bool {
        match self {
            Regions::All => true,
            Regions::Named(names) => names.iter().any(|n| n == region),
        }
    }
}

/// Everything [`MemdPublisher::start`](super::MemdPublisher::start) needs.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// The service's socket.
    pub service: Name,
    /// How to connect to it (whom it must run as).
    pub connect: ConnectOptions,
    /// The registry: endpoints, TLS, domain, owner, lease TTL.
    pub registry: RegistryConfig,
    /// The exporter's mutual TLS: its certificate (naming `exporter_name`), the roots, and
    /// the importer names admitted.
    pub exporter: TlsOptions,
    /// Where the exporter listens.
    pub listen: SocketAddr,
    /// The address locators carry (default: the listener's own, which must then be
    /// reachable from the importers' nodes).
    pub advertise: Option<SocketAddr>,
    /// The name the exporter's certificate carries (locators carry it; importers admit only it).
    pub exporter_name: String,
    /// Which regions.
    pub regions: Regions,
    /// How often the service is asked what it holds.
    pub poll: Duration,
    /// How long the service may be gone (reconnects with backoff) before the publisher stops.
    pub reconnect_within: Duration,
    /// How long one hand-off message may take.
    pub handoff_timeout: Duration,
}

impl PublisherConfig {
    /// Publish every readable region of the service at `service`, as `registry`'s owner,
    /// serving with `exporter` on `listen` under the name `exporter_name`; default poll,
    /// reconnect bound and hand-off deadline.
    pub fn new(
        service: Name,
        registry: RegistryConfig,
        exporter: TlsOptions,
        listen: SocketAddr,
        exporter_name: impl Into<String>,
    ) -> PublisherConfig {
        PublisherConfig {
            service,
            connect: ConnectOptions::default(),
            registry,
            exporter,
            listen,
            advertise: None,
            exporter_name: exporter_name.into(),
            regions: Regions::All,
            poll: DEFAULT_POLL,
            reconnect_within: DEFAULT_RECONNECT_WITHIN,
            handoff_timeout: DEFAULT_HANDOFF_TIMEOUT,
        }
    }
}
