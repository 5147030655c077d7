//! The hand-off of a resolved locator over vmm-core's mutual-TLS descriptor stream: the
//! normal path across real processes (publish, watch, fetch, import, acknowledge), a
//! SIGKILLed exporter whose key goes within TTL + 1 s and whose stale locator then fails
//! cleanly, a generation no longer served, a wrong-named exporter or importer refused in the
//! handshake, a descriptor that does not match its locator, and hostile or stalling
//! importers that cost the exporter nothing but their own slot.
//!
//! The memory is the host stand-in (support/stand_in.rs): the descriptor's handle names the
//! exporter's memfd, which the importer opens and maps.

mod support;

use std::io::Read;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use vmm_core::error::TlsReason;
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::wire::tls::TlsConnector;
use vmm_registry::{
    ExportServer, FetchError, MAX_HANDOFF_MESSAGE, MessageError, Outcome, ServeError, Served,
    WatchEvent,
};
use vmm_tests::pki::Pki;

use support::World;
use support::handoff::{
    MESSAGE, SIZE, expect_line, fetch_and_import, fetcher, locator_at, offer, options, server,
    start_exporter,
};

/// Where in-process exporters listen.
fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// The exporter child (see support/handoff.rs); a no-op as a test.
#[test]
fn exporter_child() {
    support::handoff::exporter_child();
}

/// A CA, an exporter called "exporter" serving the stand-in at generation 1 to "importer"
/// only, and what keeps the stand-in's memory named.
struct Exporter {
    pki: Pki,
    server: ExportServer,
    buf: vmm_core::shm::HostBuffer,
    _fd: std::os::fd::OwnedFd,
}

impl Exporter {
    fn start(timeout: Duration) -> Exporter {
        let pki = Pki::new("handoff");
        let server = ExportServer::bind(
            loopback(),
            &options(&pki, "exporter", &["importer"]),
            timeout,
        )
        .expect("serve");
        let (buf, descriptor, fd) = support::stand_in::export(SIZE);
        offer(&server, 1, descriptor);
        Exporter {
            pki,
            server,
            buf,
            _fd: fd,
        }
    }

    fn locator(&self, generation: u64) -> vmm_registry::Locator {
        locator_at("exporter", "exporter", self.server.local_addr(), generation)
    }

    /// The next hand-off the server finished (5 s at most).
    fn served(&self) -> Served {
        self.server
            .next_served(Duration::from_secs(5))
            .expect("a finished hand-off")
    }
}

#[test]
fn publish_watch_fetch_import_acknowledge_across_processes() {
    let Some(world) = World::start("publish_watch_fetch_import_acknowledge_across_processes")
    else {
        return;
    };
    let importer = world.open("importer");
    let watch = importer.watch().expect("watch");
    let exe = std::env::current_exe().expect("the test binary");
    let (mut child, mut lines) = start_exporter(
        Command::new(exe),
        &world.write_material("exporter"),
        &world.etcd.endpoint(),
        loopback(),
    );
    let entry = match watch.next_timeout(Duration::from_secs(5)).expect("watch") {
        Some(WatchEvent::Put(entry)) => entry,
        other => panic!("expected the exporter's put, got {other:?}"),
    };
    assert_eq!(
        (entry.owner.as_str(), entry.name.as_str()),
        ("exporter", "kv")
    );
    fetch_and_import(
        &support::handoff::fetcher(&world.pki, "importer"),
        &entry.locator,
    )
    .expect("fetch, import, acknowledge");
    // The exporter saw the acknowledgement, and our write in its memory.
    assert_eq!(
        expect_line(&mut lines, "acknowledged"),
        "acknowledged pattern-2"
    );
    child.kill().expect("SIGKILL the exporter");
    child.wait().expect("reap it");
}

