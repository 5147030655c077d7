//! The importer's side of a hand-off: fetch a resolved [`Locator`]'s descriptor over the
//! mutual-TLS stream from its exporter, then acknowledge the import.
//!
//! The importer admits only the exporter the locator names: its certificate must carry the
//! locator's `exporter_name` (checked in the handshake, before a byte of the descriptor is
//! read). The exporter, for its part, has checked this importer's name before writing any.
//! A stale locator (its exporter gone, or the generation no longer served) fails with
//! [`FetchError::ExporterGone`] or [`FetchError::Stale`] ([`FetchError::is_stale`]), and the
//! descriptor is checked against the locator (its size, its device) before it is handed out.
//!
//! The descriptor is followed by the offer's metadata (hand-off version 2): the importer
//! takes at most [`Fetcher::max_metadata`] bytes of it, checked against the exporter's
//! announcement before anything is allocated, and page by page as it arrives
//! ([`crate::handoff_metadata`]). A fetch whose metadata is refused hands out nothing: the
//! exporter is told the import failed.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use vmm_core::cuda::FabricDescriptor;
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::wire::tls::{PeerCheck, TlsConnector, TlsOptions, TlsStream};

use crate::handoff::{Ack, Answer, HANDOFF_VERSION, Request, decode, encode};
use crate::handoff_error::FetchError;
use crate::handoff_metadata::{DEFAULT_MAX_METADATA, MetadataError, check_header, check_page};
use crate::locator::{HandleKind, Locator};

/// Fetches descriptors with one identity: this importer's certificate and the roots it
/// trusts. The allowed exporter name is each locator's own.
#[derive(Debug, Clone)]
pub struct Fetcher {
    options: TlsOptions,
    timeout: Duration,
    max_metadata: usize,
}

impl Fetcher {
    /// Fetch with `options`' identity and roots (its allow-list is replaced by each locator's
    /// `exporter_name`), each message within `timeout`, taking at most
    /// [`DEFAULT_MAX_METADATA`] bytes of metadata.
    pub fn new(options: TlsOptions, timeout: Duration) -> Fetcher {
        Fetcher {
            options,
            timeout,
            max_metadata: DEFAULT_MAX_METADATA,
        }
    }

    /// Take at most `bytes` of an offer's metadata: an exporter that announces more is
    /// refused ([`MetadataError::TooLarge`]) before anything is allocated for it.
    pub fn max_metadata(mut self, bytes: usize) -> Fetcher {
        self.max_metadata = bytes;
        self
    }

