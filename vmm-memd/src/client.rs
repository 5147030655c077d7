//! [`Client`]: the Rust client. One connection to the service; the connection is the lease
//! (every lease it holds ends when it closes, process death included).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_core::peer::{Descriptor, PeerMessage, Session};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::endpoint::{ConnectOptions, Name};

use crate::error::{MemdError, Result};
use crate::gpu_mapping::GpuChunks;
use crate::keep_alive::{Next, Turn, Turns};
use crate::protocol::{
    Acl, Backend, ChunkDigest, CommitState, REQUEST_META_PAGE_BYTES, RegionSummary, Request,
    Response, Status, TensorMeta, meta_pages,
};

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

/// Options of [`Client::begin`].
#[derive(Debug, Clone, Default)]
pub struct BeginOptions {
    /// The ACL of a region this creates (ignored for an existing region).
    pub acl: Acl,
    /// How long to wait for another writer to finish (the service caps it); zero: do not
    /// wait.
    pub wait: Duration,
    /// Where a region this creates lives (an existing region's must match): host memory
    /// (default; sent as the original `Begin`, which every service speaks) or a GPU.
    pub backend: Backend,
    /// A token naming the generation (16 bytes of the writer's choosing, random: see
    /// [`commit_token`]): after a commit whose reply was lost, [`Client::commit_state`] with
    /// it says whether the generation landed. A token the region knows already is refused
    /// (`InvalidRequest` with rule `Token`) and the generation aborted.
    pub token: Option<[u8; 16]>,
}

/// A fresh commit token: 16 bytes from the kernel's random source (`getrandom`).
pub fn commit_token() -> Result<[u8; 16]> {
    let mut token = [0u8; 16];
    let mut filled = 0;
    while filled < token.len() {
        // SAFETY: the pointer and length are those of the unfilled rest of `token`.
        let n = unsafe {
            libc::getrandom(token[filled..].as_mut_ptr().cast(), token.len() - filled, 0)
        };
        if n < 0 {
            let source = std::io::Error::last_os_error();
            if source.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(MemdError::Os {
                op: "getrandom",
                source,
            });
        }
        filled += n as usize;
    }
    Ok(token)
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

    /// Begin the next generation of `region` with chunks of these sizes: see
    /// [`Writer`].
    pub fn begin(&self, region: &str, chunks: &[u64], options: BeginOptions) -> Result<Writer<'_>> {
        let _turn = self.turn();
        let (acl, wait_ms) = (options.acl, options.wait.as_millis() as u64);
        let (region, chunks_asked) = (region.to_owned(), chunks.to_vec());
        let request = match options.backend {
            Backend::Host => Request::Begin {
                region,
                chunks: chunks_asked,
                acl,
                wait_ms,
            },
            backend => Request::BeginOn {
                region,
                chunks: chunks_asked,
                acl,
                wait_ms,
                backend,
            },
        };
        let reply = self.request(&request)?;
        let (generation, buffers, gpu) = match reply {
            Response::Began {
                generation,
                chunks: sizes,
            } if options.backend == Backend::Host => {
                (generation, self.writable_host(chunks, sizes)?, None)
            }
            Response::BeganGpu {
                generation,
                chunks: sizes,
                device,
                fabric,
            } if options.backend == (Backend::Gpu { uuid: device }) => (
                generation,
                Vec::new(),
                Some(self.writable_gpu(chunks, &sizes, device, fabric)?),
            ),
            other => return Err(unexpected("Began", &other)),
        };
        let writer = Writer {
            client: self,
            generation,
            chunks: buffers,
            gpu,
            meta: Vec::new(),
            finished: false,
        };
        if let Some(token) = options.token {
            // Refused: the writer's drop aborts the generation.
            self.request(&Request::Token { token })?;
        }
        Ok(writer)
    }

    /// What became of `region`'s generation named `token` ([`BeginOptions::token`]): landed
    /// (as which generation), pending (its writer's connection is open and has not
    /// committed: ask again once it has ended), or unknown (it did not land). Needs the
    /// region's write right.
    pub fn commit_state(&self, region: &str, token: [u8; 16]) -> Result<CommitState> {
        let reply = self.request(&Request::CommitState {
            region: region.to_owned(),
            token,
        })?;
        expect_reply!(reply, Response::CommitState(state) => state)
    }

    /// Map a pending host generation's chunks writable.
    fn writable_host(&self, chunks: &[u64], sizes: Vec<u64>) -> Result<Vec<HostBuffer>> {
        if sizes != chunks {
            return Err(MemdError::BadReply(format!(
                "asked for chunks {chunks:?}, the service announced {sizes:?}"
            )));
        }
        let mut buffers = Vec::with_capacity(sizes.len());
        for size in sizes {
            let buffer = self
                .descriptor(size)
                .and_then(|d| HostBuffer::import(&d).map_err(MemdError::from));
            match buffer {
                Ok(buffer) => buffers.push(buffer),
                Err(e) => return Err(self.abandon(e)),
            }
        }
        Ok(buffers)
    }

    /// Map a pending GPU generation's chunks writable (sizes rounded up by the service).
    fn writable_gpu(
        &self,
        chunks: &[u64],
        sizes: &[u64],
        device: [u8; 16],
        fabric: bool,
    ) -> Result<GpuChunks> {
        if sizes.len() != chunks.len() || sizes.iter().zip(chunks).any(|(s, c)| s < c) {
            return Err(MemdError::BadReply(format!(
                "asked for chunks {chunks:?}, the service announced {sizes:?}"
            )));
        }
        self.gpu_descriptors(sizes, &device)
            .and_then(|fds| GpuChunks::import(device, &fds, sizes, (false, fabric)))
            .map_err(|e| self.abandon(e))
    }

    /// Best effort after a begin failed here: give the generation back (the connection's end
    /// would too).
    fn abandon(&self, e: MemdError) -> MemdError {
        if !matches!(e, MemdError::ServiceGone(_)) {
            let _ = self.request(&Request::Abort);
        }
        e
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

    /// Commit this connection's pending generation again, after a commit refused with
    /// [`Refusal::StillMapped`](crate::Refusal::StillMapped) (once the stray mapping is gone).
    ///
    /// The reply is waited for past the connection's timeout: a commit that the service
    /// carries out lands whether or not this client still listens, so giving up on its reply
    /// would report a failure for a generation that became current. The wait ends with the
    /// reply, a refusal, or [`MemdError::ServiceGone`] (the service died: whether the
    /// generation landed is then unknown until the region is read again).
    pub fn commit_pending(&self) -> Result<u64> {
        let _turn = self.turn();
        let bytes = postcard::to_allocvec(&Request::Commit)
            .map_err(|e| MemdError::BadReply(format!("encoding a request: {e}")))?;
        self.shared.session.send_data(&bytes)?;
        let reply = loop {
            match self.reply() {
                Err(MemdError::Core(vmm_core::Error::Timeout { .. })) => continue,
                other => break other?,
            }
        };
        match reply {
            Response::Committed { generation } => Ok(generation),
            Response::Refused(refusal) => Err(refusal.into()),
            other => Err(unexpected("Committed", &other)),
        }
    }

    /// Abort this connection's pending generation (after a refused commit).
    pub fn abort_pending(&self) -> Result<()> {
        self.request(&Request::Abort).map(drop)
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
            other => Err($crate::client::unexpected(stringify!($pattern), &other)),
        }
    };
}
pub(crate) use expect_reply;

