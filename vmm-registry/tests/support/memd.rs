//! Two "nodes" on one machine for the memory service's publisher: on each, a real `vmm-memd`
//! (with its keeper) on its own socket and a real `vmm-memd-publish` with its own certificate,
//! owner and loopback listener, all children of the test.
//!
//! The programs are this test executable too (it may be copied alone to another machine and
//! must open no path of the build machine): started with [`PROGRAM_VAR`] set, a pre-`main`
//! hook runs `vmm_memd::cli::main` or `vmm_registry::memd_publish::cli::main` with its
//! arguments and exits with its status, as vmm-memd's own tests do. The variable is
//! inherited, so the keeper the service starts from its own executable plays `vmm-memd` too.

use std::ffi::{CStr, c_char, c_int};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vmm_core::wire::endpoint::Name;
use vmm_memd::protocol::{Acl, TensorMeta};
use vmm_memd::{BeginOptions, Client, MemdError};
use vmm_registry::{Fetcher, Locator, host_stand_in};
use vmm_tests::pki::{Pki, dns_name};

use crate::support::World;

/// The variable that makes this executable play `vmm-memd` or `vmm-memd-publish`.
pub const PROGRAM_VAR: &str = "VMM_REGISTRY_TEST_PROGRAM";

/// The uid and gid of the publisher that may read less.
pub const NOBODY: u32 = 65534;

/// Runs before libtest's `main` (glibc passes `argc`, `argv` and `envp` to `.init_array`
/// functions): with [`PROGRAM_VAR`] set, run that program with this process's arguments after
/// `argv[0]` and exit with its status; otherwise return.
extern "C" fn play_program(argc: c_int, argv: *const *const c_char, _envp: *const *const c_char) {
    let Some(program) = std::env::var_os(PROGRAM_VAR) else {
        return;
    };
    let main: fn(&[String]) -> i32 = match program.to_str() {
        Some("vmm-memd") => vmm_memd::cli::main,
        Some("vmm-memd-publish") => vmm_registry::memd_publish::cli::main,
        _ => {
            eprintln!("{PROGRAM_VAR}={program:?}: not vmm-memd or vmm-memd-publish");
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
    // Rust's runtime ignores SIGPIPE before a program's `main`; this runs before it.
    // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
    let _ = unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigIgn,
        )
    };
    std::process::exit(main(&args));
}

#[used]
#[unsafe(link_section = ".init_array")]
static PLAY_PROGRAM: extern "C" fn(c_int, *const *const c_char, *const *const c_char) =
    play_program;

/// A command that runs `program`: this executable, playing it; as uid/gid 65534 through
/// `setpriv` when `nobody`.
pub fn program(program: &str, nobody: bool) -> Command {
    let exe = std::env::current_exe().expect("the test executable");
    let mut command = if nobody {
        let mut command = Command::new("setpriv");
        command
            .args([
                &format!("--reuid={NOBODY}"),
                &format!("--regid={NOBODY}"),
                "--clear-groups",
            ])
            .arg(exe);
        command
    } else {
        Command::new(exe)
    };
    command.env(PROGRAM_VAR, program);
    // vmm-memd's events (its `tracing` feature is on in the workspace's test builds) at warn
    // unless asked for: a test's output stays readable.
    command.env(
        "VMM_MEMD_LOG",
        std::env::var("VMM_MEMD_LOG").unwrap_or_else(|_| "warn".into()),
    );
    command
}

/// Whether this process runs as root (needed to play uid 65534, and for an importer to open
/// another uid's `/proc/<pid>/fd`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

fn signal(child: &Child, signal: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("a pid"));
    nix::sys::signal::kill(pid, signal).expect("signal a child");
}

