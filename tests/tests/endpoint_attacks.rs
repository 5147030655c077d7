//! Attacks on named endpoints, run from outside: raw `SOCK_SEQPACKET` clients, listeners and
//! clients in another process (this executable re-run through `std::process::Command`), in a
//! user namespace that maps nobody (`unshare -U`), and hostile fds whose `close` blocks.
//!
//! - a spilled frame (vmm-core's internal framing, frame byte 1) with a sparse sealed memfd of
//!   1 GiB: refused before the memfd is read, and the listener's peak memory stays put;
//! - peers whose uid is unmapped (they read as the overflow uid): refused by default, on both
//!   sides, and by a path endpoint's directory check; admitted only when named;
//! - a refused client that spoke first still reads the `REFUSED` reason (not `ECONNRESET`);
//! - a flood of refused connections writes a bounded number of log lines;
//! - an fd whose `close` would block (a TCP socket with `SO_LINGER` and unsent data), sent in a
//!   refused message, does not hold up the receive: it is defused (an abortive close) and
//!   closed at once; a file that is not a socket is closed on a closer thread;
//! - a refused user (another uid) sending many such sockets, directly and inside Unix sockets
//!   that hold them, to a listener under `prlimit --nofile=128`: the listener's fds stay put
//!   and a client of its own uid is served while the attacker lives.
//!
//! One test at a time (`vmm_tests::turns::exclusive()`); re-runs as roles and the raw peer's
//! helpers are `vmm_tests::endpoint`'s, shared with `endpoint`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::socket::MsgFlags;
use vmm_core::Error;
use vmm_core::error::{PeerRefusal, ProtocolRule};
use vmm_core::peer::Session;
use vmm_core::wire::endpoint::{Allow, ConnectOptions, LOG_BURST, Listener, ListenerOptions, Name};

use vmm_tests::endpoint::{data_packet, finish, raw_client, send_raw};
use vmm_tests::turns::exclusive;

const ARG_VAR: &str = "VMM_ATTACK_TEST_ARG";

/// A fresh abstract name of this file's tests (`@vmm-attack-<tag>-...`).
fn unique(tag: &str) -> Name {
    vmm_tests::unique_name("attack", tag)
}

/// The kernel's overflow uid, read as the code under test reads it.
fn overflow_uid() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/overflowuid")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// This process's peak resident memory (`VmHWM`), in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Roles: what a re-run of this executable does (nothing without vmm_tests::endpoint::ROLE_VAR).

