//! Peer messages on a byte stream (protocol version 2): a TCP connection, a pipe, a TLS
//! session, anything that is [`Read`] or [`Write`].
//!
//! The bytes are those of a named endpoint's packet, frame byte `0x00` first, messages back to
//! back (docs/protocol.md, "Byte streams"). Only messages without fds cross a stream:
//! `CUDA_FABRIC` ([`StreamWriter::write_descriptor`]) and `DATA`
//! ([`StreamWriter::write_data`]); [`StreamReader::read_message`] refuses every other kind.
//!
//! A stream has no packet boundaries and no credentials, so:
//! - the reader reads the frame byte and the 64-byte header first and checks them (every rule
//!   the header alone decides: magic, version, kind and its version, flags, counts against
//!   [`MAX_CHUNKS`](crate::peer::MAX_CHUNKS) and
//!   [`MAX_DATA`](crate::peer::MAX_DATA), device and location fields, the kind's
//!   rules) before it reads or allocates anything more; then it reads exactly the chunk sizes
//!   and payload the header announced (at most `8 * 253 + 16384` bytes) and checks the rest;
//! - the header is checked as its bytes arrive: a wrong magic, an unknown version or a kind a
//!   stream does not carry is refused as soon as the bytes read decide it;
//! - every message is read (or written) whole within one deadline ([`DEFAULT_TIMEOUT`], or
//!   [`StreamReader::with_timeout`]), set again before every read to what is left of it
//!   ([`TimedStream`]): a peer that sends one byte at a time, or stops reading, holds the
//!   other side no longer than that. The deadline runs from the call, so waiting for a message
//!   counts. [`StreamReader::untimed`] and [`StreamWriter::untimed`] are for streams the caller
//!   bounds itself (bytes in memory, say);
//! - any refusal or failure ends the stream: after a bad or cut message nobody can know where
//!   the next one starts, so a [`StreamReader`] (and a [`StreamWriter`] whose write failed part
//!   way) refuses every later call, and the application should drop the stream;
//! - a stream authenticates no one: on TCP, loopback included, whoever connects first gets
//!   the bytes, and a fabric handle is a bearer token (see
//!   [`cuda::fabric`](crate::cuda::fabric)). Across a network, or wherever another user can
//!   connect, run these messages on a mutual-TLS stream (`vmm_core::wire::tls`, feature
//!   `tls`); a plain socket is for a channel the caller has already authenticated, and says so
//!   by name ([`CallerAuthenticated`](crate::wire::CallerAuthenticated)): the reader and writer
//!   take only an [`AuthenticatedStream`]. Nothing here
//!   prints a handle byte.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use vmm_core::cuda::{FabricDescriptor, FabricHandle};
//! use vmm_core::peer::PeerMessage;
//! use vmm_core::peer::stream::{StreamReader, StreamWriter};
//! use vmm_core::wire::CallerAuthenticated;
//!
//! // A socketpair between this process's own threads: the caller knows who is at the other
//! // end, and says so. (Across a network: a `wire::tls::TlsStream`, feature `tls`.)
//! let (near, far) = UnixStream::pair()?;
//! let handle = FabricHandle::from_bytes([7; 64]); // from VirtualMemoryBuffer::export_fabric
//! let descriptor = FabricDescriptor::from_handles(&[handle], &[2 << 20], 2 << 20, [1; 16])?;
//! let mut writer = StreamWriter::new(CallerAuthenticated::new(near));
//! writer.write_descriptor(&descriptor)?;
//! writer.write_data(b"import it, then say so")?;
//!
//! let mut reader = StreamReader::new(CallerAuthenticated::new(&far));
//! let PeerMessage::Descriptor(received) = reader.read_message()? else { unreachable!() };
//! let received = received.into_fabric()?; // VirtualMemoryBuffer::import_fabric(&received)
//! assert_eq!(received.handles(), descriptor.handles());
//! assert!(matches!(reader.read_message()?, PeerMessage::Data(d) if d == b"import it, then say so"));
//! drop(writer); // closes `near`: the reader sees the end of the stream
//! assert!(matches!(reader.read_message(), Err(vmm_core::Error::Disconnected(_))));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A plain socket is no default: handing one over without saying so does not compile.
//!
//! ```compile_fail
//! use std::net::TcpStream;
//! use vmm_core::peer::stream::StreamReader;
//!
//! fn read_from(tcp: &TcpStream) {
//!     let _ = StreamReader::new(tcp); // not an AuthenticatedStream
//! }
//! ```

