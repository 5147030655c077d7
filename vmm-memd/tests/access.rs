//! Identity from the kernel only: ACLs and quotas for another uid (uid 65534 through
//! `setpriv`, when running as root), the message cap, the connection cap, and committed
//! memory that no reader can write, whichever way it tries.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use common::{NOBODY, Role, ServiceProc, is_root, publish, role_args, role_client, say};
use vmm_memd::protocol::{Acl, MAX_REQUEST, Principal, Request, Response};
use vmm_memd::{BeginOptions, Client, InFlightScope, MemdError, Refusal, Right};

const MIB: u64 = 1 << 20;

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    let client = role_client();
    match role.as_str() {
        "other-uid" => other_uid(&client),
        "try-writes" => try_writes(&client, &args[0]),
        "list" => {
            let names: Vec<String> = client
                .list()
                .unwrap()
                .into_iter()
                .map(|r| r.region)
                .collect();
            say(&format!("LIST {}", names.join(",")));
        }
        other => panic!("unknown role {other}"),
    }
    say("DONE");
}

/// What uid 65534 may and may not do (the parent, root, made the regions).
fn other_uid(client: &Client) {
    let names: Vec<String> = client
        .list()
        .unwrap()
        .into_iter()
        .map(|r| r.region)
        .collect();
    assert_eq!(
        names,
        ["by-group", "public", "shared-write"],
        "private stays unlisted"
    );
    let status = client.status().unwrap();
    assert_eq!(
        (status.uid, status.quota),
        (NOBODY, MIB),
        "the kernel's uid"
    );
    assert_eq!(status.regions.len(), 3);
    let denied = |e: MemdError| match e {
        MemdError::Refused(r) => r,
        other => panic!("{other:?}"),
    };
    let err = denied(client.attach("private").unwrap_err());
    assert!(matches!(err, Refusal::NoSuchRegion { .. }), "{err:?}");
    client.attach("public").unwrap();
    client.attach("by-group").unwrap();
    let err = denied(
        client
            .begin("public", &[4096], BeginOptions::default())
            .unwrap_err(),
    );
    assert_eq!(
        err,
        Refusal::AccessDenied {
            region: "public".into(),
            right: Right::Write,
            uid: NOBODY
        }
    );
    assert_eq!(publish(client, "shared-write", 1, 4096), 2);
    let err = denied(client.delete("public").unwrap_err());
    assert!(
        matches!(
            err,
            Refusal::AccessDenied {
                right: Right::Delete,
                uid: NOBODY,
                ..
            }
        ),
        "{err:?}"
    );
    let err = denied(client.delete("private").unwrap_err());
    assert!(matches!(err, Refusal::NoSuchRegion { .. }), "{err:?}");
    // Quota: 1 MiB for this uid, 4096 bytes in use.
    let err = denied(
        client
            .begin("mine", &[MIB], BeginOptions::default())
            .unwrap_err(),
    );
    assert_eq!(
        err,
        Refusal::QuotaExceeded {
            uid: NOBODY,
            used: 4096,
            asked: MIB,
            quota: MIB
        }
    );
    let status = client.status().unwrap();
    assert_eq!(
        status.used, 4096,
        "nothing allocated for the refused generation"
    );
    assert!(status.regions.iter().all(|r| r.region != "mine"));
}

