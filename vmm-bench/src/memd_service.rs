//! The service side of the `host-memd` figures: a `vmm-memd` process the bench starts and
//! stops, and, in that same process, the raw floor's responder.
//!
//! Why a child process and not `vmm_memd::Service` on a thread of the bench: the service is
//! meant to run as its own program (`vmm-memd`, with its keeper), and what a client pays is a
//! round trip to another process, whose scheduling and address space are not the client's (a
//! thread would share the bench's `mmap` lock with the client's own mappings). The floor must
//! cross the same boundary, so it is served by the same process: "a plain `SCM_RIGHTS` memfd
//! hand-off over a Unix socket between the same processes".
//!
//! The child is this bench executable re-run with [`crate::BASELINE_VAR`]` =`
//! [`SERVICE_ROLE`] and the `vmm-memd` command line: [`service_main`] runs
//! `vmm_memd::cli::main` with it, exactly what the `vmm-memd` binary runs (the way the
//! crate's tests play the service). The variable is inherited, so the keeper the service
//! starts from its own executable (`--keeper NAME`) is this executable playing `vmm-memd`
//! too. Before serving, the child starts the raw responder on the abstract name in
//! [`RAW_VAR`]: a plain `SOCK_STREAM` listener, one thread per connection, no credentials,
//! no framing beyond the two bytes of a request (see [`RawOp`]).

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::signal::{Signal, kill};
use nix::unistd::{Pid, ftruncate};
use vmm_core::wire::endpoint::Name;
use vmm_memd::Client;

use crate::{BASELINE_VAR, raw};

/// [`crate::BASELINE_VAR`]'s value that makes this executable play `vmm-memd`.
pub const SERVICE_ROLE: &str = "memd-service";

/// The abstract socket name the child's raw responder listens on.
pub const RAW_VAR: &str = "VMM_BENCH_MEMD_RAW";

/// The size of every chunk in the `host-memd` figures: 1 MiB.
pub const CHUNK: usize = 1 << 20;

/// The most chunks one raw request hands over (the responder holds this many memfds).
pub const RAW_CHUNKS: usize = 16;

/// The raw responder's requests: two bytes, the operation and a chunk count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RawOp {
    /// Send `k` of the responder's memfds, one `sendmsg` each (8-byte size + `SCM_RIGHTS`),
    /// as the service sends one descriptor message per chunk.
    Hand = 1,
    /// Make `k` fresh memfds (sealed against shrinking and growing, as the service's
    /// pending chunks) and send them the same way; keep them for [`RawOp::Seal`].
    Prepare = 2,
    /// Seal the prepared memfds against writes (`F_SEAL_WRITE | F_SEAL_FUTURE_WRITE |
    /// F_SEAL_SEAL`, as the service's commit does), reply one byte, then close them.
    Seal = 3,
}

/// In a child started with [`SERVICE_ROLE`]: serve the raw floor (when [`RAW_VAR`] is set)
/// and run `vmm-memd` with this process's arguments; the exit status.
pub fn service_main() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--keeper") {
        return vmm_memd::cli::main(&args);
    }
    if let Ok(name) = std::env::var(RAW_VAR) {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("raw address");
        let listener = UnixListener::bind_addr(&addr).expect("bind the raw responder");
        std::thread::spawn(move || raw_accept(listener));
    }
    vmm_memd::cli::main(&args)
}

fn raw_accept(listener: UnixListener) {
    let shared: Arc<Vec<OwnedFd>> =
        Arc::new((0..RAW_CHUNKS).map(|_| raw::sealed_memfd(CHUNK)).collect());
    for stream in listener.incoming().flatten() {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || raw_serve(stream, &shared));
    }
}

/// A memfd of [`CHUNK`] bytes that can still be sealed against writes.
fn sealable_memfd() -> OwnedFd {
    let fd = memfd_create(
        c"vmm-bench-raw-pending",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .expect("memfd_create");
    ftruncate(&fd, CHUNK as i64).expect("ftruncate");
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
    )
    .expect("F_ADD_SEALS");
    fd
}

