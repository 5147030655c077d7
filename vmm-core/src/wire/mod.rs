//! Fd-carrying messages: SCM_RIGHTS over `SOCK_SEQPACKET`, serde with fds out of band, [`Queue`].
//!
//! - [`Channel`]: one end of an anonymous socketpair; one message is one packet of bytes plus up
//!   to [`MAX_FDS`] fds, received CLOEXEC and owned at once; large payloads ride in a sealed memfd.
//! - [`encode`]/[`decode`]: postcard with fds out of band, for fd-backed types' serde impls.
//! - [`Queue`]: typed, cloneable, shared across processes.
//! - [`endpoint`]: named endpoints (a socket path or an abstract name) that admit a peer by
//!   the kernel's credentials for it: how a process that vmm-core did not start connects.
//! - [`TimedStream`]: byte streams whose reads and writes end by a deadline (a whole message's);
//!   [`AuthenticatedStream`]: those whose peer is known (mutual TLS, or
//!   [`CallerAuthenticated`], the caller's explicit word), the only ones peer messages cross.
//! - `tls` (feature `tls`): mutual-TLS byte streams over TCP, for descriptors that cross a
//!   network.

mod authenticated;
mod channel;
pub mod endpoint;
mod fd;
mod oob;
mod queue;
mod recvmsg;
mod spill;
mod timed;
#[cfg(feature = "tls")]
pub mod tls;
mod wait;

pub use authenticated::{AuthenticatedStream, CallerAuthenticated};
pub(crate) use channel::spin_window;
pub use channel::{Channel, INLINE_MAX, MAX_SPIN_US, Message, SPIN_VAR};
pub use fd::Fd;
pub(crate) use fd::{FdIn, FdOut, FdOwner};
pub use oob::{
    Encoded, decode, deserialize_error, deserialize_fd, encode, serialize_error, serialize_fd,
    serialize_owned_fd, serialize_shared_fd,
};
pub use queue::Queue;
pub use recvmsg::MAX_FDS;
pub use spill::MAX_MESSAGE;
pub use timed::TimedStream;
pub(crate) use wait::wait_hangup;
