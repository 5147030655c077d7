//! The memory service publishes (issue 27 item 5): two vmm-memd instances play two nodes, each
//! with its own `vmm-memd-publish` (its own certificate, owner and loopback listener), against
//! a real etcd with mutual TLS, client-certificate authentication and RBAC.
//!
//! - the normal path: a region written on A is found by an engine process of node B through
//!   the registry, fetched over mutual TLS from A's publisher, mapped, and read intact, each
//!   tensor by its name at its offset (the region's metadata crosses with the descriptor);
//!   the publisher reports the acknowledgement; and the other way round for B's region;
//! - a new commit: the watch sees the new generation, the old one is refused as stale, the new
//!   one imports with the new contents; a deleted region's key goes and a fetch fails cleanly;
//! - a SIGKILLed publisher's keys go within TTL + 1 s; a SIGKILLed and restarted service is
//!   followed, its memory stays served throughout; a publisher whose registry lease etcd
//!   says is gone (SIGSTOPped past its TTL, or revoked) publishes again under a new lease;
//! - attacks: a region the publisher's uid may not read is never published; an importer
//!   whose certificate is not admitted gets nothing; another owner may not publish under A's
//!   prefix.

mod support;

#[path = "support/memd.rs"]
mod memd;

use std::time::{Duration, Instant};

use vmm_core::error::TlsReason;
use vmm_memd::protocol::{Acl, Dtype, Principal, TensorMeta};
use vmm_registry::memd_publish::{MemdPublisher, PublishEvent, PublisherConfig, RegionError};
use vmm_registry::{Entry, FetchError, HandleKind, Op, RegistryConfig, RegistryError, WatchEvent};
use vmm_tests::pki::dns_name;

use memd::{NOBODY, Publisher, PublisherSpec, Service, fetcher, import, write_region};
use support::{DOMAIN, World};

/// The size of every region here.
const SIZE: usize = 1 << 20;

/// The engine child (see support/memd.rs); a no-op as a test.
#[test]
fn engine_child() {
    memd::engine_child();
}

/// The next put of `owner`'s `name` within `timeout` (other events skipped).
fn next_put(watch: &vmm_registry::Watch, owner: &str, name: &str, timeout: Duration) -> Entry {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match watch.next_timeout(left).expect("the watch runs") {
            Some(WatchEvent::Put(entry)) if entry.owner == owner && entry.name == name => {
                return entry;
            }
            Some(_) => {}
            None => panic!("no put of {owner}/{name} within {timeout:?}"),
        }
    }
}

/// Wait up to `timeout` for the delete of `owner`'s `name` (other events skipped).
fn next_delete(watch: &vmm_registry::Watch, owner: &str, name: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match watch.next_timeout(left).expect("the watch runs") {
            Some(WatchEvent::Deleted {
                owner: o, name: n, ..
            }) if o == owner && n == name => return,
            Some(_) => {}
            None => panic!("no delete of {owner}/{name} within {timeout:?}"),
        }
    }
}

/// The tensors of A's `weights` at generation 1, in key order: at offsets that are not
/// multiples of the pattern's period, so a tensor read at the wrong offset reads other bytes.
fn tensors() -> Vec<(&'static str, TensorMeta)> {
    vec![
        (
            "layer0.bias",
            TensorMeta {
                chunk: 0,
                offset: 1000,
                len: 256,
                dtype: Dtype::F32,
                shape: vec![64],
            },
        ),
        (
            "layer0.weight",
            TensorMeta {
                chunk: 0,
                offset: 4096,
                len: 8192,
                dtype: Dtype::BF16,
                shape: vec![64, 64],
            },
        ),
    ]
}

fn spec<'s>(name: &'s str, admit: &'s [&'s str]) -> PublisherSpec<'s> {
    PublisherSpec {
        name,
        owner: name,
        admit,
        nobody: false,
        regions: &[],
    }
}

