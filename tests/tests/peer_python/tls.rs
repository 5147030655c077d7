//! Mutual TLS in the Python peer (`tls_listen`, `tls_connect`, `TlsConfig` in
//! `python/vmm_ipc_peer/`): the certificates are made here with [`vmm_tests::pki`] (a CA,
//! valid leaves, expired, not yet valid, server-only, revoked by a CRL, of another name, of a
//! foreign CA, self-signed) into a temporary directory, and `python/tests/test_vmm_ipc_tls.py`
//! runs against them (the directory in `VMM_TLS_CERTS`): a valid pair delivers a fabric
//! descriptor and DATA; every refused client gets 0 application bytes and the next one is
//! served; the client refuses a self-signed or wrongly named server; a byte flipped or the
//! stream cut by a relay is a typed error; deadlines at both ends; the attacker that connects
//! first gets nothing; 200 to 400 stalled connections, and another process flooding the
//! listener, keep no importer from being served (19 of 20 at least).
//!
//! To run the Python tests by hand: `VMM_TLS_CERTS=DIR cargo test -p vmm-tests --test
//! peer_python -- --ignored write_tls_test_certificates` writes the files to DIR, then
//! `VMM_TLS_CERTS=DIR python3 -m unittest test_vmm_ipc_tls` in `python/tests` (with `python/`
//! on `PYTHONPATH`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout};

use rcgen::KeyUsagePurpose;
use vmm_core::testing::skip_unless;
use vmm_core::wire::tls::MAX_INTERMEDIATES;
use vmm_tests::endpoint::finish;
use vmm_tests::pki::{LeafSpec, Pki, self_signed};
use vmm_tests::turns::exclusive;
use vmm_tests::{PythonDir, pattern, text};

use super::{TIMEOUT, finish_ok, finish_ok_after, python, python_dir, python3, role};

/// The files `test_vmm_ipc_tls.py` expects in `dir` (each leaf as `<file>.pem` and
/// `<file>.key`). Leaves that must be refused for one reason carry the allowed name, so that
/// nothing else refuses them.
pub fn write_certificates(dir: &Path) {
    let ca = Pki::new("python-tls");
    ca.write_ca(dir, "ca");
    ca.issue(&LeafSpec::new("server")).write(dir, "server");
    ca.issue(&LeafSpec::new("client")).write(dir, "client");
    ca.issue(&LeafSpec::new("client").expired())
        .write(dir, "expired");
    ca.issue(&LeafSpec::new("client").not_yet_valid())
        .write(dir, "notyet");
    ca.issue(&LeafSpec::new("client").server_only())
        .write(dir, "serveronly");
    ca.issue(&LeafSpec::new("intruder")).write(dir, "wrongname");
    ca.issue(&LeafSpec::new("other")).write(dir, "otherserver");
    let revoked = ca.issue(&LeafSpec::new("client"));
    revoked.write(dir, "revoked");
    let (crl, _) = ca.crl(&[&revoked]);
    std::fs::write(dir.join("crl.pem"), crl).unwrap();
    let foreign = Pki::new("foreign");
    foreign.write_ca(dir, "foreign-ca");
    foreign
        .issue(&LeafSpec::new("client"))
        .write(dir, "foreign");
    self_signed(&LeafSpec::new("server")).write(dir, "selfsigned");
    write_trust_rule_attacks(&ca, dir);
}

