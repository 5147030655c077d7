//! The registry against a real etcd (mutual TLS, client-certificate authentication): publish,
//! resolve, watch, leases, deadlines, refusals. Each test starts its own etcd.

mod support;

use std::time::{Duration, Instant};

use vmm_registry::{
    Op, Registry, RegistryConfig, RegistryError, ValueError, WatchEvent, export_key,
};

use support::{DOMAIN, SERVER, World, locator, material};
use vmm_tests::pki::Pki;

/// The world of a test called `test` (`None` after its SKIP line), and two registries in it,
/// alice's and bob's; alice's with `ttl` when given.
fn alice_and_bob(test: &str, ttl: Option<Duration>) -> Option<(World, Registry, Registry)> {
    let world = World::start(test)?;
    let alice = match ttl {
        Some(ttl) => Registry::open(world.config("alice").lease_ttl(ttl)).expect("open"),
        None => world.open("alice"),
    };
    let bob = world.open("bob");
    Some((world, alice, bob))
}

/// alice's config for an etcd at `endpoint` whose certificate `pki` signed, opening within 2 s.
fn alice_at(endpoint: String, pki: &Pki) -> RegistryConfig {
    RegistryConfig::new([endpoint], material(pki, "alice", SERVER), DOMAIN, "alice")
        .open_timeout(Duration::from_secs(2))
}

/// The next event that is not `Refused`, within `timeout`.
fn next_event(watch: &vmm_registry::Watch, timeout: Duration) -> WatchEvent {
    watch
        .next_timeout(timeout)
        .expect("the watch is running")
        .unwrap_or_else(|| panic!("no watch event within {timeout:?}"))
}

#[test]
fn publish_resolve_and_watch() {
    let Some((_world, alice, bob)) = alice_and_bob("publish_resolve_and_watch", None) else {
        return;
    };
    let watch = bob.watch().expect("watch");
    assert!(watch.initial().entries.is_empty());

    let published = alice.publish("kv0", &locator("alice", 1)).expect("publish");
    assert_eq!(published.key, export_key(DOMAIN, "alice", "kv0"));

    let found = bob
        .resolve("alice", "kv0")
        .expect("resolve")
        .expect("found");
    assert_eq!(found.locator, locator("alice", 1));
    assert_eq!(
        (found.owner.as_str(), found.name.as_str()),
        ("alice", "kv0")
    );
    assert_eq!(found.revision, published.revision);

    match next_event(&watch, Duration::from_secs(5)) {
        WatchEvent::Put(entry) => {
            assert_eq!(entry.locator, locator("alice", 1));
            assert_eq!(entry.revision, published.revision);
        }
        other => panic!("expected the put, got {other:?}"),
    }
    assert!(alice.unpublish("kv0").expect("unpublish"));
    match next_event(&watch, Duration::from_secs(5)) {
        WatchEvent::Deleted { owner, name, .. } => {
            assert_eq!((owner.as_str(), name.as_str()), ("alice", "kv0"))
        }
        other => panic!("expected the delete, got {other:?}"),
    }
    assert!(bob.resolve("alice", "kv0").expect("resolve").is_none());
    // bob cannot remove what alice publishes: unpublish acts on bob's own lease and prefix.
    alice
        .publish("kv1", &locator("alice", 2))
        .expect("publish again");
    assert!(!bob.unpublish("kv1").expect("bob's unpublish"));
    assert!(bob.resolve("alice", "kv1").expect("resolve").is_some());
}

#[test]
fn duplicate_name_is_a_typed_error() {
    let Some(world) = World::start("duplicate_name_is_a_typed_error") else {
        return;
    };
    let first = world.open("alice");
    let second = world.open("alice");
    first.publish("kv0", &locator("alice", 1)).expect("publish");
    for registry in [&first, &second] {
        match registry.publish("kv0", &locator("alice", 2)) {
            Err(RegistryError::Duplicate { key }) => {
                assert_eq!(key, export_key(DOMAIN, "alice", "kv0"))
            }
            other => panic!("expected Duplicate, got {other:?}"),
        }
    }
    // The first value stands.
    let found = second
        .resolve("alice", "kv0")
        .expect("resolve")
        .expect("found");
    assert_eq!(found.locator.generation, 1);
    // A locator naming another owner is refused before it reaches etcd.
    assert!(matches!(
        first.publish("kv9", &locator("mallory", 1)),
        Err(RegistryError::NotOurOwner { .. })
    ));
}

#[test]
fn clean_shutdown_unpublishes_at_once() {
    // The default TTL (10 s): only the revoke can make the key go in under a second.
    let Some((_world, alice, bob)) = alice_and_bob(
        "clean_shutdown_unpublishes_at_once",
        Some(vmm_registry::DEFAULT_LEASE_TTL),
    ) else {
        return;
    };
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    let watch = bob.watch().expect("watch");
    assert_eq!(watch.initial().entries.len(), 1);
    let closed = Instant::now();
    alice.close().expect("close");
    match next_event(&watch, Duration::from_secs(1)) {
        WatchEvent::Deleted { name, .. } => assert_eq!(name, "kv0"),
        other => panic!("expected the delete, got {other:?}"),
    }
    assert!(
        closed.elapsed() < Duration::from_secs(1),
        "took {:?}",
        closed.elapsed()
    );
    assert!(bob.resolve("alice", "kv0").expect("resolve").is_none());
}