/// Wait up to 5 s for `child` to exit; SIGKILL it then.
fn reap(child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A running `vmm-memd` on an abstract socket of its own, admitting uid 65534 too; stopped
/// with SIGTERM (which lets its keeper go) and reaped on drop.
#[derive(Debug)]
pub struct Service {
    pub child: Child,
    pub socket: String,
    extra: Vec<String>,
}

impl Service {
    pub fn start(node: &str) -> Service {
        Service::start_with(node, &[])
    }

    /// [`start`](Self::start) with `extra` options (kept for a restart).
    pub fn start_with(node: &str, extra: &[&str]) -> Service {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let socket = format!(
            "@vmm-registry-memd-{node}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let child = Service::spawn(&socket, &extra);
        let service = Service {
            child,
            socket,
            extra,
        };
        service.wait_up();
        service
    }

    fn spawn(socket: &str, extra: &[String]) -> Child {
        program("vmm-memd", false)
            .args(["--socket", socket, "--quota-bytes", "1073741824"])
            .args(["--allow-uid", &NOBODY.to_string()])
            .args(["--keeper-linger-ms", "20000"])
            .args(extra)
            .stdin(Stdio::null())
            .spawn()
            .expect("start vmm-memd")
    }

    fn wait_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.client() {
                Ok(_) => return,
                Err(MemdError::ServiceGone(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("vmm-memd did not come up: {e:?}"),
            }
        }
    }

    pub fn name(&self) -> Name {
        Name::from(self.socket.as_str())
    }

    /// A client of this uid (root: the writer).
    pub fn client(&self) -> Result<Client, MemdError> {
        Client::connect(&self.name())
    }

    /// The generations of `region` the service holds, each with the pids holding a lease.
    pub fn readers(&self, region: &str) -> Vec<(u64, Vec<i32>)> {
        let status = self.client().expect("connect").status().expect("status");
        status
            .regions
            .into_iter()
            .filter(|r| r.region == region)
            .flat_map(|r| r.generations)
            .map(|g| (g.generation, g.readers))
            .collect()
    }

    /// SIGKILL the service (its keeper keeps the regions) and reap it.
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL vmm-memd");
        self.child.wait().expect("reap vmm-memd");
    }

    /// Start it again on the same socket.
    pub fn restart(&mut self) {
        self.child = Service::spawn(&self.socket, &self.extra);
        self.wait_up();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            signal(&self.child, nix::sys::signal::Signal::SIGTERM);
        }
        reap(&mut self.child);
    }
}

/// Write generation N+1 of `region` on `client`: one chunk of `size` bytes holding
/// `pattern(seed, size)`, readable by `acl`'s principals besides the writer; its number.
pub fn write_region(client: &Client, region: &str, size: usize, seed: u8, acl: Acl) -> u64 {
    let options = BeginOptions {
        acl,
        ..Default::default()
    };
    let writer = client
        .begin(region, &[size as u64], options)
        .expect("begin");
    writer
        .chunk(0)
        .write_at(0, &vmm_tests::pattern(seed, size))
        .expect("fill the chunk");
    writer.commit().expect("commit")
}

/// [`write_region`], with `tensors` as the generation's metadata.
pub fn write_tensors(
    client: &Client,
    region: &str,
    size: usize,
    seed: u8,
    tensors: &[(&str, TensorMeta)],
) -> u64 {
    let mut writer = client
        .begin(region, &[size as u64], BeginOptions::default())
        .expect("begin");
    writer
        .chunk(0)
        .write_at(0, &vmm_tests::pattern(seed, size))
        .expect("fill the chunk");
    for (key, meta) in tensors {
        writer.put(key, meta.clone());
    }
    writer.commit().expect("commit")
}

/// FNV-1a of `bytes`: how the engine child reports a tensor's bytes in one word.
pub fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A running `vmm-memd-publish`, its stdout's lines on a channel; SIGKILLed and reaped on
/// drop unless stopped before.
#[derive(Debug)]
pub struct Publisher {
    pub child: Child,
    /// Its registry lease (from its first line, `listening ADDR lease ID`).
    pub lease: i64,
    lines: mpsc::Receiver<String>,
}

/// How a publisher is started.
#[derive(Debug, Clone)]
pub struct PublisherSpec<'s> {
    /// The certificate's name (also the etcd user).
    pub name: &'s str,
    /// The owner prefix it publishes under (its name, unless a test says otherwise).
    pub owner: &'s str,
    /// The importer names it admits.
    pub admit: &'s [&'s str],
    /// Run as uid 65534.
    pub nobody: bool,
    /// The regions it publishes (`--region`; none: every readable one).
    pub regions: &'s [&'s str],
}

