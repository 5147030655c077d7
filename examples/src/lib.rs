//! A memory-owner daemon and its clients: the shape of a weight or KV-cache service whose
//! workers were started by someone else (a scheduler, a Python launcher) and connect by name.
//!
//! - [`Daemon`] owns named buffers (CUDA VMM buffers where there is a GPU, host memfd buffers
//!   elsewhere) and serves them on a [`Listener`]: one thread per connection, each bounded by
//!   the connection's timeout, so a client that connects and says nothing delays no one.
//!   No client, and no allowed uid, can starve the others: at most
//!   [`Daemon::max_connections`] connections at once (default [`DEFAULT_MAX_CONNECTIONS`]),
//!   at most [`Daemon::max_connections_per_uid`] of one uid, idle ones closed after
//!   [`Daemon::idle_timeout`] or, when slots are short, for a newcomer ([`slots`]); at most
//!   [`Daemon::max_fds_in_flight`] descriptor fds sent and not read yet, per connection, per
//!   uid and in all ([`inflight`]); running out of fds (or threads) pauses accepting instead
//!   of ending the daemon; and a stop (SIGTERM) ends every connection at once.
//! - [`daemon::run`] is the `vmm-daemon` program (`src/bin/vmm-daemon.rs` is a thin `main`
//!   over it).
//! - [`client`] is the Rust client (`src/bin/vmm-client.rs` is a thin `main` over it);
//!   `python/daemon_client.py` is the Python one, on the standard-library peer.
//!
//! The requests are `DATA` messages of docs/protocol.md, UTF-8 text, so any language can send
//! them: `list` (the reply: one `NAME KIND SIZE` line per buffer), `get NAME` (the reply: the
//! buffer's descriptor, freshly exported, or `error: ...`).

#![cfg(target_os = "linux")]

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_core::cuda::{HandleType, VirtualMemoryBuffer};
use vmm_core::error::OptionRule;
use vmm_core::peer::{Descriptor, Session};
use vmm_core::shm::HostBuffer;
use vmm_core::wire::endpoint::Listener;
use vmm_core::{Error, Result};

pub mod inflight;
pub mod slots;

use inflight::{FdBudget, Window};
use slots::{Slot, Slots};

/// The test pattern of the examples (and of the Python peer): byte `i` is `seed + i % 251`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

/// A buffer the daemon owns.
#[derive(Debug, Clone)]
pub enum Served {
    /// Host shared memory (memfd).
    Host(HostBuffer),
    /// A CUDA VMM buffer.
    Cuda(VirtualMemoryBuffer),
}

impl Served {
    fn kind(&self) -> &'static str {
        match self {
            Served::Host(_) => "host",
            Served::Cuda(b) if b.handle_type() == HandleType::Fabric => "cuda-fabric",
            Served::Cuda(_) => "cuda",
        }
    }

    fn size(&self) -> usize {
        match self {
            Served::Host(b) => b.size(),
            Served::Cuda(b) => b.size(),
        }
    }

    /// A fresh descriptor (its fds are closed once it is sent and dropped): by fabric handle
    /// for a buffer allocated with `HandleType::Fabric`, else by POSIX fd.
    fn export(&self) -> Result<Descriptor> {
        Ok(match self {
            Served::Host(b) => b.export()?.into(),
            Served::Cuda(b) if b.handle_type() == HandleType::Fabric => {
                Descriptor::Fabric(b.export_fabric()?)
            }
            Served::Cuda(b) => b.export()?.into(),
        })
    }
}

/// How many connections a [`Daemon`] serves at once unless told otherwise: 64 (one thread and
/// one fd each).
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// How many of them one uid may hold unless told otherwise: 16, a quarter of
/// [`DEFAULT_MAX_CONNECTIONS`], so that no one allowed uid can take every slot.
pub const DEFAULT_MAX_CONNECTIONS_PER_UID: usize = 16;

/// How long a connection may wait between requests before the daemon closes it, unless told
/// otherwise: 10 s (what a receive waits by default,
/// [`DEFAULT_TIMEOUT`](vmm_core::wire::endpoint::DEFAULT_TIMEOUT)).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection idle at least this long may be closed to make room for a newcomer when slots
/// are short (see [`slots`]): 1 s, so that a client between two requests is not taken for an
/// idle one.
pub const EVICT_AFTER: Duration = Duration::from_secs(1);

