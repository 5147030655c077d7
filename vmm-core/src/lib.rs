//! Share CUDA virtual-memory (VMM) buffers between processes, and test such code the way it
//! runs: one test body, run in real child processes under each start method.
//!
//! - [`cuda`]: a safe API over the CUDA driver's virtual-memory calls: allocate, grow, export
//!   to an [`cuda::IpcDescriptor`] (one fd per chunk) or a [`cuda::FabricDescriptor`] (plain
//!   data), import in another process.
//! - [`wire`]: messages that carry file descriptors (SCM_RIGHTS over `SOCK_SEQPACKET`), serde with
//!   fds out of band, and [`wire::Queue`].
//! - [`peer`]: the cross-language descriptor protocol (`docs/protocol.md`) on named
//!   endpoints ([`wire::endpoint`]): CUDA and host descriptors to and from processes vmm-core
//!   did not start, Python ones included.
//! - [`shm`]: host shared memory (memfd) with the export/import model of the CUDA path.
//! - [`process`]: start methods (spawn, forkserver, warm), [`process::Process`], child entry,
//!   and [`process::Pool`] (reusable warm workers that run tasks).
//! - [`testing`]: the runtime behind `#[ipc_test]`: fd accounting, requirement checks.
//! - [`error`]: the one [`Error`] type, and the typed rules and steps its refusals name.
//!
//! With the feature `tracing`, the operations above emit `tracing` spans (export, import,
//! map, spawn, join, accept, refuse); without it, nothing of it is compiled in.
//!
//! Linux only. A buffer crosses processes as fds, over an anonymous socketpair between processes
//! vmm-core started or over a named endpoint that checks the peer's credentials, or (fabric
//! allocations) as fabric handles over any transport you trust.

#![cfg(target_os = "linux")]
#![deny(missing_docs)]

pub mod cuda;
pub mod error;
mod limits;
pub mod peer;
pub mod process;
mod share;
pub mod shm;
pub mod testing;
mod trace;
pub mod wire;

pub use error::{Error, Result};
pub use share::SharedBuffer;
pub use vmm_macros::{all_methods, ipc_test};
