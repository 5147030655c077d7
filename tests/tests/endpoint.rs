//! Named endpoints on the host path (they run everywhere, CI included): a Rust client that
//! vmm-core did not start (this test executable re-run through `std::process::Command`), a
//! client under another uid (privileges dropped with `setpriv`/`runuser`), a squatter, stale
//! and live socket files, the directory rules, timeouts, and garbage from an admitted peer.
//! Every test ends with this process's fds where they started.
//!
//! The tests count fds, so they run one at a time (`vmm_tests::turns::exclusive()`); the
//! processes they start are `role_entry`, an ignored test that does nothing unless `ROLE_VAR`
//! names a role. Both, and the raw peer's helpers, are `vmm_tests::endpoint`'s, shared with
//! `endpoint_attacks`.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::socket::{MsgFlags, UnixAddr};
use vmm_core::Error;
use vmm_core::error::{EndpointRule, PeerRefusal, ProtocolRule};
use vmm_core::peer::Session;
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::endpoint::{
    Allow, ConnectOptions, Credentials, Listener, ListenerOptions, Name,
};

use vmm_tests::endpoint::{data_packet, finish, header, raw_client, send_raw};
use vmm_tests::pattern;
use vmm_tests::turns::exclusive;

const UID_VAR: &str = "VMM_ENDPOINT_TEST_UID";
const SEED_VAR: &str = "VMM_ENDPOINT_TEST_SEED";
const NOBODY: u32 = 65534;

/// A fresh abstract name of this file's tests (`@vmm-endpoint-test-<tag>-...`).
fn unique(tag: &str) -> Name {
    vmm_tests::unique_name("endpoint-test", tag)
}

/// A fresh owner-only directory under the temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "vmm-endpoint-{tag}-{}-{:?}",
            std::process::id(),
            Instant::now()
        ));
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn is_root() -> bool {
    Credentials::of_this_process().uid == 0
}

// ---------------------------------------------------------------------------------------------
// Processes vmm-core did not start: this executable, re-run by std::process::Command.

/// The roles a re-run of this executable plays (nothing without `vmm_tests::endpoint::ROLE_VAR`).
#[test]
#[ignore = "a role for processes the other tests start"]
fn role_entry() {
    let Some((role, name)) = vmm_tests::endpoint::role_and_name() else {
        return;
    };
    let expect = Allow::none().uid(std::env::var(UID_VAR).unwrap().parse().unwrap());
    let options = ConnectOptions::default().expect(expect.clone());
    match role.as_str() {
        // Map the owner's host buffer, check its pattern, write ours, say so.
        "host-client" => {
            let seed: u8 = std::env::var(SEED_VAR).unwrap().parse().unwrap();
            let conn = Session::connect_with(&name, &options).unwrap();
            let descriptor = conn.recv_descriptor().unwrap().into_host().unwrap();
            let buf = HostBuffer::import(&descriptor).unwrap();
            drop(descriptor);
            assert_eq!(buf.to_vec(), pattern(seed, buf.size()));
            buf.write_at(0, &pattern(seed + 1, buf.size())).unwrap();
            conn.send_data(b"done").unwrap();
            println!("OK client mapped {} bytes", buf.size());
        }
        // Expect to be turned away.
        "refused-client" => match Session::connect_with(&name, &options) {
            Err(e @ Error::PeerRefused { .. }) => println!("REFUSED {e}"),
            Err(e) => println!("OTHER ERROR {e:?}"),
            Ok(_) => println!("ADMITTED"),
        },
        // Take the name first (a plain socket: it admits anyone, and sends nothing first),
        // and report anything a client sends.
        "squatter" => {
            let listening = raw_listener(&name);
            println!("READY");
            let conn = accept_raw(&listening, Duration::from_secs(20));
            println!("{}", drain(&conn, Duration::from_secs(5)));
        }
        other => panic!("unknown role {other}"),
    }
}

/// How to run a command as uid/gid 65534: `setpriv`, else `runuser`, as root only.
fn as_nobody() -> Result<Vec<String>, String> {
    if !is_root() {
        return Err("dropping to another uid needs root".into());
    }
    let works = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let setpriv = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ];
    if works(setpriv[0], &[&setpriv[1..], &["true"]].concat()) {
        return Ok(setpriv.iter().map(|s| s.to_string()).collect());
    }
    let runuser = ["runuser", "-u", "nobody", "--"];
    if works(runuser[0], &[&runuser[1..], &["true"]].concat()) {
        return Ok(runuser.iter().map(|s| s.to_string()).collect());
    }
    Err("neither setpriv nor runuser can run a command as uid 65534 here".into())
}