/// Descriptor fds in flight (sent, not read yet) on one connection, unless told otherwise: 32.
pub const DEFAULT_MAX_FDS_IN_FLIGHT_PER_CONNECTION: usize = 32;

/// Descriptor fds in flight to the connections of one client uid, unless told otherwise: 128.
pub const DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID: usize = 128;

/// Descriptor fds in flight in all, unless told otherwise: 512 (and at most half the daemon's
/// soft `RLIMIT_NOFILE`, past which the kernel refuses its uid's sends: see [`inflight`]).
pub const DEFAULT_MAX_FDS_IN_FLIGHT: usize = 512;

/// How long [`Daemon::serve`] pauses accepting when the process is out of fds (`EMFILE`,
/// `ENFILE`) or cannot start a thread: 50 ms.
pub const RESOURCE_BACKOFF: Duration = Duration::from_millis(50);

/// How often [`Daemon::serve`] looks at its stop flag while no client connects: every 100 ms.
pub const STOP_CHECK: Duration = Duration::from_millis(100);

/// The start of the daemon's answer to a `get` that would pass a cap on fds in flight:
/// `error: busy: SIZE CAP WHY`.
pub const BUSY: &str = "error: busy: ";

/// The daemon: named buffers, served to whoever the listener admits.
#[derive(Debug)]
pub struct Daemon {
    buffers: BTreeMap<String, Served>,
    served: AtomicUsize,
    max_connections: usize,
    max_connections_per_uid: usize,
    idle_timeout: Duration,
    fds_in_flight: (usize, usize, usize),
}

impl Default for Daemon {
    fn default() -> Self {
        Daemon {
            buffers: BTreeMap::new(),
            served: AtomicUsize::new(0),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_uid: DEFAULT_MAX_CONNECTIONS_PER_UID,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            fds_in_flight: (
                DEFAULT_MAX_FDS_IN_FLIGHT_PER_CONNECTION,
                DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID,
                DEFAULT_MAX_FDS_IN_FLIGHT,
            ),
        }
    }
}

/// Whether `e` says the process (or the system) is out of fds: a transient condition for a
/// server, which pauses and goes on.
pub fn out_of_fds(e: &Error) -> bool {
    matches!(e, Error::FdLimit { .. }) || e.raw_os_error() == Some(libc::ENFILE)
}

impl Daemon {
    /// A daemon with no buffers.
    pub fn new() -> Daemon {
        Daemon::default()
    }

    /// The most connections it serves at once (each on its own thread, holding one fd). A
    /// client that finds none free is given the slot of the longest idle connection (idle at
    /// least [`EVICT_AFTER`]), or else is refused at once (`REFUSED`, saying why).
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Set [`max_connections`](Self::max_connections) (at least 1).
    pub fn set_max_connections(&mut self, max: usize) {
        self.max_connections = max.max(1);
    }

    /// The most connections one uid may hold at once (at most
    /// [`max_connections`](Self::max_connections)); default
    /// [`DEFAULT_MAX_CONNECTIONS_PER_UID`]. A client of a uid at its cap is given the slot of
    /// that uid's longest idle connection (idle at least [`EVICT_AFTER`]), or else refused.
    pub fn max_connections_per_uid(&self) -> usize {
        self.max_connections_per_uid.min(self.max_connections)
    }

    /// Set [`max_connections_per_uid`](Self::max_connections_per_uid) (at least 1).
    pub fn set_max_connections_per_uid(&mut self, max: usize) {
        self.max_connections_per_uid = max.max(1);
    }

    /// How long a connection may wait between requests before it is closed; default
    /// [`DEFAULT_IDLE_TIMEOUT`].
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Set [`idle_timeout`](Self::idle_timeout).
    pub fn set_idle_timeout(&mut self, timeout: Duration) {
        self.idle_timeout = timeout;
    }

    /// The caps on descriptor fds in flight (sent, not read yet): per connection, per client
    /// uid, in all (see [`inflight`]; clamped as [`FdBudget::new`] says when serving).
    pub fn max_fds_in_flight(&self) -> (usize, usize, usize) {
        self.fds_in_flight
    }

    /// Set [`max_fds_in_flight`](Self::max_fds_in_flight).
    pub fn set_max_fds_in_flight(&mut self, per_connection: usize, per_uid: usize, total: usize) {
        self.fds_in_flight = (per_connection, per_uid, total);
    }

