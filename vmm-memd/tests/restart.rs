//! Surviving its own restart (issue 26 item 4): the service SIGKILLed mid-traffic and started
//! again serves the same regions, generations, ACLs, quota charges and contents from its
//! keeper, with no writer reloading them; clients see `ServiceGone`, keep their mappings and
//! re-attach. A graceful stop and a start (`systemctl restart`), and an upgrade (another
//! binary started after the stop), keep everything too (issue 34 item 1); only
//! `vmm-memctl release --all` lets it go. An impostor at the keeper's name is refused, the
//! keeper refuses a process that is not the service (or an upgrade without the hand-over
//! key), and a keeper's death is survived.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    ExeCopy, NOBODY, Role, ServiceProc, fill_byte, is_root, program, publish, role_args,
    role_client, say, test_exe, until,
};
use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};
use vmm_memd::keeper::handover::{self, End, HandOverKey};
use vmm_memd::keeper::wire::{self as keeper_wire, KeeperError, KeeperMsg};
use vmm_memd::protocol::{Acl, Principal};
use vmm_memd::{BeginOptions, Client, MemdError, Refusal};

/// The entry of role processes (does nothing in a plain test run).
#[test]
fn role_entry() {
    let Ok(role) = std::env::var("MEMD_ROLE") else {
        return;
    };
    let args = role_args();
    match role.as_str() {
        // Attach ARGS[0] over and over, checking every byte, while holding one attachment;
        // when the service is gone, check the held mapping, reconnect, attach again.
        "reader-loop" => {
            let client = role_client();
            let held = client.attach(&args[0]).unwrap();
            say("READING");
            let mut attaches = 0u64;
            loop {
                match client.attach(&args[0]) {
                    Ok(a) => {
                        let byte = fill_byte(a.generation);
                        assert!(
                            a.chunks
                                .iter()
                                .all(|c| c.as_slice().iter().all(|&b| b == byte))
                        );
                        attaches += 1;
                        if let Err(MemdError::ServiceGone(_)) = client.detach(&a) {
                            break;
                        }
                    }
                    Err(MemdError::ServiceGone(_)) => break,
                    Err(e) => panic!("{e:?}"),
                }
            }
            let byte = fill_byte(held.generation);
            assert!(
                held.chunks
                    .iter()
                    .all(|c| c.as_slice().iter().all(|&b| b == byte))
            );
            say(&format!("GONE {attaches}"));
            let name = Name::from(std::env::var("MEMD_SOCKET").unwrap().as_str());
            let uid: u32 = std::env::var("MEMD_SERVICE_UID").unwrap().parse().unwrap();
            let options = ConnectOptions::default().expect(Allow::none().uid(uid));
            let again = Client::reconnect(&name, &options, Duration::from_secs(20)).unwrap();
            let a = again.attach(&args[0]).unwrap();
            let byte = fill_byte(a.generation);
            assert!(
                a.chunks
                    .iter()
                    .all(|c| c.as_slice().iter().all(|&b| b == byte))
            );
            say(&format!("REATTACHED {}", a.generation));
        }
        // Begin a generation of ARGS[0], fill half of it, and wait to be killed.
        "writer-mid-fill" => {
            let client = role_client();
            let writer = client
                .begin(&args[0], &[1 << 20], Default::default())
                .unwrap();
            writer.chunk(0).write_at(0, &[0xEE; 1 << 19]).unwrap();
            say(&format!("FILLING {}", writer.generation()));
            std::thread::sleep(Duration::from_secs(60));
        }
        // Attach ARGS[0]: ATTACHED generation, or the refusal.
        "attach" => match role_client().attach(&args[0]) {
            Ok(a) => say(&format!("ATTACHED {}", a.generation)),
            Err(MemdError::Refused(Refusal::NoSuchRegion { .. })) => say("NO-SUCH-REGION"),
            Err(e) => say(&format!("ERROR {e:?}")),
        },
        // Squat the keeper's name of service ARGS[0] and play keeper: answer the handshake
        // with a proof made of a key of its own (it has not the service's), hold nothing,
        // answer every Hand with Handed { 0 }.
        "impostor" => {
            let keeper = keeper_wire::keeper_name(&Name::from(args[0].as_str()));
            let listener = keeper_wire::listen(&keeper).unwrap();
            let key = HandOverKey::random().unwrap();
            say("LISTENING");
            loop {
                let Ok(socket) = keeper_wire::accept(std::os::fd::AsFd::as_fd(&listener)) else {
                    continue;
                };
                let fd = std::os::fd::AsFd::as_fd(&socket);
                while let Ok((msg, _)) = keeper_wire::recv(fd) {
                    let answer = match msg {
                        KeeperMsg::Hello { version, nonce } => {
                            let ours = handover::nonce().unwrap();
                            KeeperMsg::Welcome {
                                version,
                                nonce: ours,
                                proof: key.proof(End::Keeper, &ours, &nonce),
                            }
                        }
                        KeeperMsg::Hand => KeeperMsg::Handed { entries: 0 },
                        _ => continue,
                    };
                    let _ = keeper_wire::send(fd, &answer, &[]);
                }
            }
        }
        // Connect to the keeper of service ARGS[0], go through the handshake with a proof of
        // a key of its own (ARGS[1] "skip": send Hand at once, without a handshake), and ask
        // it for everything.
        "steal" => {
            let keeper = keeper_wire::keeper_name(&Name::from(args[0].as_str()));
            let socket = keeper_wire::connect(&keeper).unwrap().expect("it listens");
            let fd = std::os::fd::AsFd::as_fd(&socket);
            if args.get(1).map(String::as_str) != Some("skip") {
                let ours = handover::nonce().unwrap();
                let hello = KeeperMsg::Hello {
                    version: keeper_wire::KEEPER_WIRE_VERSION,
                    nonce: ours,
                };
                // Refused before the handshake (another uid): the keeper may have closed
                // already.
                if keeper_wire::send(fd, &hello, &[]).is_err() {
                    say("REFUSED");
                    return;
                }
                let nonce = match keeper_wire::recv(fd) {
                    Ok((KeeperMsg::Welcome { nonce, .. }, _)) => nonce,
                    // Refused before the handshake (another uid).
                    Err(KeeperError::Gone | KeeperError::Os { .. }) => {
                        say("REFUSED");
                        return;
                    }
                    other => panic!("the keeper answers Hello with Welcome, not {other:?}"),
                };
                let forged = HandOverKey::random().unwrap();
                let prove = KeeperMsg::Prove {
                    proof: forged.proof(End::Service, &ours, &nonce),
                };
                keeper_wire::send(fd, &prove, &[]).unwrap();
            }
            let _ = keeper_wire::send(fd, &KeeperMsg::Hand, &[]);
            match keeper_wire::recv(fd) {
                Err(KeeperError::Gone | KeeperError::Os { .. }) => say("REFUSED"),
                other => say(&format!("GOT {other:?}")),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn sigkill_and_reap(service: &mut ServiceProc) {
    service.signal(libc::SIGKILL);
    service.child.wait().unwrap();
}

#[test]
fn the_service_sigkilled_mid_traffic_and_restarted_serves_everything_again() {
    let mut service = ServiceProc::start(&["--retain", "1"]);
    let client = service.connect();
    // "weights": generation 1 (retained) and 2 (current), readable by uid 65534 too.
    let acl = Acl {
        read: vec![Principal::Uid(NOBODY)],
        ..Acl::default()
    };
    let writer = client
        .begin(
            "weights",
            &[1 << 20, 1 << 20],
            BeginOptions {
                acl,
                ..Default::default()
            },
        )
        .unwrap();
    for chunk in writer.chunks() {
        chunk.fill(fill_byte(1)).unwrap();
    }
    assert_eq!(writer.commit().unwrap(), 1);
    assert_eq!(publish(&client, "weights", 2, 1 << 20), 2);
    assert_eq!(publish(&client, "private", 1, 4096), 1);
    let before = client.status().unwrap();
    let listed = client.list().unwrap();
    let attached = client.attach("weights").unwrap();

    let mut readers: Vec<Role> = (0..4)
        .map(|_| Role::spawn("reader-loop", &service, &["weights"], false))
        .collect();
    for r in &mut readers {
        assert_eq!(r.expect_line(), "READING");
    }
    let mut writer = Role::spawn("writer-mid-fill", &service, &["weights"], false);
    assert_eq!(writer.expect_line(), "FILLING 3");
    std::thread::sleep(Duration::from_millis(100));
    let keeper = service.keeper_pid().expect("a keeper runs");

    sigkill_and_reap(&mut service);
    let err = client.status().unwrap_err();
    assert!(matches!(err, MemdError::ServiceGone(_)), "{err:?}");
    for r in &mut readers {
        let line = r.expect_line();
        assert!(line.starts_with("GONE "), "{line}");
    }
    // The mapping outlives the service.
    assert!(attached.chunks.iter().all(|c| common::holds(c, 2)));

    let restarted = Instant::now();
    service.restart();
    let client = service.connect();
    let first = client.attach("weights").unwrap();
    let attach_after = restarted.elapsed();
    assert_eq!(service.keeper_pid(), Some(keeper), "the same keeper");
    assert_eq!(first.generation, 2);
    assert!(first.chunks.iter().all(|c| common::holds(c, 2)));
    for r in readers {
        let mut r = r;
        assert_eq!(r.expect_line(), "REATTACHED 2");
        assert!(r.wait_success());
    }
    // Regions, generations (the retained one too), owners, quota charge: as before the
    // kill; the writer's partial generation 3 is not there.
    assert_eq!(client.list().unwrap(), listed);
    let mut after = client.status().unwrap();
    after.refusals = before.refusals;
    for r in &mut after.regions {
        for g in &mut r.generations {
            g.readers.clear();
        }
    }
    let mut expected = before.clone();
    for r in &mut expected.regions {
        for g in &mut r.generations {
            g.readers.clear();
        }
    }
    assert_eq!(after, expected);
    let old = client.attach_generation("weights", Some(1)).unwrap();
    assert!(old.chunks.iter().all(|c| common::holds(c, 1)));
    // ACLs: uid 65534 reads "weights" and does not see "private".
    if is_root() {
        let mut r = Role::spawn("attach", &service, &["weights"], true);
        assert_eq!(r.expect_line(), "ATTACHED 2");
        let mut r = Role::spawn("attach", &service, &["private"], true);
        assert_eq!(r.expect_line(), "NO-SUCH-REGION");
    } else {
        println!("SKIP the ACL part: needs root for setpriv");
    }
    // The next generation follows on.
    assert_eq!(publish(&client, "weights", 1, 4096), 3);
    let _ = writer.child.kill();
    let _ = writer.child.wait();
    println!("restart: first attach {attach_after:?} after the new service was started");
}

/// Start `vmm-memd` on `socket` and wait for its exit (at most 5 s); its status and stderr.
fn run_service(socket: &str) -> (Option<i32>, String) {
    let mut child = program("vmm-memd")
        .args(["--socket", socket, "--quota-bytes", "4096"])
        .arg("--state-dir")
        .arg(common::state_dir())
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let exited = until(Duration::from_secs(5), || {
        child.try_wait().unwrap().is_some()
    });
    if exited.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_impostor_at_the_keepers_name_is_refused() {
    // A process of the same uid running another executable, then one of another uid.
    for nobody in [false, true] {
        if nobody && !is_root() {
            println!("SKIP the other-uid impostor: needs root for setpriv");
            continue;
        }
        // The role harness wants a service to name; this one only lends its socket name.
        let decoy = ServiceProc::start(&["--no-keeper"]);
        let socket = format!("{}-squatted", decoy.socket);
        // The service is this test executable playing `vmm-memd`: the impostor of the same
        // uid runs a copy of it (another file), the one of another uid this one.
        let copy = (!nobody).then(ExeCopy::new);
        let (exe, groups) = match &copy {
            Some(copy) => (copy.path.clone(), None),
            None => (test_exe(), Some("--clear-groups")),
        };
        let mut impostor = Role::spawn_from(&exe, "impostor", &decoy, &[&socket], groups);
        assert_eq!(impostor.expect_line(), "LISTENING");
        let (code, stderr) = run_service(&socket);
        assert_eq!(code, Some(1), "the service refuses to run: {stderr}");
        let why = if nobody {
            "another uid"
        } else {
            "another executable"
        };
        assert!(
            stderr.contains("is not ours") && stderr.contains(why),
            "{stderr}"
        );
        let _ = impostor.child.kill();
        let _ = impostor.child.wait();
    }
}

#[test]
fn the_keeper_hands_nothing_to_a_process_that_is_not_the_service() {
    let service = ServiceProc::start(&[]);
    publish(&service.connect(), "weights", 1, 4096);
    // A process of the same uid running another executable (a copy of this test executable:
    // this one is the service's executable, as it plays `vmm-memd`).
    // With a proof of a key of its own, and with no handshake at all.
    let copy = ExeCopy::new();
    for how in ["forged", "skip"] {
        let mut thief =
            Role::spawn_from(&copy.path, "steal", &service, &[&service.socket, how], None);
        assert_eq!(thief.expect_line(), "REFUSED", "{how}");
    }
    // Nor to another uid.
    if is_root() {
        let mut thief = Role::spawn("steal", &service, &[&service.socket], true);
        assert_eq!(thief.expect_line(), "REFUSED");
    } else {
        println!("SKIP the other-uid thief: needs root for setpriv");
    }
    // The service still has its keeper: it survives a crash.
    let mut service = service;
    sigkill_and_reap(&mut service);
    service.restart();
    assert_eq!(service.connect().list().unwrap().len(), 1);
}

#[test]
fn a_keepers_death_is_survived_by_starting_another_and_telling_it_everything() {
    let mut service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 2, 1 << 20);
    let first = service.keeper_pid().expect("a keeper runs");
    // A keeper holding that generation holds three memfds: its record and two chunks.
    until(Duration::from_secs(5), || memfds(first) == 3).expect("the keeper holds it");
    // SAFETY: kill of the keeper's pid, which lives (found just now).
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    let replaced = until(Duration::from_secs(5), || {
        service.keeper_pid().is_some_and(|pid| pid != first)
    });
    let Some(replaced) = replaced else {
        let ps = Command::new("ps")
            .args(["-eo", "pid,ppid,stat,args"])
            .output()
            .unwrap();
        panic!(
            "no new keeper within 5 s (first {first}):\n{}",
            String::from_utf8_lossy(&ps.stdout)
        );
    };
    // Serving went on meanwhile; then a crash of the service finds everything in the new one.
    assert_eq!(client.list().unwrap().len(), 1);
    let new = service.keeper_pid().expect("the new keeper runs");
    until(Duration::from_secs(5), || memfds(new) == 3)
        .expect("the new keeper is sent the generation");
    sigkill_and_reap(&mut service);
    service.restart();
    let attached = service.connect().attach("weights").unwrap();
    assert_eq!(attached.generation, 1);
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));
    println!("keeper replaced {replaced:?} after its SIGKILL");
}

/// A process of the service's uid that connects to the keeper and says nothing holds the
/// keeper (one thread) up for one handshake's wait only: a service restarted meanwhile is
/// served after it and takes everything back.
#[test]
fn a_silent_connection_to_the_keeper_holds_it_up_for_one_handshake_wait_only() {
    let mut service = ServiceProc::start(&[]);
    publish(&service.connect(), "weights", 1, 4096);
    sigkill_and_reap(&mut service);
    let keeper = keeper_wire::keeper_name(&service.name());
    let silent = keeper_wire::connect(&keeper)
        .unwrap()
        .expect("the keeper listens");
    service.restart();
    let attached = service.connect().attach("weights").unwrap();
    assert!(common::holds(&attached.chunks[0], 1));
    drop(silent);
}

/// A keeper started without its hand-over key on stdin (nothing, or too few bytes) refuses to
/// run: it would otherwise prove a key no service has, or none.
#[test]
fn a_keeper_without_its_key_on_stdin_does_not_run() {
    for stdin in [&b""[..], &b"short"[..]] {
        let mut child = program("vmm-memd")
            .args([
                "--keeper",
                &format!("@vmm-memd-keyless-{}", std::process::id()),
            ])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), stdin).unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("no hand-over key"), "{stderr}");
    }
}

