//! The discard sleep (issue 26 item 5), host backend: the service frees a generation's memory
//! once every mapper sleeps with discard (or is gone), never while one still maps it; a wake
//! makes it again, zeroed, at the slept addresses, also after a restart of the service. The
//! GPU path is in `gpu_regions.rs`.

mod common;

use std::time::Duration;

use common::{
    NOBODY, Role, ServiceProc, fill_byte, is_root, publish, role_args, role_client, say, until,
};
use vmm_core::wire::endpoint::ConnectOptions;
use vmm_memd::protocol::{Acl, Principal};
use vmm_memd::protocol::{Request, Response};
use vmm_memd::{BeginOptions, MemdError};
use vmm_memd::{Client, Refusal, RequestRule, Sleeping};

const CHUNK: u64 = 64 << 10;

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    match role.as_str() {
        // Attach ARGS[0] and hold it until killed.
        "holder" => {
            let client = role_client();
            let attached = client.attach(&args[0]).unwrap();
            say(&format!("HOLDING {}", attached.generation));
            std::thread::sleep(Duration::from_secs(60));
        }
        // Attach ARGS[0] and try to end the lease with a discard sleep; say how it went,
        // then check the memory is still there.
        "discarder" => {
            let client = role_client();
            let attached = client.attach(&args[0]).unwrap();
            let generation = attached.generation;
            match client.sleep_discard(attached) {
                Err(failed) => match (failed.error, failed.attached) {
                    (MemdError::Refused(Refusal::AccessDenied { right, .. }), Some(kept)) => {
                        // Untouched: still mapped, still leased.
                        assert!(common::holds(&kept.chunks[0], 1));
                        client.detach(&kept).unwrap();
                        say(&format!("DENIED {right}"))
                    }
                    (e, _) => say(&format!("ERROR {e:?}")),
                },
                Ok(_) => say("SLEPT"),
            }
            let again = client.attach(&args[0]).unwrap();
            let intact = common::holds(&again.chunks[0], generation);
            say(&format!("INTACT {intact}"));
        }
        other => panic!("unknown role {other}"),
    }
}

/// The fds a process holds.
fn fds_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Let the keeper take what the service sent it: it accepts the service's connection and
/// reads its messages in its own time, and what a service SIGKILLed before the keeper
/// accepted it had sent is lost (as in `restart.rs`).
fn settle() {
    std::thread::sleep(Duration::from_millis(100));
}

/// The fds of the keeper `pid` once they stop changing (the same over 4 looks 25 ms apart,
/// within 3 s): what it holds once it has read what the service sent.
fn settled_fds(pid: i32) -> usize {
    settle();
    let (mut last, mut same) = (fds_of(pid), 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while same < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(25));
        let now = fds_of(pid);
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
    last
}

/// The slept addresses.
fn addresses(sleeping: &Sleeping) -> Vec<usize> {
    sleeping
        .reservations()
        .iter()
        .map(|r| r.as_ptr() as usize)
        .collect()
}

#[test]
fn memory_goes_once_every_mapper_sleeps_and_a_wake_makes_it_again_zeroed() {
    let service = ServiceProc::start(&[]);
    let writer = service.connect();
    publish(&writer, "kv", 2, CHUNK);
    let (a, b) = (service.connect(), service.connect());
    let (held_a, held_b) = (a.attach("kv").unwrap(), b.attach("kv").unwrap());
    let keeper = service.keeper_pid().expect("a keeper");
    let keeper_fds = settled_fds(keeper);
    let service_fds = service.fd_count();
    let used = writer.status().unwrap().used;
    let slept_a = a.sleep_discard(held_a).unwrap();
    // B still maps it: nothing is freed.
    assert_eq!(service.fd_count(), service_fds);
    assert!(held_b.chunks.iter().all(|c| common::holds(c, 1)));
    let slept_b = b.sleep_discard(held_b).unwrap();
    // Every mapper sleeps: the service and its keeper let both chunks go.
    assert_eq!(service.fd_count(), service_fds - 2);
    assert!(until(Duration::from_secs(2), || fds_of(keeper) == keeper_fds - 2).is_some());
    assert_eq!(writer.status().unwrap().used, used, "the charge stays");
    let where_a = addresses(&slept_a);
    let woke = a.wake(slept_a).unwrap();
    assert_eq!(woke.generation, 1);
    let mapped: Vec<usize> = woke.chunks.iter().map(|c| c.as_ptr() as usize).collect();
    assert_eq!(mapped, where_a);
    assert!(
        woke.chunks
            .iter()
            .all(|c| c.as_slice().iter().all(|&x| x == 0))
    );
    assert_eq!(service.fd_count(), service_fds);
    let where_b = addresses(&slept_b);
    let woke_b = b.wake(slept_b).unwrap();
    assert_eq!(woke_b.chunks[1].as_ptr() as usize, where_b[1]);
    assert!(woke_b.chunks[1].as_slice().iter().all(|&x| x == 0));
}