    /// Serve `buffer` as `name`.
    pub fn add(&mut self, name: &str, buffer: Served) {
        self.buffers.insert(name.to_owned(), buffer);
    }

    /// How many descriptors it has sent.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }

    /// Accept connections until `stop` is set (looked at every [`STOP_CHECK`]), each served
    /// on its own thread, within [`max_connections`](Self::max_connections) and
    /// [`max_connections_per_uid`](Self::max_connections_per_uid) (see [`slots`]); a
    /// connection idle for [`idle_timeout`](Self::idle_timeout) is closed. Once `stop` is set,
    /// every connection is shut down (a client in the middle of a conversation included: its
    /// next receive sees the end) and it returns as soon as their threads have ended, so a
    /// chatty client cannot hold it up; memory a client already imported is its own and stays
    /// mapped. Errors of one connection end that connection only (they are logged). Running out
    /// of fds ([`out_of_fds`]) or threads pauses accepting for [`RESOURCE_BACKOFF`] (logged once
    /// per episode) and goes on: clients wait in the backlog meanwhile. Other accept errors end
    /// it.
    pub fn serve(&self, listener: &Listener, stop: &AtomicBool) -> Result<()> {
        let slots = Slots::new(
            self.max_connections,
            self.max_connections_per_uid,
            EVICT_AFTER,
        );
        let (per_connection, per_uid, total) = self.fds_in_flight;
        let budget = FdBudget::new(per_connection, per_uid, total);
        // Connections that ended with descriptors their clients have not read: kept (their
        // fds still count against the caps) until the clients read or hang up.
        let parked: Mutex<Vec<(Arc<Session>, Window<'_>)>> = Mutex::new(Vec::new());
        let mut short_since: Option<Instant> = None;
        let result = std::thread::scope(|scope| {
            let outcome = loop {
                if stop.load(Ordering::Relaxed) {
                    break Ok(());
                }
                parked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain_mut(|(conn, window)| window.unread(conn.as_fd()));
                let conn =
                    match Session::accept_admitting(listener, Some(STOP_CHECK), &mut |peer| {
                        slots.admit(peer.uid)
                    }) {
                        Ok(conn) => Arc::new(conn),
                        Err(Error::Timeout { .. }) => continue,
                        Err(e) if out_of_fds(&e) => {
                            pause(&mut short_since, &format!("out of fds ({e})"), slots.len());
                            continue;
                        }
                        Err(e) => break Err(e),
                    };
                if let Some(since) = short_since.take() {
                    eprintln!("vmm-daemon: accepting again after {:?}", since.elapsed());
                }
                let peer = conn.peer();
                let slot = slots.hold(peer.uid, Arc::clone(&conn));
                let (budget, parked) = (&budget, &parked);
                let started = std::thread::Builder::new()
                    .name("vmm-daemon-conn".into())
                    .spawn_scoped(scope, move || {
                        let mut window = budget.window(peer.uid);
                        if let Err(e) = self.converse(&conn, &slot, &mut window, stop) {
                            eprintln!("vmm-daemon: connection from {peer}: {e}");
                        }
                        drop(slot);
                        if !stop.load(Ordering::Relaxed) && window.unread(conn.as_fd()) {
                            parked
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((conn, window));
                        }
                    });
                if let Err(e) = started {
                    // The connection and its slot (moved into the closure) are gone with it.
                    pause(
                        &mut short_since,
                        &format!("cannot start a connection thread ({e})"),
                        slots.len(),
                    );
                }
            };
            // Stop: every connection ends now, whatever its client is doing.
            slots.close_all();
            outcome
        });
        parked.lock().unwrap_or_else(|e| e.into_inner()).clear();
        result
    }

    /// Answer one connection's requests until it hangs up, stays idle past
    /// [`idle_timeout`](Self::idle_timeout), or the daemon stops.
    fn converse(
        &self,
        conn: &Session,
        slot: &Slot<'_>,
        window: &mut Window<'_>,
        stop: &AtomicBool,
    ) -> Result<()> {
        loop {
            slot.idle();
            window.settle(conn.as_fd());
            if !wait_for_request(conn, self.idle_timeout)? || stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            slot.busy();
            let request = match conn.recv_data() {
                Ok(request) => request,
                Err(Error::Disconnected(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.answer(conn, &request, window, stop)?;
        }
    }

    /// Answer one request.
    fn answer(
        &self,
        conn: &Session,
        request: &[u8],
        window: &mut Window<'_>,
        stop: &AtomicBool,
    ) -> Result<()> {
        let request = String::from_utf8_lossy(request);
        let mut words = request.split_whitespace();
        match (words.next(), words.next()) {
            (Some("list"), None) => {
                let lines: Vec<String> = self
                    .buffers
                    .iter()
                    .map(|(name, b)| format!("{name} {} {}", b.kind(), b.size()))
                    .collect();
                conn.send_data(lines.join("\n").as_bytes())
            }
            (Some("get"), Some(name)) => match self.buffers.get(name) {
                Some(buffer) => {
                    let descriptor = buffer.export()?;
                    match window.reserve(conn.as_fd(), fd_count(&descriptor), stop) {
                        Ok(()) => {
                            conn.send_descriptor(&descriptor)?;
                            self.served.fetch_add(1, Ordering::Relaxed);
                            Ok(())
                        }
                        Err(Error::LimitExceeded {
                            size, cap, what, ..
                        }) => conn.send_data(format!("{BUSY}{size} {cap} {what}").as_bytes()),
                        Err(e) => Err(e),
                    }
                }
                None => conn.send_data(format!("error: no buffer named {name}").as_bytes()),
            },
            _ => conn.send_data(format!("error: unknown request {request:?}").as_bytes()),
        }
    }
}

/// The fds a descriptor carries.
fn fd_count(descriptor: &Descriptor) -> usize {
    match descriptor {
        Descriptor::Host(d) => usize::from(d.fd().is_some()),
        Descriptor::Cuda(d) => d.fds().count(),
        _ => 0,
    }
}

/// Wait until `conn` has something to read (a request, or its end) within `idle`: `false`
/// when it stayed idle.
fn wait_for_request(conn: &Session, idle: Duration) -> Result<bool> {
    let deadline = Instant::now() + idle;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: conn.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one pollfd, a live local.
        match unsafe { libc::poll(&mut pfd, 1, ms) } {
            0 if left.is_zero() => return Ok(false),
            0 => {}
            n if n > 0 => return Ok(true),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(Error::Os {
                        op: "poll(a connection)".into(),
                        source: e,
                    });
                }
            }
        }
    }
}

/// Pause accepting for [`RESOURCE_BACKOFF`], saying so once per episode of shortage.
fn pause(short_since: &mut Option<Instant>, what: &str, open: usize) {
    if short_since.is_none() {
        eprintln!("vmm-daemon: {what}; pausing new connections until some end ({open} open)");
        *short_since = Some(Instant::now());
    }
    std::thread::sleep(RESOURCE_BACKOFF);
}

/// The `vmm-daemon` program.
pub mod daemon {
    use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
    use vmm_core::wire::endpoint::{Allow, ListenerOptions, Name};

