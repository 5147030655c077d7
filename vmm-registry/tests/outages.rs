//! The registry rides out etcd outages (issue 34, item 5). etcd keeps its leases across a
//! restart and gives each a fresh TTL when its leader is elected, so a live exporter keeps
//! its lease however long etcd was gone, as long as its keep-alive goes on trying: etcd
//! SIGKILLed for 1.5 and 3 TTLs, and a storm of short restarts, leave every locator of a
//! live exporter (in this process, and in a child process) on the lease it was published
//! under, with nothing reported and publishing working. A lease that really ran out on
//! etcd's clock (etcd SIGSTOPped past the TTL: at SIGCONT it expires the lease itself) is
//! replaced, and the locators come back under the new lease with their last values, as the
//! lease events say.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vmm_registry::{
    LeaseEvent, LeaseLoss, Registry, RegistryConfig, RegistryError, TlsMaterial, WatchEvent,
};

use support::{DOMAIN, SERVER, World, issue, locator};
use vmm_tests::pki::dns_name;

/// Set in the exporter child: `<endpoint> <owner> <TTL in seconds>`.
const CHILD_ENV: &str = "VMM_REGISTRY_TEST_OUTAGE_EXPORTER";
/// The child's TLS material, as PEM text (so the child opens no file).
const CA_ENV: &str = "VMM_REGISTRY_TEST_CA_PEM";
const CERT_ENV: &str = "VMM_REGISTRY_TEST_CERT_PEM";
const KEY_ENV: &str = "VMM_REGISTRY_TEST_KEY_PEM";

/// The exporter child's body (a no-op when run as a test): open the registry, publish `kv0`,
/// say `published <lease>`, print every lease event it meets, and when its stdin closes
/// say `events <how many>` and close the registry.
#[test]
fn exporter_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut words = spec.split(' ');
    let (Some(endpoint), Some(owner), Some(ttl)) = (words.next(), words.next(), words.next())
    else {
        panic!("{CHILD_ENV}: <endpoint> <owner> <ttl>");
    };
    let ttl = Duration::from_secs(ttl.parse().expect("a TTL in seconds"));
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is set"));
    let material =
        TlsMaterial::from_pem(var(CA_ENV), var(CERT_ENV), var(KEY_ENV), dns_name(SERVER));
    let config = RegistryConfig::new([endpoint], material, DOMAIN, owner)
        .lease_ttl(ttl)
        .call_timeout(Duration::from_secs(3))
        .open_timeout(Duration::from_secs(5));
    let registry = Registry::open(config).expect("the child opens");
    registry
        .publish("kv0", &locator(owner, 1))
        .expect("the child publishes");
    println!("published {}", registry.lease_id());
    let (eof, stdin_closed) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        drop(eof);
    });
    let mut events = 0;
    while stdin_closed.try_recv() == Err(mpsc::TryRecvError::Empty) {
        if let Some(event) = registry.next_lease_event(Duration::from_millis(100)) {
            events += 1;
            println!("event {event:?}");
        }
    }
    println!("events {events}");
    let _ = std::io::stdout().flush();
    // Best effort: etcd may be gone at the end of a test.
    let _ = registry.close();
}

/// A live exporter in a child process: the test binary again, running `exporter_child`.
struct Exporter {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    /// The lease it published under.
    lease: i64,
}

impl Exporter {
    /// Start it as `owner` with lease `ttl`; returned once it has published.
    fn start(world: &World, owner: &str, ttl: Duration) -> Exporter {
        let leaf = issue(&world.pki, owner);
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
                format!("{} {owner} {}", world.etcd.endpoint(), ttl.as_secs()),
            )
            .env(CA_ENV, world.pki.ca_pem())
            .env(CERT_ENV, &leaf.cert_pem)
            .env(KEY_ENV, &leaf.key_pem)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the exporter child");
        let stdout = child.stdout.take().expect("its stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        let stdin = child.stdin.take();
        let mut exporter = Exporter {
            child,
            stdin,
            lines,
            lease: 0,
        };
        let published = exporter.expect_line("published ", Duration::from_secs(20));
        exporter.lease = published["published ".len()..]
            .parse()
            .expect("published <lease>");
        exporter
    }

