//! A receiver that vmm-core did not start: a plain `std::process::Command`, over TCP on
//! 127.0.0.1, the descriptor as JSON. Skipped where fabric handles cannot be used.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmm_core::cuda::{FabricDescriptor, VirtualMemoryBuffer};
use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_tests::turns::shared;
use vmm_tests::{contents, pattern, text};

use super::{TIMEOUT, filled_fabric};

/// Set in the receiver process: the sender's address.
const TCP_RECEIVER_VAR: &str = "VMM_TEST_FABRIC_TCP_ADDR";

/// What the sender writes, as one JSON line.
#[derive(Serialize, Deserialize)]
struct Offer {
    descriptor: FabricDescriptor,
    seed: u8,
}

/// What the receiver writes back, as one JSON line.
#[derive(Serialize, Deserialize, Debug)]
struct Reply {
    imported: bool,
    pattern_matched: bool,
    error: Option<String>,
}

/// The receiver: this test binary re-run with `--ignored --exact fabric_tcp::fabric_tcp_receiver` and
/// [`TCP_RECEIVER_VAR`] set, by a plain `std::process::Command`, not by vmm-core. Without the
/// variable (a run of all ignored tests) it does nothing.
#[test]
#[ignore = "the receiver half of tcp_receiver_that_vmm_core_did_not_start"]
fn fabric_tcp_receiver() {
    let Ok(addr) = std::env::var(TCP_RECEIVER_VAR) else {
        return;
    };
    let stream = TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).unwrap();
    let offer: Offer = serde_json::from_str(&line).unwrap();
    let reply = match VirtualMemoryBuffer::import_fabric(&offer.descriptor) {
        Ok(buf) => {
            let matched = contents(&buf) == pattern(offer.seed, buf.size());
            buf.write_at(0, &pattern(offer.seed + 1, buf.size()))
                .unwrap();
            Reply {
                imported: true,
                pattern_matched: matched,
                error: None,
            }
        }
        Err(e) => Reply {
            imported: false,
            pattern_matched: false,
            error: Some(e.to_string()),
        },
    };
    let mut out = serde_json::to_string(&reply).unwrap();
    out.push('\n');
    (&stream).write_all(out.as_bytes()).unwrap();
}

/// The receiver's connection, or a failure with its output if it exits (or takes longer than
/// [`TIMEOUT`]) without connecting.
fn accept_from(
    listener: &TcpListener,
    mut receiver: std::process::Child,
) -> (TcpStream, std::process::Child) {
    listener.set_nonblocking(true).unwrap();
    let started = std::time::Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                return (stream, receiver);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
        let exited = receiver.try_wait().unwrap().is_some();
        if exited || started.elapsed() > TIMEOUT {
            let _ = receiver.kill();
            let output = receiver.wait_with_output().unwrap();
            panic!(
                "the receiver never connected ({}):\n{}",
                if exited { "it exited" } else { "timed out" },
                text(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[ipc_test(methods = [spawn], skip_unless = vmm_core::testing::cuda_fabric())]
fn tcp_receiver_that_vmm_core_did_not_start(_ctx: &Context) {
    let _turn = shared();
    let buf = filled_fabric(2);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let receiver = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "fabric_tcp::fabric_tcp_receiver",
            "--nocapture",
        ])
        .env(TCP_RECEIVER_VAR, &addr)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (stream, receiver) = accept_from(&listener, receiver);
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let offer = Offer {
        descriptor: buf.export_fabric().unwrap(),
        seed: 1,
    };
    let mut line = serde_json::to_string(&offer).unwrap();
    line.push('\n');
    (&stream).write_all(line.as_bytes()).unwrap();
    let mut reply = String::new();
    let read = BufReader::new(&stream).read_line(&mut reply);
    let output = receiver.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the receiver failed:\n{}",
        text(&output)
    );
    read.unwrap();
    let reply: Reply = serde_json::from_str(&reply)
        .unwrap_or_else(|e| panic!("reply {reply:?}: {e}\n{}", text(&output)));
    assert!(
        reply.imported && reply.pattern_matched,
        "{reply:?}\n{}",
        text(&output)
    );
    // The exporter kept `buf` until the reply: the receiver's write is in the memory.
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}