use std::fmt;
use std::io::{self, ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use super::PeerMessage;
use super::codec::{fabric_frame, from_frame};
use super::frame::{Frame, HEADER_LEN, Kind};
use crate::cuda::FabricDescriptor;
use crate::error::ProtocolRule;
use crate::wire::{AuthenticatedStream, TimedStream};
use crate::{Error, Result};

/// How long one message may take to read or write whole, by default: 10 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Sets a stream's read or write deadline (a [`TimedStream`] setter, or none).
type SetDeadline<S> = fn(&S, Option<Instant>) -> io::Result<()>;

/// How a reader or writer bounds one message: a timeout, and how to set the stream's deadline
/// before each read or write (none for a stream the caller bounds itself).
struct Timing<S> {
    timeout: Option<Duration>,
    set_deadline: Option<SetDeadline<S>>,
}

impl<S> Timing<S> {
    fn untimed() -> Self {
        Timing {
            timeout: None,
            set_deadline: None,
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.timeout.and_then(|t| Instant::now().checked_add(t))
    }
}

fn read_deadline<S: TimedStream>(stream: &S, deadline: Option<Instant>) -> io::Result<()> {
    stream.set_read_deadline(deadline)
}

fn write_deadline<S: TimedStream>(stream: &S, deadline: Option<Instant>) -> io::Result<()> {
    stream.set_write_deadline(deadline)
}

/// An I/O failure of a stream as the crate's error: the typed error a TLS stream put inside it,
/// a timeout (when the message had a deadline), or [`Error::Os`].
fn stream_error(e: io::Error, what: &str, started: Instant, deadline: Option<Instant>) -> Error {
    match e.kind() {
        ErrorKind::TimedOut | ErrorKind::WouldBlock if deadline.is_some() => Error::Timeout {
            what: format!("{what} (the whole message's deadline)"),
            after: started.elapsed(),
        },
        _ if e.get_ref().is_some_and(|inner| inner.is::<Error>()) => {
            match e.into_inner().map(|inner| inner.downcast::<Error>()) {
                Some(Ok(error)) => *error,
                Some(Err(inner)) => Error::io(what.to_owned(), io::Error::other(inner)),
                None => Error::io(what.to_owned(), io::Error::other("unknown")),
            }
        }
        _ => Error::io(what.to_owned(), e),
    }
}

/// The frame byte every message starts with, on a stream as in a packet.
const FRAME_BYTE: u8 = 0x00;

/// What a stream is called in errors.
const STREAM: &str = "peer stream";

/// Writes peer messages without fds (`CUDA_FABRIC`, `DATA`) to a byte stream, each with one
/// `write_all` and then a `flush`, the whole message within one deadline.
///
/// A message the protocol cannot carry is refused ([`Error::InvalidOption`],
/// [`Error::TooLarge`]) before a byte
/// of it is written. A write that fails leaves the stream holding part of a message, so every
/// later write is refused too ([`Error::Protocol`]). Its `Debug` shows nothing of the stream.
pub struct StreamWriter<W> {
    writer: W,
    timing: Timing<W>,
    failed: bool,
}

impl<W: Write + AuthenticatedStream> StreamWriter<W> {
    /// A writer of peer messages to `writer`: a mutual-TLS stream (`&mut TlsStream`), or a
    /// plain socket the caller vouches for
    /// ([`CallerAuthenticated`](crate::wire::CallerAuthenticated)`::new(&tcp)`), each message
    /// written whole within [`DEFAULT_TIMEOUT`]
    /// ([`with_timeout`](Self::with_timeout) sets another): a peer that stops reading holds a
    /// write no longer than that.
    pub fn new(writer: W) -> Self {
        StreamWriter {
            writer,
            timing: Timing {
                timeout: Some(DEFAULT_TIMEOUT),
                set_deadline: Some(write_deadline::<W>),
            },
            failed: false,
        }
    }
}

impl<W: Write> StreamWriter<W> {
    /// A writer to bytes in memory (a `Vec`, a buffer), or to a stream the caller both
    /// authenticates and bounds itself: no deadline is set and nothing is asked of the stream.
    /// For a socket, use [`new`](Self::new).
    pub fn untimed(writer: W) -> Self {
        StreamWriter {
            writer,
            timing: Timing::untimed(),
            failed: false,
        }
    }

    /// Each message written whole within `timeout` (`None`: no limit); it has effect on a
    /// writer made by [`new`](Self::new).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timing.timeout = timeout;
        self
    }

    /// Write `descriptor` as a `CUDA_FABRIC` message (protocol version 2): its chunk sizes,
    /// size, owner and location, and one 64-byte handle per chunk. The handles are bearer
    /// tokens: write them only to a stream whose reader may have the memory, and keep the
    /// buffer until that reader says it has imported.
    ///
    /// Refused for a descriptor of no chunks ([`Error::InvalidOption`]), of more than
    /// [`MAX_CHUNKS`](crate::peer::MAX_CHUNKS), or whose owner's ordinal does not fit
    /// 32 bits ([`Error::TooLarge`]).
    pub fn write_descriptor(&mut self, descriptor: &FabricDescriptor) -> Result<()> {
        let frame = fabric_frame(descriptor)?;
        self.write_frame(&frame)
    }

    /// Write application bytes as a `DATA` message (at most
    /// [`MAX_DATA`](crate::peer::MAX_DATA) bytes).
    pub fn write_data(&mut self, bytes: &[u8]) -> Result<()> {
        self.write_frame(&Frame::with_payload(Kind::Data, bytes))
    }

    /// The stream.
    pub fn get_ref(&self) -> &W {
        &self.writer
    }

    /// The stream, given back.
    pub fn into_inner(self) -> W {
        self.writer
    }

    fn write_frame(&mut self, frame: &Frame) -> Result<()> {
        if self.failed {
            return Err(Error::protocol(
                ProtocolRule::StreamFailed,
                format!(
                    "{STREAM}: an earlier write failed part way through a message, so the stream \
                 can carry no more"
                ),
            ));
        }
        let bytes = frame.encode()?;
        let mut packet = Vec::with_capacity(1 + bytes.len());
        packet.push(FRAME_BYTE);
        packet.extend_from_slice(&bytes);
        let started = Instant::now();
        let deadline = self.timing.deadline();
        let set = self.timing.set_deadline;
        let writer = &mut self.writer;
        let written = set
            .map_or(Ok(()), |set| set(writer, deadline))
            .and_then(|()| writer.write_all(&packet))
            .and_then(|()| writer.flush());
        written.map_err(|source| {
            self.failed = true;
            stream_error(
                source,
                &format!("writing a {} message to a {STREAM}", frame.kind.name()),
                started,
                deadline,
            )
        })
    }
}

impl<W> fmt::Debug for StreamWriter<W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamWriter")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// Where a [`StreamReader`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    /// The stream ended cleanly, between messages.
    Closed,
    /// A message was refused, cut short, or a read failed.
    Failed,
}