/// The attacks on the trust rules (`TrustRules` in `test_vmm_ipc_tls.py`; Rust runs the same
/// in `tests/tests/tls/trust_rules.rs`): leaves named `client` that break one rule each, and
/// the CRL files that go with them. Each `.pem` holds the leaf and its intermediates.
fn write_trust_rule_attacks(ca: &Pki, dir: &Path) {
    let client = || LeafSpec::new("client");
    let write_crls = |file: &str, crls: &[String]| {
        std::fs::write(dir.join(format!("{file}.pem")), crls.concat()).unwrap();
    };
    // Whole-chain revocation: the root's CRL revokes the intermediate, not the leaf.
    let revoked_sub = ca.intermediate("revoked");
    revoked_sub.issue(&client()).write(dir, "revokedsub");
    write_crls(
        "crl-revokedsub",
        &[
            ca.crl_revoking_cas(&[&revoked_sub]).0,
            revoked_sub.crl(&[]).0,
        ],
    );
    // A CA of the chain without a CRL: only the intermediate's is given, not the root's.
    let unlisted_sub = ca.intermediate("no CRL above");
    unlisted_sub.issue(&client()).write(dir, "nocrlabove");
    write_crls("crl-subonly", &[unlisted_sub.crl(&[]).0]);
    // A CRL past its nextUpdate (the valid client is the attacker); beside a current one of
    // the same CA, it refuses no one.
    write_crls("crl-stale", &[ca.stale_crl().0]);
    write_crls("crl-stale-then-current", &[ca.stale_crl().0, ca.crl(&[]).0]);
    // Of two current CRLs of one CA, the newer decides: it revokes `newlyrevoked`.
    let newly_revoked = ca.issue(&client());
    newly_revoked.write(dir, "newlyrevoked");
    write_crls(
        "crl-older-then-newer",
        &[
            ca.crl_issued(&[], time::Duration::hours(3)).0,
            ca.crl_issued(&[&newly_revoked], time::Duration::hours(1)).0,
        ],
    );
    // keyUsage: issuers without keyCertSign (an intermediate; a root trusted besides `ca`);
    // leaves without digitalSignature.
    ca.intermediate_with_usages(
        "no keyCertSign",
        vec![KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature],
    )
    .issue(&client())
    .write(dir, "nocertsign");
    let no_cert_sign_root = Pki::root_with_usages(
        "no keyCertSign",
        vec![KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature],
    );
    no_cert_sign_root
        .issue(&client())
        .write(dir, "nocertsignroot");
    std::fs::write(
        dir.join("ca-and-nocertsignroot.pem"),
        format!("{}{}", ca.ca_pem(), no_cert_sign_root.ca_pem()),
    )
    .unwrap();
    ca.issue(&client().key_usages(vec![KeyUsagePurpose::KeyAgreement]))
        .write(dir, "keyagreement");
    ca.issue(&client().key_usages(vec![])).write(dir, "noku");
    // A CA leaf.
    ca.issue(&client().ca_leaf()).write(dir, "caleaf");
    // Depth: at the limit (with a CRL of every CA of the chain) and one over.
    let mut cas = vec![ca.intermediate("level 1")];
    for n in 2..=MAX_INTERMEDIATES {
        let next = cas.last().unwrap().intermediate(&format!("level {n}"));
        cas.push(next);
    }
    cas.last()
        .unwrap()
        .issue(&client())
        .write(dir, "depthlimit");
    let mut crls = vec![ca.crl(&[]).0];
    crls.extend(cas.iter().map(|ca| ca.crl(&[]).0));
    write_crls("crl-depthlimit", &crls);
    cas.last()
        .unwrap()
        .intermediate("one over")
        .issue(&client())
        .write(dir, "depthover");
    // A wildcard name where `client.vmm.test` is allowed.
    ca.issue(&client().dns_names(&["*.vmm.test"]))
        .write(dir, "wildcard");
}

/// The Python files and the certificates of [`write_certificates`] in `<dir>/certs`.
pub fn python_with_certificates() -> (PythonDir, PathBuf) {
    let py = python_dir();
    let certs = py.0.join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    write_certificates(&certs);
    (py, certs)
}

