//! The typed parts of [`Error::Tls`](super::Error::Tls): which step of a mutual-TLS stream
//! failed and why. They exist whether or not the `tls` feature is on, so that the error type is
//! the same in every build (an error raised in a process built with the feature reaches one
//! built without it as the same variant).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which step of a TLS stream failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TlsStep {
    /// The handshake, the certificate checks included: nothing of the application's was sent.
    Handshake,
    /// Reading a message.
    Read,
    /// Writing a message.
    Write,
}

impl fmt::Display for TlsStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsStep::Handshake => "handshake",
            TlsStep::Read => "read",
            TlsStep::Write => "write",
        })
    }
}

/// Why a TLS stream was refused or broke.
///
/// The certificate reasons say what this side found wrong with the peer's certificate;
/// [`TlsReason::RefusedByPeer`] says the peer found something wrong with ours (or with us).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TlsReason {
    /// The peer presented no certificate.
    NoCertificate,
    /// The peer's certificate does not chain to a trusted root (a foreign CA, a self-signed
    /// certificate).
    UnknownIssuer,
    /// The peer's certificate has expired.
    Expired,
    /// The peer's certificate is not valid yet.
    NotYetValid,
    /// The peer's certificate is revoked by a CRL this side was given.
    Revoked,
    /// The peer's certificate lacks the key usages of its role: `digitalSignature` in its
    /// `keyUsage` (which it must carry), and the extended key usage of its role (client
    /// authentication for the side that connects, server authentication for the side that
    /// accepts).
    WrongUsage,
    /// The certificate chains to a trusted root but names none of the allowed names.
    NameNotAllowed,
    /// The certificate chains to a trusted root but its public key is none of the pinned ones.
    PinMismatch,
    /// The certificate could not be used: malformed, or otherwise refused by the chain check.
    BadCertificate,
    /// The peer refused this side: it sent the TLS alert numbered `alert` (RFC 8446, section
    /// 6: 42 bad certificate, 46 certificate unknown, 48 unknown CA, 116 certificate required,
    /// ...).
    RefusedByPeer {
        /// The alert's number.
        alert: u8,
    },
    /// The peer does not speak TLS (a plaintext client on the TLS port, say).
    NotTls,
    /// A record failed its authentication: the bytes were changed on the way.
    Corrupted,
    /// The stream ended without TLS's closing message: it was cut.
    Truncated,
    /// Another breach of the TLS protocol by the peer.
    Protocol,
    /// A CRL this side was given is past its `nextUpdate`: revocation cannot be decided, so
    /// the peer is refused (fail closed) until a current CRL is given.
    CrlExpired,
    /// CRLs were given, but none from a CA that issued a certificate of the peer's chain:
    /// its revocation status is unknown, so it is refused (fail closed).
    RevocationUnknown,
    /// A certificate that issued another in the peer's chain (an intermediate, or the root)
    /// is not fit to: it lacks `keyCertSign` in its `keyUsage`, or is no CA.
    NotAnIssuer,
    /// The peer's own certificate is a CA certificate (`basicConstraints` `cA` true): a leaf
    /// that could issue certificates is refused.
    CaLeaf,
    /// The peer's chain has more intermediates than `wire::tls::MAX_INTERMEDIATES` (6; the
    /// Python peer's `MAX_INTERMEDIATES` is the same).
    ChainTooLong,
}

impl fmt::Display for TlsReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsReason::NoCertificate => f.write_str("the peer presented no certificate"),
            TlsReason::UnknownIssuer => {
                f.write_str("the peer's certificate does not chain to a trusted root")
            }
            TlsReason::Expired => f.write_str("the peer's certificate has expired"),
            TlsReason::NotYetValid => f.write_str("the peer's certificate is not valid yet"),
            TlsReason::Revoked => f.write_str("the peer's certificate is revoked"),
            TlsReason::WrongUsage => f.write_str(
                "the peer's certificate lacks the key usage of its role (digitalSignature, and \
                 clientAuth for the connecting side, serverAuth for the accepting side)",
            ),
            TlsReason::NameNotAllowed => {
                f.write_str("the peer's certificate names none of the allowed names")
            }
            TlsReason::PinMismatch => {
                f.write_str("the peer's public key is none of the pinned keys")
            }
            TlsReason::BadCertificate => f.write_str("the peer's certificate is unusable"),
            TlsReason::RefusedByPeer { alert } => {
                write!(f, "the peer refused this side (TLS alert {alert})")
            }
            TlsReason::NotTls => f.write_str("the peer does not speak TLS"),
            TlsReason::Corrupted => f.write_str(
                "a record failed its authentication check: the bytes were changed on the way",
            ),
            TlsReason::Truncated => {
                f.write_str("the stream was cut (it ended without TLS's closing message)")
            }
            TlsReason::Protocol => f.write_str("the peer broke the TLS protocol"),
            TlsReason::CrlExpired => f.write_str(
                "a CRL given is past its nextUpdate: revocation cannot be decided (fail closed)",
            ),
            TlsReason::RevocationUnknown => f.write_str(
                "no CRL given from a CA of the peer's chain: its revocation status is unknown",
            ),
            TlsReason::NotAnIssuer => f.write_str(
                "a certificate that issued another in the peer's chain lacks keyCertSign or is \
                 no CA",
            ),
            TlsReason::CaLeaf => f.write_str("the peer's certificate is a CA certificate"),
            TlsReason::ChainTooLong => f.write_str(
                "the peer's chain has more intermediates than the limit (MAX_INTERMEDIATES)",
            ),
        }
    }
}
