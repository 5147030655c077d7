//! What a side of a mutual-TLS stream is configured with: its own certificate and key, the
//! roots and CRLs it trusts, and which peers it admits (by name or by pinned key). Nothing
//! here talks to a network.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};

use crate::error::OptionRule;
use crate::{Error, Result};

/// How long a handshake may take, by default: 10 seconds.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one message may take to read or write, by default: 10 seconds.
pub const DEFAULT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);

/// The most allowed names or pins a [`PeerCheck`] holds (a list that long is a
/// misconfiguration, and each one is tried on every handshake).
pub const MAX_ALLOWED_PEERS: usize = 1024;

/// This side's certificate chain (leaf first) and private key.
#[derive(Clone)]
pub struct TlsIdentity {
    pub(super) chain: Vec<CertificateDer<'static>>,
    pub(super) key: Arc<PrivateKeyDer<'static>>,
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("TlsIdentity")
            .field("certificates", &self.chain.len())
            .finish_non_exhaustive()
    }
}

impl TlsIdentity {
    /// From PEM files: the certificate chain (leaf first; more certificates are intermediates)
    /// and the private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(chain: impl AsRef<Path>, key: impl AsRef<Path>) -> Result<TlsIdentity> {
        TlsIdentity::from_pem(&read(chain.as_ref())?, &read(key.as_ref())?)
    }

    /// From PEM bytes, as [`from_pem_files`](Self::from_pem_files).
    pub fn from_pem(chain: &[u8], key: &[u8]) -> Result<TlsIdentity> {
        let chain = certificates(chain, "tls identity's certificate chain")?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
            Error::option(
                "tls identity's key",
                OptionRule::Form,
                format!("no usable private key in the PEM given ({e})"),
            )
        })?;
        Ok(TlsIdentity {
            chain,
            key: Arc::new(key),
        })
    }

    /// From DER: the certificate chain (leaf first) and a PKCS#8 private key.
    pub fn from_der(chain: Vec<Vec<u8>>, pkcs8_key: Vec<u8>) -> Result<TlsIdentity> {
        if chain.is_empty() {
            return Err(Error::option(
                "tls identity's certificate chain",
                OptionRule::Missing,
                "no certificate: a TLS identity needs at least its own certificate",
            ));
        }
        Ok(TlsIdentity {
            chain: chain.into_iter().map(CertificateDer::from).collect(),
            key: Arc::new(PrivateKeyDer::Pkcs8(pkcs8_key.into())),
        })
    }
}

/// Which peers are admitted once their certificate chains to a trusted root: by a name their
/// certificate carries, or by the SHA-256 of their public key (SPKI pin).
///
/// There is no "any certificate the roots vouch for": whoever a CA vouches for is not
/// necessarily whoever may have the memory, so the admitted peers are always named.
#[derive(Clone, PartialEq, Eq)]
pub enum PeerCheck {
    /// The peer's certificate must carry one of these names as a subject-alternative name
    /// (DNS names or IP addresses), compared whole: a DNS name ignoring ASCII case, and a
    /// wildcard such as `*.example` in the certificate matches nothing (the Python peer's
    /// rule too: `docs/security.md`, "Trust rules").
    Names(Vec<String>),
    /// The SHA-256 of the peer certificate's DER `SubjectPublicKeyInfo` must be one of these
    /// ([`spki_sha256`](super::spki_sha256) computes it from a certificate).
    SpkiSha256(Vec<[u8; 32]>),
}

impl fmt::Debug for PeerCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerCheck::Names(names) => f.debug_tuple("Names").field(names).finish(),
            PeerCheck::SpkiSha256(pins) => write!(f, "SpkiSha256({} pins)", pins.len()),
        }
    }
}

impl PeerCheck {
    /// Admit a peer whose certificate carries one of `names`; refused when empty, over
    /// [`MAX_ALLOWED_PEERS`], or when one is not a DNS name or IP address
    /// ([`Error::InvalidOption`]).
    pub fn names<I, S>(names: I) -> Result<PeerCheck>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let names: Vec<String> = names.into_iter().map(Into::into).collect();
        check_count(names.len())?;
        for name in &names {
            ServerName::try_from(name.as_str()).map_err(|_| {
                Error::option(
                    "tls allowed names",
                    OptionRule::Form,
                    format!("{name:?} is neither a DNS name nor an IP address"),
                )
            })?;
        }
        Ok(PeerCheck::Names(names))
    }

    /// Admit a peer whose public key hashes to one of `pins`; refused when empty or over
    /// [`MAX_ALLOWED_PEERS`] ([`Error::InvalidOption`]).
    pub fn spki_sha256(pins: impl IntoIterator<Item = [u8; 32]>) -> Result<PeerCheck> {
        let pins: Vec<[u8; 32]> = pins.into_iter().collect();
        check_count(pins.len())?;
        Ok(PeerCheck::SpkiSha256(pins))
    }
}

fn check_count(count: usize) -> Result<()> {
    if count == 0 {
        return Err(Error::option(
            "tls peer check",
            OptionRule::Missing,
            "no allowed name or pin: name the peers that may connect (there is no \"any \
             certificate the CA signed\")",
        ));
    }
    if count > MAX_ALLOWED_PEERS {
        return Err(Error::option(
            "tls peer check",
            OptionRule::Range,
            format!("{count} allowed names or pins: at most {MAX_ALLOWED_PEERS}"),
        ));
    }
    Ok(())
}

