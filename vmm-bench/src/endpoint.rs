//! Named endpoints: what connecting costs, and a descriptor hand-off over an endpoint's
//! connection next to the same hand-off over vmm-core's socketpair (a `Queue`), in one run.
//!
//! - `connect`: `Session::connect` to a listener that accepts on a thread of this process
//!   (connect, the client's `SO_PEERCRED` check, the listener's accept, `SO_PEERCRED` check and
//!   `HELLO`, the client's receive), next to a bare `SOCK_STREAM` connect to a plain listener
//!   whose thread accepts and writes one byte, which the client reads.
//! - `descriptor/endpoint`: a live child (started once, outside the clock, with vmm-core's
//!   spawn) that connected to this process's listener by name; one iteration is
//!   `send_descriptor`, the child's `recv_descriptor` + import + drop, and its `DATA` ack.
//!   Baseline `descriptor/socketpair`: the same descriptor through a `Queue` to a live child
//!   that imports, drops and acks on a `Queue<u8>` (`handoff::LiveChild`, spawn). Each child
//!   runs alone, as in `handoff`.
//! - `gpu-endpoint/fabric-descriptor/endpoint` (where fabric handles can be used): the same
//!   endpoint hand-off with a one-chunk fabric descriptor (`CUDA_FABRIC`, no fd; the child
//!   imports with `import_fabric`), next to the POSIX-fd `descriptor/endpoint`.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{
    Device, FabricDescriptor, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource,
};
use vmm_core::peer::{Descriptor, DescriptorRef, PeerMessage, Session};
use vmm_core::process::{Context, Process, StartMethod};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::endpoint::{ConnectOptions, Listener, Name};

use crate::handoff::{Handled, LiveChild};
use crate::report::{Target, row};
use crate::{CHILD_WAIT, Group, Kind, key};

/// The host endpoint group (runs everywhere).
pub const HOST_GROUP: &str = "host-endpoint";
/// The GPU endpoint group.
pub const GPU_GROUP: &str = "gpu-endpoint";

fn unique(tag: &str) -> String {
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "vmm-bench-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A thread that accepts connections and drops them, until dropped.
struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Wakes a thread blocked in `accept` (a connection it then sees the stop flag after).
    wake: Option<SocketAddr>,
}

impl Acceptor {
    /// The endpoint listener's side (its `accept` wakes every 50 ms to look at the flag).
    fn endpoint(listener: Listener) -> Acceptor {
        Acceptor::spawn(None, move |stop| {
            while !stop.load(Ordering::Relaxed) {
                drop(Session::accept(&listener, Some(Duration::from_millis(50))));
            }
        })
    }

    /// A plain listener that greets each connection with one byte.
    fn bare(listener: UnixListener, addr: SocketAddr) -> Acceptor {
        Acceptor::spawn(Some(addr), move |stop| {
            while !stop.load(Ordering::Relaxed) {
                if let Ok((mut stream, _)) = listener.accept() {
                    let _ = stream.write_all(&[1]);
                }
            }
        })
    }

    fn spawn(
        wake: Option<SocketAddr>,
        body: impl FnOnce(Arc<AtomicBool>) + Send + 'static,
    ) -> Acceptor {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = Arc::clone(&stop);
            move || body(stop)
        });
        Acceptor {
            stop,
            thread: Some(thread),
            wake,
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(addr) = &self.wake {
            drop(UnixStream::connect_addr(addr));
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `connect` against the bare-socket connect, interleaved.
fn connect(c: &mut Criterion) {
    row(
        &key(HOST_GROUP, "connect/vmm-core"),
        &key(HOST_GROUP, "connect/bare-socket"),
        Target::None,
    );
    let name = Name::abstract_name(unique("connect"));
    let _endpoint = Acceptor::endpoint(Listener::bind(&name).expect("bind"));
    let bare_name = unique("bare");
    let addr = SocketAddr::from_abstract_name(bare_name.as_bytes()).expect("abstract address");
    let _bare = Acceptor::bare(
        UnixListener::bind_addr(&addr).expect("bind bare"),
        addr.clone(),
    );
    let options = ConnectOptions::default().timeout(Some(CHILD_WAIT));
    let mut group = Group::new(c, HOST_GROUP, Kind::InProcess);
    group.bench_pair(
        "connect",
        ("connect/vmm-core", || {
            let t = Instant::now();
            let conn = Session::connect_with(&name, &options).expect("connect");
            let elapsed = t.elapsed();
            drop(conn);
            elapsed
        }),
        ("connect/bare-socket", || {
            let t = Instant::now();
            let mut stream = UnixStream::connect_addr(&addr).expect("connect bare");
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).expect("greeting");
            let elapsed = t.elapsed();
            drop(stream);
            elapsed
        }),
    );
    group.finish();
}

/// What an endpoint hand-off child does with a descriptor.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub enum Work {
    /// `HostBuffer::import`, drop.
    Host,
    /// `VirtualMemoryBuffer::import`, drop.
    Cuda,
    /// `VirtualMemoryBuffer::import_fabric`, drop.
    Fabric,
}

/// The endpoint hand-off child: connect to `name`, then import and ack each descriptor until a
/// `DATA` message says stop.
pub fn endpoint_serve((name, work): (String, Work)) {
    let name: Name = name.as_str().into();
    let options = ConnectOptions::default().timeout(Some(CHILD_WAIT));
    let conn = Session::connect_with(&name, &options).expect("child: connect");
    loop {
        match conn.recv_message().expect("child: receive") {
            PeerMessage::Descriptor(Descriptor::Host(d)) if matches!(work, Work::Host) => {
                drop(HostBuffer::import(&d).expect("child: import host descriptor"));
            }
            PeerMessage::Descriptor(Descriptor::Cuda(d)) if matches!(work, Work::Cuda) => {
                drop(VirtualMemoryBuffer::import(&d).expect("child: import descriptor"));
            }
            PeerMessage::Descriptor(Descriptor::Fabric(d)) if matches!(work, Work::Fabric) => {
                drop(VirtualMemoryBuffer::import_fabric(&d).expect("child: import fabric"));
            }
            PeerMessage::Data(_) => return,
            other => panic!("child: unexpected {other:?}"),
        }
        conn.send_data(b"1").expect("child: acknowledge");
    }
}

