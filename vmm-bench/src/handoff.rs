//! Hand-off to a live child: a child started once (outside the clock) receives items in a loop;
//! each timed iteration is one send, the child's import + map (+ set access) + drop, and its
//! acknowledgement.
//!
//! - vmm-core: `Queue<Option<T>>` to the child, `Queue<u8>` back; `None` ends the child.
//! - baseline: raw_vmm.c's child: a bare `SOCK_STREAM` socketpair, one `sendmsg` with the fd in
//!   `SCM_RIGHTS` and the size, the raw calls, a 1-byte `write` back. That child is started
//!   once with vmm-core's spawn (its start is not timed; only the socket and the raw calls are).

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use criterion::Criterion;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use vmm_core::cuda::{
    Device, FabricDescriptor, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource,
};
use vmm_core::process::{Context, Process, StartMethod};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::{Fd, Queue};

use crate::raw::{self, RawCuda};
use crate::report::{Target, row};
use crate::{CHILD_WAIT, Group, Kind, key};

/// The GPU hand-off group.
pub const GROUP: &str = "gpu-handoff";

/// The start methods of the live children (a warm child, once started, is a spawned one).
pub const METHODS: [StartMethod; 2] = [StartMethod::Spawn, StartMethod::Forkserver];

/// What a hand-off child does with an item it received.
pub trait Handled: Serialize + DeserializeOwned {
    /// Import (if the item is a descriptor), map, drop.
    fn consume(self);
}

impl Handled for IpcDescriptor {
    fn consume(self) {
        let buf = VirtualMemoryBuffer::import(&self).expect("child: import descriptor");
        drop(buf);
    }
}

impl Handled for FabricDescriptor {
    fn consume(self) {
        let buf = VirtualMemoryBuffer::import_fabric(&self).expect("child: import fabric");
        drop(buf);
    }
}

impl Handled for VirtualMemoryBuffer {
    /// Already imported and mapped by the queue's `get`.
    fn consume(self) {}
}

impl Handled for HostDescriptor {
    fn consume(self) {
        let buf = HostBuffer::import(&self).expect("child: import host descriptor");
        drop(buf);
    }
}

impl Handled for HostBuffer {
    /// Already imported and mapped by the queue's `get`.
    fn consume(self) {}
}

/// The hand-off child's loop (a plain `fn`, as `Context::spawn` needs).
pub fn serve<T: Handled>((items, acks): (Queue<Option<T>>, Queue<u8>)) {
    while let Some(item) = items.get(CHILD_WAIT).expect("child: receive item") {
        item.consume();
        acks.put(&1).expect("child: acknowledge");
    }
}

/// A live vmm-core hand-off child.
#[derive(Debug)]
pub struct LiveChild<T> {
    process: Option<Process>,
    items: Queue<Option<T>>,
    acks: Queue<u8>,
}

impl<T: Handled> LiveChild<T> {
    /// Start it with `method` and hand it `warm_up` once, untimed (the child's CUDA init and
    /// first import happen there).
    pub fn start(method: StartMethod, warm_up: &Option<T>) -> LiveChild<T> {
        let items = Queue::new().expect("queue");
        let acks = Queue::new().expect("queue");
        let process = Context::new(method)
            .spawn(serve::<T>, (items.clone(), acks.clone()))
            .expect("start hand-off child");
        let child = LiveChild {
            process: Some(process),
            items,
            acks,
        };
        child.send(warm_up);
        child
    }

    /// One timed hand-off: put, then wait for the acknowledgement.
    pub fn send(&self, item: &Option<T>) -> Duration {
        let t = Instant::now();
        self.items.put(item).expect("put item");
        self.acks.get(CHILD_WAIT).expect("child acknowledgement");
        t.elapsed()
    }

    /// End the child and join it.
    pub fn stop(mut self) {
        self.items.put(&None).expect("put stop");
        if let Some(process) = self.process.take() {
            process.join(CHILD_WAIT).expect("join hand-off child");
        }
    }
}

/// What the raw child does with each fd.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum RawWork {
    /// raw_vmm.c's child: import, close, reserve, map, set access, unmap, free, release.
    Gpu,
    /// The memfd twin: mmap, close, munmap.
    Host,
}

/// raw_vmm.c's child loop over a bare socket; returns at end of stream.
pub fn raw_serve((sock, work): (Fd, RawWork)) {
    let cuda = match work {
        RawWork::Gpu => Some(RawCuda::init().expect("raw child: CUDA init")),
        RawWork::Host => None,
    };
    while let Some((fd, size)) = raw::recv_fd(sock.as_fd()) {
        match &cuda {
            Some(cuda) => {
                let handle = cuda.import(fd.as_fd());
                drop(fd);
                let va = cuda.reserve(size);
                cuda.map(va, size, handle);
                cuda.set_access(va, size);
                cuda.unmap(va, size);
                cuda.free(va, size);
                cuda.release(handle);
            }
            None => {
                let ptr = raw::mmap_shared(fd.as_fd(), size);
                drop(fd);
                raw::munmap(ptr, size);
            }
        }
        raw::ack(sock.as_fd());
    }
}

/// A live raw child and our end of its bare socket.
#[derive(Debug)]
pub struct RawChild {
    sock: Option<OwnedFd>,
    process: Option<Process>,
}

impl RawChild {
    /// Start it (vmm-core spawn, untimed) and hand it `warm_up` of `size` bytes once.
    pub fn start(work: RawWork, warm_up: &OwnedFd, size: usize) -> RawChild {
        let (ours, theirs) = raw::socketpair();
        let process = Context::new(StartMethod::Spawn)
            .spawn(raw_serve, (Fd(theirs), work))
            .expect("start raw hand-off child");
        let child = RawChild {
            sock: Some(ours),
            process: Some(process),
        };
        child.send(warm_up, size);
        child
    }

