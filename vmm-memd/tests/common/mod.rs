//! Test harness: the `vmm-memd` program as a real service process, and roles run in real child
//! processes (fresh execs of the test binary, optionally as uid/gid 65534 through `setpriv`).
//!
//! The programs are this test executable too: started with [`PROGRAM_VAR`] set, it runs
//! `vmm-memd` or `vmm-memctl` before libtest's `main` (see [`play_program`]). A test binary
//! opens no path of the build machine at run time (it is copied alone to the GPU machine), so
//! it never starts cargo's `CARGO_BIN_EXE_*` binaries, except where `binary.rs` checks the
//! built programs when they are there.
#![allow(dead_code)]

use std::ffi::{CStr, c_char, c_int};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};
use vmm_memd::{Client, MemdError};

/// The uid and gid the "other user" runs as.
pub const NOBODY: u32 = 65534;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The environment variable that makes this test executable play a program: `vmm-memd` or
/// `vmm-memctl`. It is inherited on purpose: the service starts its keeper by running its own
/// executable (`--keeper NAME`), which must play `vmm-memd` as well.
pub const PROGRAM_VAR: &str = "VMM_MEMD_TEST_PROGRAM";

/// Runs before libtest's `main` in every test executable of this crate (glibc passes `argc`,
/// `argv` and `envp` to `.init_array` functions): with [`PROGRAM_VAR`] set, run that program
/// with this process's arguments after `argv[0]` and exit with its status; otherwise return.
extern "C" fn play_program(argc: c_int, argv: *const *const c_char, _envp: *const *const c_char) {
    let Some(program) = std::env::var_os(PROGRAM_VAR) else {
        return;
    };
    let main: fn(&[String]) -> i32 = match program.to_str() {
        Some("vmm-memd") => vmm_memd::cli::main,
        Some("vmm-memctl") => vmm_memd::ctl::main,
        _ => {
            eprintln!("{PROGRAM_VAR}={program:?}: not vmm-memd or vmm-memctl");
            std::process::exit(2);
        }
    };
    let args: Vec<String> = (1..usize::try_from(argc).unwrap_or(0))
        .map(|i| {
            // SAFETY: glibc passes the process's argv: `argc` valid C strings.
            unsafe { CStr::from_ptr(*argv.add(i)) }
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    // Rust's runtime ignores SIGPIPE before a program's `main`; this runs before it, so do the
    // same (a write to a peer that left is an error, not the end of the process).
    // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    std::process::exit(main(&args));
}

#[used]
#[unsafe(link_section = ".init_array")]
static PLAY_PROGRAM: extern "C" fn(c_int, *const *const c_char, *const *const c_char) =
    play_program;

/// This test executable, which plays the programs.
pub fn test_exe() -> PathBuf {
    std::env::current_exe().expect("the test executable's path")
}

/// A command that runs `program` (`vmm-memd` or `vmm-memctl`): this test executable, playing
/// it.
pub fn program(program: &str) -> Command {
    let mut command = Command::new(test_exe());
    command.env(PROGRAM_VAR, program);
    command
}

/// A command that runs `program` as uid/gid 65534 with no supplementary groups (through
/// `setpriv`, which keeps the environment).
pub fn program_as_nobody(program: &str) -> Command {
    let mut command = Command::new("setpriv");
    command
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
        ])
        .arg(test_exe())
        .env(PROGRAM_VAR, program);
    command
}

/// A running `vmm-memd`, stopped (SIGTERM; SIGKILL after 3 s) and reaped on drop, and then its
/// keeper, which a stop leaves holding everything, is stopped too (SIGTERM lets it go). Its
/// keeper lets go 20 s after its last service anyway.
pub struct ServiceProc {
    pub child: Child,
    pub socket: String,
    pub extra: Vec<String>,
    /// A program it runs under (`prlimit --nofile=...`), which execs it (same pid).
    pub wrapper: Vec<String>,
    /// The executable that plays it (this test executable unless
    /// [`restart_from`](Self::restart_from) named another).
    pub exe: PathBuf,
}

impl ServiceProc {
    /// Start `vmm-memd` on a fresh abstract socket with a quota of 1 GiB and `extra` options,
    /// admitting uid 65534 too; wait until it answers.
    pub fn start(extra: &[&str]) -> ServiceProc {
        ServiceProc::start_under(&[], extra)
    }

