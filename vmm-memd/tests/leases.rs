//! Leases come from the connection: a reader SIGKILLed, a reader whose process exits while
//! another process still holds its socket, a SIGSTOPped reader (TTL, though its client
//! renews), renewal by hand and by the client's keep-alive.

mod common;

use std::time::{Duration, Instant};

use common::{Role, ServiceProc, publish, role_args, role_client, say, until};
use vmm_memd::{MemdError, Refusal, RequestRule};

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    let client = role_client();
    match role.as_str() {
        // Attach ARGS[0] and hold the lease until killed.
        "hold" => {
            let attached = client.attach(&args[0]).unwrap();
            say(&format!("ATTACHED {}", attached.generation));
            std::thread::sleep(Duration::from_secs(60));
        }
        // Attach, fork a child that keeps the connection's socket open, then exit.
        "hold-fork-exit" => {
            let attached = client.attach(&args[0]).unwrap();
            // SAFETY: the child only sleeps (async-signal-safe calls) and _exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: async-signal-safe calls only.
                unsafe {
                    libc::sleep(60);
                    libc::_exit(0);
                }
            }
            say(&format!("ATTACHED {} {pid}", attached.generation));
            // SAFETY: ends this process at once (the child keeps the socket).
            unsafe { libc::_exit(0) };
        }
        other => panic!("unknown role {other}"),
    }
}

fn readers_of(client: &vmm_memd::Client, generation: u64) -> Vec<i32> {
    let status = client.status().unwrap();
    status.regions[0]
        .generations
        .iter()
        .find(|g| g.generation == generation)
        .map(|g| g.readers.clone())
        .unwrap_or_default()
}

#[test]
fn a_reader_sigkilled_releases_its_lease_within_100_ms() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 1, 1 << 20);
    let mut reader = Role::spawn("hold", &service, &["weights"], false);
    assert_eq!(reader.expect_line(), "ATTACHED 1");
    // Generation 2 retires 1, which only the reader's lease keeps.
    publish(&client, "weights", 1, 1 << 20);
    assert_eq!(readers_of(&client, 1), [reader.pid()]);
    assert_eq!(client.status().unwrap().used, 2 << 20);
    reader.signal(libc::SIGKILL);
    let took = until(Duration::from_secs(2), || readers_of(&client, 1).is_empty())
        .expect("the lease ends");
    eprintln!("lease released {took:?} after SIGKILL");
    assert!(took < Duration::from_millis(100), "took {took:?}");
    assert_eq!(client.status().unwrap().used, 1 << 20, "generation 1 freed");
}

#[test]
fn a_lease_ends_with_its_process_even_if_another_process_holds_the_socket() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 1, 4096);
    let mut reader = Role::spawn("hold-fork-exit", &service, &["weights"], false);
    let line = reader.expect_line();
    let holder: i32 = line.split(' ').nth(2).unwrap().parse().unwrap();
    publish(&client, "weights", 1, 4096);
    let took = until(Duration::from_secs(2), || readers_of(&client, 1).is_empty());
    // SAFETY: kill of the forked holder (a grandchild; init reaps it).
    unsafe { libc::kill(holder, libc::SIGKILL) };
    let took = took.expect("the lease ends with the process (pidfd), not with the socket");
    assert!(took < Duration::from_millis(500), "took {took:?}");
}

#[test]
fn a_sigstopped_readers_lease_expires_by_ttl_and_its_mapping_stays_valid() {
    let service = ServiceProc::start(&["--lease-ttl-ms", "300"]);
    let client = service.connect();
    publish(&client, "weights", 1, 4096);
    let mut reader = Role::spawn("hold", &service, &["weights"], false);
    assert_eq!(reader.expect_line(), "ATTACHED 1");
    let attached_at = Instant::now();
    reader.signal(libc::SIGSTOP);
    publish(&client, "weights", 1, 4096);
    assert_eq!(readers_of(&client, 1), [reader.pid()]);
    let gone = until(Duration::from_secs(2), || readers_of(&client, 1).is_empty())
        .expect("the stopped reader's lease expires");
    let after = attached_at.elapsed();
    eprintln!("lease of a stopped reader gone {after:?} after attach (TTL 300 ms)");
    assert!(
        after >= Duration::from_millis(250),
        "ended by TTL, not early: {gone:?}"
    );
    let status = client.status().unwrap();
    assert_eq!(status.expired_leases, 1);
    assert_eq!(status.used, 4096, "generation 1 freed");
    // The reader's process is still there (stopped), its connection open.
    let mut st = 0;
    // SAFETY: a non-blocking wait on our own child.
    let reaped = unsafe { libc::waitpid(reader.pid(), &mut st, libc::WNOHANG) };
    assert_eq!(reaped, 0);
    reader.signal(libc::SIGCONT);
}

