//! The TLS check opening makes before the registry's etcd channel takes over: one handshake of our own,
//! with the same material, then one read of what etcd sends unprompted.
//!
//! Why: in TLS 1.3 the client's side of the handshake finishes before the server has checked
//! the client's certificate, so an etcd that refuses it answers with an alert after the fact,
//! which HTTP/2 (inside the channel) reduces to a closed connection. Here nothing is written
//! after the handshake, so the alert arrives intact (no reset swallows it) and keeps rustls's
//! own error. An etcd that accepts the certificate speaks first (HTTP/2's server settings,
//! offered by ALPN `h2`), which ends the probe.

use std::io;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::config::TlsMaterial;
use crate::error::{ConfigError, EtcdError, Op, RegistryError, TlsFailure};

/// The rustls client configuration the material describes: its CA as the only root, its
/// certificate and key as the client's identity, TLS 1.2 and 1.3 on ring, ALPN `h2`.
pub(crate) fn client_config(tls: &TlsMaterial) -> Result<rustls::ClientConfig, ConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&tls.ca_pem) {
        roots
            .add(ca.map_err(ConfigError::Pem)?)
            .map_err(ConfigError::Tls)?;
    }
    if roots.is_empty() {
        return Err(ConfigError::Missing("a CA certificate for etcd"));
    }
    let chain = CertificateDer::pem_slice_iter(&tls.cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(ConfigError::Pem)?;
    if chain.is_empty() {
        return Err(ConfigError::Missing("the client's certificate"));
    }
    let key = PrivateKeyDer::from_pem_slice(&tls.key_pem).map_err(ConfigError::Pem)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(ConfigError::Tls)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(ConfigError::Tls)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Check TLS both ways with the first of `endpoints` that accepts a connection. A TLS
/// failure ends the probe at once (never another endpoint, never plaintext); `Unreachable`
/// when none accepts.
pub(crate) async fn probe(endpoints: &[String], tls: &TlsMaterial) -> Result<(), RegistryError> {
    let config = Arc::new(client_config(tls)?);
    let name = ServerName::try_from(tls.server_name.clone())
        .map_err(|_| ConfigError::ServerName(tls.server_name.clone()))?;
    let mut last = None;
    for endpoint in endpoints {
        let tcp = match TcpStream::connect(endpoint.as_str()).await {
            Ok(tcp) => tcp,
            Err(e) => {
                last = Some(e);
                continue;
            }
        };
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let mut stream = connector
            .connect(name.clone(), tcp)
            .await
            .map_err(failure)?;
        let mut first = [0u8; 1];
        return match stream.read(&mut first).await {
            Ok(0) => Err(failure(io::ErrorKind::UnexpectedEof.into())),
            Ok(_) => Ok(()),
            Err(e) => Err(failure(e)),
        };
    }
    Err(RegistryError::Unreachable {
        op: Op::Open,
        source: EtcdError::Connect(last.unwrap_or_else(|| io::ErrorKind::NotConnected.into())),
    })
}

/// A TLS failure from the I/O error tokio-rustls gives (which carries rustls's own error).
fn failure(e: io::Error) -> RegistryError {
    let source = match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => TlsFailure::Rustls(tls.clone()),
        None => TlsFailure::Closed(e.kind()),
    };
    RegistryError::Tls {
        op: Op::Open,
        source,
    }
}
