//! The exporter's side of a hand-off: a mutual-TLS listener that gives each admitted importer
//! the descriptor it asks for, if that object is still offered at that generation, and reports
//! how each hand-off ended.
//!
//! Who may import is decided in the handshake, by the options' allow-list of importer names
//! ([`PeerCheck`](vmm_core::wire::tls::PeerCheck)): a stream exists only once the importer's
//! certificate has passed, so a refused importer gets a TLS alert and not one byte of ours.
//! Each admitted importer is served on a thread of its own (at most [`MAX_IN_FLIGHT`] at
//! once), every message within the server's deadline, so one that stalls holds only itself.
//!
//! An offer may carry metadata, opaque bytes sent after the descriptor to an importer of
//! hand-off version 2 (an importer of version 1 gets the descriptor alone, as before).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_core::cuda::FabricDescriptor;
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::wire::tls::{TlsListener, TlsOptions, TlsRefusal, TlsStream};

use crate::handoff::{Ack, HANDOFF_VERSION, Refusal, Request, Unsupported, decode, encode};
use crate::handoff_error::ServeError;
use crate::handoff_metadata;
use crate::locator::ExportedObject;

/// How many importers are served at once; one more is closed at once (and reported).
pub const MAX_IN_FLIGHT: usize = 32;

/// How often the serving thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(100);

/// How one hand-off ended.
#[derive(Debug)]
pub enum Outcome {
    /// The importer imported and said so.
    Acknowledged,
    /// The importer received the descriptor and said its import failed.
    ImportFailed,
    /// The object is not offered at the generation asked for: a refusal was sent, no
    /// descriptor.
    Refused {
        /// What is offered of it now, if anything.
        serving: Option<u64>,
    },
    /// The hand-off broke off (a refused message, a cut stream, a deadline, too many at once).
    Failed(ServeError),
}

/// One hand-off, as the exporter saw it.
#[derive(Debug)]
pub struct Served {
    /// The importer's address (its certificate passed the allow-list).
    pub importer: SocketAddr,
    /// What it asked for, once known.
    pub request: Option<(ExportedObject, u64)>,
    /// How it ended.
    pub outcome: Outcome,
}

/// One object's offer: its generation, its descriptor and its metadata (shared with the
/// hand-offs under way).
#[derive(Debug, Clone)]
struct Offer {
    generation: u64,
    descriptor: FabricDescriptor,
    metadata: Arc<[u8]>,
}

type Offers = Arc<Mutex<HashMap<ExportedObject, Offer>>>;