    use super::*;

    static STOP: AtomicBool = AtomicBool::new(false);

    extern "C" fn stop(_: libc::c_int) {
        // An atomic store is async-signal-safe.
        STOP.store(true, Ordering::Relaxed);
    }

    /// `vmm-daemon [--gpu [--fabric]] [--size BYTES] [--allow-uid UID]... [--max-connections N]
    /// [--max-connections-per-uid N] [--idle-timeout SECS] [--max-fds-in-flight N]
    /// [--max-fds-in-flight-per-uid N] [--max-fds-in-flight-per-connection N] [NAME]`: own one
    /// buffer, `weights` (a CUDA VMM buffer of two chunks with `--gpu`, served by fabric
    /// handle with `--fabric`, else by POSIX fd; a host memfd buffer of BYTES, default 4 MiB,
    /// without `--gpu`), filled with the examples' pattern of seed 7, and serve it on NAME
    /// (default `@vmm-ipc-daemon`) until SIGINT or SIGTERM (then it ends every connection and
    /// exits at once), to this process's uid and each UID, within the limits (defaults:
    /// [`DEFAULT_MAX_CONNECTIONS`], [`DEFAULT_MAX_CONNECTIONS_PER_UID`],
    /// [`DEFAULT_IDLE_TIMEOUT`], [`DEFAULT_MAX_FDS_IN_FLIGHT`],
    /// [`DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID`], [`DEFAULT_MAX_FDS_IN_FLIGHT_PER_CONNECTION`]).
    pub fn run(args: &[String]) -> Result<()> {
        let usage = |what: &str| Error::InvalidOption {
            option: "command line".into(),
            rule: OptionRule::Form,
            message: format!("vmm-daemon: {what}"),
        };
        let mut args = args.iter();
        let (mut gpu, mut size, mut allow, mut name) = (false, 4 << 20, Allow::same_user(), None);
        let (mut max, mut fabric) = (DEFAULT_MAX_CONNECTIONS, false);
        let mut daemon = Daemon::new();
        let (mut fds_conn, mut fds_uid, mut fds_all) = daemon.max_fds_in_flight();
        while let Some(arg) = args.next() {
            let mut number = |what: &str| -> Result<usize> {
                args.next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| usage(&format!("{arg} {what}")))
            };
            match arg.as_str() {
                "--gpu" => gpu = true,
                "--fabric" => fabric = true,
                "--size" => size = number("BYTES")?,
                "--allow-uid" => {
                    let uid =
                        u32::try_from(number("UID")?).map_err(|_| usage("--allow-uid UID"))?;
                    allow = allow.uid(uid);
                }
                "--max-connections" => max = number("N")?,
                "--max-connections-per-uid" => daemon.set_max_connections_per_uid(number("N")?),
                "--idle-timeout" => {
                    let secs = args
                        .next()
                        .and_then(|v| v.parse::<f64>().ok())
                        .and_then(|v| Duration::try_from_secs_f64(v).ok())
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| usage("--idle-timeout SECS (more than 0)"))?;
                    daemon.set_idle_timeout(secs);
                }
                "--max-fds-in-flight" => fds_all = number("N")?,
                "--max-fds-in-flight-per-uid" => fds_uid = number("N")?,
                "--max-fds-in-flight-per-connection" => fds_conn = number("N")?,
                other if other.starts_with("--") => {
                    return Err(usage(&format!("unknown option {other}")));
                }
                other => name = Some(other.to_owned()),
            }
        }
        daemon.set_max_fds_in_flight(fds_conn, fds_uid, fds_all);
        let name: Name = name.as_deref().unwrap_or("@vmm-ipc-daemon").into();
        daemon.set_max_connections(max);
        if fabric && !gpu {
            return Err(usage("--fabric shares a CUDA buffer: it needs --gpu"));
        }
        let weights = if gpu {
            let handle_type = match fabric {
                true => HandleType::Fabric,
                false => HandleType::PosixFd,
            };
            let resource = VirtualMemoryResource::new(
                &Device::new(0)?,
                ResourceOptions::default().handle_type(handle_type),
            )?;
            let g = resource.granularity();
            let buf = resource.grow(&resource.allocate(g)?, 2 * g)?;
            buf.write_at(0, &pattern(7, buf.size()))?;
            Served::Cuda(buf)
        } else {
            let buf = HostBuffer::new(size)?;
            buf.write_at(0, &pattern(7, size))?;
            Served::Host(buf)
        };
        daemon.add("weights", weights);
        // SAFETY: `stop` only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, stop as *const () as libc::sighandler_t);
            libc::signal(libc::SIGTERM, stop as *const () as libc::sighandler_t);
        }
        let listener = Listener::bind_with(&name, ListenerOptions::default().allow(allow))?;
        eprintln!("vmm-daemon: serving `weights` on {name} (Ctrl-C to stop)");
        daemon.serve(&listener, &STOP)?;
        eprintln!(
            "vmm-daemon: stopped after serving {} descriptor(s)",
            daemon.served()
        );
        Ok(())
    }
}

