//! The `async` feature: the same operations on the caller's tokio runtime.

mod support;

use std::time::Duration;

use vmm_registry::{AsyncRegistry, RegistryError, WatchEvent};

use support::{World, locator};

#[tokio::test]
async fn async_publish_watch_resolve_and_close() {
    let Some(world) = World::start("async_publish_watch_resolve_and_close") else {
        return;
    };
    let alice = AsyncRegistry::open(
        world
            .config("alice")
            .lease_ttl(vmm_registry::DEFAULT_LEASE_TTL),
    )
    .await
    .expect("open");
    let bob = AsyncRegistry::open(world.config("bob"))
        .await
        .expect("open");
    let mut watch = bob.watch().await.expect("watch");
    let published = alice
        .publish("kv0", &locator("alice", 1))
        .await
        .expect("publish");
    assert!(matches!(
        alice.publish("kv0", &locator("alice", 2)).await,
        Err(RegistryError::Duplicate { .. })
    ));
    match watch
        .next_timeout(Duration::from_secs(5))
        .await
        .expect("the watch runs")
    {
        Some(WatchEvent::Put(entry)) => assert_eq!(entry.revision, published.revision),
        other => panic!("expected the put, got {other:?}"),
    }
    let found = bob
        .resolve("alice", "kv0")
        .await
        .expect("resolve")
        .expect("found");
    assert_eq!(found.locator, locator("alice", 1));
    // close revokes: the key goes at once (the TTL is 10 s).
    alice.close().await.expect("close");
    match watch
        .next_timeout(Duration::from_secs(1))
        .await
        .expect("the watch runs")
    {
        Some(WatchEvent::Deleted { name, .. }) => assert_eq!(name, "kv0"),
        other => panic!("expected the delete, got {other:?}"),
    }
    assert_eq!(bob.lease_lost(), None);
}
