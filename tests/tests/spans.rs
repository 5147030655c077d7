//! vmm-core's `tracing` feature (on in this crate): each operation it instruments emits its
//! span, with its fields, as a subscriber sees it. A capturing layer records every span (name,
//! parent, fields, including those recorded later) on the test's own thread, through
//! `tracing::subscriber::with_default`, so tests running side by side see only their own spans.
//! Remove a span from vmm-core and its test here fails. The CUDA test needs a GPU (it prints
//! one SKIP line without one).
//!
//! The other half of the feature, that with it off nothing is compiled in, is a build check,
//! not a test: see the README's "Tracing" section.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rstest::rstest;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::with_default;
use tracing_subscriber::layer::{Context as LayerContext, Layer, SubscriberExt};
use tracing_subscriber::registry::{LookupSpan, Registry};
use vmm_core::Error;
use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
use vmm_core::peer::Session;
use vmm_core::process::{Context, Pool, StartMethod};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{cuda_vmm_ipc, skip_unless};
use vmm_core::wire::endpoint::{Allow, Credentials, Listener, ListenerOptions};
use vmm_core::wire::tls::{PeerCheck, TlsConnector, TlsIdentity, TlsListener, TlsOptions};
use vmm_tests::pki::{Leaf, LeafSpec, Pki, dns_name};
use vmm_tests::{filled_in, unique_name};

const SIZE: usize = 1 << 20;
const TIMEOUT: Duration = Duration::from_secs(30);

/// One span as the subscriber saw it: its name, its parent's name, and every field with a
/// value (at creation or recorded later), as text.
#[derive(Debug, Clone)]
struct Seen {
    name: &'static str,
    parent: Option<&'static str>,
    fields: BTreeMap<&'static str, String>,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

/// Writes each field's value as text: numbers and strings plainly, the rest by `Debug` (which
/// for a `%` field is its `Display`).
struct Fields<'a>(&'a mut BTreeMap<&'static str, String>);

impl Visit for Fields<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

/// The capturing layer: spans in the order they were created.
#[derive(Default)]
struct Capture {
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Where each open span's entry is in `seen` (ids are reused once a span closes).
    open: Mutex<HashMap<Id, usize>>,
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: LayerContext<'_, S>) {
        let parent = ctx
            .span(id)
            .and_then(|span| span.parent())
            .map(|parent| parent.name());
        let mut seen = Seen {
            name: attrs.metadata().name(),
            parent,
            fields: BTreeMap::new(),
        };
        attrs.record(&mut Fields(&mut seen.fields));
        let mut all = self.seen.lock().unwrap();
        self.open.lock().unwrap().insert(id.clone(), all.len());
        all.push(seen);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: LayerContext<'_, S>) {
        if let Some(&index) = self.open.lock().unwrap().get(id) {
            values.record(&mut Fields(&mut self.seen.lock().unwrap()[index].fields));
        }
    }

    fn on_close(&self, id: Id, _ctx: LayerContext<'_, S>) {
        self.open.lock().unwrap().remove(&id);
    }
}

/// Run `f` with the capturing subscriber as this thread's default; what it returned and the
/// spans it made.
fn capture<T>(f: impl FnOnce() -> T) -> (T, Vec<Seen>) {
    let capture = Capture::default();
    let seen = Arc::clone(&capture.seen);
    let out = with_default(Registry::default().with(capture), f);
    let seen = seen.lock().unwrap().clone();
    (out, seen)
}

/// The spans named `name`.
fn named<'a>(seen: &'a [Seen], name: &str) -> Vec<&'a Seen> {
    seen.iter().filter(|s| s.name == name).collect()
}

/// The one span named `name`.
fn one<'a>(seen: &'a [Seen], name: &str) -> &'a Seen {
    match named(seen, name)[..] {
        [span] => span,
        ref other => panic!("expected one `{name}` span, saw {other:?} in {seen:#?}"),
    }
}