#[test]
#[ignore = "a role for processes the other tests start"]
fn role_entry() {
    let Some((role, name)) = vmm_tests::endpoint::role_and_name() else {
        return;
    };
    let arg = std::env::var(ARG_VAR).unwrap_or_default();
    match role.as_str() {
        // A daemon: admit one client, take one message, report what came and its peak memory.
        "receiver" => {
            let listener = Listener::bind(&name).unwrap();
            println!("READY");
            let conn = Session::accept(&listener, Some(Duration::from_secs(20))).unwrap();
            let before = peak_rss_kib();
            match conn.recv_message() {
                Ok(_) => println!("RESULT accepted a message"),
                Err(e) => println!("RESULT {}", one_line(&format!("{e:?}"))),
            }
            println!("PEAK {before} {}", peak_rss_kib());
        }
        // A listener (in a user namespace that maps nobody): default allow-list, or the
        // overflow uid named.
        "ns-listener" => {
            let allow = match arg.as_str() {
                "named" => Allow::same_user().uid(overflow_uid()),
                _ => Allow::same_user(),
            };
            let listener = Listener::bind_with(
                &name,
                ListenerOptions::default().allow(allow).log_refusals(false),
            )
            .unwrap();
            println!(
                "READY euid {}",
                vmm_core::wire::endpoint::Credentials::of_this_process().uid
            );
            match Session::accept(&listener, Some(Duration::from_secs(3))) {
                Ok(conn) => {
                    println!("ADMITTED uid {}", conn.peer().uid);
                    let _ = conn.send_data(b"welcome");
                }
                Err(Error::Timeout { .. }) => println!("NO CONNECTION admitted"),
                Err(e) => println!("ERROR {e}"),
            }
        }
        // A client (in a user namespace that maps nobody): default expectation, or the
        // overflow uid named.
        "ns-client" => {
            let expect = match arg.as_str() {
                "named" => Allow::same_user().uid(overflow_uid()),
                _ => Allow::same_user(),
            };
            match Session::connect_with(&name, &ConnectOptions::default().expect(expect)) {
                Ok(conn) => println!("ADMITTED by uid {}", conn.peer().uid),
                Err(e @ Error::PeerRefused { .. }) => {
                    println!("REFUSED {}", one_line(&e.to_string()))
                }
                Err(e) => println!("ERROR {e:?}"),
            }
        }
        // A path listener (in a user namespace that maps nobody) in a directory it made.
        "ns-path" => {
            let dir = std::path::PathBuf::from(&arg);
            match Listener::bind(&Name::path(dir.join("s.sock"))) {
                Ok(_) => println!("BOUND"),
                Err(e) => println!("REFUSED {}", one_line(&e.to_string())),
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        // A listener that admits nobody, until its stdin closes.
        "flood-listener" => {
            let listener =
                Listener::bind_with(&name, ListenerOptions::default().allow(Allow::none()))
                    .unwrap();
            let stop = stop_on_stdin_eof();
            println!("READY");
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = Session::accept(&listener, Some(Duration::from_millis(100)));
            }
            println!("REFUSED {}", listener.refused().len());
        }
        // A listener that admits its own uid (root in CI) and refuses the rest, and tells each
        // admitted client `served`; it waits out the fd limit as a server does. It starts
        // accepting once a line comes on its stdin (so that what the attacker sends is queued
        // before it is refused, as it is for a busy listener), and stops when stdin closes.
        "jam-listener" => {
            let listener =
                Listener::bind_with(&name, ListenerOptions::default().log_refusals(false)).unwrap();
            println!("READY");
            std::io::stdin().read_line(&mut String::new()).unwrap();
            let stop = stop_on_stdin_eof();
            let mut short = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match Session::accept(&listener, Some(Duration::from_millis(100))) {
                    Ok(conn) => {
                        let _ = conn.send_data(b"served");
                    }
                    Err(Error::Timeout { .. }) => {}
                    Err(Error::FdLimit { .. }) => {
                        short += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => println!("ERROR {e}"),
                }
            }
            println!("REFUSED {} SHORT {short}", listener.refused().len());
        }
        // A refused user (run under another uid): `arg` connections, each sending 4 TCP
        // sockets that linger for ten minutes with unsent data (directly, or inside a Unix
        // socket that holds them, every other connection), closing its own copies at once;
        // it keeps the never-reading ends open until its stdin closes.
        "jam-attacker" => {
            let connections: usize = arg.parse().unwrap();
            let mut keep = Vec::new();
            let mut sent = 0;
            for i in 0..connections {
                let client = raw_client(&name);
                let mut hostile = Vec::new();
                for _ in 0..4 {
                    let (socket, never_reads, server) = lingering_socket(Duration::from_secs(600));
                    hostile.push(socket);
                    keep.push((never_reads, server));
                }
                let raw: Vec<_> = hostile.iter().map(|fd| fd.as_raw_fd()).collect();
                let carried = if i % 2 == 0 {
                    try_send(&client, &data_packet(b"get weights"), &raw)
                } else {
                    // A Unix socket whose queue holds them: its last close drops them.
                    let (holder, inner) = nix::sys::socket::socketpair(
                        nix::sys::socket::AddressFamily::Unix,
                        nix::sys::socket::SockType::SeqPacket,
                        None,
                        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                    )
                    .unwrap();
                    assert!(try_send(&holder, b"x", &raw));
                    try_send(&client, &data_packet(b"get weights"), &[inner.as_raw_fd()])
                };
                if carried {
                    sent += 4;
                } else {
                    // Refused before it spoke: our copies are the last, so no linger.
                    for fd in &hostile {
                        let abort = libc::linger {
                            l_onoff: 1,
                            l_linger: 0,
                        };
                        nix::sys::socket::setsockopt(fd, nix::sys::socket::sockopt::Linger, &abort)
                            .unwrap();
                    }
                }
                // Every copy of ours closes here: the listener holds the last references.
            }
            println!("SENT {sent}");
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            drop(keep);
        }
        other => panic!("unknown role {other}"),
    }
}

/// A flag set once this process's stdin reaches its end (the test closed it).
fn stop_on_stdin_eof() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::thread::spawn({
        let stop = stop.clone();
        move || {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    stop
}

/// Send one packet with `fds`; whether it went (a refused peer's socket may be shut already).
fn try_send(fd: &OwnedFd, bytes: &[u8], fds: &[std::os::fd::RawFd]) -> bool {
    let iov = [std::io::IoSlice::new(bytes)];
    let cmsgs = [nix::sys::socket::ControlMessage::ScmRights(fds)];
    nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
        fd.as_raw_fd(),
        &iov,
        &cmsgs,
        MsgFlags::empty(),
        None,
    )
    .is_ok()
}

fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

/// A command that re-runs this executable as `role` with `arg`, optionally through `wrapper`.
fn role(role: &str, name: &Name, arg: &str, wrapper: &[&str]) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut command = vmm_tests::endpoint::role_command(&exe, wrapper, role, name);
    command.env(ARG_VAR, arg);
    command
}

/// Wait for a line starting with `READY` on the child's stdout; returns that line and the
/// reader for the rest.
fn ready(child: &mut Child) -> (String, BufReader<std::process::ChildStdout>) {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the role exited before READY"
        );
        if line.starts_with("READY") {
            return (line.trim().to_owned(), out);
        }
    }
}