/// [`as_nobody`], or one `SKIP <test>: <reason>` line on stderr. Not `testing::skip_unless`:
/// that one turns a skip into a failure under `VMM_REQUIRE_GPU=1`, and this requirement is
/// root, not a GPU.
fn as_nobody_or_skip(test: &str) -> Option<Vec<String>> {
    match as_nobody() {
        Ok(wrapper) => Some(wrapper),
        Err(reason) => {
            eprintln!("SKIP {test}: {reason}");
            None
        }
    }
}

/// This executable, where uid 65534 can run it: as it is when every directory above it lets
/// others search and it lets others read and run it, else a copy in a temporary directory.
fn exe_for_nobody(tmp: &TempDir) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let reachable = exe
        .ancestors()
        .skip(1)
        .all(|dir| std::fs::metadata(dir).is_ok_and(|m| m.mode() & 0o001 != 0))
        && std::fs::metadata(&exe).is_ok_and(|m| m.mode() & 0o005 == 0o005);
    if reachable {
        return exe;
    }
    std::fs::set_permissions(&tmp.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = tmp.0.join("test-exe");
    vmm_tests::copy_executable(&exe, &copy);
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    copy
}

/// A command that re-runs `exe` as `role`, optionally through `wrapper`, for a client that
/// expects a listener of `uid`.
fn role_command(role: &str, name: &Name, uid: u32, wrapper: &[String], exe: &Path) -> Command {
    let mut command = vmm_tests::endpoint::role_command(exe, wrapper, role, name);
    command.env(UID_VAR, uid.to_string());
    command
}

/// Serve `buf` to one client on `listener`; return once it said "done".
fn serve_host_buffer(listener: &Listener, buf: &HostBuffer) -> Credentials {
    let conn = Session::accept(listener, Some(Duration::from_secs(30))).unwrap();
    let descriptor = buf.export().unwrap();
    conn.send_descriptor(&descriptor).unwrap();
    drop(descriptor);
    assert_eq!(conn.recv_data().unwrap(), b"done");
    conn.peer()
}

#[test]
fn a_rust_client_started_by_command_maps_the_owners_buffer() {
    let _serial = exclusive();
    let tmp = TempDir::new("command");
    let me = Credentials::of_this_process();
    let exe = std::env::current_exe().unwrap();
    for name in [unique("command"), Name::path(tmp.0.join("owner.sock"))] {
        let before = settled_open_fds().unwrap();
        let listener = Listener::bind(&name).unwrap();
        let buf = HostBuffer::new(1 << 20).unwrap();
        buf.write_at(0, &pattern(10, buf.size())).unwrap();
        let child = role_command("host-client", &name, me.uid, &[], &exe)
            .env(SEED_VAR, "10")
            .spawn()
            .unwrap();
        let child_pid = child.id() as i32;
        let peer = serve_host_buffer(&listener, &buf);
        // The kernel's word for who connected: the process we started.
        assert_eq!((peer.pid, peer.uid), (child_pid, me.uid));
        let (output, out) = finish(child, None, Duration::from_secs(30));
        assert!(output.status.success(), "{out}");
        assert!(out.contains("OK client mapped 1048576 bytes"));
        assert_eq!(buf.to_vec(), pattern(11, buf.size()), "the client's writes");
        drop((listener, buf));
        assert_eq!(settled_open_fds().unwrap(), before, "fds after {name}");
    }
    assert!(
        !tmp.0.join("owner.sock").exists(),
        "the socket file is unlinked on drop"
    );
}