/// How many memfds process `pid` has open.
fn memfds(pid: i32) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("/memfd:"))
        .count()
}

/// A commit the keeper has not read yet when the service dies, and a restarted service that
/// connects before the keeper reads it: the keeper serves the dead service's connection to
/// its end before it turns to the new one, so the commit is not lost.
#[test]
fn a_commit_the_keeper_had_not_read_when_the_service_died_survives_its_restart() {
    let mut service = ServiceProc::start(&[]);
    publish(&service.connect(), "weights", 1, 4096);
    let keeper = service.keeper_pid().expect("a keeper runs");
    // SAFETY: signals to the keeper's pid, which lives (found just now).
    let signal = move |sig| assert_eq!(unsafe { libc::kill(keeper, sig) }, 0);
    signal(libc::SIGSTOP);
    // Committed while the keeper sleeps: its Keep waits in the socket.
    assert_eq!(publish(&service.connect(), "kv", 1, 4096), 1);
    sigkill_and_reap(&mut service);
    // The restarted service connects (and waits for its answer) before the keeper wakes.
    let waker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        signal(libc::SIGCONT);
    });
    service.restart();
    waker.join().unwrap();
    let client = service.connect();
    let mut regions: Vec<String> = client
        .list()
        .unwrap()
        .into_iter()
        .map(|r| r.region)
        .collect();
    regions.sort();
    assert_eq!(regions, ["kv", "weights"]);
    assert!(common::holds(&client.attach("kv").unwrap().chunks[0], 1));
}