    /// One timed hand-off: sendmsg(fd) + the child's raw calls + 1-byte ack.
    pub fn send(&self, fd: &OwnedFd, size: usize) -> Duration {
        let sock = self.sock.as_ref().expect("socket").as_fd();
        let t = Instant::now();
        raw::send_fd(sock, fd.as_fd(), size);
        raw::wait_ack(sock);
        t.elapsed()
    }

    /// `make_fd` (an export, timed), then [`send`](Self::send), then close the fd (timed, as
    /// vmm-core's buffer send closes the fds it exported).
    pub fn export_and_send(&self, size: usize, make_fd: impl FnOnce() -> OwnedFd) -> Duration {
        let sock = self.sock.as_ref().expect("socket").as_fd();
        let t = Instant::now();
        let fd = make_fd();
        raw::send_fd(sock, fd.as_fd(), size);
        raw::wait_ack(sock);
        drop(fd);
        t.elapsed()
    }

    /// Close our end (the child sees end of stream and returns) and join it.
    pub fn stop(mut self) {
        drop(self.sock.take());
        if let Some(process) = self.process.take() {
            process.join(CHILD_WAIT).expect("join raw hand-off child");
        }
    }
}

/// Bench `id` in `group` with a vmm-core child started lazily (so a filtered-out figure starts
/// nothing) and stopped after.
pub fn bench_live<T: Handled>(
    group: &mut Group<'_>,
    id: &str,
    method: StartMethod,
    item: &Option<T>,
) {
    let mut live: Option<LiveChild<T>> = None;
    group.bench(id, || {
        live.get_or_insert_with(|| LiveChild::start(method, item))
            .send(item)
    });
    if let Some(live) = live {
        live.stop();
    }
}

/// Bench `id` with a raw child started lazily; `op` runs one iteration against it.
pub fn bench_raw(
    group: &mut Group<'_>,
    id: &str,
    work: RawWork,
    warm_up: &OwnedFd,
    size: usize,
    mut op: impl FnMut(&RawChild) -> Duration,
) {
    let mut live: Option<RawChild> = None;
    group.bench(id, || {
        op(live.get_or_insert_with(|| RawChild::start(work, warm_up, size)))
    });
    if let Some(live) = live {
        live.stop();
    }
}

/// Register the hand-off rows of `group` (descriptor and buffer, both methods, against the
/// raw-socket baselines); `desc_target` is the descriptor figures' target.
pub fn rows(group: &str, desc_target: Target) {
    for method in METHODS {
        row(
            &key(group, &format!("descriptor/{method}")),
            &key(group, "descriptor/raw-socket"),
            desc_target,
        );
    }
    for method in METHODS {
        row(
            &key(group, &format!("buffer/{method}")),
            &key(group, "buffer/raw-socket"),
            Target::None,
        );
    }
}

/// The hand-off figures of one backend: its descriptor and its buffer through a Queue to a live
/// child under each start method, each next to a raw child fed over a bare socket. `fd` is the
/// raw twin's exported fd (what the raw descriptor figure sends); `export` makes a fresh one
/// (what the raw buffer figure exports on the way).
pub fn bench_handoffs<D: Handled, B: Handled>(
    group: &mut Group<'_>,
    (descriptor, buffer): (&Option<D>, &Option<B>),
    (work, fd, size): (RawWork, &OwnedFd, usize),
    mut export: impl FnMut() -> OwnedFd,
) {
    for method in METHODS {
        bench_live(group, &format!("descriptor/{method}"), method, descriptor);
    }
    bench_raw(group, "descriptor/raw-socket", work, fd, size, |child| {
        child.send(fd, size)
    });
    for method in METHODS {
        bench_live(group, &format!("buffer/{method}"), method, buffer);
    }
    bench_raw(group, "buffer/raw-socket", work, fd, size, |child| {
        child.export_and_send(size, &mut export)
    });
}

/// One 2 MiB-granularity chunk handed to a live child, under both methods, next to
/// raw_vmm.c's cross-process loop; then `buffer-cold/{method}`: a buffer of which no exported
/// fd is alive (as in a program that sends and drops), whose export on the way is the cold one
/// (the `buffer/*` figures export while the descriptor figures' descriptor is alive: warm).
pub fn gpu_handoff(c: &mut Criterion, cuda: &RawCuda) {
    rows(GROUP, Target::RatioAtMost(1.2));
    for method in METHODS {
        row(
            &key(GROUP, &format!("buffer-cold/{method}")),
            &key(GROUP, &format!("buffer/{method}")),
            Target::None,
        );
    }
    let device = Device::new(0).expect("device 0");
    let resource =
        VirtualMemoryResource::new(&device, ResourceOptions::default()).expect("resource");
    let size = (2usize << 20).next_multiple_of(resource.granularity());
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor = Some(buffer.export().expect("export"));
    let buffer = Some(buffer);

    cuda.make_current();
    let handle = cuda.create(size);
    let fd = cuda.export(handle);

    let mut group = Group::new(c, GROUP, Kind::Processes);
    bench_handoffs(
        &mut group,
        (&descriptor, &buffer),
        (RawWork::Gpu, &fd, size),
        || {
            cuda.make_current();
            cuda.export(handle)
        },
    );
    // Never exported outside the hand-off: each send's export is cold.
    let cold = Some(resource.allocate(size).expect("allocate"));
    for method in METHODS {
        bench_live(&mut group, &format!("buffer-cold/{method}"), method, &cold);
    }
    group.finish();
    drop(fd);
    cuda.make_current();
    cuda.release(handle);
}