#[test]
fn a_client_under_another_uid_is_refused_and_nothing_leaks() {
    let _serial = exclusive();
    let Some(wrapper) =
        as_nobody_or_skip("a_client_under_another_uid_is_refused_and_nothing_leaks")
    else {
        return;
    };
    let tmp = TempDir::new("other-uid");
    let exe = exe_for_nobody(&tmp);
    // An abstract name: a path socket's 0700 directory would stop uid 65534 before the
    // credential check could (see `a_path_endpoint_lives_in_an_owner_only_directory`).
    let name = unique("other-uid");
    let listener =
        Listener::bind_with(&name, ListenerOptions::default().log_refusals(false)).unwrap();
    let before = settled_open_fds().unwrap();
    // The client trusts a root listener: only the listener's check can turn it away.
    let child = role_command("refused-client", &name, 0, &wrapper, &exe)
        .spawn()
        .unwrap();
    let accepted = Session::accept(&listener, Some(Duration::from_secs(3)));
    assert!(
        matches!(accepted, Err(Error::Timeout { .. })),
        "a refused peer is no connection: {accepted:?}"
    );
    let (output, out) = finish(child, None, Duration::from_secs(30));
    assert!(output.status.success(), "{out}");
    assert!(
        out.contains("REFUSED endpoint @vmm-endpoint-test-other-uid")
            && out.contains("refused this process: uid 65534 (gid 65534) is not allowed"),
        "{out}"
    );
    let refused = listener.refused();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!((refused[0].uid, refused[0].gid), (NOBODY, NOBODY));
    assert_eq!(settled_open_fds().unwrap(), before, "fds after the refusal");
    // The listener still serves its own uid.
    let me = Credentials::of_this_process();
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name).map(|c| c.peer())
    });
    let conn = Session::accept(&listener, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(conn.peer().uid, me.uid);
    assert_eq!(client.join().unwrap().unwrap().uid, me.uid);
}

#[test]
fn a_squatter_under_another_uid_gets_nothing() {
    let _serial = exclusive();
    let Some(wrapper) = as_nobody_or_skip("a_squatter_under_another_uid_gets_nothing") else {
        return;
    };
    let tmp = TempDir::new("squatter");
    let exe = exe_for_nobody(&tmp);
    let name = unique("squat");
    let before = settled_open_fds().unwrap();
    // The squatter admits us (uid 0): if we sent anything, it would see it.
    let mut child = role_command("squatter", &name, 0, &wrapper, &exe)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "READY" {
        line.clear();
        assert_ne!(
            stdout.read_line(&mut line).unwrap(),
            0,
            "the squatter never got ready"
        );
    }
    // The name is taken, so our own listener cannot have it ...
    let err = Listener::bind(&name).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EADDRINUSE), "{err}");
    // ... and a client expecting our uid refuses the squatter before sending anything.
    let buf = HostBuffer::new(4096).unwrap();
    let err = Session::connect(&name).unwrap_err();
    let Error::PeerRefused {
        endpoint,
        reason: PeerRefusal::UnexpectedListener { listener, .. },
    } = &err
    else {
        panic!("wanted PeerRefused(UnexpectedListener), got {err:?}")
    };
    assert_eq!(endpoint, &name.to_string());
    assert_eq!(listener.uid, NOBODY, "{err}");
    drop(buf);
    let (_, out) = finish(child, Some(stdout), Duration::from_secs(30));
    assert!(out.contains("NOTHING: the client hung up"), "{out}");
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn a_listener_that_is_not_expected_gets_nothing() {
    // The squatter test without privileges: a plain listener of our own uid, a client that
    // expects another uid. The listener sees the connection, and then only its hang-up.
    let _serial = exclusive();
    let name = unique("unexpected");
    let listening = raw_listener(&name);
    let before = settled_open_fds().unwrap();
    let me = Credentials::of_this_process();
    let other = Allow::none().uid(me.uid.wrapping_add(1));
    let err = Session::connect_with(&name, &ConnectOptions::default().expect(other)).unwrap_err();
    assert!(
        matches!(&err, Error::PeerRefused {
                reason: PeerRefusal::UnexpectedListener { listener, .. }, ..
            } if *listener == me),
        "{err:?}"
    );
    let conn = accept_raw(&listening, Duration::from_secs(5));
    assert_eq!(
        drain(&conn, Duration::from_secs(5)),
        "NOTHING: the client hung up"
    );
    drop(conn);
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn a_listener_refuses_its_own_uid_when_not_allowed() {
    let _serial = exclusive();
    let name = unique("not-allowed");
    let listener = Listener::bind_with(
        &name,
        ListenerOptions::default()
            .allow(Allow::none().gid(u32::MAX - 7))
            .log_refusals(false),
    )
    .unwrap();
    let before = settled_open_fds().unwrap();
    let me = Credentials::of_this_process();
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name)
    });
    let accepted = Session::accept(&listener, Some(Duration::from_millis(500)));
    assert!(
        matches!(accepted, Err(Error::Timeout { .. })),
        "{accepted:?}"
    );
    let err = client.join().unwrap().unwrap_err();
    assert!(
        matches!(&err, Error::PeerRefused {
                reason: PeerRefusal::RefusedByListener { listener, said }, ..
            } if *listener == me && said.starts_with(&format!("uid {} (gid {})", me.uid, me.gid))),
        "{err:?}"
    );
    assert_eq!(listener.refused(), vec![me]);
    assert_eq!(settled_open_fds().unwrap(), before);
}