#[test]
fn two_nodes_find_fetch_and_follow_each_other_s_regions() {
    let Some(world) = World::start("two_nodes_find_fetch_and_follow_each_other_s_regions") else {
        return;
    };
    world.enable_rbac(&["node-a", "node-b", "engine-a", "engine-b"]);
    let (service_a, service_b) = (Service::start("a"), Service::start("b"));
    let (writer_a, writer_b) = (
        service_a.client().expect("writer on A"),
        service_b.client().expect("writer on B"),
    );
    assert_eq!(
        memd::write_tensors(&writer_a, "weights", SIZE, 1, &tensors()),
        1
    );
    write_region(&writer_b, "kv-b", SIZE, 5, Acl::default());
    let observer = world.open("engine-a");
    let watch = observer.watch().expect("watch");
    let publisher_a = Publisher::start(&world, &service_a, &spec("node-a", &["engine-b"]));
    let publisher_b = Publisher::start(&world, &service_b, &spec("node-b", &["engine-a"]));
    publisher_a.expect_line("published weights 1", Duration::from_secs(10));
    publisher_b.expect_line("published kv-b 1", Duration::from_secs(10));
    let first = next_put(&watch, "node-a", "weights", Duration::from_secs(5));
    assert_eq!(first.locator.generation, 1);
    assert_eq!(first.locator.size, SIZE as u64);
    assert_eq!(first.locator.handle, HandleKind::HostMemfd);
    assert_eq!(first.locator.exporter_name, dns_name("node-a"));

    // 1. An engine process of node B finds A's region, fetches it from A's publisher over
    // mutual TLS, maps it and reads what the writer wrote, and each tensor by its name at its
    // offset (the region's metadata came with the descriptor); A's publisher saw the ack.
    let lines = memd::run_engine_lines(&world, "engine-b", "node-a", "weights", 1, SIZE);
    let written = vmm_tests::pattern(1, SIZE);
    let mut expected: Vec<String> = tensors()
        .iter()
        .map(|(key, t)| {
            let bytes = &written[t.offset as usize..(t.offset + t.len) as usize];
            format!(
                "engine tensor {key} {:?} {:?} {} {} {:016x}",
                t.dtype,
                t.shape,
                t.offset,
                t.len,
                memd::fnv(bytes)
            )
        })
        .collect();
    expected.push("engine read node-a/weights 1 ok".into());
    assert_eq!(lines, expected);
    let served = publisher_a.expect_line("served weights 1 ", Duration::from_secs(5));
    assert!(served.ends_with(" acknowledged"), "{served}");

    // 2. The other way: B's region, found and read from A's side.
    let entry_b = observer
        .resolve("node-b", "kv-b")
        .expect("resolve")
        .expect("B published");
    assert_eq!(entry_b.locator.exporter_name, dns_name("node-b"));
    let bytes = import(&fetcher(&world.pki, "engine-a"), &entry_b.locator).expect("import B's");
    assert_eq!(bytes, vmm_tests::pattern(5, SIZE));
    let served = publisher_b.expect_line("served kv-b 1 ", Duration::from_secs(5));
    assert!(served.ends_with(" acknowledged"), "{served}");

    // 3. A new commit on A: the watch sees generation 2; generation 1 is refused as stale;
    // generation 2 imports with the new contents.
    assert_eq!(
        write_region(&writer_a, "weights", SIZE, 2, Acl::default()),
        2
    );
    let second = next_put(&watch, "node-a", "weights", Duration::from_secs(5));
    assert_eq!(second.locator.generation, 2);
    assert_eq!(second.locator.exporter_addr, first.locator.exporter_addr);
    publisher_a.expect_line("updated weights 2", Duration::from_secs(5));
    let engine_b = fetcher(&world.pki, "engine-b");
    match engine_b.fetch(&first.locator) {
        Err(FetchError::Stale {
            wanted: 1,
            serving: Some(2),
            ..
        }) => {}
        other => panic!("expected generation 1 stale, got {other:?}"),
    }
    let bytes = import(&engine_b, &second.locator).expect("import generation 2");
    assert_eq!(bytes, vmm_tests::pattern(2, SIZE));

    // 4. A deletes the region: its key goes within a poll (bounded here by 3 s), and the last
    // locator fails cleanly (nothing offered).
    writer_a.delete("weights").expect("delete");
    let deleted = Instant::now();
    next_delete(&watch, "node-a", "weights", Duration::from_secs(3));
    assert!(deleted.elapsed() < Duration::from_secs(3));
    publisher_a.expect_line("unpublished weights gone", Duration::from_secs(5));
    match engine_b.fetch(&second.locator) {
        Err(error @ FetchError::Stale { serving: None, .. }) => assert!(error.is_stale()),
        other => panic!("expected a withdrawn offer, got {other:?}"),
    }
    assert!(
        observer
            .resolve("node-a", "weights")
            .expect("resolve")
            .is_none()
    );
    // B's is untouched.
    assert!(
        observer
            .resolve("node-b", "kv-b")
            .expect("resolve")
            .is_some()
    );
}

