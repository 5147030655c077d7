//! Hand a GPU buffer to a process vmm-core did not start, over plain TCP, as peer-protocol
//! messages (docs/protocol.md, version 2: a `CUDA_FABRIC` message on a byte stream).
//!
//! ```sh
//! cargo run -p vmm-core --example fabric_tcp
//! ```
//!
//! The sender allocates a buffer with `HandleType::Fabric`, fills it, and starts a receiver
//! with `std::process::Command` (this same executable with the argument `receive ADDR`; any
//! program that speaks the protocol would do: a version 2 Python peer reads the same bytes).
//! It writes the `FabricDescriptor` as one `CUDA_FABRIC` message
//! ([`StreamWriter::write_descriptor`](vmm_core::peer::stream::StreamWriter::write_descriptor))
//! to a TCP connection on 127.0.0.1; the receiver reads it
//! ([`StreamReader::read_message`](vmm_core::peer::stream::StreamReader::read_message), which
//! checks the header before it reads or allocates more), imports it, checks the pattern,
//! writes its own and replies with a `DATA` message. The sender keeps its buffer until that
//! reply: a fabric handle does not keep the memory alive.
//!
//! Fabric handles are bearer tokens: anyone who reads the stream and has an IMEX channel can
//! map the memory. Loopback between your own processes is fine; across a network, use a
//! channel you trust (TLS, an SSH tunnel, an authenticated service mesh): the protocol
//! authenticates no one on a stream.
//!
//! Needs a GPU with fabric support and an IMEX channel; without them it prints one
//! `SKIP fabric_tcp: <reason>` line and exits 0 (`VMM_REQUIRE_GPU=1` makes that a failure).

use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode};
use std::time::Duration;

use vmm_core::cuda::{
    Device, HandleType, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
    fabric_availability,
};
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

fn contents(buf: &VirtualMemoryBuffer) -> vmm_core::Result<Vec<u8>> {
    let mut out = vec![0u8; buf.size()];
    buf.read_at(0, &mut out)?;
    Ok(out)
}

type Failure = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let Err(reason) = fabric_availability() {
        eprintln!("SKIP fabric_tcp: {reason}");
        return if std::env::var_os("VMM_REQUIRE_GPU").is_some_and(|v| v == "1") {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
    }
    let result = match args.get(1).map(String::as_str) {
        Some("receive") => match args.get(2) {
            Some(addr) => receive(addr),
            None => Err("usage: fabric_tcp receive ADDR".into()),
        },
        _ => send(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fabric_tcp: {e}");
            ExitCode::FAILURE
        }
    }
}

fn send() -> Result<(), Failure> {
    let device = Device::new(0)?;
    let resource = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().handle_type(HandleType::Fabric),
    )?;
    let buf = resource.allocate(4 << 20)?;
    buf.write_at(0, &pattern(1, buf.size()))?;

    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let mut receiver = Command::new(std::env::current_exe()?)
        .args(["receive", &addr])
        .spawn()?;
    let (stream, _) = listener.accept()?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;

    let descriptor = buf.export_fabric()?;
    println!("sender: {descriptor:?}"); // Debug prints no handle byte
    StreamWriter::new(&stream).write_descriptor(&descriptor)?;

    let reply = match StreamReader::new(&stream).read_message()? {
        PeerMessage::Data(reply) => String::from_utf8_lossy(&reply).into_owned(),
        PeerMessage::Descriptor(d) => {
            return Err(format!("the receiver sent a descriptor ({d:?}), not a reply").into());
        }
    };
    let status = receiver.wait()?;
    if !status.success() {
        return Err(format!("the receiver failed ({status})").into());
    }
    println!("sender: the receiver replied {reply:?}");
    // Only now may the buffer go: the receiver has imported it.
    if contents(&buf)? != pattern(2, buf.size()) {
        return Err("the receiver's write is not in the buffer".into());
    }
    println!("sender: the receiver's write is in the buffer");
    Ok(())
}

fn receive(addr: &str) -> Result<(), Failure> {
    let stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let descriptor = match StreamReader::new(&stream).read_message()? {
        PeerMessage::Descriptor(d) => d.into_fabric()?,
        PeerMessage::Data(bytes) => {
            return Err(format!("expected a descriptor, got {} bytes of DATA", bytes.len()).into());
        }
    };
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor)?;
    let matched = contents(&buf)? == pattern(1, buf.size());
    buf.write_at(0, &pattern(2, buf.size()))?;
    let reply = if matched {
        "imported, pattern matched"
    } else {
        "imported, pattern NOT matched"
    };
    StreamWriter::new(&stream).write_data(reply.as_bytes())?;
    if !matched {
        return Err("the sender's pattern is not in the buffer".into());
    }
    println!("receiver: imported {} bytes, pattern matched", buf.size());
    Ok(())
}