impl Publisher {
    /// Start a publisher of `service`'s regions in `world`'s etcd (TTL 2 s, polling every
    /// 100 ms), listening on loopback; returned once it listens.
    pub fn start(world: &World, service: &Service, spec: &PublisherSpec<'_>) -> Publisher {
        let dir = world.write_material(spec.name);
        let file = |name: &str| dir.join(name).display().to_string();
        let mut command = program("vmm-memd-publish", spec.nobody);
        command
            .args(["--socket", &service.socket])
            .args(["--etcd", &world.etcd.endpoint()])
            .args(["--ca", &file("ca.pem")])
            .args(["--cert", &file(&format!("{}.pem", spec.name))])
            .args(["--key", &file(&format!("{}.key", spec.name))])
            .args(["--etcd-name", &dns_name(crate::support::SERVER)])
            .args(["--domain", crate::support::DOMAIN, "--owner", spec.owner])
            .args(["--exporter-name", &dns_name(spec.name)])
            .args(["--listen", "127.0.0.1:0", "--poll-ms", "100"])
            .args(["--lease-ttl-s", "2", "--reconnect-ms", "20000"]);
        for importer in spec.admit {
            command.args(["--admit", &dns_name(importer)]);
        }
        if spec.nobody {
            command.args(["--service-uid", "0"]);
        }
        for region in spec.regions {
            command.args(["--region", region]);
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start vmm-memd-publish");
        let stdout = child.stdout.take().expect("its stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        let mut publisher = Publisher {
            child,
            lease: 0,
            lines,
        };
        let listening = publisher.expect_line("listening ", Duration::from_secs(15));
        publisher.lease = listening
            .rsplit(' ')
            .next()
            .and_then(|id| id.parse().ok())
            .expect("listening ADDR lease ID");
        publisher
    }

    /// The next line that starts with `prefix` within `timeout` (lines before it are
    /// skipped), or a panic.
    pub fn expect_line(&self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(_) => panic!("the publisher never said {prefix:?} within {timeout:?}"),
            }
        }
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("a pid")
    }

    /// Its exit status's code, if it exits within `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Send it SIGTERM.
    pub fn terminate(&self) {
        signal(&self.child, nix::sys::signal::Signal::SIGTERM);
    }

    /// Stop it (SIGSTOP) or let it go on (SIGCONT).
    pub fn stop(&self, stopped: bool) {
        use nix::sys::signal::Signal::{SIGCONT, SIGSTOP};
        signal(&self.child, if stopped { SIGSTOP } else { SIGCONT });
    }

    /// SIGKILL it and reap it.
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the publisher");
        self.child.wait().expect("reap the publisher");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fetcher whose certificate is called `name`.
pub fn fetcher(pki: &Pki, name: &str) -> Fetcher {
    crate::support::handoff::fetcher(pki, name)
}

/// Fetch `locator`, map its chunks read-only, and acknowledge: the importer's side; the bytes
/// of the first chunk.
pub fn import(fetcher: &Fetcher, locator: &Locator) -> Result<Vec<u8>, vmm_registry::FetchError> {
    let fetched = fetcher.fetch(locator)?;
    let chunks = host_stand_in::import_read_only(fetched.descriptor()).expect("map the chunks");
    let bytes = chunks[0].as_slice().to_vec();
    fetched.acknowledge()?;
    Ok(bytes)
}

/// [`import`], reading the region's metadata too: the first chunk's bytes, and one line per
/// tensor, `engine tensor <key> <dtype> <shape> <offset> <len> <fnv of its bytes>`, each
/// read from its chunk at its offset (or `engine metadata refused <error>`).
pub fn import_with_tensors(
    fetcher: &Fetcher,
    locator: &Locator,
) -> Result<(Vec<u8>, Vec<String>), vmm_registry::FetchError> {
    let fetched = fetcher.fetch(locator)?;
    let chunks = host_stand_in::import_read_only(fetched.descriptor()).expect("map the chunks");
    let lines = match vmm_registry::memd_publish::region_metadata(&fetched) {
        Ok(tensors) => tensors
            .iter()
            .map(|(key, t)| {
                let chunk = chunks[t.chunk as usize].as_slice();
                let bytes = &chunk[t.offset as usize..(t.offset + t.len) as usize];
                format!(
                    "engine tensor {key} {:?} {:?} {} {} {:016x}",
                    t.dtype,
                    t.shape,
                    t.offset,
                    t.len,
                    fnv(bytes)
                )
            })
            .collect(),
        Err(error) => vec![format!("engine metadata refused {error:?}")],
    };
    let bytes = chunks[0].as_slice().to_vec();
    fetched.acknowledge()?;
    Ok((bytes, lines))
}

