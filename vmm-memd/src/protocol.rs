//! The request/response protocol: typed enums, postcard-encoded, one per `DATA` message of
//! the peer protocol (docs/protocol.md); descriptors travel as the peer protocol's own
//! `HOST_MEMFD` messages after the reply that announces them. See `vmm-memd/README.md`.

use serde::{Deserialize, Serialize};

use crate::error::{Refusal, RequestRule, Right};

/// The largest request the service decodes: 8 KiB. Longer `DATA` messages are refused with
/// [`Refusal::TooLarge`] before a byte of them is decoded.
pub const MAX_REQUEST: usize = 8 * 1024;

/// The most chunks one generation has (one fd each).
pub const MAX_CHUNKS: usize = 64;

/// The most metadata entries one generation has.
pub const MAX_META_ENTRIES: usize = 65_536;

/// The longest metadata key, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// The longest region name, in bytes.
pub const MAX_REGION_NAME: usize = 128;

/// The most uid or gid entries in one ACL list.
pub const MAX_ACL_ENTRIES: usize = 64;

/// The most bytes of entries in a reply's metadata page (below the peer protocol's
/// `MAX_DATA`, 16 KiB).
pub(crate) const REPLY_META_PAGE_BYTES: usize = 12 * 1024;

/// The most bytes of entries in one `PutMeta` request: [`MAX_REQUEST`] less room for the
/// request's tag and the list's length.
pub(crate) const REQUEST_META_PAGE_BYTES: usize = MAX_REQUEST - 16;

/// The element type of a tensor in a region's metadata.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    BF16,
    F32,
    F64,
    Bool,
}

/// Where one named tensor lies in a generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Which chunk.
    pub chunk: u32,
    /// Byte offset in the chunk.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
}

/// Who an ACL entry names: a uid, or a gid (primary or supplementary, as the kernel reports
/// them for the connection: `SO_PEERCRED`, `SO_PEERGROUPS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Principal {
    /// A user id.
    Uid(u32),
    /// A group id.
    Gid(u32),
}

/// Who may read, write and delete a region, besides its owner (the uid that created it, which
/// may do all three). Set by the owner when it creates the region.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acl {
    /// May attach and list.
    pub read: Vec<Principal>,
    /// May publish generations (and read).
    pub write: Vec<Principal>,
    /// May delete the region.
    pub delete: Vec<Principal>,
}

impl Acl {
    /// The entries for `right`.
    pub fn entries(&self, right: Right) -> &[Principal] {
        match right {
            Right::Read => &self.read,
            Right::Write => &self.write,
            Right::Delete => &self.delete,
        }
    }

    pub(crate) fn check(&self) -> Result<(), Refusal> {
        if [&self.read, &self.write, &self.delete]
            .iter()
            .any(|l| l.len() > MAX_ACL_ENTRIES)
        {
            return Err(Refusal::InvalidRequest {
                rule: RequestRule::Acl,
                detail: format!("an ACL list has more than {MAX_ACL_ENTRIES} entries"),
            });
        }
        Ok(())
    }
}

/// Where a region's memory lives, chosen when a `BeginOn` creates the region (a `Begin` is
/// `BeginOn` with [`Backend::Host`]). Every generation of a region lives where the region does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Backend {
    /// Host memory: memfds, sealed read-only at commit.
    #[default]
    Host,
    /// Device memory of the CUDA device with this UUID (`cuDeviceGetUuid`, the same in every
    /// process whatever its `CUDA_VISIBLE_DEVICES` numbering): VMM chunks (`cuMemCreate`)
    /// exported as POSIX fds.
    Gpu {
        /// The device's UUID.
        uuid: [u8; 16],
    },
}

/// A SHA-256 digest of one chunk's bytes.
pub type ChunkDigest = [u8; 32];

