//! Regions with generations: publish and attach, readers that never see an uncommitted
//! generation, a writer killed mid-fill, the writer slot.

mod common;

use std::time::{Duration, Instant};

use common::{Role, ServiceProc, fill_byte, publish, role_args, role_client, say, until};
use vmm_memd::protocol::{Dtype, TensorMeta};
use vmm_memd::{BeginOptions, MemdError, Refusal};

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    let client = role_client();
    match role.as_str() {
        // Attach, check, detach, for ARGS[1] ms: every attached generation must be whole.
        "poll" => {
            let (region, ms): (&str, u64) = (&args[0], args[1].parse().unwrap());
            let until = Instant::now() + Duration::from_millis(ms);
            let (mut attaches, mut seen) = (0u64, std::collections::BTreeSet::new());
            while Instant::now() < until {
                let attached = match client.attach(region) {
                    Ok(a) => a,
                    Err(MemdError::Refused(Refusal::NoSuchRegion { .. })) => continue,
                    Err(e) => panic!("attach: {e:?}"),
                };
                let byte = fill_byte(attached.generation);
                for (i, chunk) in attached.chunks.iter().enumerate() {
                    let bad = chunk.as_slice().iter().position(|&b| b != byte);
                    assert!(
                        bad.is_none(),
                        "generation {} chunk {i}: byte {bad:?} is not {byte}: an uncommitted generation",
                        attached.generation
                    );
                }
                client.detach(&attached).unwrap();
                attaches += 1;
                seen.insert(attached.generation);
            }
            say(&format!("OK {attaches} {}", seen.len()));
        }
        // Begin a generation of 16 MiB, fill half of it, then wait to be killed.
        "fill-and-hang" => {
            let writer = client
                .begin(&args[0], &[8 << 20, 8 << 20], BeginOptions::default())
                .unwrap();
            writer.chunk(0).fill(0xEE).unwrap();
            say(&format!("BEGAN {}", writer.generation()));
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn publish_then_attach_round_trip() {
    let service = ServiceProc::start(&[]);
    let writer_client = service.connect();
    let mut writer = writer_client
        .begin("weights", &[4096, 10_000], BeginOptions::default())
        .unwrap();
    assert_eq!(writer.generation(), 1);
    writer.chunk(0).write_at(100, b"hello").unwrap();
    writer.chunk(1).write_at(9_995, b"world").unwrap();
    let meta = |chunk, offset, len| TensorMeta {
        chunk,
        offset,
        len,
        dtype: Dtype::U8,
        shape: vec![len],
    };
    writer.put("a", meta(0, 100, 5));
    writer.put("b", meta(1, 9_995, 5));
    assert_eq!(writer.commit().unwrap(), 1);

    // Another process's view: a reader role is not needed for the bytes, but the reader is a
    // second connection.
    let reader = service.connect();
    let attached = reader.attach("weights").unwrap();
    assert_eq!(attached.generation, 1);
    assert_eq!(attached.tensor("a"), Some(&b"hello"[..]));
    assert_eq!(attached.tensor("b"), Some(&b"world"[..]));
    assert_eq!(attached.chunks[1].len(), 10_000);
    let list = reader.list().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].generation, list[0].bytes), (1, 14_096));

    // Generation 2 while 1 is attached: 1 stays served (and unchanged) until detached.
    let g2 = publish(&writer_client, "weights", 1, 4096);
    assert_eq!(g2, 2);
    assert_eq!(attached.tensor("a"), Some(&b"hello"[..]));
    let status = reader.status().unwrap();
    let gens: Vec<u64> = status.regions[0]
        .generations
        .iter()
        .map(|g| g.generation)
        .collect();
    assert_eq!(gens, [1, 2]);
    assert_eq!(status.used, 14_096 + 4096);
    reader.detach(&attached).unwrap();
    let status = reader.status().unwrap();
    let gens: Vec<u64> = status.regions[0]
        .generations
        .iter()
        .map(|g| g.generation)
        .collect();
    assert_eq!(gens, [2], "generation 1 is freed with its last reader");
    assert_eq!(status.used, 4096);
    // The mapping outlives the lease.
    assert_eq!(attached.tensor("a"), Some(&b"hello"[..]));
    let again = reader.attach("weights").unwrap();
    assert_eq!(again.generation, 2);
    assert!(common::holds(&again.chunks[0], 2));
}

