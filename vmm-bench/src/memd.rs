//! `host-memd`: the memory service of `vmm-memd` (issue 26, item 11) on the host (memfd)
//! backend, next to the raw floor measured in the same run, between the same two processes
//! (the bench and a `vmm-memd` child, see [`crate::memd_service`]). Chunks are 1 MiB.
//!
//! - `attach/{1,4,16}-chunk/memd`: `Client::attach` on an open connection: the `Attach`
//!   request, the service's lookup and lease, the reply, one `HOST_MEMFD` message per chunk,
//!   the client's seal checks and read-only `mmap` of each (detach and unmap untimed). Floor
//!   `attach/{k}-chunk/raw-socket`, interleaved: a 2-byte request on a plain Unix socket to a
//!   thread of the service process, which answers with one `sendmsg` (8 bytes + the fd in
//!   `SCM_RIGHTS`) per chunk; the bench `recvmsg`s each, `mmap`s it and closes the fd.
//! - `connect-attach/4-chunk/memd`: `Client::connect` (the endpoint's handshake, both
//!   credential checks, the service's pidfd) and the attach, from nothing to mapped. Floor
//!   `connect-attach/4-chunk/raw-socket`: a plain `connect` to the raw responder, then the
//!   raw attach above.
//! - `commit/4-chunk/memd`: `Writer::commit` of 4 chunks just filled (begin and fill
//!   untimed): the writer's unmap, `PutMeta`, `Commit` (the service seals each memfd, hands
//!   the generation to its keeper, makes it current, frees the previous one). Floor
//!   `commit/4-chunk/raw-seal`, interleaved: what a commit must do at least: the writer's
//!   unmap of 4 filled chunks (memfds the responder made and sent, untimed), one round trip
//!   in which the responder seals each against writes, in the service's two calls. Not a
//!   floor in practice: on the 2-core development VM the floor's unmap alone took 150 to
//!   290 us, and its median came out above memd's commit (0.6x to 0.7x in four runs; an
//!   extra round trip before the seal, the seal's form and a pause before the clock changed
//!   nothing); why the same unmap costs less inside `Writer::commit` is not established.
//! - `attaches/{1,4,16,64}-readers`: throughput. That many reader processes (vmm-core spawn
//!   children of the bench, each with its own connection), started untimed; one iteration is
//!   a round of [`ROUND`] attaches (attach, read a byte of each chunk, detach) shared evenly
//!   among them: the parent tells each reader its share, and the round ends with the last
//!   reader's acknowledgement. Attaches per second = [`ROUND`] / the round's time, printed
//!   after the group (`host-memd attaches/s: ...`); rows compare each count with one reader.
//!   A round's own cost (one message to and from each reader) grows with the readers: at 64
//!   it is 64 sends and 64 acknowledgements for 64 attaches.
//!
//! Nothing starts before a figure runs, so a filtered run that skips this group starts no
//! service.

use std::cell::OnceCell;
use std::hint::black_box;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::process::{Context, Process, StartMethod};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::Queue;
use vmm_core::wire::endpoint::Name;
use vmm_memd::Client;
use vmm_memd::protocol::{Dtype, TensorMeta};

use crate::memd_service::{CHUNK, RawOp, ServiceProcess, raw_request};
use crate::report::{Target, row};
use crate::{CHILD_WAIT, Group, Kind, key, raw, record};

/// The group (its name starts with `host-`, so the CI smoke run's filter takes it).
pub const GROUP: &str = "host-memd";

/// Chunk counts of the attach figures.
pub const CHUNK_COUNTS: [usize; 3] = [1, 4, 16];

/// Reader counts of the throughput figures.
pub const READERS: [usize; 4] = [1, 4, 16, 64];

/// Attaches per throughput round, shared among the readers.
pub const ROUND: usize = 64;

/// Chunks of the connect-attach and commit figures.
const FOUR: usize = 4;

fn region(chunks: usize) -> String {
    format!("bench-{chunks}")
}

fn meta(chunk: usize) -> TensorMeta {
    TensorMeta {
        chunk: chunk as u32,
        offset: 0,
        len: CHUNK as u64,
        dtype: Dtype::U8,
        shape: vec![CHUNK as u64],
    }
}

/// The service with one region per chunk count published, a connection to it and one to
/// the raw responder.
struct Fixture {
    service: ServiceProcess,
    client: Client,
    raw: UnixStream,
}

impl Fixture {
    fn start() -> Fixture {
        let service = ServiceProcess::start();
        let client = Client::connect(&service.name).expect("connect to vmm-memd");
        for k in CHUNK_COUNTS {
            let mut writer = client
                .begin(&region(k), &vec![CHUNK as u64; k], Default::default())
                .expect("begin");
            for (i, chunk) in writer.chunks().iter().enumerate() {
                chunk.fill(i as u8 + 1).expect("fill");
            }
            for i in 0..k {
                writer.put(&format!("t{i}"), meta(i));
            }
            writer.commit().expect("commit");
        }
        let raw = service.raw_connect();
        let fixture = Fixture {
            service,
            client,
            raw,
        };
        fixture.warm();
        fixture
    }

