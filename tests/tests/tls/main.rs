//! The mutual-TLS transport (`vmm_core::wire::tls`) with certificates made in the test
//! (`vmm_tests::pki`): a valid pair delivers a descriptor; every wrong certificate, a plaintext
//! client and a stalled handshake are refused inside the handshake with 0 application bytes
//! sent, while the next legitimate importer is still served; the importer refuses a wrong
//! exporter; a proxy that flips a byte or cuts the stream gives a typed error and nothing is
//! delivered; deadlines fire at both ends and fds stay bounded.
//!
//! Where there is no GPU, a stand-in plays the fabric handle: the 64 bytes name the exporter's
//! memfd (`/proc/<pid>/fd/<n>`), which an importer of the same uid opens and maps, so that whoever
//! holds the bytes holds the memory, as with a fabric handle. The valid pair runs the importer in
//! a child process started by vmm-core.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rstest::rstest;
use vmm_core::error::{OptionRule, TlsReason, TlsStep};
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::process::{Context, StartMethod};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::tls::{
    PeerCheck, TlsConnector, TlsIdentity, TlsListener, TlsOptions, spki_sha256,
};
use vmm_core::{Error, Result};
use vmm_tests::pattern;
use vmm_tests::pki::{LeafSpec, Pki, self_signed};
use vmm_tests::turns::exclusive;

mod flood;
mod relay;
mod trust_rules;
mod world;

use relay::{Tamper, relay};
use world::*;

fn child_importer((addr, cert, key, ca): ImporterArgs) {
    import_from(addr.parse().unwrap(), &child_options(&cert, &key, &ca)).unwrap();
}

#[rstest]
#[case::spawn(StartMethod::Spawn)]
#[case::forkserver(StartMethod::Forkserver)]
fn a_valid_pair_delivers_the_descriptor_across_processes(#[case] method: StartMethod) {
    let _turn = exclusive();
    let world = World::new();
    let listener = world.listener();
    let addr = listener.local_addr().unwrap();
    let buf = HostBuffer::new(SIZE).unwrap();
    buf.write_at(0, &pattern(1, SIZE)).unwrap();
    let (descriptor, _fd) = stand_in(&buf);
    let child = Context::new(method)
        .spawn(child_importer, world.child_args(addr))
        .unwrap();
    let mut stream = listener.accept(Some(WAIT)).unwrap();
    let reply = export_on(&mut stream, &descriptor).unwrap();
    assert_eq!(reply, b"matched");
    child.join(WAIT).unwrap();
    assert_eq!(
        buf.to_vec(),
        pattern(2, SIZE),
        "the importer's write is in the memory"
    );
    assert!(listener.refused().is_empty());
}

/// How a refused client is made.
#[derive(Debug, Clone, Copy)]
enum Attacker {
    ForeignCa,
    Expired,
    NotYetValid,
    NoClientAuth,
    Revoked,
    WrongName,
}

#[rstest]
#[case::foreign_ca(Attacker::ForeignCa, TlsReason::UnknownIssuer)]
#[case::expired(Attacker::Expired, TlsReason::Expired)]
#[case::not_yet_valid(Attacker::NotYetValid, TlsReason::NotYetValid)]
#[case::no_client_auth_usage(Attacker::NoClientAuth, TlsReason::WrongUsage)]
#[case::revoked_by_a_crl(Attacker::Revoked, TlsReason::Revoked)]
#[case::right_ca_wrong_name(Attacker::WrongName, TlsReason::NameNotAllowed)]
fn a_refused_importer_gets_nothing_and_the_next_is_served(
    #[case] attacker: Attacker,
    #[case] expected: TlsReason,
) {
    let _turn = exclusive();
    let world = World::new();
    let foreign = Pki::new("foreign");
    let (leaf, pki) = match attacker {
        Attacker::ForeignCa => (foreign.issue(&LeafSpec::new("importer")), &foreign),
        Attacker::Expired => (
            world.pki.issue(&LeafSpec::new("importer").expired()),
            &world.pki,
        ),
        Attacker::NotYetValid => (
            world.pki.issue(&LeafSpec::new("importer").not_yet_valid()),
            &world.pki,
        ),
        Attacker::NoClientAuth => (
            world.pki.issue(&LeafSpec::new("importer").server_only()),
            &world.pki,
        ),
        Attacker::Revoked => (world.pki.issue(&LeafSpec::new("importer")), &world.pki),
        Attacker::WrongName => (world.pki.issue(&LeafSpec::new("intruder")), &world.pki),
    };
    let mut exporter = world.exporter_options();
    if let Attacker::Revoked = attacker {
        let (_, crl) = world.pki.crl(&[&leaf]);
        exporter = exporter.crl_der(crl);
    }
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    let addr = listener.local_addr().unwrap();
    // The attacker trusts the real CA (it knows whom it attacks), and connects first.
    let attack = options(pki, &leaf, names("exporter"));
    let attack = TlsOptions::new(
        TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes()).unwrap(),
        vec![world.pki.ca_der()],
        attack.peer().clone(),
    )
    .unwrap();
    let attacker_thread = try_as_importer(addr, attack);
    let refused = wait_for_refusal(&listener, &attacker_thread);
    assert_eq!(refused, Some(expected));
    let got = attacker_thread.join().unwrap();
    assert!(
        matches!(
            got,
            Err(Error::Tls {
                reason: TlsReason::RefusedByPeer { .. },
                ..
            })
        ),
        "the attacker read no message: {got:?}"
    );
    serve_the_legitimate_importer(&world, &listener);
}

