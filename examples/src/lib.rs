//! A memory-owner daemon and its clients: the shape of a weight or KV-cache service whose
//! workers were started by someone else (a scheduler, a Python launcher) and connect by name.
//!
//! - [`Daemon`] owns named buffers (CUDA VMM buffers where there is a GPU, host memfd buffers
//!   elsewhere) and serves them on a [`Listener`]: one thread per connection, each bounded by
//!   the connection's timeout, so a client that connects and says nothing delays no one; at
//!   most [`Daemon::max_connections`] at once (default [`DEFAULT_MAX_CONNECTIONS`]), and
//!   running out of fds (or threads) pauses accepting instead of ending the daemon.
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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vmm_core::cuda::{HandleType, VirtualMemoryBuffer};
use vmm_core::peer::{Descriptor, Session};
use vmm_core::shm::HostBuffer;
use vmm_core::wire::endpoint::Listener;
use vmm_core::{Error, Result};

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

/// How long [`Daemon::serve`] pauses accepting when the process is out of fds (`EMFILE`,
/// `ENFILE`) or cannot start a thread: 50 ms.
pub const RESOURCE_BACKOFF: Duration = Duration::from_millis(50);

/// The daemon: named buffers, served to whoever the listener admits.
#[derive(Debug)]
pub struct Daemon {
    buffers: BTreeMap<String, Served>,
    served: AtomicUsize,
    max_connections: usize,
}