pub(crate) fn unexpected(wanted: &str, got: &Response) -> MemdError {
    MemdError::BadReply(format!("expected {wanted}, got {got:?}"))
}

/// A pending generation: its chunks mapped writable in this process. Fill them, describe
/// them with [`put`](Self::put), then [`commit`](Self::commit). Dropped without commit, it is
/// aborted (and the service frees it if this process dies first).
///
/// Commit unmaps the chunks here, then the service seals them against writes; a clone of a
/// chunk's `HostBuffer` kept elsewhere keeps a writable mapping, and the commit is refused
/// with [`Refusal::StillMapped`](crate::Refusal::StillMapped).
#[derive(Debug)]
pub struct Writer<'c> {
    client: &'c Client,
    generation: u64,
    chunks: Vec<HostBuffer>,
    gpu: Option<GpuChunks>,
    meta: Vec<(String, TensorMeta)>,
    finished: bool,
}

impl Writer<'_> {
    /// The generation this writes.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Chunk `index` of a host region, mapped writable (a GPU region has none: see
    /// [`gpu`](Self::gpu)). Panics past the last chunk.
    pub fn chunk(&self, index: usize) -> &HostBuffer {
        &self.chunks[index]
    }

    /// All chunks of a host region (empty for a GPU region).
    pub fn chunks(&self) -> &[HostBuffer] {
        &self.chunks
    }

    /// A GPU region's chunks, mapped writable on their device, back to back (`None` for a
    /// host region). Fill them with `buffer().write_at(chunk_offset(i) + offset, bytes)`.
    pub fn gpu(&self) -> Option<&GpuChunks> {
        self.gpu.as_ref()
    }

    /// Describe a tensor (sent at commit; the service checks it lies inside its chunk).
    pub fn put(&mut self, key: &str, meta: TensorMeta) {
        self.meta.push((key.to_owned(), meta));
    }

    /// Unmap, send the metadata, and commit: the generation becomes current, read-only for
    /// everyone (host: sealed by the kernel; GPU: the service takes each chunk's digest,
    /// which [`Client::verify`] checks later, and readers of our client map it read-only).
    /// Returns its number.
    ///
    /// Metadata the service refuses aborts the generation (the refusal is returned). A commit
    /// refused with [`Refusal::StillMapped`](crate::Refusal::StillMapped) leaves it pending:
    /// drop the stray mapping and [`Client::commit_pending`], or [`Client::abort_pending`].
    pub fn commit(mut self) -> Result<u64> {
        let client = self.client;
        let _turn = client.turn();
        self.finished = true;
        self.chunks.clear();
        // The GPU mapping goes before the commit, whose digests then see the final bytes.
        self.gpu = None;
        for page in meta_pages(&std::mem::take(&mut self.meta), REQUEST_META_PAGE_BYTES) {
            if let Err(e) = self.client.request(&Request::PutMeta(page)) {
                if matches!(e, MemdError::Refused(_)) {
                    let _ = self.client.request(&Request::Abort);
                }
                return Err(e);
            }
        }
        self.client.commit_pending()
    }

    /// Free the generation now.
    pub fn abort(mut self) -> Result<()> {
        let client = self.client;
        let _turn = client.turn();
        self.finished = true;
        self.chunks.clear();
        self.gpu = None;
        self.client.request(&Request::Abort).map(drop)
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let client = self.client;
            let _turn = client.turn();
            self.chunks.clear();
            self.gpu = None;
            let _ = client.request(&Request::Abort);
        }
    }
}
