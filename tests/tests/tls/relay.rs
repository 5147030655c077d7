//! A TCP relay between importer and exporter that tampers with the stream.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;

/// A TCP relay between the importer and the exporter that passes the first `pass` bytes from
/// the exporter untouched, then flips one byte (`Flip`) or cuts both connections (`Cut`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Tamper {
    Flip,
    Cut,
}

pub(crate) fn relay(to: SocketAddr, tamper: Tamper, pass: usize) -> (SocketAddr, JoinHandle<()>) {
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = front.local_addr().unwrap();
    let thread = std::thread::spawn(move || {
        let (client, _) = front.accept().unwrap();
        let server = TcpStream::connect(to).unwrap();
        let mut up_from = client.try_clone().unwrap();
        let mut up_to = server.try_clone().unwrap();
        let upstream = std::thread::spawn(move || {
            let _ = std::io::copy(&mut up_from, &mut up_to);
            let _ = up_to.shutdown(std::net::Shutdown::Write);
        });
        let mut down_from = server;
        let mut down_to = client;
        let mut seen = 0usize;
        let mut buf = [0u8; 4096];
        loop {
            let n = match down_from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let chunk = &mut buf[..n];
            if seen + n > pass {
                let at = pass.saturating_sub(seen);
                match tamper {
                    Tamper::Flip => {
                        chunk[at] ^= 0x01;
                        let _ = down_to.write_all(chunk);
                        // Then pass the rest untouched.
                        let _ = std::io::copy(&mut down_from, &mut down_to);
                        break;
                    }
                    Tamper::Cut => {
                        let _ = down_to.write_all(&chunk[..at]);
                        let _ = down_to.shutdown(std::net::Shutdown::Both);
                        let _ = down_from.shutdown(std::net::Shutdown::Both);
                        break;
                    }
                }
            }
            let _ = down_to.write_all(chunk);
            seen += n;
        }
        let _ = down_to.shutdown(std::net::Shutdown::Both);
        let _ = upstream.join();
    });
    (addr, thread)
}
