//! Mutual-TLS byte streams over TCP (feature `tls`): how a descriptor's bytes, a fabric
//! handle above all, cross a network, or a loopback that other users can reach.
//!
//! A byte stream authenticates no one: on TCP, loopback included, whoever connects first is
//! who gets the bytes, and a `CUDA_FABRIC` descriptor's handles are bearer tokens (whoever holds
//! them, with an IMEX channel, maps the memory read-write). So a descriptor crosses a network
//! only on a [`TlsStream`], made by rustls (TLS 1.3, the `ring` provider, synchronous: no async
//! runtime), both ways authenticated:
//!
//! - each side checks the other's certificate chain by the trust rules of `docs/security.md`,
//!   which the Python peer enforces the same: the roots it was given (at most
//!   [`MAX_INTERMEDIATES`] intermediates, each issuer with `keyCertSign`), the validity
//!   period, the key usages of its role (`digitalSignature`; `clientAuth` for the side that
//!   connects, `serverAuth` for the side that accepts), no CA leaf, the CRLs it was given for
//!   the whole chain (failing closed on a stale CRL or a CA without one), and then an explicit
//!   allow-list: a subject-alternative name compared whole ([`PeerCheck::Names`]) or the
//!   SHA-256 of the public key ([`PeerCheck::SpkiSha256`]). There is no "anyone the CA
//!   signed";
//! - these checks run inside the handshake, and a stream exists only once the handshake has
//!   finished. On the accepting side that is after the client's certificate passed: in TLS
//!   1.3 the client finishes its handshake before the server has checked the client's
//!   certificate, so the server must not write before its own check has passed, and here it
//!   cannot (it has no stream to write to). A refused peer gets a TLS alert and a close, never
//!   an application byte;
//! - there is no plaintext fallback: a peer that does not speak TLS is refused
//!   ([`TlsReason::NotTls`](crate::error::TlsReason::NotTls));
//! - the handshake has a deadline ([`TlsOptions::handshake_timeout`]), and every read and write
//!   of a stream ends by the deadline its reader or writer set (`vmm_core::peer::stream` sets one
//!   per message, [`TimedStream`](crate::wire::TimedStream)) or, with none set, by
//!   [`TlsOptions::message_timeout`] per call;
//! - [`TlsListener`] runs handshakes side by side (at most [`MAX_HANDSHAKES`]), so a client
//!   that connects first and stalls, or sends plaintext, delays no one and holds no more than
//!   its slot until its deadline; no session is resumed (every connection is checked in full);
//! - a flood of such clients starves no one: the listener never stops accepting, at its cap a
//!   new connection ends a handshake the listener has not answered yet (no whole ClientHello),
//!   the oldest of the address holding the most, and handshakes that can move are driven
//!   before new connections are accepted; [`TlsConnector::connect`] makes a new connection
//!   attempt soon ([`CONNECT_ATTEMPT`]) when a flood made the kernel drop its SYN. Tested with
//!   another process flooding the listener as fast as it can (`docs/security.md`, "Listeners
//!   that a flood cannot starve", says at what rate).
//!
//! A plain `TcpStream` or `UnixStream` stays usable with `peer::stream` for a channel the
//! caller has already authenticated (an SSH tunnel, a socketpair between its own processes):
//! that is the caller's explicit choice, never this module's fallback.
//!
//! ```
//! # use vmm_core::wire::tls::{PeerCheck, TlsConnector, TlsListener, TlsOptions};
//! # fn demo(exporter: TlsOptions, importer: TlsOptions) -> vmm_core::Result<()> {
//! // The exporter admits only the importer's name, the importer only the exporter's.
//! let exporter = exporter.peer_check(PeerCheck::names(["importer.example"])?);
//! let importer = importer.peer_check(PeerCheck::names(["exporter.example"])?);
//! let listener = TlsListener::bind("127.0.0.1:0", &exporter)?;
//! let addr = listener.local_addr()?;
//! let client = std::thread::spawn(move || TlsConnector::new(&importer)?.connect(addr));
//! let stream = listener.accept(None)?; // the importer's certificate passed every check
//! # drop((stream, client)); Ok(()) }
//! ```

mod handshake;
mod tls_listener;
mod tls_options;
mod tls_stream;
mod verify;

pub use handshake::{CONNECT_ATTEMPT, TlsAcceptor, TlsConnector};
pub use tls_listener::{LISTEN_BACKLOG, MAX_HANDSHAKES, TlsListener, TlsRefusal};
pub use tls_options::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MESSAGE_TIMEOUT, MAX_ALLOWED_PEERS, PeerCheck, TlsIdentity,
    TlsOptions,
};
pub use tls_stream::TlsStream;
pub use verify::{MAX_INTERMEDIATES, spki_sha256};