/// Attach as a hostile reader does (the raw protocol, keeping the fds), then try every way
/// to write the committed memory.
fn try_writes(client: &Client, region: &str) {
    let session = client.session();
    session
        .send_data(
            &postcard::to_allocvec(&Request::Attach {
                region: region.into(),
                generation: None,
            })
            .unwrap(),
        )
        .unwrap();
    let reply: Response = postcard::from_bytes(&session.recv_data().unwrap()).unwrap();
    let Response::Attached {
        chunks, meta_pages, ..
    } = reply
    else {
        panic!("{reply:?}")
    };
    for _ in 0..meta_pages {
        session.recv_data().unwrap();
    }
    let descriptor = session.recv_descriptor().unwrap().into_host().unwrap();
    assert_eq!(descriptor.size() as u64, chunks[0]);
    let fd: OwnedFd = descriptor.fd().unwrap().try_clone_to_owned().unwrap();
    let raw = fd.as_raw_fd();
    let len = chunks[0] as usize;
    let errno = || std::io::Error::last_os_error().raw_os_error().unwrap();
    // SAFETY: plain system calls on our own fd and mappings (all below), results checked.
    unsafe {
        // 1. A writable shared mapping.
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            raw,
            0,
        );
        assert_eq!(
            p,
            libc::MAP_FAILED,
            "mmap(PROT_WRITE, MAP_SHARED) must fail"
        );
        assert_eq!(errno(), libc::EPERM);
        // 2. write(2) and pwrite(2).
        assert_eq!(
            libc::write(raw, b"x".as_ptr().cast(), 1),
            -1,
            "write(2) must fail"
        );
        assert_eq!(errno(), libc::EPERM);
        assert_eq!(
            libc::pwrite(raw, b"x".as_ptr().cast(), 1, 8),
            -1,
            "pwrite must fail"
        );
        assert_eq!(errno(), libc::EPERM);
        // 3. Resizing, and punching a hole (which would zero bytes).
        assert_eq!(libc::ftruncate(raw, 0), -1, "shrinking must fail");
        assert_eq!(
            libc::ftruncate(raw, (len * 2) as i64),
            -1,
            "growing must fail"
        );
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        assert_eq!(
            libc::fallocate(raw, punch, 0, len as i64),
            -1,
            "a hole must fail"
        );
        // 4. A read-only shared mapping made writable.
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            raw,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        assert_eq!(
            libc::mprotect(p, len, libc::PROT_READ | libc::PROT_WRITE),
            -1,
            "mprotect must fail"
        );
        assert_eq!(errno(), libc::EACCES);
        libc::munmap(p, len);
        // 5. The seals themselves: no more may be added (or the file's state changed).
        assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_WRITE), -1);
        assert_eq!(errno(), libc::EPERM);
        // 6. Reopening the file read-write through /proc: the seal is the inode's.
        let path = std::ffi::CString::new(format!("/proc/self/fd/{raw}")).unwrap();
        let again = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if again >= 0 {
            assert_eq!(
                libc::write(again, b"x".as_ptr().cast(), 1),
                -1,
                "write through a reopened fd must fail"
            );
            libc::close(again);
        }
        // 7. A private writable mapping is allowed: copy-on-write, invisible to others.
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            raw,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        std::ptr::write_bytes(p.cast::<u8>(), 0, len);
        libc::munmap(p, len);
    }
    let fresh = client.attach(region).unwrap();
    assert!(common::holds(&fresh.chunks[0], 1), "contents unchanged");
}

#[test]
fn another_uid_sees_only_what_acls_give_it_and_its_own_quota() {
    if !is_root() {
        eprintln!(
            "SKIP another_uid_sees_only_what_acls_give_it_and_its_own_quota: needs root for setpriv"
        );
        return;
    }
    let quota = format!("{NOBODY}={MIB}");
    let service = ServiceProc::start(&["--quota", &quota]);
    let root = service.connect();
    let with = |acl: Acl| BeginOptions {
        acl,
        ..Default::default()
    };
    for (region, acl) in [
        ("private", Acl::default()),
        (
            "public",
            Acl {
                read: vec![Principal::Uid(NOBODY)],
                ..Default::default()
            },
        ),
        (
            "by-group",
            Acl {
                read: vec![Principal::Gid(NOBODY)],
                ..Default::default()
            },
        ),
        (
            "shared-write",
            Acl {
                write: vec![Principal::Uid(NOBODY)],
                ..Default::default()
            },
        ),
    ] {
        let w = root.begin(region, &[4096], with(acl)).unwrap();
        w.chunk(0).fill(common::fill_byte(1)).unwrap();
        w.commit().unwrap();
    }
    let mut other = Role::spawn("other-uid", &service, &[], true);
    assert_eq!(other.expect_line(), "DONE");
    assert!(other.wait_success());
    // Root's own view: nobody's generation 2 of shared-write is charged to nobody, and
    // root's generation 1 of it, retired with no reader, is freed and refunded.
    let status = root.status().unwrap();
    assert_eq!(status.used, 3 * 4096);
    assert_eq!(status.regions.len(), 4);
}