#[test]
fn a_sigkilled_publisher_s_locators_go_within_ttl_plus_one_second() {
    let Some(world) =
        World::start("a_sigkilled_publisher_s_locators_go_within_ttl_plus_one_second")
    else {
        return;
    };
    let service = Service::start("a");
    let writer = service.client().expect("writer");
    write_region(&writer, "weights", SIZE, 1, Acl::default());
    write_region(&writer, "bias", SIZE, 2, Acl::default());
    let observer = world.open("engine-b");
    let watch = observer.watch().expect("watch");
    let mut publisher = Publisher::start(&world, &service, &spec("node-a", &["engine-b"]));
    next_put(&watch, "node-a", "weights", Duration::from_secs(10));
    assert!(
        observer
            .resolve("node-a", "bias")
            .expect("resolve")
            .is_some()
    );

    publisher.kill();
    let killed = Instant::now();
    // TTL 2 s: both keys gone within 3 s of the SIGKILL.
    next_delete(&watch, "node-a", "bias", Duration::from_secs(3));
    assert!(
        observer
            .resolve("node-a", "weights")
            .expect("resolve")
            .is_none()
    );
    assert!(
        killed.elapsed() < Duration::from_secs(3),
        "{:?}",
        killed.elapsed()
    );
    // The memory is the service's still: a reader there is unaffected.
    let attached = writer.attach("weights").expect("attach on the node");
    assert_eq!(attached.chunks[0].as_slice(), vmm_tests::pattern(1, SIZE));
}

#[test]
fn a_service_sigkilled_and_restarted_under_the_publisher_stays_served() {
    let Some(world) =
        World::start("a_service_sigkilled_and_restarted_under_the_publisher_stays_served")
    else {
        return;
    };
    // A short service lease TTL (1.5 s): the publisher must renew (every TTL/3) to keep it.
    let mut service = Service::start_with("a", &["--lease-ttl-ms", "1500"]);
    write_region(
        &service.client().expect("writer"),
        "weights",
        SIZE,
        1,
        Acl::default(),
    );
    let observer = world.open("engine-b");
    let publisher = Publisher::start(&world, &service, &spec("node-a", &["engine-b"]));
    publisher.expect_line("published weights 1", Duration::from_secs(10));
    let before = observer
        .resolve("node-a", "weights")
        .expect("resolve")
        .expect("published");
    let engine_b = fetcher(&world.pki, "engine-b");
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        service.readers("weights"),
        [(1, vec![publisher.pid()])],
        "the publisher's lease, renewed over more than two TTLs"
    );

    service.kill();
    publisher.expect_line("service-gone", Duration::from_secs(5));
    // Meanwhile what is offered stays offered: the publisher holds the chunks.
    let bytes = import(&engine_b, &before.locator).expect("import while the service is down");
    assert_eq!(bytes, vmm_tests::pattern(1, SIZE));

    service.restart();
    publisher.expect_line("reconnected", Duration::from_secs(10));
    let after = observer
        .resolve("node-a", "weights")
        .expect("resolve")
        .expect("still published");
    assert_eq!(after.locator, before.locator);
    let bytes = import(&engine_b, &after.locator).expect("import after the restart");
    assert_eq!(bytes, vmm_tests::pattern(1, SIZE));
    // Attached again, under a lease of the new service.
    assert_eq!(service.readers("weights"), [(1, vec![publisher.pid()])]);

    // The restarted service's next commit is followed, and the old lease given back (the
    // retired generation is freed).
    let generation = write_region(
        &service.client().expect("writer again"),
        "weights",
        SIZE,
        3,
        Acl::default(),
    );
    publisher.expect_line(
        &format!("updated weights {generation}"),
        Duration::from_secs(5),
    );
    let updated = observer
        .resolve("node-a", "weights")
        .expect("resolve")
        .expect("published");
    assert_eq!(updated.locator.generation, generation);
    let bytes = import(&engine_b, &updated.locator).expect("import the new generation");
    assert_eq!(bytes, vmm_tests::pattern(3, SIZE));
    assert_eq!(
        service.readers("weights"),
        [(generation, vec![publisher.pid()])]
    );
}