// ---------------------------------------------------------------------------------------------
// Path sockets.

#[test]
fn a_path_endpoint_lives_in_an_owner_only_directory() {
    let _serial = exclusive();
    let tmp = TempDir::new("dirs");
    let before = settled_open_fds().unwrap();
    let refused = |dir: &Path| match Listener::bind(&Name::path(dir.join("sock"))) {
        Err(Error::InvalidEndpoint { rule, message }) => (rule, message),
        other => panic!(
            "wanted InvalidEndpoint for {}, got {other:?}",
            dir.display()
        ),
    };
    let open = tmp.0.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (rule, m) = refused(&open);
    assert_eq!(rule, EndpointRule::DirectoryMode { mode: 0o755 }, "{m}");
    // The text as people read it.
    assert!(
        m.contains("has mode 0755: group or others may enter or list it"),
        "{m}"
    );
    let sticky = tmp.0.join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    assert_eq!(
        refused(&sticky).0,
        EndpointRule::DirectoryMode { mode: 0o1777 }
    );
    let link = tmp.0.join("link");
    std::os::unix::fs::symlink(&tmp.0, &link).unwrap();
    assert_eq!(refused(&link).0, EndpointRule::DirectorySymlink);
    if is_root() {
        let theirs = tmp.0.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
        let (rule, m) = refused(&theirs);
        assert_eq!(
            rule,
            EndpointRule::DirectoryOwner {
                owner: NOBODY,
                uid: 0
            },
            "{m}"
        );
        assert!(!theirs.join("sock").exists());
    }
    // A missing last directory is created owner-only; the socket file is 0600.
    let made = tmp.0.join("made");
    let path = made.join("sock");
    let listener = Listener::bind(&Name::path(&path)).unwrap();
    assert_eq!(std::fs::metadata(&made).unwrap().mode() & 0o7777, 0o700);
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o600);
    drop(listener);
    assert!(!path.exists(), "unlinked on drop");
    // A file that is not a socket is never replaced.
    let plain = tmp.0.join("plain");
    std::fs::write(&plain, b"keep me").unwrap();
    assert!(
        matches!(
            Listener::bind(&Name::path(&plain)),
            Err(Error::InvalidEndpoint {
                rule: EndpointRule::NotASocket,
                ..
            })
        ),
        "a plain file is not replaced"
    );
    assert_eq!(std::fs::read(&plain).unwrap(), b"keep me");
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn a_stale_socket_file_is_replaced_and_a_live_one_never_is() {
    let _serial = exclusive();
    let tmp = TempDir::new("stale");
    let path = tmp.0.join("sock");
    let name = Name::path(&path);
    let before = settled_open_fds().unwrap();
    // A dead listener's file: bound, then closed without unlinking.
    let dead = std::os::unix::net::UnixListener::bind(&path).unwrap();
    drop(dead);
    let stale_mode = std::fs::symlink_metadata(&path).unwrap().mode() & 0o7777;
    let err = Session::connect(&name).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ECONNREFUSED), "{err}");
    let live = Listener::bind(&name).unwrap();
    // Replaced: the new file is 0600 (the dead one was made with the umask's mode), and it
    // answers (below). Its inode may be the old one's: filesystems reuse them.
    let live_meta = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(live_meta.mode() & 0o7777, 0o600);
    assert_ne!(stale_mode, 0o600);
    let live_ino = live_meta.ino();
    // A live listener's name is not taken, and its file stays.
    let err = Listener::bind(&name).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EADDRINUSE), "{err}");
    assert_eq!(std::fs::symlink_metadata(&path).unwrap().ino(), live_ino);
    // It still serves (the probe's connection was skipped by accept).
    let client = std::thread::spawn({
        let name = name.clone();
        move || Session::connect(&name).map(|c| c.peer().pid)
    });
    let conn = Session::accept(&live, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(client.join().unwrap().unwrap(), std::process::id() as i32);
    drop(conn);
    // Someone replaced the file meanwhile: dropping the first listener leaves the new file.
    std::fs::remove_file(&path).unwrap();
    let successor = Listener::bind(&name).unwrap();
    drop(live);
    assert!(path.exists(), "a successor's socket file is not unlinked");
    drop(successor);
    assert!(!path.exists());
    assert_eq!(settled_open_fds().unwrap(), before);
    // Nothing at all there.
    let err = Session::connect(&name).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Timeouts.

#[test]
fn accept_and_connect_time_out() {
    let _serial = exclusive();
    let name = unique("timeouts");
    let listener = Listener::bind(&name).unwrap();
    let started = Instant::now();
    let err = Session::accept(&listener, Some(Duration::from_millis(150))).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!((Duration::from_millis(150)..Duration::from_secs(3)).contains(&started.elapsed()));
    // Nobody calls accept: the client is never admitted, and says so in time.
    let started = Instant::now();
    let err = Session::connect_with(
        &name,
        &ConnectOptions::default().timeout(Some(Duration::from_millis(200))),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Timeout { what, .. } if what.contains("waiting to be admitted")),
        "{err:?}"
    );
    assert!((Duration::from_millis(200)..Duration::from_secs(3)).contains(&started.elapsed()));
}