#[test]
fn a_quota_refusal_comes_before_any_allocation() {
    let service = ServiceProc::start(&["--quota-bytes", "1048576"]);
    let client = service.connect();
    publish(&client, "a", 1, 512 << 10);
    for chunks in [vec![MIB], vec![u64::MAX, 1], vec![256 << 10; 3]] {
        let err = client
            .begin("b", &chunks, BeginOptions::default())
            .unwrap_err();
        assert!(
            matches!(&err, MemdError::Refused(Refusal::QuotaExceeded { used, quota, .. }) if *used == 512 << 10 && *quota == MIB),
            "{chunks:?}: {err:?}"
        );
    }
    let status = client.status().unwrap();
    assert_eq!(status.used, 512 << 10);
    assert_eq!(client.list().unwrap().len(), 1, "no region b");
    // Within the quota it goes through.
    publish(&client, "b", 2, 256 << 10);
}

#[test]
fn a_reader_cannot_write_committed_memory_any_way_it_tries() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "sealed", 1, 64 << 10);
    let nobody = is_root();
    if nobody {
        // The region must be readable by the other uid.
        let w = client
            .begin(
                "sealed-other",
                &[64 << 10],
                BeginOptions {
                    acl: Acl {
                        read: vec![Principal::Uid(NOBODY)],
                        ..Default::default()
                    },
                    ..Default::default()
                },
            )
            .unwrap();
        w.chunk(0).fill(common::fill_byte(1)).unwrap();
        w.commit().unwrap();
    }
    let region = if nobody { "sealed-other" } else { "sealed" };
    let mut reader = Role::spawn("try-writes", &service, &[region], nobody);
    assert_eq!(reader.expect_line(), "DONE");
    assert!(reader.wait_success());
    // And in this process too (same uid as the writer).
    try_writes(&client, "sealed");
}

#[test]
fn a_request_over_the_cap_is_refused_before_decoding() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    // A valid request followed by padding: decoded, the padding would be ignored.
    let mut bytes = postcard::to_allocvec(&Request::Status).unwrap();
    bytes.resize(MAX_REQUEST, 0);
    assert!(matches!(
        client.request_raw(&bytes).unwrap(),
        Response::Status(_)
    ));
    bytes.push(0);
    assert_eq!(
        client.request_raw(&bytes).unwrap(),
        Response::Refused(Refusal::TooLarge {
            size: MAX_REQUEST as u64 + 1,
            cap: MAX_REQUEST as u64
        })
    );
    // Garbage is a typed refusal too, and the connection goes on.
    let reply = client.request_raw(&[0xFF; 16]).unwrap();
    assert!(
        matches!(reply, Response::Refused(Refusal::InvalidRequest { .. })),
        "{reply:?}"
    );
    assert_eq!(client.status().unwrap().refusals, 2);
}