#[test]
fn renewal_keeps_a_lease_past_its_ttl_and_an_expired_one_is_not_renewed() {
    let service = ServiceProc::start(&["--lease-ttl-ms", "200"]);
    let writer = service.connect();
    publish(&writer, "weights", 1, 4096);
    let reader = service.connect();
    // Renewal by hand: the client's own keep-alive off.
    reader.set_keep_alive(false);
    let attached = reader.attach("weights").unwrap();
    assert_eq!(attached.ttl, Duration::from_millis(200));
    publish(&writer, "weights", 1, 4096);
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(reader.renew().unwrap(), 1);
    }
    assert_eq!(readers_of(&writer, 1).len(), 1, "renewed for 600 ms > TTL");
    std::thread::sleep(Duration::from_millis(400));
    assert!(readers_of(&writer, 1).is_empty());
    assert_eq!(reader.renew().unwrap(), 0, "an expired lease is gone");
    // Expiry does not touch the mapping: the bytes are the kernel's to keep.
    assert!(common::holds(&attached.chunks[0], 1));
}

#[test]
fn the_client_keeps_its_leases_alive_until_told_not_to() {
    let service = ServiceProc::start(&["--lease-ttl-ms", "400"]);
    let writer = service.connect();
    publish(&writer, "weights", 1, 4096);
    let reader = service.connect();
    let attached = reader.attach("weights").unwrap();
    // Generation 2 retires 1: only the reader's lease keeps it.
    publish(&writer, "weights", 1, 4096);
    std::thread::sleep(Duration::from_millis(2000));
    assert_eq!(
        readers_of(&writer, 1),
        [std::process::id() as i32],
        "kept for 5 TTLs by the client's renewals"
    );
    assert_eq!(writer.status().unwrap().expired_leases, 0);
    reader.set_keep_alive(false);
    let gone = until(Duration::from_secs(3), || readers_of(&writer, 1).is_empty());
    assert!(gone.is_some(), "with renewal off the lease ends by TTL");
    assert_eq!(writer.status().unwrap().expired_leases, 1);
    assert!(common::holds(&attached.chunks[0], 1), "the mapping stays");
}

#[test]
fn renewals_never_come_between_a_call_and_its_reply() {
    // A TTL of 30 ms: the client renews every 10 ms while it attaches and detaches, each
    // attach several messages (the reply, metadata, 4 descriptors). A renewal sent or read
    // inside one of them would desynchronise the connection (BadReply, a wrong reply).
    let service = ServiceProc::start(&["--lease-ttl-ms", "30"]);
    let writer = service.connect();
    publish(&writer, "weights", 4, 4096);
    let reader = service.connect();
    let held = reader.attach("weights").unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    let mut attaches = 0;
    while Instant::now() < until {
        let attached = reader.attach("weights").unwrap();
        assert_eq!(attached.chunks.len(), 4);
        // A 30 ms lease may run out on a loaded machine before it is detached: the refusal
        // is then this request's own reply, still in step.
        match reader.detach(&attached) {
            Ok(())
            | Err(MemdError::Refused(Refusal::InvalidRequest {
                rule: RequestRule::NoSuchLease,
                ..
            })) => {}
            Err(e) => panic!("the detach's reply: {e:?}"),
        }
        assert!(reader.list().unwrap().iter().any(|r| r.region == "weights"));
        attaches += 1;
    }
    eprintln!("{attaches} attaches while the client renewed every 10 ms");
    // The connection is still in step: a last exchange of each kind.
    assert_eq!(reader.attach("weights").unwrap().chunks.len(), 4);
    reader.renew().unwrap();
    drop(held);
}
