//! Surviving its own restart (issue 26 item 4): the service SIGKILLed mid-traffic and started
//! again serves the same regions, generations, ACLs, quota charges and contents from its
//! keeper, with no writer reloading them; clients see `ServiceGone`, keep their mappings and
//! re-attach. An impostor at the keeper's name is refused, the keeper refuses a process that
//! is not the service, and a keeper's death is survived.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::{
    NOBODY, Role, ServiceProc, fill_byte, is_root, program, publish, role_args, role_client, say,
    test_exe, until,
};
use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};
use vmm_memd::keeper_wire::{self, KeeperError, KeeperMsg};
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
        // Squat the keeper's name of service ARGS[0] and play keeper: hold nothing, answer
        // every Hand with Handed { 0 }.
        "impostor" => {
            let keeper = keeper_wire::keeper_name(&Name::from(args[0].as_str()));
            let listener = keeper_wire::listen(&keeper).unwrap();
            say("LISTENING");
            loop {
                let Ok(socket) = keeper_wire::accept(std::os::fd::AsFd::as_fd(&listener)) else {
                    continue;
                };
                while let Ok((msg, _)) = keeper_wire::recv(std::os::fd::AsFd::as_fd(&socket)) {
                    if msg == KeeperMsg::Hand {
                        let done = KeeperMsg::Handed { entries: 0 };
                        let fd = std::os::fd::AsFd::as_fd(&socket);
                        let _ = keeper_wire::send(fd, &done, &[]);
                    }
                }
            }
        }
        // Connect to the keeper of service ARGS[0] and ask it for everything.
        "steal" => {
            let keeper = keeper_wire::keeper_name(&Name::from(args[0].as_str()));
            let socket = keeper_wire::connect(&keeper).unwrap().expect("it listens");
            let fd = std::os::fd::AsFd::as_fd(&socket);
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

/// A copy of this test executable in a fresh directory of its own: the same program in another
/// file, so "another executable" to the keeper's check. Removed on drop.
struct ExeCopy {
    path: PathBuf,
}

impl ExeCopy {
    fn new() -> ExeCopy {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vmm-memd-impostor-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("impostor");
        std::fs::copy(test_exe(), &path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        ExeCopy { path }
    }
}

impl Drop for ExeCopy {
    fn drop(&mut self) {
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
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
    let copy = ExeCopy::new();
    let mut thief = Role::spawn_from(&copy.path, "steal", &service, &[&service.socket], None);
    assert_eq!(thief.expect_line(), "REFUSED");
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

#[test]
fn a_graceful_stop_lets_the_keeper_go() {
    let mut service = ServiceProc::start(&[]);
    let client = service.connect();
    publish(&client, "weights", 1, 4096);
    let attached = client.attach("weights").unwrap();
    let keeper = service.keeper_pid().expect("a keeper runs");
    service.signal(libc::SIGTERM);
    let stopped = until(Duration::from_secs(2), || {
        service.child.try_wait().unwrap().is_some()
    });
    assert!(stopped.is_some(), "still running 2 s after SIGTERM");
    assert_eq!(service.child.wait().unwrap().code(), Some(0));
    let gone = until(Duration::from_secs(2), || {
        std::fs::metadata(format!("/proc/{keeper}")).is_err() || service.keeper_pid().is_none()
    });
    assert!(gone.is_some(), "the keeper lingers after a graceful stop");
    // Service and keeper gone, the reader's mapping is intact.
    assert!(common::holds(&attached.chunks[0], 1));
    service.restart();
    assert!(service.connect().list().unwrap().is_empty());
}