/// A plain listening socket on `name` (no credential checks, no handshake: what a squatter
/// needs).
fn raw_listener(name: &Name) -> OwnedFd {
    let fd = vmm_tests::endpoint::seqpacket_socket();
    let Name::Abstract(bytes) = name else {
        panic!("abstract names only")
    };
    nix::sys::socket::bind(fd.as_raw_fd(), &UnixAddr::new_abstract(bytes).unwrap()).unwrap();
    nix::sys::socket::listen(&fd, nix::sys::socket::Backlog::new(8).unwrap()).unwrap();
    fd
}

fn accept_raw(listening: &OwnedFd, within: Duration) -> OwnedFd {
    let mut pfd = [nix::poll::PollFd::new(
        std::os::fd::AsFd::as_fd(listening),
        nix::poll::PollFlags::POLLIN,
    )];
    let ms = u16::try_from(within.as_millis()).unwrap_or(u16::MAX);
    assert_eq!(
        nix::poll::poll(&mut pfd, ms).unwrap(),
        1,
        "no connection came"
    );
    let raw = nix::sys::socket::accept(listening.as_raw_fd()).unwrap();
    // SAFETY: accept returned a new fd that nothing else owns.
    unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) }
}

/// What a peer sends until it hangs up (or `within` passes): `NOTHING` or the bytes and fds.
fn drain(conn: &OwnedFd, within: Duration) -> String {
    let deadline = Instant::now() + within;
    let (mut bytes, mut fds) = (0, 0);
    loop {
        let mut pfd = [nix::poll::PollFd::new(
            std::os::fd::AsFd::as_fd(conn),
            nix::poll::PollFlags::POLLIN,
        )];
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        if nix::poll::poll(&mut pfd, ms).unwrap() == 0 {
            return format!("TIMED OUT after {bytes} bytes {fds} fds");
        }
        let mut buf = [0u8; 70_000];
        let mut space = nix::cmsg_space!([RawFd; 253]);
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .unwrap();
        for cmsg in msg.cmsgs().unwrap() {
            if let nix::sys::socket::ControlMessageOwned::ScmRights(received) = cmsg {
                fds += received.len();
                for fd in received {
                    // SAFETY: a received fd is new in this process and ours alone.
                    drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
                }
            }
        }
        if msg.bytes == 0 && fds == 0 {
            return if bytes == 0 {
                "NOTHING: the client hung up".to_owned()
            } else {
                format!("RECEIVED {bytes} bytes {fds} fds")
            };
        }
        bytes += msg.bytes;
        if fds > 0 {
            return format!("RECEIVED {bytes} bytes {fds} fds");
        }
    }
}

#[test]
fn a_silent_client_delays_no_one() {
    let _serial = exclusive();
    let name = unique("silent");
    let listener = Listener::bind_with(
        &name,
        ListenerOptions::default().timeout(Some(Duration::from_millis(300))),
    )
    .unwrap();
    let before = settled_open_fds().unwrap();
    let silent = raw_client(&name);
    let talker = std::thread::spawn({
        let name = name.clone();
        move || {
            let conn = Session::connect(&name).unwrap();
            conn.recv_data().unwrap()
        }
    });
    let started = Instant::now();
    // The backlog is first come, first served: the silent client's connection comes first.
    let quiet = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    let talking = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    // Accepting the silent one read nothing from it, so the talker is admitted at once, and
    // served while the silent one still says nothing.
    assert!(started.elapsed() < Duration::from_millis(300));
    talking.send_data(b"served").unwrap();
    assert_eq!(talker.join().unwrap(), b"served");
    let started = Instant::now();
    let err = quiet.recv_data().unwrap_err();
    assert!(
        matches!(&err, Error::Timeout { what, .. } if what.contains("it sent nothing")),
        "{err:?}"
    );
    assert!((Duration::from_millis(300)..Duration::from_secs(3)).contains(&started.elapsed()));
    drop((quiet, talking, silent));
    assert_eq!(settled_open_fds().unwrap(), before);
}