/// The Rust client.
pub mod client {
    use vmm_core::peer::{Descriptor, PeerMessage, Session};
    use vmm_core::wire::endpoint::{Allow, ConnectOptions, Name};

    use super::*;

    /// What a client fetched: the buffer, imported and mapped in this process.
    #[derive(Debug)]
    pub enum Fetched {
        /// A host buffer.
        Host(HostBuffer),
        /// A CUDA buffer (imported into this process's importer for its device).
        Cuda(VirtualMemoryBuffer),
    }

    impl Fetched {
        /// A copy of the whole buffer.
        pub fn contents(&self) -> Result<Vec<u8>> {
            Ok(match self {
                Fetched::Host(b) => b.to_vec(),
                Fetched::Cuda(b) => {
                    let mut out = vec![0u8; b.size()];
                    b.read_at(0, &mut out)?;
                    out
                }
            })
        }
    }

    /// The daemon's `list` reply.
    pub fn list(conn: &Session) -> Result<String> {
        conn.send_data(b"list")?;
        Ok(String::from_utf8_lossy(&conn.recv_data()?).into_owned())
    }

    /// Ask for `buffer` and import it.
    pub fn fetch(conn: &Session, buffer: &str) -> Result<Fetched> {
        conn.send_data(format!("get {buffer}").as_bytes())?;
        reply(conn)
    }