    /// Connect to the locator's exporter, admit it only if its certificate names the locator's
    /// `exporter_name`, ask for the locator's object and generation, and check the descriptor
    /// against the locator. Import it, then [`Fetched::acknowledge`] (or
    /// [`Fetched::import_failed`]).
    pub fn fetch(&self, locator: &Locator) -> Result<Fetched, FetchError> {
        if locator.handle == HandleKind::PosixFd {
            return Err(FetchError::NotFetchable(locator.handle));
        }
        let addr = locator.exporter_addr;
        let exporter = PeerCheck::names([locator.exporter_name.as_str()]).map_err(|source| {
            FetchError::ExporterName {
                name: locator.exporter_name.clone(),
                source: Box::new(source),
            }
        })?;
        let options = self
            .options
            .clone()
            .peer_check(exporter)
            .handshake_timeout(self.timeout);
        let connector = TlsConnector::new(&options).map_err(|source| FetchError::ExporterName {
            name: locator.exporter_name.clone(),
            source: Box::new(source),
        })?;
        let mut stream = connector
            .connect(addr)
            .map_err(|source| connect_error(addr, source))?;
        let request = Request {
            object: locator.object.clone(),
            generation: locator.generation,
            version: HANDOFF_VERSION,
            max_metadata: Some(self.max_metadata as u64),
        };
        StreamWriter::new(&mut stream)
            .with_timeout(Some(self.timeout))
            .write_data(&encode(&request))
            .map_err(|source| stream_error(addr, source))?;
        let answer = StreamReader::new(&mut stream)
            .with_timeout(Some(self.timeout))
            .read_message()
            .map_err(|source| answer_error(addr, source))?;
        let descriptor = match answer {
            PeerMessage::Descriptor(descriptor) => descriptor
                .into_fabric()
                .map_err(|source| stream_error(addr, source))?,
            PeerMessage::Data(bytes) => {
                return Err(match decode(&bytes).map_err(FetchError::Answer)? {
                    Answer::Stale(refusal) => FetchError::Stale {
                        object: locator.object.clone(),
                        wanted: locator.generation,
                        serving: refusal.serving,
                    },
                    Answer::Unsupported(unsupported) => FetchError::Unsupported {
                        speaks: unsupported.speaks,
                    },
                });
            }
        };
        check(locator, &descriptor)?;
        let metadata = match self.read_metadata(&mut stream, addr)? {
            Ok(metadata) => metadata,
            Err(refused) => {
                // In step still (the refused message was read whole): say the import failed,
                // best effort, so the exporter does not count it as in use.
                let _ = StreamWriter::new(&mut stream)
                    .with_timeout(Some(self.timeout))
                    .write_data(&encode(&Ack { imported: false }));
                return Err(FetchError::Metadata(refused));
            }
        };
        Ok(Fetched {
            descriptor,
            metadata,
            stream,
            addr,
            timeout: self.timeout,
        })
    }

    /// The metadata that follows the descriptor: its header (checked against the cap before
    /// anything is allocated), then each page, checked as it comes, every page within one
    /// deadline of the header (an exporter that trickles pages holds the importer no longer
    /// than one that stops). The outer error is the stream's (cut, a deadline passed); the
    /// inner one a refusal of what was read.
    fn read_metadata(
        &self,
        stream: &mut TlsStream,
        addr: SocketAddr,
    ) -> Result<Result<Vec<u8>, MetadataError>, FetchError> {
        let mut next = |timeout: Duration| match StreamReader::new(&mut *stream)
            .with_timeout(Some(timeout))
            .read_message()
        {
            Ok(PeerMessage::Data(bytes)) => Ok(Ok(bytes)),
            Ok(PeerMessage::Descriptor(_)) => Ok(Err(MetadataError::NotData)),
            Err(source) => Err(stream_error(addr, source)),
        };
        let header =
            match next(self.timeout)?.and_then(|bytes| check_header(&bytes, self.max_metadata)) {
                Ok(header) => header,
                Err(refused) => return Ok(Err(refused)),
            };
        let deadline = Instant::now() + self.timeout;
        // At most `max_metadata`: checked by `check_header`.
        let mut metadata = Vec::with_capacity(usize::try_from(header.bytes).unwrap_or(0));
        for index in 0..header.pages {
            // What is left of the deadline (a millisecond at least: a read needs a timeout).
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let page = match next(left)? {
                Ok(page) => page,
                Err(refused) => return Ok(Err(refused)),
            };
            match check_page(&page, index, &header) {
                Ok(payload) => metadata.extend_from_slice(payload),
                Err(refused) => return Ok(Err(refused)),
            }
        }
        Ok(Ok(metadata))
    }
}

/// A descriptor fetched and checked against its locator, its metadata, and the stream to
/// acknowledge on.
pub struct Fetched {
    descriptor: FabricDescriptor,
    metadata: Vec<u8>,
    stream: TlsStream,
    addr: SocketAddr,
    timeout: Duration,
}

