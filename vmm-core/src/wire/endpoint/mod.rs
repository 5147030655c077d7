//! Named endpoints: how a process that vmm-core did not start reaches a buffer.
//!
//! A [`Listener`] binds a Unix `SOCK_SEQPACKET` socket by path or by abstract name
//! ([`Name`]); [`Connection::connect_with`] is the client side. Both sides end up with a
//! [`Connection`]: an authenticated channel, the socket plus the peer's credentials as the
//! kernel gave them, one packet per message. This module is the transport and the trust
//! decision (who may connect, who may listen); it knows nothing of what the packets say. The
//! protocol spoken on an endpoint (docs/protocol.md: the handshake, `DATA`, CUDA and host
//! descriptors) is `vmm_core::peer`'s: `peer::Session` owns a [`Connection`], and its
//! `accept` and `connect` pass the protocol's handshake as the listener's [`Greeting`].
//!
//! Why the split: the protocol's kinds are descriptors, and their rules are the descriptors'
//! own, so the protocol sits above both the transport and the CUDA and host layers; the
//! transport below them carries no descriptor rule and no CUDA handle type. What it does
//! enforce is what no protocol may skip: credentials on both sides, a cap on every packet
//! before it is read, frame byte `0x00` on every packet (so vmm-core's internal framings never
//! cross an endpoint), bounded waits, and fds closed off the caller's thread.
//!
//! ```
//! use std::time::Duration;
//! use vmm_core::peer::Session;
//! use vmm_core::shm::HostBuffer;
//! use vmm_core::wire::endpoint::{Listener, Name};
//!
//! let name = Name::abstract_name(format!("vmm-doc-{}", std::process::id()));
//! let listener = Listener::bind(&name)?;
//! let owner = HostBuffer::new(4096)?;
//! let server = std::thread::spawn(move || -> vmm_core::Result<()> {
//!     let session = Session::accept(&listener, Some(Duration::from_secs(10)))?;
//!     session.send_descriptor(&owner.export()?)?;
//!     assert_eq!(session.recv_data()?, b"done");
//!     assert_eq!(owner.to_vec()[0], 7);
//!     Ok(())
//! });
//! let client = Session::connect(&name)?; // checks the listener's uid, then is admitted
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
//!   an fd of the application's is sent, and the listener logs the refusal. The listener
//!   shuts down reading and drains what a refused client already sent before it closes, so a
//!   client that spoke first still reads the reason (a Unix socket closed with unread
//!   messages would make its peer's read fail with `ECONNRESET` first).
//! - **An unmapped peer passing for the listener's own user.** A uid with no mapping in this
//!   process's user namespace reads as the overflow uid (`/proc/sys/kernel/overflowuid`,
//!   usually 65534), which stands for every unmapped user at once. It is admitted only when
//!   the allow-list names it ([`Allow::uid`]); the default ([`Allow::same_user`]) of a process
//!   that itself runs as the overflow uid (`nobody`, or in a user namespace that does not map
//!   it) admits no one by uid, on the listener's side and in the client's squatter check, and
//!   a path endpoint refuses a directory it cannot tell from other unmapped users'. If the
//!   overflow uid cannot be read, it is assumed to be any uid (fail closed).
//! - **Flooding the owner's log.** A foreign user may connect as often as it likes; refusals
//!   are logged at most [`LOG_BURST`] lines per [`LOG_INTERVAL`], then counted in one line.
//! - **A squatter.** Whoever binds a name first owns it; a client checks the listener's
//!   credentials against [`ConnectOptions::expect`] (default: the client's own uid) right after
//!   `connect`, before it sends or reads anything, so a listener run by another user cannot
//!   collect the client's fds or feed it descriptors.
//! - **Reaching a path socket at all.** A path socket lives mode 0600 in a directory owned by
//!   the listener's uid and closed to everyone else (0700); `bind` refuses a directory that is
//!   group- or world-accessible or owned by someone else, and never replaces a live
//!   listener's socket file (only a stale one, whose `connect` is refused). Abstract names have
//!   no file and no permissions: there the credential checks are the whole defence.
//! - **Hostile messages from an admitted peer.** A receive takes only the packets of
//!   `docs/protocol.md`: frame byte `0x00` and at most the largest protocol message; vmm-core's
//!   internal framing (a payload spilled into a memfd, frame byte `0x01`, which would make the
//!   receiver read up to 1 GiB) and longer packets are refused before anything is read from
//!   their fds or allocated for them. Every message is checked against the documented limits
//!   and the kernel's fd count before anything is allocated, and a descriptor is checked as
//!   `import` checks it before anything is mapped; the decoder is fuzzed. Every receive, send,
//!   accept and connect has a timeout, so a silent or stuck peer costs a bounded wait, and a
//!   client that connects and says nothing does not delay `accept`.
//! - **Hostile fds.** Closing the last reference to a file runs code its sender chose (a TCP
//!   socket that lingers with unsent data, a Unix socket holding such sockets in its queue, a
//!   FUSE file whose server never answers): the fds of a refused or unwanted message, and
//!   those a refused client sent, are defused before they are closed. Every socket is set to
//!   close abortively (`SO_LINGER` `{on, 0}`), a Unix socket is shut down for reading and
//!   drained without waiting (to a bounded depth and count, what comes out defused too), and
//!   then closed at once by the caller; only files that are not sockets (and sockets whose
//!   drain hit a bound) go to a bounded set of background closer threads, behind which a
//!   bounded number of fds may wait. So no receive, accept or connect waits for them past its
//!   timeout, and what a refused peer sends holds neither the listener's fds nor its threads.
//!   The residual is a peer that can mount a FUSE file system and never answers `FLUSH`: it
//!   pins at most 8 closer threads and 256 waiting fds, then the caller's own close (see the
//!   `closer` module).
//! - **Running out of fds.** [`Listener::accept`] at the process's fd limit returns
//!   [`Error::FdLimit`](crate::Error::FdLimit) (`EMFILE`; `ENFILE` at the system's) at once
//!   and leaves the connection queued: a transient condition a server waits out (the example
//!   daemon pauses, and bounds the connections and threads it holds).
//!
//! What they do not stop:
//! - **Another process of an admitted uid** (by default: of the same user). It passes the
//!   checks; the kernel does not tell two processes of one uid apart for this purpose (the pid
//!   in the credentials is informative, and may be reused). It could equally `ptrace` or read
//!   the memory of the process it impersonates. Where that matters, run the owner under a
//!   dedicated uid and admit only the uids (or a group) that should have the memory.
//! - **root, or a process with `CAP_SYS_PTRACE`/`CAP_DAC_OVERRIDE`**, which can reach any
//!   socket and any memory anyway (root is admitted only if listed, but that is no defence).
//! - **Peers in other namespaces**, beyond the overflow uid: credentials are translated into
//!   this process's user and pid namespaces, so an allow-list that names the overflow uid
//!   admits every unmapped user; abstract names are per network namespace.
//! - **An admitted peer holding every connection a server allows**, or a foreign one filling
//!   the listen backlog: the kernel bounds the backlog, and a server bounds its connections
//!   (in all, and per uid through [`Listener::accept_admitting`], which refuses a peer at
//!   once with the server's reason; a server may also close idle connections, as the Python
//!   `Listener` does);
//!   clients beyond that wait, within their connect timeout.
//! - **An admitted peer that never reads** what it is sent: every fd sent to it stays in
//!   flight, charged by the kernel to the sender's uid (`ETOOMANYREFS` past its
//!   `RLIMIT_NOFILE`). Sends are bounded by the connection's timeout; how many fds a server
//!   lets one peer leave unread is the server's to cap ([`FdBudget`]: per connection, per uid
//!   (at most a quarter of the one in all, so one uid always leaves room for the others)
//!   and in all, from `SIOCOUTQ`; vmm-memd uses it).
//! - **What an admitted peer does with memory it was given**: it may read and write it for as
//!   long as it keeps the mapping.
//! - **Races inside the listener's own uid**: between the stale-file check and `bind`, only
//!   processes that can write the 0700 directory, which are the listener's uid (and root),
//!   can interfere.

mod closer;
mod connection;
mod creds;
mod defuse;
mod fd_budget;
mod listener;
mod name;
mod peer_process;

pub(crate) use closer::close_later;
pub(crate) use closer::pending as closing_fds;
pub(crate) use closer::started as closer_threads_started;
pub use connection::{ConnectOptions, Connection, DEFAULT_TIMEOUT};
pub(crate) use creds::maybe_overflow_uid;
pub use creds::{Allow, Credentials};
pub use fd_budget::{FdBudget, FdWindow, InFlightExceeded, InFlightScope, uid_share};
pub use listener::{Greeting, LOG_BURST, LOG_INTERVAL, Listener, ListenerOptions};
pub use name::Name;
pub use peer_process::{PeerProcess, peer_pidfd, pidfd_exited};
