//! An operator's sleep and wake of a whole region (`Request::Sleep`, `Request::Wake`; what
//! `vmm-memctl sleep` and `wake` send), host backend, on a real service process: a sleep frees
//! the current generation's memory once the last lease ends (the service's fd count), never
//! while a reader holds one; a reader that still maps it keeps what it maps; the quota charge
//! and the metadata stay; a wake makes the chunks again, zeroed, before anyone attaches; a
//! wake calls off a sleep still waiting for leases; a reader SIGKILLed while the sleep waits
//! for it lets the memory go; `status`, `list` and `metrics` show it.
//! Refusals: a uid without the write right (`AccessDenied`, nothing changes), a region it may
//! not read or that does not exist (`NoSuchRegion`), a wake of an awake one (`NotAsleep`).
//! `vmm-memctl`'s side (output, exit statuses) is in `ctl.rs`.

mod common;

use std::process::{Output, Stdio};
use std::time::Duration;

use common::{
    NOBODY, Role, ServiceProc, is_root, program_as_nobody, publish, role_args, role_client, say,
    until,
};
use vmm_memd::protocol::{Acl, Principal, SleepState, Status};
use vmm_memd::{BeginOptions, Client, MemdError, Refusal, RegionSlept, RegionWoke, RequestRule};

const CHUNK: u64 = 64 << 10;

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    match role.as_str() {
        // Attach ARGS[0] and hold it until killed.
        "holder" => {
            let client = role_client();
            let attached = client.attach(&role_args()[0]).unwrap();
            say(&format!("HOLDING {}", attached.generation));
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown role {other}"),
    }
}

/// The sleep state of `region`'s current generation in `status`.
fn sleep_of(status: &Status, region: &str) -> SleepState {
    let r = status.regions.iter().find(|r| r.region == region).unwrap();
    r.generations.iter().find(|g| g.current).unwrap().sleep
}

/// The service's fd count once it stops changing (the same over 4 looks 25 ms apart, within
/// 3 s): a reply's descriptors are closed by the service just after the client has read them.
fn settled_fds(service: &ServiceProc) -> usize {
    let (mut last, mut same) = (service.fd_count(), 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while same < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(25));
        let now = service.fd_count();
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
    last
}

fn zeroed(attached: &vmm_memd::Attached) -> bool {
    attached
        .chunks
        .iter()
        .all(|c| c.as_slice().iter().all(|&b| b == 0))
}

fn refusal(e: MemdError) -> Refusal {
    match e {
        MemdError::Refused(r) => r,
        other => panic!("not a refusal: {other:?}"),
    }
}