impl Default for Daemon {
    fn default() -> Self {
        Daemon {
            buffers: BTreeMap::new(),
            served: AtomicUsize::new(0),
            max_connections: DEFAULT_MAX_CONNECTIONS,
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

    /// The most connections it serves at once (each on its own thread, holding one fd);
    /// further clients wait in the listener's backlog until one ends (their `connect` timeout
    /// bounds that wait).
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Set [`max_connections`](Self::max_connections) (at least 1).
    pub fn set_max_connections(&mut self, max: usize) {
        self.max_connections = max.max(1);
    }

    /// Serve `buffer` as `name`.
    pub fn add(&mut self, name: &str, buffer: Served) {
        self.buffers.insert(name.to_owned(), buffer);
    }

    /// How many descriptors it has sent.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::Relaxed)
    }

    /// Accept connections until `stop` is set (checked every 100 ms), each served on its own
    /// thread, at most [`max_connections`](Self::max_connections) at once; returns once every
    /// connection thread has ended (each within its connection's timeout). Errors of one
    /// connection end that connection only (they are logged). Running out of fds
    /// ([`out_of_fds`]) or threads pauses accepting for [`RESOURCE_BACKOFF`] (logged once per
    /// episode) and goes on: clients wait in the backlog meanwhile. Other accept errors end it.
    pub fn serve(&self, listener: &Listener, stop: &AtomicBool) -> Result<()> {
        let active = AtomicUsize::new(0);
        let mut short_since: Option<Instant> = None;
        std::thread::scope(|scope| {
            while !stop.load(Ordering::Relaxed) {
                if active.load(Ordering::Acquire) >= self.max_connections {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                let conn = match Session::accept(listener, Some(Duration::from_millis(100))) {
                    Ok(conn) => conn,
                    Err(Error::Timeout { .. }) => continue,
                    Err(e) if out_of_fds(&e) => {
                        pause(&mut short_since, &format!("out of fds ({e})"), &active);
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                if let Some(since) = short_since.take() {
                    eprintln!("vmm-daemon: accepting again after {:?}", since.elapsed());
                }
                active.fetch_add(1, Ordering::AcqRel);
                let active = &active;
                let started = std::thread::Builder::new()
                    .name("vmm-daemon-conn".into())
                    .spawn_scoped(scope, move || {
                        let peer = conn.peer();
                        if let Err(e) = self.handle(&conn) {
                            eprintln!("vmm-daemon: connection from {peer}: {e}");
                        }
                        drop(conn);
                        active.fetch_sub(1, Ordering::AcqRel);
                    });
                if let Err(e) = started {
                    // The connection (moved into the closure) is closed with it.
                    active.fetch_sub(1, Ordering::AcqRel);
                    pause(
                        &mut short_since,
                        &format!("cannot start a connection thread ({e})"),
                        active,
                    );
                }
            }
            Ok(())
        })
    }

    /// Answer one connection's requests until it hangs up (or stays silent past its timeout).
    pub fn handle(&self, conn: &Session) -> Result<()> {
        loop {
            let request = match conn.recv_data() {
                Ok(request) => request,
                Err(Error::Disconnected(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            let request = String::from_utf8_lossy(&request);
            let mut words = request.split_whitespace();
            match (words.next(), words.next()) {
                (Some("list"), None) => {
                    let lines: Vec<String> = self
                        .buffers
                        .iter()
                        .map(|(name, b)| format!("{name} {} {}", b.kind(), b.size()))
                        .collect();
                    conn.send_data(lines.join("\n").as_bytes())?;
                }
                (Some("get"), Some(name)) => match self.buffers.get(name) {
                    Some(buffer) => {
                        let descriptor = buffer.export()?;
                        conn.send_descriptor(&descriptor)?;
                        self.served.fetch_add(1, Ordering::Relaxed);
                    }
                    None => conn.send_data(format!("error: no buffer named {name}").as_bytes())?,
                },
                _ => conn.send_data(format!("error: unknown request {request:?}").as_bytes())?,
            }
        }
    }
}

/// Pause accepting for [`RESOURCE_BACKOFF`], saying so once per episode of shortage.
fn pause(short_since: &mut Option<Instant>, what: &str, active: &AtomicUsize) {
    if short_since.is_none() {
        eprintln!(
            "vmm-daemon: {what}; pausing new connections until some end ({} open)",
            active.load(Ordering::Relaxed)
        );
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
    /// [NAME]`: own one buffer, `weights` (a CUDA VMM buffer of two chunks with `--gpu`, served
    /// by fabric handle with `--fabric`, else by POSIX fd; a host memfd buffer of BYTES, default
    /// 4 MiB, without `--gpu`), filled with the examples' pattern of seed 7, and
    /// serve it on NAME (default `@vmm-ipc-daemon`) until SIGINT or SIGTERM, to at most N
    /// connections at once (default [`DEFAULT_MAX_CONNECTIONS`]).
    pub fn run(args: &[String]) -> Result<()> {
        let usage = |what: &str| Error::InvalidOption {
            option: "command line".into(),
            message: format!("vmm-daemon: {what}"),
        };
        let mut args = args.iter();
        let (mut gpu, mut size, mut allow, mut name) = (false, 4 << 20, Allow::same_user(), None);
        let (mut max, mut fabric) = (DEFAULT_MAX_CONNECTIONS, false);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--gpu" => gpu = true,
                "--fabric" => fabric = true,
                "--size" => {
                    size = args
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| usage("--size BYTES"))?
                }
                "--allow-uid" => {
                    allow = allow.uid(
                        args.next()
                            .and_then(|v| v.parse().ok())
                            .ok_or_else(|| usage("--allow-uid UID"))?,
                    )
                }
                "--max-connections" => {
                    max = args
                        .next()
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| usage("--max-connections N"))?
                }
                other => name = Some(other.to_owned()),
            }
        }
        let name: Name = name.as_deref().unwrap_or("@vmm-ipc-daemon").into();
        let mut daemon = Daemon::new();
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
            // The daemon answers a name it does not serve with text instead of a buffer.
            PeerMessage::Data(reply) => Err(Error::InvalidOption {
                option: "buffer".into(),
                message: format!("the daemon says: {}", String::from_utf8_lossy(&reply)),
            }),
        }
    }

    /// `vmm-client NAME BUFFER [--expect-uid UID] [--check-seed SEED]`: connect (checking the
    /// daemon runs as this uid, or UID), list, fetch BUFFER, check its pattern if asked; the
    /// report is one line starting with `OK`.
    pub fn run(args: &[String]) -> Result<String> {
        let usage = || Error::InvalidOption {
            option: "command line".into(),
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