/// A request. Each gets exactly one [`Response`] (a refusal included), then, for `Begin` and
/// `Attach`, what the response announces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Regions the caller may read.
    List,
    /// Per region the caller may read: generations, readers, leases; and the caller's quota.
    Status,
    /// Start generation N+1 of `region` (creating the region, owned by the caller, with `acl`,
    /// if it does not exist): wait at most `wait_ms` (capped by the service) for the region's
    /// writer slot, check the quota, allocate `chunks`. The reply is [`Response::Began`],
    /// then one `HOST_MEMFD` descriptor per chunk, writable until commit.
    Begin {
        /// The region.
        region: String,
        /// The chunk sizes in bytes.
        chunks: Vec<u64>,
        /// The ACL of a region this creates (ignored for an existing one).
        acl: Acl,
        /// How long to wait for the writer slot, in ms.
        wait_ms: u64,
    },
    /// Add metadata entries to the pending generation (decoded without trusting the
    /// announced count: see `capped.rs`).
    PutMeta(#[serde(deserialize_with = "crate::capped::metadata_list")] Vec<(String, TensorMeta)>),
    /// Seal the pending generation against writes and make it the current one.
    Commit,
    /// Free the pending generation.
    Abort,
    /// A lease on a committed generation of `region`: the reply is [`Response::Attached`],
    /// then `meta_pages` [`Response::MetaPage`]s, then one `HOST_MEMFD` descriptor per chunk,
    /// sealed read-only.
    Attach {
        /// The region.
        region: String,
        /// A committed generation still held (the current one, one a lease keeps, or one
        /// the retention setting keeps); `None`: the current one.
        generation: Option<u64>,
    },
    /// End the lease `lease`.
    Detach {
        /// The lease, as `Attached` named it.
        lease: u64,
    },
    /// Renew every lease of this connection for another TTL.
    Renew,
    /// Delete the region: its name goes at once; its generations are freed as their leases
    /// end.
    Delete {
        /// The region.
        region: String,
    },
    /// The service's metrics in the Prometheus text format, as the caller may see them
    /// (regions it may read; its quota; the service's counters). Changes nothing.
    Metrics,
    /// `Begin` on a chosen backend (appended after the host-only requests, so their postcard
    /// tags stay). A region created by it lives on `backend` for good; a `BeginOn` (or
    /// `Begin`) for another backend is refused (`InvalidRequest`, rule `Backend`). For a GPU
    /// region the reply is [`Response::BeganGpu`] (chunk sizes rounded up to the device's
    /// granularity), then one `CUDA_VMM` descriptor (one fd) per chunk, writable; for a host
    /// region, as `Begin`.
    BeginOn {
        /// The region.
        region: String,
        /// The chunk sizes in bytes (a GPU region rounds each up to the granularity).
        chunks: Vec<u64>,
        /// The ACL of a region this creates (ignored for an existing one).
        acl: Acl,
        /// How long to wait for the writer slot, in ms.
        wait_ms: u64,
        /// Where the region lives.
        backend: Backend,
    },
    /// Check a committed generation's bytes against the digests taken at its commit (GPU
    /// regions; a host region is sealed and has none): [`Response::Verified`], or
    /// `Refused(DigestMismatch)` naming the first chunk that changed.
    Verify {
        /// The region.
        region: String,
        /// A generation still held; `None`: the current one.
        generation: Option<u64>,
    },
    /// End the lease `lease` as a *discard sleep*: besides ending the lease, ask the service
    /// to free the generation's memory once no lease holds it (every mapper asleep or gone).
    /// Needs the region's write right (it replaces the contents): `AccessDenied` otherwise,
    /// and the lease stays. The generation stays (number, metadata, chunk sizes, quota charge); the next `Attach`
    /// of it (a wake) makes its chunks again, zeroed. The reply is `Done`.
    Discard {
        /// The lease, as `Attached` named it.
        lease: u64,
    },
    /// `Attach` a GPU region's generation as fabric handles, for importers on other nodes of
    /// the fabric (a process there needs an IMEX channel): the reply is
    /// [`Response::AttachedGpu`], the `MetaPage`s, then one `CUDA_FABRIC` descriptor per
    /// chunk. Refused with `FabricUnavailable` for a host region and for chunks that are not
    /// fabric-shareable. A generation the service took back from its keeper after a restart
    /// is copied on the device into fresh fabric-shareable chunks first (a fabric handle is
    /// exported from the allocation, which only the service that made it held; see
    /// `registry/refabric.rs`). The lease keeps the memory while importers import: a fabric
    /// handle does not keep memory alive.
    AttachFabric {
        /// The region.
        region: String,
        /// A generation still held; `None`: the current one.
        generation: Option<u64>,
    },
    /// An operator's sleep of `region`'s current generation (`vmm-memctl sleep`): a discard
    /// sleep without a lease of the caller's. The service frees the generation's memory once
    /// no lease holds it (at once if none does); its number, metadata, chunk sizes and quota
    /// charge stay, as for [`Request::Discard`]. Needs the region's write right (its owner
    /// has it). The reply is [`Response::Slept`]; a sleep of a generation already asleep (or
    /// falling asleep) changes nothing and answers the same.
    Sleep {
        /// The region.
        region: String,
    },
    /// An operator's wake of `region`'s current generation (`vmm-memctl wake`): the chunks
    /// of a generation asleep are made again now, zeroed (as the next `Attach` would), so the
    /// next attach does not wait for it; a sleep still waiting for leases to end is called
    /// off (the contents stay). Needs the write right. The reply is [`Response::Woke`];
    /// `InvalidRequest` with rule `NotAsleep` for a generation that is awake.
    Wake {
        /// The region.
        region: String,
    },
    /// Name this connection's pending generation with `token`, a value the writer chose (16
    /// random bytes): after a commit whose reply was lost, [`Request::CommitState`] with the
    /// token says whether that generation landed. The reply is [`Response::Done`];
    /// `InvalidRequest` with rule `NotWriting` without a pending generation, with rule
    /// `Token` for a token the region knows already (landed, or naming its pending one).
    Token {
        /// The writer's token.
        token: [u8; 16],
    },
    /// What became of `region`'s generation named `token` (needs the region's write right):
    /// [`Response::CommitState`].
    CommitState {
        /// The region.
        region: String,
        /// The writer's token.
        token: [u8; 16],
    },
    /// An operator lets everything go (`vmm-memctl release --all`): every region is deleted,
    /// as a [`Request::Delete`] of each would (its name goes now, a generation's memory when
    /// its last lease ends, and the keeper holds none of it any more). A graceful stop or an
    /// upgrade keeps every region; this is how their memory is given back for good. Admins
    /// only (`--admin-uid`, `--admin-gid`): [`Refusal::NotAdmin`] for anyone else. A region
    /// with a writer at work or waiting is left, and counted in the reply:
    /// [`Response::Released`].
    ReleaseAll,
    /// Replace `region`'s ACL (`vmm-memctl acl`): its owner or an admin. It applies to the
    /// next request of every connection (leases already granted stay) and is kept across
    /// restarts. The reply is [`Response::Done`]; a region the caller may not see is
    /// `NoSuchRegion`, one it sees but does not own is [`Refusal::NotAdmin`].
    SetAcl {
        /// The region.
        region: String,
        /// Its new ACL (at most [`MAX_ACL_ENTRIES`] per list).
        acl: Acl,
    },
    /// Set `uid`'s quota to `bytes` (`vmm-memctl quota`), or with `None` give it back the one
    /// the service was started with: admins only ([`Refusal::NotAdmin`]). Kept across
    /// restarts; it limits the uid's next `Begin` (what it holds already stays, even past the
    /// new quota). The reply is [`Response::Done`].
    SetQuota {
        /// The uid.
        uid: u32,
        /// Its quota in bytes; `None`: the service's default for it.
        bytes: Option<u64>,
    },
}

