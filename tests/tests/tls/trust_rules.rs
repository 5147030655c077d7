//! The trust rules of `docs/security.md` ("Trust rules"), each run as an attack on the Rust
//! peer: a certificate (or CRL) built to break one rule, presented by a client to a Rust
//! listener, which must refuse it in the handshake with that rule's [`TlsReason`] and then
//! still serve a legitimate importer. The Python peer runs the same attacks
//! (`python/tests/test_vmm_ipc_tls.py`, `TrustRules`), on certificates made by
//! `peer_python::tls::write_certificates`.

use rcgen::KeyUsagePurpose;
use rstest::rstest;
use vmm_core::error::TlsReason;
use vmm_core::wire::tls::{MAX_INTERMEDIATES, TlsIdentity, TlsListener, TlsOptions};
use vmm_tests::pki::{Leaf, LeafSpec, Pki};
use vmm_tests::turns::exclusive;

use super::world::*;
use super::{serve_importer, serve_the_legitimate_importer, wait_for_refusal};

/// One attack: what the exporter is given besides the world's root (and a second root,
/// without `keyCertSign`), and who connects.
#[derive(Debug, Clone, Copy)]
enum Attack {
    /// An intermediate CA its root's CRL revokes issued the client's leaf (the leaf itself
    /// is not revoked): whole-chain revocation.
    RevokedIntermediate,
    /// CRLs are given, but none from the root above the client's intermediate: the
    /// intermediate's status is unknown.
    IntermediateWithoutCrl,
    /// The only CRL given is past its `nextUpdate`.
    StaleCrl,
    /// The client's leaf was issued by an intermediate whose `keyUsage` lacks `keyCertSign`.
    IssuerWithoutKeyCertSign,
    /// The client's leaf was issued by a root, trusted by the exporter, whose `keyUsage`
    /// lacks `keyCertSign`.
    RootWithoutKeyCertSign,
    /// The client's leaf has `keyUsage` without `digitalSignature` (`keyAgreement` only).
    LeafWithoutDigitalSignature,
    /// The client's leaf has no `keyUsage` at all.
    LeafWithoutKeyUsage,
    /// The client's leaf is a CA certificate (`cA` true).
    CaLeaf,
    /// The client's chain has one intermediate more than `MAX_INTERMEDIATES`.
    ChainOneOverTheLimit,
    /// The client's leaf names only `*.vmm.test`; the exporter allows `importer.vmm.test`.
    WildcardName,
}

/// A root the exporter trusts besides the world's, for the attack on a root's key usage.
fn second_root() -> Pki {
    Pki::root_with_usages(
        "no keyCertSign",
        vec![KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature],
    )
}

/// The attacker's leaf (with its chain) and the CRLs the exporter is given.
fn stage(world: &World, attack: Attack, second_root: &Pki) -> (Leaf, Vec<Vec<u8>>) {
    let importer = || LeafSpec::new("importer");
    let root = &world.pki;
    match attack {
        Attack::RootWithoutKeyCertSign => (second_root.issue(&importer()), vec![]),
        Attack::RevokedIntermediate => {
            let sub = root.intermediate("revoked");
            let (_, root_crl) = root.crl_revoking_cas(&[&sub]);
            let (_, sub_crl) = sub.crl(&[]);
            (sub.issue(&importer()), vec![root_crl, sub_crl])
        }
        Attack::IntermediateWithoutCrl => {
            let sub = root.intermediate("no CRL above");
            let (_, sub_crl) = sub.crl(&[]);
            (sub.issue(&importer()), vec![sub_crl])
        }
        Attack::StaleCrl => (root.issue(&importer()), vec![root.stale_crl().1]),
        Attack::IssuerWithoutKeyCertSign => {
            let sub = root.intermediate_with_usages(
                "no keyCertSign",
                vec![KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature],
            );
            (sub.issue(&importer()), vec![])
        }
        Attack::LeafWithoutDigitalSignature => (
            root.issue(&importer().key_usages(vec![KeyUsagePurpose::KeyAgreement])),
            vec![],
        ),
        Attack::LeafWithoutKeyUsage => (root.issue(&importer().key_usages(vec![])), vec![]),
        Attack::CaLeaf => (root.issue(&importer().ca_leaf()), vec![]),
        Attack::ChainOneOverTheLimit => (
            root.chain_of(MAX_INTERMEDIATES + 1).issue(&importer()),
            vec![],
        ),
        Attack::WildcardName => (root.issue(&importer().dns_names(&["*.vmm.test"])), vec![]),
    }
}

