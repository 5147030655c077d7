//! The registry's own thin client of etcd's v3 API: one tonic channel over mutual TLS
//! (rustls on ring), and the few calls the registry makes, on the clients vmm-etcd-api
//! generated from etcd's .proto files. Every call returns [`EtcdError`]; bounding it by a
//! deadline and classifying its failure is the caller's (`classify`).

mod keep_alive;
mod requests;
mod watch_stream;

use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use vmm_etcd_api::etcdserverpb::kv_client::KvClient;
use vmm_etcd_api::etcdserverpb::lease_client::LeaseClient;
use vmm_etcd_api::etcdserverpb::{
    LeaseGrantRequest, LeaseRevokeRequest, LeaseTimeToLiveRequest, RangeRequest, RangeResponse,
    TxnRequest, TxnResponse,
};

use crate::config::RegistryConfig;
use crate::error::{ConfigError, EtcdError};

pub(crate) use keep_alive::KeepAlive;
pub(crate) use requests::{delete_if, put_if, when_absent, when_lease};
pub(crate) use watch_stream::WatchStream;

/// How often an idle connection is pinged (HTTP/2), and how long an answer may take: an etcd
/// that stops answering (SIGSTOP, a dead link) is noticed by then.
const PING: Duration = Duration::from_secs(2);

/// A channel to an etcd cluster, shared by every call (clones are cheap).
#[derive(Debug, Clone)]
pub(crate) struct Etcd {
    channel: Channel,
}

impl Etcd {
    /// A channel to `config`'s endpoints, `https://` only, with its TLS material, balanced
    /// over the endpoints. It connects at the first call (and again after a failure), each
    /// connection within the open timeout. Must be called on the tokio runtime.
    pub(crate) fn connect(config: &RegistryConfig) -> Result<Etcd, ConfigError> {
        let tls = &config.tls;
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&tls.ca_pem))
            .identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem))
            .domain_name(tls.server_name.clone());
        let endpoints = config
            .urls()
            .into_iter()
            .map(|url| {
                Ok(Endpoint::from_shared(url)
                    .map_err(ConfigError::Client)?
                    .tls_config(tls.clone())
                    .map_err(ConfigError::Client)?
                    .connect_timeout(config.open_timeout)
                    .http2_keep_alive_interval(PING)
                    .keep_alive_timeout(PING)
                    .keep_alive_while_idle(true))
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        Ok(Etcd {
            channel: Channel::balance_list(endpoints.into_iter()),
        })
    }

    fn kv(&self) -> KvClient<Channel> {
        KvClient::new(self.channel.clone())
    }

    fn lease(&self) -> LeaseClient<Channel> {
        LeaseClient::new(self.channel.clone())
    }

    /// The value at `key` (at most one key).
    pub(crate) async fn get(&self, key: Vec<u8>) -> Result<RangeResponse, EtcdError> {
        let request = RangeRequest {
            key,
            ..RangeRequest::default()
        };
        Ok(self.kv().range(request).await?.into_inner())
    }

    /// Every key under `prefix`, with its value, at one revision.
    pub(crate) async fn get_prefix(&self, prefix: Vec<u8>) -> Result<RangeResponse, EtcdError> {
        let request = RangeRequest {
            range_end: requests::prefix_end(&prefix),
            key: prefix,
            ..RangeRequest::default()
        };
        Ok(self.kv().range(request).await?.into_inner())
    }

    /// Run a transaction (made by [`put_if`] or [`delete_if`]).
    pub(crate) async fn txn(&self, request: TxnRequest) -> Result<TxnResponse, EtcdError> {
        Ok(self.kv().txn(request).await?.into_inner())
    }

    /// Grant a lease of `ttl` seconds; its id.
    pub(crate) async fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let request = LeaseGrantRequest { ttl, id: 0 };
        Ok(self.lease().lease_grant(request).await?.into_inner().id)
    }

    /// Revoke lease `id`: every key attached to it is deleted.
    pub(crate) async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.lease().lease_revoke(LeaseRevokeRequest { id }).await?;
        Ok(())
    }

    /// The seconds lease `id` has left (-1 when etcd no longer has it).
    pub(crate) async fn time_to_live(&self, id: i64) -> Result<i64, EtcdError> {
        let request = LeaseTimeToLiveRequest { id, keys: false };
        Ok(self
            .lease()
            .lease_time_to_live(request)
            .await?
            .into_inner()
            .ttl)
    }

    /// Keep-alives for lease `id`, on a stream opened at the first one.
    pub(crate) fn keep_alive(&self, id: i64) -> KeepAlive {
        KeepAlive::new(self.lease(), id)
    }

    /// Watch every key under `prefix` from revision `start` on.
    pub(crate) async fn watch_prefix(
        &self,
        prefix: Vec<u8>,
        start: i64,
    ) -> Result<WatchStream, EtcdError> {
        WatchStream::open(self.channel.clone(), prefix, start).await
    }
}
