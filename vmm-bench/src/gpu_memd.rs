//! `gpu-memd`: the memory service of `vmm-memd` on the GPU backend (issue 32 item 3), each
//! figure next to a floor measured in the same run, interleaved iteration by iteration. The
//! service is this executable playing `vmm-memd` ([`ServiceProcess`], its keeper included),
//! started by the group's first figure that runs; device 0 of this process is the region's
//! device (named to the service by its UUID). Sizes are GiB (2^30 bytes).
//!
//! Rows (figure / floor: target):
//!
//! - `publish/{2,16}GiB/memd` / `publish/{2,16}GiB/raw-create-export`: target the figure's
//!   median under GMS's own cost of the same publish (the low end of its measured range: 45 ms
//!   for 2 GiB, 232 ms for 16 GiB in 331 tensors; `Target::Under`), the ratio to the floor
//!   shown. The figure: `Client::connect`, `begin` of one chunk of that size on the GPU
//!   (`Backend::Gpu`: the service's `cuMemCreate` + map + export, its fd sent, the writer's
//!   read-write import), `put` of 24 (2 GiB) or 331 (16 GiB) tensors' metadata, as GMS's
//!   runs, and `commit` (the writer's unmap, `PutMeta`, `Commit`: the generation handed to the
//!   keeper and made current; its digests are taken afterwards by the service's background
//!   thread, registry/hashing.rs). Nothing is filled: the service's own cost. Untimed after
//!   it: `delete` of the region, the connection's end, and a wait until device 0's free
//!   memory is back (the service, its keeper and the hashing thread let go within tens of
//!   milliseconds), so generations never pile up. The floor: what the service must do at
//!   least, through vmm-core in this process: `VirtualMemoryResource::allocate` (cuMemCreate,
//!   reserve, map, set access: the service's allocation does all four too), then `export` (one
//!   POSIX fd), with the service's handle type (POSIX fd, and fabric where this process can
//!   use fabric handles, as the service decides); freed untimed.
//! - `attach/{2,16,64}GiB/memd` / `attach/{2,16,64}GiB/raw`: target at most 1.2x. Regions of
//!   2 GiB chunks (1, 8, 32 chunks; 24, 331 and 1324 tensors), as ANCHORS' floor for an
//!   engine restart was measured. The figure: `Client::attach` on an open connection (the
//!   request, the lease, the metadata pages, one descriptor per chunk, the client's import of
//!   every chunk read-only, back to back in one reservation); detach and unmap untimed. The
//!   floor: `VirtualMemoryResource::import` (read-only too) of one `IpcDescriptor` built once
//!   with `IpcDescriptor::from_fds` from the same chunks' fds, which the bench holds (taken
//!   once with `Client::attach_unmapped`): import + reserve + map + set access; dropped
//!   untimed. Before the first of these figures the bench waits, untimed, until the service
//!   has taken the digests of every region (a `Verify` per region, in parallel), so no hashing
//!   runs beside them: the service's steady state, not the seconds after a publish.
//!   A third figure, interleaved with both, `.../raw-and-request`: the raw import and one
//!   request's round trip on the same connection (`Renew`), timed together: the floor of any
//!   attach through a service, shown next to the figure without a target.
//! - `attach/16GiB-331-tensors-packed/memd` / `.../raw`: the same for 16 GiB as one chunk
//!   with 331 equal tensors: target under 2 ms (absolute); the ratio to the raw import of
//!   that one chunk is shown.
//! - `attach-8-readers/16GiB-packed/each` / `.../lone`: target at most 2x. Eight reader
//!   threads of this process, each with its own connection, attach the packed region at once
//!   (started by one barrier; each times its own attach; they detach and unmap, untimed, once
//!   all have attached): each reader's time is one iteration of `each` (eight per round).
//!   `lone`: the first of those readers attaching alone. `.../round` (the slowest reader of a
//!   round) is shown next to `lone` without a target. The floor, interleaved with them: the
//!   same eight threads import the region's held fds at once, with no service in the way
//!   (`.../raw-each`, `.../raw-round`; each thread holds its own duplicates of the fds,
//!   taken with `attach_unmapped`), against one raw import alone (`.../raw-lone`): how much
//!   of the eight readers' slowdown is the driver's. Threads, not processes: they share one
//!   driver context, so this is no kinder to the service than eight processes would be.
//! - `sleep-wake/{2,16}GiB/memd` / `.../raw`: target at most 1.2x (the brief named none; a
//!   wake is an attach at the slept address, so the attach target is carried over). The
//!   figure: `Client::sleep` of an attached region (unmap and release here, the address range
//!   kept reserved, the lease ended) then `Client::wake` (attach again, mapped into that
//!   range). The floor: a buffer imported from the held fds,
//!   `VirtualMemoryBuffer::into_address_range` then `VirtualMemoryResource::import_at` of the
//!   same descriptor into that range (unmap + release, then import + map + set access at the
//!   same address). Time per GiB printed. Interleaved with both, `.../raw-and-requests`: the
//!   floor and two requests' round trips on the same connection (`Renew`: a sleep ends a
//!   lease, a wake attaches), shown without a target.
//! - `attach-after-restart/{2,16,64}GiB/memd` / `.../raw`: target at most 1.2x: the attach
//!   rows again after the service was killed with SIGKILL and started again on the same
//!   socket (its keeper held the chunks and handed them back; the floor imports the same fds
//!   the bench held throughout). The restart's time (from the kill until a client connected)
//!   and the first attach after it (64 GiB) are printed once.
//!
//! GPU memory: the publish rows hold at most two generations of 16 GiB at once (one being
//! freed); the attach regions hold 98 GiB (2 + 16 + 64 + 16) from the first attach figure to
//! the end of the group, when they are deleted and the service stopped. After the group, one
//! line per row on stdout (`gpu-memd <row>: ...`) gives the medians, the ratio, the target
//! and pass or miss, with GMS's publish cost beside the publish rows and milliseconds per GiB
//! beside sleep-wake.
//!
//! Nothing starts before a figure runs (each figure's setup runs lazily, outside criterion's
//! clocks: [`Group::bench_pair_prepared`]), so a filtered run that skips this group (the CI
//! smoke run's `'host-|child-start'`) starts no service and allocates nothing; without a GPU
//! the group prints one `SKIP gpu-memd: <reason>` line ([`crate::run`]).

