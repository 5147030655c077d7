//! Mutual TLS with etcd, refused both ways: a client whose certificate etcd does not trust,
//! a client with none, and an etcd whose certificate the client does not trust (a rogue one,
//! or one that speaks plaintext) each end in a TLS error, and nothing is retried in
//! plaintext (a retry would have succeeded against the plaintext etcd).

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use vmm_registry::{Op, Registry, RegistryConfig, RegistryError, TlsFailure, TlsMaterial};

use support::etcd::{Etcd, TempDir, etcd_or_skip};
use support::{DOMAIN, SERVER, World, etcd_tls, issue, material};
use vmm_tests::pki::{Pki, dns_name, pem_to_der};

/// alice's config against `endpoint`, with `pki`'s CA and a certificate of alice's it issued,
/// expecting etcd's certificate to name `server`.
fn config(endpoint: String, pki: &Pki, server: &str) -> RegistryConfig {
    config_with(endpoint, material(pki, "alice", server))
}

fn config_with(endpoint: String, material: TlsMaterial) -> RegistryConfig {
    RegistryConfig::new([endpoint], material, DOMAIN, "alice").open_timeout(Duration::from_secs(3))
}

/// `Err(Tls { op: Open })`, or a panic naming what came instead.
fn expect_tls(result: Result<Registry, RegistryError>) -> TlsFailure {
    match result {
        Err(RegistryError::Tls {
            op: Op::Open,
            source,
        }) => source,
        other => panic!("expected a TLS error at open, got {other:?}"),
    }
}

#[test]
fn a_client_certificate_etcd_does_not_trust_is_a_tls_error() {
    let Some(world) = World::start("a_client_certificate_etcd_does_not_trust_is_a_tls_error")
    else {
        return;
    };
    // Signed by another CA, same name.
    let foreign = issue(&Pki::new("foreign"), "alice");
    let material = TlsMaterial::from_pem(
        world.pki.ca_pem(),
        foreign.cert_pem,
        foreign.key_pem,
        dns_name(SERVER),
    );
    // etcd refuses it with an alert (which TLS 1.3 delivers after our handshake finished).
    let error = expect_tls(Registry::open(config_with(world.etcd.endpoint(), material)));
    assert!(
        matches!(error, TlsFailure::Rustls(rustls::Error::AlertReceived(_))),
        "{error:?}"
    );
    // The same etcd admits a client whose certificate its CA signed.
    Registry::open(world.config("alice")).expect("a trusted client opens");
}

#[test]
fn a_rogue_etcd_with_a_foreign_certificate_is_a_tls_error() {
    let Some(binary) = etcd_or_skip("a_rogue_etcd_with_a_foreign_certificate_is_a_tls_error")
    else {
        return;
    };
    // The rogue etcd's certificate carries the right name, from a CA the client never trusted.
    let ours = Pki::new("ours");
    let rogue_ca = Pki::new("rogue");
    let dir = TempDir::new("rogue");
    let rogue = Etcd::start(&binary, Some(etcd_tls(&rogue_ca, &dir)), None);
    let error = expect_tls(Registry::open(config(rogue.endpoint(), &ours, SERVER)));
    assert!(
        matches!(
            error,
            TlsFailure::Rustls(rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer
            ))
        ),
        "{error:?}"
    );
}

#[test]
fn an_etcd_certificate_of_another_name_is_a_tls_error() {
    let Some(world) = World::start("an_etcd_certificate_of_another_name_is_a_tls_error") else {
        return;
    };
    let error = expect_tls(Registry::open(config(
        world.etcd.endpoint(),
        &world.pki,
        "not-etcd",
    )));
    assert!(
        matches!(
            error,
            TlsFailure::Rustls(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                    | rustls::CertificateError::NotValidForNameContext { .. }
            ))
        ),
        "{error:?}"
    );
}

#[test]
fn a_plaintext_etcd_is_never_spoken_to_in_plaintext() {
    let Some(binary) = etcd_or_skip("a_plaintext_etcd_is_never_spoken_to_in_plaintext") else {
        return;
    };
    let plaintext = Etcd::start(&binary, None, None);
    let pki = Pki::new("plain");
    let error = expect_tls(Registry::open(config(plaintext.endpoint(), &pki, SERVER)));
    assert!(
        matches!(error, TlsFailure::Rustls(_) | TlsFailure::Closed(_)),
        "{error:?}"
    );
    // A scheme in an endpoint (`http://` above all) is refused before any connection.
    assert!(matches!(
        Registry::open(config(
            format!("http://{}", plaintext.endpoint()),
            &pki,
            SERVER
        )),
        Err(RegistryError::Config(vmm_registry::ConfigError::Endpoint(
            _
        )))
    ));
}

#[test]
fn a_client_without_a_certificate_is_refused_by_etcd() {
    let Some(world) = World::start("a_client_without_a_certificate_is_refused_by_etcd") else {
        return;
    };
    // rustls itself, with no client certificate: the handshake may finish on the client's
    // side (TLS 1.3), but etcd refuses before any application byte.
    let mut roots = rustls::RootCertStore::empty();
    let ca = rustls::pki_types::CertificateDer::from(pem_to_der(&world.pki.ca_pem()));
    roots.add(ca).expect("the CA");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(dns_name(SERVER)).expect("a name");
    let connection = rustls::ClientConnection::new(Arc::new(tls), name).expect("a client");
    let tcp = TcpStream::connect(world.etcd.endpoint()).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let wrote = stream.write_all(preface).and_then(|()| stream.flush());
    let mut buf = [0u8; 64];
    let read = wrote.and_then(|()| stream.read(&mut buf));
    let error = match read {
        Err(e) => e,
        Ok(n) => panic!("etcd answered a client without a certificate ({n} bytes)"),
    };
    let tls_error = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .unwrap_or_else(|| panic!("expected a TLS alert, got {error:?}"));
    assert!(
        matches!(tls_error, rustls::Error::AlertReceived(_)),
        "{tls_error:?}"
    );
    // Through the registry's API no client exists without a certificate: TlsMaterial always
    // carries one.
}
