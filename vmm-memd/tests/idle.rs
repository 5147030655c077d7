//! The idle-connection timeout (`--idle-timeout-ms`): a connection that sends nothing for that
//! long while it holds no lease and no pending generation is closed, and its slot of its uid's
//! connection cap comes back; one that holds a lease, or writes, is never closed for idleness,
//! and `0` turns the timeout off.

mod common;

use std::time::Duration;

use common::{ServiceProc, publish, until};
use vmm_memd::{BeginOptions, MemdError};

const IDLE_MS: &str = "300";

#[test]
fn an_idle_connection_is_closed_and_its_uids_slot_comes_back() {
    let service = ServiceProc::start(&[
        "--idle-timeout-ms",
        IDLE_MS,
        "--max-connections-per-uid",
        "2",
    ]);
    let (idle, other) = (service.connect(), service.connect());
    // The uid's two slots are taken.
    let refused = service.try_connect().unwrap_err();
    assert!(
        matches!(
            &refused,
            MemdError::Core(vmm_core::Error::PeerRefused { .. })
        ),
        "{refused:?}"
    );
    // Quiet past the timeout, both are closed; a new connection of this uid is admitted.
    let admitted = until(Duration::from_secs(5), || service.try_connect().is_ok());
    let after = admitted.expect("an idle connection's slot comes back");
    assert!(
        after >= Duration::from_millis(250),
        "closed after {after:?}, before the timeout"
    );
    // Both are closed by now, a tick or two apart (a request would reset a clock: none
    // until well past the timeout).
    std::thread::sleep(Duration::from_millis(300));
    assert!(matches!(idle.list(), Err(MemdError::ServiceGone(_))));
    assert!(matches!(other.status(), Err(MemdError::ServiceGone(_))));
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