use std::cell::{Cell, OnceCell, Ref, RefCell};
use std::hint::black_box;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{
    Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::wire::endpoint::{ConnectOptions, Name};
use vmm_memd::protocol::{Backend, Dtype, TensorMeta};
use vmm_memd::{BeginOptions, Client};

use crate::memd_service::ServiceProcess;
use crate::raw::RawCuda;
use crate::report::{Target, format_ns, row};
use crate::{CHILD_WAIT, Group, Kind, Settings, key, record};

/// The group.
pub const GROUP: &str = "gpu-memd";

const GIB: u64 = 1 << 30;

/// The chunk size of the attach and sleep-wake regions: 2 GiB.
pub const CHUNK: u64 = 2 * GIB;

/// Sizes (GiB) of the attach rows.
pub const ATTACH_GIB: [u64; 3] = [2, 16, 64];

/// Sizes (GiB) of the publish rows (one chunk each).
pub const PUBLISH_GIB: [u64; 2] = [2, 16];

/// Sizes (GiB) of the sleep-wake rows (regions of the attach rows).
pub const SLEEP_GIB: [u64; 2] = [2, 16];

/// The packed region: 16 GiB in one chunk, with [`PACKED_TENSORS`] tensors.
pub const PACKED_GIB: u64 = 16;

/// Tensors of a 16 GiB model (GMS's Llama-3-8B run: 331).
pub const PACKED_TENSORS: usize = 331;

/// Concurrent readers of the readers row.
pub const READERS: usize = 8;

/// Attach (and attach after a restart): at most 1.2x of the raw import.
pub const ATTACH_TARGET: Target = Target::RatioAtMost(1.2);

/// The packed attach: under 2 ms.
pub const PACKED_TARGET: Target = Target::Under(2e6);

/// Each of eight concurrent readers: at most 2x of a lone reader.
pub const READERS_TARGET: Target = Target::RatioAtMost(2.0);

/// Sleep + wake: at most 1.2x of raw unmap + map at the same address.
pub const SLEEP_TARGET: Target = Target::RatioAtMost(1.2);

/// GMS's own cost of a publish (ANCHORS: H200, driver 580), GiB -> (low, high) in ms.
pub const GMS_PUBLISH_MS: [(u64, (f64, f64)); 2] = [(2, (45.0, 49.0)), (16, (232.0, 270.0))];

/// The service's quota: far above what the group holds (the GPU is the limit).
const QUOTA: u64 = 1 << 40;

/// After a publish iteration, device 0's free memory must come back to within this much of
/// what it was before (less than the smallest generation published: 2 GiB).
const SETTLE_SLACK: usize = 1 << 30;

/// How long an iteration waits for that before it goes on (with one warning).
const SETTLE_WAIT: Duration = Duration::from_secs(10);

/// How long the wait for the service's digests may take (a Verify of 64 GiB at the
/// service's 1.2 GB/s takes about a minute).
const DIGEST_WAIT: Duration = Duration::from_secs(600);

/// One row of a 4096-column bf16 tensor: every tensor is a whole number of them.
const ROW_BYTES: u64 = 4096 * 2;

/// Tensors of a region of `gib` GiB: 24 for 2 GiB and 331 for 16 GiB (GMS's runs), 331 per
/// 16 GiB above.
fn tensors_of(gib: u64) -> usize {
    match gib {
        2 => 24,
        g => (PACKED_TENSORS as u64 * g / 16) as usize,
    }
}

/// `tensors` equal bf16 tensors spread over `chunks` (as evenly as they go), each a whole
/// number of 8 KiB rows, back to back from each chunk's start.
fn layout(chunks: &[u64], tensors: usize) -> Vec<(String, TensorMeta)> {
    let n = chunks.len();
    let mut out = Vec::with_capacity(tensors);
    for (c, &size) in chunks.iter().enumerate() {
        let here = tensors / n + usize::from(c < tensors % n);
        if here == 0 {
            continue;
        }
        let rows = size / here as u64 / ROW_BYTES;
        let len = rows * ROW_BYTES;
        for j in 0..here as u64 {
            let i = out.len();
            out.push((
                format!("model.layers.{}.mlp.w{}.weight", i / 16, i % 16),
                TensorMeta {
                    chunk: c as u32,
                    offset: j * len,
                    len,
                    dtype: Dtype::BF16,
                    shape: vec![rows, 4096],
                },
            ));
        }
    }
    out
}

/// A region as the bench publishes it.
#[derive(Debug, Clone)]
struct Spec {
    name: String,
    chunks: Vec<u64>,
    meta: Vec<(String, TensorMeta)>,
}

impl Spec {
    /// `gib` GiB in 2 GiB chunks.
    fn chunked(gib: u64) -> Spec {
        let chunks = vec![CHUNK; (gib * GIB / CHUNK) as usize];
        let meta = layout(&chunks, tensors_of(gib));
        Spec {
            name: chunked_name(gib),
            chunks,
            meta,
        }
    }

    /// `gib` GiB as one chunk with `tensors` tensors.
    fn one_chunk(name: String, gib: u64, tensors: usize) -> Spec {
        let chunks = vec![gib * GIB];
        let meta = layout(&chunks, tensors);
        Spec { name, chunks, meta }
    }

    fn bytes(&self) -> u64 {
        self.chunks.iter().sum()
    }

    /// `begin`, metadata, `commit` on `client`, nothing filled; the generation.
    fn publish(&self, client: &Client, uuid: [u8; 16]) -> u64 {
        let mut writer = client
            .begin(&self.name, &self.chunks, gpu_options(uuid))
            .expect("begin a GPU generation");
        for (k, m) in &self.meta {
            writer.put(k, m.clone());
        }
        writer.commit().expect("commit")
    }
}

fn chunked_name(gib: u64) -> String {
    format!("gpu-{gib}GiB")
}

const PACKED_NAME: &str = "gpu-16GiB-packed";

fn gpu_options(uuid: [u8; 16]) -> BeginOptions {
    BeginOptions {
        backend: Backend::Gpu { uuid },
        ..Default::default()
    }
}

/// Device 0 as the floors use it.
struct Gpu {
    uuid: [u8; 16],
    /// Imports as the service's readers do: read-only for the device.
    reader: VirtualMemoryResource,
    /// Allocates as the service does: POSIX fds, and fabric handles where this process can.
    allocator: VirtualMemoryResource,
    handle_type: HandleType,
}

impl Gpu {
    fn open() -> Gpu {
        let device = Device::new(0).expect("device 0");
        let handle_type = match device.check_fabric() {
            Ok(()) => HandleType::PosixFdAndFabric,
            Err(_) => HandleType::PosixFd,
        };
        let reader =
            VirtualMemoryResource::new(&device, ResourceOptions::default().read_only(true))
                .expect("a read-only resource");
        let allocator = VirtualMemoryResource::new(
            &device,
            ResourceOptions::default().handle_type(handle_type),
        )
        .expect("an allocating resource");
        Gpu {
            uuid: *device.uuid(),
            reader,
            allocator,
            handle_type,
        }
    }
}

/// A published attach region and the descriptor of its chunks' fds, which the bench holds.
struct Held {
    spec: Spec,
    descriptor: IpcDescriptor,
}

/// Everything the figures share, made when the first figure that needs it runs.
struct Bench<'a> {
    cuda: &'a RawCuda,
    quick: bool,
    gpu: OnceCell<Gpu>,
    service: RefCell<Option<ServiceProcess>>,
    /// The connection the attach figures use (replaced after the restart).
    client: RefCell<Option<Client>>,
    /// The service has opened the GPU (a GPU request made, untimed).
    primed: Cell<bool>,
    regions: OnceCell<Vec<Held>>,
    hashed: Cell<bool>,
    restarted: Cell<bool>,
    settle_warned: Cell<bool>,
}