/// Everything one side of a mutual-TLS stream needs: its identity, the roots (and CRLs) it
/// trusts for its peer's chain, which peers it admits, and its deadlines.
#[derive(Debug, Clone)]
pub struct TlsOptions {
    pub(super) identity: TlsIdentity,
    pub(super) roots: Vec<CertificateDer<'static>>,
    pub(super) crls: Vec<CertificateRevocationListDer<'static>>,
    pub(super) peer: PeerCheck,
    pub(super) handshake_timeout: Duration,
    pub(super) message_timeout: Option<Duration>,
}

impl TlsOptions {
    /// `identity`, trusting the CA certificates `roots` (DER) for the peer's chain, admitting
    /// the peers `peer` names; no CRL, default deadlines. Refused without a root
    /// ([`Error::InvalidOption`]).
    pub fn new(identity: TlsIdentity, roots: Vec<Vec<u8>>, peer: PeerCheck) -> Result<TlsOptions> {
        if roots.is_empty() {
            return Err(Error::option(
                "tls roots",
                OptionRule::Missing,
                "no trusted root: a peer's chain must end at a CA this side names",
            ));
        }
        Ok(TlsOptions {
            identity,
            roots: roots.into_iter().map(CertificateDer::from).collect(),
            crls: Vec::new(),
            peer,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            message_timeout: Some(DEFAULT_MESSAGE_TIMEOUT),
        })
    }

    /// From PEM files: this side's certificate chain and key, and the CA certificates it
    /// trusts (one or more in one file).
    pub fn from_pem_files(
        chain: impl AsRef<Path>,
        key: impl AsRef<Path>,
        roots: impl AsRef<Path>,
        peer: PeerCheck,
    ) -> Result<TlsOptions> {
        let identity = TlsIdentity::from_pem_files(chain, key)?;
        let roots = certificates(&read(roots.as_ref())?, "tls roots")?;
        TlsOptions::new(
            identity,
            roots.into_iter().map(|c| c.to_vec()).collect(),
            peer,
        )
    }

    /// Also refuse peers a CRL (DER) revokes, the leaf or any CA of its chain but the root.
    /// Once any CRL is given, every CA of the peer's chain (the root included) needs a CRL
    /// here: a peer with one whose CRL is missing is refused
    /// ([`TlsReason::RevocationUnknown`](crate::error::TlsReason::RevocationUnknown)), and so
    /// is any peer while a CRL needed is past its `nextUpdate`
    /// ([`TlsReason::CrlExpired`](crate::error::TlsReason::CrlExpired)): fail closed.
    pub fn crl_der(mut self, der: Vec<u8>) -> TlsOptions {
        self.crls.push(der.into());
        self
    }

    /// Also refuse peers the CRLs in the PEM file `path` revoke (see [`crl_der`](Self::crl_der)).
    pub fn crl_pem_file(mut self, path: impl AsRef<Path>) -> Result<TlsOptions> {
        let bytes = read(path.as_ref())?;
        let mut found = 0;
        for crl in CertificateRevocationListDer::pem_slice_iter(&bytes) {
            let crl = crl.map_err(|e| {
                Error::option(
                    "tls CRL",
                    OptionRule::Form,
                    format!("unreadable PEM in the CRL file ({e})"),
                )
            })?;
            self.crls.push(crl);
            found += 1;
        }
        if found == 0 {
            return Err(Error::option(
                "tls CRL",
                OptionRule::Missing,
                "no X509 CRL in the file",
            ));
        }
        Ok(self)
    }

    /// Which peers are admitted.
    pub fn peer_check(mut self, peer: PeerCheck) -> TlsOptions {
        self.peer = peer;
        self
    }

    /// How long a handshake may take (default [`DEFAULT_HANDSHAKE_TIMEOUT`]); zero is
    /// refused when the stream is made.
    pub fn handshake_timeout(mut self, timeout: Duration) -> TlsOptions {
        self.handshake_timeout = timeout;
        self
    }

    /// How long one message may take to read or write, whole (default
    /// [`DEFAULT_MESSAGE_TIMEOUT`]; `None`: no limit).
    pub fn message_timeout(mut self, timeout: Option<Duration>) -> TlsOptions {
        self.message_timeout = timeout;
        self
    }

    /// The admitted peers.
    pub fn peer(&self) -> &PeerCheck {
        &self.peer
    }

    /// Refuse what no handshake could work with: a peer check built by hand with no name or
    /// pin, too many, or a name that is not one; a zero timeout.
    pub(super) fn check(&self) -> Result<()> {
        match &self.peer {
            PeerCheck::Names(names) => {
                PeerCheck::names(names.iter().map(String::as_str))?;
            }
            PeerCheck::SpkiSha256(pins) => {
                check_count(pins.len())?;
            }
        }
        if self.handshake_timeout.is_zero() || self.message_timeout.is_some_and(|t| t.is_zero()) {
            return Err(Error::option(
                "tls timeouts",
                OptionRule::Range,
                "a zero timeout would refuse every handshake or message; use a positive one",
            ));
        }
        Ok(())
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

fn certificates(pem: &[u8], what: &'static str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::option(what, OptionRule::Form, format!("unreadable PEM ({e})")))?;
    if certs.is_empty() {
        return Err(Error::option(
            what,
            OptionRule::Missing,
            "no CERTIFICATE in the PEM given",
        ));
    }
    Ok(certs)
}