/// A region as `status` shows it: name, owner, and its generations (number, bytes).
type RegionSeen = (String, u32, Vec<(u64, u64)>);

/// What the published regions look like, to compare before and after a stop.
fn regions_seen(client: &Client) -> Vec<RegionSeen> {
    let status = client.status().unwrap();
    let mut seen: Vec<_> = status
        .regions
        .iter()
        .map(|r| {
            let generations = r
                .generations
                .iter()
                .map(|g| (g.generation, g.bytes))
                .collect();
            (r.region.clone(), r.owner, generations)
        })
        .collect();
    seen.sort();
    seen
}

/// `systemctl restart`: SIGTERM, then the same binary again. Every region comes back with the
/// same generations, bytes, owner, ACL and quota charge, a reader's mapping outlives both,
/// and a new reader attaches the same generation with the same contents: nothing reloaded.
#[test]
fn a_graceful_stop_and_a_start_keep_every_region() {
    let mut service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 2, 1 << 20);
    let shared = BeginOptions {
        acl: Acl {
            read: vec![Principal::Uid(NOBODY)],
            ..Acl::default()
        },
        ..BeginOptions::default()
    };
    let writer = client.begin("shared", &[4096], shared).unwrap();
    writer.chunk(0).write_at(0, &[0x5A; 4096]).unwrap();
    assert_eq!(writer.commit().unwrap(), 1);
    let before = regions_seen(&client);
    let used = client.status().unwrap().used;
    let attached = client.attach("weights").unwrap();
    drop(client);
    let keeper = service.keeper_pid().expect("a keeper runs");
    service.signal(libc::SIGTERM);
    let stopped = until(Duration::from_secs(2), || {
        service.child.try_wait().unwrap().is_some()
    });
    assert!(stopped.is_some(), "still running 2 s after SIGTERM");
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    // The keeper stays, holding everything; the reader's mapping is intact.
    assert_eq!(
        service.keeper_pid(),
        Some(keeper),
        "the keeper left with the service"
    );
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));
    service.restart();
    let client = service.connect();
    assert_eq!(regions_seen(&client), before);
    assert_eq!(
        client.status().unwrap().used,
        used,
        "the quota charge came back"
    );
    let again = client.attach("weights").unwrap();
    assert_eq!(again.generation, 1);
    assert!(again.chunks.iter().all(|c| common::holds(c, 1)));
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));
    // The ACL came back: uid 65534 reads "shared" (and is refused "weights", as before).
    if is_root() {
        let mut nobody = Role::spawn("attach", &service, &["shared"], true);
        assert_eq!(nobody.expect_line(), "ATTACHED 1");
        let mut nobody = Role::spawn("attach", &service, &["weights"], true);
        assert_eq!(nobody.expect_line(), "NO-SUCH-REGION");
    } else {
        println!("SKIP the ACL after the restart: needs root for setpriv");
    }
    assert_eq!(service.keeper_pid(), Some(keeper), "one keeper throughout");
}