/// The address a `tls-export` role listens on (its first `LISTENING HOST:PORT` line), and the
/// rest of its output.
pub fn listening_address(exporter: &mut Child) -> (String, BufReader<ChildStdout>) {
    let mut stdout = BufReader::new(exporter.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("LISTENING ") {
        line.clear();
        assert_ne!(stdout.read_line(&mut line).unwrap(), 0, "the exporter died");
    }
    let address = line.trim().strip_prefix("LISTENING ").unwrap().to_owned();
    (address, stdout)
}

/// `python3` can run here with an `ssl` module that speaks TLS 1.3.
pub fn python3_tls() -> Result<(), String> {
    python3().and_then(|()| {
        vmm_tests::python3_can(
            "import ssl; assert ssl.HAS_TLSv1_3",
            "python3 has no ssl module with TLS 1.3",
        )
    })
}

#[test]
fn python_mutual_tls() {
    // Starts processes and threads and times deadlines: one at a time.
    let _turn = exclusive();
    if !skip_unless(python3_tls()) {
        return;
    }
    let (py, certs) = python_with_certificates();
    let output = python(&py, &["-m", "unittest", "-v", "test_vmm_ipc_tls"])
        .env("VMM_TLS_CERTS", &certs)
        .output()
        .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("\nOK"), "{out}");
    assert!(
        !out.contains("skipped"),
        "no TLS test may skip here:\n{out}"
    );
    for test in [
        "test_a_valid_pair_delivers_a_descriptor_and_data",
        "test_refused_clients_get_nothing_and_the_next_is_served",
        "test_the_client_refuses_a_self_signed_or_wrongly_named_server",
        "test_a_relay_that_flips_a_byte_or_cuts_the_stream",
        "test_deadlines_at_both_ends",
        "test_the_attacker_that_connects_first_gets_nothing",
        "test_a_trust_rule_refuses_its_attack",
        "test_a_chain_at_the_depth_limit_is_served",
        "test_a_wildcard_is_no_allowed_name",
        "test_the_newest_current_crl_of_a_ca_decides",
        "test_200_stalled_handshakes_delay_no_importer",
        "test_a_flooding_process_starves_no_importer",
        "test_a_client_that_sent_its_hello_keeps_its_place_before_newer_stallers",
        "test_stallers_from_one_address_end_their_own_handshakes_first",
    ] {
        assert!(out.contains(test), "{test} did not run:\n{out}");
    }
}

/// The roles the Rust TLS transport will be tested against (`peer_roles.py tls-export` and
/// `tls-import`, documented there), run against each other: an intruder with a valid chain
/// but another name is refused and reads no handle; the importer prints exactly the handles
/// the exporter was given.
#[test]
fn python_tls_roles_exchange_given_handles() {
    let _turn = exclusive();
    if !skip_unless(python3_tls()) {
        return;
    }
    let (py, certs) = python_with_certificates();
    let certs = certs.to_str().unwrap();
    let hex = |bytes: Vec<u8>| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let handles = format!("{},{}", hex(pattern(1, 64)), hex(pattern(2, 64)));
    let mut exporter = role(
        &py,
        "tls-export",
        &["127.0.0.1:0", certs, "server", "client.vmm.test", &handles],
    );
    let (address, stdout) = listening_address(&mut exporter);
    let intruder = role(
        &py,
        "tls-import",
        &[&address, certs, "wrongname", "server.vmm.test"],
    );
    let (output, out) = finish(intruder, None, TIMEOUT);
    assert!(!output.status.success(), "the intruder was served:\n{out}");
    assert!(
        !out.contains("HANDLES") && out.contains("PeerClosed"),
        "{out}"
    );
    let importer = role(
        &py,
        "tls-import",
        &[&address, certs, "client", "server.vmm.test"],
    );
    let out = finish_ok(importer, TIMEOUT);
    assert!(out.contains(&format!("HANDLES {handles}\n")), "{out}");
    assert!(
        out.contains("DESCRIPTOR chunks=[2097152, 2097152] size=4194304"),
        "{out}"
    );
    let out = finish_ok_after(exporter, TIMEOUT, Some(stdout));
    assert!(
        out.contains("OK exported 2 fabric handle(s) over mutual TLS to client.vmm.test; reply imported (refused 1 before)"),
        "{out}"
    );
}

/// Not a test: writes the certificates to `$VMM_TLS_CERTS`, for running the Python tests by
/// hand (see the module's documentation).
#[test]
#[ignore = "a helper: writes test certificates to $VMM_TLS_CERTS"]
fn write_tls_test_certificates() {
    let dir = std::env::var_os("VMM_TLS_CERTS").expect("VMM_TLS_CERTS names a directory");
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).unwrap();
    write_certificates(dir);
}
