//! [`Client`]: the Rust client. One connection to the service; the connection is the lease
//! (every lease it holds ends when it closes, process death included).

use std::collections::BTreeMap;
use std::time::Duration;

use vmm_core::peer::{Descriptor, PeerMessage, Session};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::endpoint::{ConnectOptions, Name};

use crate::error::{MemdError, Result};
use crate::mapping::ReadOnlyChunk;
use crate::protocol::{
    Acl, MAX_CHUNKS, MAX_META_ENTRIES, RegionSummary, Request, Response, Status, TensorMeta,
    meta_pages,
};
use crate::sleep::{Placement, layout_hash};

/// A connection to the service.
#[derive(Debug)]
pub struct Client {
    session: Session,
}

/// Options of [`Client::begin`].
#[derive(Debug, Clone, Default)]
pub struct BeginOptions {
    /// The ACL of a region this creates (ignored for an existing region).
    pub acl: Acl,
    /// How long to wait for another writer to finish (the service caps it); zero: do not
    /// wait.
    pub wait: Duration,
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
        Ok(Client { session })
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

    /// The session, for what this API does not cover.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Send raw bytes as one request and read the reply: for conformance tests and peers in
    /// other languages that want to see what the service answers to any bytes.
    pub fn request_raw(&self, bytes: &[u8]) -> Result<Response> {
        self.session.send_data(bytes)?;
        self.reply()
    }

    fn request(&self, request: &Request) -> Result<Response> {
        let bytes = postcard::to_allocvec(request)
            .map_err(|e| MemdError::BadReply(format!("encoding a request: {e}")))?;
        match self.request_raw(&bytes)? {
            Response::Refused(refusal) => Err(refusal.into()),
            other => Ok(other),
        }
    }

    fn reply(&self) -> Result<Response> {
        let bytes = self.session.recv_data()?;
        postcard::from_bytes(&bytes).map_err(|e| MemdError::BadReply(e.to_string()))
    }

    fn descriptor(&self, size: u64) -> Result<HostDescriptor> {
        match self.session.recv_message()? {
            PeerMessage::Descriptor(Descriptor::Host(d)) if d.size() as u64 == size => Ok(d),
            PeerMessage::Descriptor(d) => Err(MemdError::BadReply(format!(
                "expected a host descriptor of {size} bytes, got {d:?}"
            ))),
            PeerMessage::Data(_) => Err(MemdError::BadReply(
                "expected a descriptor, got DATA".into(),
            )),
        }
    }

    /// Regions this process's uid may read.
    pub fn list(&self) -> Result<Vec<RegionSummary>> {
        match self.request(&Request::List)? {
            Response::List(list) => Ok(list),
            other => Err(unexpected("List", &other)),
        }
    }

    /// The service's status as this uid may see it.
    pub fn status(&self) -> Result<Status> {
        match self.request(&Request::Status)? {
            Response::Status(status) => Ok(status),
            other => Err(unexpected("Status", &other)),
        }
    }

    /// The service's metrics in the Prometheus text format, as this uid may see them.
    pub fn metrics(&self) -> Result<String> {
        match self.request(&Request::Metrics)? {
            Response::Metrics(text) => Ok(text),
            other => Err(unexpected("Metrics", &other)),
        }
    }