#[test]
fn a_sleep_frees_the_memory_once_the_last_reader_detaches_and_a_wake_makes_it_zeroed() {
    let service = ServiceProc::start(&[]);
    let owner = service.connect();
    publish(&owner, "kv", 2, CHUNK);
    let reader = service.connect();
    let attached = reader.attach("kv").unwrap();
    let service_fds = settled_fds(&service);
    let used = owner.status().unwrap().used;

    // A reader holds a lease: the sleep waits for it, and nothing is freed yet.
    let slept = owner.sleep_region("kv").unwrap();
    assert_eq!(
        slept,
        RegionSlept {
            generation: 1,
            leases: 1
        }
    );
    assert_eq!(settled_fds(&service), service_fds);
    assert_eq!(
        sleep_of(&owner.status().unwrap(), "kv"),
        SleepState::Falling
    );
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));
    // A second sleep changes nothing.
    assert_eq!(owner.sleep_region("kv").unwrap(), slept);

    // The last lease ends: the service lets both chunks go. The reader's mapping is its
    // own: it keeps what it maps (the discard semantics).
    reader.detach(&attached).unwrap();
    assert!(
        until(Duration::from_secs(1), || service.fd_count()
            == service_fds - 2)
        .is_some()
    );
    let status = owner.status().unwrap();
    assert_eq!(sleep_of(&status, "kv"), SleepState::Asleep);
    assert_eq!(status.used, used, "the quota charge stays");
    assert_eq!(owner.list().unwrap()[0].sleep, SleepState::Asleep);
    let metrics = owner.metrics().unwrap();
    assert!(
        metrics.contains("vmm_memd_region_asleep{region=\"kv\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "vmm_memd_region_asleep_bytes{{region=\"kv\"}} {}",
            2 * CHUNK
        )),
        "{metrics}"
    );
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));

    // Wake: the chunks are made again now, before anyone attaches.
    let woke = owner.wake_region("kv").unwrap();
    assert_eq!(
        woke,
        RegionWoke {
            generation: 1,
            zeroed: true
        }
    );
    assert_eq!(settled_fds(&service), service_fds);
    assert_eq!(sleep_of(&owner.status().unwrap(), "kv"), SleepState::Awake);
    assert!(
        owner
            .metrics()
            .unwrap()
            .contains("vmm_memd_region_asleep{region=\"kv\"} 0")
    );
    let again = reader.attach("kv").unwrap();
    assert_eq!(again.generation, 1);
    assert!(zeroed(&again));
    assert_eq!(again.tensor("t1").map(<[u8]>::len), Some(CHUNK as usize));
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));
    reader.detach(&again).unwrap();

    // An awake generation: a wake is refused and changes nothing.
    let before = owner.status().unwrap();
    let refused = refusal(owner.wake_region("kv").unwrap_err());
    assert!(
        matches!(
            refused,
            Refusal::InvalidRequest {
                rule: RequestRule::NotAsleep,
                ..
            }
        ),
        "{refused:?}"
    );
    let after = owner.status().unwrap();
    assert_eq!(after.regions, before.regions);

    // No lease: a sleep frees at once, and the next attach wakes it (the attach path).
    let slept = owner.sleep_region("kv").unwrap();
    assert_eq!(slept.leases, 0);
    assert_eq!(settled_fds(&service), service_fds - 2);
    let woken_by_attach = reader.attach("kv").unwrap();
    assert!(zeroed(&woken_by_attach));
    assert_eq!(settled_fds(&service), service_fds);
}

/// The last lease ends by the reader's death (SIGKILL while the sleep waits for it): the
/// service lets the memory go then, and a wake makes it again.
#[test]
fn a_sleep_waiting_for_a_reader_that_is_killed_frees_the_memory() {
    let service = ServiceProc::start(&[]);
    let owner = service.connect();
    publish(&owner, "kv", 2, CHUNK);
    let mut holder = Role::spawn("holder", &service, &["kv"], false);
    assert_eq!(holder.expect_line(), "HOLDING 1");
    let service_fds = settled_fds(&service);
    assert_eq!(owner.sleep_region("kv").unwrap().leases, 1);
    assert_eq!(
        settled_fds(&service),
        service_fds,
        "the holder's lease keeps it"
    );
    holder.signal(libc::SIGKILL);
    // Its connection (socket and pidfd) and both chunks go.
    let freed = until(Duration::from_secs(2), || {
        service.fd_count() == service_fds - 4
    });
    assert!(freed.is_some(), "{} fds", service.fd_count());
    assert_eq!(sleep_of(&owner.status().unwrap(), "kv"), SleepState::Asleep);
    assert!(owner.wake_region("kv").unwrap().zeroed);
    assert!(zeroed(&owner.attach("kv").unwrap()));
}

#[test]
fn a_wake_calls_off_a_sleep_still_waiting_for_leases() {
    let service = ServiceProc::start(&[]);
    let owner = service.connect();
    publish(&owner, "kv", 1, CHUNK);
    let reader = service.connect();
    let attached = reader.attach("kv").unwrap();
    let service_fds = settled_fds(&service);
    assert_eq!(owner.sleep_region("kv").unwrap().leases, 1);
    let woke = owner.wake_region("kv").unwrap();
    assert_eq!(
        woke,
        RegionWoke {
            generation: 1,
            zeroed: false
        }
    );
    assert_eq!(sleep_of(&owner.status().unwrap(), "kv"), SleepState::Awake);
    reader.detach(&attached).unwrap();
    assert_eq!(settled_fds(&service), service_fds, "nothing freed");
    let again = reader.attach("kv").unwrap();
    assert!(common::holds(&again.chunks[0], 1), "the contents stayed");
}

