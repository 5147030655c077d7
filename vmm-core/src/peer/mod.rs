//! The cross-language descriptor protocol: CUDA VMM, fabric and host (memfd) descriptors to
//! and from processes vmm-core did not start, in any language, on a named endpoint or (for
//! messages without fds) on any byte stream.
//!
//! One message is a small self-describing header (magic `VMMI`, version, kind, handle type,
//! chunk count and sizes, size, device UUID, location), then a payload, and for `CUDA_VMM` and
//! `HOST_MEMFD` one fd per chunk in `SCM_RIGHTS`; `docs/protocol.md` in the repository is the
//! specification, and `python/vmm_ipc_peer/` a standard-library Python peer. This module
//! turns those messages into [`IpcDescriptor`](crate::cuda::IpcDescriptor)s, [`FabricDescriptor`](crate::cuda::FabricDescriptor)s and [`HostDescriptor`](crate::shm::HostDescriptor)s
//! and back. [`Session`] speaks the protocol on a named endpoint's authenticated connection
//! ([`wire::endpoint::Connection`](crate::wire::endpoint::Connection)): the handshake, then
//! [`send_descriptor`](Session::send_descriptor), [`recv_descriptor`](Session::recv_descriptor)
//! and `DATA`; [`stream`] writes and reads the messages without fds (`CUDA_FABRIC`, `DATA`) on
//! any [`std::io::Write`]/[`std::io::Read`], a TCP connection say, so a fabric descriptor
//! crosses machines.
//!
//! # Layers
//!
//! The protocol sits above the transport ([`wire`](crate::wire): packets, fds, credentials,
//! which knows nothing of descriptors) and above the descriptors it carries
//! ([`cuda`](crate::cuda), [`shm`](crate::shm)), whose rules it reuses rather than restates:
//! the message codec (`frame`) checks a descriptor's chunk layout with the rule every
//! descriptor meets, and names handle types by [`HandleType`](crate::cuda::HandleType)'s driver numbers. So `wire`
//! imports nothing of `cuda` or `peer`, and nothing imports `peer` back.
//!
//! # Versions
//!
//! Each message carries the version that defines its kind: `HELLO`, `REFUSED`, `DATA`,
//! `CUDA_VMM` and `HOST_MEMFD` are version 1 and are sent exactly as version 1 sent them;
//! `CUDA_FABRIC` (one 64-byte fabric handle per chunk, no fds) is version 2. So this crate
//! speaks version 1 to a version 1 peer as long as it sends it no fabric descriptor, and a
//! version 1 peer refuses one, naming the version it speaks. A message whose version is not
//! its kind's, or an unknown version, is refused ([`Error::Protocol`](crate::Error::Protocol), naming the versions this
//! crate speaks). Whether a peer takes fabric descriptors is for the applications to agree
//! (there is no negotiation on the wire).
//!
//! # Checks on receipt
//!
//! Receiving validates as importing does, before anything is mapped: the header's counts
//! against the documented maxima and the fds the kernel delivered, then the descriptor's
//! layout by import's own rules (non-empty chunks, no overflow, size within the chunks, a
//! handle type this crate can import, one fabric handle per chunk); the fds are owned (and
//! close-on-exec) from the moment they arrive and are closed on any refusal. The descriptor
//! that comes out is an ordinary one:
//! [`VirtualMemoryBuffer::import`](crate::cuda::VirtualMemoryBuffer::import),
//! [`VirtualMemoryBuffer::import_fabric`](crate::cuda::VirtualMemoryBuffer::import_fabric) (or
//! [`HostBuffer::import`](crate::shm::HostBuffer::import)) runs its full checks again and maps.
//!
//! # Fabric handles are bearer tokens
//!
//! Whoever holds a fabric handle's 64 bytes (and an IMEX channel of the same NVLink domain)
//! can map the memory: send a [`FabricDescriptor`](crate::cuda::FabricDescriptor) only to a peer you would give the memory
//! (on an endpoint, an admitted peer; on a stream, one the stream authenticates). No `Debug`
//! output and no error of this module shows a handle byte. A handle does not keep the memory
//! alive: keep the exported buffer until the importer says it has imported (a `DATA` reply).
//! See [`cuda::fabric`](crate::cuda::fabric).
//!
//! For a transport of your own, [`encode_descriptor`] and [`decode_message`] are the codec
//! (a message's bytes exclude the packet's leading frame byte; see the specification).

mod codec;
mod frame;
mod message;
mod session;
pub mod stream;

pub use codec::{decode_message, encode_descriptor};
pub use frame::{MAX_CHUNKS, MAX_DATA, PROTOCOL_VERSION};
pub use message::{Descriptor, DescriptorRef, PeerMessage};
pub use session::{Handshake, Session};
