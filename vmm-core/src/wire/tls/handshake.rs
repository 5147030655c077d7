//! The two sides' configurations and their blocking handshakes: [`TlsAcceptor`] (the side that
//! accepts a TCP connection) and [`TlsConnector`] (the side that connects). Both are mutual:
//! each checks the other's certificate in the handshake (see `verify`), and a stream exists
//! only once the handshake, those checks included, has finished.

use std::fmt;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::client::Resumption;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::server::NoServerSessionStorage;
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};

use super::tls_options::{PeerCheck, TlsOptions};
use super::tls_stream::{DeadlineSocket, TlsStream, io_to_error};
use super::verify::{PeerRole, PeerVerifier};
use crate::error::{OptionRule, TlsStep};
use crate::{Error, Result};

/// How much longer each connection attempt of [`TlsConnector::connect`] waits for an answer
/// than the one before (the first waits this long, the second twice as long, ...).
pub const CONNECT_ATTEMPT: Duration = Duration::from_millis(50);

/// The name a connector asks for (SNI) when its peers are pinned by key, not named: a name that
/// means nothing, as the pin alone admits the server.
const PINNED_SNI: &str = "vmm-ipc-peer.invalid";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_error(what: &'static str) -> impl Fn(rustls::Error) -> Error {
    move |e| {
        Error::option(
            what,
            OptionRule::Unsupported,
            format!("rustls refused it ({e})"),
        )
    }
}

/// The accepting side's configuration: its certificate, and the client certificates it admits.
#[derive(Clone)]
pub struct TlsAcceptor {
    pub(super) config: Arc<ServerConfig>,
    pub(super) handshake_timeout: Duration,
    pub(super) message_timeout: Option<Duration>,
}

impl fmt::Debug for TlsAcceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsAcceptor")
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl TlsAcceptor {
    /// The accepting side of `options`: TLS 1.3 only, a client certificate required, no
    /// session resumption (every connection is checked in full).
    pub fn new(options: &TlsOptions) -> Result<TlsAcceptor> {
        options.check()?;
        let verifier = PeerVerifier::new(options, PeerRole::Client)?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config_error("tls protocol versions"))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                options.identity.chain.clone(),
                options.identity.key.clone_key(),
            )
            .map_err(config_error("tls identity"))?;
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(NoServerSessionStorage {});
        Ok(TlsAcceptor {
            config: Arc::new(config),
            handshake_timeout: options.handshake_timeout,
            message_timeout: options.message_timeout,
        })
    }

    /// The handshake on an accepted connection, blocking, bounded by the handshake timeout.
    /// The stream is returned only once the client's certificate passed every check; a
    /// refused client was sent an alert and nothing else ([`Error::Tls`] at
    /// [`TlsStep::Handshake`]).
    pub fn accept(&self, tcp: TcpStream) -> Result<TlsStream> {
        let peer = peer_of(&tcp)?;
        let conn = ServerConnection::new(Arc::clone(&self.config))
            .map_err(config_error("tls server connection"))?;
        handshake(
            Connection::Server(conn),
            tcp,
            peer,
            self.handshake_timeout,
            self.message_timeout,
        )
    }
}