    /// A few untimed rounds of each figure's work: the figure that starts the fixture would
    /// otherwise time a cold first iteration, and criterion, whose warm-up ends after that
    /// one iteration when the start took longer than the warm-up time, would plan the whole
    /// figure from it (11 iterations in a quick run instead of hundreds).
    fn warm(&self) {
        for _ in 0..3 {
            for k in CHUNK_COUNTS {
                let attached = self.client.attach(&region(k)).expect("attach");
                self.client.detach(&attached).expect("detach");
                raw_unmap(raw_attach(&self.raw, k));
            }
            let client = Client::connect(&self.service.name).expect("connect");
            drop(client.attach(&region(FOUR)).expect("attach"));
            raw_unmap(raw_attach(&self.service.raw_connect(), FOUR));
        }
    }
}

/// The raw attach: request `k` chunks, receive and map each (closing its fd).
fn raw_attach(stream: &UnixStream, k: usize) -> Vec<std::ptr::NonNull<std::ffi::c_void>> {
    raw_request(stream, RawOp::Hand, k);
    (0..k)
        .map(|_| {
            let (fd, size) = raw::recv_fd(stream.as_fd()).expect("a chunk's fd");
            raw::mmap_shared(fd.as_fd(), size)
        })
        .collect()
}

fn raw_unmap(maps: Vec<std::ptr::NonNull<std::ffi::c_void>>) {
    for ptr in maps {
        raw::munmap(ptr, CHUNK);
    }
}

fn attach(group: &mut Group<'_>, fixture: &OnceCell<Fixture>) {
    for k in CHUNK_COUNTS {
        let (memd, floor) = (
            format!("attach/{k}-chunk/memd"),
            format!("attach/{k}-chunk/raw-socket"),
        );
        row(&key(GROUP, &memd), &key(GROUP, &floor), Target::None);
        let name = region(k);
        group.bench_pair(
            &format!("attach/{k}-chunk"),
            (&memd, || {
                let f = fixture.get_or_init(Fixture::start);
                let t = Instant::now();
                let attached = f.client.attach(&name).expect("attach");
                let elapsed = t.elapsed();
                f.client.detach(&attached).expect("detach");
                elapsed
            }),
            (&floor, || {
                let f = fixture.get_or_init(Fixture::start);
                let t = Instant::now();
                let maps = raw_attach(&f.raw, k);
                let elapsed = t.elapsed();
                raw_unmap(maps);
                elapsed
            }),
        );
    }
}

fn connect_attach(group: &mut Group<'_>, fixture: &OnceCell<Fixture>) {
    let (memd, floor) = (
        format!("connect-attach/{FOUR}-chunk/memd"),
        format!("connect-attach/{FOUR}-chunk/raw-socket"),
    );
    row(&key(GROUP, &memd), &key(GROUP, &floor), Target::None);
    let name = region(FOUR);
    group.bench_pair(
        &format!("connect-attach/{FOUR}-chunk"),
        (&memd, || {
            let f = fixture.get_or_init(Fixture::start);
            let t = Instant::now();
            let client = Client::connect(&f.service.name).expect("connect");
            let attached = client.attach(&name).expect("attach");
            let elapsed = t.elapsed();
            // The lease ends with the connection.
            drop((attached, client));
            elapsed
        }),
        (&floor, || {
            let f = fixture.get_or_init(Fixture::start);
            let t = Instant::now();
            let stream = f.service.raw_connect();
            let maps = raw_attach(&stream, FOUR);
            let elapsed = t.elapsed();
            raw_unmap(maps);
            elapsed
        }),
    );
}

fn commit(group: &mut Group<'_>, fixture: &OnceCell<Fixture>) {
    let (memd, floor) = (
        format!("commit/{FOUR}-chunk/memd"),
        format!("commit/{FOUR}-chunk/raw-seal"),
    );
    row(&key(GROUP, &memd), &key(GROUP, &floor), Target::None);
    let mut filled = 0u8;
    group.bench_pair(
        &format!("commit/{FOUR}-chunk"),
        (&memd, || {
            let f = fixture.get_or_init(Fixture::start);
            let mut writer = f
                .client
                .begin("bench-commit", &[CHUNK as u64; FOUR], Default::default())
                .expect("begin");
            filled = filled.wrapping_add(1);
            for chunk in writer.chunks() {
                chunk.fill(filled).expect("fill");
            }
            for i in 0..FOUR {
                writer.put(&format!("t{i}"), meta(i));
            }
            let t = Instant::now();
            let generation = writer.commit().expect("commit");
            let elapsed = t.elapsed();
            black_box(generation);
            elapsed
        }),
        (&floor, || {
            let f = fixture.get_or_init(Fixture::start);
            raw_request(&f.raw, RawOp::Prepare, FOUR);
            let chunks: Vec<HostBuffer> = (0..FOUR)
                .map(|_| {
                    let (fd, size) = raw::recv_fd(f.raw.as_fd()).expect("a pending chunk");
                    let descriptor = HostDescriptor::from_fd(fd.as_fd(), size).expect("wrap");
                    let chunk = HostBuffer::import(&descriptor).expect("map the chunk");
                    chunk.fill(7).expect("fill");
                    chunk
                })
                .collect();
            let t = Instant::now();
            drop(chunks);
            raw_request(&f.raw, RawOp::Seal, FOUR);
            raw::wait_ack(f.raw.as_fd());
            t.elapsed()
        }),
    );
}