    /// [`start`](Self::start) under `wrapper` (a program that execs the rest of its command
    /// line, such as `prlimit --nofile=1024:1024`).
    pub fn start_under(wrapper: &[&str], extra: &[&str]) -> ServiceProc {
        let socket = format!(
            "@vmm-memd-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let wrapper: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
        let exe = test_exe();
        let child = ServiceProc::spawn(&exe, &wrapper, &socket, &extra);
        let service = ServiceProc {
            child,
            socket,
            extra,
            wrapper,
            exe,
        };
        service.wait_up();
        service
    }

    /// Start the service again on the same socket with the same options (after it ended).
    pub fn restart(&mut self) {
        self.child = ServiceProc::spawn(&self.exe, &self.wrapper, &self.socket, &self.extra);
        self.wait_up();
    }

    /// [`restart`](Self::restart) with `exe` playing the service from now on (a copy of this
    /// test executable in another file: an upgraded binary).
    pub fn restart_from(&mut self, exe: &Path) {
        self.exe = exe.to_owned();
        self.restart();
    }

    fn spawn(exe: &Path, wrapper: &[String], socket: &str, extra: &[String]) -> Child {
        let mut command = match wrapper.split_first() {
            None => Command::new(exe),
            Some((first, rest)) => {
                let mut command = Command::new(first);
                command.args(rest).arg(exe);
                command
            }
        };
        command.env(PROGRAM_VAR, "vmm-memd");
        command
            .args(["--socket", socket, "--quota-bytes", "1073741824"])
            .args(["--allow-uid", &NOBODY.to_string()])
            .args(["--keeper-linger-ms", "20000"])
            .arg("--state-dir")
            .arg(state_dir())
            .args(extra)
            // Built with the `tracing` feature, the program prints its events: only warnings
            // in these tests unless the environment asks for more.
            .env(
                "VMM_MEMD_LOG",
                std::env::var("VMM_MEMD_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .spawn()
            .expect("start vmm-memd")
    }

    /// Wait until the service answers, and until it has closed its side of the probe
    /// connection (socket and pidfd): tests that count the service's fds take their baseline
    /// right after `start`, and a probe still open there would inflate it.
    fn wait_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.try_connect() {
                Ok(probe) => {
                    // One round trip: the connection's thread runs and holds its pidfd.
                    probe.status().expect("status of a fresh service");
                    let open = self.fd_count();
                    drop(probe);
                    until(Duration::from_secs(10), || self.fd_count() <= open - 2)
                        .expect("the service closes a connection that ended");
                    return;
                }
                Err(MemdError::ServiceGone(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("vmm-memd did not come up: {e:?}"),
            }
        }
    }

    /// Send `signal` to the service process.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill of our own child's pid (not reaped yet).
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// The pid of the keeper of this service (a `vmm-memd --keeper` process for its name),
    /// if one runs.
    pub fn keeper_pid(&self) -> Option<i32> {
        keeper_pid_of(&self.socket)
    }

    pub fn name(&self) -> Name {
        Name::from(self.socket.as_str())
    }

    pub fn try_connect(&self) -> Result<Client, MemdError> {
        Client::connect(&self.name())
    }

    /// How many fds the service process holds now.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }

    pub fn connect(&self) -> Client {
        self.try_connect().expect("connect to vmm-memd")
    }
}

/// The pid of the keeper of the service on abstract socket `socket` (a `vmm-memd --keeper`
/// process for its name), if one runs.
pub fn keeper_pid_of(socket: &str) -> Option<i32> {
    let name = format!("@vmm-memd-keeper:{}", &socket[1..]);
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let state = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let zombie = state.rsplit(')').next()?.trim_start().starts_with('Z');
            (!zombie && args.len() >= 3 && args[1] == b"--keeper" && args[2] == name.as_bytes())
                .then_some(pid)
        })
}

impl Drop for ServiceProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill of our own child's pid (not reaped yet).
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(3);
            while let Ok(None) = self.child.try_wait() {
                if Instant::now() > deadline {
                    let _ = self.child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = self.child.wait();
        if let Some(keeper) = self.keeper_pid() {
            // SAFETY: kill of a pid found just now; SIGTERM makes a keeper let everything go.
            unsafe { libc::kill(keeper, libc::SIGTERM) };
        }
    }
}

/// The state directory the services of this test process leave their keepers' hand-over
/// keys in (a `--state-dir` the service creates, 0700): one per test process, so tests do not
/// write to the machine's /run.
pub fn state_dir() -> PathBuf {
    std::env::temp_dir().join(format!("vmm-memd-test-state-{}", std::process::id()))
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Whether this process runs as root (so other uids can be tried with setpriv).
pub fn is_root() -> bool {
    euid() == 0
}

/// A role process; its `MEMD ...` stdout lines are read with [`Role::expect_line`].
pub struct Role {
    pub child: Child,
    lines: BufReader<ChildStdout>,
}

impl Role {
    /// Run `role` in a fresh exec of this test binary (through the `role_entry` test), with
    /// `args` in `MEMD_ARGS` (space-separated), against `service`; as uid/gid 65534 with no
    /// supplementary groups when `nobody`.
    pub fn spawn(role: &str, service: &ServiceProc, args: &[&str], nobody: bool) -> Role {
        let groups = nobody.then_some("--clear-groups");
        Role::spawn_as(role, service, args, groups)
    }

    /// [`spawn`](Self::spawn) as uid/gid 65534 with `groups` (`--clear-groups` or
    /// `--groups=GID,...`) when it is `Some`.
    pub fn spawn_as(
        role: &str,
        service: &ServiceProc,
        args: &[&str],
        groups: Option<&str>,
    ) -> Role {
        Role::spawn_from(&test_exe(), role, service, args, groups)
    }

    /// [`spawn_as`](Self::spawn_as) from `exe`, a test executable of this crate (a copy of
    /// this one, for a process of another executable).
    pub fn spawn_from(
        exe: &Path,
        role: &str,
        service: &ServiceProc,
        args: &[&str],
        groups: Option<&str>,
    ) -> Role {
        let mut command = match groups {
            Some(groups) => {
                let mut c = Command::new("setpriv");
                c.args([
                    &format!("--reuid={NOBODY}"),
                    &format!("--regid={NOBODY}"),
                    groups,
                ])
                .arg(exe);
                c
            }
            None => Command::new(exe),
        };
        command
            .args([
                "--exact",
                "role_entry",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ])
            .env("MEMD_ROLE", role)
            .env("MEMD_SOCKET", &service.socket)
            .env("MEMD_SERVICE_UID", euid().to_string())
            .env("MEMD_ARGS", args.join(" "))
            .stdout(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = spawn_fresh(&mut command).expect("spawn a role");
        let lines = BufReader::new(child.stdout.take().unwrap());
        Role { child, lines }
    }

    /// The next `MEMD ` line (without the prefix), or a panic if the role ends first.
    pub fn expect_line(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.lines.read_line(&mut line).unwrap();
            assert!(n > 0, "the role ended before saying anything more");
            if let Some(rest) = line.trim_end().strip_prefix("MEMD ") {
                return rest.to_owned();
            }
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill of our own child's pid (not reaped yet).
        assert_eq!(unsafe { libc::kill(self.pid(), signal) }, 0);
    }

    /// Wait for the role to exit; its success.
    pub fn wait_success(mut self) -> bool {
        self.child.wait().unwrap().success()
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawn `command`; while its executable was just written (a copy of this test executable),
/// retry for up to 2 s on `ETXTBSY`: a process forked meanwhile by another test's thread holds
/// the copy's write fd until its own exec closes it.
fn spawn_fresh(command: &mut Command) -> std::io::Result<Child> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match command.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            spawned => return spawned,
        }
    }
}

/// The role's side: the client connected as this process (expecting the service's uid).
pub fn role_client() -> Client {
    let name = Name::from(std::env::var("MEMD_SOCKET").unwrap().as_str());
    let uid: u32 = std::env::var("MEMD_SERVICE_UID").unwrap().parse().unwrap();
    Client::connect_with(
        &name,
        &ConnectOptions::default().expect(Allow::none().uid(uid)),
    )
    .expect("the role connects")
}

/// The role's arguments.
pub fn role_args() -> Vec<String> {
    std::env::var("MEMD_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Say a line to the parent.
pub fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "MEMD {line}").unwrap();
    out.flush().unwrap();
}

/// The byte every chunk of generation `g` is filled with in these tests.
pub fn fill_byte(generation: u64) -> u8 {
    (generation % 251) as u8 + 1
}

/// Whether every byte of `chunk` is [`fill_byte`] of `generation`: what [`publish`] wrote.
pub fn holds(chunk: &vmm_memd::ReadOnlyChunk, generation: u64) -> bool {
    chunk.as_slice().iter().all(|&b| b == fill_byte(generation))
}

/// Publish one generation of `region`: `chunks` chunks of `size` bytes, each filled with
/// [`fill_byte`] of its generation, with one tensor per chunk. Returns the generation.
pub fn publish(client: &Client, region: &str, chunks: usize, size: u64) -> u64 {
    let mut writer = client
        .begin(region, &vec![size; chunks], Default::default())
        .expect("begin");
    let byte = fill_byte(writer.generation());
    for (i, chunk) in writer.chunks().iter().enumerate() {
        chunk.fill(byte).unwrap();
        let _ = i;
    }
    for i in 0..chunks {
        writer.put(
            &format!("t{i}"),
            vmm_memd::protocol::TensorMeta {
                chunk: i as u32,
                offset: 0,
                len: size,
                dtype: vmm_memd::protocol::Dtype::U8,
                shape: vec![size],
            },
        );
    }
    writer.commit().expect("commit")
}

/// Poll `f` every 1 ms until it is true or `limit` passes; how long it took.
pub fn until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    loop {
        if f() {
            return Some(started.elapsed());
        }
        if started.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A copy of this test executable in a fresh directory of its own: the same program in another
/// file, so "another executable" to the keeper's check. Removed on drop.
pub struct ExeCopy {
    pub path: PathBuf,
}

impl ExeCopy {
    pub fn new() -> ExeCopy {
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