/// The connecting side's configuration: its certificate, and the server certificates it
/// admits.
#[derive(Clone)]
pub struct TlsConnector {
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    handshake_timeout: Duration,
    message_timeout: Option<Duration>,
}

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector")
            .field("server_name", &self.server_name)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl TlsConnector {
    /// The connecting side of `options`: TLS 1.3 only, this side's certificate presented, no
    /// session resumption. It asks for (SNI) the first allowed name.
    pub fn new(options: &TlsOptions) -> Result<TlsConnector> {
        options.check()?;
        let verifier = PeerVerifier::new(options, PeerRole::Server)?;
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config_error("tls protocol versions"))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(
                options.identity.chain.clone(),
                options.identity.key.clone_key(),
            )
            .map_err(config_error("tls identity"))?;
        config.resumption = Resumption::disabled();
        let name = match &options.peer {
            PeerCheck::Names(names) => names[0].clone(),
            PeerCheck::SpkiSha256(_) => PINNED_SNI.to_owned(),
        };
        let server_name = ServerName::try_from(name.clone()).map_err(|_| {
            Error::option(
                "tls allowed names",
                OptionRule::Form,
                format!("{name:?} is neither a DNS name nor an IP address"),
            )
        })?;
        Ok(TlsConnector {
            config: Arc::new(config),
            server_name,
            handshake_timeout: options.handshake_timeout,
            message_timeout: options.message_timeout,
        })
    }

    /// Connect to `addr` (the first of its addresses that answers) and make the handshake,
    /// both within the handshake timeout. A connection attempt that gets no answer is made
    /// again, waiting [`CONNECT_ATTEMPT`] longer each time (the kernel would wait 1 s, then
    /// 2 s, ... before sending its SYN again): a listener whose kernel queue a flood keeps
    /// full drops SYNs, and one that comes back soon finds room sooner. The stream is returned once the server's
    /// certificate passed every check; the server's check of this side's certificate ends
    /// after that in TLS 1.3, so a refusal by the server shows on the first read
    /// ([`TlsReason::RefusedByPeer`](crate::error::TlsReason::RefusedByPeer)).
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<TlsStream> {
        let started = Instant::now();
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolving the TLS peer's address", e))?
            .collect();
        let mut last = None;
        'addrs: for addr in addrs {
            let mut attempt = Duration::ZERO;
            loop {
                let left = self.handshake_timeout.saturating_sub(started.elapsed());
                if left.is_zero() {
                    break 'addrs;
                }
                attempt += CONNECT_ATTEMPT;
                match TcpStream::connect_timeout(&addr, attempt.min(left)) {
                    Ok(tcp) => return self.handshake_within(tcp, started),
                    Err(e) => {
                        let again = e.kind() == std::io::ErrorKind::TimedOut;
                        last = Some(Error::io(format!("connecting to {addr}"), e));
                        if !again {
                            continue 'addrs;
                        }
                    }
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::Timeout {
            what: "connecting to the TLS peer".into(),
            after: started.elapsed(),
        }))
    }

    /// The handshake on a connected socket, blocking, bounded by the handshake timeout.
    pub fn connect_stream(&self, tcp: TcpStream) -> Result<TlsStream> {
        self.handshake_within(tcp, Instant::now())
    }

    fn handshake_within(&self, tcp: TcpStream, started: Instant) -> Result<TlsStream> {
        let peer = peer_of(&tcp)?;
        let conn = ClientConnection::new(Arc::clone(&self.config), self.server_name.clone())
            .map_err(config_error("tls client connection"))?;
        let left = self.handshake_timeout.saturating_sub(started.elapsed());
        handshake(
            Connection::Client(conn),
            tcp,
            peer,
            left.max(Duration::from_millis(1)),
            self.message_timeout,
        )
    }
}

pub(super) fn peer_of(tcp: &TcpStream) -> Result<SocketAddr> {
    tcp.peer_addr()
        .map_err(|e| Error::io("reading a TCP peer's address", e))
}

/// Run `conn`'s handshake on `tcp` to its end within `timeout`, then hand both to a stream.
fn handshake(
    mut conn: Connection,
    tcp: TcpStream,
    peer: SocketAddr,
    timeout: Duration,
    message_timeout: Option<Duration>,
) -> Result<TlsStream> {
    let started = Instant::now();
    let _ = tcp.set_nodelay(true);
    let mut sock = DeadlineSocket::new(tcp, message_timeout);
    // A timeout too large to add to now (`Duration::MAX`) is no deadline.
    sock.set_deadlines(started.checked_add(timeout));
    let failed = |e| match io_to_error(e, TlsStep::Handshake, peer) {
        Error::Timeout { what, .. } => Error::Timeout {
            what,
            after: started.elapsed(),
        },
        other => other,
    };
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).map_err(failed)?;
    }
    // What the handshake still has to say (the client's last flight).
    while conn.wants_write() {
        conn.write_tls(&mut sock).map_err(failed)?;
    }
    sock.set_deadlines(None);
    Ok(match conn {
        Connection::Client(c) => TlsStream::client(c, sock, peer),
        Connection::Server(s) => TlsStream::server(s, sock, peer),
    })
}