/// What became of a generation named by a writer's token ([`Request::CommitState`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommitState {
    /// It was committed, as this generation (it may have been retired since).
    Landed {
        /// Its number.
        generation: u64,
    },
    /// It is the region's pending generation: its writer's connection is open and has not
    /// committed it (yet). Ask again once that connection has ended.
    Pending,
    /// The region knows no generation of that token: it did not land (its writer's
    /// connection ended before the commit), or it landed more than
    /// [`MAX_LANDED_TOKENS`] tokened commits ago, or the region was deleted since.
    Unknown,
}

/// The tokens of a region's latest tokened commits that [`Request::CommitState`] remembers.
pub const MAX_LANDED_TOKENS: usize = 64;

/// One generation's view in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationStatus {
    /// Its number.
    pub generation: u64,
    /// Its bytes.
    pub bytes: u64,
    /// Whether it is the current one.
    pub current: bool,
    /// The pids (from SO_PEERCRED) that hold a lease on it, one per lease.
    pub readers: Vec<i32>,
    /// Whether it sleeps (appended: the Python client decodes it too).
    pub sleep: SleepState,
}

/// Whether a generation's memory is there ([`GenerationStatus::sleep`],
/// [`RegionSummary::sleep`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SleepState {
    /// Its memory is there.
    #[default]
    Awake,
    /// A discard sleep was asked (by a reader's `Discard` or an operator's `Sleep`) and
    /// leases still hold it: its memory goes when the last one ends.
    Falling,
    /// Its memory was let go; the next attach or a `Wake` makes it again, zeroed.
    Asleep,
}

