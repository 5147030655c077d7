//! The `vmm-memd` program: its command line, signals and exit codes (`src/bin/vmm-memd.rs`
//! is a thin `main` over [`main`]).

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use vmm_core::wire::endpoint::{Allow, Listener, ListenerOptions, Name};

use crate::identity::Admins;
use crate::keeper::Keeper;
use crate::keeper::handover::{HandOverKey, KEY_LEN, StateDir};
use crate::service::Service;

/// The usage text (`--help`).
pub const USAGE: &str = "\
usage: vmm-memd --socket NAME|PATH --quota-bytes BYTES [options]

Serve named memory regions with generations to local processes (see vmm-memd/README.md).

  --socket NAME|PATH       @NAME: abstract socket; otherwise a path (its directory 0700)
  --quota-bytes BYTES      each uid's quota (bytes of generations it allocated)
  --quota UID=BYTES        a uid's own quota (repeatable)
  --allow-uid UID          admit this uid too (repeatable; this process's uid always)
  --allow-gid GID          admit this group too (repeatable)
  --admin-uid UID          an operator: may list, delete, sleep and wake any region and
                           release everything (repeatable; default: root only)
  --admin-gid GID          the members of this group are operators too (repeatable)
  --lease-ttl-ms MS        a lease's TTL (default 10000)
  --max-wait-ms MS         the longest a writer waits for a region (default 60000)
  --retain N               keep N retired generations per region without leases (default 0)
  --max-connections N      connections at once (default 256)
  --max-connections-per-uid N   of one uid (default 64; at the cap a newcomer evicts the
                           uid's longest-idle connection without a lease or pending generation)
  --idle-timeout-ms MS     close a connection that sent no request for MS while it holds no
                           lease and no pending generation (default 300000; 0: never)
  --max-fds-in-flight N    descriptor fds sent and not read yet, in all (default 4096; at
                           most half the soft RLIMIT_NOFILE, raised to the hard one at start)
  --max-fds-in-flight-per-uid N   to one uid (default 1024; at most a quarter of the total)
  --no-keeper              no keeper process: a stop or crash of the service loses every
                           region
  --keeper-linger-ms MS    a keeper lets everything go once no service has been connected
                           for MS (default: it waits for a restart for ever)
  --state-dir DIR          where the keeper's hand-over key is left for an upgraded binary
                           (created 0700; default $RUNTIME_DIRECTORY, else
                           $XDG_RUNTIME_DIR/vmm-memd, else /run/vmm-memd for root)
  -h, --help               this text

A keeper process (this program, `vmm-memd --keeper NAME`) holds every committed generation so
that the service, started again after a stop, a crash or an upgrade of this program, serves
them again; `vmm-memctl release --all` lets them go, and so does SIGINT/SIGTERM to the keeper.

Exit status: 0 after SIGINT/SIGTERM, 1 when serving fails, 2 on a usage error.
Logs go to stderr; built with the `tracing` feature, so do its events, at the level
$VMM_MEMD_LOG names (error, warn, info, debug, trace, off; default info).";

/// A command line `vmm-memd` does not take.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// An option it does not know.
    #[error("unknown option {0}")]
    Unknown(String),
    /// An option without its value, or with one that does not parse.
    #[error("{0} needs a value: {1}")]
    Value(String, &'static str),
    /// A required option is missing.
    #[error("{0} is required")]
    Missing(&'static str),
}

/// What the command line asks for.
#[derive(Debug)]
pub struct Config {
    /// Where to listen.
    pub socket: Name,
    /// Who may connect.
    pub allow: Allow,
    /// The service.
    pub service: Service,
    /// Whether a keeper holds committed generations across a crash of the service.
    pub keeper: bool,
    /// How long the keeper waits for a service (`None`: for ever).
    pub keeper_linger: Option<Duration>,
    /// `--state-dir`, if given (else [`default_state_dir`]).
    pub state_dir: Option<PathBuf>,
}

/// Parse the arguments (without the program name). `Ok(None)`: `--help`.
pub fn parse(args: &[String]) -> Result<Option<Config>, UsageError> {
    let mut it = args.iter();
    let (mut socket, mut quota, mut allow) = (None, None, Allow::same_user());
    let (mut quotas, mut ttl, mut wait, mut idle) = (Vec::new(), None, None, None);
    let (mut max, mut per_uid, mut retain) = (None, None, None);
    let (mut fds_all, mut fds_uid) = (None, None);
    let (mut keeper, mut keeper_linger, mut state_dir) = (true, None, None);
    let mut admins = Admins::default();
    while let Some(arg) = it.next() {
        let mut value = |what: &'static str| {
            it.next()
                .cloned()
                .ok_or_else(|| UsageError::Value(arg.clone(), what))
        };
        let number = |text: String, what: &'static str| {
            text.parse::<u64>()
                .map_err(|_| UsageError::Value(arg.clone(), what))
        };
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--socket" => socket = Some(Name::from(value("NAME|PATH")?.as_str())),
            "--quota-bytes" => quota = Some(number(value("BYTES")?, "BYTES")?),
            "--quota" => {
                let text = value("UID=BYTES")?;
                let (uid, bytes) = text
                    .split_once('=')
                    .and_then(|(u, b)| Some((u.parse::<u32>().ok()?, b.parse::<u64>().ok()?)))
                    .ok_or_else(|| UsageError::Value(arg.clone(), "UID=BYTES"))?;
                quotas.push((uid, bytes));
            }
            "--allow-uid" => {
                let uid = number(value("UID")?, "UID")?;
                allow = allow
                    .uid(u32::try_from(uid).map_err(|_| UsageError::Value(arg.clone(), "UID"))?);
            }
            "--allow-gid" => {
                let gid = number(value("GID")?, "GID")?;
                allow = allow
                    .gid(u32::try_from(gid).map_err(|_| UsageError::Value(arg.clone(), "GID"))?);
            }
            "--lease-ttl-ms" => ttl = Some(number(value("MS")?, "MS")?),
            "--max-wait-ms" => wait = Some(number(value("MS")?, "MS")?),
            "--idle-timeout-ms" => idle = Some(number(value("MS")?, "MS")?),
            "--max-fds-in-flight" => fds_all = Some(number(value("N")?, "N")? as usize),
            "--max-fds-in-flight-per-uid" => fds_uid = Some(number(value("N")?, "N")? as usize),
            "--admin-uid" => {
                let uid = number(value("UID")?, "UID")?;
                let uid = u32::try_from(uid).map_err(|_| UsageError::Value(arg.clone(), "UID"))?;
                admins.uids.push(uid);
                allow = allow.uid(uid);
            }
            "--admin-gid" => {
                let gid = number(value("GID")?, "GID")?;
                let gid = u32::try_from(gid).map_err(|_| UsageError::Value(arg.clone(), "GID"))?;
                admins.gids.push(gid);
                allow = allow.gid(gid);
            }
            "--state-dir" => state_dir = Some(PathBuf::from(value("DIR")?)),
            "--no-keeper" => keeper = false,
            "--keeper-linger-ms" => {
                keeper_linger = Some(Duration::from_millis(number(value("MS")?, "MS")?))
            }
            "--retain" => retain = Some(number(value("N")?, "N")? as usize),
            "--max-connections" => max = Some(number(value("N")?, "N")? as usize),
            "--max-connections-per-uid" => per_uid = Some(number(value("N")?, "N")? as usize),
            other => return Err(UsageError::Unknown(other.to_owned())),
        }
    }
    if admins.uids.is_empty() && admins.gids.is_empty() {
        admins.uids.push(0);
        allow = allow.uid(0);
    }
    let mut service = Service::new(quota.ok_or(UsageError::Missing("--quota-bytes"))?);
    service.set_admins(admins);
    for (uid, bytes) in quotas {
        service.set_quota_of(uid, bytes);
    }
    if let Some(ms) = ttl {
        service.set_lease_ttl(Duration::from_millis(ms));
    }
    if fds_all.is_some() || fds_uid.is_some() {
        service.set_max_fds_in_flight(
            fds_uid.unwrap_or(crate::service::DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID),
            fds_all.unwrap_or(crate::service::DEFAULT_MAX_FDS_IN_FLIGHT),
        );
    }
    if let Some(n) = retain {
        service.set_retain(n);
    }
    if let Some(ms) = wait {
        service.set_max_wait(Duration::from_millis(ms));
    }
    if let Some(ms) = idle {
        service.set_idle_timeout((ms > 0).then(|| Duration::from_millis(ms)));
    }
    if max.is_some() || per_uid.is_some() {
        service.set_max_connections(
            max.unwrap_or(crate::service::DEFAULT_MAX_CONNECTIONS),
            per_uid.unwrap_or(crate::service::DEFAULT_MAX_CONNECTIONS_PER_UID),
        );
    }
    Ok(Some(Config {
        socket: socket.ok_or(UsageError::Missing("--socket"))?,
        allow,
        service,
        keeper,
        keeper_linger,
        state_dir,
    }))
}