impl<'a> Bench<'a> {
    fn new(cuda: &'a RawCuda, quick: bool) -> Bench<'a> {
        Bench {
            cuda,
            quick,
            gpu: OnceCell::new(),
            service: RefCell::new(None),
            client: RefCell::new(None),
            primed: Cell::new(false),
            regions: OnceCell::new(),
            hashed: Cell::new(false),
            restarted: Cell::new(false),
            settle_warned: Cell::new(false),
        }
    }

    fn gpu(&self) -> &Gpu {
        self.gpu.get_or_init(Gpu::open)
    }

    /// The service, started on first use, with a connection; the service has opened the
    /// GPU (one GPU `Begin` of 2 MiB, aborted), so no figure times its CUDA init.
    fn start(&self) {
        if self.service.borrow().is_none() {
            let service = ServiceProcess::start_with_quota(QUOTA);
            let client = Client::connect(&service.name).expect("connect to vmm-memd");
            *self.service.borrow_mut() = Some(service);
            *self.client.borrow_mut() = Some(client);
        }
        if !self.primed.get() {
            let uuid = self.gpu().uuid;
            let client = self.client();
            let writer = client
                .begin("gpu-prime", &[2 << 20], gpu_options(uuid))
                .expect("a first GPU begin");
            // A region whose first generation is aborted is gone with it.
            writer.abort().expect("abort");
            self.primed.set(true);
        }
    }

    fn client(&self) -> Ref<'_, Client> {
        Ref::map(self.client.borrow(), |c| c.as_ref().expect("connected"))
    }

    fn name(&self) -> Name {
        self.start();
        self.service
            .borrow()
            .as_ref()
            .expect("started")
            .name
            .clone()
    }

