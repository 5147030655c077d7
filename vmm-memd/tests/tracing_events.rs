//! vmm-memd's `tracing` events (feature `tracing`; this test needs it: `cargo test -p
//! vmm-memd --features tracing --test tracing_events`). An in-process service, served on
//! threads of this process, is driven by real clients (and by `vmm-memctl` as uid 65534 when
//! running as root); a capturing layer installed as the global subscriber (the service's
//! connection threads are not this thread) records every event: its name and fields. Each
//! event the clients caused is there with its fields, and a refusal names the uid and the
//! reason. A second test runs the `vmm-memd` program and reads its stderr: the fmt subscriber
//! prints the events next to the program's own lines.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::{NOBODY, euid, is_root, keeper_pid_of, program, program_as_nobody, until};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::Registry;
use vmm_core::wire::endpoint::{Allow, Listener, ListenerOptions, Name};
use vmm_memd::protocol::{Acl, Principal};
use vmm_memd::{Admins, BeginOptions, Client, MemdError, Refusal, Service};

/// One event as the subscriber saw it: its name and every field as text.
#[derive(Debug, Clone)]
struct Seen {
    name: &'static str,
    fields: BTreeMap<&'static str, String>,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

/// Writes each field's value as text: numbers and strings plainly, the rest by `Debug`.
struct Fields<'a>(&'a mut BTreeMap<&'static str, String>);

impl Visit for Fields<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

/// The capturing layer: events in the order they came, from every thread.
struct Capture(Arc<Mutex<Vec<Seen>>>);

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut seen = Seen {
            name: event.metadata().name(),
            fields: BTreeMap::new(),
        };
        event.record(&mut Fields(&mut seen.fields));
        self.0.lock().unwrap().push(seen);
    }
}

/// The events seen so far by this process's global subscriber (installed on first use).
fn events() -> Vec<Seen> {
    static SEEN: OnceLock<Arc<Mutex<Vec<Seen>>>> = OnceLock::new();
    let seen = SEEN.get_or_init(|| {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriber = Registry::default().with(Capture(Arc::clone(&seen)));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        seen
    });
    seen.lock().unwrap().clone()
}

/// The events named `name` whose field `key` is `value`.
fn find<'a>(seen: &'a [Seen], name: &str, key: &str, value: &str) -> Vec<&'a Seen> {
    seen.iter()
        .filter(|s| s.name == name && s.field(key) == Some(value))
        .collect()
}

/// The one event named `name` whose field `key` is `value`.
fn one<'a>(seen: &'a [Seen], name: &str, key: &str, value: &str) -> &'a Seen {
    match find(seen, name, key, value)[..] {
        [event] => event,
        ref other => panic!("expected one {name} with {key}={value}, saw {other:?}"),
    }
}