#[test]
fn only_the_regions_asked_for_are_published_and_sigterm_unpublishes_at_once() {
    let Some(world) =
        World::start("only_the_regions_asked_for_are_published_and_sigterm_unpublishes_at_once")
    else {
        return;
    };
    let service = Service::start("a");
    let writer = service.client().expect("writer");
    write_region(&writer, "weights", SIZE, 1, Acl::default());
    write_region(&writer, "scratch", SIZE, 2, Acl::default());
    let observer = world.open("engine-b");
    let watch = observer.watch().expect("watch");
    let mut publisher = Publisher::start(
        &world,
        &service,
        &PublisherSpec {
            regions: &["weights", "not-there-yet"],
            ..spec("node-a", &["engine-b"])
        },
    );
    publisher.expect_line("published weights 1", Duration::from_secs(10));
    // A region asked for that appears later is published then.
    write_region(&writer, "not-there-yet", SIZE, 3, Acl::default());
    publisher.expect_line("published not-there-yet 1", Duration::from_secs(5));
    let mut names: Vec<String> = observer
        .list()
        .expect("list")
        .entries
        .into_iter()
        .map(|entry| entry.name)
        .collect();
    names.sort();
    assert_eq!(names, ["not-there-yet", "weights"]);

    // SIGTERM: the lease is revoked, the locators go at once. (With a TTL of 2 s kept alive
    // every 0.67 s, at least 1.33 s of it is left at any moment: a delete sooner than that is
    // the revoke, not the expiry.)
    next_put(&watch, "node-a", "not-there-yet", Duration::from_secs(5));
    publisher.terminate();
    let stopped = Instant::now();
    assert_eq!(publisher.wait_exit(Duration::from_secs(5)), Some(0));
    next_delete(&watch, "node-a", "weights", Duration::from_secs(1));
    assert!(
        stopped.elapsed() < Duration::from_millis(1300),
        "{:?}",
        stopped.elapsed()
    );
    assert!(observer.list().expect("list").entries.is_empty());
}

/// After etcd said the publisher's lease is gone: it reports the region unpublished, the new
/// lease, and the region published again; the new lease's id.
fn republished(publisher: &Publisher, region: &str, generation: u64) -> i64 {
    publisher.expect_line(
        &format!("unpublished {region} lease-lost"),
        Duration::from_secs(20),
    );
    let granted = publisher.expect_line("lease ", Duration::from_secs(20));
    let lease: i64 = granted["lease ".len()..].parse().expect("lease ID");
    assert_ne!(lease, publisher.lease, "a new lease");
    publisher.expect_line(
        &format!("republished {region} {generation}"),
        Duration::from_secs(20),
    );
    lease
}

#[test]
fn a_sigstopped_publisher_s_keys_go_and_come_back_under_a_new_lease_when_continued() {
    let Some(world) = World::start(
        "a_sigstopped_publisher_s_keys_go_and_come_back_under_a_new_lease_when_continued",
    ) else {
        return;
    };
    let service = Service::start("a");
    write_region(
        &service.client().expect("writer"),
        "weights",
        SIZE,
        1,
        Acl::default(),
    );
    let observer = world.open("engine-b");
    let watch = observer.watch().expect("watch");
    let mut publisher = Publisher::start(&world, &service, &spec("node-a", &["engine-b"]));
    next_put(&watch, "node-a", "weights", Duration::from_secs(10));
    // Stopped, it keeps nothing alive: its key goes within TTL + 1 s.
    publisher.stop(true);
    let stopped = Instant::now();
    next_delete(&watch, "node-a", "weights", Duration::from_secs(3));
    assert!(stopped.elapsed() < Duration::from_secs(3));
    // Continued, etcd tells it the lease is gone: it grants a new one and publishes again,
    // and importers find the region and fetch it as before.
    publisher.stop(false);
    let lease = republished(&publisher, "weights", 1);
    let entry = next_put(&watch, "node-a", "weights", Duration::from_secs(10));
    assert_eq!(entry.locator.generation, 1);
    assert_eq!(
        world.key_lease("node-a", "weights").expect("read"),
        Some(lease)
    );
    let engine = fetcher(&world.pki, "engine-b");
    import(&engine, &entry.locator).expect("the region fetched after the republish");
    assert_eq!(
        publisher.wait_exit(Duration::from_millis(500)),
        None,
        "it runs on"
    );
}

