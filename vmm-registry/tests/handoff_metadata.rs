//! An offer's metadata in the hand-off (version 2): the normal path with a real
//! `ExportServer` (metadata of several pages arrives intact; an importer's cap refuses more),
//! and hostile exporters written here as raw mutual-TLS peers: one that announces more than
//! the importer takes (refused before allocating, and told the import failed), malformed
//! pages, one that stops mid-way or trickles its pages (the deadline), an exporter of version 1 (a typed error at
//! once, not a hang), and metadata whose tensor lies outside its chunk (refused by
//! `region_metadata`). Old and future importers against a real exporter too.

mod support;

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::wire::tls::{TlsConnector, TlsListener, TlsStream};
use vmm_registry::memd_publish::{RegionMetadataError, region_metadata};
use vmm_registry::{
    ExportServer, FetchError, MetadataError, Outcome, PAGE_PAYLOAD, PAGE_TAG, PageRule, ServeError,
};
use vmm_tests::pki::Pki;

use support::handoff::{MESSAGE, SIZE, fetcher, locator_at, object, options};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A metadata page as the protocol frames it: tag, index, payload.
fn page(index: u32, payload: &[u8]) -> Vec<u8> {
    let mut page = PAGE_TAG.to_vec();
    page.extend_from_slice(&index.to_le_bytes());
    page.extend_from_slice(payload);
    page
}

