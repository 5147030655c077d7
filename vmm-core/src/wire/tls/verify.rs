//! The one certificate check both sides make of their peer, inside the handshake: the chain
//! ends at a trusted root, every certificate is in its validity period, the leaf has the
//! extended key usage of its role, no CRL given revokes it, and then the leaf carries an
//! allowed name or a pinned key.
//!
//! Both rustls verifier traits are implemented by one type, so the client's check of the
//! server and the server's check of the client are the same code with the role's key usage.
//! The check runs inside the handshake: a refused peer gets a TLS alert, and the handshake
//! fails before either side has an application byte to send.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use webpki::{
    CertRevocationList, EndEntityCert, KeyUsage, OwnedCertRevocationList, RevocationCheckDepth,
    RevocationOptionsBuilder, UnknownStatusPolicy,
};

use super::tls_options::{PeerCheck, TlsOptions};
use crate::error::OptionRule;
use crate::{Error, Result};

/// Which side's certificate is checked: it decides the extended key usage required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PeerRole {
    /// The peer connected: it needs `clientAuth`.
    Client,
    /// The peer accepted: it needs `serverAuth`.
    Server,
}

pub(super) struct PeerVerifier {
    anchors: Vec<rustls::pki_types::TrustAnchor<'static>>,
    hints: Vec<DistinguishedName>,
    crls: Vec<CertRevocationList<'static>>,
    check: PeerCheck,
    role: PeerRole,
    algorithms: WebPkiSupportedAlgorithms,
}

impl fmt::Debug for PeerVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerVerifier")
            .field("roots", &self.anchors.len())
            .field("crls", &self.crls.len())
            .field("check", &self.check)
            .field("role", &self.role)
            .finish()
    }
}

impl PeerVerifier {
    pub(super) fn new(options: &TlsOptions, role: PeerRole) -> Result<Arc<PeerVerifier>> {
        let mut anchors = Vec::with_capacity(options.roots.len());
        let mut hints = Vec::with_capacity(options.roots.len());
        for root in &options.roots {
            let anchor = webpki::anchor_from_trusted_cert(root).map_err(|e| {
                Error::option(
                    "tls roots",
                    OptionRule::Form,
                    format!("a root is not a usable CA certificate ({e})"),
                )
            })?;
            // DER of the whole Name (its SEQUENCE included), as RFC 8446 sends it: webpki keeps
            // only its contents.
            hints.push(DistinguishedName::in_sequence(anchor.subject.as_ref()));
            anchors.push(anchor.to_owned());
        }
        let crls = options
            .crls
            .iter()
            .map(|der| {
                OwnedCertRevocationList::from_der(der.as_ref())
                    .map(CertRevocationList::from)
                    .map_err(|e| {
                        Error::option(
                            "tls CRL",
                            OptionRule::Form,
                            format!("not a usable CRL ({e})"),
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(PeerVerifier {
            anchors,
            hints,
            crls,
            check: options.peer.clone(),
            role,
            algorithms: rustls::crypto::ring::default_provider().signature_verification_algorithms,
        }))
    }

    /// The whole check of the peer's certificate (see the module docs).
    fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<(), rustls::Error> {
        let cert = EndEntityCert::try_from(end_entity).map_err(certificate_error)?;
        let usage = match self.role {
            PeerRole::Client => KeyUsage::client_auth(),
            PeerRole::Server => KeyUsage::server_auth(),
        };
        let crls: Vec<&CertRevocationList<'_>> = self.crls.iter().collect();
        let revocation = RevocationOptionsBuilder::new(&crls).ok().map(|builder| {
            builder
                .with_depth(RevocationCheckDepth::EndEntity)
                .with_status_policy(UnknownStatusPolicy::Deny)
                .build()
        });
        cert.verify_for_usage(
            self.algorithms.all,
            &self.anchors,
            intermediates,
            now,
            usage,
            revocation,
            None,
        )
        .map_err(certificate_error)?;
        match &self.check {
            PeerCheck::Names(names) => {
                let allowed = names.iter().any(|name| {
                    ServerName::try_from(name.as_str())
                        .is_ok_and(|name| cert.verify_is_valid_for_subject_name(&name).is_ok())
                });
                if !allowed {
                    return Err(CertificateError::NotValidForName.into());
                }
            }
            PeerCheck::SpkiSha256(pins) => {
                let pin = sha256(cert.subject_public_key_info().as_ref());
                if !pins.contains(&pin) {
                    return Err(CertificateError::ApplicationVerificationFailure.into());
                }
            }
        }
        Ok(())
    }
}

/// The SHA-256 of the DER `SubjectPublicKeyInfo` of the certificate `der`: the pin
/// [`PeerCheck::SpkiSha256`] compares (what `openssl x509 -pubkey | openssl pkey -pubin
/// -outform der | sha256sum` prints).
pub fn spki_sha256(der: &[u8]) -> Result<[u8; 32]> {
    let der = CertificateDer::from(der);
    let cert = webpki::EndEntityCert::try_from(&der).map_err(|e| {
        Error::option(
            "certificate",
            OptionRule::Form,
            format!("not a DER X.509 certificate ({e})"),
        )
    })?;
    Ok(sha256(cert.subject_public_key_info().as_ref()))
}

/// SHA-256 of `bytes`.
pub(super) fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// webpki's refusal as the certificate error rustls sends an alert for (and that
/// `stream::reason` reads back as a [`TlsReason`](crate::error::TlsReason)).
fn certificate_error(e: webpki::Error) -> rustls::Error {
    use webpki::Error as W;
    let error = match e {
        W::CertExpired { .. } => CertificateError::Expired,
        W::CertNotValidYet { .. } => CertificateError::NotValidYet,
        W::UnknownIssuer => CertificateError::UnknownIssuer,
        W::CertRevoked => CertificateError::Revoked,
        W::UnknownRevocationStatus => CertificateError::UnknownRevocationStatus,
        W::RequiredEkuNotFoundContext(_) => CertificateError::InvalidPurpose,
        W::CertNotValidForName(_) => CertificateError::NotValidForName,
        W::InvalidSignatureForPublicKey => CertificateError::BadSignature,
        _ => CertificateError::BadEncoding,
    };
    error.into()
}

/// The handshake-signature checks, the same on both sides (rustls asks for them in each of
/// its two verifier traits): the provider's algorithms, nothing of our own.
macro_rules! handshake_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(message, cert, dss, &self.algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(message, cert, dss, &self.algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algorithms.supported_schemes()
        }
    };
}

impl ClientCertVerifier for PeerVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        debug_assert_eq!(self.role, PeerRole::Client);
        self.verify(end_entity, intermediates, now)?;
        Ok(ClientCertVerified::assertion())
    }

    handshake_signatures!();
}

impl ServerCertVerifier for PeerVerifier {
    /// The name the client asked for (SNI) is not what admits the server: the allowed names
    /// (or pins) of this side's [`PeerCheck`] are.
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        debug_assert_eq!(self.role, PeerRole::Server);
        self.verify(end_entity, intermediates, now)?;
        Ok(ServerCertVerified::assertion())
    }

    handshake_signatures!();
}
