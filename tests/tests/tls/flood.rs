//! Availability of the TLS listener under attack from outside: clients that connect and stall
//! (saying nothing, or half a ClientHello), pending by the hundred, and one local process that
//! floods the listener with such connections as fast as it can. The legitimate importer is
//! served within its handshake deadline all the same (at least 19 of 20 imports).
//!
//! The flooder is another process (started by vmm-core, so it is killed with the test): its
//! threads connect in a loop, two of three waiting for each connection and sending half a
//! ClientHello, the third connecting without waiting and saying nothing (so the flood goes on
//! while the listener's kernel queue is full), each keeping its last 128 connections open. It counts its connections in a shared memfd, so the test reports
//! the rate it flooded at (a report, never an assertion: speed is not tested here).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_core::process::{Context, StartMethod};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::tls::MAX_HANDSHAKES;
use vmm_tests::pattern;
use vmm_tests::turns::exclusive;

use super::world::*;

/// The first bytes of a ClientHello: a handshake record of 512 bytes of which 75 come.
pub(crate) const HALF_HELLO: &[u8] = &[
    0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];

/// Threads of the flooding process: half connect and send half a ClientHello (each waiting
/// for its connection), half connect without waiting (non-blocking) and say nothing, so the
/// flood goes on while the kernel's queue of the listener is full.
const FLOOD_THREADS: usize = 6;
/// Connections each flooding thread keeps open (the oldest is closed for a new one).
const FLOOD_KEPT: usize = 128;
/// The longest a flooder floods (the test kills it long before).
const FLOOD_MAX: Duration = Duration::from_secs(300);
/// Legitimate imports, and how many of them must succeed.
const IMPORTS: usize = 20;
const MUST_SUCCEED: usize = 19;

/// Open `n` connections to `addr` that stall: every other one says nothing, the rest send
/// half a ClientHello.
pub(crate) fn stallers(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| {
            let mut s = TcpStream::connect(addr).unwrap();
            if i % 2 == 1 {
                s.write_all(HALF_HELLO).unwrap();
            }
            s
        })
        .collect()
}