#[test]
fn thirty_two_readers_never_map_an_uncommitted_generation() {
    let service = ServiceProc::start(&[]);
    let writer = service.connect();
    publish(&writer, "kv", 4, 256 << 10);
    let readers: Vec<Role> = (0..32)
        .map(|_| Role::spawn("poll", &service, &["kv", "2500"], false))
        .collect();
    // Fill slowly, chunk by chunk, so a reader that could see a pending generation would
    // see it half filled.
    let started = Instant::now();
    let mut committed = 1;
    while started.elapsed() < Duration::from_millis(2500) {
        let w = writer
            .begin("kv", &[256 << 10; 4], BeginOptions::default())
            .unwrap();
        let byte = fill_byte(w.generation());
        for chunk in w.chunks() {
            chunk.fill(byte).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        committed = w.commit().unwrap();
    }
    assert!(committed >= 5, "only {committed} generations published");
    let mut total = 0u64;
    for mut reader in readers {
        let line = reader.expect_line();
        let n: u64 = line.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(line.starts_with("OK "), "{line}");
        total += n;
        assert!(reader.wait_success());
    }
    assert!(total >= 32, "the readers attached only {total} times");
    eprintln!("32 readers: {total} attaches over {committed} generations");
}

#[test]
fn a_writer_killed_mid_fill_leaves_the_current_generation_and_its_partial_one_is_freed() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 1, 1 << 20);
    let baseline = service.fd_count();
    let mut writer = Role::spawn("fill-and-hang", &service, &["weights"], false);
    assert_eq!(writer.expect_line(), "BEGAN 2");
    assert!(
        service.fd_count() >= baseline + 3,
        "two memfds and a connection"
    );
    let status = client.status().unwrap();
    assert_eq!(
        status.regions[0].pending.map(|p| (p.0, p.1)),
        Some((2, 16 << 20))
    );
    assert_eq!(status.used, (1 << 20) + (16 << 20));
    writer.signal(libc::SIGKILL);
    let freed = until(Duration::from_secs(1), || {
        let s = client.status().unwrap();
        s.regions[0].pending.is_none() && s.used == 1 << 20
    });
    let freed = freed.expect("the partial generation is freed within 1 s");
    eprintln!("partial generation freed {freed:?} after SIGKILL");
    // Its two memfds are closed (and the writer's connection and pidfd).
    until(Duration::from_secs(1), || service.fd_count() == baseline)
        .unwrap_or_else(|| panic!("{} fds, {baseline} before", service.fd_count()));
    let attached = client.attach("weights").unwrap();
    assert_eq!(attached.generation, 1);
    assert!(common::holds(&attached.chunks[0], 1));
    // And the slot is free: the next writer gets generation 2.
    assert_eq!(publish(&client, "weights", 1, 4096), 2);
}

#[test]
fn one_writer_at_a_time_and_waiting_writers_go_first_come_first_served() {
    let service = ServiceProc::start(&[]);
    let a = service.connect();
    let first = a.begin("w", &[4096], BeginOptions::default()).unwrap();
    let b = service.connect();
    let err = b
        .begin(
            "w",
            &[4096],
            BeginOptions {
                wait: Duration::from_millis(100),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(
        matches!(&err, MemdError::Refused(Refusal::WriterBusy { waited_ms, .. }) if *waited_ms >= 100),
        "{err:?}"
    );
    // Eight writers queue up one after the other; each holds the slot 5 ms once it has it.
    const WAITERS: usize = 8;
    let clients: Vec<_> = (0..WAITERS).map(|_| service.connect()).collect();
    let generations = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let handle = s.spawn(move || {
                    let wait = BeginOptions {
                        wait: Duration::from_secs(10),
                        ..Default::default()
                    };
                    let w = c.begin("w", &[4096], wait).unwrap();
                    std::thread::sleep(Duration::from_millis(5));
                    w.commit().unwrap()
                });
                // The next one asks once this one is in the queue.
                let queued = until(Duration::from_secs(5), || {
                    a.status().unwrap().regions[0].waiting_writers == i as u32 + 1
                });
                queued.expect("the writer queues");
                handle
            })
            .collect();
        assert_eq!(
            a.status().unwrap().regions[0].waiting_writers,
            WAITERS as u32
        );
        assert_eq!(first.commit().unwrap(), 1);
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<u64>>()
    });
    let expected: Vec<u64> = (2..2 + WAITERS as u64).collect();
    assert_eq!(
        generations, expected,
        "writers get the slot in the order they asked"
    );
}

#[test]
fn commit_is_refused_while_the_writer_still_maps_a_chunk() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let writer = client
        .begin("w", &[4096, 4096], BeginOptions::default())
        .unwrap();
    // The second chunk stays mapped: the first is sealed, the second refuses (EBUSY).
    let kept = writer.chunk(1).clone();
    let err = writer.commit().unwrap_err();
    assert!(
        matches!(
            &err,
            MemdError::Refused(Refusal::StillMapped { generation: 1, .. })
        ),
        "{err:?}"
    );
    kept.write_at(0, b"still writable: not committed").unwrap();
    drop(kept);
    // Unmapped now: the commit goes through on the same connection.
    assert_eq!(client.commit_pending().unwrap(), 1);
    let attached = client.attach("w").unwrap();
    assert_eq!(&attached.chunks[1].as_slice()[..7], b"still w");
}

