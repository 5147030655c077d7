//! The example daemon under users who would starve it (issue 23, items 6b, 6f, 6i), run from
//! outside: the daemon is this executable re-run as `vmm-daemon` (`daemon_role`), under
//! `prlimit` and another uid where the attack needs them, and every client is a process of its
//! own (`client_role`), under the uid the case names (`setpriv`; the tests run as root).
//!
//! - a client that asks for many descriptors and never reads its replies does not bring the
//!   daemon's uid to the kernel's limit on fds in flight: a second client of its uid and one
//!   of another uid are served, and the reader-less client, once it reads, finds a typed
//!   refusal past its cap;
//! - SIGTERM ends the daemon within 2 s while clients keep asking, and a client that imported
//!   the buffer still reads its pattern once the daemon is gone;
//! - one uid with 300 idle connections does not starve anyone: a client of another uid and one
//!   of the same uid are served promptly, and the idle connections are closed after the idle
//!   timeout.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::Error;
use vmm_core::peer::Session;
use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};
use vmm_examples::{client, pattern};

const ROLE_VAR: &str = "VMM_AVAILABILITY_ROLE";
const ARGS_VAR: &str = "VMM_AVAILABILITY_ARGS";

/// Two uids for the clients and the daemon (no account needed: `setpriv` takes numbers).
const UID_A: u32 = 4101;
const UID_B: u32 = 4102;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The arguments a role was given (separated by U+001F).
fn role_args() -> Vec<String> {
    std::env::var(ARGS_VAR)
        .unwrap_or_default()
        .split('\u{1f}')
        .map(str::to_owned)
        .collect()
}

/// The daemon (`vmm_examples::daemon::run`, what `vmm-daemon`'s `main` calls).
#[test]
#[ignore = "the daemon the other tests start"]
fn daemon_role() {
    if std::env::var(ROLE_VAR).as_deref() != Ok("daemon") {
        return;
    }
    if let Err(e) = vmm_examples::daemon::run(&role_args()) {
        panic!("vmm-daemon: {e}");
    }
}

/// A client: `MODE NAME DAEMON_UID`.
/// - `fetch`: `vmm-client NAME weights --check-seed 7`, printing its `OK` report;
/// - `chatty`: list and fetch again and again, saying `CHATTY` after the first round;
/// - `holder`: fetch, say `IMPORTED`, wait for a line on stdin (the daemon is gone by then),
///   read the imported buffer again and say `STILL OK`;
/// - `hog`: send 200 `get weights` without reading, say `SENT`, wait for a line on stdin,
///   then read the replies: `DESCRIPTORS n BUSY m`.
#[test]
#[ignore = "the clients the other tests start"]
fn client_role() {
    if std::env::var(ROLE_VAR).as_deref() != Ok("client") {
        return;
    }
    let args = role_args();
    let [mode, name, daemon_uid] = args.as_slice() else {
        panic!("client_role: {args:?}")
    };
    let name: Name = name.as_str().into();
    let expect = ConnectOptions::default().expect(Allow::none().uid(daemon_uid.parse().unwrap()));
    let wait_for_line = || {
        std::io::stdin().read_line(&mut String::new()).unwrap();
    };
    let check = |fetched: &client::Fetched| {
        let contents = fetched.contents().unwrap();
        assert_eq!(contents, pattern(7, contents.len()), "the pattern");
    };
    match mode.as_str() {
        "fetch" => {
            let report = client::run(&[
                name.to_string(),
                "weights".into(),
                "--check-seed".into(),
                "7".into(),
                "--expect-uid".into(),
                daemon_uid.clone(),
            ])
            .unwrap_or_else(|e| panic!("vmm-client: {e}"));
            println!("{report}");
        }
        "chatty" => {
            let conn = Session::connect_with(&name, &expect).unwrap();
            let mut first = true;
            loop {
                if client::list(&conn).is_err() {
                    return;
                }
                match client::fetch(&conn, "weights") {
                    Ok(fetched) => drop(fetched),
                    Err(_) => return,
                }
                if std::mem::take(&mut first) {
                    println!("CHATTY");
                }
            }
        }
        "holder" => {
            let conn = Session::connect_with(&name, &expect).unwrap();
            let fetched = client::fetch(&conn, "weights").unwrap();
            check(&fetched);
            drop(conn);
            println!("IMPORTED");
            wait_for_line();
            check(&fetched);
            println!("STILL OK");
        }
        "hog" => {
            let conn = Session::connect_with(&name, &expect).unwrap();
            for _ in 0..200 {
                conn.send_data(b"get weights").unwrap();
            }
            println!("SENT");
            wait_for_line();
            let (mut descriptors, mut busy) = (0, 0);
            for _ in 0..200 {
                match client::reply(&conn) {
                    Ok(fetched) => {
                        check(&fetched);
                        descriptors += 1;
                    }
                    Err(Error::LimitExceeded { .. }) => busy += 1,
                    Err(e) => {
                        println!("ERROR {e}");
                        break;
                    }
                }
            }
            println!("DESCRIPTORS {descriptors} BUSY {busy}");
        }
        other => panic!("unknown client mode {other}"),
    }
}

