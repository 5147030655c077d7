//! The errors of a hand-off: the importer's ([`FetchError`]) and the exporter's
//! ([`ServeError`]), typed so that a caller tells "the exporter is gone" from "that generation
//! is no longer served" from "the peer is not who the locator says" without reading a message.

use std::net::SocketAddr;

use vmm_core::error::TlsReason;

use crate::handoff::MessageError;
use crate::handoff_metadata::MetadataError;
use crate::locator::{ExportedObject, HandleKind};

/// Why fetching a locator's descriptor failed. Nothing was imported in any case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The locator's `exporter_name` cannot be admitted (not a DNS name or IP address).
    #[error("the locator's exporter name {name:?} cannot be checked")]
    ExporterName {
        /// The name.
        name: String,
        /// What vmm-core said.
        #[source]
        source: Box<vmm_core::Error>,
    },
    /// This kind of handle does not cross a network (a POSIX fd needs a Unix socket).
    #[error("a {0:?} handle cannot be fetched over the network")]
    NotFetchable(HandleKind),
    /// Nothing answers at the locator's address (refused, unreachable, or no answer to the
    /// connection within the handshake's deadline): the exporter is gone, and the locator
    /// is stale.
    #[error("no exporter at {addr}: the locator is stale")]
    ExporterGone {
        /// The locator's address.
        addr: SocketAddr,
        /// What the connection said.
        #[source]
        source: Box<vmm_core::Error>,
    },
    /// The TLS handshake failed: the exporter's certificate does not name the locator's
    /// `exporter_name` (or fails another check), or the exporter refused ours. No
    /// descriptor crossed.
    #[error("TLS with the exporter at {addr} failed: {reason}")]
    Tls {
        /// The locator's address.
        addr: SocketAddr,
        /// Why (`NameNotAllowed`: not the locator's exporter; `RefusedByPeer`: it refused us).
        reason: TlsReason,
        /// The whole error.
        #[source]
        source: Box<vmm_core::Error>,
    },
    /// The exporter no longer serves that object at that generation: the locator is stale.
    #[error(
        "the exporter does not serve {object:?} at generation {wanted} (it serves {serving:?})"
    )]
    Stale {
        /// The object asked for.
        object: ExportedObject,
        /// The generation asked for (the locator's).
        wanted: u64,
        /// The generation it serves now, if any.
        serving: Option<u64>,
    },
    /// The descriptor does not match the locator (its size, or the device that owns it).
    #[error("the descriptor's {what} is {got}, the locator says {expected}")]
    Mismatch {
        /// Which property.
        what: &'static str,
        /// What the locator says.
        expected: String,
        /// What the descriptor says.
        got: String,
    },
    /// The exporter's answer was not a descriptor nor a refusal it may send.
    #[error("the exporter's answer was refused")]
    Answer(#[source] MessageError),
    /// The exporter closed the stream without answering the request: it speaks hand-off
    /// version 1 (before metadata), which refuses a version 2 request so, or it was serving
    /// [`MAX_IN_FLIGHT`](crate::MAX_IN_FLIGHT) importers already.
    #[error("the exporter at {addr} closed the stream without answering (an older hand-off?)")]
    Unanswered {
        /// The locator's address.
        addr: SocketAddr,
        /// How the stream ended.
        #[source]
        source: Box<vmm_core::Error>,
    },
    /// The exporter does not speak this importer's hand-off version.
    #[error("the exporter speaks hand-off version {speaks} at most")]
    Unsupported {
        /// The highest version it speaks.
        speaks: u32,
    },
    /// The metadata that followed the descriptor was refused (announced past the importer's
    /// cap, a page out of form): nothing was handed out, and the exporter was told the
    /// import failed.
    #[error("the offer's metadata was refused")]
    Metadata(#[source] MetadataError),
    /// The stream failed (cut, a deadline passed, a message the protocol refuses).
    #[error("the hand-off stream with {addr} failed")]
    Stream {
        /// The locator's address.
        addr: SocketAddr,
        /// What vmm-core said.
        #[source]
        source: Box<vmm_core::Error>,
    },
}

impl FetchError {
    /// Whether the locator is stale: its exporter is gone or no longer serves it. Resolve or
    /// watch again; another error is not cured by that.
    pub fn is_stale(&self) -> bool {
        matches!(
            self,
            FetchError::ExporterGone { .. } | FetchError::Stale { .. }
        )
    }
}

/// Why serving exports failed, or how one hand-off ended badly (reported, never fatal to the
/// server).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The listener could not be made (the address, or the TLS options).
    #[error("listening for importers")]
    Listen(#[source] Box<vmm_core::Error>),
    /// The serving thread could not be started.
    #[error("starting the serving thread")]
    Thread(#[source] std::io::Error),
    /// The importer's request or acknowledgement was refused.
    #[error("the importer's message was refused")]
    Message(#[source] MessageError),
    /// The stream with an importer failed (cut, a deadline passed, a refused message).
    #[error("the hand-off stream failed")]
    Stream(#[source] Box<vmm_core::Error>),
    /// The importer asked in a version of the hand-off this exporter does not speak (it was
    /// told the version it does).
    #[error("the importer asked in hand-off version {asked}")]
    Version {
        /// The version it asked in.
        asked: u32,
    },
    /// The importer sent a message of the wrong kind (what it sent).
    #[error("the importer sent {0}, not a DATA message")]
    Unexpected(&'static str),
    /// [`MAX_IN_FLIGHT`](crate::serve::MAX_IN_FLIGHT) importers were being served: this one
    /// was closed at once.
    #[error("too many importers at once")]
    Busy,
}