/// Where the keeper's hand-over key goes when `--state-dir` is not given: systemd's
/// `$RUNTIME_DIRECTORY` (its first entry), else `$XDG_RUNTIME_DIR/vmm-memd`, else
/// `/run/vmm-memd` for root; `None` otherwise (an upgraded binary then finds no key).
pub fn default_state_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dirs) = var("RUNTIME_DIRECTORY") {
        let first = dirs.to_string_lossy().split(':').next().map(PathBuf::from);
        return first;
    }
    if let Some(dir) = var("XDG_RUNTIME_DIR") {
        return Some(PathBuf::from(dir).join("vmm-memd"));
    }
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() } == 0).then(|| PathBuf::from("/run/vmm-memd"))
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    // An atomic store is async-signal-safe.
    STOP.store(true, Ordering::Relaxed);
}

/// Run the program; the process's exit status.
pub fn main(args: &[String]) -> i32 {
    if args.first().map(String::as_str) == Some("--keeper") {
        return keeper_main(&args[1..]);
    }
    let config = match parse(args) {
        Ok(Some(config)) => config,
        Ok(None) => {
            println!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("vmm-memd: {e}\n{USAGE}");
            return 2;
        }
    };
    // With the `tracing` feature the program prints its events on stderr too (the lines
    // below stay as they are).
    #[cfg(feature = "tracing")]
    crate::trace::install_stderr_subscriber();
    // The caps on fds in flight follow the soft limit: as high as this process may go.
    crate::fd_limit::raise();
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_stop as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_stop as *const () as libc::sighandler_t);
    }
    let listener = match Listener::bind_with(
        &config.socket,
        ListenerOptions::default().allow(config.allow),
    ) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("vmm-memd: cannot listen on {}: {e}", config.socket);
            return 1;
        }
    };
    // The keeper after the listener: a second service on the same name fails to bind before
    // it could take the keeper from the first.
    let served = if !config.keeper {
        eprintln!("vmm-memd: serving on {} (no keeper)", config.socket);
        config.service.serve(&listener, &STOP)
    } else {
        let state = match state_dir(config.state_dir) {
            Ok(state) => state,
            Err(code) => return code,
        };
        match Keeper::establish(&config.socket, config.keeper_linger, state) {
            Ok(keeper) => {
                eprintln!("vmm-memd: serving on {}", config.socket);
                config.service.serve_kept(&listener, &STOP, keeper)
            }
            Err(e) => {
                eprintln!("vmm-memd: no keeper: {e}");
                return 1;
            }
        }
    };
    match served {
        Ok(()) => {
            eprintln!("vmm-memd: stopped");
            0
        }
        Err(e) => {
            eprintln!("vmm-memd: {e}");
            1
        }
    }
}