/// Whether `program` runs here (prlimit, setpriv as root).
fn usable(program: &[&str]) -> bool {
    Command::new(program[0])
        .args(&program[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn as_uid(uid: u32) -> Vec<String> {
    let uid = uid.to_string();
    [
        "setpriv",
        "--reuid",
        &uid,
        "--regid",
        &uid,
        "--clear-groups",
    ]
    .map(String::from)
    .to_vec()
}

/// Skip (with one line) unless `prlimit` and `setpriv` work here.
fn tools_or_skip(test: &str) -> bool {
    let mut setpriv = as_uid(UID_A);
    setpriv.push("true".into());
    let setpriv: Vec<&str> = setpriv.iter().map(String::as_str).collect();
    let works = usable(&["prlimit", "--nofile=128:128", "true"]) && usable(&setpriv);
    if !works {
        eprintln!("SKIP {test}: needs prlimit, and setpriv as root");
    }
    works
}

/// This executable re-run as `role` (its ignored test of that name) with `args`, through
/// `wrapper`.
fn role(role: &str, test: &str, wrapper: &[String], args: &[String]) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut command = match wrapper.split_first() {
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    command
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(ROLE_VAR, role)
        .env(ARGS_VAR, args.join("\u{1f}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A started daemon and its log, line by line.
struct Daemon {
    child: Child,
    log: Receiver<String>,
    seen: Vec<String>,
}

impl Daemon {
    /// Start `vmm-daemon ARGS... NAME` through `wrapper`; returns once it serves.
    fn start(wrapper: &[String], args: &[&str], name: &Name) -> Daemon {
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.push(name.to_string());
        let mut child = role("daemon", "daemon_role", wrapper, &args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let (tx, log) = channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut daemon = Daemon {
            child,
            log,
            seen: Vec::new(),
        };
        daemon.wait_for("serving `weights`");
        daemon
    }

    fn wait_for(&mut self, words: &str) {
        while let Ok(line) = self.log.recv_timeout(Duration::from_secs(30)) {
            self.seen.push(line);
            if self.seen.last().unwrap().contains(words) {
                return;
            }
        }
        panic!("the daemon never said {words:?}: {:#?}", self.seen);
    }

    fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id() as i32)
    }

    /// Everything it wrote so far.
    fn log(&mut self) -> String {
        while let Ok(line) = self.log.try_recv() {
            self.seen.push(line);
        }
        self.seen.join("\n")
    }

    /// The whole log of a daemon that has exited: every line up to its stderr's end (the
    /// reader thread may still be forwarding the last ones when the exit is seen), waiting at
    /// most 5 s for it.
    fn log_to_end(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.log.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => break,
            }
        }
        self.seen.join("\n")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client process and its stdout, line by line.
struct Client {
    child: Child,
    lines: Receiver<String>,
    started: Instant,
}

impl Client {
    fn start(uid: Option<u32>, mode: &str, name: &Name, daemon_uid: u32) -> Client {
        let wrapper = uid.map(as_uid).unwrap_or_default();
        let args = [mode.to_string(), name.to_string(), daemon_uid.to_string()];
        let started = Instant::now();
        let mut child = role("client", "client_role", &wrapper, &args)
            .spawn()
            .unwrap();
        let (tx, lines) = channel();
        let stdout: ChildStdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Client {
            child,
            lines,
            started,
        }
    }

    /// The first line starting with `prefix` (within `within`), or the client's output.
    fn line(&mut self, prefix: &str, within: Duration) -> Result<String, String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(_) => {
                    let _ = self.child.kill();
                    let mut err = String::new();
                    if let Some(mut e) = self.child.stderr.take() {
                        let _ = e.read_to_string(&mut err);
                    }
                    return Err(format!("no {prefix:?} within {within:?}: {err}"));
                }
            }
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.child.stdin.as_ref().unwrap(), "{line}").unwrap();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Item 6b: descriptors in flight.

#[test]
fn a_client_that_never_reads_its_descriptors_does_not_starve_the_others() {
    let _serial = serial();
    if !tools_or_skip("a_client_that_never_reads_its_descriptors_does_not_starve_the_others") {
        return;
    }
    let name = Name::abstract_name(format!("vmm-avail-inflight-{}", std::process::id()));
    // The daemon runs as UID_A without privileges, so the kernel holds its uid to 128 fds in
    // flight (its RLIMIT_NOFILE); it admits UID_B too. Small buffers: one fd per descriptor.
    let mut wrapper = vec!["prlimit".to_string(), "--nofile=128:128".into()];
    wrapper.extend(as_uid(UID_A));
    let uid_b = UID_B.to_string();
    let mut daemon = Daemon::start(&wrapper, &["--size", "4096", "--allow-uid", &uid_b], &name);
    let mut hog = Client::start(Some(UID_A), "hog", &name, UID_A);
    hog.line("SENT", Duration::from_secs(30)).unwrap();
    // Let the daemon answer what it will of the 200 requests (a cap makes it wait 1 s each).
    std::thread::sleep(Duration::from_secs(2));
    for (uid, who) in [
        (UID_A, "a second client of its uid"),
        (UID_B, "a client of another uid"),
    ] {
        let mut client = Client::start(Some(uid), "fetch", &name, UID_A);
        let report = client.line("OK weights", Duration::from_secs(30));
        assert!(
            report.is_ok(),
            "{who}: {report:?}\ndaemon: {}",
            daemon.log()
        );
    }
    // The reader-less client, reading at last: what the daemon sent it, then typed refusals.
    hog.say("read");
    let counts = hog.line("DESCRIPTORS", Duration::from_secs(120));
    let counts = counts.unwrap_or_else(|e| panic!("{e}\ndaemon: {}", daemon.log()));
    let words: Vec<usize> = counts.split(' ').filter_map(|w| w.parse().ok()).collect();
    assert!(words[0] <= 64 && words[1] > 0, "{counts}");
    assert_eq!(words[0] + words[1], 200, "{counts}");
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "{}",
        daemon.log()
    );
}

// ---------------------------------------------------------------------------------------------
// Item 6f: SIGTERM while clients chat.

#[test]
fn sigterm_stops_the_daemon_within_two_seconds_while_clients_chat() {
    let _serial = serial();
    let name = Name::abstract_name(format!("vmm-avail-sigterm-{}", std::process::id()));
    let me = vmm_core::wire::endpoint::Credentials::of_this_process().uid;
    let mut daemon = Daemon::start(&[], &["--size", "65536"], &name);
    let mut holder = Client::start(None, "holder", &name, me);
    holder.line("IMPORTED", Duration::from_secs(30)).unwrap();
    let mut chatty: Vec<Client> = (0..3)
        .map(|_| Client::start(None, "chatty", &name, me))
        .collect();
    for client in &mut chatty {
        client.line("CHATTY", Duration::from_secs(30)).unwrap();
    }
    // Chatting for a while, then told to stop.
    std::thread::sleep(Duration::from_millis(500));
    let asked = Instant::now();
    nix::sys::signal::kill(daemon.pid(), nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = loop {
        if let Some(status) = daemon.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "the daemon is still running 10 s after SIGTERM: {}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = asked.elapsed();
    let log = daemon.log_to_end();
    assert!(status.success(), "{status:?}: {log}");
    // A bound for stopping at all, not a speed target: before, it waited for the chatty
    // clients to stop (31 s).
    assert!(
        took < Duration::from_secs(2),
        "SIGTERM took {took:?}: {log}"
    );
    assert!(log.contains("stopped after serving"), "{log}");
    // Memory a client imported is its own: still there, still the pattern.
    holder.say("check");
    holder
        .line("STILL OK", Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------------
// Item 6i: idle connections.

/// A raw connection to `name` that never reads or says anything, or `None` when the backlog is
/// full.
fn idle_connection(name: &Name) -> Option<OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .unwrap();
    let Name::Abstract(bytes) = name else {
        panic!("abstract names only")
    };
    connect(fd.as_raw_fd(), &UnixAddr::new_abstract(bytes).unwrap())
        .ok()
        .map(|()| fd)
}

/// Whether the daemon has closed this connection: what it queued (`HELLO` or `REFUSED`) read,
/// then the end of file.
fn closed_by_daemon(fd: &OwnedFd) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match nix::sys::socket::recv(
            fd.as_raw_fd(),
            &mut buf,
            nix::sys::socket::MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(nix::errno::Errno::EAGAIN) => return false,
            Err(_) => return true,
        }
    }
}

#[test]
fn one_uid_with_300_idle_connections_does_not_starve_anyone() {
    let _serial = serial();
    if !tools_or_skip("one_uid_with_300_idle_connections_does_not_starve_anyone") {
        return;
    }
    let name = Name::abstract_name(format!("vmm-avail-idle-{}", std::process::id()));
    // The daemon runs as this uid (root in CI) and admits UID_B too; idle connections are
    // closed after 3 s.
    let me = vmm_core::wire::endpoint::Credentials::of_this_process().uid;
    let uid_b = UID_B.to_string();
    let mut daemon = Daemon::start(
        &[],
        &[
            "--size",
            "65536",
            "--allow-uid",
            &uid_b,
            "--idle-timeout",
            "3",
        ],
        &name,
    );
    // This uid opens 300 connections and says nothing on any.
    let mut idle = Vec::new();
    let opening = Instant::now();
    while idle.len() < 300 {
        match idle_connection(&name) {
            Some(fd) => idle.push(fd),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
        assert!(
            opening.elapsed() < Duration::from_secs(60),
            "{}",
            daemon.log()
        );
    }
    let opened = Instant::now();
    // A client of another allowed uid, then one of the same uid: both served promptly. The bounds are generous: this
    // is availability (before: 5.2 s, and clients past the cap timed out), not speed.
    let mut other = Client::start(Some(UID_B), "fetch", &name, me);
    let report = other.line("OK weights", Duration::from_secs(30));
    let took = other.started.elapsed();
    assert!(report.is_ok(), "{report:?}\ndaemon: {}", daemon.log());
    assert!(took < Duration::from_secs(2), "another uid waited {took:?}");
    // The other client came after the 300 in the backlog: by now the daemon has taken them
    // all. Those it holds give way to a client of their own uid once idle for EVICT_AFTER.
    std::thread::sleep(vmm_examples::EVICT_AFTER + Duration::from_millis(200));
    let mut same = Client::start(None, "fetch", &name, me);
    let report = same.line("OK weights", Duration::from_secs(30));
    let took = same.started.elapsed();
    assert!(report.is_ok(), "{report:?}\ndaemon: {}", daemon.log());
    assert!(
        took < Duration::from_secs(2),
        "the same uid waited {took:?}"
    );
    // Every idle connection is closed: refused at once past the cap, else after the idle
    // timeout (3 s; given 20).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut open: Vec<&OwnedFd> = idle.iter().collect();
    while !open.is_empty() && Instant::now() < deadline {
        open.retain(|fd| !closed_by_daemon(fd));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        open.is_empty(),
        "{} idle connections still open after {:?}: {}",
        open.len(),
        opened.elapsed(),
        daemon.log()
    );
}