#[test]
fn a_sigkilled_exporter_goes_within_ttl_plus_one_second_and_its_locator_fails_cleanly() {
    let Some(world) = World::start(
        "a_sigkilled_exporter_goes_within_ttl_plus_one_second_and_its_locator_fails_cleanly",
    ) else {
        return;
    };
    let importer = world.open("importer");
    let exe = std::env::current_exe().expect("the test binary");
    let (mut child, _lines) = start_exporter(
        Command::new(exe),
        &world.write_material("exporter"),
        &world.etcd.endpoint(),
        loopback(),
    );
    let watch = importer.watch().expect("watch");
    let entry = watch.initial().entries[0].clone();
    let fetcher = support::handoff::fetcher(&world.pki, "importer");
    fetch_and_import(&fetcher, &entry.locator).expect("the live exporter serves");

    child.kill().expect("SIGKILL the exporter");
    let killed = Instant::now();
    child.wait().expect("reap it");
    match watch.next_timeout(Duration::from_secs(3)).expect("watch") {
        Some(WatchEvent::Deleted { owner, name, .. }) => {
            assert_eq!((owner.as_str(), name.as_str()), ("exporter", "kv"))
        }
        other => panic!("expected the dead exporter's delete within TTL + 1 s, got {other:?}"),
    }
    assert!(
        killed.elapsed() < Duration::from_secs(3),
        "{:?}",
        killed.elapsed()
    );
    // Whoever still holds the locator gets a typed, stale error, and nothing is mapped.
    let error = fetcher
        .fetch(&entry.locator)
        .expect_err("a dead exporter serves nothing");
    assert!(
        matches!(error, FetchError::ExporterGone { addr, .. } if addr == entry.locator.exporter_addr),
        "{error:?}"
    );
    assert!(error.is_stale());
}

#[test]
fn a_generation_no_longer_served_is_stale() {
    let exporter = Exporter::start(MESSAGE);
    let fetcher = fetcher(&exporter.pki, "importer");
    // The exporter re-exported (generation 2): generation 1's locator is stale.
    let (_buf, descriptor, _fd) = support::stand_in::export(SIZE);
    offer(&exporter.server, 2, descriptor);
    match fetcher.fetch(&exporter.locator(1)) {
        Err(FetchError::Stale {
            wanted: 1,
            serving: Some(2),
            ..
        }) => {}
        other => panic!("expected Stale, got {other:?}"),
    }
    assert!(matches!(
        exporter.served().outcome,
        Outcome::Refused { serving: Some(2) }
    ));
    // Withdrawn: stale too, with nothing served.
    assert!(exporter.server.withdraw(&support::handoff::object()));
    let error = fetcher.fetch(&exporter.locator(2)).expect_err("withdrawn");
    assert!(
        matches!(error, FetchError::Stale { serving: None, .. }),
        "{error:?}"
    );
    assert!(error.is_stale());
}

#[test]
fn an_exporter_of_another_name_is_refused_by_the_importer() {
    // mallory listens where the locator says "exporter" is, with a certificate of the same CA.
    let pki = Pki::new("handoff");
    let mallory = server(&options(&pki, "mallory", &["importer"]), loopback());
    let (_buf, descriptor, _fd) = support::stand_in::export(SIZE);
    offer(&mallory, 1, descriptor);
    let locator = locator_at("exporter", "exporter", mallory.local_addr(), 1);
    match fetcher(&pki, "importer").fetch(&locator) {
        Err(FetchError::Tls {
            reason: TlsReason::NameNotAllowed,
            ..
        }) => {}
        other => panic!("expected the exporter's name refused, got {other:?}"),
    }
    // mallory handed nothing off: the importer ended the handshake.
    assert!(mallory.next_served(Duration::from_millis(500)).is_none());
}

