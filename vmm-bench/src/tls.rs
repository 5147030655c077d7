//! What mutual TLS costs a descriptor on a byte stream (`vmm_core::wire::tls`), next to the
//! same messages on a plain TCP stream, in one run, on loopback.
//!
//! - `descriptor/tls` and its baseline `descriptor/tcp`, interleaved: on an established
//!   connection to a thread of this process, one iteration writes a one-chunk `CUDA_FABRIC`
//!   descriptor (`StreamWriter::write_descriptor`) and reads the peer's `DATA` reply, which the
//!   peer writes once it has read the descriptor whole (`StreamReader::read_message`). The
//!   target: TLS adds at most 20 us per descriptor. The handles are stand-ins (the transport
//!   does not look at them); the GPU's own fabric hand-off is `gpu-fabric-handoff`.
//! - `handshake/tls`, on its own row: a new connection's whole mutual handshake (connect, both
//!   certificate checks, both sides done), next to a bare TCP connect accepted by a thread.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{FabricDescriptor, FabricHandle};
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::wire::tls::{PeerCheck, TlsConnector, TlsIdentity, TlsListener, TlsOptions};
use vmm_core::wire::{AuthenticatedStream, CallerAuthenticated};
use vmm_tests::pki::{Leaf, LeafSpec, Pki, dns_name};

use crate::report::{Target, row};
use crate::{Group, Kind, key};

/// The group (runs everywhere: it needs no GPU).
pub const GROUP: &str = "host-tls-stream";

/// What TLS may add to one descriptor's round trip on an established connection.
const ADDED_AT_MOST_NS: f64 = 20_000.0;

fn options(pki: &Pki, leaf: &Leaf, peer: &str) -> TlsOptions {
    let identity = TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
        .expect("a bench identity");
    TlsOptions::new(
        identity,
        vec![pki.ca_der()],
        PeerCheck::names([dns_name(peer)]).expect("a name"),
    )
    .expect("bench options")
}

fn descriptor() -> FabricDescriptor {
    FabricDescriptor::from_handles(
        &[FabricHandle::from_bytes([0x5a; 64])],
        &[2 << 20],
        2 << 20,
        [1; 16],
    )
    .expect("a one-chunk descriptor")
}

/// The peer: read a descriptor, reply `DATA`, until the stream ends.
fn echo<S: std::io::Read + std::io::Write + AuthenticatedStream>(mut stream: S) {
    loop {
        let read = StreamReader::new(&mut stream)
            .with_timeout(None)
            .read_message();
        match read {
            Ok(PeerMessage::Descriptor(_)) => {
                if StreamWriter::new(&mut stream).write_data(b"ok").is_err() {
                    return;
                }
            }
            _ => return,
        }
    }
}

/// One round trip: the descriptor out, the reply in.
fn round_trip<S: std::io::Read + std::io::Write + AuthenticatedStream>(
    stream: &mut S,
    descriptor: &FabricDescriptor,
) -> Duration {
    let started = Instant::now();
    StreamWriter::new(&mut *stream)
        .write_descriptor(descriptor)
        .expect("write a descriptor");
    match StreamReader::new(&mut *stream).read_message() {
        Ok(PeerMessage::Data(_)) => {}
        other => panic!("the peer's reply: {other:?}"),
    }
    started.elapsed()
}

/// `descriptor/tls` next to `descriptor/tcp`, then `handshake/tls` next to a TCP connect.
pub fn host_tls(c: &mut Criterion) {
    let pki = Pki::new("bench");
    let exporter = pki.issue(&LeafSpec::new("exporter"));
    let importer = pki.issue(&LeafSpec::new("importer"));
    let exporter_options = options(&pki, &exporter, "importer");
    let importer_options = options(&pki, &importer, "exporter");
    let descriptor = descriptor();

    // The established connections, each to a thread that answers.
    let listener = TlsListener::bind("127.0.0.1:0", &exporter_options).expect("TLS listener");
    let addr = listener.local_addr().expect("its address");
    let connector = TlsConnector::new(&importer_options).expect("a connector");
    let client = std::thread::spawn(move || connector.connect(addr));
    let served = listener
        .accept(Some(Duration::from_secs(30)))
        .expect("accept");
    let mut tls = client.join().expect("the client thread").expect("connect");
    let tls_peer = std::thread::spawn(move || echo(served));

    let plain = TcpListener::bind("127.0.0.1:0").expect("TCP listener");
    let tcp = TcpStream::connect(plain.local_addr().expect("its address")).expect("connect");
    let _ = tcp.set_nodelay(true);
    let (plain_served, _) = plain.accept().expect("accept");
    let _ = plain_served.set_nodelay(true);
    // The baseline: the same messages on plain TCP between two threads of this process (it
    // vouches for both ends).
    let mut tcp = CallerAuthenticated::new(tcp);
    let tcp_peer = std::thread::spawn(move || echo(CallerAuthenticated::new(plain_served)));

    let mut group = Group::new(c, GROUP, Kind::InProcess);
    group.bench_pair(
        "descriptor",
        ("descriptor/tls", || round_trip(&mut tls, &descriptor)),
        ("descriptor/tcp", || round_trip(&mut tcp, &descriptor)),
    );
    drop((tls, tcp));
    let _ = (tls_peer.join(), tcp_peer.join());

    // Handshakes: a thread accepts (the listener drives the server's side).
    let acceptor = Accepting::start(listener);
    let connector = TlsConnector::new(&importer_options).expect("a connector");
    let bare = TcpListener::bind("127.0.0.1:0").expect("TCP listener");
    let bare_addr = bare.local_addr().expect("its address");
    // Accepts for the rest of the run (the bench process's end closes it).
    std::thread::spawn(move || bare.incoming().for_each(drop));
    group.bench_pair(
        "handshake",
        ("handshake/tls", || {
            let started = Instant::now();
            let stream = connector.connect(acceptor.addr).expect("a handshake");
            let took = started.elapsed();
            drop(stream);
            took
        }),
        ("handshake/tcp-connect", || {
            let started = Instant::now();
            let stream = TcpStream::connect(bare_addr).expect("connect");
            let took = started.elapsed();
            drop(stream);
            took
        }),
    );
    group.finish();
    acceptor.stop();
    row(
        &key(GROUP, "descriptor/tls"),
        &key(GROUP, "descriptor/tcp"),
        Target::AddedPerChunkAtMost {
            chunks: 1,
            ns: ADDED_AT_MOST_NS,
        },
    );
    row(
        &key(GROUP, "handshake/tls"),
        &key(GROUP, "handshake/tcp-connect"),
        Target::None,
    );
}

/// A thread accepting TLS connections (and dropping them once their handshake is done).
struct Accepting {
    addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: JoinHandle<()>,
}

impl Accepting {
    fn start(listener: TlsListener) -> Accepting {
        use std::sync::atomic::{AtomicBool, Ordering};
        let addr = listener.local_addr().expect("its address");
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                drop(listener.accept(Some(Duration::from_millis(50))));
            }
        });
        Accepting { addr, stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.thread.join();
    }
}