    /// The attach regions, published on first use (2, 16, 64 GiB in 2 GiB chunks; 16 GiB
    /// packed), with the fds the floors import.
    fn regions(&self) -> &[Held] {
        self.regions.get_or_init(|| self.publish_regions())
    }

    fn publish_regions(&self) -> Vec<Held> {
        self.start();
        let t = Instant::now();
        let uuid = self.gpu().uuid;
        let specs = ATTACH_GIB
            .iter()
            .map(|&gib| Spec::chunked(gib))
            .chain([Spec::one_chunk(
                PACKED_NAME.to_owned(),
                PACKED_GIB,
                PACKED_TENSORS,
            )]);
        let client = self.client();
        let held: Vec<Held> = specs
            .map(|spec| {
                spec.publish(&client, uuid);
                let unmapped = client
                    .attach_unmapped(&spec.name, None)
                    .expect("attach_unmapped");
                assert_eq!(
                    unmapped.device,
                    Some(uuid),
                    "{}: not on device 0",
                    spec.name
                );
                let fds: Vec<BorrowedFd<'_>> =
                    unmapped.chunks.iter().map(|(fd, _)| fd.as_fd()).collect();
                let sizes: Vec<usize> = unmapped.chunks.iter().map(|&(_, s)| s as usize).collect();
                let total = sizes.iter().sum();
                // The descriptor holds its own duplicates of the fds (the same open files).
                let descriptor = IpcDescriptor::from_fds(&fds, &sizes, HandleType::PosixFd, total)
                    .expect("a descriptor of the held fds");
                client.detach_lease(unmapped.lease).expect("detach");
                // Untimed check (and first use) of both paths: the service's attach maps the
                // same chunks, read-only, as the floor's import does.
                let attached = client.attach(&spec.name).expect("attach");
                let gpu = attached.gpu.as_ref().expect("a GPU attachment");
                assert!(gpu.is_read_only(), "a reader's GPU mapping is read-only");
                assert_eq!(gpu.buffer().size(), total, "{}: attach size", spec.name);
                client.detach(&attached).expect("detach");
                drop(attached);
                let buffer = self.gpu().reader.import(&descriptor).expect("import");
                assert_eq!(buffer.size(), total, "{}: import size", spec.name);
                drop(buffer);
                Held { spec, descriptor }
            })
            .collect();
        let bytes: u64 = held.iter().map(|h| h.spec.bytes()).sum();
        println!(
            "{GROUP}: published {} GiB in {} regions for the attach figures in {:.1} s",
            bytes / GIB,
            held.len(),
            t.elapsed().as_secs_f64()
        );
        held
    }

    fn held(&self, region: &str) -> &Held {
        self.regions()
            .iter()
            .find(|h| h.spec.name == region)
            .expect("a published region")
    }

    /// The regions, once the service has their digests (see the module docs); a quick run
    /// and a restarted service do not wait (the restarted one hashes nothing by itself).
    fn ready(&self) {
        let regions = self.regions();
        if self.hashed.replace(true) || self.restarted.get() {
            return;
        }
        if self.quick {
            println!(
                "{GROUP}: quick run: the attach figures do not wait for the service's digests"
            );
            return;
        }
        let t = Instant::now();
        let name = self.name();
        std::thread::scope(|scope| {
            for held in regions {
                let name = &name;
                scope.spawn(move || {
                    let options = ConnectOptions::default().timeout(Some(DIGEST_WAIT));
                    let client = Client::connect_with(name, &options).expect("connect");
                    client
                        .verify(&held.spec.name, None)
                        .expect("the region's digests");
                });
            }
        });
        let bytes: u64 = regions.iter().map(|h| h.spec.bytes()).sum();
        println!(
            "{GROUP}: waited {:.1} s until the service had the digests of all {} GiB (a Verify \
             per region, in parallel), so that no hashing runs beside the attach figures",
            t.elapsed().as_secs_f64(),
            bytes / GIB
        );
    }

    /// The regions, on a service killed with SIGKILL and started again (once).
    fn restarted(&self) {
        let regions = self.regions();
        if self.restarted.get() {
            return;
        }
        self.client.borrow_mut().take();
        let took = self
            .service
            .borrow_mut()
            .as_mut()
            .expect("started")
            .restart();
        let client = Client::connect(&self.name()).expect("connect after the restart");
        let listed = client.list().expect("list");
        for held in regions {
            assert!(
                listed
                    .iter()
                    .any(|r| r.region == held.spec.name && r.generation > 0),
                "{} is not back after the restart: {listed:?}",
                held.spec.name
            );
        }
        let biggest = regions
            .iter()
            .max_by_key(|h| h.spec.bytes())
            .expect("regions");
        let t = Instant::now();
        let attached = client
            .attach(&biggest.spec.name)
            .expect("attach after restart");
        let first = t.elapsed();
        client.detach(&attached).expect("detach");
        drop(attached);
        println!(
            "{GROUP}: the service was killed (SIGKILL) and started again: a client connected \
             {} after the kill, its {} regions back from the keeper; the first attach of {} \
             then took {}",
            format_ns(took.as_nanos() as f64),
            regions.len(),
            biggest.spec.name,
            format_ns(first.as_nanos() as f64)
        );
        *self.client.borrow_mut() = Some(client);
        self.restarted.set(true);
    }