/// Drive the listener until it refused a peer (it must return no stream meanwhile): the
/// refusal's reason.
fn wait_for_refusal<T>(listener: &TlsListener, attacker: &JoinHandle<T>) -> Option<TlsReason> {
    let deadline = Instant::now() + WAIT;
    while listener.refused().is_empty() {
        assert!(Instant::now() < deadline, "no refusal in time");
        match listener.accept(Some(Duration::from_millis(50))) {
            Err(Error::Timeout { .. }) => {}
            Ok(stream) => panic!("the listener admitted {stream:?}"),
            Err(e) => panic!("{e}"),
        }
        if attacker.is_finished() && listener.refused().is_empty() {
            // One more turn, for a refusal the listener has not processed yet.
            continue;
        }
    }
    listener.refused()[0].reason
}

/// The next, legitimate importer is served on the same listener.
fn serve_the_legitimate_importer(world: &World, listener: &TlsListener) {
    serve_importer(listener, world.importer_options());
}

/// An importer with `importer`'s options is served on `listener`.
fn serve_importer(listener: &TlsListener, importer: TlsOptions) {
    let addr = listener.local_addr().unwrap();
    let buf = HostBuffer::new(SIZE).unwrap();
    buf.write_at(0, &pattern(1, SIZE)).unwrap();
    let (descriptor, _fd) = stand_in(&buf);
    let good = std::thread::spawn(move || import_from(addr, &importer));
    let mut stream = listener.accept(Some(WAIT)).unwrap();
    assert_eq!(export_on(&mut stream, &descriptor).unwrap(), b"matched");
    good.join().unwrap().unwrap();
    assert_eq!(buf.to_vec(), pattern(2, SIZE));
}

#[test]
fn a_client_without_a_certificate_is_refused() {
    let _turn = exclusive();
    let world = World::new();
    let listener = world.listener();
    let addr = listener.local_addr().unwrap();
    let attacker = std::thread::spawn(move || no_certificate_client(addr));
    assert_eq!(
        wait_for_refusal(&listener, &attacker),
        Some(TlsReason::NoCertificate)
    );
    let app_bytes = attacker.join().unwrap();
    assert_eq!(
        app_bytes, 0,
        "the client without a certificate read application bytes"
    );
    serve_the_legitimate_importer(&world, &listener);
}

/// A rustls client that presents no certificate and believes any server: how many application
/// bytes it reads before the stream ends.
fn no_certificate_client(addr: SocketAddr) -> usize {
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, SignatureScheme};

    #[derive(Debug)]
    struct Anything;
    impl ServerCertVerifier for Anything {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> std::result::Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            rustls::crypto::ring::default_provider()
                .signature_verification_algorithms
                .supported_schemes()
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(Anything))
    .with_no_client_auth();
    let conn = rustls::ClientConnection::new(
        Arc::new(config),
        ServerName::try_from("exporter.vmm.test").unwrap(),
    )
    .unwrap();
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(WAIT)).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut got = Vec::new();
    let _ = tls.read_to_end(&mut got);
    got.len()
}