/// One region's view in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionStatus {
    /// Its name.
    pub region: String,
    /// Its owner.
    pub owner: u32,
    /// The committed generations still held (the current one and retired ones with leases).
    pub generations: Vec<GenerationStatus>,
    /// The writer's pending generation (number, bytes, writer pid), if any.
    pub pending: Option<(u64, u64, i32)>,
    /// How many writers wait for the writer slot.
    pub waiting_writers: u32,
}

/// The reply to [`Request::Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The caller's uid, as the kernel reported it.
    pub uid: u32,
    /// Bytes the caller's uid holds (pending and committed generations it allocated).
    pub used: u64,
    /// The caller's quota.
    pub quota: u64,
    /// Regions the caller may read.
    pub regions: Vec<RegionStatus>,
    /// Requests refused since the service started (all callers).
    pub refusals: u64,
    /// Leases that ended by TTL since the service started.
    pub expired_leases: u64,
    /// Whether regions (or reader pids, past 64 per generation) were left out to fit one
    /// message.
    pub truncated: bool,
}

/// One line of [`Response::List`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionSummary {
    /// Its name.
    pub region: String,
    /// The current generation (0: none committed yet).
    pub generation: u64,
    /// The current generation's bytes.
    pub bytes: u64,
    /// Whether the current generation sleeps (appended; `Awake` when there is none).
    pub sleep: SleepState,
}