/// A listener serving this process's offered descriptors to admitted importers. Dropping it
/// stops accepting (hand-offs under way end by their deadlines).
#[derive(Debug)]
pub struct ExportServer {
    addr: SocketAddr,
    listener: Arc<TlsListener>,
    offers: Offers,
    served: mpsc::Receiver<Served>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ExportServer {
    /// Listen on `addr` with `options` (this exporter's certificate, the roots, and the
    /// importer names it admits), each message of a hand-off within `message_timeout`.
    pub fn bind(
        addr: impl ToSocketAddrs,
        options: &TlsOptions,
        message_timeout: Duration,
    ) -> Result<ExportServer, ServeError> {
        let listener = Arc::new(
            TlsListener::bind(addr, options).map_err(|e| ServeError::Listen(Box::new(e)))?,
        );
        let addr = listener
            .local_addr()
            .map_err(|e| ServeError::Listen(Box::new(e)))?;
        let offers = Offers::default();
        let (report, served) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let serving = Serving {
            listener: listener.clone(),
            offers: offers.clone(),
            report,
            stop: stop.clone(),
            timeout: message_timeout,
            in_flight: Arc::new(AtomicUsize::new(0)),
        };
        let thread = std::thread::Builder::new()
            .name("vmm-registry-serve".into())
            .spawn(move || serving.run())
            .map_err(ServeError::Thread)?;
        Ok(ExportServer {
            addr,
            listener,
            offers,
            served,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens (the locator's `exporter_addr`, or what a node's address maps to).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Offer `descriptor` as `object` at `generation`, replacing what was offered of it (an
    /// importer holding an older generation's locator is then refused:
    /// [`FetchError::Stale`](crate::FetchError::Stale)). No metadata goes with it.
    pub fn offer(&self, object: ExportedObject, generation: u64, descriptor: FabricDescriptor) {
        self.offer_with_metadata(object, generation, descriptor, Vec::new());
    }

    /// [`offer`](Self::offer), with `metadata` sent after the descriptor to each importer
    /// ([`Fetched::metadata`](crate::Fetched::metadata)), which takes it only up to the cap it
    /// chose ([`Fetcher::max_metadata`](crate::Fetcher::max_metadata)).
    pub fn offer_with_metadata(
        &self,
        object: ExportedObject,
        generation: u64,
        descriptor: FabricDescriptor,
        metadata: Vec<u8>,
    ) {
        let offer = Offer {
            generation,
            descriptor,
            metadata: metadata.into(),
        };
        lock(&self.offers).insert(object, offer);
    }

    /// Stop offering `object`; whether it was offered.
    pub fn withdraw(&self, object: &ExportedObject) -> bool {
        lock(&self.offers).remove(object).is_some()
    }

    /// The next finished hand-off, waiting up to `timeout`.
    pub fn next_served(&self, timeout: Duration) -> Option<Served> {
        self.served.recv_timeout(timeout).ok()
    }

    /// The most recent importers refused in the handshake (a name not allowed, no
    /// certificate, ...), oldest first.
    pub fn refused(&self) -> Vec<TlsRefusal> {
        self.listener.refused()
    }
}

impl Drop for ExportServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the serving thread owns.
struct Serving {
    listener: Arc<TlsListener>,
    offers: Offers,
    report: mpsc::Sender<Served>,
    stop: Arc<AtomicBool>,
    timeout: Duration,
    in_flight: Arc<AtomicUsize>,
}

impl Serving {
    fn run(self) {
        while !self.stop.load(Ordering::SeqCst) {
            let stream = match self.listener.accept(Some(POLL)) {
                Ok(stream) => stream,
                // A timeout, or out of fds (the connection stays queued): look again.
                Err(vmm_core::Error::Timeout { .. }) => continue,
                Err(_) => {
                    std::thread::sleep(POLL);
                    continue;
                }
            };
            let importer = stream.peer_addr();
            if self.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                drop(stream);
                let _ = self.report.send(Served {
                    importer,
                    request: None,
                    outcome: Outcome::Failed(ServeError::Busy),
                });
                continue;
            }
            let (offers, report, in_flight) = (
                self.offers.clone(),
                self.report.clone(),
                self.in_flight.clone(),
            );
            let timeout = self.timeout;
            let spawned = std::thread::Builder::new()
                .name("vmm-registry-handoff".into())
                .spawn(move || {
                    let served = hand_off(stream, &offers, timeout);
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let _ = report.send(served);
                });
            if let Err(e) = spawned {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                let _ = self.report.send(Served {
                    importer,
                    request: None,
                    outcome: Outcome::Failed(ServeError::Thread(e)),
                });
            }
        }
    }
}

/// Serve one admitted importer: read its request, answer with the descriptor or a refusal,
/// and read its acknowledgement.
fn hand_off(mut stream: TlsStream, offers: &Offers, timeout: Duration) -> Served {
    let importer = stream.peer_addr();
    let mut request = None;
    let outcome = match exchange(&mut stream, offers, timeout, &mut request) {
        Ok(outcome) => {
            // TLS's closing message, so the importer reads a clean end.
            let _ = stream.close();
            outcome
        }
        Err(e) => Outcome::Failed(e),
    };
    Served {
        importer,
        request,
        outcome,
    }
}

fn exchange(
    stream: &mut TlsStream,
    offers: &Offers,
    timeout: Duration,
    asked: &mut Option<(ExportedObject, u64)>,
) -> Result<Outcome, ServeError> {
    let request: Request = read_data(stream, timeout)?;
    *asked = Some((request.object.clone(), request.generation));
    if !(1..=HANDOFF_VERSION).contains(&request.version) {
        write(
            stream,
            timeout,
            &encode(&Unsupported {
                speaks: HANDOFF_VERSION,
            }),
        )?;
        return Err(ServeError::Version {
            asked: request.version,
        });
    }
    let offered = lock(offers).get(&request.object).cloned();
    match offered {
        Some(offer) if offer.generation == request.generation => {
            StreamWriter::new(&mut *stream)
                .with_timeout(Some(timeout))
                .write_descriptor(&offer.descriptor)
                .map_err(|e| ServeError::Stream(Box::new(e)))?;
            if request.version >= 2 {
                let header = handoff_metadata::header(&offer.metadata);
                write(stream, timeout, &encode(&header))?;
                // More than the importer takes: it refuses the header, and says so.
                if request.max_metadata.is_none_or(|max| header.bytes <= max) {
                    for page in handoff_metadata::pages(&offer.metadata) {
                        write(stream, timeout, &page)?;
                    }
                }
            }
            // The descriptor stays offered: a fabric handle does not keep the memory alive,
            // the exporter's buffer does, and the acknowledgement says it is in use.
            let ack: Ack = read_data(stream, timeout)?;
            Ok(if ack.imported {
                Outcome::Acknowledged
            } else {
                Outcome::ImportFailed
            })
        }
        other => {
            let serving = other.map(|offer| offer.generation);
            write(stream, timeout, &encode(&Refusal { serving }))?;
            Ok(Outcome::Refused { serving })
        }
    }
}

/// Send `bytes` as a `DATA` message.
fn write(stream: &mut TlsStream, timeout: Duration, bytes: &[u8]) -> Result<(), ServeError> {
    StreamWriter::new(&mut *stream)
        .with_timeout(Some(timeout))
        .write_data(bytes)
        .map_err(|e| ServeError::Stream(Box::new(e)))
}

/// The importer's next message, a `DATA` one decoded as `T`.
fn read_data<T: serde::de::DeserializeOwned>(
    stream: &mut TlsStream,
    timeout: Duration,
) -> Result<T, ServeError> {
    let message = StreamReader::new(&mut *stream)
        .with_timeout(Some(timeout))
        .read_message()
        .map_err(|e| ServeError::Stream(Box::new(e)))?;
    match message {
        PeerMessage::Data(bytes) => decode(&bytes).map_err(ServeError::Message),
        PeerMessage::Descriptor(_) => Err(ServeError::Unexpected("a descriptor")),
    }
}