#[test]
fn retention_keeps_retired_generations_until_the_quota_needs_them() {
    // Room for three generations of 4 KiB: the current one and two retired.
    let service = ServiceProc::start(&["--retain", "2", "--quota-bytes", "12288"]);
    let client = service.connect();
    for g in 1..=3 {
        assert_eq!(publish(&client, "r", 1, 4096), g);
    }
    let held = |client: &vmm_memd::Client| -> Vec<u64> {
        client.status().unwrap().regions[0]
            .generations
            .iter()
            .map(|g| g.generation)
            .collect()
    };
    assert_eq!(
        held(&client),
        [1, 2, 3],
        "two retired generations kept without leases"
    );
    let old = client.attach_generation("r", Some(1)).unwrap();
    assert_eq!(old.generation, 1);
    assert!(common::holds(&old.chunks[0], 1));
    client.detach(&old).unwrap();
    // Generation 4 needs room: the oldest retired one (1) is freed for it, and 2 and 3
    // stay retained.
    assert_eq!(publish(&client, "r", 1, 4096), 4);
    assert_eq!(held(&client), [2, 3, 4]);
    let err = client.attach_generation("r", Some(1)).unwrap_err();
    assert!(
        matches!(
            err,
            MemdError::Refused(Refusal::NoSuchGeneration { generation: 1, .. })
        ),
        "{err:?}"
    );
    // Leases keep generations whatever the quota: with 2 leased, generation 5 takes the
    // room of 3 (retained, unleased)...
    let leased = client.attach_generation("r", Some(2)).unwrap();
    let other = service.connect();
    assert_eq!(publish(&other, "r", 1, 4096), 5);
    assert_eq!(held(&client), [2, 4, 5]);
    // ... and with 2 and 4 leased there is no room for 6.
    let leased_too = client.attach_generation("r", Some(4)).unwrap();
    let err = other
        .begin("r", &[4096], BeginOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            MemdError::Refused(Refusal::QuotaExceeded { used: 12288, .. })
        ),
        "{err:?}"
    );
    assert_eq!(held(&client), [2, 4, 5]);
    client.detach(&leased).unwrap();
    client.detach(&leased_too).unwrap();
    assert_eq!(publish(&other, "r", 1, 4096), 6);
    assert_eq!(held(&client), [4, 5, 6]);
}

/// An attach without mapping (`Client::attach_unmapped`, what a publisher that hands the
/// memory on uses): the lease counts this reader, the metadata comes as with `attach`, and each
/// chunk is an fd of its size sealed against writes (no process can write it through this).
#[test]
fn an_unmapped_attach_holds_a_lease_and_sealed_chunk_fds() {
    let service = ServiceProc::start(&[]);
    let client = service.connect();
    let generation = publish(&client, "weights", 2, 8192);
    let unmapped = client.attach_unmapped("weights", None).unwrap();
    assert_eq!((unmapped.generation, unmapped.device), (generation, None));
    assert_eq!(unmapped.meta.len(), 2);
    assert_eq!(unmapped.chunks.len(), 2);
    for (fd, size) in &unmapped.chunks {
        let seals = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GET_SEALS).unwrap();
        assert_ne!(
            seals & libc::F_SEAL_WRITE,
            0,
            "a chunk not sealed against writes"
        );
        let file = std::fs::File::from(fd.try_clone().unwrap());
        assert_eq!(file.metadata().unwrap().len(), *size);
    }
    let readers = &client.status().unwrap().regions[0].generations[0].readers;
    assert_eq!(readers.len(), 1, "the unmapped attach holds a lease");
    client.detach_lease(unmapped.lease).unwrap();
    assert!(
        client.status().unwrap().regions[0].generations[0]
            .readers
            .is_empty()
    );
}

/// A commit whose reply comes later than the client's per-message timeout still reports the
/// generation it made current, never a failure: the service is SIGSTOPped while the commit is
/// in its socket, for five times the client's timeout, then continued.
#[test]
fn a_commit_answered_after_the_clients_timeout_reports_its_generation() {
    let service = ServiceProc::start(&[]);
    let options = vmm_core::wire::endpoint::ConnectOptions {
        timeout: Some(Duration::from_millis(100)),
        ..Default::default()
    };
    let client = vmm_memd::Client::connect_with(&service.name(), &options).unwrap();
    let writer = client
        .begin("slow-commit", &[4096], BeginOptions::default())
        .unwrap();
    writer.chunk(0).write_at(0, &[7u8; 4096]).unwrap();
    service.signal(libc::SIGSTOP);
    let continued = std::thread::spawn({
        let pid = service.child.id() as i32;
        move || {
            std::thread::sleep(Duration::from_millis(500));
            // SAFETY: kill(2) on the service's pid, which the test owns and has not reaped.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
    });
    let committed = writer.commit();
    continued.join().unwrap();
    assert_eq!(committed.unwrap(), 1);
    let attached = service.connect().attach("slow-commit").unwrap();
    assert_eq!(
        (attached.generation, attached.chunks[0].as_slice()[0]),
        (1, 7)
    );
}
