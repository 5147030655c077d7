//! [`Client`]: the Rust client's connection to the service, its requests and replies, and the
//! thread that renews its leases. The connection is the lease (every lease it holds ends when
//! it closes, process death included).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_core::peer::{Descriptor, PeerMessage, Session};
use vmm_core::shm::HostDescriptor;
use vmm_core::wire::endpoint::{ConnectOptions, Name};

use super::keep_alive::{Next, Turn, Turns};
use crate::error::{MemdError, Result};
use crate::protocol::{ChunkDigest, RegionSummary, Request, Response, Status};

/// A connection to the service.
///
/// Its leases are kept alive while it holds any: a thread of this client renews them every
/// third of their TTL (see [`set_keep_alive`](Self::set_keep_alive)). A stopped process stops
/// that thread too, so its leases still end by TTL. Calls take turns with that thread on the
/// connection; [`session`](Self::session) bypasses those turns (use it with renewal off).
#[derive(Debug)]
pub struct Client {
    shared: Arc<Shared>,
    renewer: Mutex<Option<Renewer>>,
}

/// What a client and its renewal thread share.
#[derive(Debug)]
struct Shared {
    session: Session,
    turns: Turns,
}

/// The renewal thread, started by the first lease, and the process that started it (a
/// forked child's copy of the client has no such thread).
#[derive(Debug)]
struct Renewer {
    thread: JoinHandle<()>,
    pid: u32,
}

impl Client {
    /// Connect to the service on `name`, which must run as this process's uid.
    pub fn connect(name: &Name) -> Result<Client> {
        Client::connect_with(name, &ConnectOptions::default())
    }