/// An upgrade: the service stopped, and another executable (a copy of this one: another file,
/// as an upgraded binary is) started with the same state directory. It proves the hand-over
/// key its predecessor left there and takes every region; the keeper proves it back.
#[test]
fn an_upgraded_binary_takes_every_region_with_the_hand_over_key() {
    let mut service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 2, 1 << 20);
    let before = regions_seen(&client);
    drop(client);
    service.signal(libc::SIGTERM);
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    let upgraded = ExeCopy::new();
    service.restart_from(&upgraded.path);
    let client = service.connect();
    assert_eq!(regions_seen(&client), before);
    let attached = client.attach("weights").unwrap();
    assert_eq!(attached.generation, 1);
    assert!(attached.chunks.iter().all(|c| common::holds(c, 1)));
    // The upgraded service keeps the keeper told: a commit now survives its crash too.
    assert_eq!(publish(&client, "kv", 1, 4096), 1);
    drop(client);
    sigkill_and_reap(&mut service);
    service.restart_from(&upgraded.path);
    let client = service.connect();
    let regions: Vec<String> = client
        .list()
        .unwrap()
        .into_iter()
        .map(|r| r.region)
        .collect();
    assert_eq!(regions.len(), 2, "{regions:?}");
    assert!(common::holds(&client.attach("kv").unwrap().chunks[0], 1));
}

