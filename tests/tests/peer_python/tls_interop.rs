//! Mutual TLS between Rust (`vmm_core::wire::tls`) and the Python peer (`vmm_ipc_peer`'s
//! `tls_listen` / `tls_connect`, driven through `peer_roles.py tls-export` / `tls-import`),
//! both ways, each with an intruder first: a valid chain under another name is refused by the
//! other language's side before a handle byte crosses, and the legitimate peer then gets
//! exactly the handles sent. The handles are stand-ins (the GPU's real ones cross in
//! `fabric_tcp` and the fabric example). And the trust rules (`docs/security.md`) across the
//! languages: each attack certificate of `write_certificates`, presented by one language's
//! peer, is refused by the other's with the same reason.

use std::path::Path;
use std::time::Duration;

use vmm_core::cuda::{FabricDescriptor, FabricHandle};
use vmm_core::error::{ProtocolRule, TlsReason};
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::testing::skip_unless;
use vmm_core::wire::tls::{PeerCheck, TlsConnector, TlsListener, TlsOptions};
use vmm_core::{Error, Result};
use vmm_tests::endpoint::finish;
use vmm_tests::pattern;
use vmm_tests::turns::exclusive;

use super::tls::{listening_address, python_with_certificates, python3_tls};
use super::{TIMEOUT, finish_ok, finish_ok_after, role};

/// Rust's options for the leaf `own` in `dir`, admitting the name `peer`.
fn rust_options(dir: &Path, own: &str, peer: &str) -> TlsOptions {
    TlsOptions::from_pem_files(
        dir.join(format!("{own}.pem")),
        dir.join(format!("{own}.key")),
        dir.join("ca.pem"),
        PeerCheck::names([peer]).unwrap(),
    )
    .unwrap()
}

fn handles() -> Vec<FabricHandle> {
    (0..2)
        .map(|i| {
            let mut bytes = [0u8; 64];
            bytes.copy_from_slice(&pattern(10 + i, 64));
            FabricHandle::from_bytes(bytes)
        })
        .collect()
}