    /// Connect with `options` (`expect` names the uids the service may run as: the client
    /// checks the service's credentials before it sends anything).
    pub fn connect_with(name: &Name, options: &ConnectOptions) -> Result<Client> {
        let session = Session::connect_with(name, options).map_err(|e| match e {
            vmm_core::Error::Os { ref source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOENT | libc::ECONNREFUSED)
                ) =>
            {
                MemdError::ServiceGone(e.to_string())
            }
            e => e.into(),
        })?;
        Ok(Client {
            shared: Arc::new(Shared {
                session,
                turns: Turns::default(),
            }),
            renewer: Mutex::new(None),
        })
    }

    /// Connect with `options`, trying again every 10 ms for up to `within` while no service
    /// listens ([`MemdError::ServiceGone`]): what a client does after its service died and
    /// is being restarted (its mappings stay valid meanwhile; its leases are gone, attach
    /// again). The last `ServiceGone` when `within` passes.
    pub fn reconnect(name: &Name, options: &ConnectOptions, within: Duration) -> Result<Client> {
        let deadline = std::time::Instant::now() + within;
        loop {
            match Client::connect_with(name, options) {
                Err(MemdError::ServiceGone(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    /// The session, for what this API does not cover (its exchanges do not take turns with
    /// the renewal thread: turn renewal off first, [`set_keep_alive`](Self::set_keep_alive)).
    pub fn session(&self) -> &Session {
        &self.shared.session
    }

    /// Keep this connection's leases alive (the default) or not: with it on, a thread
    /// renews them every third of their TTL while the connection holds any, from the first
    /// attach on; with it off, they end one TTL after the last [`renew`](Self::renew).
    pub fn set_keep_alive(&self, on: bool) {
        self.shared.turns.set_enabled(on);
    }

    /// This call's turn on the connection (held for its whole exchange).
    pub(crate) fn turn(&self) -> Turn<'_> {
        self.shared.turns.call()
    }

    /// A lease with this TTL was taken: renew from now on (the thread starts with the first).
    pub(crate) fn leased(&self, ttl: Duration) {
        if !self.shared.turns.leased(ttl) {
            return;
        }
        let mut renewer = self.renewer.lock().unwrap_or_else(|e| e.into_inner());
        if renewer.is_none() {
            let shared = Arc::clone(&self.shared);
            let spawned = std::thread::Builder::new()
                .name("vmm-memd-renew".into())
                .spawn(move || renew_while_leased(&shared));
            // Without a thread (the process is out of them) leases end by TTL, as with
            // renewal off.
            if let Ok(thread) = spawned {
                *renewer = Some(Renewer {
                    thread,
                    pid: std::process::id(),
                });
            }
        }
    }

    /// Send raw bytes as one request and read the reply: for conformance tests and peers in
    /// other languages that want to see what the service answers to any bytes.
    pub fn request_raw(&self, bytes: &[u8]) -> Result<Response> {
        let _turn = self.turn();
        self.shared.session.send_data(bytes)?;
        self.reply()
    }

    pub(crate) fn request(&self, request: &Request) -> Result<Response> {
        let bytes = postcard::to_allocvec(request)
            .map_err(|e| MemdError::BadReply(format!("encoding a request: {e}")))?;
        match self.request_raw(&bytes)? {
            Response::Refused(refusal) => Err(refusal.into()),
            other => Ok(other),
        }
    }

    pub(crate) fn reply(&self) -> Result<Response> {
        debug_assert!(self.shared.turns.in_call(), "an exchange outside a turn");
        let bytes = self.shared.session.recv_data()?;
        postcard::from_bytes(&bytes).map_err(|e| MemdError::BadReply(e.to_string()))
    }

    pub(crate) fn descriptor(&self, size: u64) -> Result<HostDescriptor> {
        debug_assert!(self.shared.turns.in_call(), "an exchange outside a turn");
        match self.shared.session.recv_message()? {
            PeerMessage::Descriptor(Descriptor::Host(d)) if d.size() as u64 == size => Ok(d),
            PeerMessage::Descriptor(d) => Err(MemdError::BadReply(format!(
                "expected a host descriptor of {size} bytes, got {d:?}"
            ))),
            PeerMessage::Data(_) => Err(MemdError::BadReply(
                "expected a descriptor, got DATA".into(),
            )),
        }
    }

    /// A GPU chunk's descriptor: `CUDA_VMM` with one fd of `size` bytes naming the device
    /// `device` (the UUID the reply before announced); its fd. Anything else is `BadReply`
    /// (its fds closed), as the Python client refuses it too.
    fn gpu_descriptor(&self, size: u64, device: &[u8; 16]) -> Result<OwnedFd> {
        debug_assert!(self.shared.turns.in_call(), "an exchange outside a turn");
        match self.shared.session.recv_message()? {
            PeerMessage::Descriptor(Descriptor::Cuda(d))
                if d.size() as u64 == size
                    && d.chunk_sizes().len() == 1
                    && d.device().is_some_and(|named| &named.uuid == device) =>
            {
                d.into_fds()
                    .pop()
                    .ok_or_else(|| MemdError::BadReply("a CUDA descriptor without its fd".into()))
            }
            PeerMessage::Descriptor(d) => Err(MemdError::BadReply(format!(
                "expected a one-chunk CUDA descriptor of {size} bytes on device {}, got {d:?}",
                vmm_core::cuda::format_uuid(device)
            ))),
            PeerMessage::Data(_) => Err(MemdError::BadReply(
                "expected a descriptor, got DATA".into(),
            )),
        }
    }

    /// The fds of `sizes.len()` GPU chunk descriptors of device `device`.
    pub(crate) fn gpu_descriptors(&self, sizes: &[u64], device: &[u8; 16]) -> Result<Vec<OwnedFd>> {
        sizes
            .iter()
            .map(|&s| self.gpu_descriptor(s, device))
            .collect()
    }

    /// Check `region`'s generation `generation` (`None`: the current one) against the
    /// digests the service took at its commit: the digests, one per chunk (none for a host
    /// region: sealed, it cannot change), or
    /// [`Refusal::DigestMismatch`](crate::Refusal::DigestMismatch) naming the first chunk
    /// that changed (someone wrote it through a writable mapping of its own).
    pub fn verify(&self, region: &str, generation: Option<u64>) -> Result<Vec<ChunkDigest>> {
        let reply = self.request(&Request::Verify {
            region: region.to_owned(),
            generation,
        })?;
        expect_reply!(reply, Response::Verified { digests, .. } => digests)
    }

    /// Regions this process's uid may read.
    pub fn list(&self) -> Result<Vec<RegionSummary>> {
        let reply = self.request(&Request::List)?;
        expect_reply!(reply, Response::List(list) => list)
    }

    /// The service's status as this uid may see it.
    pub fn status(&self) -> Result<Status> {
        let reply = self.request(&Request::Status)?;
        expect_reply!(reply, Response::Status(status) => status)
    }

    /// The service's metrics in the Prometheus text format, as this uid may see them.
    pub fn metrics(&self) -> Result<String> {
        let reply = self.request(&Request::Metrics)?;
        expect_reply!(reply, Response::Metrics(text) => text)
    }

    /// End lease `lease` (as [`detach`](Self::detach) does for an
    /// [`Attached`](crate::Attached)).
    pub fn detach_lease(&self, lease: u64) -> Result<()> {
        self.request(&Request::Detach { lease }).map(drop)
    }

    /// Renew every lease of this connection for another TTL; how many it renewed (leases
    /// that expired are gone: attach again).
    pub fn renew(&self) -> Result<u32> {
        let reply = self.request(&Request::Renew)?;
        expect_reply!(reply, Response::Renewed(n) => n)
    }

    /// Delete `region` (needs the delete right).
    pub fn delete(&self, region: &str) -> Result<()> {
        self.request(&Request::Delete {
            region: region.to_owned(),
        })
        .map(drop)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shared.turns.stop();
        let renewer = self
            .renewer
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(renewer) = renewer.filter(|r| r.pid == std::process::id()) {
            // It ends within one renewal (the connection's own timeout bounds that).
            let _ = renewer.thread.join();
        }
    }
}

/// The renewal thread: renew while the last renewal renewed something (or a lease was
/// taken since), until the client goes. A renewal that fails (the service gone, or a
/// timeout, which leaves the connection out of step with its replies) turns renewal off:
/// the leases end by TTL, as they would without it.
fn renew_while_leased(shared: &Shared) {
    let mut idle = false;
    while let Next::Renew = shared.turns.next(idle) {
        let renewed = renew(&shared.session);
        shared.turns.renewed();
        match renewed {
            Ok(n) => idle = n == 0,
            Err(_) => {
                shared.turns.set_enabled(false);
                idle = true;
            }
        }
    }
}

/// One `Renew` exchange: how many leases it renewed.
fn renew(session: &Session) -> Result<u32> {
    let bytes = postcard::to_allocvec(&Request::Renew)
        .map_err(|e| MemdError::BadReply(format!("encoding a request: {e}")))?;
    session.send_data(&bytes)?;
    let reply = session.recv_data()?;
    match postcard::from_bytes(&reply).map_err(|e| MemdError::BadReply(e.to_string()))? {
        Response::Renewed(n) => Ok(n),
        Response::Refused(refusal) => Err(refusal.into()),
        other => Err(unexpected("Renewed", &other)),
    }
}

/// The value of reply `$reply` if it is the one variant a request expects (`$pattern`, whose
/// bindings `$value` uses), else `BadReply` naming that pattern and what came: the client's
/// one check of a reply's kind (`request` has turned a refusal into its error already).
macro_rules! expect_reply {
    ($reply:expr, $pattern:pat => $value:expr) => {
        match $reply {
            $pattern => Ok($value),
            other => Err($crate::client::connection::unexpected(
                stringify!($pattern),
                &other,
            )),
        }
    };
}
pub(crate) use expect_reply;

pub(crate) fn unexpected(wanted: &str, got: &Response) -> MemdError {
    MemdError::BadReply(format!("expected {wanted}, got {got:?}"))
}