/// An upgrade without the key (another state directory: no key left there) takes nothing:
/// the keeper, of another executable, cannot prove a key the new service has, so the service
/// refuses it and exits 1; the keeper keeps everything for a service that can.
#[test]
fn an_upgraded_binary_without_the_hand_over_key_takes_nothing() {
    let mut service = ServiceProc::start(&[]);
    publish(&service.connect(), "weights", 1, 4096);
    service.signal(libc::SIGTERM);
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    let upgraded = ExeCopy::new();
    let elsewhere = std::env::temp_dir().join(format!("vmm-memd-no-key-{}", std::process::id()));
    let mut child = Command::new(&upgraded.path)
        .env(common::PROGRAM_VAR, "vmm-memd")
        .args([
            "--socket",
            &service.socket,
            "--quota-bytes",
            "4096",
            "--state-dir",
        ])
        .arg(&elsewhere)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Without the defence it would serve on (with everything): kill it after 10 s.
    let exited = until(Duration::from_secs(10), || {
        child.try_wait().unwrap().is_some()
    });
    if exited.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&elsewhere);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the service refuses to run: {stderr}"
    );
    assert!(
        stderr.contains("is not ours") && stderr.contains("another executable"),
        "{stderr}"
    );
    // Nothing was taken: the service of the first binary finds everything.
    service.restart();
    let attached = service.connect().attach("weights").unwrap();
    assert!(common::holds(&attached.chunks[0], 1));
}