/// Set in an engine child: `<etcd endpoint> <material dir> <name> <owner> <region> <seed>
/// <size>`.
pub const ENGINE_VAR: &str = "VMM_REGISTRY_TEST_MEMD_ENGINE";

/// The engine child's body, run where [`ENGINE_VAR`] is set (a no-op elsewhere): open the
/// registry as `name`, resolve `owner`'s `region` (waiting up to 10 s), fetch it over mutual
/// TLS, map it read-only, compare it with `pattern(seed, size)`, acknowledge, and print
/// `engine read <owner>/<region> <generation> ok` (or `WRONG`).
pub fn engine_child() {
    use vmm_registry::{Registry, RegistryConfig, TlsMaterial};

    let Ok(spec) = std::env::var(ENGINE_VAR) else {
        return;
    };
    let parts: Vec<&str> = spec.split(' ').collect();
    let [endpoint, dir, name, owner, region, seed, size] = parts[..] else {
        panic!("{ENGINE_VAR}: <endpoint> <dir> <name> <owner> <region> <seed> <size>");
    };
    let dir = std::path::Path::new(dir);
    let read = |file: &str| std::fs::read(dir.join(file)).expect("read material");
    let material = TlsMaterial::from_pem(
        read("ca.pem"),
        read(&format!("{name}.pem")),
        read(&format!("{name}.key")),
        dns_name(crate::support::SERVER),
    );
    let config = RegistryConfig::new([endpoint], material, crate::support::DOMAIN, name)
        .lease_ttl(Duration::from_secs(2));
    let registry = Registry::open(config).expect("the engine opens the registry");
    let deadline = Instant::now() + Duration::from_secs(10);
    let entry = loop {
        if let Some(entry) = registry.resolve(owner, region).expect("resolve") {
            break entry;
        }
        assert!(Instant::now() < deadline, "the locator never came");
        std::thread::sleep(Duration::from_millis(50));
    };
    let fetcher = Fetcher::new(
        crate::support::handoff::options_from(dir, name, &["nobody"]),
        crate::support::handoff::MESSAGE,
    );
    let (bytes, tensors) =
        import_with_tensors(&fetcher, &entry.locator).expect("fetch, map, acknowledge");
    for line in tensors {
        println!("{line}");
    }
    let expected = vmm_tests::pattern(seed.parse().expect("a seed"), size.parse().expect("a size"));
    let verdict = if bytes == expected { "ok" } else { "WRONG" };
    println!(
        "engine read {owner}/{region} {} {verdict}",
        entry.locator.generation
    );
}

/// Run an engine child called `name` (its certificate written into the world's directory)
/// that reads `owner`'s `region` and checks it holds `pattern(seed, size)`; every line it
/// printed (its tensors', then its report).
pub fn run_engine_lines(
    world: &World,
    name: &str,
    owner: &str,
    region: &str,
    seed: u8,
    size: usize,
) -> Vec<String> {
    let dir = world.write_material(name);
    let output = Command::new(std::env::current_exe().expect("the test executable"))
        .args([
            "--exact",
            "engine_child",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(
            ENGINE_VAR,
            format!(
                "{} {} {name} {owner} {region} {seed} {size}",
                world.etcd.endpoint(),
                dir.display()
            ),
        )
        .stderr(Stdio::inherit())
        .output()
        .expect("run the engine child");
    assert!(
        output.status.success(),
        "the engine failed: {:?}",
        output.status
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.starts_with("engine "))
        .map(str::to_owned)
        .collect()
}