#[rstest]
#[case::revoked_intermediate(Attack::RevokedIntermediate, TlsReason::Revoked)]
#[case::intermediate_without_crl(Attack::IntermediateWithoutCrl, TlsReason::RevocationUnknown)]
#[case::stale_crl(Attack::StaleCrl, TlsReason::CrlExpired)]
#[case::issuer_without_key_cert_sign(Attack::IssuerWithoutKeyCertSign, TlsReason::NotAnIssuer)]
#[case::root_without_key_cert_sign(Attack::RootWithoutKeyCertSign, TlsReason::NotAnIssuer)]
#[case::leaf_without_digital_signature(Attack::LeafWithoutDigitalSignature, TlsReason::WrongUsage)]
#[case::leaf_without_key_usage(Attack::LeafWithoutKeyUsage, TlsReason::WrongUsage)]
#[case::ca_leaf(Attack::CaLeaf, TlsReason::CaLeaf)]
#[case::chain_one_over_the_limit(Attack::ChainOneOverTheLimit, TlsReason::ChainTooLong)]
#[case::wildcard_name(Attack::WildcardName, TlsReason::NameNotAllowed)]
fn a_trust_rule_refuses_its_attack(#[case] attack: Attack, #[case] expected: TlsReason) {
    let _turn = exclusive();
    let world = World::new();
    let second_root = second_root();
    let (leaf, crls) = stage(&world, attack, &second_root);
    // The CRLs of these two refuse every peer of this root: no legitimate one is left.
    let no_one_left = matches!(attack, Attack::StaleCrl | Attack::IntermediateWithoutCrl);
    let identity = TlsIdentity::from_pem(
        world.exporter.chain_pem.as_bytes(),
        world.exporter.key_pem.as_bytes(),
    )
    .unwrap();
    let roots = vec![world.pki.ca_der(), second_root.ca_der()];
    let exporter = crls.into_iter().fold(
        TlsOptions::new(identity, roots, names("importer")).unwrap(),
        TlsOptions::crl_der,
    );
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    let addr = listener.local_addr().unwrap();
    let attacker = try_as_importer(addr, options(&world.pki, &leaf, names("exporter")));
    assert_eq!(wait_for_refusal(&listener, &attacker), Some(expected));
    let got = attacker.join().unwrap();
    assert!(got.is_err(), "the attacker read a message: {got:?}");
    if !no_one_left {
        serve_the_legitimate_importer(&world, &listener);
    }
}

/// The depth limit's other side: a chain of exactly `MAX_INTERMEDIATES` intermediates is
/// served, also with a CRL of every CA of its chain given (whole-chain revocation finds each).
#[rstest]
#[case::without_crls(false)]
#[case::with_a_crl_of_every_ca(true)]
fn a_chain_at_the_depth_limit_is_served(#[case] crls: bool) {
    let _turn = exclusive();
    let world = World::new();
    let mut cas = vec![world.pki.intermediate("level 1")];
    for n in 2..=MAX_INTERMEDIATES {
        let next = cas.last().unwrap().intermediate(&format!("level {n}"));
        cas.push(next);
    }
    let leaf = cas.last().unwrap().issue(&LeafSpec::new("importer"));
    let mut exporter = world.exporter_options();
    if crls {
        exporter = exporter.crl_der(world.pki.crl(&[]).1);
        for ca in &cas {
            exporter = exporter.crl_der(ca.crl(&[]).1);
        }
    }
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    serve_importer(&listener, options(&world.pki, &leaf, names("exporter")));
    assert!(listener.refused().is_empty(), "{:?}", listener.refused());
}

/// Of several CRLs of one CA, a current one decides before a stale one, and the newest
/// current one before an older (as OpenSSL chooses): a stale CRL given beside a current one
/// refuses no one, and a revocation in the newer of two current CRLs refuses its leaf.
#[test]
fn the_newest_current_crl_of_a_ca_decides() {
    let _turn = exclusive();
    let world = World::new();
    let root = &world.pki;
    let exporter = world
        .exporter_options()
        .crl_der(root.stale_crl().1)
        .crl_der(root.crl(&[]).1);
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    serve_the_legitimate_importer(&world, &listener);
    assert!(listener.refused().is_empty(), "{:?}", listener.refused());

    let revoked = root.issue(&LeafSpec::new("importer"));
    let older = root.crl_issued(&[], time::Duration::hours(3)).1;
    let newer = root.crl_issued(&[&revoked], time::Duration::hours(1)).1;
    let exporter = world.exporter_options().crl_der(older).crl_der(newer);
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    let addr = listener.local_addr().unwrap();
    let attacker = try_as_importer(addr, options(root, &revoked, names("exporter")));
    assert_eq!(
        wait_for_refusal(&listener, &attacker),
        Some(TlsReason::Revoked)
    );
    assert!(attacker.join().unwrap().is_err());
    serve_the_legitimate_importer(&world, &listener);
}
