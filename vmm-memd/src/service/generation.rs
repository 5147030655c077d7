//! One generation's memory and bookkeeping: its chunks (memfds, or exported GPU chunk fds,
//! that the service holds but never maps writable), its metadata, who allocated it, its
//! digests (GPU), and its leases.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Refusal, RequestRule};
use crate::protocol::{ChunkDigest, MAX_KEY_LEN, MAX_META_ENTRIES, SleepState, TensorMeta};

/// A chunk's fd, shared (not duplicated) with the replies that send it: a reply waiting for
/// room in the fds-in-flight budget holds no fd of its own, and the fd stays open until the
/// last reply that sends it is done, even if its generation is freed meanwhile.
pub(crate) type ChunkFd = Arc<OwnedFd>;

/// One chunk: its fd (a memfd, or a GPU chunk's exported POSIX fd) and size.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) fd: ChunkFd,
    pub(crate) len: u64,
    /// The service's own allocation of a fabric-shareable GPU chunk it made (not one taken
    /// back from the keeper, until a fabric attach copied it: `registry/refabric.rs`): what
    /// fabric handles are exported from (an fd import cannot be exported again).
    pub(crate) origin: Option<vmm_core::cuda::VirtualMemoryBuffer>,
}

/// A generation's metadata as encoded `MetaPage` replies, shared by the attaches that send
/// them.
pub(crate) type MetaReplies = Arc<[Vec<u8>]>;

/// A reader's lease on a generation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease {
    /// The connection it comes from: it ends with it.
    pub(crate) conn: u64,
    /// The reader's pid (SO_PEERCRED), for status.
    pub(crate) pid: i32,
    /// When it ends unless renewed.
    pub(crate) expires: Instant,
}

/// A generation, pending or committed.
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) number: u64,
    pub(crate) chunks: Vec<Chunk>,
    pub(crate) meta: Vec<(String, TensorMeta)>,
    /// The metadata as the encoded `MetaPage` replies an attach sends, made by the first
    /// attach and shared by every later one: a committed generation's metadata never changes,
    /// and encoding a large model's every attach (hundreds of entries, each a key and a shape)
    /// was most of the service's part of an attach.
    pub(crate) meta_replies: Option<MetaReplies>,
    /// The token its writer named it with (`Request::Token`), if any.
    pub(crate) token: Option<[u8; 16]>,
    /// The uid whose quota it is charged to.
    pub(crate) charged_to: u32,
    pub(crate) leases: HashMap<u64, Lease>,
    /// The SHA-256 of each chunk taken at commit (GPU generations; empty for host ones,
    /// which are sealed instead).
    pub(crate) digests: Vec<ChunkDigest>,
    /// A reader asked for a discard sleep: free the memory once no lease holds it.
    pub(crate) discard_wanted: bool,
    /// The chunk sizes of a generation whose memory was discarded (`chunks` is then empty);
    /// the next attach makes the chunks again, zeroed.
    pub(crate) discarded: Option<Vec<u64>>,
}

impl Generation {
    /// Its bytes (a discarded generation's too: its quota charge stays, so that a wake can
    /// make it again).
    pub(crate) fn bytes(&self) -> u64 {
        self.sizes().iter().sum()
    }

    /// Whether its memory is there, going once its leases end, or gone (a discard sleep).
    pub(crate) fn sleep_state(&self) -> SleepState {
        match (self.discarded.is_some(), self.discard_wanted) {
            (true, _) => SleepState::Asleep,
            (false, true) => SleepState::Falling,
            (false, false) => SleepState::Awake,
        }
    }

    /// Its chunk sizes.
    pub(crate) fn sizes(&self) -> Vec<u64> {
        match &self.discarded {
            Some(sizes) => sizes.clone(),
            None => self.chunks.iter().map(|c| c.len).collect(),
        }
    }

    /// Its chunks' fds, shared, to send (no fd is made).
    pub(crate) fn chunk_fds(&self) -> Vec<ChunkFd> {
        self.chunks.iter().map(|c| Arc::clone(&c.fd)).collect()
    }

    /// The metadata as encoded `MetaPage` replies: made once, then shared (call it only on a
    /// committed generation, whose metadata is final).
    pub(crate) fn meta_replies(&mut self) -> MetaReplies {
        let meta = &self.meta;
        Arc::clone(
            self.meta_replies
                .get_or_insert_with(|| crate::protocol::meta_replies(meta).into()),
        )
    }

    /// Add metadata entries, each checked: a key of at most [`MAX_KEY_LEN`] bytes, at most
    /// [`MAX_META_ENTRIES`] in all, and a tensor inside its chunk.
    pub(crate) fn put_meta(&mut self, entries: Vec<(String, TensorMeta)>) -> Result<(), Refusal> {
        let bad = |detail: String| Refusal::InvalidRequest {
            rule: RequestRule::Metadata,
            detail,
        };
        if self.meta.len() + entries.len() > MAX_META_ENTRIES {
            return Err(bad(format!(
                "more than {MAX_META_ENTRIES} metadata entries"
            )));
        }
        for (key, meta) in &entries {
            if key.is_empty() || key.len() > MAX_KEY_LEN {
                return Err(bad(format!("a key is 1 to {MAX_KEY_LEN} bytes")));
            }
            let chunk = self
                .chunks
                .get(meta.chunk as usize)
                .ok_or_else(|| bad(format!("{key:?}: no chunk {}", meta.chunk)))?;
            if meta
                .offset
                .checked_add(meta.len)
                .is_none_or(|end| end > chunk.len)
            {
                return Err(bad(format!(
                    "{key:?}: {} bytes at {} pass the end of chunk {} ({} bytes)",
                    meta.len, meta.offset, meta.chunk, chunk.len
                )));
            }
        }
        self.meta.extend(entries);
        Ok(())
    }
}