    /// Begin the next generation of `region` with chunks of these sizes: see
    /// [`Writer`].
    pub fn begin(&self, region: &str, chunks: &[u64], options: BeginOptions) -> Result<Writer<'_>> {
        let reply = self.request(&Request::Begin {
            region: region.to_owned(),
            chunks: chunks.to_vec(),
            acl: options.acl,
            wait_ms: options.wait.as_millis() as u64,
        })?;
        let Response::Began {
            generation,
            chunks: sizes,
        } = reply
        else {
            return Err(unexpected("Began", &reply));
        };
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
                Err(e) => {
                    // Best effort: give the generation back (the connection's end would too).
                    if !matches!(e, MemdError::ServiceGone(_)) {
                        let _ = self.request(&Request::Abort);
                    }
                    return Err(e);
                }
            }
        }
        Ok(Writer {
            client: self,
            generation,
            chunks: buffers,
            meta: Vec::new(),
            finished: false,
        })
    }

    /// Attach `region`'s current committed generation: a lease (held by this connection),
    /// its metadata, and its chunks mapped read-only.
    pub fn attach(&self, region: &str) -> Result<Attached> {
        self.attach_generation(region, None)
    }

    /// [`attach`](Self::attach) generation `generation` (`None`: the current one), if the
    /// service still holds it (a lease or the retention setting keeps it).
    pub fn attach_generation(&self, region: &str, generation: Option<u64>) -> Result<Attached> {
        self.attach_placed(region, generation, &mut None)
    }

    /// Attach; with `place`, only a generation of its layout, mapped at its reservations
    /// (which come back in `place` when it fails, and are used up when it succeeds).
    pub(crate) fn attach_placed(
        &self,
        region: &str,
        generation: Option<u64>,
        place: &mut Option<Placement>,
    ) -> Result<Attached> {
        let reply = self.request(&Request::Attach {
            region: region.to_owned(),
            generation,
        })?;
        let Response::Attached {
            lease,
            generation,
            chunks,
            meta_pages,
            ttl_ms,
        } = reply
        else {
            return Err(unexpected("Attached", &reply));
        };
        if chunks.len() > MAX_CHUNKS || meta_pages as usize > MAX_META_ENTRIES {
            return Err(MemdError::BadReply(format!(
                "{} chunks and {meta_pages} metadata pages announced",
                chunks.len()
            )));
        }
        let mut meta = BTreeMap::new();
        for _ in 0..meta_pages {
            match self.reply()? {
                Response::MetaPage(entries) if meta.len() + entries.len() <= MAX_META_ENTRIES => {
                    meta.extend(entries)
                }
                other => return Err(unexpected("MetaPage", &other)),
            }
        }
        if let Some(p) = place.as_ref() {
            let found = layout_hash(&chunks, &meta);
            if found != p.layout {
                // Read the descriptors (closing them) to stay in step, and give the lease up.
                for &size in &chunks {
                    self.descriptor(size)?;
                }
                let _ = self.request(&Request::Detach { lease });
                return Err(MemdError::StaleLayout {
                    region: region.to_owned(),
                    generation,
                    expected: p.layout,
                    found,
                });
            }
        }
        let mut mapped = Vec::with_capacity(chunks.len());
        let mut spare = place
            .as_mut()
            .map(|p| std::mem::take(&mut p.reservations).into_iter());
        for (i, &size) in chunks.iter().enumerate() {
            let chunk = self.descriptor(size).and_then(|descriptor| {
                let fd = descriptor
                    .fd()
                    .ok_or_else(|| MemdError::BadReply("an empty chunk".into()))?;
                match spare.as_mut().map(|s| s.next()) {
                    None => ReadOnlyChunk::map(fd, size as usize),
                    Some(Some(r)) => {
                        ReadOnlyChunk::map_into(fd, size as usize, r).map_err(|(e, r)| {
                            // Back where it was, for the rest to follow it.
                            if let Some(p) = place.as_mut() {
                                p.reservations.push(r);
                            }
                            e
                        })
                    }
                    Some(None) => Err(MemdError::BadReply(format!("no reservation for chunk {i}"))),
                }
            });
            match chunk {
                Ok(chunk) => mapped.push(chunk),
                Err(e) => {
                    if let (Some(p), Some(rest)) = (place.as_mut(), spare.take()) {
                        // The reservations in order: the mapped ones given up again, the
                        // failed one (pushed above), the rest.
                        let failed = std::mem::take(&mut p.reservations);
                        p.reservations = mapped
                            .drain(..)
                            .filter_map(|c: ReadOnlyChunk| c.into_reservation().ok())
                            .chain(failed)
                            .chain(rest)
                            .collect();
                    }
                    // Best effort: the lease is of no use. (The rest of the reply, if any,
                    // is not read: the connection is out of step, drop it.)
                    if matches!(e, MemdError::BadDescriptor(_) | MemdError::Os { .. }) {
                        let _ = self.request(&Request::Detach { lease });
                    }
                    return Err(e);
                }
            }
        }
        Ok(Attached {
            region: region.to_owned(),
            lease,
            generation,
            chunks: mapped,
            meta,
            ttl: Duration::from_millis(ttl_ms),
        })
    }

    /// End the lease of `attached` (its mapping stays valid: see [`Attached`]).
    pub fn detach(&self, attached: &Attached) -> Result<()> {
        self.detach_lease(attached.lease)
    }

    pub(crate) fn detach_lease(&self, lease: u64) -> Result<()> {
        self.request(&Request::Detach { lease }).map(drop)
    }

    /// Renew every lease of this connection for another TTL; how many it renewed (leases
    /// that expired are gone: attach again).
    pub fn renew(&self) -> Result<u32> {
        match self.request(&Request::Renew)? {
            Response::Renewed(n) => Ok(n),
            other => Err(unexpected("Renewed", &other)),
        }
    }

    /// Commit this connection's pending generation again, after a commit refused with
    /// [`Refusal::StillMapped`](crate::Refusal::StillMapped) (once the stray mapping is gone).
    pub fn commit_pending(&self) -> Result<u64> {
        match self.request(&Request::Commit)? {
            Response::Committed { generation } => Ok(generation),
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

fn unexpected(wanted: &str, got: &Response) -> MemdError {
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
    meta: Vec<(String, TensorMeta)>,
    finished: bool,
}

impl Writer<'_> {
    /// The generation this writes.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Chunk `index`, mapped writable.
    pub fn chunk(&self, index: usize) -> &HostBuffer {
        &self.chunks[index]
    }

    /// All chunks.
    pub fn chunks(&self) -> &[HostBuffer] {
        &self.chunks
    }

    /// Describe a tensor (sent at commit; the service checks it lies inside its chunk).
    pub fn put(&mut self, key: &str, meta: TensorMeta) {
        self.meta.push((key.to_owned(), meta));
    }

    /// Unmap, send the metadata, and commit: the generation becomes current, read-only for
    /// everyone. Returns its number.
    ///
    /// Metadata the service refuses aborts the generation (the refusal is returned). A commit
    /// refused with [`Refusal::StillMapped`](crate::Refusal::StillMapped) leaves it pending:
    /// drop the stray mapping and [`Client::commit_pending`], or [`Client::abort_pending`].
    pub fn commit(mut self) -> Result<u64> {
        self.finished = true;
        self.chunks.clear();
        for page in meta_pages(&std::mem::take(&mut self.meta)) {
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
        self.finished = true;
        self.chunks.clear();
        self.client.request(&Request::Abort).map(drop)
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.chunks.clear();
            let _ = self.client.request(&Request::Abort);
        }
    }
}

/// A committed generation attached: a lease, the metadata, the chunks mapped read-only.
///
/// The lease is the service's count of this reader: it ends with [`Client::detach`], with the
/// connection (this process's exit included), or when its TTL runs out without
/// [`Client::renew`]. Expiry only stops the service counting this reader (a retired
/// generation may then be freed by the service and its quota given back); the mapping here
/// stays valid and unchanged, because the kernel keeps the pages while any mapping holds them.
#[derive(Debug)]
pub struct Attached {
    /// The region.
    pub region: String,
    /// The lease number.
    pub lease: u64,
    /// The generation.
    pub generation: u64,
    /// The chunks, mapped read-only.
    pub chunks: Vec<ReadOnlyChunk>,
    /// The metadata.
    pub meta: BTreeMap<String, TensorMeta>,
    /// The lease's TTL.
    pub ttl: Duration,
}

impl Attached {
    /// The bytes of tensor `key`.
    pub fn tensor(&self, key: &str) -> Option<&[u8]> {
        let meta = self.meta.get(key)?;
        let chunk = self.chunks.get(meta.chunk as usize)?.as_slice();
        let start = usize::try_from(meta.offset).ok()?;
        let end = start.checked_add(usize::try_from(meta.len).ok()?)?;
        chunk.get(start..end)
    }
}