#[test]
fn a_plaintext_client_on_the_tls_port_gets_nothing() {
    let _turn = exclusive();
    let world = World::new();
    let listener = world.listener();
    let addr = listener.local_addr().unwrap();
    let attacker = std::thread::spawn(move || {
        let mut tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(WAIT)).unwrap();
        // A peer-protocol message in the clear, as a plain stream would carry it.
        let _ = tcp.write_all(b"\x00VMMI\x02\x00\x06\x00@\x00");
        let mut got = Vec::new();
        let _ = tcp.read_to_end(&mut got);
        got
    });
    assert_eq!(
        wait_for_refusal(&listener, &attacker),
        Some(TlsReason::NotTls)
    );
    let got = attacker.join().unwrap();
    // At most a TLS alert record (content type 21): never an application byte.
    assert!(
        got.is_empty() || got[0] == 21,
        "the plaintext client read {} bytes starting {:02x?}",
        got.len(),
        &got[..got.len().min(8)]
    );
    assert!(!got.windows(4).any(|w| w == b"VMMI"));
    serve_the_legitimate_importer(&world, &listener);
}

#[test]
fn an_spki_pin_admits_the_pinned_key_and_refuses_another() {
    let _turn = exclusive();
    let world = World::new();
    let pin = spki_sha256(&world.importer.cert_der).unwrap();
    let exporter = world
        .exporter_options()
        .peer_check(PeerCheck::spki_sha256([pin]).unwrap());
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    let addr = listener.local_addr().unwrap();
    // Same CA, same name, another key: the pin refuses it.
    let other = world.pki.issue(&LeafSpec::new("importer"));
    let attacker = try_as_importer(addr, options(&world.pki, &other, names("exporter")));
    assert_eq!(
        wait_for_refusal(&listener, &attacker),
        Some(TlsReason::PinMismatch)
    );
    assert!(attacker.join().unwrap().is_err());
    serve_the_legitimate_importer(&world, &listener);
}

#[rstest]
#[case::self_signed(true, TlsReason::UnknownIssuer)]
#[case::wrong_name(false, TlsReason::NameNotAllowed)]
fn the_importer_refuses_a_wrong_exporter(#[case] self_signed_cert: bool, #[case] want: TlsReason) {
    let _turn = exclusive();
    let world = World::new();
    let impostor = if self_signed_cert {
        self_signed(&LeafSpec::new("exporter"))
    } else {
        world.pki.issue(&LeafSpec::new("impostor"))
    };
    let impostor_options = TlsOptions::new(
        TlsIdentity::from_pem(impostor.cert_pem.as_bytes(), impostor.key_pem.as_bytes()).unwrap(),
        vec![world.pki.ca_der()],
        names("importer"),
    )
    .unwrap();
    let listener = TlsListener::bind("127.0.0.1:0", &impostor_options).unwrap();
    let addr = listener.local_addr().unwrap();
    // The impostor's side drives its handshakes and sees the importer leave, never a stream.
    let impostor_side = std::thread::spawn(move || listener.accept(Some(Duration::from_secs(3))));
    let err = import_from(addr, &world.importer_options()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Tls {
                step: TlsStep::Handshake,
                reason,
                ..
            } if reason == want
        ),
        "{err:?}"
    );
    match impostor_side.join().unwrap() {
        Err(Error::Timeout { .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[rstest]
#[case::flipped_byte(Tamper::Flip, TlsReason::Corrupted)]
#[case::cut_stream(Tamper::Cut, TlsReason::Truncated)]
fn a_tampering_proxy_gives_a_typed_error_and_nothing_is_imported(
    #[case] tamper: Tamper,
    #[case] want: TlsReason,
) {
    let _turn = exclusive();
    let world = World::new();
    let listener = world.listener();
    // Pass the whole handshake: tamper with the first application record only. The server's
    // handshake flight is measured on a clean connection first.
    let flight = server_flight_len(&world);
    let (front, relay_thread) = relay(listener.local_addr().unwrap(), tamper, flight + 10);
    let importer = world.importer_options();
    let buf = HostBuffer::new(SIZE).unwrap();
    buf.write_at(0, &pattern(1, SIZE)).unwrap();
    let (descriptor, _fd) = stand_in(&buf);
    let client = std::thread::spawn(move || import_from(front, &importer));
    let mut stream = listener.accept(Some(WAIT)).unwrap();
    let _ = export_on(&mut stream, &descriptor);
    let err = client.join().unwrap().unwrap_err();
    assert!(
        matches!(&err, Error::Tls { step: TlsStep::Read, reason, .. } if *reason == want),
        "{err:?}"
    );
    assert_eq!(
        buf.to_vec(),
        pattern(1, SIZE),
        "nothing was imported or written"
    );
    drop(stream);
    relay_thread.join().unwrap();
}

/// How many bytes the exporter sends before its first application record, on a clean
/// connection (its handshake flight: ServerHello to Finished).
fn server_flight_len(world: &World) -> usize {
    let listener = world.listener();
    let addr = listener.local_addr().unwrap();
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let front_addr = front.local_addr().unwrap();
    let counter = std::thread::spawn(move || {
        let (mut client, _) = front.accept().unwrap();
        let mut server = TcpStream::connect(addr).unwrap();
        let mut up = client.try_clone().unwrap();
        let mut up_to = server.try_clone().unwrap();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut up, &mut up_to);
        });
        server
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut total = 0;
        let mut buf = [0u8; 4096];
        while let Ok(n) = server.read(&mut buf) {
            if n == 0 {
                break;
            }
            client.write_all(&buf[..n]).unwrap();
            total += n;
        }
        total
    });
    let importer = world.importer_options();
    let client = std::thread::spawn(move || TlsConnector::new(&importer)?.connect(front_addr));
    let stream = listener.accept(Some(WAIT)).unwrap();
    let total = counter.join().unwrap();
    drop((stream, client.join()));
    total
}

