//! Named endpoints: how a process that vmm-core did not start reaches a buffer.
//!
//! A [`Listener`] binds a Unix `SOCK_SEQPACKET` socket by path or by abstract name
//! ([`Name`]); [`Connection::connect`] is the client side. Both sides end up with a
//! [`Connection`]: one packet per message, serde values with fds out of band (as
//! [`Queue`](crate::wire::Queue)), and the cross-language messages of `docs/protocol.md`
//! (application bytes with [`Connection::send_data`]; descriptors with
//! [`Connection::send_descriptor`](crate::wire::endpoint::Connection::send_descriptor), in
//! [`peer`](crate::peer)), so a Python process speaks to it with the standard library alone.
//!
//! ```
//! use std::time::Duration;
//! use vmm_core::shm::HostBuffer;
//! use vmm_core::wire::endpoint::{Connection, Listener, Name};
//!
//! let name = Name::abstract_name(format!("vmm-doc-{}", std::process::id()));
//! let listener = Listener::bind(&name)?;
//! let owner = HostBuffer::new(4096)?;
//! let server = std::thread::spawn(move || -> vmm_core::Result<()> {
//!     let connection = listener.accept(Some(Duration::from_secs(10)))?;
//!     connection.send_descriptor(&owner.export()?)?;
//!     assert_eq!(connection.recv_data()?, b"done");
//!     assert_eq!(owner.to_vec()[0], 7);
//!     Ok(())
//! });
//! let client = Connection::connect(&name)?; // checks the listener's uid, then is admitted
//! let buffer = HostBuffer::import(&client.recv_descriptor()?.into_host()?)?;
//! buffer.fill(7)?;
//! client.send_data(b"done")?;
//! server.join().unwrap()?;
//! # Ok::<(), vmm_core::Error>(())
//! ```
//!
//! # Threat model
//!
//! What is trusted is the kernel's word about who a peer is: `SO_PEERCRED`, read on both sides
//! of every connection. Nothing a peer sends about itself is used to decide anything.
//!
//! What the checks stop:
//! - **A process of another user connecting to a listener.** `accept` admits a peer only if its
//!   uid or primary gid is in the listener's [`Allow`] list (default: the listener's own
//!   effective uid); anyone else gets a `REFUSED` message and a closed socket before a byte or
//!   an fd of the application's is sent, and the listener logs the refusal.
//! - **A squatter.** Whoever binds a name first owns it; a client checks the listener's
//!   credentials against [`ConnectOptions::expect`] (default: the client's own uid) right after
//!   `connect`, before it sends or reads anything, so a listener run by another user cannot
//!   collect the client's fds or feed it descriptors.
//! - **Reaching a path socket at all.** A path socket lives mode 0600 in a directory owned by
//!   the listener's uid and closed to everyone else (0700); `bind` refuses a directory that is
//!   group- or world-accessible or owned by someone else, and never replaces a live
//!   listener's socket file (only a stale one, whose `connect` is refused). Abstract names have
//!   no file and no permissions: there the credential checks are the whole defence.
//! - **Hostile messages from an admitted peer.** Every message is checked against the
//!   documented limits and the kernel's fd count before anything is allocated, and a
//!   descriptor is checked as `import` checks it before anything is mapped; the decoder is
//!   fuzzed. Every receive, send, accept and connect has a timeout, so a silent or stuck peer
//!   costs a bounded wait, and a client that connects and says nothing does not delay `accept`.
//!
//! What they do not stop:
//! - **Another process of an admitted uid** (by default: of the same user). It passes the
//!   checks; the kernel does not tell two processes of one uid apart for this purpose (the pid
//!   in the credentials is informative, and may be reused). It could equally `ptrace` or read
//!   the memory of the process it impersonates. Where that matters, run the owner under a
//!   dedicated uid and admit only the uids (or a group) that should have the memory.
//! - **root, or a process with `CAP_SYS_PTRACE`/`CAP_DAC_OVERRIDE`**, which can reach any
//!   socket and any memory anyway (root is admitted only if listed, but that is no defence).
//! - **Peers in other namespaces**: credentials are translated into this process's user and
//!   pid namespaces (an unmapped uid reads as the overflow uid, 65534); abstract names are
//!   per network namespace.
//! - **What an admitted peer does with memory it was given**: it may read and write it for as
//!   long as it keeps the mapping.
//! - **Races inside the listener's own uid**: between the stale-file check and `bind`, only
//!   processes that can write the 0700 directory, which are the listener's uid (and root),
//!   can interfere.

mod connection;
mod creds;
mod frame;
mod listener;
mod name;

pub use connection::{ConnectOptions, Connection, DEFAULT_TIMEOUT};
pub use creds::{Allow, Credentials};
pub(crate) use frame::{Frame, FrameLocation, Kind};
pub use frame::{MAX_CHUNKS, MAX_DATA, PROTOCOL_VERSION};
pub use listener::{Listener, ListenerOptions};
pub use name::Name;