fn header(bytes: u64, pages: u64) -> Vec<u8> {
    format!(r#"{{"bytes":{bytes},"pages":{pages}}}"#).into_bytes()
}

/// What a hostile exporter does after it read the request and wrote the descriptor: given
/// the stream, it returns the importer's next `DATA` message, if one came.
type Behaviour = Box<dyn FnOnce(&mut TlsStream) -> Option<Vec<u8>> + Send>;

/// A hostile exporter called "exporter", admitting "importer": it serves one connection,
/// reading the request (which must be version 2) and, when `descriptor` is set, answering
/// with the stand-in's descriptor, then does `then`. Its address and its thread (what
/// `then` returned).
fn hostile(
    pki: &Pki,
    descriptor: bool,
    then: Behaviour,
) -> (SocketAddr, JoinHandle<Option<Vec<u8>>>) {
    let listener =
        TlsListener::bind(loopback(), &options(pki, "exporter", &["importer"])).expect("listen");
    let addr = listener.local_addr().expect("its address");
    let thread = std::thread::spawn(move || {
        let mut stream = listener
            .accept(Some(Duration::from_secs(10)))
            .expect("the importer connects");
        let request = match StreamReader::new(&mut stream).read_message() {
            Ok(PeerMessage::Data(bytes)) => String::from_utf8(bytes).expect("JSON"),
            other => panic!("expected a request, got {other:?}"),
        };
        assert!(request.contains(r#""version":2"#), "{request}");
        let (_buf, stand_in, _fd) = support::stand_in::export(SIZE);
        if descriptor {
            StreamWriter::new(&mut stream)
                .write_descriptor(&stand_in)
                .expect("write the descriptor");
        }
        then(&mut stream)
    });
    (addr, thread)
}

/// Write each of `messages` as a `DATA` message.
fn send(stream: &mut TlsStream, messages: &[Vec<u8>]) {
    for message in messages {
        StreamWriter::new(&mut *stream)
            .write_data(message)
            .expect("write");
    }
}

/// The importer's next `DATA` message, if one comes within 5 s.
fn last_word(stream: &mut TlsStream) -> Option<Vec<u8>> {
    match StreamReader::new(stream)
        .with_timeout(Some(Duration::from_secs(5)))
        .read_message()
    {
        Ok(PeerMessage::Data(bytes)) => Some(bytes),
        _ => None,
    }
}

#[test]
fn metadata_of_several_pages_arrives_intact_and_an_importer_s_cap_refuses_more() {
    let pki = Pki::new("handoff");
    let server = ExportServer::bind(
        loopback(),
        &options(&pki, "exporter", &["importer"]),
        MESSAGE,
    )
    .expect("serve");
    let (_buf, descriptor, _fd) = support::stand_in::export(SIZE);
    let metadata: Vec<u8> = (0..3 * PAGE_PAYLOAD + 17)
        .map(|i| (i % 253) as u8)
        .collect();
    server.offer_with_metadata(object(), 1, descriptor.clone(), metadata.clone());
    let locator = locator_at("exporter", "exporter", server.local_addr(), 1);

    let fetched = fetcher(&pki, "importer").fetch(&locator).expect("fetch");
    assert_eq!(fetched.metadata(), metadata.as_slice());
    fetched.acknowledge().expect("acknowledge");
    let served = server.next_served(Duration::from_secs(5)).expect("served");
    assert!(
        matches!(served.outcome, Outcome::Acknowledged),
        "{served:?}"
    );

    // An importer that takes less refuses it, and says it did not import.
    let small = fetcher(&pki, "importer").max_metadata(PAGE_PAYLOAD);
    match small.fetch(&locator) {
        Err(FetchError::Metadata(MetadataError::TooLarge { announced, max }))
            if announced == metadata.len() as u64 && max == PAGE_PAYLOAD => {}
        other => panic!("expected the metadata refused, got {other:?}"),
    }
    let served = server.next_served(Duration::from_secs(5)).expect("served");
    assert!(
        matches!(served.outcome, Outcome::ImportFailed),
        "{served:?}"
    );

    // `offer` is metadata-free: an empty metadata.
    server.offer(object(), 2, descriptor);
    let fetched = fetcher(&pki, "importer")
        .fetch(&locator_at("exporter", "exporter", server.local_addr(), 2))
        .expect("fetch");
    assert!(fetched.metadata().is_empty());
    assert!(matches!(
        region_metadata(&fetched),
        Err(RegionMetadataError::Missing)
    ));
    fetched.acknowledge().expect("acknowledge");
}

#[test]
fn an_exporter_announcing_too_much_metadata_is_refused_before_allocation() {
    let pki = Pki::new("handoff");
    // A terabyte: allocated, it would abort the importer.
    let announced: u64 = 1 << 40;
    let (addr, exporter) = hostile(
        &pki,
        true,
        Box::new(move |stream| {
            let pages = announced.div_ceil(PAGE_PAYLOAD as u64);
            send(stream, &[header(announced, pages)]);
            last_word(stream)
        }),
    );
    let started = Instant::now();
    match fetcher(&pki, "importer").fetch(&locator_at("exporter", "exporter", addr, 1)) {
        Err(FetchError::Metadata(MetadataError::TooLarge { announced: a, max }))
            if a == announced && max == vmm_registry::DEFAULT_MAX_METADATA => {}
        other => panic!("expected the announcement refused, got {other:?}"),
    }
    assert!(started.elapsed() < MESSAGE, "refused at once");
    // The exporter was told the import failed: nothing is in use.
    assert_eq!(
        exporter.join().expect("the exporter").as_deref(),
        Some(br#"{"imported":false}"#.as_slice())
    );
}

#[test]
fn malformed_metadata_pages_are_refused() {
    let pki = Pki::new("handoff");
    let good = vec![5u8; PAGE_PAYLOAD];
    let cases: Vec<(Vec<Vec<u8>>, MetadataErrorKind)> = vec![
        // The header: unknown fields, or a page count the length does not take.
        (
            vec![br#"{"bytes":1,"pages":1,"extra":0}"#.to_vec()],
            MetadataErrorKind::Header,
        ),
        (vec![header(10, 3)], MetadataErrorKind::PageCount),
        // A page of another tag, of another index, too short, too long, short of its place.
        (
            vec![header(10, 1), {
                let mut p = page(0, &[1; 10]);
                p[0] = b'X';
                p
            }],
            MetadataErrorKind::Page(PageRule::Tag),
        ),
        (
            vec![header(10, 1), page(1, &[1; 10])],
            MetadataErrorKind::Page(PageRule::Index(1)),
        ),
        (
            vec![header(10, 1), PAGE_TAG[..3].to_vec()],
            MetadataErrorKind::Page(PageRule::TooShort),
        ),
        (
            vec![header(10, 1), page(0, &[1; 11])],
            MetadataErrorKind::Page(PageRule::Length(11)),
        ),
        (
            vec![
                header(PAGE_PAYLOAD as u64 + 10, 2),
                page(0, &good[..100]),
                page(1, &[1; 10]),
            ],
            MetadataErrorKind::Page(PageRule::Length(100)),
        ),
    ];
    for (messages, expected) in cases {
        let (addr, exporter) = hostile(
            &pki,
            true,
            Box::new(move |stream| {
                send(stream, &messages);
                last_word(stream)
            }),
        );
        let result = fetcher(&pki, "importer").fetch(&locator_at("exporter", "exporter", addr, 1));
        match &result {
            Err(FetchError::Metadata(error)) => assert_eq!(kind(error), expected, "{error:?}"),
            other => panic!("expected {expected:?}, got {other:?}"),
        }
        assert_eq!(
            exporter.join().expect("the exporter").as_deref(),
            Some(br#"{"imported":false}"#.as_slice()),
            "{expected:?}"
        );
    }
    // A second descriptor where a page belongs.
    let (addr, exporter) = hostile(
        &pki,
        true,
        Box::new(|stream| {
            send(stream, &[header(10, 1)]);
            let (_buf, stand_in, _fd) = support::stand_in::export(SIZE);
            StreamWriter::new(&mut *stream)
                .write_descriptor(&stand_in)
                .expect("write");
            last_word(stream)
        }),
    );
    match fetcher(&pki, "importer").fetch(&locator_at("exporter", "exporter", addr, 1)) {
        Err(FetchError::Metadata(MetadataError::NotData)) => {}
        other => panic!("expected a descriptor refused as a page, got {other:?}"),
    }
    exporter.join().expect("the exporter");
}

/// Which refusal, without its details.
#[derive(Debug, PartialEq, Eq)]
enum MetadataErrorKind {
    Header,
    PageCount,
    Page(PageRule),
    Other,
}

fn kind(error: &MetadataError) -> MetadataErrorKind {
    match error {
        MetadataError::Header(_) => MetadataErrorKind::Header,
        MetadataError::PageCount { .. } => MetadataErrorKind::PageCount,
        MetadataError::Page { rule, .. } => MetadataErrorKind::Page(*rule),
        _ => MetadataErrorKind::Other,
    }
}

#[test]
fn an_exporter_that_stops_mid_way_holds_the_importer_only_until_its_deadline() {
    let pki = Pki::new("handoff");
    let (addr, exporter) = hostile(
        &pki,
        true,
        Box::new(|stream| {
            // Two pages announced, one sent, then silence (the stream held open).
            let payload = vec![3u8; PAGE_PAYLOAD];
            send(
                stream,
                &[header(PAGE_PAYLOAD as u64 + 1, 2), page(0, &payload)],
            );
            std::thread::sleep(Duration::from_secs(6));
            None
        }),
    );
    assert_deadline_within(&pki, addr, Duration::from_secs(4));
    exporter.join().expect("the exporter");
}

#[test]
fn an_exporter_that_trickles_pages_holds_the_importer_only_until_its_deadline() {
    let pki = Pki::new("handoff");
    let (addr, exporter) = hostile(
        &pki,
        true,
        Box::new(|stream| {
            // Six pages, one every 0.6 s: each within the 1 s deadline of a message, all of
            // them not within the deadline of the header.
            let payload = vec![3u8; PAGE_PAYLOAD];
            send(stream, &[header(6 * PAGE_PAYLOAD as u64, 6)]);
            for index in 0..6 {
                std::thread::sleep(Duration::from_millis(600));
                if StreamWriter::new(&mut *stream)
                    .write_data(&page(index, &payload))
                    .is_err()
                {
                    break;
                }
            }
            None
        }),
    );
    assert_deadline_within(&pki, addr, Duration::from_secs(3));
    exporter.join().expect("the exporter");
}

/// A fetch from `addr` with a 1 s message deadline ends by that deadline (a `Timeout` in the
/// stream), within `bound` in all.
fn assert_deadline_within(pki: &Pki, addr: std::net::SocketAddr, bound: Duration) {
    let fetcher = vmm_registry::Fetcher::new(
        options(pki, "importer", &["nobody"]),
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let result = fetcher.fetch(&locator_at("exporter", "exporter", addr, 1));
    let took = started.elapsed();
    match result {
        Err(FetchError::Stream { source, .. })
            if matches!(*source, vmm_core::Error::Timeout { .. }) => {}
        other => panic!("expected the deadline, got {other:?}"),
    }
    assert!(took < bound, "took {took:?}");
}

#[test]
fn an_exporter_of_version_1_is_a_typed_error_at_once() {
    let pki = Pki::new("handoff");
    // As a version 1 exporter does: the request's `version` is an unknown field, so it is
    // refused, and the stream dropped without an answer.
    let (addr, exporter) = hostile(&pki, false, Box::new(|_| None));
    let started = Instant::now();
    match fetcher(&pki, "importer").fetch(&locator_at("exporter", "exporter", addr, 1)) {
        Err(FetchError::Unanswered { .. }) => {}
        other => panic!("expected an unanswered request, got {other:?}"),
    }
    assert!(started.elapsed() < MESSAGE, "not by the deadline");
    exporter.join().expect("the exporter");
}

#[test]
fn importers_of_version_1_are_served_as_before_and_of_a_future_version_told_ours() {
    let pki = Pki::new("handoff");
    let server = ExportServer::bind(
        loopback(),
        &options(&pki, "exporter", &["importer"]),
        MESSAGE,
    )
    .expect("serve");
    let (_buf, descriptor, _fd) = support::stand_in::export(SIZE);
    server.offer_with_metadata(object(), 1, descriptor, b"[]".to_vec());
    let importer = options(&pki, "importer", &["exporter"]);
    let connect = || {
        TlsConnector::new(&importer)
            .expect("a connector")
            .connect(server.local_addr())
            .expect("admitted")
    };

    // Version 1 (no `version`): the descriptor, then at once the acknowledgement is read.
    let mut old = connect();
    send(
        &mut old,
        &[br#"{"object":{"region":"kv"},"generation":1}"#.to_vec()],
    );
    assert!(matches!(
        StreamReader::new(&mut old).read_message(),
        Ok(PeerMessage::Descriptor(_))
    ));
    send(&mut old, &[br#"{"imported":true}"#.to_vec()]);
    let served = server.next_served(Duration::from_secs(5)).expect("served");
    assert!(
        matches!(served.outcome, Outcome::Acknowledged),
        "{served:?}"
    );

    // Version 3: told the version spoken, no descriptor.
    let mut future = connect();
    send(
        &mut future,
        &[br#"{"object":{"region":"kv"},"generation":1,"version":3}"#.to_vec()],
    );
    match StreamReader::new(&mut future).read_message() {
        Ok(PeerMessage::Data(bytes)) => assert_eq!(bytes, br#"{"speaks":2}"#),
        other => panic!("expected the version spoken, got {other:?}"),
    }
    let served = server.next_served(Duration::from_secs(5)).expect("served");
    assert!(
        matches!(
            served.outcome,
            Outcome::Failed(ServeError::Version { asked: 3 })
        ),
        "{served:?}"
    );
}

#[test]
fn a_tensor_outside_its_chunk_is_refused_by_region_metadata() {
    let pki = Pki::new("handoff");
    let tensor = |chunk: u32, offset: usize, len: usize| {
        format!(
            r#"[["layer0.weight",{{"chunk":{chunk},"offset":{offset},"len":{len},"dtype":"BF16","shape":[4]}}]]"#
        )
        .into_bytes()
    };
    let cases = [
        // Passes the end of the chunk the descriptor announces, by one byte.
        tensor(0, SIZE - 7, 8),
        // A chunk the region does not have.
        tensor(1, 0, 8),
        // Inside: accepted.
        tensor(0, SIZE - 8, 8),
    ];
    for (i, metadata) in cases.into_iter().enumerate() {
        let (addr, exporter) = hostile(
            &pki,
            true,
            Box::new(move |stream| {
                send(
                    stream,
                    &[header(metadata.len() as u64, 1), page(0, &metadata)],
                );
                last_word(stream)
            }),
        );
        let fetched = fetcher(&pki, "importer")
            .fetch(&locator_at("exporter", "exporter", addr, 1))
            .expect("the hand-off itself is well formed");
        let read = region_metadata(&fetched);
        match (i, &read) {
            (0, Err(RegionMetadataError::OutsideChunk { chunk_size, .. }))
                if *chunk_size == SIZE as u64 => {}
            (
                1,
                Err(RegionMetadataError::NoSuchChunk {
                    chunk: 1,
                    chunks: 1,
                    ..
                }),
            ) => {}
            (2, Ok(meta)) if meta["layer0.weight"].offset == (SIZE - 8) as u64 => {}
            _ => panic!("case {i}: got {read:?}"),
        }
        // The importer decides what to say: a refused layout is not imported.
        if read.is_ok() {
            fetched.acknowledge().expect("acknowledge");
        } else {
            fetched.import_failed().expect("say so");
        }
        let said = exporter.join().expect("the exporter");
        assert_eq!(
            said.as_deref(),
            Some(if i == 2 {
                br#"{"imported":true}"#.as_slice()
            } else {
                br#"{"imported":false}"#.as_slice()
            })
        );
    }
}