    /// Read the daemon's answer to one `get` and import the buffer: a client that sent
    /// several requests before reading reads their answers in order. A busy daemon's answer
    /// (too many of its descriptors unread) is [`Error::LimitExceeded`].
    pub fn reply(conn: &Session) -> Result<Fetched> {
        match conn.recv_message()? {
            PeerMessage::Descriptor(Descriptor::Host(d)) => {
                Ok(Fetched::Host(HostBuffer::import(&d)?))
            }
            PeerMessage::Descriptor(Descriptor::Cuda(d)) => {
                Ok(Fetched::Cuda(VirtualMemoryBuffer::import(&d)?))
            }
            PeerMessage::Descriptor(Descriptor::Fabric(d)) => {
                Ok(Fetched::Cuda(VirtualMemoryBuffer::import_fabric(&d)?))
            }
            // Too many of its descriptors unread: a typed refusal (see `inflight`).
            PeerMessage::Data(reply) if reply.starts_with(BUSY.as_bytes()) => Err(busy(&reply)),
            // The daemon answers a name it does not serve with text instead of a buffer.
            PeerMessage::Data(reply) => Err(Error::InvalidOption {
                option: "buffer".into(),
                rule: OptionRule::Unknown,
                message: format!("the daemon says: {}", String::from_utf8_lossy(&reply)),
            }),
        }
    }

    /// The daemon's `error: busy: SIZE CAP WHY` as [`Error::LimitExceeded`].
    fn busy(reply: &[u8]) -> Error {
        let text = String::from_utf8_lossy(&reply[BUSY.len()..]).into_owned();
        let mut words = text.splitn(3, ' ');
        let mut number = || words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let (size, cap) = (number(), number());
        Error::LimitExceeded {
            what: format!("the daemon's {}", words.next().unwrap_or("cap")).into(),
            size,
            cap,
            raise: "read the descriptors it already sent, then ask again".into(),
        }
    }

    /// `vmm-client NAME BUFFER [--expect-uid UID] [--check-seed SEED]`: connect (checking the
    /// daemon runs as this uid, or UID), list, fetch BUFFER, check its pattern if asked; the
    /// report is one line starting with `OK`.
    pub fn run(args: &[String]) -> Result<String> {
        let usage = || Error::InvalidOption {
            option: "command line".into(),
            rule: OptionRule::Form,
            message: "usage: vmm-client NAME BUFFER [--expect-uid UID] [--check-seed SEED]".into(),
        };
        let (mut positional, mut expect, mut seed) = (Vec::new(), Allow::same_user(), None);
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--expect-uid" => {
                    let uid = it.next().and_then(|v| v.parse().ok()).ok_or_else(usage)?;
                    expect = Allow::none().uid(uid);
                }
                "--check-seed" => {
                    seed = Some(
                        it.next()
                            .and_then(|v| v.parse::<u8>().ok())
                            .ok_or_else(usage)?,
                    );
                }
                _ => positional.push(arg.clone()),
            }
        }
        let [name, buffer] = positional.as_slice() else {
            return Err(usage());
        };
        let name: Name = name.as_str().into();
        let conn = Session::connect_with(&name, &ConnectOptions::default().expect(expect))?;
        let listing = list(&conn)?;
        let fetched = fetch(&conn, buffer)?;
        let contents = fetched.contents()?;
        if let Some(seed) = seed
            && contents != pattern(seed, contents.len())
        {
            return Err(Error::InvalidOption {
                option: "--check-seed".into(),
                rule: OptionRule::Conflict,
                message: format!(
                    "buffer {buffer}: its contents are not the pattern of seed {seed}"
                ),
            });
        }
        let kind = match fetched {
            Fetched::Host(_) => "host",
            Fetched::Cuda(b) if b.handle_type() == HandleType::Fabric => "cuda-fabric",
            Fetched::Cuda(_) => "cuda",
        };
        Ok(format!(
            "OK {buffer}: {kind}, {} bytes, from daemon {} (lists: {})",
            contents.len(),
            conn.peer(),
            listing.replace('\n', "; ")
        ))
    }
}
