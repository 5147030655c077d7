//! Hand a GPU buffer to a process vmm-core did not start, over plain TCP, as JSON.
//!
//! ```sh
//! cargo run -p vmm-core --example fabric_tcp
//! ```
//!
//! The sender allocates a buffer with `HandleType::Fabric`, fills it, and starts a receiver
//! with `std::process::Command` (this same executable with the argument `receive ADDR`; any
//! program that links vmm-core would do). It sends the `FabricDescriptor` as one line of JSON
//! over a TCP connection on 127.0.0.1; the receiver imports it, checks the pattern, writes its
//! own and replies with one line of JSON. The sender keeps its buffer until that reply: a
//! fabric handle does not keep the memory alive.
//!
//! Fabric handles are bearer tokens: anyone who reads the JSON and has an IMEX channel can map
//! the memory. Loopback between your own processes is fine; across a network, use a channel
//! you trust (TLS, an authenticated service mesh).
//!
//! Needs a GPU with fabric support and an IMEX channel (the error says how to create one).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, ExitCode};
use std::time::Duration;

use vmm_core::cuda::{
    Device, FabricDescriptor, HandleType, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource,
};

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
    let mut line = serde_json::to_string(&descriptor)?;
    line.push('\n');
    (&stream).write_all(line.as_bytes())?;

    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    let status = receiver.wait()?;
    if !status.success() {
        return Err(format!("the receiver failed ({status})").into());
    }
    println!("sender: the receiver replied {}", reply.trim_end());
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
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let descriptor: FabricDescriptor = serde_json::from_str(&line)?;
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor)?;
    let matched = contents(&buf)? == pattern(1, buf.size());
    buf.write_at(0, &pattern(2, buf.size()))?;
    let reply = serde_json::json!({ "imported": true, "pattern_matched": matched });
    (&stream).write_all(format!("{reply}\n").as_bytes())?;
    if !matched {
        return Err("the sender's pattern is not in the buffer".into());
    }
    println!("receiver: imported {} bytes, pattern matched", buf.size());
    Ok(())
}
