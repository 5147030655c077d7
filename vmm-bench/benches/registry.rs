//! `cargo bench -p vmm-bench --bench registry`: the registry (issue 27, item 9) against a
//! bare etcd in the same run, on one TLS etcd started for the run (loopback, client
//! certificates; the test suite's own, `vmm-registry/tests/support`).
//!
//! - `registry/publish`: `Registry::publish` of a new name (the create-only transaction on the
//!   process's lease, through the registry's background thread), next to
//!   `registry/etcd-put`: a bare `put` of the same bytes with a raw gRPC client of etcd (the
//!   test suite's, on vmm-etcd-api's generated clients) on this thread's runtime. The
//!   difference is the transaction's compare and the hop to the thread.
//! - `registry/watch-to-imported`: from a watch event's arrival (a locator another process's
//!   registry just published) to imported: fetch over the mutual-TLS stream (handshake both
//!   ways, request, descriptor), map the host stand-in, acknowledge. Next to
//!   `registry/etcd-get`: a bare `get` of one key.
//!
//! Where etcd is not installed it prints `SKIP registry: ...` and exits 0
//! (`VMM_REQUIRE_ETCD=1`: exit 1). `VMM_BENCH_QUICK=1` shortens it as for the main bench.

#[path = "../../vmm-registry/tests/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_registry::{Registry, WatchEvent};

use support::World;
use support::handoff::{SIZE, fetcher, locator_at, offer, options, server};

const GROUP: &str = "registry";

fn main() -> ExitCode {
    if support::etcd::etcd_binary().is_none() {
        println!("SKIP {GROUP}: etcd is not installed (apt-get install etcd-server)");
        let strict = std::env::var("VMM_REQUIRE_ETCD").is_ok_and(|v| v == "1");
        return if strict {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
    }
    let world = World::start(GROUP).expect("etcd is installed");
    let mut criterion = vmm_bench::Settings::from_env().criterion();
    publish(&mut criterion, &world);
    watch_to_imported(&mut criterion, &world);
    criterion.final_summary();
    ExitCode::SUCCESS
}

/// A current-thread runtime and a raw etcd client of `world`'s etcd (the bare baseline).
fn raw_client(world: &World) -> (tokio::runtime::Runtime, support::raw::Raw) {
    world.raw_client("raw")
}

fn publish(criterion: &mut Criterion, world: &World) {
    let registry = Registry::open(world.config("alice").lease_ttl(Duration::from_secs(60)))
        .expect("open the registry");
    let locator = support::locator("alice", 1);
    let value = serde_json::to_vec(&locator).expect("json");
    let (runtime, mut client) = raw_client(world);
    let mut group = criterion.benchmark_group(GROUP);
    let mut n = 0u64;
    group.bench_function("publish", |b| {
        numbered(b, &mut n, |n| {
            let name = format!("kv{n}");
            let started = Instant::now();
            black_box(registry.publish(&name, &locator).expect("publish"));
            started.elapsed()
        })
    });
    let mut m = 0u64;
    group.bench_function("etcd-put", |b| {
        numbered(b, &mut m, |m| {
            let key = format!("/bench/put/{m}");
            let started = Instant::now();
            runtime
                .block_on(client.put(key, value.clone()))
                .expect("put");
            started.elapsed()
        })
    });
    group.finish();
    registry.close().expect("close");
}

fn watch_to_imported(criterion: &mut Criterion, world: &World) {
    // The exporter: its own registry, and a server offering the stand-in at each generation
    // it publishes.
    let exporter = Registry::open(world.config("exporter").lease_ttl(Duration::from_secs(60)))
        .expect("open the exporter's registry");
    let server = server(
        &options(&world.pki, "exporter", &["importer"]),
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let (buf, descriptor, _fd) = support::stand_in::export(SIZE);
    offer(&server, 1, descriptor);
    let importer = world.open("importer");
    let watch = importer.watch().expect("watch");
    let fetcher = fetcher(&world.pki, "importer");
    let locator = locator_at("exporter", "exporter", server.local_addr(), 1);
    let (runtime, mut client) = raw_client(world);
    runtime
        .block_on(client.put("/bench/get", vec![b'x'; 300]))
        .expect("put the key to get");
    let mut group = criterion.benchmark_group(GROUP);
    let mut n = 0u64;
    group.bench_function("watch-to-imported", |b| {
        numbered(b, &mut n, |n| {
            exporter
                .publish(&format!("kv{n}"), &locator)
                .expect("publish");
            let entry = match watch.next_timeout(Duration::from_secs(5)).expect("watch") {
                Some(WatchEvent::Put(entry)) => entry,
                other => panic!("expected a put, got {other:?}"),
            };
            let started = Instant::now();
            let fetched = fetcher.fetch(&entry.locator).expect("fetch");
            let imported =
                support::stand_in::import(fetched.descriptor()).expect("map the stand-in");
            black_box(imported.as_ptr());
            fetched.acknowledge().expect("acknowledge");
            let spent = started.elapsed();
            drop(imported);
            // The exporter's report of this hand-off, so none queues up.
            let _ = server.next_served(Duration::from_secs(5));
            spent
        })
    });
    group.bench_function("etcd-get", |b| {
        b.iter(|| black_box(runtime.block_on(client.get("/bench/get")).expect("get")))
    });
    group.finish();
    drop(buf);
    exporter.close().expect("close");
}

/// Run `iters` iterations of `one`, each given the next number from `next` (keys must be
/// new each time) and returning the time of its measured part; their sum.
fn numbered(b: &mut criterion::Bencher<'_>, next: &mut u64, mut one: impl FnMut(u64) -> Duration) {
    b.iter_custom(|iters| {
        (0..iters)
            .map(|_| {
                *next += 1;
                one(*next)
            })
            .sum()
    })
}
