//! Fabric descriptors between Rust and the Python peer over TCP loopback, with the byte-stream
//! framing (docs/protocol.md version 2), both ways.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};

use vmm_core::testing::skip_unless;
use vmm_tests::own_uid;
use vmm_tests::turns::exclusive;

use super::gpu::{check_mark, fabric_resource, import_check_mark, python_fabric, rust_export};
use super::{TIMEOUT, finish_ok, python_dir, role, twice_with_baseline, v2};

/// The Python peer's TCP connection, or a failure with its output if it exits (or takes
/// longer than [`TIMEOUT`]) without connecting.
fn accept_tcp(listener: &TcpListener, child: &mut Child) -> TcpStream {
    listener.set_nonblocking(true).unwrap();
    let started = Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                stream.set_read_timeout(Some(TIMEOUT)).unwrap();
                stream.set_write_timeout(Some(TIMEOUT)).unwrap();
                return stream;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
        if child.try_wait().unwrap().is_some() || started.elapsed() > TIMEOUT {
            let _ = child.kill();
            let mut out = String::new();
            if let Some(stdout) = child.stdout.take() {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    out.push_str(&line);
                    out.push('\n');
                }
            }
            panic!("the Python peer never connected:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn python_fabric_export_to_rust_over_tcp() {
    let _turn = exclusive();
    if !skip_unless(python_fabric()) {
        return;
    }
    let py = python_dir();
    twice_with_baseline([90, 100], |seed| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seed_arg = seed.to_string();
        let mut child = role(
            &py,
            "fabric-exporter",
            &["tcp", &addr, &own_uid(), &seed_arg, "2"],
        );
        let mut stream = accept_tcp(&listener, &mut child);
        let descriptor = v2::read_fabric(&mut stream).unwrap();
        import_check_mark(&descriptor, seed);
        v2::write_data(&mut stream, b"written").unwrap();
        let out = finish_ok(child, TIMEOUT);
        assert!(out.contains("OK exported 2 fabric chunk(s)"), "{out}");
        assert!(out.contains("over tcp"), "{out}");
        drop((stream, listener));
    });
}

#[test]
fn rust_fabric_export_to_python_over_tcp() {
    let _turn = exclusive();
    if !skip_unless(python_fabric()) {
        return;
    }
    let py = python_dir();
    let resource = fabric_resource();
    let g = resource.granularity();
    twice_with_baseline([90, 100], |seed| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let buf = rust_export(&resource, seed);
        let seed_arg = seed.to_string();
        let mut child = role(
            &py,
            "fabric-importer",
            &["tcp", &addr, &own_uid(), &seed_arg],
        );
        let mut stream = accept_tcp(&listener, &mut child);
        v2::write_fabric(&mut stream, &buf.export_fabric().unwrap()).unwrap();
        assert_eq!(v2::read_data(&mut stream).unwrap(), b"written");
        let out = finish_ok(child, TIMEOUT);
        assert!(
            out.contains(&format!(
                "OK imported 2 fabric chunk(s), {} bytes over tcp",
                2 * g - 4096
            )),
            "{out}"
        );
        check_mark(&buf, seed);
        drop((buf, stream, listener));
    });
}
