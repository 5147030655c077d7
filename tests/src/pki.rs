//! Certificates made in the test, with explicit validity periods (rcgen): a CA, the leaves it
//! issues (valid, expired, not yet valid, without the client-auth usage, revoked, of another
//! name), its CRL, a foreign CA and self-signed leaves, so that every refusal of the TLS
//! transport is tried against real certificates and nothing is read from the machine.
//!
//! Every leaf names itself in a DNS subject-alternative name (`<name>.vmm.test`, see
//! [`dns_name`]) and in its common name.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, CertifiedIssuer,
    DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair,
    KeyUsagePurpose, RevokedCertParams, SerialNumber,
};
use time::{Duration, OffsetDateTime};

/// The DNS name a leaf called `name` carries: `<name>.vmm.test`.
pub fn dns_name(name: &str) -> String {
    format!("{name}.vmm.test")
}

/// A serial number no other certificate of this process has.
fn next_serial() -> SerialNumber {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut bytes = Vec::with_capacity(12);
    bytes.extend_from_slice(&std::process::id().to_be_bytes());
    bytes.extend_from_slice(&n.to_be_bytes());
    // A positive INTEGER: the first byte's high bit clear.
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

/// What to issue: the name, the validity period and the extended key usages.
#[derive(Debug, Clone)]
pub struct LeafSpec {
    name: String,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    usages: Vec<ExtendedKeyUsagePurpose>,
    key_usages: Vec<KeyUsagePurpose>,
    ca: bool,
    dns_names: Option<Vec<String>>,
}

impl LeafSpec {
    /// A leaf called `name` (SAN `<name>.vmm.test`), valid from an hour ago for a day, for
    /// client and server authentication alike.
    pub fn new(name: &str) -> LeafSpec {
        let now = OffsetDateTime::now_utc();
        LeafSpec {
            name: name.into(),
            not_before: now - Duration::hours(1),
            not_after: now + Duration::days(1),
            usages: vec![
                ExtendedKeyUsagePurpose::ClientAuth,
                ExtendedKeyUsagePurpose::ServerAuth,
            ],
            key_usages: vec![KeyUsagePurpose::DigitalSignature],
            ca: false,
            dns_names: None,
        }
    }

    /// With exactly these `keyUsage` bits (none: no `keyUsage` extension at all) in place of
    /// `digitalSignature`.
    pub fn key_usages(mut self, key_usages: Vec<KeyUsagePurpose>) -> LeafSpec {
        self.key_usages = key_usages;
        self
    }

    /// A CA certificate (`basicConstraints` `cA` true) used as a leaf: it keeps the leaf's
    /// key usages (`digitalSignature`) and extended key usages.
    pub fn ca_leaf(mut self) -> LeafSpec {
        self.ca = true;
        self
    }

    /// With these DNS names as its subject-alternative names in place of [`dns_name`] of its
    /// name (a wildcard such as `*.vmm.test` included).
    pub fn dns_names(mut self, names: &[&str]) -> LeafSpec {
        self.dns_names = Some(names.iter().map(|n| n.to_string()).collect());
        self
    }

    /// Valid for a day that ended an hour ago.
    pub fn expired(mut self) -> LeafSpec {
        let now = OffsetDateTime::now_utc();
        self.not_before = now - Duration::days(2);
        self.not_after = now - Duration::hours(1);
        self
    }

    /// Valid from tomorrow on.
    pub fn not_yet_valid(mut self) -> LeafSpec {
        let now = OffsetDateTime::now_utc();
        self.not_before = now + Duration::days(1);
        self.not_after = now + Duration::days(2);
        self
    }

    /// Server authentication only: no client-auth extended key usage.
    pub fn server_only(mut self) -> LeafSpec {
        self.usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self
    }

    /// Client authentication only.
    pub fn client_only(mut self) -> LeafSpec {
        self.usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self
    }

    fn params(&self, serial: SerialNumber) -> CertificateParams {
        let names = self
            .dns_names
            .clone()
            .unwrap_or_else(|| vec![dns_name(&self.name)]);
        let mut params = CertificateParams::new(names).expect("a valid DNS name");
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, self.name.clone());
        params.distinguished_name = dn;
        params.not_before = self.not_before;
        params.not_after = self.not_after;
        params.serial_number = Some(serial);
        params.key_usages = self.key_usages.clone();
        if self.ca {
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        }
        params.extended_key_usages = self.usages.clone();
        params.use_authority_key_identifier_extension = true;
        params
    }
}