/// A live endpoint hand-off child and the parent's admitted connection to it.
#[derive(Debug)]
struct EndpointChild {
    process: Option<Process>,
    conn: Session,
    _listener: Listener,
}

impl EndpointChild {
    fn start<'a>(work: Work, warm_up: impl Into<DescriptorRef<'a>> + Copy) -> EndpointChild {
        let name = unique("handoff");
        let listener = Listener::bind(&Name::abstract_name(&name)).expect("bind");
        let process = Context::new(StartMethod::Spawn)
            .spawn(endpoint_serve, (format!("@{name}"), work))
            .expect("start endpoint child");
        let mut conn = Session::accept(&listener, Some(CHILD_WAIT)).expect("the child connects");
        conn.set_timeout(Some(CHILD_WAIT));
        let child = EndpointChild {
            process: Some(process),
            conn,
            _listener: listener,
        };
        child.send(warm_up);
        child
    }

    fn send<'a>(&self, descriptor: impl Into<DescriptorRef<'a>>) -> Duration {
        let t = Instant::now();
        self.conn
            .send_descriptor(descriptor)
            .expect("send descriptor");
        self.conn.recv_data().expect("child acknowledgement");
        t.elapsed()
    }

    fn stop(mut self) {
        self.conn.send_data(b"stop").expect("stop the child");
        if let Some(process) = self.process.take() {
            process.join(CHILD_WAIT).expect("join endpoint child");
        }
    }
}

/// The endpoint hand-off of `descriptor` and its socketpair baseline, each child alone.
fn handoffs<D: Handled>(group: &mut Group<'_>, work: Work, descriptor: &D, socketpair: &Option<D>)
where
    for<'a> &'a D: Into<DescriptorRef<'a>>,
{
    let mut live: Option<EndpointChild> = None;
    group.bench("descriptor/endpoint", || {
        live.get_or_insert_with(|| EndpointChild::start(work, descriptor))
            .send(descriptor)
    });
    if let Some(live) = live {
        live.stop();
    }
    let mut live: Option<LiveChild<D>> = None;
    group.bench("descriptor/socketpair", || {
        live.get_or_insert_with(|| LiveChild::start(StartMethod::Spawn, socketpair))
            .send(socketpair)
    });
    if let Some(live) = live {
        live.stop();
    }
}

fn handoff_rows(group: &str) {
    row(
        &key(group, "descriptor/endpoint"),
        &key(group, "descriptor/socketpair"),
        Target::RatioAtMost(1.1),
    );
}

/// The host endpoint figures: connect, and a 2 MiB memfd descriptor's hand-off.
pub fn host(c: &mut Criterion) {
    connect(c);
    handoff_rows(HOST_GROUP);
    let buffer = HostBuffer::new(2 << 20).expect("host buffer");
    let descriptor: HostDescriptor = buffer.export().expect("export");
    let socketpair = Some(buffer.export().expect("export"));
    let mut group = Group::new(c, HOST_GROUP, Kind::Processes);
    handoffs(&mut group, Work::Host, &descriptor, &socketpair);
    group.finish();
}

/// The GPU endpoint figure: a one-chunk (2 MiB granularity) VMM descriptor's hand-off.
pub fn gpu(c: &mut Criterion) {
    handoff_rows(GPU_GROUP);
    let resource = VirtualMemoryResource::new(
        &Device::new(0).expect("device 0"),
        ResourceOptions::default(),
    )
    .expect("resource");
    let size = (2usize << 20).next_multiple_of(resource.granularity());
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor: IpcDescriptor = buffer.export().expect("export");
    let socketpair = Some(buffer.export().expect("export"));
    let mut group = Group::new(c, GPU_GROUP, Kind::Processes);
    handoffs(&mut group, Work::Cuda, &descriptor, &socketpair);
    fabric_handoff(&mut group, size);
    group.finish();
}

/// `fabric-descriptor/endpoint`: a one-chunk fabric descriptor (`CUDA_FABRIC`, protocol
/// version 2: 64 handle bytes, no fd) handed over an endpoint to a live child that imports it,
/// next to the POSIX-fd `descriptor/endpoint` of the same run. One `SKIP` line where fabric
/// handles cannot be used.
fn fabric_handoff(group: &mut Group<'_>, size: usize) {
    let id = "fabric-descriptor/endpoint";
    if let Err(why) = crate::fabric::availability() {
        eprintln!("SKIP {GPU_GROUP}/{id}: {why}");
        return;
    }
    row(
        &key(GPU_GROUP, id),
        &key(GPU_GROUP, "descriptor/endpoint"),
        Target::None,
    );
    let resource = VirtualMemoryResource::new(
        &Device::new(0).expect("device 0"),
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )
    .expect("fabric resource");
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor: FabricDescriptor = buffer.export_fabric().expect("export_fabric");
    let mut live: Option<EndpointChild> = None;
    group.bench(id, || {
        live.get_or_insert_with(|| EndpointChild::start(Work::Fabric, &descriptor))
            .send(&descriptor)
    });
    if let Some(live) = live {
        live.stop();
    }
    // Every import was acknowledged: the buffer may go.
    drop(buffer);
}
