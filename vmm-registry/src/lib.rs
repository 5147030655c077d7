//! A registry of exported memory across nodes, on etcd.
//!
//! An exporter publishes a [`Locator`] (where its mutual-TLS descriptor stream listens, the
//! name its certificate carries, what the object is), never handle bytes, under
//! `/vmm/v1/<domain>/exports/<owner>/<name>`, by a create-only transaction, attached to its
//! process's one lease. The lease is kept alive every TTL/3 on a background thread; a clean
//! shutdown revokes it (the locators disappear at once) and a crash lets it expire (they
//! disappear within the TTL). Importers resolve a name or watch the domain.
//! - The registry rides out etcd outages: the keep-alive goes on trying, with backoff, until
//!   etcd itself answers that the lease is gone (etcd restores its leases when it returns);
//!   then it grants a new lease, publishes every locator again under it, and says so
//!   ([`LeaseEvent`]).
//!
//! - etcd is spoken to over mutual TLS only; there is no plaintext fallback, and a TLS
//!   failure is its own error ([`RegistryError::Tls`]).
//! - The API is blocking: one background thread owns a tokio runtime (vmm-core stays free
//!   of one), and every call ends by its deadline. Opening makes a real request (it grants
//!   the lease), so an etcd that is down fails the open within the open timeout.
//! - A value read from etcd is hostile: its size is capped before it is parsed
//!   ([`MAX_LOCATOR_BYTES`]), and its owner must be the owner its key names.
//! - The hand-off of a resolved locator ([`Fetcher`], [`ExportServer`]): the descriptor
//!   crosses vmm-core's mutual-TLS descriptor stream, each side admitting only the other's
//!   certificate name (the importer: the locator's `exporter_name`), and the importer
//!   acknowledges its import. A stale locator fails with a typed error
//!   ([`FetchError::is_stale`]). An offer may carry metadata, sent after the descriptor in
//!   checked pages, up to a cap the importer chooses ([`Fetcher::max_metadata`],
//!   [`Fetched::metadata`]).
//! - [`memd_publish`]: a vmm-memd service's regions published by a client of it
//!   ([`MemdPublisher`](memd_publish::MemdPublisher), the `vmm-memd-publish` program), with
//!   their tensors' metadata ([`memd_publish::region_metadata()`]).
//! - Feature `async`: `AsyncRegistry` and `AsyncWatch`, the same operations as `async fn`s
//!   on the caller's tokio runtime.

#[cfg(feature = "async")]
mod async_registry;
mod background;
mod classify;
mod config;
mod core;
mod error;
mod etcd;
mod fetch;
mod handoff;
mod handoff_error;
mod handoff_metadata;
pub mod host_stand_in;
mod keys;
mod lease;
mod lease_state;
mod locator;
pub mod memd_publish;
mod registry;
mod serve;
mod tls_probe;
mod watch;

#[cfg(feature = "async")]
pub use async_registry::{AsyncRegistry, AsyncWatch};
pub use config::{DEFAULT_CALL_TIMEOUT, DEFAULT_LEASE_TTL, RegistryConfig, TlsMaterial};
pub use core::{Listing, Published};
pub use error::{
    ConfigError, EtcdError, LeaseLoss, NameRule, Op, RegistryError, Result, TlsFailure, ValueError,
};
pub use fetch::{Fetched, Fetcher, gpu_uuid};
pub use handoff::{HANDOFF_VERSION, MAX_HANDOFF_MESSAGE, MessageError};
pub use handoff_error::{FetchError, ServeError};
pub use handoff_metadata::{DEFAULT_MAX_METADATA, MetadataError, PAGE_PAYLOAD, PAGE_TAG, PageRule};
pub use keys::{MAX_NAME_LEN, domain_prefix, export_key};
pub use lease_state::{LeaseEvent, MAX_LEASE_EVENTS};
pub use locator::{Entry, ExportedObject, HandleKind, Locator, MAX_LOCATOR_BYTES};
pub use registry::Registry;
pub use serve::{ExportServer, MAX_IN_FLIGHT, Outcome, Served};
pub use watch::{Watch, WatchEvent};

// The README's example compiles.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