// ---------------------------------------------------------------------------------------------
// Garbage from an admitted peer.

#[test]
fn garbage_and_partial_headers_give_clean_errors() {
    let _serial = exclusive();
    let name = unique("garbage");
    let listener = Listener::bind(&name).unwrap();
    let memfd = || -> OwnedFd {
        nix::sys::memfd::memfd_create(c"garbage", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap()
    };
    let warm = raw_client(&name);
    let conn = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    drop((conn, warm));
    let before = settled_open_fds().unwrap();
    let client = raw_client(&name);
    let conn = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    let frame = |bytes: &[u8]| [&[0u8][..], bytes].concat();
    let mut cuda = header(4, 1, 2, 0, 4096);
    cuda.extend_from_slice(&4096u64.to_le_bytes());
    cuda.extend_from_slice(&4096u64.to_le_bytes());
    let cases: Vec<(Vec<u8>, usize, &str, ProtocolRule)> = vec![
        (
            frame(b"GET / HTTP/1.1\r\n"),
            0,
            "not a vmm-ipc peer message",
            ProtocolRule::Magic,
        ),
        (
            frame(&header(4, 1, 0, 0, 0)[..40]),
            1,
            "40 bytes: shorter than the 64-byte header",
            ProtocolRule::Truncated,
        ),
        (
            frame(&[b"VMMI".as_slice(), &9u16.to_le_bytes()].concat()),
            0,
            "protocol version 9 is not supported",
            ProtocolRule::Version,
        ),
        (
            frame(&header(77, 0, 0, 0, 0)),
            0,
            "unknown message kind 77",
            ProtocolRule::UnknownKind,
        ),
        (
            frame(&header(4, 1, 1_000_000, 0, 0)),
            3,
            "1000000 chunks: at most 253",
            ProtocolRule::TooLarge,
        ),
        (
            frame(&cuda[..cuda.len() - 4]),
            2,
            "announces 2 chunk size(s)",
            ProtocolRule::Truncated,
        ),
        (
            frame(&cuda),
            1,
            "2 chunk(s) arrived with 1 fd(s)",
            ProtocolRule::Fds,
        ),
        (frame(&cuda), 3, "arrived with 3 fd(s)", ProtocolRule::Fds),
        (
            frame(&header(4, 8, 0, 0, 0)),
            0,
            "handle type 8 is not carried",
            ProtocolRule::Descriptor,
        ),
        (
            frame(&header(5, 0, 0, 0, 4096)),
            0,
            "size 4096 with no fd",
            ProtocolRule::Counts,
        ),
        (
            frame(&header(3, 0, 0, 100_000, 0)),
            0,
            "100000 payload bytes",
            ProtocolRule::TooLarge,
        ),
        (
            frame(&header(1, 0, 0, 0, 0)),
            0,
            "HELLO belongs to the handshake",
            ProtocolRule::UnexpectedKind,
        ),
        (
            vec![7, 1, 2, 3],
            1,
            "unknown message tag 7",
            ProtocolRule::FrameByte,
        ),
        (vec![], 0, "empty packet", ProtocolRule::FrameByte),
    ];
    for (bytes, nfds, words, rule) in &cases {
        let fds: Vec<OwnedFd> = (0..*nfds).map(|_| memfd()).collect();
        let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        send_raw(&client, bytes, &raw);
        drop(fds);
        match conn.recv_message() {
            Err(Error::Protocol { rule: got, message }) => {
                assert_eq!(got, *rule, "{message}");
                assert!(message.contains(words), "{words:?} not in {message}");
            }
            other => panic!("{words:?}: wanted Error::Protocol, got {other:?}"),
        }
    }
    // The connection still works after all of it.
    send_raw(&client, &data_packet(b"ok"), &[]);
    assert_eq!(conn.recv_data().unwrap(), b"ok");
    drop(client);
    assert!(matches!(conn.recv_message(), Err(Error::Disconnected(_))));
    drop(conn);
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "every received fd closed"
    );
}