fn hex(handles: &[FabricHandle]) -> String {
    handles
        .iter()
        .map(|h| {
            h.as_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn rust_exporter_to_python_importer_over_mutual_tls() {
    let _turn = exclusive();
    if !skip_unless(python3_tls()) {
        return;
    }
    let (py, certs) = python_with_certificates();
    let listener = TlsListener::bind(
        "127.0.0.1:0",
        &rust_options(&certs, "server", "client.vmm.test"),
    )
    .unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let dir = certs.to_str().unwrap();

    // The intruder: the right CA, another name. Rust refuses it in the handshake.
    let intruder = role(
        &py,
        "tls-import",
        &[&address, dir, "wrongname", "server.vmm.test"],
    );
    let deadline = std::time::Instant::now() + TIMEOUT;
    while listener.refused().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the intruder was not refused"
        );
        match listener.accept(Some(Duration::from_millis(100))) {
            Err(Error::Timeout { .. }) => {}
            other => panic!("the intruder was admitted: {other:?}"),
        }
    }
    assert_eq!(
        listener.refused()[0].reason,
        Some(TlsReason::NameNotAllowed)
    );
    let (output, out) = finish(intruder, None, TIMEOUT);
    assert!(!output.status.success(), "the intruder was served:\n{out}");
    assert!(
        !out.contains("HANDLES"),
        "the intruder read handles:\n{out}"
    );

    // The importer.
    let importer = role(
        &py,
        "tls-import",
        &[&address, dir, "client", "server.vmm.test"],
    );
    let mut stream = listener.accept(Some(TIMEOUT)).unwrap();
    let sent = handles();
    let descriptor =
        FabricDescriptor::from_handles(&sent, &[2 << 20, 2 << 20], 4 << 20, [0x11; 16]).unwrap();
    StreamWriter::new(&mut stream)
        .write_descriptor(&descriptor)
        .unwrap();
    match StreamReader::new(&mut stream)
        .with_timeout(Some(TIMEOUT))
        .read_message()
        .unwrap()
    {
        PeerMessage::Data(reply) => assert_eq!(reply, b"imported"),
        other => panic!("{other:?}"),
    }
    let out = finish_ok(importer, TIMEOUT);
    assert!(out.contains(&format!("HANDLES {}\n", hex(&sent))), "{out}");
}

#[test]
fn python_exporter_to_rust_importer_over_mutual_tls() {
    let _turn = exclusive();
    if !skip_unless(python3_tls()) {
        return;
    }
    let (py, certs) = python_with_certificates();
    let dir = certs.to_str().unwrap();
    let sent = handles();
    let mut exporter = role(
        &py,
        "tls-export",
        &["127.0.0.1:0", dir, "server", "client.vmm.test", &hex(&sent)],
    );
    let (address, stdout) = listening_address(&mut exporter);

    // The intruder: Rust with the right CA and another name. Python refuses it: it reads no
    // message (in TLS 1.3 it learns of the refusal on its first read).
    let intruder = TlsConnector::new(&rust_options(&certs, "wrongname", "server.vmm.test"))
        .unwrap()
        .connect(address.as_str())
        .and_then(|mut stream| StreamReader::new(&mut stream).read_message());
    assert!(
        matches!(
            intruder,
            Err(Error::Tls {
                reason: TlsReason::RefusedByPeer { .. } | TlsReason::Truncated,
                ..
            })
        ),
        "the intruder: {intruder:?}"
    );

    // The importer.
    let imported: Result<Vec<FabricHandle>> = (|| {
        let mut stream = TlsConnector::new(&rust_options(&certs, "client", "server.vmm.test"))?
            .connect(address.as_str())?;
        let descriptor = match StreamReader::new(&mut stream).read_message()? {
            PeerMessage::Descriptor(d) => d.into_fabric()?,
            PeerMessage::Data(_) => {
                return Err(Error::Protocol {
                    rule: ProtocolRule::UnexpectedKind,
                    message: "DATA, not a descriptor".into(),
                });
            }
        };
        StreamWriter::new(&mut stream).write_data(b"imported")?;
        Ok(descriptor.handles().to_vec())
    })();
    assert_eq!(imported.unwrap(), sent);
    let out = finish_ok_after(exporter, TIMEOUT, Some(stdout));
    assert!(out.contains("reply imported (refused 1 before)"), "{out}");
}

/// The trust rules' attacks (`write_trust_rule_attacks`): the client's certificate, the CRL
/// file the listener is given (none for the rules that are no CRL's: a chain that breaks two
/// rules may be refused for either), the reason, and whether a legitimate client is served
/// after.
const TRUST_RULE_ATTACKS: &[(&str, Option<&str>, TlsReason, bool)] = &[
    (
        "revokedsub",
        Some("crl-revokedsub.pem"),
        TlsReason::Revoked,
        true,
    ),
    (
        "nocrlabove",
        Some("crl-subonly.pem"),
        TlsReason::RevocationUnknown,
        false,
    ),
    (
        "client",
        Some("crl-stale.pem"),
        TlsReason::CrlExpired,
        false,
    ),
    ("nocertsign", None, TlsReason::NotAnIssuer, true),
    ("keyagreement", None, TlsReason::WrongUsage, true),
    ("noku", None, TlsReason::WrongUsage, true),
    ("caleaf", None, TlsReason::CaLeaf, true),
    ("depthover", None, TlsReason::ChainTooLong, true),
    ("wildcard", None, TlsReason::NameNotAllowed, true),
];

/// A Python importer presents each attack certificate to a Rust listener: refused with the
/// rule's reason, no handle read.
#[test]
fn rust_refuses_python_peers_that_break_a_trust_rule() {
    let _turn = exclusive();
    if !skip_unless(python3_tls()) {
        return;
    }
    let (py, certs) = python_with_certificates();
    let dir = certs.to_str().unwrap();
    for &(leaf, crl, reason, _) in TRUST_RULE_ATTACKS {
        let mut options = rust_options(&certs, "server", "client.vmm.test");
        if let Some(crl) = crl {
            options = options.crl_pem_file(certs.join(crl)).unwrap();
        }
        let listener = TlsListener::bind("127.0.0.1:0", &options).unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let intruder = role(&py, "tls-import", &[&address, dir, leaf, "server.vmm.test"]);
        let deadline = std::time::Instant::now() + TIMEOUT;
        while listener.refused().is_empty() {
            assert!(std::time::Instant::now() < deadline, "{leaf}: not refused");
            match listener.accept(Some(Duration::from_millis(100))) {
                Err(Error::Timeout { .. }) => {}
                other => panic!("{leaf} ({crl:?}) was admitted: {other:?}"),
            }
        }
        assert_eq!(
            listener.refused()[0].reason,
            Some(reason),
            "{leaf} ({crl:?})"
        );
        let (output, out) = finish(intruder, None, TIMEOUT);
        assert!(
            !output.status.success() && !out.contains("HANDLES"),
            "{leaf}:\n{out}"
        );
    }
}

/// A Rust importer presents each attack certificate to a Python exporter: refused with the
/// rule's reason (the exporter prints it), no message read; then a legitimate Rust importer
/// is served.
#[test]
fn python_refuses_rust_peers_that_break_a_trust_rule() {
    let _turn = exclusive();
    if !skip_unless(python3_tls()) {
        return;
    }
    let (py, certs) = python_with_certificates();
    let dir = certs.to_str().unwrap();
    for &(leaf, crl, reason, served) in TRUST_RULE_ATTACKS.iter().filter(|a| a.3) {
        let mut exporter = super::python(
            &py,
            &[
                "peer_roles.py",
                "tls-export",
                "127.0.0.1:0",
                dir,
                "server",
                "client.vmm.test",
            ],
        )
        // A file that is not there: no CRL.
        .env("VMM_TLS_CRL", crl.unwrap_or("no-crl.pem"))
        .spawn()
        .unwrap();
        let (address, stdout) = listening_address(&mut exporter);
        let intruder = TlsConnector::new(&rust_options(&certs, leaf, "server.vmm.test"))
            .unwrap()
            .connect(address.as_str())
            .and_then(|mut stream| StreamReader::new(&mut stream).read_message());
        assert!(intruder.is_err(), "{leaf} read a message: {intruder:?}");
        assert!(served);
        let mut stream = TlsConnector::new(&rust_options(&certs, "client", "server.vmm.test"))
            .unwrap()
            .connect(address.as_str())
            .unwrap();
        match StreamReader::new(&mut stream).read_message().unwrap() {
            PeerMessage::Descriptor(_) => {}
            other => panic!("{other:?}"),
        }
        StreamWriter::new(&mut stream)
            .write_data(b"imported")
            .unwrap();
        let out = finish_ok_after(exporter, TIMEOUT, Some(stdout));
        assert!(
            out.contains(&format!("REFUSED {reason:?}\n")),
            "{leaf} ({crl:?}): want {reason:?}:\n{out}"
        );
        assert!(out.contains("(refused 1 before)"), "{leaf}:\n{out}");
    }
}
