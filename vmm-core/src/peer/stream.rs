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
//! - any refusal or failure ends the stream: after a bad or cut message nobody can know where
//!   the next one starts, so a [`StreamReader`] (and a [`StreamWriter`] whose write failed part
//!   way) refuses every later call, and the application should drop the stream;
//! - who the peer is, and whether it may have the memory, is the stream's business (TLS, a
//!   VPN, an SSH tunnel, a loopback socket only your processes reach): a fabric handle is a
//!   bearer token (see [`cuda::fabric`](crate::cuda::fabric)). Nothing here prints a handle
//!   byte.
//!
//! ```
//! use std::os::unix::net::UnixStream;
//! use vmm_core::cuda::{FabricDescriptor, FabricHandle};
//! use vmm_core::peer::PeerMessage;
//! use vmm_core::peer::stream::{StreamReader, StreamWriter};
//!
//! let (near, far) = UnixStream::pair()?; // or a TcpStream, on either side
//! let handle = FabricHandle::from_bytes([7; 64]); // from VirtualMemoryBuffer::export_fabric
//! let descriptor = FabricDescriptor::from_handles(&[handle], &[2 << 20], 2 << 20, [1; 16])?;
//! let mut writer = StreamWriter::new(near); // a `&TcpStream` would do too
//! writer.write_descriptor(&descriptor)?;
//! writer.write_data(b"import it, then say so")?;
//!
//! let mut reader = StreamReader::new(&far);
//! let PeerMessage::Descriptor(received) = reader.read_message()? else { unreachable!() };
//! let received = received.into_fabric()?; // VirtualMemoryBuffer::import_fabric(&received)
//! assert_eq!(received.handles(), descriptor.handles());
//! assert!(matches!(reader.read_message()?, PeerMessage::Data(d) if d == b"import it, then say so"));
//! drop(writer); // closes `near`: the reader sees the end of the stream
//! assert!(matches!(reader.read_message(), Err(vmm_core::Error::Disconnected(_))));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::io::{self, ErrorKind, Read, Write};

use super::PeerMessage;
use super::codec::{fabric_frame, from_frame};
use super::frame::{Frame, HEADER_LEN, Kind};
use crate::cuda::FabricDescriptor;
use crate::{Error, Result};

/// The frame byte every message starts with, on a stream as in a packet.
const FRAME_BYTE: u8 = 0x00;

/// What a stream is called in errors.
const STREAM: &str = "peer stream";

/// Writes peer messages without fds (`CUDA_FABRIC`, `DATA`) to a byte stream, each with one
/// `write_all` and then a `flush`.
///
/// A message the protocol cannot carry is refused ([`Error::InvalidOption`],
/// [`Error::TooLarge`]) before a byte
/// of it is written. A write that fails leaves the stream holding part of a message, so every
/// later write is refused too ([`Error::Protocol`]). Its `Debug` shows nothing of the stream.
pub struct StreamWriter<W> {
    writer: W,
    failed: bool,
}

impl<W: Write> StreamWriter<W> {
    /// A writer of peer messages to `writer` (a `TcpStream`, `&TcpStream`, a `BufWriter`...).
    pub fn new(writer: W) -> Self {
        StreamWriter {
            writer,
            failed: false,
        }
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
            return Err(Error::Protocol(format!(
                "{STREAM}: an earlier write failed part way through a message, so the stream \
                 can carry no more"
            )));
        }
        let bytes = frame.encode()?;
        let mut packet = Vec::with_capacity(1 + bytes.len());
        packet.push(FRAME_BYTE);
        packet.extend_from_slice(&bytes);
        let written = self
            .writer
            .write_all(&packet)
            .and_then(|()| self.writer.flush());
        written.map_err(|source| {
            self.failed = true;
            Error::io(
                format!("writing a {} message to a {STREAM}", frame.kind.name()),
                source,
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
    state: State,
}

impl<R> fmt::Debug for StreamReader<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamReader")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl<R: Read> StreamReader<R> {
    /// A reader of peer messages from `reader` (a `TcpStream`, `&TcpStream`, a `BufReader`...;
    /// set a read timeout on a socket to bound each read).
    pub fn new(reader: R) -> Self {
        StreamReader {
            reader,
            state: State::Open,
        }
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
                return Err(Error::Protocol(format!(
                    "{STREAM}: an earlier message was refused or cut short, so nothing more is \
                     read from it (after a bad message, nobody knows where the next one starts)"
                )));
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
        let mut head = [0u8; 1 + HEADER_LEN];
        if fill(&mut self.reader, &mut head[..1])? == 0 {
            return Err(Error::Disconnected(STREAM.into()));
        }
        if head[0] != FRAME_BYTE {
            return Err(Error::Protocol(format!(
                "{STREAM}: frame byte {:#04x}: a message on a stream starts with 0x00",
                head[0]
            )));
        }
        let got = fill(&mut self.reader, &mut head[1..])?;
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
        let got = fill(&mut self.reader, &mut message[HEADER_LEN..])?;
        if got != body {
            return Err(Error::Protocol(format!(
                "{STREAM}: it ended after {got} of the {body} bytes of chunk sizes and payload \
                 that the message's header announced (a message cut short)"
            )));
        }
        let frame = Frame::decode(&message, 0)?;
        from_frame(frame, Vec::new())
    }
}

/// Read into `buf` until it is full or the stream ends; how many bytes were read.
fn fill<R: Read + ?Sized>(reader: &mut R, buf: &mut [u8]) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            // A reader that claims more than it was given is not believed past the buffer.
            Ok(n) => got = (got + n).min(buf.len()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(Error::io(format!("reading from a {STREAM}"), source));
            }
        }
    }
    Ok(got)
}