#[test]
fn an_in_process_service_emits_its_events_and_a_refusal_names_the_uid_and_the_reason() {
    events();
    let socket = format!("@vmm-memd-tracing-test-{}", std::process::id());
    let name = Name::from(socket.as_str());
    let options = ListenerOptions::default().allow(Allow::same_user().uid(NOBODY));
    let listener = Listener::bind_with(&name, options).unwrap();
    let stop = AtomicBool::new(false);
    let me = euid().to_string();
    let mut service = Service::new(1 << 20);
    service.set_admins(Admins {
        uids: vec![euid()],
        gids: vec![],
    });
    std::thread::scope(|scope| {
        let served = scope.spawn(|| service.serve(&listener, &stop));
        let client = Client::connect(&name).unwrap();
        let acl = Acl {
            read: vec![Principal::Uid(NOBODY)],
            ..Default::default()
        };
        let options = BeginOptions {
            acl,
            ..Default::default()
        };
        let writer = client.begin("weights", &[4096], options).unwrap();
        writer.commit().unwrap();
        let attached = client.attach("weights").unwrap();
        client.detach(&attached).unwrap();
        client.sleep_region("weights").unwrap();
        client.wake_region("weights").unwrap();
        let over = client.begin("big", &[2 << 20], BeginOptions::default());
        assert!(matches!(
            over.map(drop),
            Err(MemdError::Refused(Refusal::QuotaExceeded { .. }))
        ));
        if is_root() {
            let out = program_as_nobody("vmm-memctl")
                .args([
                    "--socket",
                    &socket,
                    "--service-uid",
                    &me,
                    "sleep",
                    "weights",
                ])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(1), "{out:?}");
        } else {
            eprintln!("SKIP the other uid's refusal event: needs root for setpriv");
        }
        // An admin's requests (this uid is the service's admin here).
        client.set_acl("weights", &Acl::default()).unwrap();
        client.set_quota(NOBODY, Some(4096)).unwrap();
        assert_eq!(client.release_all().unwrap().regions, 1);
        drop(client);
        // The connections' ends are seen by their threads within a tick.
        let ended = until(Duration::from_secs(2), || {
            events().iter().any(|s| s.name == "memd.conn.ended")
        });
        assert!(ended.is_some(), "no memd.conn.ended");
        stop.store(true, Ordering::Relaxed);
        served.join().unwrap().unwrap();
    });
    let seen = events();
    let pid = std::process::id().to_string();

    let accepted = find(&seen, "memd.conn.accepted", "uid", &me);
    assert!(!accepted.is_empty(), "{seen:#?}");
    assert_eq!(accepted[0].field("pid"), Some(&*pid));
    let begin = one(&seen, "memd.begin", "region", "weights");
    for (key, value) in [("generation", "1"), ("uid", &*me), ("bytes", "4096")] {
        assert_eq!(begin.field(key), Some(value), "{begin:?}");
    }
    assert!(begin.field("conn").is_some(), "{begin:?}");
    let commit = one(&seen, "memd.commit", "region", "weights");
    assert_eq!(commit.field("generation"), Some("1"));
    let attach = one(&seen, "memd.attach", "region", "weights");
    assert_eq!(attach.field("pid"), Some(&*pid));
    let detach = one(&seen, "memd.detach", "region", "weights");
    assert_eq!(detach.field("lease"), attach.field("lease"));
    let sleep = one(&seen, "memd.sleep", "region", "weights");
    assert_eq!(sleep.field("outcome"), Some("asleep"));
    assert_eq!(sleep.field("uid"), Some(&*me));
    one(&seen, "memd.discard.freed", "region", "weights");
    let wake = one(&seen, "memd.wake", "region", "weights");
    assert_eq!(wake.field("outcome"), Some("zeroed"));
    one(&seen, "memd.remade", "region", "weights");

    // The quota refusal names the uid and the reason.
    let quota = one(&seen, "memd.refused", "reason", "QuotaExceeded");
    assert_eq!(quota.field("uid"), Some(&*me), "{quota:?}");
    assert_eq!(quota.field("pid"), Some(&*pid), "{quota:?}");
    assert!(quota.field("detail").unwrap().contains("quota exceeded"));
    // The ACL refusal names the other uid, the reason and the region.
    if is_root() {
        let denied = one(&seen, "memd.refused", "reason", "AccessDenied");
        assert_eq!(
            denied.field("uid"),
            Some(&*NOBODY.to_string()),
            "{denied:?}"
        );
        assert_eq!(denied.field("region"), Some("weights"), "{denied:?}");
        assert_ne!(denied.field("pid"), Some(&*pid));
        assert!(!find(&seen, "memd.conn.accepted", "uid", &NOBODY.to_string()).is_empty());
    }
    // Every admin action names its caller and says it was an admin's.
    let acl = one(&seen, "memd.acl", "region", "weights");
    assert_eq!(acl.field("admin"), Some("true"), "{acl:?}");
    assert_eq!(acl.field("uid"), Some(&*me), "{acl:?}");
    assert_eq!(acl.field("read"), Some("0"), "{acl:?}");
    let quota = one(&seen, "memd.quota", "target_uid", &NOBODY.to_string());
    assert_eq!(quota.field("bytes"), Some("4096"), "{quota:?}");
    assert_eq!(quota.field("admin"), Some("true"), "{quota:?}");
    let released = one(&seen, "memd.release_all", "uid", &me);
    assert_eq!(released.field("regions"), Some("1"), "{released:?}");
    assert_eq!(released.field("admin"), Some("true"), "{released:?}");
    assert_eq!(sleep.field("admin"), Some("true"), "{sleep:?}");
    assert!(!find(&seen, "memd.conn.ended", "outcome", "closed").is_empty());
    one(&seen, "memd.stop", "outcome", "stopped");
}