/// One packet, read with a deadline: its bytes, or the errno.
fn recv_raw(fd: &OwnedFd, within: Duration) -> Result<Vec<u8>, nix::errno::Errno> {
    let mut pfd = [nix::poll::PollFd::new(
        fd.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    let ms = u16::try_from(within.as_millis()).unwrap_or(u16::MAX);
    assert_eq!(nix::poll::poll(&mut pfd, ms).unwrap(), 1, "nothing came");
    let mut buf = vec![0u8; 70_000];
    let n = nix::sys::socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
    buf.truncate(n);
    Ok(buf)
}

/// vmm-core's internal spilled frame: frame byte 1, then the payload's size.
fn spilled_header(size: u64) -> Vec<u8> {
    let mut h = vec![1u8];
    h.extend_from_slice(&size.to_le_bytes());
    h
}

/// A sparse memfd of `size` bytes, sealed as vmm-core's spilled payloads are: it costs
/// nothing to make, and `size` bytes to read.
fn sparse_sealed_memfd(size: u64) -> OwnedFd {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create(
        c"hostile",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .unwrap();
    nix::unistd::ftruncate(&fd, size as i64).unwrap();
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(
            SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK,
        ),
    )
    .unwrap();
    fd
}

// ---------------------------------------------------------------------------------------------
// Item: a 9-byte packet must not make a listener allocate 1 GiB.

#[test]
fn a_spilled_frame_from_a_peer_is_refused_before_its_memfd_is_read() {
    let _serial = exclusive();
    let name = unique("spill");
    let mut child = role("receiver", &name, "", &[]).spawn().unwrap();
    let (_, rest) = ready(&mut child);
    let client = raw_client(&name);
    let memfd = sparse_sealed_memfd(1 << 30);
    send_raw(&client, &spilled_header(1 << 30), &[memfd.as_raw_fd()]);
    drop(memfd);
    let (output, text) = finish(child, Some(rest), Duration::from_secs(60));
    assert!(output.status.success(), "{text}");
    let result = text.lines().find(|l| l.starts_with("RESULT")).unwrap();
    assert!(
        result.contains("Protocol { rule: FrameByte") && result.contains("frame byte 1"),
        "{text}"
    );
    let peak: Vec<u64> = text
        .lines()
        .find_map(|l| l.strip_prefix("PEAK "))
        .unwrap()
        .split(' ')
        .map(|v| v.parse().unwrap())
        .collect();
    // A read of the memfd would have taken 1 GiB; refusing it takes nothing.
    assert!(
        peak[1] < peak[0] + 64 * 1024,
        "peak memory went from {} KiB to {} KiB: {text}",
        peak[0],
        peak[1]
    );
}

#[test]
fn a_packet_longer_than_any_peer_message_is_refused_and_the_connection_lives() {
    let _serial = exclusive();
    let name = unique("long");
    let listener = Listener::bind(&name).unwrap();
    let client = raw_client(&name);
    let conn = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    // 60 000 bytes: within vmm-core's inline framing, far beyond docs/protocol.md's largest.
    send_raw(&client, &[vec![0u8], vec![7u8; 60_000]].concat(), &[]);
    match conn.recv_message() {
        Err(Error::Protocol {
            rule: ProtocolRule::TooLarge,
            message,
        }) => assert!(message.contains("packet larger than"), "{message}"),
        other => panic!("wanted Error::Protocol, got {other:?}"),
    }
    // A value is a DATA message on an endpoint.
    send_raw(&client, &data_packet(&postcard_u32(7)), &[]);
    assert_eq!(conn.recv_value::<u32>().unwrap(), 7);
}

fn postcard_u32(v: u32) -> Vec<u8> {
    vmm_core::wire::encode(&v).unwrap().bytes().to_vec()
}

// ---------------------------------------------------------------------------------------------
// Item: the overflow uid (an unmapped peer) is no one's identity unless named.

/// Whether `unshare -U` can run a command here, as the overflow uid.
fn unshare_or_skip(test: &str) -> bool {
    let works = Command::new("unshare")
        .args(["-U", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        eprintln!("SKIP {test}: `unshare -U` cannot make a user namespace here");
    }
    works
}

#[test]
fn a_listener_whose_uid_is_unmapped_refuses_unmapped_peers_unless_named() {
    let _serial = exclusive();
    if !unshare_or_skip("a_listener_whose_uid_is_unmapped_refuses_unmapped_peers_unless_named") {
        return;
    }
    let overflow = overflow_uid();
    for (allow, admitted) in [("default", false), ("named", true)] {
        let name = unique("ns-listener");
        let mut child = role("ns-listener", &name, allow, &["unshare", "-U"])
            .spawn()
            .unwrap();
        let (line, rest) = ready(&mut child);
        assert_eq!(
            line,
            format!("READY euid {overflow}"),
            "the listener is unmapped"
        );
        // This process's uid has no mapping in the listener's namespace: it reads there as
        // the overflow uid, as every unmapped user does.
        let result = Session::connect(&name);
        let (_, text) = finish(child, Some(rest), Duration::from_secs(30));
        if admitted {
            let conn = result.unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(text.contains(&format!("ADMITTED uid {overflow}")), "{text}");
            assert_eq!(conn.recv_data().unwrap(), b"welcome");
        } else {
            let err = result.unwrap_err();
            assert!(
                // The listener's words name this process by the uid it reads as there.
                matches!(&err, Error::PeerRefused {
                        reason: PeerRefusal::RefusedByListener { said, .. }, ..
                    } if said.starts_with(&format!("uid {overflow}")) && said.contains("overflow uid")),
                "{err:?}"
            );
            assert!(text.contains("NO CONNECTION admitted"), "{text}");
        }
    }
}

#[test]
fn a_client_whose_uid_is_unmapped_takes_an_unmapped_listener_for_a_squatter_unless_named() {
    let _serial = exclusive();
    if !unshare_or_skip(
        "a_client_whose_uid_is_unmapped_takes_an_unmapped_listener_for_a_squatter_unless_named",
    ) {
        return;
    }
    let overflow = overflow_uid();
    for (expect, admitted) in [("default", false), ("named", true)] {
        let name = unique("ns-client");
        let listener =
            Listener::bind_with(&name, ListenerOptions::default().log_refusals(false)).unwrap();
        let child = role("ns-client", &name, expect, &["unshare", "-U"])
            .spawn()
            .unwrap();
        let accepted = Session::accept(
            &listener,
            Some(Duration::from_secs(if admitted { 20 } else { 2 })),
        );
        let (output, text) = finish(child, None, Duration::from_secs(30));
        assert!(output.status.success(), "{text}");
        if admitted {
            assert!(accepted.is_ok(), "{accepted:?}: {text}");
            assert!(
                text.contains(&format!("ADMITTED by uid {overflow}")),
                "{text}"
            );
        } else {
            // The client found the listener unmapped and went away before it was admitted
            // (the accept may still see its connection, already closed).
            assert!(
                text.contains(&format!("REFUSED endpoint {name}: its listener is pid"))
                    && text.contains("overflow uid")
                    && text.contains("nothing was sent to it"),
                "{text}"
            );
        }
    }
}

#[test]
fn a_path_listener_whose_uid_is_unmapped_cannot_trust_its_directory() {
    let _serial = exclusive();
    if !unshare_or_skip("a_path_listener_whose_uid_is_unmapped_cannot_trust_its_directory") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vmm-attack-ns-path-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let child = role(
        "ns-path",
        &unique("unused"),
        dir.to_str().unwrap(),
        &["unshare", "-U"],
    )
    .spawn()
    .unwrap();
    let (output, text) = finish(child, None, Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(output.status.success(), "{text}");
    assert!(
        text.contains("REFUSED endpoint directory") && text.contains("is the overflow uid"),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------------------
// Item: a refused client reads its refusal; refusals cannot flood the log.

#[test]
fn a_refused_client_that_spoke_first_reads_the_refusal() {
    let _serial = exclusive();
    let name = unique("spoke-first");
    let listener = Listener::bind_with(
        &name,
        ListenerOptions::default()
            .allow(Allow::none())
            .log_refusals(false),
    )
    .unwrap();
    let client = raw_client(&name);
    // It speaks before it is admitted (a message with an fd, as a hasty client might).
    let (r, w) = nix::unistd::pipe().unwrap();
    send_raw(&client, &data_packet(b"get weights"), &[w.as_raw_fd()]);
    drop(w);
    let accepted = Session::accept(&listener, Some(Duration::from_millis(500)));
    assert!(
        matches!(accepted, Err(Error::Timeout { .. })),
        "{accepted:?}"
    );
    let reply = recv_raw(&client, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("the refused client read {e} instead of REFUSED"));
    assert_eq!(&reply[1..5], b"VMMI");
    assert_eq!(u16::from_le_bytes([reply[7], reply[8]]), 2, "REFUSED");
    assert!(
        String::from_utf8_lossy(&reply).contains("is not allowed to connect"),
        "{reply:?}"
    );
    // The fd it sent was closed (on the background closer): the pipe reads end-of-file.
    let mut r = std::fs::File::from(r);
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

#[test]
fn a_flood_of_refused_connections_writes_a_bounded_log() {
    let _serial = exclusive();
    let name = unique("flood");
    let mut child = role("flood-listener", &name, "", &[])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let (_, rest) = ready(&mut child);
    const FLOOD: usize = 200;
    let started = Instant::now();
    for _ in 0..FLOOD {
        let client = raw_client(&name);
        let reply = recv_raw(&client, Duration::from_secs(10)).unwrap();
        assert_eq!(u16::from_le_bytes([reply[7], reply[8]]), 2, "REFUSED");
    }
    let elapsed = started.elapsed();
    drop(child.stdin.take());
    let (output, text) = finish(child, Some(rest), Duration::from_secs(30));
    assert!(output.status.success(), "{text}");
    assert!(text.contains(&format!("REFUSED {}", 64)), "{text}");
    let lines = text
        .lines()
        .filter(|l| l.contains("refused a connection from"))
        .count();
    let counted: usize = text
        .lines()
        .filter_map(|l| l.split_once(" more refused connection"))
        .filter_map(|(head, _)| head.rsplit(' ').next()?.parse::<usize>().ok())
        .sum();
    // Every refusal is accounted for, in a bounded number of lines: LOG_BURST per interval
    // (the flood may straddle intervals).
    let intervals = 2 + elapsed.as_secs() as usize / 10;
    assert!(
        lines <= LOG_BURST as usize * intervals,
        "{lines} lines for {FLOOD} refusals: {text}"
    );
    assert_eq!(lines + counted, FLOOD, "{text}");
}

// ---------------------------------------------------------------------------------------------
// Item: hostile fds are closed off the caller's deadline path.

/// A TCP socket whose `close` blocks for `linger`: `SO_LINGER` set, and data it cannot send
/// (its peer, `server`, never reads, and its window is full). The stand-in for a FUSE file
/// whose server never answers.
fn lingering_socket(linger: Duration) -> (OwnedFd, std::net::TcpStream, std::net::TcpListener) {
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stream = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
    let (accepted, _) = server.accept().unwrap();
    nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::SndBuf, &4096).unwrap();
    nix::sys::socket::setsockopt(&accepted, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    stream.set_nonblocking(true).unwrap();
    let chunk = [0u8; 4096];
    let mut s = &stream;
    while s.write(&chunk).is_ok() {}
    stream.set_nonblocking(false).unwrap();
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: linger.as_secs() as i32,
    };
    nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &linger).unwrap();
    (OwnedFd::from(stream), accepted, server)
}

#[test]
fn a_hostile_fd_whose_close_blocks_does_not_hold_up_a_receive() {
    let _serial = exclusive();
    let name = unique("linger");
    let listener = Listener::bind(&name).unwrap();
    let client = raw_client(&name);
    let mut conn = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    conn.set_timeout(Some(Duration::from_secs(2)));
    // Closing it as it is would block for ten minutes.
    let (hostile, mut never_reads, _server) = lingering_socket(Duration::from_secs(600));
    // A DATA message may carry no fd: refused, and the fd is the receiver's to close.
    send_raw(&client, &data_packet(b"x"), &[hostile.as_raw_fd()]);
    drop(hostile);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = conn.recv_message().map(|_| ());
        let _ = tx.send((format!("{result:?}"), conn));
    });
    // Far within the ten minutes the close would take.
    let (result, conn) = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the receive waited for the hostile fd's close");
    assert!(
        result.contains("Protocol { rule: Fds") && result.contains("arrived with 1 fd"),
        "{result}"
    );
    // It was defused and closed at once: an abortive close (a reset, the unsent data
    // dropped), not a close that waits ten minutes on some thread.
    never_reads
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut sink = vec![0u8; 1 << 20];
    let reset = loop {
        match never_reads.read(&mut sink) {
            Ok(0) => break None,
            Ok(_) => {}
            Err(e) => break Some(e.kind()),
        }
    };
    assert_eq!(reset, Some(std::io::ErrorKind::ConnectionReset));
    // A file that is not a socket goes to a closer thread, and is closed there.
    let (r, w) = nix::unistd::pipe().unwrap();
    send_raw(&client, &data_packet(b"y"), &[w.as_raw_fd()]);
    drop(w);
    assert!(matches!(
        conn.recv_message(),
        Err(Error::Protocol {
            rule: ProtocolRule::Fds,
            ..
        })
    ));
    let mut pfd = [nix::poll::PollFd::new(
        r.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    assert_eq!(
        nix::poll::poll(&mut pfd, 30_000u16).unwrap(),
        1,
        "the second refused fd was not closed"
    );
    let mut rest = Vec::new();
    std::fs::File::from(r).read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Item: a refused user cannot jam the closers (issue 23, item 6a).

/// The open fds of process `pid` (this test runs as root: it may list another's).
fn fds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn a_refused_user_sending_lingering_sockets_cannot_starve_the_listener() {
    let _serial = exclusive();
    let usable = |program: &[&str]| {
        Command::new(program[0])
            .args(&program[1..])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let setpriv = [
        "setpriv",
        "--reuid",
        "65534",
        "--regid",
        "65534",
        "--clear-groups",
    ];
    if !usable(&["prlimit", "--nofile=128:128", "true"])
        || !usable(&[&setpriv[..], &["true"]].concat())
    {
        eprintln!(
            "SKIP a_refused_user_sending_lingering_sockets_cannot_starve_the_listener: needs \
             prlimit, and setpriv as root"
        );
        return;
    }
    let name = unique("jam");
    // At most 128 fds: the attack sends 200 fds (160 sockets that linger for ten minutes
    // each, half of them inside 40 Unix sockets).
    let mut listener = role("jam-listener", &name, "", &["prlimit", "--nofile=128:128"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let (_, listener_out) = ready(&mut listener);
    let baseline = fds_of(listener.id());
    let mut attacker = role("jam-attacker", &name, "80", &setpriv)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    // Its stdout, line by line, so that a stuck attacker fails the test instead of hanging it.
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let attacker_stdout = attacker.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(attacker_stdout).lines() {
            let Ok(line) = line else { break };
            let _ = lines_tx.send(line);
        }
    });
    let sent: usize = loop {
        match lines.recv_timeout(Duration::from_secs(120)) {
            Ok(line) if line.starts_with("SENT ") => break line[5..].trim().parse().unwrap(),
            Ok(_) => {}
            Err(_) => {
                let _ = attacker.kill();
                drop(listener.stdin.take());
                let (_, text) = finish(attacker, None, Duration::from_secs(30));
                panic!("the attacker did not send: {text}");
            }
        }
    };
    assert!(
        sent > 128,
        "only {sent} lingering sockets reached the listener"
    );
    writeln!(listener.stdin.as_ref().unwrap(), "go").unwrap();
    // While the attacker lives (its sockets would linger for ten minutes), a client of the
    // listener's own uid is admitted and served.
    let served = Session::connect(&name).and_then(|conn| conn.recv_data());
    let during = fds_of(listener.id());
    drop(attacker.stdin.take());
    let (_, attacker_text) = finish(attacker, None, Duration::from_secs(30));
    reader.join().unwrap();
    drop(listener.stdin.take());
    let (output, text) = finish(listener, Some(listener_out), Duration::from_secs(30));
    assert_eq!(
        served.as_deref().ok(),
        Some(&b"served"[..]),
        "{served:?}: listener: {text} attacker: {attacker_text}"
    );
    // The refused connections' sockets were closed as they came, not kept.
    assert!(
        during <= baseline + 8,
        "the listener held {during} fds (from {baseline}): {text}"
    );
    assert!(output.status.success(), "{text}");
    // Every refusal remembered (the most recent 64), and the listener never short of fds.
    assert!(text.contains("REFUSED 64 SHORT 0"), "{text}");
}