/// A reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// The request was refused.
    Refused(Refusal),
    /// Regions the caller may read.
    List(Vec<RegionSummary>),
    /// See [`Status`].
    Status(Status),
    /// The pending generation's number; its chunks' descriptors follow, in order.
    Began {
        /// The generation.
        generation: u64,
        /// Chunk sizes.
        chunks: Vec<u64>,
    },
    /// Done (`PutMeta`, `Abort`, `Detach`, `Delete`).
    Done,
    /// The generation is committed (now current).
    Committed {
        /// The generation.
        generation: u64,
    },
    /// A lease; metadata pages and descriptors follow.
    Attached {
        /// The lease, for `Detach`.
        lease: u64,
        /// The generation.
        generation: u64,
        /// Chunk sizes.
        chunks: Vec<u64>,
        /// How many `MetaPage`s follow.
        meta_pages: u32,
        /// The lease's TTL in ms (renew before it runs out).
        ttl_ms: u64,
    },
    /// Metadata entries (a page of an `Attached` reply; decoded as `PutMeta` is).
    MetaPage(#[serde(deserialize_with = "crate::capped::metadata_list")] Vec<(String, TensorMeta)>),
    /// How many leases `Renew` renewed.
    Renewed(u32),
    /// The reply to [`Request::Metrics`]: Prometheus text (cut to fit one message).
    Metrics(String),
    /// A GPU region's pending generation (the reply to a `BeginOn` of a GPU region); one
    /// `CUDA_VMM` descriptor per chunk follows, in order, each one fd.
    BeganGpu {
        /// The generation.
        generation: u64,
        /// Chunk sizes (the asked sizes rounded up to the device's granularity).
        chunks: Vec<u64>,
        /// The UUID of the device the chunks live on.
        device: [u8; 16],
        /// Whether the chunks were also created shareable as fabric handles (the device and
        /// the service's process support them); the service always holds and sends POSIX fds.
        fabric: bool,
    },
    /// A lease on a GPU region's generation (the reply to `Attach` of a GPU region):
    /// `meta_pages` `MetaPage`s follow, then one `CUDA_VMM` descriptor per chunk.
    AttachedGpu {
        /// The lease, for `Detach`.
        lease: u64,
        /// The generation.
        generation: u64,
        /// Chunk sizes.
        chunks: Vec<u64>,
        /// How many `MetaPage`s follow.
        meta_pages: u32,
        /// The lease's TTL in ms.
        ttl_ms: u64,
        /// The UUID of the device the chunks live on.
        device: [u8; 16],
        /// Whether the chunks are also shareable as fabric handles.
        fabric: bool,
    },
    /// The generation's bytes match its digests (one per chunk; none for a host region,
    /// which is sealed).
    Verified {
        /// The generation checked.
        generation: u64,
        /// The digests, one per chunk (SHA-256 of its bytes).
        digests: Vec<ChunkDigest>,
    },
    /// The reply to [`Request::Sleep`].
    Slept {
        /// The generation put to sleep (the region's current one).
        generation: u64,
        /// Leases that still hold it: its memory goes when they end (0: gone now).
        leases: u32,
    },
    /// The reply to [`Request::Wake`].
    Woke {
        /// The generation woken (the region's current one).
        generation: u64,
        /// Whether its chunks were made again, zeroed (`false`: a sleep still waiting for
        /// leases was called off, and the contents stayed).
        zeroed: bool,
    },
    /// The reply to [`Request::CommitState`].
    CommitState(CommitState),
    /// The reply to [`Request::ReleaseAll`].
    Released {
        /// Regions deleted.
        regions: u32,
        /// Regions left because a writer was at work on them or waiting for them.
        busy: u32,
    },
}

/// Decode a request, refusing one longer than [`MAX_REQUEST`] before reading a byte of it.
pub fn decode_request(bytes: &[u8]) -> Result<Request, Refusal> {
    if bytes.len() > MAX_REQUEST {
        return Err(Refusal::TooLarge {
            size: bytes.len() as u64,
            cap: MAX_REQUEST as u64,
        });
    }
    postcard::from_bytes(bytes).map_err(|e| Refusal::InvalidRequest {
        rule: RequestRule::Decode,
        detail: e.to_string(),
    })
}

/// Check a region name: 1 to [`MAX_REGION_NAME`] bytes of `[A-Za-z0-9._/-]`.
pub fn check_region_name(name: &str) -> Result<(), Refusal> {
    let ok = !name.is_empty()
        && name.len() <= MAX_REGION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Refusal::InvalidRequest {
            rule: RequestRule::RegionName,
            detail: format!(
                "a region name is 1 to {MAX_REGION_NAME} bytes of [A-Za-z0-9._/-], not {:?}",
                name.chars().take(MAX_REGION_NAME + 1).collect::<String>()
            ),
        })
    }
}

/// Metadata entries cut into pages of at most `budget` bytes of encoded entries each
/// ([`REPLY_META_PAGE_BYTES`] for replies, [`REQUEST_META_PAGE_BYTES`] for `PutMeta`); an
/// entry larger than the budget alone is a page of its own (and its message is refused).
pub(crate) fn meta_pages(
    entries: &[(String, TensorMeta)],
    budget: usize,
) -> Vec<Vec<(String, TensorMeta)>> {
    let mut pages = Vec::new();
    let (mut page, mut bytes) = (Vec::new(), 0usize);
    for entry in entries {
        let size = postcard::to_allocvec(entry).map_or(budget, |encoded| encoded.len());
        if !page.is_empty() && bytes + size > budget {
            pages.push(std::mem::take(&mut page));
            bytes = 0;
        }
        page.push(entry.clone());
        bytes += size;
    }
    if !page.is_empty() {
        pages.push(page);
    }
    pages
}

