//! Publishing a vmm-memd service's regions (issue 27 item 5), so that engines on other nodes
//! find them in the registry and import them.
//!
//! The publisher is a client of the service, a process of its own (`vmm-memd-publish`):
//! the service's trusted core gets no network, no TLS and no async runtime, and what the
//! publisher can publish is exactly what the service's ACLs let the publisher's uid read
//! (the kernel's identity of its connection). For each region it attaches the current
//! generation (a lease, renewed every TTL/3), offers the memory on an
//! [`ExportServer`](crate::ExportServer) to the importer names it admits, and publishes a
//! [`Locator`](crate::Locator) (object `Region(name)`, generation, size, device for GPU
//! memory) under its owner's prefix. A GPU region is handed off as the service's fabric
//! handles ([`HandleKind::Fabric`](crate::HandleKind::Fabric)); a host region as the
//! [host stand-in](crate::host_stand_in) naming the publisher's fds of its chunks
//! ([`HandleKind::HostMemfd`](crate::HandleKind::HostMemfd)), which only importers on the same
//! machine can open: the way tests play two nodes on one machine.
//!
//! The region's metadata (its tensors: name, chunk, offset, length, dtype, shape) goes with
//! the descriptor in the hand-off, in the form the module
//! [`region_metadata`](mod@region_metadata) documents; an importer reads it back, every entry
//! checked against the descriptor's chunks, with [`region_metadata()`].

mod attach_held;
pub mod cli;
mod event;
mod held;
mod publish_error;
mod publisher;
mod publisher_config;
pub mod region_metadata;
mod service_link;

pub use event::{PublishEvent, Withdrawal};
pub use publish_error::{PublishError, RegionError};
pub use publisher::MemdPublisher;
pub use publisher_config::{
    DEFAULT_HANDOFF_TIMEOUT, DEFAULT_POLL, DEFAULT_RECONNECT_WITHIN, PublisherConfig, Regions,
};
pub use region_metadata::{RegionMetadataError, region_metadata};