#[test]
fn dropping_the_registry_unpublishes_too() {
    let Some((_world, alice, bob)) = alice_and_bob(
        "dropping_the_registry_unpublishes_too",
        Some(vmm_registry::DEFAULT_LEASE_TTL),
    ) else {
        return;
    };
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    let dropped = Instant::now();
    drop(alice);
    assert!(bob.resolve("alice", "kv0").expect("resolve").is_none());
    assert!(dropped.elapsed() < Duration::from_secs(1));
}

#[test]
fn lease_outlives_several_ttls() {
    let Some(world) = World::start("lease_outlives_several_ttls") else {
        return;
    };
    let alice = world.open("alice");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    // TTL 2 s: without keep-alives the key would be gone by now.
    assert!(
        alice.next_lease_event(Duration::from_secs(5)).is_none(),
        "the lease was kept"
    );
    assert!(
        world
            .open("bob")
            .resolve("alice", "kv0")
            .expect("resolve")
            .is_some()
    );
}

#[test]
fn open_fails_by_its_deadline_when_etcd_is_down_then_works() {
    let Some(binary) =
        support::etcd::etcd_or_skip("open_fails_by_its_deadline_when_etcd_is_down_then_works")
    else {
        return;
    };
    let pki = Pki::new("down");
    let dir = support::etcd::TempDir::new("pki");
    let port = support::etcd::free_port();
    let config = alice_at(format!("127.0.0.1:{port}"), &pki);
    let started = Instant::now();
    match Registry::open(config.clone()) {
        Err(
            RegistryError::Unreachable { op: Op::Open, .. }
            | RegistryError::Deadline { op: Op::Open, .. },
        ) => {}
        other => panic!("expected unreachable, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );

    let _etcd =
        support::etcd::Etcd::start(&binary, Some(support::etcd_tls(&pki, &dir)), Some(port));
    let registry = Registry::open(config).expect("open once etcd is up");
    registry
        .publish("kv0", &locator("alice", 1))
        .expect("publish");
}

#[test]
fn a_peer_that_never_speaks_tls_holds_open_only_until_its_deadline() {
    // A listener that accepts and says nothing (no etcd needed).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let _held = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(8) {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_secs(10));
    });
    let config = alice_at(addr.to_string(), &Pki::new("silent"));
    let started = Instant::now();
    match Registry::open(config) {
        Err(RegistryError::Deadline {
            op: Op::Open,
            after,
        }) => assert_eq!(after, Duration::from_secs(2)),
        other => panic!("expected the open's deadline, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn hostile_values_are_refused_and_the_watch_goes_on() {
    let Some((world, alice, bob)) =
        alice_and_bob("hostile_values_are_refused_and_the_watch_goes_on", None)
    else {
        return;
    };
    let watch = bob.watch().expect("watch");
    let key = |owner: &str, name: &str| export_key(DOMAIN, owner, name);

    // Over the cap: refused before parsing (it is valid JSON padded with spaces).
    let mut oversized = serde_json::to_vec(&locator("mallory", 1)).expect("json");
    oversized.resize(vmm_registry::MAX_LOCATOR_BYTES + 1, b' ');
    world.raw_put(&key("mallory", "big"), oversized);
    // Not a locator.
    world.raw_put(&key("mallory", "junk"), b"{\"owner\":".to_vec());
    // alice's locator under mallory's prefix: an owner describes only its own memory.
    world.raw_put(
        &key("mallory", "stolen"),
        serde_json::to_vec(&locator("alice", 1)).expect("json"),
    );
    // A key outside the layout.
    world.raw_put(
        &format!("{}mallory", vmm_registry::domain_prefix(DOMAIN)),
        b"{}".to_vec(),
    );

    let mut refused = Vec::new();
    for _ in 0..4 {
        match next_event(&watch, Duration::from_secs(5)) {
            WatchEvent::Refused { key, error, .. } => refused.push((key, error)),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    assert!(
        matches!(refused[0].1, ValueError::TooLarge { len, .. } if len == vmm_registry::MAX_LOCATOR_BYTES + 1)
    );
    assert!(matches!(refused[1].1, ValueError::Malformed(_)));
    assert!(
        matches!(&refused[2].1, ValueError::OwnerMismatch { in_key, in_value } if in_key == "mallory" && in_value == "alice")
    );
    assert!(matches!(refused[3].1, ValueError::Key));

    // The watch goes on.
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    match next_event(&watch, Duration::from_secs(5)) {
        WatchEvent::Put(entry) => assert_eq!(entry.name, "kv0"),
        other => panic!("expected alice's put, got {other:?}"),
    }
    // Resolve and list refuse them too.
    assert!(matches!(
        bob.resolve("mallory", "stolen"),
        Err(RegistryError::Value {
            source: ValueError::OwnerMismatch { .. },
            ..
        })
    ));
    assert!(matches!(
        bob.resolve("mallory", "big"),
        Err(RegistryError::Value {
            source: ValueError::TooLarge { .. },
            ..
        })
    ));
    let listing = bob.list().expect("list");
    assert_eq!(listing.entries.len(), 1);
    assert_eq!(listing.refused.len(), 4);
}

#[test]
fn a_watch_from_a_compacted_revision_lists_again() {
    let Some((world, alice, bob)) =
        alice_and_bob("a_watch_from_a_compacted_revision_lists_again", None)
    else {
        return;
    };
    let seen = bob.list().expect("list").revision;
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    alice.publish("kv1", &locator("alice", 2)).expect("publish");
    assert!(alice.unpublish("kv0").expect("unpublish"));
    world.raw_compact();
    // bob resumes from the revision after the one it saw: compacted, so it gets the domain
    // as it is now, then the changes after it.
    let watch = bob.watch_from(seen + 1).expect("watch");
    match next_event(&watch, Duration::from_secs(5)) {
        WatchEvent::Relisted(listing) => {
            let names: Vec<&str> = listing.entries.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(names, ["kv1"]);
        }
        other => panic!("expected a relisting, got {other:?}"),
    }
    alice.publish("kv2", &locator("alice", 3)).expect("publish");
    match next_event(&watch, Duration::from_secs(5)) {
        WatchEvent::Put(entry) => assert_eq!(entry.name, "kv2"),
        other => panic!("expected kv2's put, got {other:?}"),
    }
}

#[test]
fn calls_end_by_their_deadline_while_etcd_is_stopped_and_recover() {
    let Some(world) = World::start("calls_end_by_their_deadline_while_etcd_is_stopped_and_recover")
    else {
        return;
    };
    let config = world
        .config("alice")
        .lease_ttl(Duration::from_secs(6))
        .call_timeout(Duration::from_secs(1));
    let alice = Registry::open(config).expect("open");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    world.etcd.pause();
    let started = Instant::now();
    let stopped = alice.resolve("alice", "kv0");
    let took = started.elapsed();
    world.etcd.resume();
    assert!(
        matches!(
            stopped,
            Err(RegistryError::Deadline {
                op: Op::Resolve,
                ..
            })
        ),
        "{stopped:?}"
    );
    // The call's own deadline (1 s), not the background guard's grace.
    assert!(took < Duration::from_millis(1500), "took {took:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match alice.resolve("alice", "kv0") {
            Ok(found) => {
                assert!(found.is_some());
                break;
            }
            Err(e) => assert!(
                Instant::now() < deadline,
                "no recovery after SIGCONT: {e:?}"
            ),
        }
    }
    alice
        .publish("kv1", &locator("alice", 2))
        .expect("publish after SIGCONT");
    assert_eq!(alice.lease_lost(), None);
}

#[test]
fn update_replaces_only_this_process_s_key_and_the_watch_sees_it() {
    let Some(world) = World::start("update_replaces_only_this_process_s_key_and_the_watch_sees_it")
    else {
        return;
    };
    let first = world.open("alice");
    let second = world.open("alice");
    let bob = world.open("bob");
    let watch = bob.watch().expect("watch");
    let published = first.publish("kv0", &locator("alice", 1)).expect("publish");
    let updated = first.update("kv0", &locator("alice", 2)).expect("update");
    assert!(updated.revision > published.revision);
    for expected in [1, 2] {
        match next_event(&watch, Duration::from_secs(5)) {
            WatchEvent::Put(entry) => assert_eq!(entry.locator.generation, expected),
            other => panic!("expected a put, got {other:?}"),
        }
    }
    // Another process of the same owner may not replace it, nor create a key by updating.
    for (registry, name) in [(&second, "kv0"), (&first, "kv-absent")] {
        match registry.update(name, &locator("alice", 3)) {
            Err(RegistryError::NotPublishedHere { key }) => {
                assert_eq!(key, export_key(DOMAIN, "alice", name))
            }
            other => panic!("expected NotPublishedHere, got {other:?}"),
        }
    }
    assert!(matches!(
        first.update("kv0", &locator("mallory", 3)),
        Err(RegistryError::NotOurOwner { .. })
    ));
    let found = second
        .resolve("alice", "kv0")
        .expect("resolve")
        .expect("found");
    assert_eq!(found.locator.generation, 2);
    // Still on the first process's lease: its close takes it.
    first.close().expect("close");
    match next_event(&watch, Duration::from_secs(5)) {
        WatchEvent::Deleted { name, .. } => assert_eq!(name, "kv0"),
        other => panic!("expected the delete, got {other:?}"),
    }
}
