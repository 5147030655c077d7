//! The one certificate check both sides make of their peer, inside the handshake: the trust
//! rule set of `docs/security.md` ("Trust rules"), which the Python peer enforces the same:
//!
//! - the chain ends at a trusted root, with at most [`MAX_INTERMEDIATES`] intermediates;
//! - every certificate is in its validity period;
//! - the leaf is no CA (`basicConstraints` `cA` false or absent), carries `keyUsage` with
//!   `digitalSignature`, and the extended key usage of its role;
//! - every issuer of the path (its intermediates and the root) carries `keyUsage` with
//!   `keyCertSign`;
//! - once any CRL is given, every certificate of the path but the root is checked against its
//!   issuer's CRL (the whole chain, not only the leaf); a CA of the path without a CRL here
//!   leaves a status unknown, and a CRL past its `nextUpdate` cannot decide one: both refuse
//!   (fail closed);
//! - then the leaf carries an allowed name, compared whole (a wildcard in the certificate
//!   matches nothing), or a pinned key.
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
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, SignatureScheme,
};
use webpki::{
    CertRevocationList, EndEntityCert, ExpirationPolicy, KeyUsage, OwnedCertRevocationList,
    RevocationCheckDepth, RevocationOptionsBuilder, UnknownStatusPolicy,
};
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;

use super::tls_options::{PeerCheck, TlsOptions};
use crate::error::{OptionRule, TlsReason};
use crate::{Error, Result};

/// The most intermediate certificates a peer's chain may have between its leaf and a trusted
/// root: 6, webpki's own limit, and the Python peer's `MAX_INTERMEDIATES`. One more is
/// refused ([`TlsReason::ChainTooLong`]).
pub const MAX_INTERMEDIATES: usize = 6;

/// A refusal by one of the trust rules webpki has no error of its own for, carried through
/// rustls as `CertificateError::Other` and read back as its [`TlsReason`] by
/// `stream::reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TrustRule(pub(super) TlsReason);

impl fmt::Display for TrustRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for TrustRule {}