#[test]
fn a_revoked_registry_lease_is_replaced_and_the_publisher_republishes() {
    let Some(world) =
        World::start("a_revoked_registry_lease_is_replaced_and_the_publisher_republishes")
    else {
        return;
    };
    let service = Service::start("a");
    write_region(
        &service.client().expect("writer"),
        "weights",
        SIZE,
        1,
        Acl::default(),
    );
    let observer = world.open("engine-b");
    let mut publisher = Publisher::start(&world, &service, &spec("node-a", &["engine-b"]));
    publisher.expect_line("published weights 1", Duration::from_secs(10));
    // An operator takes the lease away: etcd answers the next keep-alive with TTL 0.
    world.raw_revoke(publisher.lease);
    let lease = republished(&publisher, "weights", 1);
    assert_eq!(
        world.key_lease("node-a", "weights").expect("read"),
        Some(lease)
    );
    assert_eq!(
        observer
            .resolve("node-a", "weights")
            .expect("resolve")
            .expect("published again")
            .locator
            .generation,
        1
    );
    assert_eq!(
        publisher.wait_exit(Duration::from_millis(500)),
        None,
        "it runs on"
    );
}

#[test]
fn what_the_publisher_may_not_read_or_hand_out_or_claim_stays_out() {
    let test = "what_the_publisher_may_not_read_or_hand_out_or_claim_stays_out";
    if !memd::is_root() {
        eprintln!("SKIP {test}: playing uid {NOBODY} needs root");
        return;
    }
    let Some(world) = World::start(test) else {
        return;
    };
    world.enable_rbac(&["node-a", "node-b", "engine-b", "intruder"]);
    let service_a = Service::start("a");
    let writer = service_a.client().expect("writer (root)");
    let readable = Acl {
        read: vec![Principal::Uid(NOBODY)],
        ..Acl::default()
    };
    write_region(&writer, "weights", SIZE, 1, readable.clone());
    write_region(&writer, "secret", SIZE, 7, Acl::default());
    let observer = world.open("engine-b");

    // The publisher runs as uid 65534: the service lists "weights" to it, not "secret".
    let publisher = Publisher::start(
        &world,
        &service_a,
        &PublisherSpec {
            nobody: true,
            ..spec("node-a", &["engine-b"])
        },
    );
    publisher.expect_line("published weights 1", Duration::from_secs(10));
    write_region(&writer, "secret", SIZE, 8, Acl::default());
    write_region(&writer, "weights", SIZE, 2, readable);
    publisher.expect_line("updated weights 2", Duration::from_secs(5));
    let names: Vec<String> = observer
        .list()
        .expect("list")
        .entries
        .into_iter()
        .map(|entry| entry.name)
        .collect();
    assert_eq!(names, ["weights"]);
    let entry = observer
        .resolve("node-a", "weights")
        .expect("resolve")
        .expect("published");

    // An importer whose certificate the publisher does not admit gets nothing.
    match fetcher(&world.pki, "intruder").fetch(&entry.locator) {
        Err(FetchError::Tls {
            reason: TlsReason::RefusedByPeer { .. },
            ..
        }) => {}
        other => panic!("expected the intruder refused in the handshake, got {other:?}"),
    }
    let bytes = import(&fetcher(&world.pki, "engine-b"), &entry.locator).expect("admitted");
    assert_eq!(bytes, vmm_tests::pattern(2, SIZE));

    // node-b's publisher claiming node-a's prefix: etcd denies every publish.
    let service_b = Service::start("b");
    write_region(
        &service_b.client().expect("writer on B"),
        "weights",
        SIZE,
        9,
        Acl::default(),
    );
    let registry = RegistryConfig::new(
        [world.etcd.endpoint()],
        world.material("node-b"),
        DOMAIN,
        "node-a",
    )
    .lease_ttl(Duration::from_secs(2));
    let config = PublisherConfig::new(
        service_b.name(),
        registry,
        support::handoff::options(&world.pki, "node-b", &["engine-b"]),
        "127.0.0.1:0".parse().expect("an address"),
        dns_name("node-b"),
    );
    let mut hostile = MemdPublisher::start(config).expect("node-b may hold a lease");
    let denied = hostile.poll().expect("a poll").into_iter().any(|event| {
        matches!(
            event,
            PublishEvent::Failed {
                error: RegionError::Registry(RegistryError::PermissionDenied {
                    op: Op::Publish,
                    ..
                }),
                ..
            }
        )
    });
    assert!(denied, "etcd let node-b publish under node-a's prefix");
    assert!(hostile.published().is_empty());
    let standing = observer
        .resolve("node-a", "weights")
        .expect("resolve")
        .expect("A's locator stands");
    assert_eq!(standing.locator, entry.locator);
}