/// A reader that still maps the memory keeps it, whoever sleeps with discard: a discard of
/// someone else's lease is refused, and the memory goes only when the last mapper is gone
/// (here SIGKILLed); a wake then finds it zeroed.
#[test]
fn a_discard_sleep_never_frees_memory_a_reader_still_maps() {
    let service = ServiceProc::start(&[]);
    let writer = service.connect();
    publish(&writer, "kv", 1, CHUNK);
    let sleeper = service.connect();
    let attached = sleeper.attach("kv").unwrap();
    let lease = attached.lease;
    let mut holder = Role::spawn("holder", &service, &["kv"], false);
    assert_eq!(holder.expect_line(), "HOLDING 1");
    // A hostile connection discards the sleeper's lease: refused, nothing freed.
    let hostile = service.connect();
    let bytes = postcard::to_allocvec(&Request::Discard { lease }).unwrap();
    assert!(matches!(
        hostile.request_raw(&bytes).unwrap(),
        Response::Refused(Refusal::InvalidRequest {
            rule: RequestRule::NoSuchLease,
            ..
        })
    ));
    let keeper = service.keeper_pid().expect("a keeper");
    let keeper_fds = settled_fds(keeper);
    let slept = sleeper.sleep_discard(attached).unwrap();
    assert_eq!(settled_fds(keeper), keeper_fds, "the holder still maps it");
    let check = sleeper.attach("kv").unwrap();
    assert!(common::holds(&check.chunks[0], 1));
    sleeper.detach(&check).unwrap();
    drop(check);
    holder.signal(libc::SIGKILL);
    assert!(
        until(Duration::from_secs(1), || fds_of(keeper) == keeper_fds - 1).is_some(),
        "the last mapper is gone: the memory goes (the keeper keeps the record only)"
    );
    let woke = sleeper.wake(slept).unwrap();
    assert!(woke.chunks[0].as_slice().iter().all(|&x| x == 0));
}

/// A discarded generation survives a SIGKILL of the service (the keeper holds its record):
/// after the restart a wake makes it again, zeroed, at the same addresses.
#[test]
fn a_discarded_generation_survives_a_restart() {
    let mut service = ServiceProc::start(&[]);
    let writer = service.connect();
    publish(&writer, "kv", 2, CHUNK);
    let reader = service.connect();
    let slept = reader.sleep_discard(reader.attach("kv").unwrap()).unwrap();
    let where_slept = addresses(&slept);
    drop((writer, reader));
    settle();
    service.signal(libc::SIGKILL);
    let _ = service.child.wait();
    service.restart();
    let client = Client::reconnect(
        &service.name(),
        &ConnectOptions::default(),
        Duration::from_secs(5),
    )
    .unwrap();
    let woke = client.wake(slept).unwrap();
    assert_eq!(woke.generation, 1);
    let mapped: Vec<usize> = woke.chunks.iter().map(|c| c.as_ptr() as usize).collect();
    assert_eq!(mapped, where_slept);
    assert!(
        woke.chunks
            .iter()
            .all(|c| c.as_slice().iter().all(|&x| x == 0))
    );
}

/// A discard replaces the contents, so it needs the write right: a reader of another uid
/// that may only read is refused (`AccessDenied` for `write`) and the published memory stays
/// (it would otherwise wipe the weights of every later reader by attaching and discarding).
#[test]
fn a_reader_without_the_write_right_cannot_discard() {
    if !is_root() {
        eprintln!("SKIP a_reader_without_the_write_right_cannot_discard: needs root for setpriv");
        return;
    }
    let service = ServiceProc::start(&[]);
    let owner = service.connect();
    let options = BeginOptions {
        acl: Acl {
            read: vec![Principal::Uid(NOBODY)],
            ..Default::default()
        },
        ..Default::default()
    };
    let writer = owner.begin("weights", &[CHUNK], options).unwrap();
    writer.chunk(0).fill(fill_byte(1)).unwrap();
    writer.commit().unwrap();
    let mut reader = Role::spawn("discarder", &service, &["weights"], true);
    assert_eq!(reader.expect_line(), "DENIED write");
    assert_eq!(reader.expect_line(), "INTACT true");
    assert!(reader.wait_success());
    let attached = owner.attach("weights").unwrap();
    assert!(common::holds(&attached.chunks[0], 1));
}