#[test]
fn an_importer_of_another_name_gets_nothing_and_the_next_is_served() {
    let exporter = Exporter::start(MESSAGE);
    match fetcher(&exporter.pki, "intruder").fetch(&exporter.locator(1)) {
        Err(FetchError::Tls {
            reason: TlsReason::RefusedByPeer { .. },
            ..
        }) => {}
        other => panic!("expected a refusal by the exporter, got {other:?}"),
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while exporter.server.refused().is_empty() {
        assert!(Instant::now() < deadline, "no refusal recorded");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        exporter.server.refused()[0].reason,
        Some(TlsReason::NameNotAllowed)
    );
    // Nothing was handed off to the intruder; the importer is served next.
    fetch_and_import(&fetcher(&exporter.pki, "importer"), &exporter.locator(1))
        .expect("the importer is served");
    assert!(matches!(exporter.served().outcome, Outcome::Acknowledged));
    assert_eq!(exporter.buf.to_vec(), vmm_tests::pattern(2, SIZE));
}

#[test]
fn a_descriptor_that_does_not_match_its_locator_is_refused() {
    let exporter = Exporter::start(MESSAGE);
    // A locator announcing twice the size the exporter serves.
    let mut locator = exporter.locator(1);
    locator.size *= 2;
    match fetcher(&exporter.pki, "importer").fetch(&locator) {
        Err(FetchError::Mismatch { what: "size", .. }) => {}
        other => panic!("expected a size mismatch, got {other:?}"),
    }
    // A fabric locator naming another device than the descriptor's owner.
    let mut locator = exporter.locator(1);
    locator.handle = vmm_registry::HandleKind::Fabric;
    locator.device_uuid = Some(vmm_registry::gpu_uuid(&[9; 16]));
    match fetcher(&exporter.pki, "importer").fetch(&locator) {
        Err(FetchError::Mismatch { what: "device", .. }) => {}
        other => panic!("expected a device mismatch, got {other:?}"),
    }
    // A POSIX fd does not cross a network.
    locator.handle = vmm_registry::HandleKind::PosixFd;
    assert!(matches!(
        fetcher(&exporter.pki, "importer").fetch(&locator),
        Err(FetchError::NotFetchable(_))
    ));
}

#[test]
fn a_hostile_request_is_refused_and_the_next_importer_is_served() {
    let exporter = Exporter::start(MESSAGE);
    let options = options(&exporter.pki, "importer", &["exporter"]);
    for hostile in [
        vec![b' '; MAX_HANDOFF_MESSAGE + 1],
        br#"{"object":{"region":"kv"},"generation":1,"give_me":"all"}"#.to_vec(),
    ] {
        let mut stream = TlsConnector::new(&options)
            .expect("a connector")
            .connect(exporter.server.local_addr())
            .expect("the importer is admitted");
        StreamWriter::new(&mut stream)
            .write_data(&hostile)
            .expect("write");
        // No descriptor comes back: the stream ends.
        assert!(!matches!(
            StreamReader::new(&mut stream).read_message(),
            Ok(PeerMessage::Descriptor(_))
        ));
        match exporter.served().outcome {
            Outcome::Failed(ServeError::Message(
                MessageError::TooLarge { .. } | MessageError::Malformed(_),
            )) => {}
            other => panic!("expected the request refused, got {other:?}"),
        }
    }
    fetch_and_import(&fetcher(&exporter.pki, "importer"), &exporter.locator(1))
        .expect("the next importer is served");
}

#[test]
fn a_stalling_importer_holds_only_its_own_slot_until_the_deadline() {
    let exporter = Exporter::start(Duration::from_secs(1));
    let options = options(&exporter.pki, "importer", &["exporter"]);
    // Admitted, then silent.
    let stalled = TlsConnector::new(&options)
        .expect("a connector")
        .connect(exporter.server.local_addr())
        .expect("admitted");
    // Meanwhile another importer is served.
    let started = Instant::now();
    fetch_and_import(&fetcher(&exporter.pki, "importer"), &exporter.locator(1))
        .expect("served beside the stalled one");
    assert!(matches!(exporter.served().outcome, Outcome::Acknowledged));
    // The stalled one is dropped by its deadline.
    match exporter.served().outcome {
        Outcome::Failed(ServeError::Stream(error))
            if matches!(*error, vmm_core::Error::Timeout { .. }) => {}
        other => panic!("expected the stalled importer's deadline, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(4));
    // It got nothing: the exporter closed it without a byte of ours.
    let mut stalled = stalled;
    let mut byte = [0u8; 1];
    assert!(matches!(stalled.read(&mut byte), Ok(0) | Err(_)));
}

#[test]
fn a_sigstopped_exporter_holds_the_importer_only_until_its_deadline() {
    let Some(world) =
        World::start("a_sigstopped_exporter_holds_the_importer_only_until_its_deadline")
    else {
        return;
    };
    let importer = world.open("importer");
    let exe = std::env::current_exe().expect("the test binary");
    let (mut child, _lines) = start_exporter(
        Command::new(exe),
        &world.write_material("exporter"),
        &world.etcd.endpoint(),
        loopback(),
    );
    let entry = importer
        .resolve("exporter", "kv")
        .expect("resolve")
        .expect("published");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("a pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    // `kill` returns before the kernel has stopped every thread: one still running could
    // answer this fetch's handshake (CI once saw the fetch time out reading instead).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !support::etcd::all_threads_stopped(child.id()) {
        assert!(
            Instant::now() < deadline,
            "the exporter did not stop within 5 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The kernel still completes the TCP handshake; nothing answers TLS.
    let fetcher = vmm_registry::Fetcher::new(
        options(&world.pki, "importer", &["nobody"]),
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let stopped = fetcher.fetch(&entry.locator);
    let took = started.elapsed();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    assert!(
        matches!(stopped, Err(FetchError::ExporterGone { .. })),
        "{stopped:?}"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // Continued, it serves again.
    fetch_and_import(&fetcher, &entry.locator).expect("served after SIGCONT");
    child.kill().expect("SIGKILL the exporter");
    child.wait().expect("reap it");
}