/// The flooding process: connect as fast as it can, until killed (or [`FLOOD_MAX`] has
/// passed), counting the connections made in `counter` (one `u64` per thread).
fn flooder((addr, counter): (String, HostDescriptor)) {
    let addr: SocketAddr = addr.parse().unwrap();
    let counter = Arc::new(HostBuffer::import(&counter).unwrap());
    let threads: Vec<_> = (0..FLOOD_THREADS)
        .map(|t| {
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || {
                let mut kept = std::collections::VecDeque::with_capacity(FLOOD_KEPT);
                let mut made = 0u64;
                let started = Instant::now();
                while started.elapsed() < FLOOD_MAX {
                    let opened = if t % 3 != 0 {
                        TcpStream::connect(addr).ok().map(|mut s| {
                            let _ = s.write_all(HALF_HELLO);
                            OwnedFd::from(s)
                        })
                    } else {
                        connect_without_waiting(addr)
                    };
                    let Some(fd) = opened else { continue };
                    if kept.len() == FLOOD_KEPT {
                        kept.pop_front();
                    }
                    kept.push_back(fd);
                    made += 1;
                    if made.is_multiple_of(16) {
                        counter.write_at(t * 8, &made.to_le_bytes()).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// A TCP connection to `addr` started and not waited for (it may never be accepted).
fn connect_without_waiting(addr: SocketAddr) -> Option<OwnedFd> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(v4) = addr else {
        panic!("an IPv4 listener")
    };
    // SAFETY: a new socket, owned at once.
    let raw = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` is a new fd nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sin` is a valid sockaddr_in of the length given.
    let rc = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&raw const sin).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    let in_progress = std::io::Error::last_os_error().raw_os_error() == Some(libc::EINPROGRESS);
    (rc == 0 || in_progress).then_some(fd)
}

/// The connections the flooder has made so far.
fn flooded(counter: &HostBuffer) -> u64 {
    let mut total = 0;
    for t in 0..FLOOD_THREADS {
        let mut word = [0u8; 8];
        counter.read_at(t * 8, &mut word).unwrap();
        total += u64::from_le_bytes(word);
    }
    total
}

/// An exporter on its own thread: a listener of `world` that serves every stream it hands
/// out (the stand-in descriptor, fresh, each time) until [`stop`](Self::stop).
struct Exporter {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Exporter {
    fn start(world: &World) -> Exporter {
        let listener = world.listener();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let buf = HostBuffer::new(SIZE).unwrap();
            let (descriptor, _fd) = stand_in(&buf);
            while !stopped.load(Ordering::Relaxed) {
                if let Ok(mut stream) = listener.accept(Some(Duration::from_millis(200))) {
                    buf.write_at(0, &pattern(1, SIZE)).unwrap();
                    let _ = export_on(&mut stream, &descriptor);
                }
            }
        });
        Exporter { addr, stop, thread }
    }

    /// End the loop (within one accept's wait) and its thread, whose panic is the test's.
    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}

/// `IMPORTS` legitimate imports one after another, each bounded by the importer's handshake
/// deadline (and its message deadlines): how many succeeded, and the errors of the others.
fn legitimate_imports(world: &World, addr: SocketAddr) -> (usize, Vec<vmm_core::Error>) {
    let importer = world.importer_options();
    let mut ok = 0;
    let mut errors = Vec::new();
    for _ in 0..IMPORTS {
        match import_from(addr, &importer) {
            Ok(()) => ok += 1,
            Err(e) => errors.push(e),
        }
    }
    (ok, errors)
}

#[test]
fn the_importer_is_served_while_200_stalled_handshakes_are_pending() {
    let _turn = exclusive();
    let world = World::new();
    let exporter = Exporter::start(&world);
    let addr = exporter.addr;
    // 200 stallers connect first, and 200 more between every two imports.
    let mut held = stallers(addr, 200);
    let importer = world.importer_options();
    let mut ok = 0;
    let mut errors = Vec::new();
    for _ in 0..IMPORTS {
        match import_from(addr, &importer) {
            Ok(()) => ok += 1,
            Err(e) => errors.push(e),
        }
        held.extend(stallers(addr, 200));
        held.drain(..held.len().saturating_sub(400));
    }
    exporter.stop();
    eprintln!(
        "{ok} of {IMPORTS} imports served beside 200 to 400 stalled handshakes (the listener runs {MAX_HANDSHAKES} at once)"
    );
    assert!(ok >= MUST_SUCCEED, "{ok} of {IMPORTS} served: {errors:?}");
}

#[test]
fn the_importer_is_served_while_a_local_process_floods_the_listener() {
    let _turn = exclusive();
    let world = World::new();
    let exporter = Exporter::start(&world);
    let addr = exporter.addr;
    let counter = HostBuffer::new(4096).unwrap();
    counter.write_at(0, &[0; 64]).unwrap();
    let flood = Context::new(StartMethod::Spawn)
        .spawn(flooder, (addr.to_string(), counter.export().unwrap()))
        .unwrap();
    // The flood is under way before the first import.
    let until = Instant::now() + WAIT;
    while flooded(&counter) < 1000 {
        assert!(Instant::now() < until, "the flooder never got going");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (before, started) = (flooded(&counter), Instant::now());
    let (ok, errors) = legitimate_imports(&world, addr);
    let (after, took) = (flooded(&counter), started.elapsed());
    flood.kill().unwrap();
    let _ = flood.join(WAIT);
    exporter.stop();
    let rate = (after - before) as f64 / took.as_secs_f64();
    eprintln!(
        "{ok} of {IMPORTS} imports served in {took:.1?} while one process ({FLOOD_THREADS} threads) opened {} stalling connections, {rate:.0} per second",
        after - before
    );
    assert!(ok >= MUST_SUCCEED, "{ok} of {IMPORTS} served: {errors:?}");
}

/// A relay to `to` that passes the client's first read (its ClientHello) at once, says so on
/// `hello_passed`, and holds the rest of what the client sends (its second flight) for `hold`.
fn slow_second_flight(
    to: SocketAddr,
    hold: Duration,
    hello_passed: std::sync::mpsc::Sender<()>,
) -> SocketAddr {
    holding_relay(to, Duration::ZERO, hold, hello_passed)
}

/// A relay to `to` that connects at once and says so on `connected`, holds the client's first
/// read (its ClientHello) for `hold_hello`, then the rest for `hold_rest`.
fn holding_relay(
    to: SocketAddr,
    hold_hello: Duration,
    hold_rest: Duration,
    connected: std::sync::mpsc::Sender<()>,
) -> SocketAddr {
    use std::io::Read;
    let front = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = front.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut client, _) = front.accept().unwrap();
        let mut server = TcpStream::connect(to).unwrap();
        let (mut down_from, mut down_to) =
            (server.try_clone().unwrap(), client.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut down_from, &mut down_to);
            let _ = down_to.shutdown(std::net::Shutdown::Write);
        });
        let mut hello = [0u8; 16384];
        let n = client.read(&mut hello).unwrap();
        if hold_hello.is_zero() {
            server.write_all(&hello[..n]).unwrap();
            connected.send(()).unwrap();
        } else {
            connected.send(()).unwrap();
            std::thread::sleep(hold_hello);
            server.write_all(&hello[..n]).unwrap();
        }
        std::thread::sleep(hold_rest);
        let _ = std::io::copy(&mut client, &mut server);
        let _ = server.shutdown(std::net::Shutdown::Write);
    });
    addr
}