    /// Wait until device 0's free memory is back within [`SETTLE_SLACK`] of `before`.
    fn settle(&self, before: usize) {
        let deadline = Instant::now() + SETTLE_WAIT;
        loop {
            let (free, _) = self.cuda.mem_info();
            if free + SETTLE_SLACK >= before {
                return;
            }
            if Instant::now() > deadline {
                if !self.settle_warned.replace(true) {
                    eprintln!(
                        "{GROUP}: device memory not back {SETTLE_WAIT:?} after a publish \
                         iteration ({} MiB free, {} MiB before); going on",
                        free >> 20,
                        before >> 20
                    );
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One attach of `region` on the open connection, timed; detach and unmap untimed.
    fn time_attach(&self, region: &str) -> Duration {
        let client = self.client();
        let t = Instant::now();
        let attached = client.attach(region).expect("attach");
        let elapsed = t.elapsed();
        client.detach(&attached).expect("detach");
        drop(attached);
        elapsed
    }

    /// The floor: one import of `region`'s held fds, timed; dropped untimed.
    fn time_raw_import(&self, region: &str) -> Duration {
        let (reader, descriptor) = (&self.gpu().reader, &self.held(region).descriptor);
        let t = Instant::now();
        let buffer = reader.import(descriptor).expect("import");
        let elapsed = t.elapsed();
        drop(buffer);
        elapsed
    }

    /// The floor of any attach through a service: the raw import of `region`'s held fds and
    /// one request's round trip on the open connection (`Renew`, with no lease to renew: one
    /// small request, one small reply), timed together.
    fn time_raw_import_and_request(&self, region: &str) -> Duration {
        let (reader, descriptor) = (&self.gpu().reader, &self.held(region).descriptor);
        let client = self.client();
        let t = Instant::now();
        black_box(client.renew().expect("renew"));
        let buffer = reader.import(descriptor).expect("import");
        let elapsed = t.elapsed();
        drop(buffer);
        elapsed
    }

    /// Delete the regions, close the held fds, stop the service (SIGTERM: its keeper lets
    /// everything go) and wait until the memory is back.
    fn stop(self) {
        let before = self.cuda.mem_info().0;
        if let (Some(regions), Some(client)) = (self.regions.get(), self.client.borrow().as_ref()) {
            for held in regions {
                let _ = client.delete(&held.spec.name);
            }
        }
        let held_bytes: u64 = self
            .regions
            .get()
            .map_or(0, |r| r.iter().map(|h| h.spec.bytes()).sum());
        let Bench {
            cuda,
            service,
            client,
            regions,
            ..
        } = self;
        drop(regions);
        drop(client);
        drop(service);
        if held_bytes > 0 {
            let deadline = Instant::now() + SETTLE_WAIT;
            while cuda.mem_info().0 < before + held_bytes as usize - SETTLE_SLACK
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// One row's keys, its target, and what its summary line adds.
struct Line {
    figure: String,
    baseline: String,
    target: Target,
    extra: Extra,
}

enum Extra {
    None,
    /// GMS's own cost of the same publish (ms, low and high).
    Gms(f64, f64),
    /// Milliseconds per GiB of this many GiB.
    PerGib(u64),
}

/// Add the report row and remember its summary line.
fn line(lines: &mut Vec<Line>, figure: &str, baseline: &str, target: Target, extra: Extra) {
    let (figure, baseline) = (key(GROUP, figure), key(GROUP, baseline));
    row(&figure, &baseline, target);
    lines.push(Line {
        figure,
        baseline,
        target,
        extra,
    });
}

/// GMS's own publish cost of `gib` GiB (ms, low and high).
fn gms_publish_ms(gib: u64) -> (f64, f64) {
    GMS_PUBLISH_MS
        .iter()
        .find(|(g, _)| *g == gib)
        .map(|&(_, ms)| ms)
        .expect("GMS's figure for this size")
}

fn publish(group: &mut Group<'_>, bench: &Bench<'_>, lines: &mut Vec<Line>) {
    for gib in PUBLISH_GIB {
        let (low, high) = gms_publish_ms(gib);
        let spec = Spec::one_chunk(format!("gpu-publish-{gib}GiB"), gib, tensors_of(gib));
        let (memd, floor) = (
            format!("publish/{gib}GiB/memd"),
            format!("publish/{gib}GiB/raw-create-export"),
        );
        line(
            lines,
            &memd,
            &floor,
            Target::Under(low * 1e6),
            Extra::Gms(low, high),
        );
        let bytes = spec.bytes() as usize;
        group.bench_pair_prepared(
            &format!("publish/{gib}GiB"),
            || bench.start(),
            (&memd, || {
                let (uuid, name) = (bench.gpu().uuid, bench.name());
                let before = bench.cuda.mem_info().0;
                let t = Instant::now();
                let client = Client::connect(&name).expect("connect");
                let generation = spec.publish(&client, uuid);
                let elapsed = t.elapsed();
                black_box(generation);
                client.delete(&spec.name).expect("delete");
                drop(client);
                bench.settle(before);
                elapsed
            }),
            (&floor, || {
                let allocator = &bench.gpu().allocator;
                let before = bench.cuda.mem_info().0;
                let t = Instant::now();
                let buffer = allocator.allocate(bytes).expect("allocate");
                let descriptor = buffer.export().expect("export");
                let elapsed = t.elapsed();
                drop((descriptor, buffer));
                bench.settle(before);
                elapsed
            }),
        );
    }
}

fn attach(group: &mut Group<'_>, bench: &Bench<'_>, lines: &mut Vec<Line>, after_restart: bool) {
    let prefix = match after_restart {
        false => "attach",
        true => "attach-after-restart",
    };
    for gib in ATTACH_GIB {
        let region = chunked_name(gib);
        let (memd, floor) = (
            format!("{prefix}/{gib}GiB/memd"),
            format!("{prefix}/{gib}GiB/raw"),
        );
        line(lines, &memd, &floor, ATTACH_TARGET, Extra::None);
        if after_restart {
            group.bench_pair_prepared(
                &format!("{prefix}/{gib}GiB"),
                || bench.restarted(),
                (&memd, || bench.time_attach(&region)),
                (&floor, || bench.time_raw_import(&region)),
            );
            continue;
        }
        let request = format!("{prefix}/{gib}GiB/raw-and-request");
        line(lines, &memd, &request, Target::None, Extra::None);
        bench.ready();
        group.bench_interleaved(
            &format!("{prefix}/{gib}GiB"),
            &mut [
                (&memd, &mut || bench.time_attach(&region)),
                (&floor, &mut || bench.time_raw_import(&region)),
                (&request, &mut || bench.time_raw_import_and_request(&region)),
            ],
        );
    }
}

fn packed(group: &mut Group<'_>, bench: &Bench<'_>, lines: &mut Vec<Line>) {
    let id = format!("attach/{PACKED_GIB}GiB-{PACKED_TENSORS}-tensors-packed");
    let (memd, floor) = (format!("{id}/memd"), format!("{id}/raw"));
    let request = format!("{id}/raw-and-request");
    line(lines, &memd, &floor, PACKED_TARGET, Extra::None);
    line(lines, &memd, &request, Target::None, Extra::None);
    bench.ready();
    group.bench_interleaved(
        &id,
        &mut [
            (&memd, &mut || bench.time_attach(PACKED_NAME)),
            (&floor, &mut || bench.time_raw_import(PACKED_NAME)),
            (&request, &mut || {
                bench.time_raw_import_and_request(PACKED_NAME)
            }),
        ],
    );
}

/// What a reader thread is told.
enum Go {
    /// Attach with the others: wait at the first barrier, attach (timed), wait at the
    /// second, then detach and unmap.
    Together(Arc<Barrier>, Arc<Barrier>),
    /// Attach alone, then detach and unmap.
    Alone,
    /// The floor: import the held fds of [`PACKED_NAME`] with the others (the same
    /// barriers), with no service in the way; unmap untimed.
    RawTogether(Arc<Barrier>, Arc<Barrier>),
}

/// [`READERS`] threads, each with its own connection to the service.
struct Readers {
    go: Vec<Sender<Go>>,
    done: Receiver<Result<Duration, String>>,
    threads: Vec<JoinHandle<()>>,
}

impl Readers {
    fn start(name: &Name) -> Readers {
        let (done_tx, done) = mpsc::channel();
        let (mut go, mut threads) = (Vec::new(), Vec::new());
        for _ in 0..READERS {
            let (tx, rx) = mpsc::channel();
            let (name, done) = (name.clone(), done_tx.clone());
            threads.push(std::thread::spawn(move || {
                if let Err(e) = reader(&name, &rx, &done) {
                    let _ = done.send(Err(e));
                }
            }));
            go.push(tx);
        }
        Readers { go, done, threads }
    }

    /// All attach at once: each reader's time.
    fn round(&self) -> Vec<Duration> {
        self.all(Go::Together)
    }

    /// All import the held fds at once: each reader's time.
    fn raw_round(&self) -> Vec<Duration> {
        self.all(Go::RawTogether)
    }

    fn all(&self, what: fn(Arc<Barrier>, Arc<Barrier>) -> Go) -> Vec<Duration> {
        let (start, end) = (
            Arc::new(Barrier::new(READERS)),
            Arc::new(Barrier::new(READERS)),
        );
        for go in &self.go {
            go.send(what(Arc::clone(&start), Arc::clone(&end)))
                .expect("a reader");
        }
        (0..READERS).map(|_| self.wait()).collect()
    }

    /// The first reader alone: its time.
    fn alone(&self) -> Duration {
        self.go[0].send(Go::Alone).expect("a reader");
        self.wait()
    }

    fn wait(&self) -> Duration {
        match self.done.recv_timeout(CHILD_WAIT) {
            Ok(Ok(elapsed)) => elapsed,
            Ok(Err(e)) => panic!("a reader failed: {e}"),
            Err(e) => panic!("no reader's time: {e}"),
        }
    }

    fn stop(self) {
        drop(self.go);
        for thread in self.threads {
            thread.join().expect("a reader thread");
        }
    }
}

/// A reader thread: connect, then attach [`PACKED_NAME`] each time it is told to, and send
/// the attach's time (its error, if one fails).
fn reader(
    name: &Name,
    go: &Receiver<Go>,
    done: &Sender<Result<Duration, String>>,
) -> Result<(), String> {
    let client = Client::connect(name).map_err(|e| format!("connect: {e}"))?;
    let (resource, descriptor) = held_by_reader(&client)?;
    while let Ok(what) = go.recv() {
        let together = match what {
            Go::Together(start, end) => {
                start.wait();
                Some(end)
            }
            Go::Alone => None,
            Go::RawTogether(start, end) => {
                start.wait();
                let t = Instant::now();
                let buffer = resource.import(&descriptor);
                let elapsed = t.elapsed();
                end.wait();
                drop(buffer.map_err(|e| format!("import: {e}"))?);
                if done.send(Ok(elapsed)).is_err() {
                    return Ok(());
                }
                continue;
            }
        };
        let t = Instant::now();
        let attached = client.attach(PACKED_NAME);
        let elapsed = t.elapsed();
        if let Some(end) = together {
            end.wait();
        }
        let attached = attached.map_err(|e| format!("attach: {e}"))?;
        client
            .detach(&attached)
            .map_err(|e| format!("detach: {e}"))?;
        drop(attached);
        if done.send(Ok(elapsed)).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// A reader thread's own floor: a read-only resource of the packed region's device and a
/// descriptor of the region's chunk fds (its own, taken with `attach_unmapped`; the lease
/// given back), as the bench's raw import holds them.
fn held_by_reader(client: &Client) -> Result<(VirtualMemoryResource, IpcDescriptor), String> {
    let unmapped = client
        .attach_unmapped(PACKED_NAME, None)
        .map_err(|e| format!("attach_unmapped: {e}"))?;
    let uuid = unmapped.device.ok_or("the packed region is not on a GPU")?;
    let device = Device::by_uuid(&uuid).map_err(|e| format!("device: {e}"))?;
    let resource = VirtualMemoryResource::new(&device, ResourceOptions::default().read_only(true))
        .map_err(|e| format!("resource: {e}"))?;
    let fds: Vec<BorrowedFd<'_>> = unmapped.chunks.iter().map(|(fd, _)| fd.as_fd()).collect();
    let sizes: Vec<usize> = unmapped.chunks.iter().map(|&(_, s)| s as usize).collect();
    let total = sizes.iter().sum();
    let descriptor = IpcDescriptor::from_fds(&fds, &sizes, HandleType::PosixFd, total)
        .map_err(|e| format!("descriptor: {e}"))?;
    client
        .detach_lease(unmapped.lease)
        .map_err(|e| format!("detach: {e}"))?;
    Ok((resource, descriptor))
}

fn readers(group: &mut Group<'_>, bench: &Bench<'_>, lines: &mut Vec<Line>) {
    let id = format!("attach-{READERS}-readers/{PACKED_GIB}GiB-packed");
    let [each, round, lone, raw_each, raw_round, raw_lone] =
        ["each", "round", "lone", "raw-each", "raw-round", "raw-lone"].map(|f| format!("{id}/{f}"));
    line(lines, &each, &lone, READERS_TARGET, Extra::None);
    line(lines, &round, &lone, Target::None, Extra::None);
    // The driver's own floor: eight raw imports at once against one alone, and what the
    // service adds to each of eight.
    line(lines, &raw_each, &raw_lone, Target::None, Extra::None);
    line(lines, &each, &raw_each, Target::None, Extra::None);
    let (each_key, raw_each_key) = (key(GROUP, &each), key(GROUP, &raw_each));
    bench.ready();
    let readers = Readers::start(&bench.name());
    // Untimed: each connection's first attach, each thread's first import.
    drop(readers.round());
    drop(readers.raw_round());
    group.bench_interleaved(
        &id,
        &mut [
            (&round, &mut || {
                let times = readers.round();
                record::record(&each_key, &times);
                times.into_iter().max().unwrap_or_default()
            }),
            (&lone, &mut || readers.alone()),
            (&raw_round, &mut || {
                let times = readers.raw_round();
                record::record(&raw_each_key, &times);
                times.into_iter().max().unwrap_or_default()
            }),
            (&raw_lone, &mut || bench.time_raw_import(PACKED_NAME)),
        ],
    );
    readers.stop();
    record::note_interleaved(&[
        &each_key,
        &raw_each_key,
        &key(GROUP, &lone),
        &key(GROUP, &raw_lone),
    ]);
}

fn sleep_wake(group: &mut Group<'_>, bench: &Bench<'_>, lines: &mut Vec<Line>) {
    for gib in SLEEP_GIB {
        let region = chunked_name(gib);
        let (memd, floor) = (
            format!("sleep-wake/{gib}GiB/memd"),
            format!("sleep-wake/{gib}GiB/raw"),
        );
        line(lines, &memd, &floor, SLEEP_TARGET, Extra::PerGib(gib));
        let requests = format!("sleep-wake/{gib}GiB/raw-and-requests");
        line(lines, &memd, &requests, Target::None, Extra::PerGib(gib));
        bench.ready();
        let attached = RefCell::new(Some(bench.client().attach(&region).expect("attach")));
        let import = || {
            let descriptor = &bench.held(&region).descriptor;
            bench.gpu().reader.import(descriptor).expect("import")
        };
        let (mapped, mapped_too) = (RefCell::new(Some(import())), RefCell::new(Some(import())));
        // The floor: unmap and release, then import at the same range.
        let raw = |mapped: &RefCell<Option<VirtualMemoryBuffer>>, requests: usize| {
            let (reader, descriptor) = (&bench.gpu().reader, &bench.held(&region).descriptor);
            let client = bench.client();
            let buffer = mapped.borrow_mut().take().expect("mapped");
            let t = Instant::now();
            for _ in 0..requests {
                black_box(client.renew().expect("renew"));
            }
            let range = buffer
                .into_address_range()
                .unwrap_or_else(|_| panic!("the floor's buffer is shared"));
            let buffer = reader
                .import_at(descriptor, range)
                .unwrap_or_else(|failed| panic!("import_at: {}", failed.0));
            let elapsed = t.elapsed();
            *mapped.borrow_mut() = Some(buffer);
            elapsed
        };
        group.bench_interleaved(
            &format!("sleep-wake/{gib}GiB"),
            &mut [
                (&memd, &mut || {
                    let client = bench.client();
                    let awake = attached.borrow_mut().take().expect("attached");
                    let t = Instant::now();
                    let sleeping = client.sleep(awake).expect("sleep");
                    let woken = client
                        .wake(sleeping)
                        .unwrap_or_else(|failed| panic!("wake: {}", failed.error));
                    let elapsed = t.elapsed();
                    *attached.borrow_mut() = Some(woken);
                    elapsed
                }),
                (&floor, &mut || raw(&mapped, 0)),
                // A sleep ends a lease (one request), a wake attaches (another).
                (&requests, &mut || raw(&mapped_too, 2)),
            ],
        );
        if let Some(awake) = attached.take() {
            // Its lease may have expired meanwhile (10 s without a renewal): no matter.
            let _ = bench.client().detach(&awake);
        }
        drop((mapped, mapped_too));
    }
}

/// One line per row that ran, on stdout.
fn print_lines(lines: &[Line], bench: &Bench<'_>) {
    if let Some(gpu) = bench.gpu.get() {
        println!(
            "{GROUP}: device {}; the publish floor allocates with handle type {:?}, as the \
             service does",
            vmm_core::cuda::format_uuid(&gpu.uuid),
            gpu.handle_type
        );
    }
    for l in lines {
        let Some(figure) = record::summary(&l.figure) else {
            continue;
        };
        let baseline = record::summary(&l.baseline);
        let short = |k: &str| k.rsplit('/').next().unwrap_or(k).to_owned();
        let id = l
            .figure
            .strip_prefix(&format!("{GROUP}/"))
            .and_then(|f| f.rsplit_once('/'))
            .map_or(l.figure.clone(), |(id, _)| id.to_owned());
        let mut text = format!(
            "{GROUP} {id}: {} {} (p10 {}, p90 {}, {} it)",
            short(&l.figure),
            format_ns(figure.median_ns),
            format_ns(figure.p10_ns),
            format_ns(figure.p90_ns),
            figure.iterations
        );
        if let Some(b) = baseline {
            text.push_str(&format!(
                " vs {} {} ({} it): {:.3}x",
                short(&l.baseline),
                format_ns(b.median_ns),
                b.iterations,
                figure.median_ns / b.median_ns
            ));
        }
        match l.extra {
            Extra::None => {}
            Extra::Gms(low, high) => {
                text.push_str(&format!("; GMS's own cost {low:.0}-{high:.0} ms"));
            }
            Extra::PerGib(gib) => {
                let per = |ns: f64| format_ns(ns / gib as f64);
                text.push_str(&format!("; {}/GiB", per(figure.median_ns)));
                if let Some(b) = baseline {
                    text.push_str(&format!(" vs {}/GiB", per(b.median_ns)));
                }
            }
        }
        let verdict = l
            .target
            .verdict(figure.median_ns, baseline.map(|b| b.median_ns));
        text.push_str(&match verdict {
            Some(pass) => format!(
                "; target {}: {}",
                l.target.describe(),
                if pass { "pass" } else { "miss" }
            ),
            None => "; no target".to_owned(),
        });
        println!("{text}");
    }
}

/// The `gpu-memd` figures (a GPU machine only: [`crate::run`] prints the SKIP line
/// elsewhere).
pub fn gpu_memd(c: &mut Criterion, cuda: &RawCuda) {
    let settings = Settings::from_env();
    let bench = Bench::new(cuda, settings.quick);
    let mut lines = Vec::new();
    let mut group = Group::new(c, GROUP, Kind::Processes);
    // Bounded: 16 GiB a publish iteration, 98 GiB held for the attach figures; each
    // figure's setup runs outside these times (see the module docs).
    if !settings.times_from_args {
        match settings.quick {
            true => group.times(Duration::from_millis(20), Duration::from_millis(100)),
            false => group.times(Duration::from_millis(200), Duration::from_millis(1500)),
        }
    }
    publish(&mut group, &bench, &mut lines);
    if !settings.times_from_args && !settings.quick {
        group.times(Duration::from_millis(200), Duration::from_secs(1));
    }
    attach(&mut group, &bench, &mut lines, false);
    packed(&mut group, &bench, &mut lines);
    readers(&mut group, &bench, &mut lines);
    sleep_wake(&mut group, &bench, &mut lines);
    attach(&mut group, &bench, &mut lines, true);
    group.finish();
    print_lines(&lines, &bench);
    bench.stop();
}
