//! Certificates made in the test (rcgen), after vmm-tests' `pki` module: a CA and the
//! leaves it issues. Every leaf carries `<name>.vmm.test` (and 127.0.0.1) as
//! subject-alternative names and `<name>` as its common name (the name etcd takes as the
//! user, once RBAC is on).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

/// The DNS name a leaf called `name` carries.
pub fn dns_name(name: &str) -> String {
    format!("{name}.vmm.test")
}

/// A certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Leaf {
    /// Write `<dir>/<file>.pem` and `<dir>/<file>.key`; their paths.
    pub fn write(&self, dir: &Path, file: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{file}.pem"));
        let key = dir.join(format!("{file}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("write a certificate");
        std::fs::write(&key, &self.key_pem).expect("write a key");
        (cert, key)
    }
}

/// A certificate authority made for one test.
#[derive(Debug)]
pub struct Pki {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    /// A new CA called `label`, valid from a day ago for ten days.
    pub fn new(label: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("vmm-registry test CA {label}"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::days(1);
        params.not_after = now + Duration::days(10);
        let key = KeyPair::generate().expect("a CA key");
        Pki {
            issuer: CertifiedIssuer::self_signed(params, key).expect("a CA certificate"),
        }
    }

    /// The CA's certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf called `name`, for client and server authentication, valid from an hour ago
    /// for a day.
    pub fn issue(&self, name: &str) -> Leaf {
        let mut params = CertificateParams::new(vec![dns_name(name), "127.0.0.1".to_owned()])
            .expect("valid names");
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name.to_owned());
        params.distinguished_name = dn;
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + Duration::days(1);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ClientAuth,
            ExtendedKeyUsagePurpose::ServerAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("a leaf certificate");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// The DER bytes of the first PEM block in `pem`.
pub fn pem_der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .expect("a PEM certificate")
        .to_vec()
}