/// `entries` as the encoded [`Response::MetaPage`] replies of an attach, pages of at most
/// [`REPLY_META_PAGE_BYTES`] of entries each.
pub(crate) fn meta_replies(entries: &[(String, TensorMeta)]) -> Vec<Vec<u8>> {
    meta_pages(entries, REPLY_META_PAGE_BYTES)
        .into_iter()
        .map(|page| {
            postcard::to_allocvec(&Response::MetaPage(page))
                .expect("metadata entries always encode (strings, integers, enums)")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any bytes: a request or a typed refusal, never a panic, and nothing over the cap
        /// decoded.
        #[test]
        fn any_bytes_decode_to_a_request_or_a_refusal(bytes in proptest::collection::vec(any::<u8>(), 0..MAX_REQUEST + 64)) {
            match decode_request(&bytes) {
                Ok(request) => prop_assert!(bytes.len() <= MAX_REQUEST, "{request:?}"),
                Err(Refusal::TooLarge { size, .. }) => prop_assert_eq!(size as usize, bytes.len()),
                Err(Refusal::InvalidRequest { rule: RequestRule::Decode, .. }) => {}
                Err(other) => prop_assert!(false, "{other:?}"),
            }
        }

        /// A request with a huge announced length (a varint count) is refused without
        /// allocating it: postcard checks counts against the bytes left.
        #[test]
        fn announced_lengths_past_the_bytes_are_refused(count in 1u32..u32::MAX, tag in 0u8..16) {
            let mut bytes = vec![tag];
            let mut n = count;
            while n >= 0x80 {
                bytes.push((n as u8) | 0x80);
                n >>= 7;
            }
            bytes.push(n as u8);
            let _ = decode_request(&bytes);
        }
    }

    #[test]
    fn an_oversized_request_is_refused_before_decoding() {
        let mut bytes = postcard::to_allocvec(&Request::Status).unwrap();
        assert_eq!(decode_request(&bytes), Ok(Request::Status));
        bytes.resize(MAX_REQUEST + 1, 0);
        assert_eq!(
            decode_request(&bytes),
            Err(Refusal::TooLarge {
                size: MAX_REQUEST as u64 + 1,
                cap: MAX_REQUEST as u64
            })
        );
    }

    #[test]
    fn region_names_are_checked() {
        assert!(check_region_name("llama/70b-v1.2_x").is_ok());
        for bad in ["", "a b", "é", &"x".repeat(MAX_REGION_NAME + 1)] {
            assert!(
                matches!(
                    check_region_name(bad),
                    Err(Refusal::InvalidRequest {
                        rule: RequestRule::RegionName,
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn meta_pages_fit_a_data_message() {
        let entries: Vec<_> = (0..2000)
            .map(|i| {
                (
                    format!("layer.{i}.{}", "k".repeat(200)),
                    TensorMeta {
                        chunk: 0,
                        offset: i,
                        len: 1,
                        dtype: Dtype::BF16,
                        shape: vec![u64::MAX; 8],
                    },
                )
            })
            .collect();
        // An attach's pages, encoded once: each fits a DATA message, and together they
        // decode to every entry, in order.
        let mut decoded = Vec::new();
        for bytes in meta_replies(&entries) {
            assert!(bytes.len() <= vmm_core::peer::MAX_DATA, "{}", bytes.len());
            match postcard::from_bytes::<Response>(&bytes).unwrap() {
                Response::MetaPage(page) => decoded.extend(page),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(decoded, entries);
        // A writer's pages are requests, which the service decodes only up to MAX_REQUEST.
        let pages = meta_pages(&entries, REQUEST_META_PAGE_BYTES);
        assert_eq!(pages.iter().map(Vec::len).sum::<usize>(), 2000);
        for page in pages {
            let bytes = postcard::to_allocvec(&Request::PutMeta(page)).unwrap();
            assert!(decode_request(&bytes).is_ok(), "{} bytes", bytes.len());
        }
    }
}