#[test]
fn connections_per_uid_are_capped() {
    let service = ServiceProc::start(&["--max-connections-per-uid", "2"]);
    // The start-up probe's connection ends within a poll tick: retry until it has.
    let connect = || {
        let started = std::time::Instant::now();
        loop {
            match service.try_connect() {
                Ok(c) => return c,
                Err(_) if started.elapsed() < Duration::from_secs(2) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    };
    // Both hold a lease, so neither can be evicted for a newcomer of their uid (an idle one
    // would be: `availability.rs`).
    let (a, b) = (connect(), connect());
    publish(&a, "w", 1, 4096);
    let leases = (a.attach("w").unwrap(), b.attach("w").unwrap());
    let err = service.try_connect().unwrap_err();
    assert!(
        matches!(&err, MemdError::Core(vmm_core::Error::PeerRefused { .. })),
        "{err:?}"
    );
    drop((leases, b));
    drop(a);
    // Its slot frees once the service sees the hang-up (within a poll tick).
    common::until(Duration::from_secs(2), || service.try_connect().is_ok())
        .expect("a slot frees when a connection ends");
}

#[test]
fn a_client_that_does_not_read_its_descriptors_gets_no_more() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "w", 4, 4096);
    let session = client.session();
    let attach = postcard::to_allocvec(&Request::Attach {
        region: "w".into(),
        generation: None,
    })
    .unwrap();
    session.send_data(&attach).unwrap();
    session.send_data(&attach).unwrap();
    // The service sent the first reply's 4 descriptors; the second waits for them to be read.
    std::thread::sleep(vmm_memd::IN_FLIGHT_WAIT + Duration::from_millis(200));
    let first: Response = postcard::from_bytes(&session.recv_data().unwrap()).unwrap();
    assert!(
        matches!(first, Response::Attached { meta_pages: 1, .. }),
        "{first:?}"
    );
    session.recv_data().unwrap();
    for _ in 0..4 {
        session.recv_descriptor().unwrap();
    }
    let second: Response = postcard::from_bytes(&session.recv_data().unwrap()).unwrap();
    assert!(
        matches!(
            second,
            Response::Refused(Refusal::FdsInFlight {
                scope: InFlightScope::Connection,
                ..
            })
        ),
        "{second:?}"
    );
    // Read up: served again.
    assert_eq!(client.attach("w").unwrap().chunks.len(), 4);

    // The same for a writer that pipelines Begin, Abort, Begin.
    let begin = postcard::to_allocvec(&Request::Begin {
        region: "v".into(),
        chunks: vec![4096; 4],
        acl: Acl::default(),
        wait_ms: 0,
    })
    .unwrap();
    session.send_data(&begin).unwrap();
    session
        .send_data(&postcard::to_allocvec(&Request::Abort).unwrap())
        .unwrap();
    session.send_data(&begin).unwrap();
    std::thread::sleep(vmm_memd::IN_FLIGHT_WAIT + Duration::from_millis(200));
    let began: Response = postcard::from_bytes(&session.recv_data().unwrap()).unwrap();
    assert!(matches!(began, Response::Began { .. }), "{began:?}");
    for _ in 0..4 {
        session.recv_descriptor().unwrap();
    }
    let aborted: Response = postcard::from_bytes(&session.recv_data().unwrap()).unwrap();
    assert_eq!(aborted, Response::Done);
    let third: Response = postcard::from_bytes(&session.recv_data().unwrap()).unwrap();
    assert!(
        matches!(
            third,
            Response::Refused(Refusal::FdsInFlight {
                scope: InFlightScope::Connection,
                ..
            })
        ),
        "{third:?}"
    );
}