#[test]
fn the_program_s_usage_errors_exit_2_and_help_exits_0() {
    let status = |args: &[&str]| {
        memd::program("vmm-memd-publish", false)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run vmm-memd-publish")
            .code()
    };
    assert_eq!(status(&["--help"]), Some(0));
    assert_eq!(status(&["--frobnicate"]), Some(2));
    assert_eq!(status(&["--etcd"]), Some(2));
    assert_eq!(status(&[]), Some(2));
}

/// A GPU region (GPU with fabric support and an IMEX channel; one `SKIP` line otherwise, a
/// failure under `VMM_REQUIRE_GPU=1`): published as the service's fabric handles with its
/// device's UUID, imported read-only here with the written bytes; withdrawn when the service
/// dies (its fabric handles die with its allocation); after the restart the generation taken
/// back from the keeper has no fabric handles and stays unpublished; the next commit is
/// published again.
#[test]
fn a_gpu_region_is_published_as_fabric_handles_and_withdrawn_with_its_service() {
    use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
    use vmm_memd::BeginOptions;
    use vmm_memd::protocol::Backend;

    if !vmm_core::testing::skip_unless(vmm_core::testing::cuda_fabric()) {
        return;
    }
    let Some(world) =
        World::start("a_gpu_region_is_published_as_fabric_handles_and_withdrawn_with_its_service")
    else {
        return;
    };
    let device = Device::new(0).expect("device 0");
    let mut service = Service::start("a");
    let commit = |client: &vmm_memd::Client, seed: u8| -> (u64, Vec<u8>) {
        let options = BeginOptions {
            backend: Backend::Gpu {
                uuid: *device.uuid(),
            },
            ..BeginOptions::default()
        };
        let writer = client
            .begin("gpu-weights", &[SIZE as u64], options)
            .expect("begin on the GPU");
        let gpu = writer.gpu().expect("a GPU writer");
        // Rounded up to the device's granularity.
        let len = usize::try_from(gpu.chunk_sizes()[0]).expect("a size");
        let bytes = vmm_tests::pattern(seed, len);
        gpu.buffer().write_at(0, &bytes).expect("fill the chunk");
        (writer.commit().expect("commit"), bytes)
    };
    let (generation, bytes) = commit(&service.client().expect("writer"), 4);
    let observer = world.open("engine-b");
    let publisher = Publisher::start(&world, &service, &spec("node-a", &["engine-b"]));
    publisher.expect_line(
        &format!("published gpu-weights {generation}"),
        Duration::from_secs(10),
    );
    let entry = observer
        .resolve("node-a", "gpu-weights")
        .expect("resolve")
        .expect("published");
    assert_eq!(entry.locator.handle, HandleKind::Fabric);
    assert_eq!(
        entry.locator.device_uuid,
        Some(vmm_registry::gpu_uuid(device.uuid()))
    );
    assert_eq!(entry.locator.size, bytes.len() as u64);
    let fetched = fetcher(&world.pki, "engine-b")
        .fetch(&entry.locator)
        .expect("fetch the fabric handles");
    let reader = VirtualMemoryResource::new(&device, ResourceOptions::default().read_only(true))
        .expect("a read-only importer");
    let mapped = reader
        .import_fabric(fetched.descriptor())
        .expect("import the fabric handles");
    let mut read = vec![0u8; bytes.len()];
    mapped.read_at(0, &mut read).expect("read the region");
    assert_eq!(read, bytes);
    fetched.acknowledge().expect("acknowledge");
    drop((mapped, reader));

    service.kill();
    publisher.expect_line(
        "unpublished gpu-weights not-shareable",
        Duration::from_secs(5),
    );
    assert!(
        observer
            .resolve("node-a", "gpu-weights")
            .expect("resolve")
            .is_none()
    );
    service.restart();
    publisher.expect_line("reconnected", Duration::from_secs(10));
    let (next, _) = commit(&service.client().expect("writer again"), 6);
    publisher.expect_line(
        &format!("published gpu-weights {next}"),
        Duration::from_secs(5),
    );
}