/// The state directory to use: `given` must be usable (else the exit status 1); the default
/// may not be, and then the service runs without one (with a warning: an upgraded binary
/// will not take this keeper's memory, a restart of this one will).
fn state_dir(given: Option<PathBuf>) -> Result<Option<StateDir>, i32> {
    match given {
        Some(path) => StateDir::open(&path).map(Some).map_err(|e| {
            eprintln!("vmm-memd: --state-dir: {e}");
            1
        }),
        None => Ok(default_state_dir().and_then(|path| match StateDir::open(&path) {
            Ok(state) => Some(state),
            Err(e) => {
                eprintln!("vmm-memd: no state directory ({e}): an upgraded binary will not find the keeper's key");
                None
            }
        })),
    }
}

/// `vmm-memd --keeper NAME [--linger-ms MS]`: the keeper process (see [`crate::keeper`]). Its
/// hand-over key comes on its stdin ([`KEY_LEN`] bytes, from the service that starts it).
fn keeper_main(args: &[String]) -> i32 {
    let (name, linger) = match args {
        [name] => (name, None),
        [name, flag, ms] if flag == "--linger-ms" => match ms.parse::<u64>() {
            Ok(ms) => (name, Some(Duration::from_millis(ms))),
            Err(_) => return 2,
        },
        _ => {
            eprintln!("vmm-memd: usage: vmm-memd --keeper NAME [--linger-ms MS]");
            return 2;
        }
    };
    let mut key = Vec::with_capacity(KEY_LEN);
    let read = std::io::stdin()
        .lock()
        .take(KEY_LEN as u64)
        .read_to_end(&mut key);
    let Some(key) = read.ok().and_then(|_| HandOverKey::from_bytes(&key)) else {
        eprintln!("vmm-memd keeper: no hand-over key on stdin ({KEY_LEN} bytes)");
        return 2;
    };
    crate::keeper::run(&Name::from(name.as_str()), linger, &key)
}