#[test]
fn unknown_regions_and_regions_without_a_commit_are_no_such_region() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    for result in [
        client.sleep_region("nothing-here").map(drop),
        client.wake_region("nothing-here").map(drop),
    ] {
        assert!(matches!(
            refusal(result.unwrap_err()),
            Refusal::NoSuchRegion { region } if region == "nothing-here"
        ));
    }
    // A region whose first generation is still being written has no current one.
    let writer_client = service.connect();
    let writer = writer_client
        .begin("pending", &[CHUNK], BeginOptions::default())
        .unwrap();
    assert!(matches!(
        refusal(client.sleep_region("pending").unwrap_err()),
        Refusal::NoSuchRegion { .. }
    ));
    drop(writer);
}

fn memctl_as_nobody(service: &ServiceProc, args: &[&str]) -> Output {
    program_as_nobody("vmm-memctl")
        .args(["--socket", &service.socket, "--json"])
        .args(["--service-uid", &common::euid().to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The refusal `vmm-memctl --json` printed (exit status 1).
fn refused(out: &Output) -> serde_json::Value {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    doc["refused"].clone()
}

fn begin_with(client: &Client, region: &str, acl: Acl) {
    let options = BeginOptions {
        acl,
        ..Default::default()
    };
    let writer = client.begin(region, &[CHUNK], options).unwrap();
    writer.chunk(0).fill(common::fill_byte(1)).unwrap();
    writer.commit().unwrap();
}

/// Sleep and wake are for whoever holds the region's write right (its owner, or whom its ACL
/// lets write): uid 65534 that may only read is refused with `AccessDenied` for `write` and
/// nothing changes (the full status, counters aside, is the same); a region it may not read
/// does not exist for it; given the write right, it may.
#[test]
fn another_uid_without_the_write_right_is_refused_and_nothing_changes() {
    if !is_root() {
        eprintln!(
            "SKIP another_uid_without_the_write_right_is_refused_and_nothing_changes: needs root for setpriv"
        );
        return;
    }
    let service = ServiceProc::start(&[]);
    let owner = service.connect();
    let read_only = Acl {
        read: vec![Principal::Uid(NOBODY)],
        ..Default::default()
    };
    begin_with(&owner, "weights", read_only);
    begin_with(&owner, "private", Acl::default());
    let writable = Acl {
        write: vec![Principal::Uid(NOBODY)],
        ..Default::default()
    };
    begin_with(&owner, "shared-kv", writable);
    let service_fds = settled_fds(&service);
    let before = owner.status().unwrap();

    for command in ["sleep", "wake"] {
        let denied = refused(&memctl_as_nobody(&service, &[command, "weights"]));
        assert_eq!(denied["AccessDenied"]["right"], "Write", "{denied}");
        assert_eq!(denied["AccessDenied"]["uid"], NOBODY, "{denied}");
        let hidden = refused(&memctl_as_nobody(&service, &[command, "private"]));
        assert_eq!(hidden["NoSuchRegion"]["region"], "private", "{hidden}");
    }
    let after = owner.status().unwrap();
    assert_eq!(
        after.regions, before.regions,
        "a refused sleep changed something"
    );
    assert_eq!(settled_fds(&service), service_fds);
    let attached = owner.attach("weights").unwrap();
    assert!(common::holds(&attached.chunks[0], 1));
    owner.detach(&attached).unwrap();

    // With the write right it may.
    let out = memctl_as_nobody(&service, &["sleep", "shared-kv"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        sleep_of(&owner.status().unwrap(), "shared-kv"),
        SleepState::Asleep
    );
    let out = memctl_as_nobody(&service, &["wake", "shared-kv"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["zeroed"], true, "{doc}");
}