#[test]
fn metadata_outside_its_chunk_and_requests_out_of_turn_are_refused() {
    use vmm_memd::RequestRule;
    use vmm_memd::protocol::{Dtype, TensorMeta};
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let rule = |e: MemdError| match e {
        MemdError::Refused(Refusal::InvalidRequest { rule, .. }) => rule,
        other => panic!("{other:?}"),
    };
    let request = |r: &Request| match client.request_raw(&postcard::to_allocvec(r).unwrap()) {
        Ok(Response::Refused(refusal)) => Err(MemdError::Refused(refusal)),
        other => other,
    };
    assert_eq!(
        rule(request(&Request::Commit).unwrap_err()),
        RequestRule::NotWriting
    );
    let mut writer = client.begin("w", &[4096], BeginOptions::default()).unwrap();
    writer.put(
        "past-the-end",
        TensorMeta {
            chunk: 0,
            offset: 4000,
            len: 97,
            dtype: Dtype::U8,
            shape: vec![97],
        },
    );
    assert_eq!(rule(writer.commit().unwrap_err()), RequestRule::Metadata);
    // Refused metadata aborted the generation: the connection writes nothing now.
    assert_eq!(
        rule(request(&Request::Commit).unwrap_err()),
        RequestRule::NotWriting
    );
    assert!(client.list().unwrap().is_empty());
    let writer = client.begin("w", &[4096], BeginOptions::default()).unwrap();
    let bad_chunk = Request::PutMeta(vec![(
        "no-chunk".into(),
        TensorMeta {
            chunk: 1,
            offset: 0,
            len: 1,
            dtype: Dtype::U8,
            shape: vec![1],
        },
    )]);
    assert_eq!(
        rule(request(&bad_chunk).unwrap_err()),
        RequestRule::Metadata
    );
    let again = Request::Begin {
        region: "x".into(),
        chunks: vec![1],
        acl: Acl::default(),
        wait_ms: 0,
    };
    assert_eq!(
        rule(request(&again).unwrap_err()),
        RequestRule::AlreadyWriting
    );
    for chunks in [vec![], vec![0], vec![1; vmm_memd::protocol::MAX_CHUNKS + 1]] {
        let other = service.connect();
        let err = other
            .begin("y", &chunks, BeginOptions::default())
            .unwrap_err();
        assert_eq!(rule(err), RequestRule::Chunks, "{chunks:?}");
    }
    drop(writer); // aborts
    assert!(
        client.list().unwrap().is_empty(),
        "a region never committed is gone with its writer"
    );
}

#[test]
fn fds_in_flight_are_capped_per_uid() {
    let service = ServiceProc::start(&["--max-fds-in-flight-per-uid", "6"]);
    let (a, b) = (service.connect(), service.connect());
    publish(&a, "w", 4, 4096);
    // `a` asks and does not read: its 4 fds are in flight.
    let attach = postcard::to_allocvec(&Request::Attach {
        region: "w".into(),
        generation: None,
    })
    .unwrap();
    a.session().send_data(&attach).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let err = b.attach("w").unwrap_err();
    assert!(
        matches!(
            err,
            MemdError::Refused(Refusal::FdsInFlight {
                scope: InFlightScope::Uid,
                in_flight: 4,
                cap: 6
            })
        ),
        "{err:?}"
    );
    assert!(
        b.status().unwrap().regions[0].generations[0].readers.len() == 1,
        "the refused attach left no lease"
    );
    // `a` reads its reply: the budget comes back within a poll tick.
    let reply: Response = postcard::from_bytes(&a.session().recv_data().unwrap()).unwrap();
    assert!(matches!(reply, Response::Attached { meta_pages: 1, .. }));
    a.session().recv_data().unwrap();
    for _ in 0..4 {
        a.session().recv_descriptor().unwrap();
    }
    assert_eq!(b.attach("w").unwrap().chunks.len(), 4);
}

#[test]
fn supplementary_groups_come_from_the_kernel() {
    if !is_root() {
        eprintln!("SKIP supplementary_groups_come_from_the_kernel: needs root for setpriv");
        return;
    }
    let service = ServiceProc::start(&[]);
    let root = service.connect();
    let acl = Acl {
        read: vec![Principal::Gid(4242)],
        ..Default::default()
    };
    let w = root
        .begin(
            "group-4242",
            &[4096],
            BeginOptions {
                acl,
                ..Default::default()
            },
        )
        .unwrap();
    w.commit().unwrap();
    let mut member = Role::spawn_as("list", &service, &[], Some("--groups=4242"));
    assert_eq!(member.expect_line(), "LIST group-4242", "SO_PEERGROUPS");
    assert_eq!(member.expect_line(), "DONE");
    let mut outsider = Role::spawn_as("list", &service, &[], Some("--clear-groups"));
    assert_eq!(outsider.expect_line(), "LIST", "not in group 4242");
    assert_eq!(outsider.expect_line(), "DONE");
}