/// A certificate and its private key, as PEM and DER.
#[derive(Debug, Clone)]
pub struct Leaf {
    /// The name it was issued for (its SAN is [`dns_name`] of it).
    pub name: String,
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The certificate and the intermediates above it (nearest first, the root not included),
    /// PEM: what this side presents. Only the certificate for a leaf a root issued.
    pub chain_pem: String,
    /// The private key (PKCS#8), PEM.
    pub key_pem: String,
    /// The certificate, DER.
    pub cert_der: Vec<u8>,
    /// The private key (PKCS#8), DER.
    pub key_der: Vec<u8>,
    serial: SerialNumber,
}

impl Leaf {
    /// A new key, and the certificate `sign` makes of `spec`'s parameters with it.
    fn make(
        spec: &LeafSpec,
        intermediates: &str,
        sign: impl FnOnce(&CertificateParams, &KeyPair) -> Result<rcgen::Certificate, rcgen::Error>,
    ) -> Leaf {
        let key = KeyPair::generate().expect("a leaf key");
        let serial = next_serial();
        let cert = sign(&spec.params(serial.clone()), &key).expect("a leaf certificate");
        Leaf {
            name: spec.name.clone(),
            cert_pem: cert.pem(),
            chain_pem: format!("{}{intermediates}", cert.pem()),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
            serial,
        }
    }

    /// Write `<dir>/<file>.pem` (certificate, then its intermediates: [`chain_pem`]) and
    /// `<dir>/<file>.key` (key); their paths.
    ///
    /// [`chain_pem`]: Leaf::chain_pem
    pub fn write(&self, dir: &Path, file: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{file}.pem"));
        let key = dir.join(format!("{file}.key"));
        std::fs::write(&cert, &self.chain_pem).expect("write a certificate");
        std::fs::write(&key, &self.key_pem).expect("write a key");
        (cert, key)
    }
}

/// A certificate authority made for one test: it issues leaves and revokes them. A root
/// ([`Pki::new`]) or an intermediate ([`Pki::intermediate`]).
#[derive(Debug)]
pub struct Pki {
    issuer: CertifiedIssuer<'static, KeyPair>,
    serial: SerialNumber,
    /// This CA's certificate and the intermediates above it, PEM (empty for a root).
    chain_pem: String,
}

/// The key usages of a CA this module makes by default.
fn ca_key_usages() -> Vec<KeyUsagePurpose> {
    vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ]
}

fn ca_params(label: &str, key_usages: Vec<KeyUsagePurpose>) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("vmm-ipc test CA {label}"));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = key_usages;
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(10);
    params.serial_number = Some(next_serial());
    params.use_authority_key_identifier_extension = true;
    params
}

impl Pki {
    /// A new CA called `label` (its common name), valid from a day ago for ten days.
    pub fn new(label: &str) -> Pki {
        Pki::root_with_usages(label, ca_key_usages())
    }

    /// A new root CA with exactly these `keyUsage` bits (none: no `keyUsage` at all).
    pub fn root_with_usages(label: &str, key_usages: Vec<KeyUsagePurpose>) -> Pki {
        let params = ca_params(label, key_usages);
        let serial = params.serial_number.clone().expect("a serial");
        let key = KeyPair::generate().expect("a CA key");
        Pki {
            issuer: CertifiedIssuer::self_signed(params, key).expect("a CA certificate"),
            serial,
            chain_pem: String::new(),
        }
    }

    /// An intermediate CA called `label` that this CA issues (`keyCertSign`, `cRLSign`,
    /// `digitalSignature`).
    pub fn intermediate(&self, label: &str) -> Pki {
        self.intermediate_with_usages(label, ca_key_usages())
    }

    /// An intermediate CA with exactly these `keyUsage` bits (none: no `keyUsage` at all).
    pub fn intermediate_with_usages(&self, label: &str, key_usages: Vec<KeyUsagePurpose>) -> Pki {
        let params = ca_params(label, key_usages);
        let serial = params.serial_number.clone().expect("a serial");
        let key = KeyPair::generate().expect("a CA key");
        let issuer =
            CertifiedIssuer::signed_by(params, key, &self.issuer).expect("an intermediate");
        let chain_pem = format!("{}{}", issuer.pem(), self.chain_pem);
        Pki {
            issuer,
            serial,
            chain_pem,
        }
    }

