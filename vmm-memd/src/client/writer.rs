//! [`Client::begin`] and the [`Writer`] it gives: a pending generation mapped writable here,
//! described, then committed (or aborted); and the commit's token and its state after a lost
//! reply.

use std::time::Duration;

use vmm_core::shm::HostBuffer;

use super::connection::{Client, expect_reply, unexpected};
use super::gpu_mapping::GpuChunks;
use crate::error::{MemdError, Result};
use crate::protocol::{
    Acl, Backend, CommitState, REQUEST_META_PAGE_BYTES, Request, Response, TensorMeta, meta_pages,
};

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
        self.session().send_data(&bytes)?;
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