#[test]
fn host_export_import_and_map_have_spans_with_their_sizes() {
    let buf = HostBuffer::new(SIZE).unwrap();
    let (alias, seen) = capture(|| HostBuffer::import(&buf.export().unwrap()).unwrap());
    assert_eq!(alias.size(), SIZE);
    let bytes = SIZE.to_string();
    assert_eq!(one(&seen, "shm.export").field("bytes"), Some(&*bytes));
    let import = one(&seen, "shm.import");
    assert_eq!(import.field("bytes"), Some(&*bytes));
    // The import's own mapping, inside it.
    let map = one(&seen, "shm.map");
    assert_eq!(map.field("bytes"), Some(&*bytes));
    assert_eq!(map.parent, Some("shm.import"));
}

#[test]
fn cuda_export_import_and_map_have_spans_with_sizes_and_chunks() {
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let buf = filled_in(&resource, 2);
    let (alias, seen) = capture(|| resource.import(&buf.export().unwrap()).unwrap());
    assert_eq!(alias.chunk_sizes(), buf.chunk_sizes());
    let bytes = buf.size().to_string();
    for name in ["cuda.export", "cuda.import"] {
        let span = one(&seen, name);
        assert_eq!(span.field("bytes"), Some(&*bytes), "{span:?}");
        assert_eq!(span.field("chunks"), Some("2"), "{span:?}");
        assert_eq!(span.field("handle_type"), Some("posix_fd"), "{span:?}");
    }
    // The import maps both chunks back to back in one reservation of their total size.
    let map = one(&seen, "cuda.map");
    assert_eq!(map.parent, Some("cuda.import"));
    assert_eq!(map.field("chunks"), Some("2"), "{map:?}");
    assert_eq!(map.field("bytes"), Some(&*bytes), "{map:?}");
}

fn fill(buf: HostBuffer) {
    buf.fill(7).unwrap();
}

#[rstest]
#[case::spawn(StartMethod::Spawn)]
#[case::forkserver(StartMethod::Forkserver)]
#[case::warm(StartMethod::Warm)]
fn spawn_and_join_have_spans_with_pid_and_method(#[case] method: StartMethod) {
    let buf = HostBuffer::new(SIZE).unwrap();
    let (pid, seen) = capture(|| {
        let child = Context::new(method).spawn(fill, buf.clone()).unwrap();
        let pid = child.pid();
        child.join(TIMEOUT).unwrap();
        pid
    });
    assert_eq!(buf.to_vec(), vec![7; SIZE]);
    let pid = pid.to_string();
    for name in ["process.spawn", "process.join"] {
        let span = one(&seen, name);
        assert_eq!(span.field("pid"), Some(&*pid), "{span:?}");
        assert_eq!(span.field("method"), Some(method.name()), "{span:?}");
    }
    // The argument is exported on the way, inside the spawn.
    let export = one(&seen, "shm.export");
    assert_eq!(export.parent, Some("process.spawn"));
    assert_eq!(export.field("bytes"), Some(&*SIZE.to_string()));
}

fn double(n: u32) -> u32 {
    n * 2
}

#[test]
fn pool_submit_and_join_have_spans_with_the_task() {
    let pool = Pool::new(StartMethod::Warm, 1).unwrap();
    let (result, seen) = capture(|| pool.submit(double, 21).unwrap().join(TIMEOUT).unwrap());
    assert_eq!(result, 42);
    let submit = one(&seen, "pool.submit");
    let join = one(&seen, "pool.join");
    for span in [submit, join] {
        assert_eq!(span.field("method"), Some("warm"), "{span:?}");
    }
    assert!(submit.field("task").is_some(), "{submit:?}");
    assert_eq!(submit.field("task"), join.field("task"));
}