impl std::fmt::Debug for Fetched {
    /// The metadata by its length: it may be megabytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetched")
            .field("descriptor", &self.descriptor)
            .field("metadata_bytes", &self.metadata.len())
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Fetched {
    /// The descriptor: import it (`VirtualMemoryBuffer::import_fabric` for a fabric handle).
    pub fn descriptor(&self) -> &FabricDescriptor {
        &self.descriptor
    }

    /// The metadata the exporter offered with the descriptor (opaque bytes, empty when it
    /// offered none): a vmm-memd region's tensors, for one
    /// ([`region_metadata`](fn@crate::memd_publish::region_metadata)).
    pub fn metadata(&self) -> &[u8] {
        &self.metadata
    }

    /// Tell the exporter the import succeeded, and close the stream.
    pub fn acknowledge(self) -> Result<(), FetchError> {
        self.finish(true)
    }

    /// Tell the exporter the import failed, and close the stream.
    pub fn import_failed(self) -> Result<(), FetchError> {
        self.finish(false)
    }

    fn finish(mut self, imported: bool) -> Result<(), FetchError> {
        let addr = self.addr;
        StreamWriter::new(&mut self.stream)
            .with_timeout(Some(self.timeout))
            .write_data(&encode(&Ack { imported }))
            .map_err(|source| stream_error(addr, source))?;
        self.stream
            .close()
            .map_err(|source| stream_error(addr, source))
    }
}

/// The descriptor matches the locator: its size, and for a fabric handle the device that
/// owns the memory.
fn check(locator: &Locator, descriptor: &FabricDescriptor) -> Result<(), FetchError> {
    if descriptor.size() as u64 != locator.size {
        return Err(FetchError::Mismatch {
            what: "size",
            expected: locator.size.to_string(),
            got: descriptor.size().to_string(),
        });
    }
    if let (HandleKind::Fabric, Some(uuid)) = (locator.handle, &locator.device_uuid) {
        let got = gpu_uuid(descriptor.owner_uuid());
        if !got.eq_ignore_ascii_case(uuid) {
            return Err(FetchError::Mismatch {
                what: "device",
                expected: uuid.clone(),
                got,
            });
        }
    }
    Ok(())
}

/// A device UUID as `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`
/// (vmm-core's [`format_uuid`](vmm_core::cuda::format_uuid), the form locators carry).
pub fn gpu_uuid(uuid: &[u8; 16]) -> String {
    vmm_core::cuda::format_uuid(uuid)
}

/// A failed connection: nothing answering is a gone exporter; a TLS refusal is typed by its
/// reason.
fn connect_error(addr: SocketAddr, source: vmm_core::Error) -> FetchError {
    let source = Box::new(source);
    match &*source {
        vmm_core::Error::Tls { reason, .. } => FetchError::Tls {
            addr,
            reason: *reason,
            source,
        },
        vmm_core::Error::Timeout { .. } => FetchError::ExporterGone { addr, source },
        vmm_core::Error::Os { source: io, .. }
            if matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::ConnectionReset
                    | ErrorKind::HostUnreachable
                    | ErrorKind::NetworkUnreachable
                    | ErrorKind::TimedOut
            ) =>
        {
            FetchError::ExporterGone { addr, source }
        }
        _ => FetchError::Stream { addr, source },
    }
}

/// A failure reading the answer to the request: a stream that ends there, cleanly or not,
/// was closed unanswered (an exporter of hand-off version 1 refuses a version 2 request so);
/// anything else is as [`stream_error`].
fn answer_error(addr: SocketAddr, source: vmm_core::Error) -> FetchError {
    match source {
        vmm_core::Error::Disconnected(_)
        | vmm_core::Error::Tls {
            reason: vmm_core::error::TlsReason::Truncated,
            ..
        } => FetchError::Unanswered {
            addr,
            source: Box::new(source),
        },
        source => stream_error(addr, source),
    }
}

/// A failure after the connection: a TLS refusal (the exporter refused our certificate shows
/// on the first read in TLS 1.3) keeps its reason; anything else is the stream's.
fn stream_error(addr: SocketAddr, source: vmm_core::Error) -> FetchError {
    let source = Box::new(source);
    match &*source {
        vmm_core::Error::Tls { reason, .. } => FetchError::Tls {
            addr,
            reason: *reason,
            source,
        },
        _ => FetchError::Stream { addr, source },
    }
}