/// Reads peer messages from a byte stream, one at a time: `CUDA_FABRIC` (a
/// [`Descriptor::Fabric`](super::Descriptor::Fabric)) and `DATA`; everything else is refused.
///
/// Every size in a header is checked against the protocol's maxima before anything more is
/// read or allocated (at most `1 + 64 + 8 * 253 + 16384` bytes per message). Any refusal or
/// failure ends the stream: every later [`read_message`](Self::read_message) is refused. Its
/// `Debug` shows nothing of the stream (whose buffer may hold handle bytes).
pub struct StreamReader<R> {
    reader: R,
    timing: Timing<R>,
    state: State,
}

impl<R> fmt::Debug for StreamReader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamReader")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<R: Read + AuthenticatedStream> StreamReader<R> {
    /// A reader of peer messages from `reader`: a mutual-TLS stream (`&mut TlsStream`), or a
    /// plain socket the caller vouches for
    /// ([`CallerAuthenticated`](crate::wire::CallerAuthenticated)`::new(&tcp)`), each message
    /// read whole within [`DEFAULT_TIMEOUT`]
    /// ([`with_timeout`](Self::with_timeout) sets another). The deadline is the message's, not
    /// each read's: it is set again before every read to what is left, so a peer that sends
    /// one byte at a time holds the reader no longer than it.
    pub fn new(reader: R) -> Self {
        StreamReader {
            reader,
            timing: Timing {
                timeout: Some(DEFAULT_TIMEOUT),
                set_deadline: Some(read_deadline::<R>),
            },
            state: State::Open,
        }
    }
}

impl<R: Read> StreamReader<R> {
    /// A reader of bytes in memory, or of a stream the caller both authenticates and bounds
    /// itself: no deadline is set and nothing is asked of the stream. For a socket, use
    /// [`new`](Self::new).
    pub fn untimed(reader: R) -> Self {
        StreamReader {
            reader,
            timing: Timing::untimed(),
            state: State::Open,
        }
    }