    /// The next line starting with `prefix` within `timeout` (others skipped), or a panic.
    fn expect_line(&self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(_) => panic!("the exporter child never said {prefix:?} within {timeout:?}"),
            }
        }
    }

    /// Close its stdin: how many lease events it met, once it said so and exited 0.
    fn finish(mut self) -> usize {
        drop(self.stdin.take());
        let said = self.expect_line("events ", Duration::from_secs(20));
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "the exporter child did not exit");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "the exporter child: {status}");
        said["events ".len()..].parse().expect("events <n>")
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Watch the keys `(owner, lease)` (each owner's `kv0`) from etcd's return (`back`) until
/// `ttl * 3 + 1 s` after it, and at least once after etcd answers: each is on its lease all
/// along. (A client that stopped renewing during the outage loses its lease about TTL + 1 s
/// after the return: etcd gives restored leases a fresh TTL, then expires them.)
fn stay_on_their_leases(world: &World, keys: &[(&str, i64)], back: Instant, ttl: Duration) {
    let until = back + ttl * 3 + Duration::from_secs(1);
    let mut answered = false;
    while !answered || Instant::now() < until {
        for (owner, lease) in keys {
            match world.key_lease(owner, "kv0") {
                Ok(found) => {
                    answered = true;
                    assert_eq!(
                        found,
                        Some(*lease),
                        "{owner}'s kv0, {:?} after etcd's return",
                        back.elapsed()
                    );
                }
                Err(status) => assert!(
                    back.elapsed() < Duration::from_secs(30),
                    "etcd did not answer within 30 s of its return: {status}"
                ),
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Publish `name` on `registry`, trying again while etcd is still coming back (20 s at
/// most): a lost lease (`LeaseLost`) or any other refusal fails at once.
fn publish_works(registry: &Registry, name: &str, owner: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match registry.publish(name, &locator(owner, 1)) {
            Ok(_) => return,
            Err(
                e @ (RegistryError::Unreachable { .. }
                | RegistryError::Deadline { .. }
                | RegistryError::Etcd { .. }),
            ) => {
                assert!(
                    Instant::now() < deadline,
                    "no publish after the outage: {e:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("publish after the outage: {e:?}"),
        }
    }
}

/// Nothing happened to `registry`'s lease: still `lease`, no event.
fn kept(registry: &Registry, lease: i64) {
    assert_eq!(registry.lease_lost(), None);
    assert_eq!(registry.lease_id(), lease);
    let events = registry.lease_events();
    assert!(events.is_empty(), "lease events: {events:?}");
}

/// etcd SIGKILLed for `outage` under two live exporters (TTL `ttl`), then started again on
/// its data: both keep their leases and their keys, and publishing works.
fn live_exporters_ride_out(world: &mut World, outage: Duration, ttl: Duration) {
    let carol = Exporter::start(world, "carol", ttl);
    let alice = Registry::open(world.config("alice").lease_ttl(ttl)).expect("open");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    let lease = alice.lease_id();

    world.etcd.kill();
    std::thread::sleep(outage);
    world.etcd.start_again();
    let back = Instant::now();

    stay_on_their_leases(
        world,
        &[("alice", lease), ("carol", carol.lease)],
        back,
        ttl,
    );
    kept(&alice, lease);
    publish_works(&alice, "kv1", "alice");
    assert_eq!(world.key_lease("alice", "kv1").expect("read"), Some(lease));
    assert_eq!(carol.finish(), 0, "the child exporter met lease events");
}

#[test]
fn live_exporters_keep_their_leases_through_an_outage_of_one_and_a_half_ttls() {
    let test = "live_exporters_keep_their_leases_through_an_outage_of_one_and_a_half_ttls";
    let Some(mut world) = World::start(test) else {
        return;
    };
    // TTL 3 s (not the 2 s of most tests): after etcd's return the client has one TTL to
    // renew, and a loaded machine may take a while to restart etcd and reconnect.
    live_exporters_ride_out(
        &mut world,
        Duration::from_millis(4500),
        Duration::from_secs(3),
    );
}

#[test]
fn live_exporters_keep_their_leases_through_an_outage_of_three_ttls() {
    let test = "live_exporters_keep_their_leases_through_an_outage_of_three_ttls";
    let Some(mut world) = World::start(test) else {
        return;
    };
    live_exporters_ride_out(&mut world, Duration::from_secs(9), Duration::from_secs(3));
}

#[test]
fn live_exporters_keep_their_leases_through_a_storm_of_short_restarts() {
    let test = "live_exporters_keep_their_leases_through_a_storm_of_short_restarts";
    let Some(mut world) = World::start(test) else {
        return;
    };
    // Outages of 2-2.6 s at a TTL of 3 s (each shorter than the TTL, so etcd never expires a
    // lease it restored), with etcd back only briefly between them: no keep-alive may
    // succeed for several TTLs in all.
    let ttl = Duration::from_secs(3);
    let carol = Exporter::start(&world, "carol", ttl);
    let alice = Registry::open(world.config("alice").lease_ttl(ttl)).expect("open");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    let lease = alice.lease_id();

    for outage_ms in [2000, 2600, 2200, 2600, 2400, 2600] {
        world.etcd.kill();
        std::thread::sleep(Duration::from_millis(outage_ms));
        world.etcd.start_again();
        std::thread::sleep(Duration::from_millis(200));
    }
    let back = Instant::now();

    stay_on_their_leases(
        &world,
        &[("alice", lease), ("carol", carol.lease)],
        back,
        ttl,
    );
    kept(&alice, lease);
    publish_works(&alice, "kv1", "alice");
    assert_eq!(carol.finish(), 0, "the child exporter met lease events");
}

#[test]
fn a_lease_that_ran_out_on_etcd_s_clock_is_replaced_and_its_locators_republished() {
    let test = "a_lease_that_ran_out_on_etcd_s_clock_is_replaced_and_its_locators_republished";
    let Some(world) = World::start(test) else {
        return;
    };
    let alice = world.open("alice");
    let bob = world.open("bob");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    alice.publish("kv1", &locator("alice", 1)).expect("publish");
    alice.update("kv1", &locator("alice", 2)).expect("update");
    alice.publish("kv2", &locator("alice", 1)).expect("publish");
    assert!(alice.unpublish("kv2").expect("unpublish"));
    let old = alice.lease_id();

    // Stopped for two TTLs: at SIGCONT etcd expires the lease itself (a renewal of an expired
    // lease waits for its revocation), so the client is told the lease is gone.
    world.etcd.pause();
    std::thread::sleep(Duration::from_secs(4));
    world.etcd.resume();

    let event = alice.next_lease_event(Duration::from_secs(20));
    match event {
        Some(LeaseEvent::Lost {
            lease,
            reason: LeaseLoss::NotFound,
            unpublished,
        }) => {
            assert_eq!(lease, old);
            assert_eq!(unpublished, ["kv0", "kv1"], "kv2 was unpublished before");
        }
        other => panic!("expected the loss, got {other:?}"),
    }
    let new = match alice.next_lease_event(Duration::from_secs(20)) {
        Some(LeaseEvent::Granted { lease }) => lease,
        other => panic!("expected a new lease, got {other:?}"),
    };
    assert_ne!(new, old);
    assert_eq!(alice.lease_id(), new);
    // Each with its last value, in name order.
    for (name, generation) in [("kv0", 1), ("kv1", 2)] {
        match alice.next_lease_event(Duration::from_secs(20)) {
            Some(LeaseEvent::Republished {
                name: n,
                lease,
                locator: value,
                ..
            }) => {
                assert_eq!((n.as_str(), lease), (name, new));
                assert_eq!(value, locator("alice", generation));
            }
            other => panic!("expected {name} republished, got {other:?}"),
        }
    }
    assert_eq!(alice.lease_lost(), None);
    for name in ["kv0", "kv1"] {
        assert_eq!(world.key_lease("alice", name).expect("read"), Some(new));
    }
    assert_eq!(world.key_lease("alice", "kv2").expect("read"), None);
    assert_eq!(
        bob.resolve("alice", "kv1")
            .expect("resolve")
            .expect("kv1 is back")
            .locator
            .generation,
        2
    );
    publish_works(&alice, "kv3", "alice");
    assert_eq!(world.key_lease("alice", "kv3").expect("read"), Some(new));
    // The new lease is kept alive in its turn.
    std::thread::sleep(Duration::from_secs(3));
    let events = alice.lease_events();
    assert!(events.is_empty(), "lease events: {events:?}");
    assert_eq!(world.key_lease("alice", "kv0").expect("read"), Some(new));
}

#[test]
fn a_revoked_lease_is_replaced_and_watchers_see_the_locator_come_back() {
    let test = "a_revoked_lease_is_replaced_and_watchers_see_the_locator_come_back";
    let Some(world) = World::start(test) else {
        return;
    };
    let alice = world.open("alice");
    let bob = world.open("bob");
    alice.publish("kv0", &locator("alice", 1)).expect("publish");
    let watch = bob.watch().expect("watch");
    let old = alice.lease_id();
    // An operator revokes it: etcd answers the next keep-alive (every TTL/3) with TTL 0.
    world.raw_revoke(old);
    match watch.next_timeout(Duration::from_secs(10)).expect("watch") {
        Some(WatchEvent::Deleted { owner, name, .. }) => {
            assert_eq!((owner.as_str(), name.as_str()), ("alice", "kv0"));
        }
        other => panic!("expected kv0 deleted, got {other:?}"),
    }
    match watch.next_timeout(Duration::from_secs(20)).expect("watch") {
        Some(WatchEvent::Put(entry)) => {
            assert_eq!(
                (entry.owner.as_str(), entry.name.as_str()),
                ("alice", "kv0")
            );
            assert_eq!(entry.locator, locator("alice", 1));
        }
        other => panic!("expected kv0 back, got {other:?}"),
    }
    let events: Vec<LeaseEvent> =
        std::iter::from_fn(|| alice.next_lease_event(Duration::from_secs(5)))
            .take(3)
            .collect();
    assert!(
        matches!(
            events.as_slice(),
            [
                LeaseEvent::Lost { lease, reason: LeaseLoss::NotFound, .. },
                LeaseEvent::Granted { lease: granted },
                LeaseEvent::Republished { lease: republished, .. },
            ] if *lease == old && granted == republished && *granted != old
        ),
        "{events:?}"
    );
    assert_eq!(
        world.key_lease("alice", "kv0").expect("read"),
        Some(alice.lease_id())
    );
}
