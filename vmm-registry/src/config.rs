//! What a registry is opened with: etcd's endpoints, the mutual-TLS material (there is no
//! configuration without it), the domain and owner it publishes under, its lease TTL and its
//! deadlines.

use std::time::Duration;

use crate::error::ConfigError;
use crate::keys::check_name;

/// The lease TTL by default: 10 s (kept alive every TTL/3).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// How long one call may take by default: 5 s.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The mutual-TLS material: this process's certificate and key, the CA that signed etcd's
/// certificate, and the name etcd's certificate must carry.
#[derive(Clone)]
pub struct TlsMaterial {
    pub(crate) ca_pem: Vec<u8>,
    pub(crate) cert_pem: Vec<u8>,
    pub(crate) key_pem: Vec<u8>,
    pub(crate) server_name: String,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("TlsMaterial")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsMaterial {
    /// From PEM: the CA certificate(s) trusted for etcd, this client's certificate and its key;
    /// `server_name` is the DNS name etcd's certificate must carry.
    pub fn from_pem(
        ca_pem: impl Into<Vec<u8>>,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
        server_name: impl Into<String>,
    ) -> TlsMaterial {
        TlsMaterial {
            ca_pem: ca_pem.into(),
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
            server_name: server_name.into(),
        }
    }
}

/// Everything [`Registry::open`](crate::Registry::open) needs.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    pub(crate) endpoints: Vec<String>,
    pub(crate) tls: TlsMaterial,
    pub(crate) domain: String,
    pub(crate) owner: String,
    pub(crate) lease_ttl: Duration,
    pub(crate) call_timeout: Duration,
    pub(crate) open_timeout: Duration,
}

impl RegistryConfig {
    /// Publish as `owner` in `domain`, on the etcd cluster at `endpoints` (`host:port`, spoken
    /// to over TLS only), with the TLS material `tls`; default TTL and deadlines.
    pub fn new<I, S>(
        endpoints: I,
        tls: TlsMaterial,
        domain: impl Into<String>,
        owner: impl Into<String>,
    ) -> RegistryConfig
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RegistryConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            tls,
            domain: domain.into(),
            owner: owner.into(),
            lease_ttl: DEFAULT_LEASE_TTL,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            open_timeout: DEFAULT_CALL_TIMEOUT,
        }
    }

    /// The lease TTL (whole seconds, 2 s to a day; default [`DEFAULT_LEASE_TTL`]).
    pub fn lease_ttl(mut self, ttl: Duration) -> RegistryConfig {
        self.lease_ttl = ttl;
        self
    }

    /// How long each call may take (default [`DEFAULT_CALL_TIMEOUT`]).
    pub fn call_timeout(mut self, timeout: Duration) -> RegistryConfig {
        self.call_timeout = timeout;
        self
    }

    /// How long opening may take, connecting and granting the lease (default
    /// [`DEFAULT_CALL_TIMEOUT`]).
    pub fn open_timeout(mut self, timeout: Duration) -> RegistryConfig {
        self.open_timeout = timeout;
        self
    }

    /// The domain.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The owner.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Refuse what cannot work.
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() {
            return Err(ConfigError::NoEndpoint);
        }
        for endpoint in &self.endpoints {
            let ok = !endpoint.contains("://")
                && endpoint
                    .rsplit_once(':')
                    .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(ConfigError::Endpoint(endpoint.clone()));
            }
        }
        for (what, name) in [("domain", &self.domain), ("owner", &self.owner)] {
            check_name(name).map_err(|rule| ConfigError::Name {
                what,
                name: name.clone(),
                rule,
            })?;
        }
        let ttl = self.lease_ttl;
        if ttl < Duration::from_secs(2)
            || ttl > Duration::from_secs(86_400)
            || ttl.subsec_nanos() != 0
        {
            return Err(ConfigError::Range {
                what: "lease TTL",
                value: ttl,
            });
        }
        for (what, value) in [
            ("call timeout", self.call_timeout),
            ("open timeout", self.open_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Range { what, value });
            }
        }
        Ok(())
    }

    /// The endpoints as the channel takes them: always `https://`.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.endpoints
            .iter()
            .map(|e| format!("https://{e}"))
            .collect()
    }
}
