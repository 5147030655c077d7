//! The idle-connection timeout (`--idle-timeout-ms`): a connection that sends nothing for that
//! long while it holds no lease and no pending generation is closed (and its slot of its uid's
//! connection cap comes back); one that holds a lease, or writes, is never closed for idleness,
//! and `0` turns the timeout off.

mod common;

use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use common::{ServiceProc, publish, until};
use vmm_memd::{BeginOptions, Client, MemdError};

const IDLE_MS: &str = "300";

/// Whether the service has closed `client`'s connection (seen without sending a request,
/// which would reset its idle clock).
fn hung_up(client: &Client) -> bool {
    let mut pfd = libc::pollfd {
        fd: client.session().as_fd().as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd, a live local; no wait.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}

/// A uid's connections are closed once idle past the timeout, not before. (Its slots came
/// back only so, before a uid at its cap could evict its longest-idle connection for a new
/// client: `availability.rs`.)
#[test]
fn an_idle_connection_is_closed_after_the_timeout() {
    let service = ServiceProc::start(&["--idle-timeout-ms", IDLE_MS]);
    let (idle, other) = (service.connect(), service.connect());
    let started = Instant::now();
    let closed = until(Duration::from_secs(5), || hung_up(&idle) && hung_up(&other));
    closed.expect("idle connections are closed");
    let after = started.elapsed();
    assert!(
        after >= Duration::from_millis(250),
        "closed after {after:?}, before the timeout"
    );
    assert!(matches!(idle.list(), Err(MemdError::ServiceGone(_))));
    assert!(matches!(other.status(), Err(MemdError::ServiceGone(_))));
    // The uid is served again.
    service.connect().list().unwrap();
}

#[test]
fn a_connection_that_holds_a_lease_or_writes_is_not_idle() {
    // A lease TTL well past the idle timeout: the reader never renews meanwhile.
    let service = ServiceProc::start(&["--idle-timeout-ms", IDLE_MS, "--lease-ttl-ms", "60000"]);
    let writer = service.connect();
    publish(&writer, "weights", 1, 4096);
    let reader = service.connect();
    let attached = reader.attach("weights").unwrap();
    let pending = service.connect();
    let began = pending
        .begin("kv", &[4096], BeginOptions::default())
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    // The reader and the writer are still served; the one that only published is gone.
    reader.detach(&attached).unwrap();
    assert_eq!(began.commit().unwrap(), 1);
    assert!(matches!(writer.list(), Err(MemdError::ServiceGone(_))));
    // Now without a lease, the reader's connection goes too (a request would reset its
    // clock: none until past the timeout).
    std::thread::sleep(Duration::from_millis(1000));
    assert!(matches!(reader.list(), Err(MemdError::ServiceGone(_))));
}

#[test]
fn a_timeout_of_0_keeps_idle_connections() {
    let service = ServiceProc::start(&["--idle-timeout-ms", "0"]);
    let client = service.connect();
    std::thread::sleep(Duration::from_millis(700));
    client.list().expect("still served");
}

/// An idle connection's thread sleeps with no tick, so what ends it must wake it: an eviction
/// for a newcomer of its uid closes the evicted connection at once, seen by its client
/// without sending anything (without the wake, it would end only at its next request or at
/// the idle timeout, 5 minutes by default here).
#[test]
fn an_evicted_idle_connection_is_closed_without_a_request_of_its_own() {
    let service = ServiceProc::start(&["--max-connections-per-uid", "1"]);
    let first = service.connect();
    first.list().unwrap();
    // Its thread goes to sleep once the client has read the reply (it looks every 10 ms until
    // then): let it get there, so that only the eviction can wake it.
    std::thread::sleep(Duration::from_millis(200));
    // The newcomer may find the first still finishing its reply (then counted busy): again.
    let mut second = None;
    until(Duration::from_secs(5), || {
        second = service.try_connect().ok();
        second.is_some()
    })
    .expect("the newcomer evicts the idle connection");
    let closed = until(Duration::from_secs(2), || hung_up(&first));
    closed.expect("the evicted connection is closed without a request of its own");
    second.unwrap().list().unwrap();
}

/// The stop wakes every idle connection's thread: with 64 idle connections the service exits
/// 0 within 2 s of SIGTERM, and every client sees its connection closed.
#[test]
fn a_stop_ends_every_idle_connection_at_once() {
    let mut service = ServiceProc::start(&[]);
    let idle: Vec<Client> = (0..64).map(|_| service.connect()).collect();
    service.signal(libc::SIGTERM);
    let stopped = until(Duration::from_secs(2), || {
        service.child.try_wait().unwrap().is_some()
    });
    stopped.expect("the service stops within 2 s with idle connections");
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    assert!(idle.iter().all(hung_up));
}