/// A reader process: connect, say so, then for each share it is told, attach, read a byte
/// of each chunk, detach, that many times, and acknowledge; a share of 0 ends it.
pub fn reader_main((socket, name, shares, acks): (String, String, Queue<u32>, Queue<u8>)) {
    let client = Client::connect(&Name::from(socket.as_str())).expect("reader: connect");
    acks.put(&1).expect("reader: ready");
    loop {
        let share = shares.get(CHILD_WAIT).expect("reader: its share");
        if share == 0 {
            return;
        }
        for _ in 0..share {
            let attached = client.attach(&name).expect("reader: attach");
            let sum: u32 = attached
                .chunks
                .iter()
                .map(|c| u32::from(c.as_slice()[0]))
                .sum();
            black_box(sum);
            client.detach(&attached).expect("reader: detach");
        }
        acks.put(&1).expect("reader: acknowledge");
    }
}

/// `n` live reader processes.
struct Readers {
    processes: Vec<Process>,
    shares: Vec<Queue<u32>>,
    acks: Queue<u8>,
}

impl Readers {
    fn start(n: usize, service: &ServiceProcess) -> Readers {
        let acks = Queue::new().expect("queue");
        let socket = service.socket.clone();
        let (mut processes, mut shares) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for _ in 0..n {
            let share = Queue::new().expect("queue");
            let args = (socket.clone(), region(FOUR), share.clone(), acks.clone());
            processes.push(
                Context::new(StartMethod::Spawn)
                    .spawn(reader_main, args)
                    .expect("start a reader"),
            );
            shares.push(share);
        }
        for _ in 0..n {
            acks.get(CHILD_WAIT).expect("a reader connected");
        }
        let readers = Readers {
            processes,
            shares,
            acks,
        };
        // Untimed: each reader's first attaches (see `Fixture::warm`).
        readers.round();
        readers
    }

    /// One round of [`ROUND`] attaches, shared evenly; its time.
    fn round(&self) -> Duration {
        let share = (ROUND / self.shares.len()) as u32;
        let t = Instant::now();
        for queue in &self.shares {
            queue.put(&share).expect("a reader's share");
        }
        for _ in 0..self.shares.len() {
            self.acks
                .get(CHILD_WAIT)
                .expect("a reader's acknowledgement");
        }
        t.elapsed()
    }

    fn stop(self) {
        for queue in &self.shares {
            queue.put(&0).expect("stop a reader");
        }
        for process in self.processes {
            process.join(CHILD_WAIT).expect("join a reader");
        }
    }
}

fn readers_id(n: usize) -> String {
    if n == 1 {
        "attaches/1-reader".to_owned()
    } else {
        format!("attaches/{n}-readers")
    }
}

fn throughput(group: &mut Group<'_>, fixture: &OnceCell<Fixture>) {
    for n in READERS.into_iter().skip(1) {
        row(
            &key(GROUP, &readers_id(n)),
            &key(GROUP, &readers_id(1)),
            Target::None,
        );
    }
    for n in READERS {
        let mut live: Option<Readers> = None;
        group.bench(&readers_id(n), || {
            let f = fixture.get_or_init(Fixture::start);
            live.get_or_insert_with(|| Readers::start(n, &f.service))
                .round()
        });
        if let Some(readers) = live {
            readers.stop();
        }
    }
}

/// Attaches per second of each reader count that ran, one line each on stdout.
fn print_rates() {
    for n in READERS {
        let id = readers_id(n);
        if let Some(s) = record::summary(&key(GROUP, &id)) {
            let rate = |ns: f64| ROUND as f64 / (ns / 1e9);
            println!(
                "{GROUP} attaches/s with {n:>2} readers: {:.0} (p90 round {:.0}, p10 round \
                 {:.0}; {} rounds)",
                rate(s.median_ns),
                rate(s.p90_ns),
                rate(s.p10_ns),
                s.iterations
            );
        }
    }
}

/// The `host-memd` figures (run everywhere).
pub fn host_memd(c: &mut Criterion) {
    let fixture: OnceCell<Fixture> = OnceCell::new();
    let mut group = Group::new(c, GROUP, Kind::Processes);
    attach(&mut group, &fixture);
    connect_attach(&mut group, &fixture);
    commit(&mut group, &fixture);
    throughput(&mut group, &fixture);
    group.finish();
    print_rates();
    // Stops the service (and its keeper) if a figure started it.
    drop(fixture);
}