#[test]
fn a_stalled_handshake_delays_no_one_and_ends_by_its_deadline() {
    let _turn = exclusive();
    let world = World::new();
    let exporter = world
        .exporter_options()
        .handshake_timeout(Duration::from_millis(500));
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    let addr = listener.local_addr().unwrap();
    let baseline = settled_open_fds().unwrap();
    // Ten clients connect first and say nothing.
    let stalled: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // The legitimate importer, behind them, is served before their deadline.
    serve_the_legitimate_importer(&world, &listener);
    // Their deadlines pass: each is dropped, and its fd with it.
    let deadline = Instant::now() + WAIT;
    while listener.refused().len() < 10 {
        assert!(
            Instant::now() < deadline,
            "stalled handshakes were not ended"
        );
        let _ = listener.accept(Some(Duration::from_millis(100)));
    }
    assert!(listener.refused().iter().all(|r| r.reason.is_none()));
    for mut s in stalled {
        let mut byte = [0u8; 1];
        s.set_read_timeout(Some(WAIT)).unwrap();
        assert_eq!(
            s.read(&mut byte).unwrap_or(0),
            0,
            "a stalled client got a byte"
        );
    }
    assert_eq!(settled_open_fds().unwrap(), baseline);
}

#[test]
fn a_silent_server_ends_the_handshake_by_its_deadline() {
    let _turn = exclusive();
    let world = World::new();
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let baseline = settled_open_fds().unwrap();
    let importer = world
        .importer_options()
        .handshake_timeout(Duration::from_millis(300));
    let err = TlsConnector::new(&importer)
        .unwrap()
        .connect(addr)
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    let (held, _) = silent.accept().unwrap();
    drop(held);
    assert_eq!(settled_open_fds().unwrap(), baseline);
}

#[test]
fn a_silent_peer_after_the_handshake_ends_a_read_by_its_deadline() {
    let _turn = exclusive();
    let world = World::new();
    let listener = world.listener();
    let addr = listener.local_addr().unwrap();
    let importer = world.importer_options();
    let client = std::thread::spawn(move || -> Result<()> {
        let mut stream = TlsConnector::new(&importer)?.connect(addr)?;
        StreamReader::new(&mut stream)
            .with_timeout(Some(Duration::from_millis(300)))
            .read_message()
            .map(drop)
    });
    let stream = listener.accept(Some(WAIT)).unwrap();
    let err = client.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    drop(stream);
}

// ---------------------------------------------------------------------------------------------
// The GPU: real fabric handles over mutual TLS.

fn child_fabric_importer((addr, cert, key, ca): ImporterArgs) {
    use vmm_core::cuda::VirtualMemoryBuffer;
    let mut stream = TlsConnector::new(&child_options(&cert, &key, &ca))
        .unwrap()
        .connect(addr.parse::<SocketAddr>().unwrap())
        .unwrap();
    let descriptor = match StreamReader::new(&mut stream).read_message().unwrap() {
        PeerMessage::Descriptor(d) => d.into_fabric().unwrap(),
        PeerMessage::Data(_) => panic!("DATA, not a descriptor"),
    };
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap();
    let matched = vmm_tests::contents(&buf) == pattern(1, buf.size());
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
    let reply: &[u8] = if matched { b"matched" } else { b"NOT matched" };
    StreamWriter::new(&mut stream).write_data(reply).unwrap();
}

