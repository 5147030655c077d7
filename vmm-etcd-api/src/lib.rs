//! etcd's v3 gRPC API, the part vmm-registry speaks: the `KV`, `Watch`, `Lease` and `Auth`
//! services with their messages ([`etcdserverpb`]), and the key-value and auth records they
//! carry ([`mvccpb`], [`authpb`]), as prost messages and tonic clients.
//!
//! # Why the code is committed
//! Generating it needs `protoc`, a program outside the Rust toolchain and crates.io. A build
//! script that ran it (as the `etcd-client` crate's does) made every build of the workspace
//! need `protoc` installed. Here the generated code is part of the repository
//! (`src/generated`), so building needs only Rust and the crates on crates.io; CI builds the
//! workspace with `PROTOC=/bin/false` to prove it. A crate that ships a `protoc` binary
//! inside its package was the other way; generated code keeps the build free of any
//! binary, and a drift test keeps the code honest:
//!
//! - `proto/` holds the inputs: etcd's `rpc.proto`, `kv.proto` and `auth.proto` (Apache-2.0,
//!   `proto/LICENSE`), from etcd v3.5.33, with only the gogoproto and grpc-gateway
//!   annotations and the services this workspace does not use (Cluster, Maintenance)
//!   taken out; each file's header says exactly what changed. The v3 API is stable: these
//!   speak to etcd 3.4 (the version CI tests against) and 3.5 alike.
//! - `src/generated` is what `tonic-prost-build` makes of them: clients only, without
//!   tonic's transport (the caller brings a channel: vmm-registry's is mutual TLS on rustls
//!   with ring), no servers.
//! - `tests/generated.rs` regenerates the code where `protoc` exists and fails on any
//!   difference (one `SKIP` line where it does not; `VMM_REQUIRE_PROTOC=1` makes that a
//!   failure); `VMM_REGENERATE=1` rewrites `src/generated` after a change to `proto/`.
//!
//! Nothing here runs: no runtime, no connection, no policy. The registry's client layer
//! (vmm-registry's `etcd` module) is where the calls are made, bounded and classified.

// The generated code is included as the generator wrote it (not reformatted, not linted):
// the drift test compares it byte for byte.

/// etcd's key-value record and watch event (`mvccpb`, from `kv.proto`).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod mvccpb {
    include!("generated/mvccpb.rs");
}

/// etcd's users, roles and permissions (`authpb`, from `auth.proto`).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod authpb {
    include!("generated/authpb.rs");
}

/// etcd's v3 services `KV`, `Watch`, `Lease`, `Auth` and their messages (`etcdserverpb`,
/// from `rpc.proto`): `kv_client::KvClient`, `watch_client::WatchClient`,
/// `lease_client::LeaseClient`, `auth_client::AuthClient`, each over any tonic channel.
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod etcdserverpb {
    include!("generated/etcdserverpb.rs");
}