/// The rustls error that carries `reason` to the alert and back to [`TlsReason`].
fn refuse(reason: TlsReason) -> rustls::Error {
    CertificateError::Other(OtherError(Arc::new(TrustRule(reason)))).into()
}

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
    /// Per anchor: whether the root may issue (its `keyUsage` has `keyCertSign`).
    anchor_issues: Vec<bool>,
    hints: Vec<DistinguishedName>,
    crls: Vec<CertRevocationList<'static>>,
    /// Per CRL: its `thisUpdate` and `nextUpdate` (Unix seconds), to offer webpki, which
    /// takes the first CRL of an issuer it finds, a current one first and the newest of those
    /// (as OpenSSL chooses among CRLs of one CA).
    crl_times: Vec<(i64, Option<i64>)>,
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
        let mut anchor_issues = Vec::with_capacity(options.roots.len());
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
            anchor_issues.push(may_issue(root.as_ref()));
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
        let crl_times = options
            .crls
            .iter()
            .map(|der| match x509_parser::parse_x509_crl(der.as_ref()) {
                Ok((_, crl)) => Ok((
                    crl.last_update().timestamp(),
                    crl.next_update().map(|t| t.timestamp()),
                )),
                Err(e) => Err(Error::option(
                    "tls CRL",
                    OptionRule::Form,
                    format!("not a usable CRL ({e})"),
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(PeerVerifier {
            anchors,
            anchor_issues,
            hints,
            crls,
            crl_times,
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
        // The leaf's own rules first: webpki refuses a CA leaf too, but untyped.
        let (_, leaf) = x509_parser::parse_x509_certificate(end_entity.as_ref())
            .map_err(|_| rustls::Error::from(CertificateError::BadEncoding))?;
        leaf_rules(&leaf)?;
        let cert = EndEntityCert::try_from(end_entity).map_err(certificate_error)?;
        let usage = match self.role {
            PeerRole::Client => KeyUsage::client_auth(),
            PeerRole::Server => KeyUsage::server_auth(),
        };
        let crls = self.crls_in_order(now);
        let revocation = RevocationOptionsBuilder::new(&crls).ok().map(|builder| {
            builder
                .with_depth(RevocationCheckDepth::Chain)
                .with_status_policy(UnknownStatusPolicy::Deny)
                .with_expiration_policy(ExpirationPolicy::Enforce)
                .build()
        });
        let path = cert
            .verify_for_usage(
                self.algorithms.all,
                &self.anchors,
                intermediates,
                now,
                usage,
                revocation,
                None,
            )
            .map_err(certificate_error)?;
        if path.intermediate_certificates().count() > MAX_INTERMEDIATES {
            return Err(refuse(TlsReason::ChainTooLong));
        }
        for issuer in path.intermediate_certificates() {
            if !may_issue(issuer.der().as_ref()) {
                return Err(refuse(TlsReason::NotAnIssuer));
            }
        }
        let anchor = path.anchor();
        let root = self.anchors.iter().position(|a| {
            a.subject.as_ref() == anchor.subject.as_ref()
                && a.subject_public_key_info.as_ref() == anchor.subject_public_key_info.as_ref()
        });
        if !root.is_some_and(|i| self.anchor_issues[i]) {
            return Err(refuse(TlsReason::NotAnIssuer));
        }
        match &self.check {
            PeerCheck::Names(names) => {
                if !names_match(&leaf, names) {
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

impl PeerVerifier {
    /// The CRLs as webpki should meet them at `now`: current ones first, newest first; then
    /// the stale ones (which refuse, [`TlsReason::CrlExpired`], where no current CRL of the
    /// same CA was given).
    fn crls_in_order(&self, now: UnixTime) -> Vec<&CertRevocationList<'static>> {
        let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
        let mut order: Vec<usize> = (0..self.crls.len()).collect();
        order.sort_by_key(|&i| {
            let (this_update, next_update) = self.crl_times[i];
            (
                next_update.is_some_and(|t| t <= now),
                std::cmp::Reverse(this_update),
            )
        });
        order.into_iter().map(|i| &self.crls[i]).collect()
    }
}

/// The rules of the leaf itself: no CA, and `keyUsage` with `digitalSignature` (the
/// extended key usage of its role is webpki's check).
fn leaf_rules(leaf: &X509Certificate<'_>) -> std::result::Result<(), rustls::Error> {
    let bad = |_| rustls::Error::from(CertificateError::BadEncoding);
    if leaf
        .basic_constraints()
        .map_err(bad)?
        .is_some_and(|bc| bc.value.ca)
    {
        return Err(refuse(TlsReason::CaLeaf));
    }
    match leaf.key_usage().map_err(bad)? {
        Some(ku) if ku.value.digital_signature() => Ok(()),
        _ => Err(refuse(TlsReason::WrongUsage)),
    }
}

/// Whether the certificate `der` may issue others: its `keyUsage` has `keyCertSign` (one
/// without `keyUsage` may not; that it is a CA is webpki's check).
fn may_issue(der: &[u8]) -> bool {
    x509_parser::parse_x509_certificate(der).is_ok_and(|(_, cert)| {
        cert.key_usage()
            .is_ok_and(|ku| ku.is_some_and(|ku| ku.value.key_cert_sign()))
    })
}

/// Whether `leaf` carries one of `allowed` as a subject-alternative name, compared whole: a
/// DNS name ignoring ASCII case (a wildcard such as `*.example` is only itself, and no
/// allowed name is one), an IP address by its bytes.
fn names_match(leaf: &X509Certificate<'_>, allowed: &[String]) -> bool {
    let Ok(Some(san)) = leaf.subject_alternative_name() else {
        return false;
    };
    san.value.general_names.iter().any(|name| match name {
        GeneralName::DNSName(dns) => {
            !dns.contains('*')
                && allowed
                    .iter()
                    .any(|a| a.parse::<std::net::IpAddr>().is_err() && a.eq_ignore_ascii_case(dns))
        }
        GeneralName::IPAddress(bytes) => allowed.iter().any(|a| match a.parse() {
            Ok(std::net::IpAddr::V4(ip)) => ip.octets()[..] == bytes[..],
            Ok(std::net::IpAddr::V6(ip)) => ip.octets()[..] == bytes[..],
            Err(_) => false,
        }),
        _ => false,
    })
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
/// `stream::reason` reads back as a [`TlsReason`]).
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
        W::CrlExpired { .. } => CertificateError::ExpiredRevocationList,
        W::MaximumPathDepthExceeded => return refuse(TlsReason::ChainTooLong),
        W::CaUsedAsEndEntity => return refuse(TlsReason::CaLeaf),
        W::EndEntityUsedAsCa => return refuse(TlsReason::NotAnIssuer),
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