fn raw_serve(mut stream: UnixStream, shared: &[OwnedFd]) {
    let mut pending: Vec<OwnedFd> = Vec::new();
    let mut request = [0u8; 2];
    while stream.read_exact(&mut request).is_ok() {
        let k = usize::from(request[1]).min(RAW_CHUNKS);
        match request[0] {
            op if op == RawOp::Hand as u8 => {
                for fd in &shared[..k] {
                    raw::send_fd(stream.as_fd(), fd.as_fd(), CHUNK);
                }
            }
            op if op == RawOp::Prepare as u8 => {
                pending = (0..k).map(|_| sealable_memfd()).collect();
                for fd in &pending {
                    raw::send_fd(stream.as_fd(), fd.as_fd(), CHUNK);
                }
            }
            op if op == RawOp::Seal as u8 => {
                // Two calls, as the service's commit makes them: the write seal (which waits
                // for pinned pages), then the future-write seal and the seal seal.
                let rest = SealFlag::F_SEAL_FUTURE_WRITE | SealFlag::F_SEAL_SEAL;
                for fd in &pending {
                    fcntl(fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_WRITE))
                        .expect("seal against writes");
                    fcntl(fd, FcntlArg::F_ADD_SEALS(rest)).expect("seal future writes");
                }
                raw::ack(stream.as_fd());
                pending.clear();
            }
            _ => return,
        }
    }
}

/// Send one raw request.
pub fn raw_request(stream: &UnixStream, op: RawOp, k: usize) {
    (&*stream)
        .write_all(&[op as u8, k as u8])
        .expect("raw request");
}

/// The `vmm-memd` child (its keeper with it): started and waited for by [`start`], stopped
/// with SIGTERM (the service lets its keeper go) and reaped on drop; [`restart`] kills it
/// (SIGKILL) and starts it again on the same socket, where its keeper hands back what it held.
///
/// [`start`]: ServiceProcess::start
/// [`restart`]: ServiceProcess::restart
#[derive(Debug)]
pub struct ServiceProcess {
    child: Child,
    /// The service's socket, as its command line names it (`@NAME`).
    pub socket: String,
    /// The service's socket.
    pub name: Name,
    /// The raw responder's address.
    pub raw: SocketAddr,
    raw_name: String,
    quota: u64,
}

/// How long the keeper waits for a service after its own has gone (`--keeper-linger-ms`): a
/// [`ServiceProcess::restart`] comes well within it; after the bench, the keeper of a service
/// that did not stop cleanly lets its memory go this long after.
pub const KEEPER_LINGER: Duration = Duration::from_secs(5);

impl ServiceProcess {
    /// Start the service (quota 64 GiB; connection caps raised for the 64-reader figure) and
    /// wait until both it and the raw responder answer.
    pub fn start() -> ServiceProcess {
        ServiceProcess::start_with_quota(64 << 30)
    }

    /// [`start`](Self::start) with each uid's quota `quota` bytes (the GPU figures hold
    /// more than 64 GiB).
    pub fn start_with_quota(quota: u64) -> ServiceProcess {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let socket = format!("@vmm-bench-memd-{tag}");
        let raw_name = format!("vmm-bench-memd-raw-{tag}");
        let child = spawn_service(&socket, &raw_name, quota);
        let raw = SocketAddr::from_abstract_name(raw_name.as_bytes()).expect("raw address");
        let service = ServiceProcess {
            child,
            name: Name::from(socket.as_str()),
            socket,
            raw,
            raw_name,
            quota,
        };
        service.wait_up();
        service
    }

    /// Wait until both the service and the raw responder answer.
    fn wait_up(&self) {
        let deadline = Instant::now() + crate::CHILD_WAIT;
        while Client::connect(&self.name).is_err() || UnixStream::connect_addr(&self.raw).is_err() {
            assert!(Instant::now() < deadline, "vmm-memd did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kill the service with SIGKILL (a crash: its keeper stays, holding every committed
    /// generation), reap it, and start it again on the same socket with the same command
    /// line; the time from the kill until a client connected to the new one (which has
    /// taken back what the keeper held by then: it does so before it serves). Connections
    /// to the old service are dead: connect again.
    pub fn restart(&mut self) -> Duration {
        let t = Instant::now();
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_service(&self.socket, &self.raw_name, self.quota);
        self.wait_up();
        t.elapsed()
    }

    /// A connection to the raw responder.
    pub fn raw_connect(&self) -> UnixStream {
        UnixStream::connect_addr(&self.raw).expect("connect to the raw responder")
    }
}

/// This executable playing `vmm-memd` on `socket`, with the raw responder on `raw_name`.
fn spawn_service(socket: &str, raw_name: &str, quota: u64) -> Child {
    let exe = std::env::current_exe().expect("the bench executable");
    Command::new(exe)
        .env(BASELINE_VAR, SERVICE_ROLE)
        .env(RAW_VAR, raw_name)
        .args(["--socket", socket, "--quota-bytes", &quota.to_string()])
        .args([
            "--max-connections",
            "4096",
            "--max-connections-per-uid",
            "2048",
        ])
        .args(["--keeper-linger-ms", &KEEPER_LINGER.as_millis().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start vmm-memd")
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(pid, Signal::SIGTERM);
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
    }
}