#[test]
fn an_endpoint_accept_has_a_span_with_the_peers_pid_and_uid() {
    let name = unique_name("spans", "accept");
    let listener = Listener::bind(&name).unwrap();
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name).map(|_| ())
    });
    let (session, seen) = capture(|| Session::accept(&listener, Some(TIMEOUT)).unwrap());
    client.join().unwrap().unwrap();
    let me = Credentials::of_this_process();
    assert_eq!(session.peer(), me);
    let accept = one(&seen, "endpoint.accept");
    assert_eq!(accept.field("pid"), Some(&*me.pid.to_string()));
    assert_eq!(accept.field("uid"), Some(&*me.uid.to_string()));
    assert_eq!(accept.field("endpoint"), Some(&*name.to_string()));
    assert!(named(&seen, "endpoint.refuse").is_empty(), "{seen:#?}");
}

#[test]
fn an_endpoint_refusal_has_a_span_with_the_refused_peer() {
    let name = unique_name("spans", "refuse");
    // An allow-list without the test's uid (tests run as root; no other uid is needed).
    let options = ListenerOptions::default()
        .allow(Allow::none())
        .log_refusals(false);
    let listener = Listener::bind_with(&name, options).unwrap();
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name).map(|_| ())
    });
    let (accepted, seen) = capture(|| Session::accept(&listener, Some(Duration::from_millis(500))));
    assert!(
        matches!(accepted, Err(Error::Timeout { .. })),
        "{accepted:?}"
    );
    assert!(client.join().unwrap().is_err(), "the client was refused");
    let me = Credentials::of_this_process();
    let refuse = one(&seen, "endpoint.refuse");
    assert_eq!(refuse.parent, Some("endpoint.accept"));
    assert_eq!(refuse.field("pid"), Some(&*me.pid.to_string()));
    assert_eq!(refuse.field("uid"), Some(&*me.uid.to_string()));
    assert_eq!(refuse.field("gid"), Some(&*me.gid.to_string()));
    // Nobody was admitted: the accept span names no peer.
    assert_eq!(one(&seen, "endpoint.accept").field("uid"), None);
}

fn tls_options(pki: &Pki, leaf: &Leaf, peer: &str) -> TlsOptions {
    let identity = TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
        .expect("a test identity");
    TlsOptions::new(
        identity,
        vec![pki.ca_der()],
        PeerCheck::names([dns_name(peer)]).unwrap(),
    )
    .expect("test options")
    .handshake_timeout(Duration::from_secs(5))
}

#[test]
fn a_tls_accept_and_a_tls_refusal_have_spans_with_the_peers_address() {
    let pki = Pki::new("spans");
    let exporter = pki.issue(&LeafSpec::new("exporter"));
    let importer = pki.issue(&LeafSpec::new("importer"));
    let listener = TlsListener::bind("127.0.0.1:0", &tls_options(&pki, &exporter, "importer"))
        .expect("a TLS listener");
    let addr = listener.local_addr().unwrap();

    // A plaintext client: refused inside its handshake.
    let mut plain = TcpStream::connect(addr).unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (accepted, seen) = capture(|| listener.accept(Some(Duration::from_secs(2))));
    assert!(
        matches!(accepted, Err(Error::Timeout { .. })),
        "{accepted:?}"
    );
    let refuse = one(&seen, "tls.refuse");
    assert_eq!(refuse.parent, Some("tls.accept"));
    assert_eq!(
        refuse.field("peer"),
        Some(&*plain.local_addr().unwrap().to_string())
    );
    assert!(refuse.field("reason").is_some(), "{refuse:?}");
    assert_eq!(one(&seen, "tls.accept").field("peer"), None);
    drop(plain);

    // A client with the right certificate: accepted.
    let connector = TlsConnector::new(&tls_options(&pki, &importer, "exporter")).unwrap();
    // It keeps its stream until the listener has finished with it.
    let client = std::thread::spawn(move || connector.connect(addr));
    let (stream, seen) = capture(|| listener.accept(Some(TIMEOUT)).unwrap());
    let _client_stream = client.join().unwrap().unwrap();
    let accept = one(&seen, "tls.accept");
    assert_eq!(accept.field("peer"), Some(&*stream.peer_addr().to_string()));
    assert!(named(&seen, "tls.refuse").is_empty(), "{seen:#?}");
}