#[test]
fn a_client_that_sent_its_hello_keeps_its_place_before_newer_stallers() {
    let _turn = exclusive();
    let world = World::new();
    let exporter = Exporter::start(&world);
    let addr = exporter.addr;
    // The importer's ClientHello reaches the listener at once, its second flight only after
    // 200 stallers have connected: more than the listener's slots, so it must end some of
    // its pending handshakes, and the importer's, the oldest, has been answered.
    let (passed, hello_passed) = std::sync::mpsc::channel();
    let front = slow_second_flight(addr, Duration::from_millis(1500), passed);
    let importer = world.importer_options();
    let import = std::thread::spawn(move || import_from(front, &importer));
    hello_passed.recv_timeout(WAIT).unwrap();
    std::thread::sleep(Duration::from_millis(200)); // the listener answers the hello
    let held = stallers(addr, 200);
    let result = import.join().unwrap();
    exporter.stop();
    drop(held);
    result.unwrap();
}

/// A TCP connection to `to` from the address `from` (a loopback address other than
/// 127.0.0.1: another host, as the listener sees it).
fn connect_from(from: std::net::Ipv4Addr, to: SocketAddr) -> Option<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else {
        panic!("an IPv4 listener")
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, owned at once.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` is a new fd nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let (src, dst) = (sockaddr(from, 0), sockaddr(*to.ip(), to.port()));
    // SAFETY: valid sockaddr_in values of the length given, on a socket this function owns.
    let ok = unsafe {
        libc::bind(fd.as_raw_fd(), (&raw const src).cast(), len) == 0
            && libc::connect(fd.as_raw_fd(), (&raw const dst).cast(), len) == 0
    };
    ok.then(|| TcpStream::from(fd))
}

#[test]
fn stallers_from_one_address_end_their_own_handshakes_first() {
    let _turn = exclusive();
    let world = World::new();
    let exporter = Exporter::start(&world);
    let addr = exporter.addr;
    // The importer (from 127.0.0.1) has connected, and its ClientHello is late; meanwhile
    // 200 stallers connect from 127.0.0.2: none of them has been answered either, but their
    // address holds the most pending handshakes, so theirs end, the oldest first.
    let (connected, relay_connected) = std::sync::mpsc::channel();
    let front = holding_relay(addr, Duration::from_millis(1500), Duration::ZERO, connected);
    let importer = world.importer_options();
    let import = std::thread::spawn(move || import_from(front, &importer));
    relay_connected.recv_timeout(WAIT).unwrap();
    let other = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let held: Vec<TcpStream> = (0..200)
        .filter_map(|i| {
            let mut s = connect_from(other, addr)?;
            if i % 2 == 1 {
                s.write_all(HALF_HELLO).ok()?;
            }
            Some(s)
        })
        .collect();
    assert!(held.len() > MAX_HANDSHAKES, "{} stallers", held.len());
    let result = import.join().unwrap();
    exporter.stop();
    drop(held);
    result.unwrap();
}