    /// A chain of `count` (at least 1) intermediates under this CA, each issuing the next: the
    /// last, which issues leaves.
    pub fn chain_of(&self, count: usize) -> Pki {
        assert!(count >= 1, "a chain of at least one intermediate");
        (1..count).fold(self.intermediate("level 1"), |ca, n| {
            ca.intermediate(&format!("level {}", n + 1))
        })
    }

    /// The CA's certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// The CA's certificate, DER.
    pub fn ca_der(&self) -> Vec<u8> {
        self.issuer.der().to_vec()
    }

    /// Write the CA's certificate to `<dir>/<file>.pem`; its path.
    pub fn write_ca(&self, dir: &Path, file: &str) -> PathBuf {
        let path = dir.join(format!("{file}.pem"));
        std::fs::write(&path, self.ca_pem()).expect("write a CA certificate");
        path
    }

    /// A leaf as `spec` says, signed by this CA (its chain: this CA's intermediates).
    pub fn issue(&self, spec: &LeafSpec) -> Leaf {
        Leaf::make(spec, &self.chain_pem, |params, key| {
            params.signed_by(key, &self.issuer)
        })
    }

    /// This CA's CRL revoking `revoked` (valid from an hour ago for a day), PEM and DER.
    pub fn crl(&self, revoked: &[&Leaf]) -> (String, Vec<u8>) {
        let serials: Vec<SerialNumber> = revoked.iter().map(|l| l.serial.clone()).collect();
        self.crl_of(&serials, false)
    }

    /// This CA's CRL revoking the intermediate CAs `revoked` (which it issued).
    pub fn crl_revoking_cas(&self, revoked: &[&Pki]) -> (String, Vec<u8>) {
        let serials: Vec<SerialNumber> = revoked.iter().map(|ca| ca.serial.clone()).collect();
        self.crl_of(&serials, false)
    }

    /// This CA's CRL revoking nothing, but stale: issued two days ago, its `nextUpdate` an
    /// hour ago.
    pub fn stale_crl(&self) -> (String, Vec<u8>) {
        self.crl_of(&[], true)
    }

    /// This CA's CRL revoking `revoked`, issued `ago` (its `thisUpdate`), its `nextUpdate` a
    /// day from now: of two current CRLs, the one issued later is the newer.
    pub fn crl_issued(&self, revoked: &[&Leaf], ago: Duration) -> (String, Vec<u8>) {
        let serials: Vec<SerialNumber> = revoked.iter().map(|l| l.serial.clone()).collect();
        let now = OffsetDateTime::now_utc();
        self.crl_between(&serials, now - ago, now + Duration::days(1))
    }

    fn crl_of(&self, serials: &[SerialNumber], stale: bool) -> (String, Vec<u8>) {
        let now = OffsetDateTime::now_utc();
        if stale {
            self.crl_between(serials, now - Duration::days(2), now - Duration::hours(1))
        } else {
            self.crl_between(serials, now - Duration::hours(1), now + Duration::days(1))
        }
    }

    fn crl_between(
        &self,
        serials: &[SerialNumber],
        this_update: OffsetDateTime,
        next_update: OffsetDateTime,
    ) -> (String, Vec<u8>) {
        let now = OffsetDateTime::now_utc();
        let params = CertificateRevocationListParams {
            this_update,
            next_update,
            crl_number: next_serial(),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|serial| RevokedCertParams {
                    serial_number: serial.clone(),
                    revocation_time: now - Duration::minutes(30),
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let crl = params.signed_by(&self.issuer).expect("a CRL");
        (crl.pem().expect("a CRL's PEM"), crl.der().to_vec())
    }
}

/// A leaf that signs itself (no CA vouches for it), as `spec` says.
pub fn self_signed(spec: &LeafSpec) -> Leaf {
    Leaf::make(spec, "", |params, key| params.self_signed(key))
}

/// The DER bytes of the first PEM block in `pem`.
pub fn pem_to_der(pem: &str) -> Vec<u8> {
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    decode_base64(&body)
}

fn decode_base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for v in text.bytes().filter_map(value) {
        acc = acc << 6 | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