    /// Each message read whole within `timeout` (`None`: no limit); it has effect on a reader
    /// made by [`new`](Self::new).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timing.timeout = timeout;
        self
    }

    /// Read the next message.
    ///
    /// Errors: [`Error::Disconnected`] when the stream ends between messages (and for every
    /// call after that); [`Error::Protocol`] for a message that breaks docs/protocol.md, that
    /// the stream ended inside, or of a kind a stream does not carry (`CUDA_VMM` and
    /// `HOST_MEMFD` carry fds; `HELLO` and `REFUSED` belong to a named endpoint's
    /// handshake), and for every call after a failed one; [`Error::Os`] when reading fails.
    pub fn read_message(&mut self) -> Result<PeerMessage> {
        match self.state {
            State::Open => {}
            State::Closed => return Err(Error::Disconnected(STREAM.into())),
            State::Failed => {
                return Err(Error::protocol(
                    ProtocolRule::StreamFailed,
                    format!(
                        "{STREAM}: an earlier message was refused or cut short, so nothing more is \
                     read from it (after a bad message, nobody knows where the next one starts)"
                    ),
                ));
            }
        }
        let read = self.read_one();
        self.state = match &read {
            Ok(_) => State::Open,
            Err(Error::Disconnected(_)) => State::Closed,
            Err(_) => State::Failed,
        };
        read
    }

    /// The stream.
    pub fn get_ref(&self) -> &R {
        &self.reader
    }

    /// The stream, given back (where the last message ended, unless a read failed).
    pub fn into_inner(self) -> R {
        self.reader
    }

    fn read_one(&mut self) -> Result<PeerMessage> {
        let mut source = Source {
            reader: &mut self.reader,
            set_deadline: self.timing.set_deadline,
            deadline: self.timing.deadline(),
            started: Instant::now(),
        };
        // The frame byte and the header, a read at a time (never past the header: the next
        // bytes are the message's own, or the next message's), each part checked as it comes:
        // a wrong frame byte or magic, an unknown version or a kind a stream does not carry is
        // refused as soon as its bytes are there, not after the rest of the header.
        let mut head = [0u8; 1 + HEADER_LEN];
        let mut read = 0;
        while read < head.len() {
            let n = source.read_some(&mut head[read..])?;
            if n == 0 {
                if read == 0 {
                    return Err(Error::Disconnected(STREAM.into()));
                }
                break;
            }
            read += n;
            if head[0] != FRAME_BYTE {
                return Err(Error::protocol(
                    ProtocolRule::FrameByte,
                    format!(
                        "{STREAM}: frame byte {:#04x}: a message on a stream starts with 0x00",
                        head[0]
                    ),
                ));
            }
            Frame::check_stream_prefix(&head[1..read])?;
        }
        let got = read.saturating_sub(1);
        // Fewer than 64 bytes: the magic and the version are still checked first, then the
        // header is refused as partial.
        let body = Frame::check_stream_header(&head[1..1 + got])?;
        let len = HEADER_LEN + body;
        let mut message = Vec::new();
        message.try_reserve_exact(len).map_err(|_| {
            Error::io(
                format!("allocating {len} bytes for a message of a {STREAM}"),
                io::Error::from(ErrorKind::OutOfMemory),
            )
        })?;
        message.extend_from_slice(&head[1..]);
        message.resize(len, 0);
        let got = source.fill(&mut message[HEADER_LEN..])?;
        if got != body {
            return Err(Error::protocol(
                ProtocolRule::Truncated,
                format!(
                    "{STREAM}: it ended after {got} of the {body} bytes of chunk sizes and payload \
                 that the message's header announced (a message cut short)"
                ),
            ));
        }
        let frame = Frame::decode(&message, 0)?;
        from_frame(frame, Vec::new())
    }
}

/// One message's reads: each bounded by what is left of the message's deadline.
struct Source<'a, R> {
    reader: &'a mut R,
    set_deadline: Option<SetDeadline<R>>,
    deadline: Option<Instant>,
    started: Instant,
}

impl<R: Read> Source<'_, R> {
    /// One read into `buf` (0 at the end of the stream), within the message's deadline.
    fn read_some(&mut self, buf: &mut [u8]) -> Result<usize> {
        let deadline = self.deadline;
        let failed =
            |e, started| stream_error(e, &format!("reading from a {STREAM}"), started, deadline);
        loop {
            if let Some(set) = self.set_deadline {
                set(self.reader, self.deadline).map_err(|e| failed(e, self.started))?;
            }
            match self.reader.read(buf) {
                // A reader that claims more than it was given is not believed past the buffer.
                Ok(n) => return Ok(n.min(buf.len())),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(failed(e, self.started)),
            }
        }
    }

    /// Read into `buf` until it is full or the stream ends; how many bytes were read.
    fn fill(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut got = 0;
        while got < buf.len() {
            match self.read_some(&mut buf[got..])? {
                0 => break,
                n => got += n,
            }
        }
        Ok(got)
    }
}