/// The program, built with the feature, prints its events on stderr through the fmt
/// subscriber (`VMM_MEMD_LOG=info`), and its own lines as before: a refusal with the uid and
/// the reason, an idle connection evicted for a newcomer of its uid at its cap (1 here), its
/// keeper SIGKILLed and replaced, its stop.
#[test]
fn the_program_prints_its_events_on_stderr() {
    let socket = format!("@vmm-memd-tracing-program-{}", std::process::id());
    let mut service = program("vmm-memd")
        .args(["--socket", &socket, "--quota-bytes", "4096"])
        .args([
            "--keeper-linger-ms",
            "20000",
            "--max-connections-per-uid",
            "1",
        ])
        .env("VMM_MEMD_LOG", "info")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let name = Name::from(socket.as_str());
    let mut client = None;
    until(Duration::from_secs(10), || {
        client = Client::connect(&name).ok();
        client.is_some()
    })
    .expect("the service comes up");
    let client = client.unwrap();
    let refused = client.attach("nothing-here").map(drop);
    assert!(matches!(
        refused,
        Err(MemdError::Refused(Refusal::NoSuchRegion { .. }))
    ));
    // A second client of this uid, at its cap: the first (idle, no lease) is evicted. The
    // first counts as busy until its thread has finished with the reply it just read (the
    // client can be faster): a newcomer in that window is refused, and tries again.
    let mut second = None;
    until(Duration::from_secs(5), || {
        second = Client::connect(&name).ok();
        second.is_some()
    })
    .expect("the newcomer is admitted once the first connection is idle");
    let second = second.unwrap();
    second.list().unwrap();
    assert!(matches!(client.list(), Err(MemdError::ServiceGone(_))));
    drop((client, second));
    let keeper = keeper_pid_of(&socket).expect("a keeper");
    // SAFETY: kill of the keeper our child started (found by its command line just now).
    unsafe { libc::kill(keeper, libc::SIGKILL) };
    let replaced = until(Duration::from_secs(5), || {
        keeper_pid_of(&socket).is_some_and(|pid| pid != keeper)
    });
    assert!(replaced.is_some(), "the keeper was not replaced");
    // SAFETY: kill of our own child's pid (not reaped yet).
    unsafe { libc::kill(service.id() as i32, libc::SIGTERM) };
    let mut stderr = String::new();
    service
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(service.wait().unwrap().success(), "{stderr}");
    assert!(stderr.contains("vmm-memd: serving on"), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("memd.refused"))
        .unwrap_or_else(|| panic!("no refusal event in\n{stderr}"));
    assert!(line.contains(&format!("uid={}", euid())), "{line}");
    assert!(line.contains("NoSuchRegion"), "{line}");
    let evicted = stderr
        .lines()
        .find(|l| l.contains("memd.conn.evicted"))
        .unwrap_or_else(|| panic!("no eviction event in\n{stderr}"));
    assert!(evicted.contains(&format!("uid={}", euid())), "{evicted}");
    assert!(stderr.contains("memd.conn.evicting"), "{stderr}");
    assert!(stderr.contains("memd.keeper.lost"), "{stderr}");
    let restart = stderr
        .lines()
        .find(|l| l.contains("memd.keeper.restart"))
        .unwrap_or_else(|| panic!("no keeper restart event in\n{stderr}"));
    assert!(restart.contains("outcome=\"restarted\""), "{restart}");
    assert!(stderr.contains("memd.stop"), "{stderr}");
}
