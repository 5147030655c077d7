//! `vmm-memd`: a memory service on vmm-ipc. Named regions with generations (a writer fills
//! generation N+1 while N stays served, then commits atomically), leases that end with the
//! reader's connection or by TTL, ACLs and quotas keyed by the kernel's identity of each
//! peer, and committed memory sealed read-only by the kernel (host memfd backend) or mapped
//! read-only by our clients and checked by digest (GPU backend: CUDA VMM chunks on any
//! device, chosen per region with [`BeginOptions::backend`]).
//!
//! - [`Service`] serves on a [`vmm_core::wire::endpoint::Listener`]; [`cli`] is the
//!   `vmm-memd` program.
//! - [`Client`] is the Rust client: [`Client::begin`] gives a [`Writer`],
//!   [`Client::attach`] an [`Attached`].
//! - [`protocol`] is the request/response protocol (postcard in peer-protocol `DATA`
//!   messages; descriptors as the peer protocol's own `HOST_MEMFD`, `CUDA_VMM` and
//!   `CUDA_FABRIC` messages).
//!
//! ```no_run
//! use vmm_core::wire::endpoint::Name;
//! use vmm_memd::protocol::{Dtype, TensorMeta};
//! use vmm_memd::{BeginOptions, Client};
//!
//! let client = Client::connect(&Name::from("@memd"))?;
//! let mut writer = client.begin("llama-70b", &[1 << 30], BeginOptions::default())?;
//! writer.chunk(0).write_at(0, &[0u8; 4096])?; // through this process's mapping
//! let meta = TensorMeta { chunk: 0, offset: 0, len: 4096, dtype: Dtype::BF16, shape: vec![2048] };
//! writer.put("embed", meta);
//! let generation = writer.commit()?; // atomic; read-only for everyone from now on
//!
//! let reader = Client::connect(&Name::from("@memd"))?; // any process
//! let attached = reader.attach("llama-70b")?; // a lease, and read-only mappings
//! let embed: &[u8] = attached.tensor("embed").unwrap(); // zero-copy: it cannot change
//! assert_eq!((attached.generation, embed.len()), (generation, 4096));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! See `vmm-memd/README.md` for the protocol, the semantics of generations and leases, and
//! what is not done yet.

#![cfg(target_os = "linux")]

mod capped;
pub mod cli;
mod client;
pub mod ctl;
mod error;
mod fd_limit;
mod identity;
pub mod keeper;
mod memfd;
pub mod protocol;
mod service;
mod trace;

pub use client::{
    Attached, BeginOptions, Client, FabricAttached, GpuChunks, ReadOnlyChunk, RegionSlept,
    RegionWoke, Released, Reservation, SleepFailed, Sleeping, Unmapped, WakeFailed, Writer,
    commit_token, layout_hash, layout_hash_on,
};
pub use error::{GpuOp, MemdError, Refusal, RequestRule, Result, Right};
pub use identity::Admins;
pub use keeper::Keeper;
pub use keeper::wire::{ImpostorCheck, KeeperError};
pub use service::{
    DEFAULT_IDLE_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_UID, DEFAULT_MAX_FDS_IN_FLIGHT, DEFAULT_MAX_FDS_IN_FLIGHT_PER_UID,
    DEFAULT_MAX_WAIT, IN_FLIGHT_WAIT, InFlightScope, KEEPER_TICK, Service, TICK,
};
