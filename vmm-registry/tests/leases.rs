//! The lease that makes a dead exporter disappear by itself, and what survives an etcd
//! restart: an exporter SIGKILLed (a real child process) vanishes within TTL + 1 s;
//! keep-alive and watch resume after etcd is SIGKILLed and restarted, with no event lost or
//! delivered twice; with RBAC on, another user may not touch the exporter's key. (Longer
//! outages, and a lease etcd says is gone: `outages.rs`.)

mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vmm_registry::{Registry, RegistryConfig, RegistryError, TlsMaterial, WatchEvent};

use support::{DOMAIN, SERVER, World, locator};
use vmm_tests::pki::dns_name;

/// Set in the exporter child: `<endpoint> <material directory>`.
const CHILD_ENV: &str = "VMM_REGISTRY_TEST_EXPORTER";

/// The exporter child's body (a no-op when run as a test): publish `kv0` as alice with a
/// 2 s lease, say so, and wait to be killed.
#[test]
fn exporter_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (endpoint, dir) = spec.split_once(' ').expect("<endpoint> <dir>");
    let read = |file: &str| std::fs::read(Path::new(dir).join(file)).expect("read material");
    let material = TlsMaterial::from_pem(
        read("ca.pem"),
        read("alice.pem"),
        read("alice.key"),
        dns_name(SERVER),
    );
    let config = RegistryConfig::new([endpoint], material, DOMAIN, "alice")
        .lease_ttl(Duration::from_secs(2));
    let registry = Registry::open(config).expect("the child opens");
    registry
        .publish("kv0", &locator("alice", 1))
        .expect("the child publishes");
    println!("published");
    std::thread::sleep(Duration::from_secs(30));
    panic!("the exporter child was not killed");
}

/// Start the exporter child and wait until it has published.
fn exporter(world: &World) -> std::process::Child {
    let dir = world.write_material("alice");
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--exact",
            "exporter_child",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(
            CHILD_ENV,
            format!("{} {}", world.etcd.endpoint(), dir.display()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the exporter child");
    let stdout = child.stdout.take().expect("its stdout");
    let published = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line.trim() == "published");
    assert!(published, "the child ended without publishing");
    child
}

#[test]
fn a_sigkilled_exporter_disappears_within_ttl_plus_one_second() {
    let Some(world) = World::start("a_sigkilled_exporter_disappears_within_ttl_plus_one_second")
    else {
        return;
    };
    let mut child = exporter(&world);
    let bob = world.open("bob");
    // Past one TTL the child's keep-alive holds the key.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        bob.resolve("alice", "kv0").expect("resolve").is_some(),
        "the live child's key"
    );
    child.kill().expect("SIGKILL the child");
    let killed = Instant::now();
    child.wait().expect("reap the child");
    while bob.resolve("alice", "kv0").expect("resolve").is_some() {
        assert!(
            killed.elapsed() < Duration::from_secs(3),
            "the dead exporter's key outlived TTL + 1 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("key gone {:?} after SIGKILL (TTL 2 s)", killed.elapsed());
}

#[test]
fn keep_alive_and_watch_resume_after_etcd_is_killed_and_restarted() {
    let Some(mut world) =
        World::start("keep_alive_and_watch_resume_after_etcd_is_killed_and_restarted")
    else {
        return;
    };
    let alice =
        Registry::open(world.config("alice").lease_ttl(Duration::from_secs(4))).expect("open");
    let bob = world.open("bob");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    let lease = alice.lease_id();
    let watch = bob.watch().expect("watch");
    assert_eq!(watch.initial().entries.len(), 1);

    world.etcd.kill_and_restart();

    // The client reconnects by itself; the first calls may find etcd still starting.
    let deadline = Instant::now() + Duration::from_secs(10);
    let published = loop {
        match alice.publish("kv1", &locator("alice", 2)) {
            Ok(published) => break published,
            Err(
                e @ (RegistryError::Unreachable { .. }
                | RegistryError::Deadline { .. }
                | RegistryError::Etcd { .. }),
            ) => {
                assert!(
                    Instant::now() < deadline,
                    "no publish after the restart: {e:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("publish after the restart: {e:?}"),
        }
    };
    // The watch resumed from where it was: kv1 once, and nothing else (kv0 not again).
    match watch
        .next_timeout(Duration::from_secs(10))
        .expect("the watch runs")
    {
        Some(WatchEvent::Put(entry)) => {
            assert_eq!(entry.name, "kv1");
            assert_eq!(entry.revision, published.revision);
        }
        other => panic!("expected kv1's put, got {other:?}"),
    }
    // Two TTLs later the lease is still kept alive, and kv0 is still there.
    assert!(
        alice.next_lease_event(Duration::from_secs(8)).is_none(),
        "the lease was kept"
    );
    assert_eq!(alice.lease_id(), lease);
    assert!(bob.resolve("alice", "kv0").expect("resolve").is_some());
    match watch
        .next_timeout(Duration::from_millis(200))
        .expect("the watch runs")
    {
        None => {}
        Some(event) => panic!("an event nobody caused: {event:?}"),
    }
}

#[test]
fn another_user_may_not_write_or_delete_the_exporters_key() {
    let Some(world) = World::start("another_user_may_not_write_or_delete_the_exporters_key") else {
        return;
    };
    world.enable_rbac(&["alice", "bob", "mallory"]);
    let alice = world.open("alice");
    alice
        .publish("kv0", &locator("alice", 1))
        .expect("alice publishes under her prefix");
    let bob = world.open("bob");
    assert!(
        bob.resolve("alice", "kv0")
            .expect("bob reads the domain")
            .is_some()
    );

    // mallory's certificate, claiming alice's prefix: etcd denies it.
    let config = RegistryConfig::new(
        [world.etcd.endpoint()],
        world.material("mallory"),
        DOMAIN,
        "alice",
    )
    .lease_ttl(Duration::from_secs(2));
    let mallory = Registry::open(config).expect("mallory may hold a lease");
    assert!(matches!(
        mallory.publish("kv1", &locator("alice", 2)),
        Err(RegistryError::PermissionDenied {
            op: vmm_registry::Op::Publish,
            ..
        })
    ));
    let key = vmm_registry::export_key(DOMAIN, "alice", "kv0");
    let denied = |result: Result<(), tonic::Status>| matches!(result, Err(status) if status.code() == tonic::Code::PermissionDenied);
    let k = key.clone();
    assert!(denied(
        world.raw_as("mallory", async |c| c.put(k, "{}").await)
    ));
    let k = key.clone();
    assert!(denied(world.raw_as("mallory", async |c| c.delete(k).await)));
    // alice's locator stands.
    assert_eq!(
        bob.resolve("alice", "kv0")
            .expect("resolve")
            .expect("found")
            .locator,
        locator("alice", 1)
    );
    // mallory under its own prefix is fine.
    let own = RegistryConfig::new(
        [world.etcd.endpoint()],
        world.material("mallory"),
        DOMAIN,
        "mallory",
    );
    Registry::open(own)
        .expect("open")
        .publish("kv0", &locator("mallory", 1))
        .expect("own prefix");
}