#[rstest]
#[case::spawn(StartMethod::Spawn)]
#[case::forkserver(StartMethod::Forkserver)]
fn a_real_fabric_handle_crosses_mutual_tls_to_a_child(#[case] method: StartMethod) {
    use vmm_core::cuda::{Device, HandleType, ResourceOptions, VirtualMemoryResource};
    if !vmm_core::testing::skip_unless(vmm_core::testing::cuda_fabric()) {
        return;
    }
    let _turn = exclusive();
    let world = World::new();
    let resource = VirtualMemoryResource::new(
        &Device::new(0).unwrap(),
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )
    .unwrap();
    let buf = resource.allocate(4 << 20).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    let listener = world.listener();
    let addr = listener.local_addr().unwrap();
    let child = Context::new(method)
        .spawn(child_fabric_importer, world.child_args(addr))
        .unwrap();
    let mut stream = listener.accept(Some(WAIT)).unwrap();
    StreamWriter::new(&mut stream)
        .write_descriptor(&buf.export_fabric().unwrap())
        .unwrap();
    match StreamReader::new(&mut stream)
        .with_timeout(Some(WAIT))
        .read_message()
        .unwrap()
    {
        PeerMessage::Data(reply) => assert_eq!(reply, b"matched"),
        PeerMessage::Descriptor(_) => panic!("a descriptor, not a reply"),
    }
    child.join(WAIT).unwrap();
    // The buffer was kept until the reply: the child's write is in it.
    assert_eq!(vmm_tests::contents(&buf), pattern(2, buf.size()));
}

#[test]
fn options_no_handshake_could_use_are_refused_up_front() {
    let world = World::new();
    let refused = |options: TlsOptions, want: OptionRule| {
        let accept = TlsListener::bind("127.0.0.1:0", &options).unwrap_err();
        let connect = TlsConnector::new(&options).unwrap_err();
        for err in [accept, connect] {
            assert!(
                matches!(err, Error::InvalidOption { rule, .. } if rule == want),
                "{err:?}"
            );
        }
    };
    // A peer check built by hand: no name, no pin, or a name that is none.
    refused(
        world
            .exporter_options()
            .peer_check(PeerCheck::Names(vec![])),
        OptionRule::Missing,
    );
    refused(
        world
            .exporter_options()
            .peer_check(PeerCheck::SpkiSha256(vec![])),
        OptionRule::Missing,
    );
    refused(
        world
            .exporter_options()
            .peer_check(PeerCheck::Names(vec!["not a name!".into()])),
        OptionRule::Form,
    );
    refused(
        world.exporter_options().handshake_timeout(Duration::ZERO),
        OptionRule::Range,
    );
    assert!(matches!(
        PeerCheck::names(Vec::<String>::new()),
        Err(Error::InvalidOption {
            rule: OptionRule::Missing,
            ..
        })
    ));
    assert!(matches!(
        TlsOptions::new(
            TlsIdentity::from_der(
                vec![world.exporter.cert_der.clone()],
                world.exporter.key_der.clone()
            )
            .unwrap(),
            vec![],
            names("importer"),
        ),
        Err(Error::InvalidOption {
            rule: OptionRule::Missing,
            ..
        })
    ));
}

#[test]
fn duration_max_handshake_and_message_timeouts_mean_no_limit() {
    let _turn = exclusive();
    let world = World::new();
    let exporter = world
        .exporter_options()
        .handshake_timeout(Duration::MAX)
        .message_timeout(Some(Duration::MAX));
    let listener = TlsListener::bind("127.0.0.1:0", &exporter).unwrap();
    let importer = world
        .importer_options()
        .handshake_timeout(Duration::MAX)
        .message_timeout(Some(Duration::MAX));
    let addr = listener.local_addr().unwrap();
    let client = std::thread::spawn(move || -> Result<Vec<u8>> {
        let mut stream = TlsConnector::new(&importer)?.connect(addr)?;
        match StreamReader::new(&mut stream)
            .with_timeout(Some(Duration::MAX))
            .read_message()?
        {
            PeerMessage::Data(bytes) => Ok(bytes),
            PeerMessage::Descriptor(_) => Err(Error::Protocol {
                rule: vmm_core::error::ProtocolRule::UnexpectedKind,
                message: "a descriptor, not DATA".into(),
            }),
        }
    });
    let mut stream = listener.accept(Some(WAIT)).unwrap();
    StreamWriter::new(&mut stream)
        .with_timeout(Some(Duration::MAX))
        .write_data(b"no limit")
        .unwrap();
    assert_eq!(client.join().unwrap().unwrap(), b"no limit");
}