/// `vmm-memctl release --all` lets everything go, for an admin only (root by default): the
/// regions are gone, a reader's mapping stays valid, the keeper holds nothing (it exits
/// once the service leaves), and a start after a stop finds nothing.
#[test]
fn release_all_lets_everything_go_for_an_admin_only() {
    let mut service = ServiceProc::start(&["--admin-uid", &common::euid().to_string()]);
    let client = service.connect();
    publish(&client, "weights", 2, 1 << 20);
    publish(&client, "kv", 1, 4096);
    let attached = client.attach("weights").unwrap();
    if is_root() {
        // uid 65534, admitted but no admin, is refused with a typed error.
        let out = common::program_as_nobody("vmm-memctl")
            .args(["--socket", &service.socket, "--json", "release", "--all"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["refused"]["NotAdmin"]["uid"], NOBODY, "{doc}");
        assert_eq!(client.list().unwrap().len(), 2, "nothing released");
    } else {
        println!("SKIP the non-admin's release: needs root for setpriv");
    }
    // `release` alone is a usage error: nothing goes by accident.
    let out = program("vmm-memctl")
        .args(["--socket", &service.socket, "release"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(client.list().unwrap().len(), 2);
    let out = program("vmm-memctl")
        .args(["--socket", &service.socket, "--json", "release", "--all"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (doc["released"].as_u64(), doc["busy"].as_u64()),
        (Some(2), Some(0))
    );
    assert!(client.list().unwrap().is_empty());
    assert!(
        attached.chunks.iter().all(|c| common::holds(c, 1)),
        "a mapping outlives it"
    );
    let keeper = service.keeper_pid().expect("a keeper runs");
    until(Duration::from_secs(5), || memfds(keeper) == 0).expect("the keeper lets go");
    drop(client);
    service.signal(libc::SIGTERM);
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    let gone = until(Duration::from_secs(5), || service.keeper_pid().is_none());
    assert!(
        gone.is_some(),
        "a keeper holding nothing exits when its service leaves"
    );
    service.restart();
    assert!(service.connect().list().unwrap().is_empty());
}
