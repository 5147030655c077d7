use nix::sys::socket::{MsgFlags, send};

use std::fs::File;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

use super::*;

/// Send one raw packet (bytes + fds) on `end`, as a hostile peer would.
fn raw_packet(end: &Channel, bytes: &[u8], fds: &[RawFd]) {
    let iov = [IoSlice::new(bytes)];
    let cmsgs = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsgs };
    sendmsg::<UnixAddr>(end.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
}

fn spill_header(size: u64) -> Vec<u8> {
    let mut header = vec![FRAME_SPILLED];
    header.extend_from_slice(&size.to_le_bytes());
    header
}

fn memfd(len: u64, seals: SealFlag) -> OwnedFd {
    let fd = memfd_create(
        c"hostile",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .unwrap();
    nix::unistd::ftruncate(&fd, len as i64).unwrap();
    if !seals.is_empty() {
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).unwrap();
    }
    fd
}

const ALL_SEALS: SealFlag = SealFlag::F_SEAL_WRITE
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_SHRINK);

/// The message of a refusal, which must be by `rule`.
fn protocol_error(result: Result<Message>, rule: ProtocolRule) -> String {
    match result {
        Err(Error::Protocol { rule: got, message }) => {
            assert_eq!(got, rule, "{message}");
            message
        }
        other => panic!("wanted Error::Protocol, got {other:?}"),
    }
}

#[test]
fn a_spill_header_of_a_terabyte_is_refused_before_any_allocation() {
    let (a, b) = Channel::pair().unwrap();
    // Sparse: costs nothing to create, 1 TiB to read.
    let fd = memfd(1 << 40, ALL_SEALS);
    raw_packet(&a, &spill_header(1 << 40), &[fd.as_raw_fd()]);
    let m = protocol_error(b.recv(Some(Duration::from_secs(5))), ProtocolRule::TooLarge);
    assert!(
        m.contains("1099511627776 bytes") && m.contains("MAX_MESSAGE"),
        "{m}"
    );
    // The channel is still usable.
    a.send(b"after", &[]).unwrap();
    assert_eq!(b.recv(None).unwrap().bytes, b"after");
}

#[test]
fn each_reader_refuses_the_other_framing_by_its_frame_byte() {
    let (a, b) = Channel::pair().unwrap();
    // A peer message on an internal channel: named, not mistaken for a payload.
    a.send_peer(b"VMMI", &[], None).unwrap();
    let m = protocol_error(
        b.recv(Some(Duration::from_secs(5))),
        ProtocolRule::FrameByte,
    );
    assert!(
        m.contains("frame byte 0") && m.contains("peer message"),
        "{m}"
    );
    // vmm-core's internal framing (inline, then spilled) at a peer's receive.
    let drop_fds: fn(Vec<OwnedFd>) = drop;
    a.send(b"internal", &[]).unwrap();
    let m = protocol_error(
        b.recv_peer(Some(Duration::from_secs(5)), 1024, drop_fds),
        ProtocolRule::FrameByte,
    );
    assert!(
        m.contains("frame byte 2") && m.contains("internal framing"),
        "{m}"
    );
    a.send(&vec![7u8; INLINE_MAX + 1], &[]).unwrap();
    let m = protocol_error(
        b.recv_peer(Some(Duration::from_secs(5)), 1024, drop_fds),
        ProtocolRule::FrameByte,
    );
    assert!(m.contains("frame byte 1") && m.contains("spilled"), "{m}");
    // Each reader still takes its own.
    a.send_peer(b"VMMI", &[], None).unwrap();
    let peer = b.recv_peer(Some(Duration::from_secs(5)), 1024, drop_fds);
    assert_eq!(peer.unwrap().bytes, b"VMMI");
    a.send(b"internal", &[]).unwrap();
    assert_eq!(b.recv(None).unwrap().bytes, b"internal");
    // A peer message is never spilled.
    let err = a
        .send_peer(&vec![0u8; INLINE_MAX + 1], &[], None)
        .unwrap_err();
    assert!(
        matches!(&err, Error::TooLarge { message, .. } if message.contains("INLINE_MAX")),
        "{err:?}"
    );
}

#[test]
fn a_large_message_spills_and_arrives_whole() {
    let (a, b) = Channel::pair().unwrap();
    let big: Vec<u8> = (0..INLINE_MAX * 3).map(|i| (i % 251) as u8).collect();
    a.send(&big, &[]).unwrap();
    let message = b.recv(Some(Duration::from_secs(5))).unwrap();
    assert!(message.bytes == big && message.fds.is_empty());
}

#[test]
fn a_spill_whose_memfd_disagrees_or_is_unsealed_is_refused() {
    let (a, b) = Channel::pair().unwrap();
    let fd = memfd(20, ALL_SEALS);
    raw_packet(&a, &spill_header(10), &[fd.as_raw_fd()]);
    let m = protocol_error(b.recv(None), ProtocolRule::Fds);
    assert!(m.contains("holds 20 bytes, its header says 10"), "{m}");
    let fd = memfd(100_000, SealFlag::empty());
    raw_packet(&a, &spill_header(100_000), &[fd.as_raw_fd()]);
    let m = protocol_error(b.recv(None), ProtocolRule::Fds);
    assert!(m.contains("not sealed"), "{m}");
    let file = File::open("/proc/self/stat").unwrap();
    raw_packet(&a, &spill_header(100_000), &[file.as_raw_fd()]);
    let m = protocol_error(b.recv(None), ProtocolRule::Fds);
    assert!(m.contains("not a sealed memfd"), "{m}");
}

#[test]
fn an_empty_packet_from_a_live_peer_is_not_a_hang_up() {
    let (a, b) = Channel::pair().unwrap();
    send(a.as_raw_fd(), &[], MsgFlags::empty()).unwrap();
    let m = protocol_error(
        b.recv(Some(Duration::from_secs(5))),
        ProtocolRule::FrameByte,
    );
    assert!(m.contains("empty packet"), "{m}");
    a.send(b"still here", &[]).unwrap();
    assert_eq!(b.recv(None).unwrap().bytes, b"still here");
    drop(a);
    let after = b.recv(None);
    assert!(matches!(after, Err(Error::Disconnected(_))), "{after:?}");
}

#[test]
fn a_zero_timeout_returns_at_once_despite_the_spin_window() {
    let (_a, b) = Channel::pair().unwrap();
    let started = Instant::now();
    let err = b.recv(Some(Duration::ZERO)).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    // Far below the window's cap (10 ms): the deadline bounds the spin too.
    assert!(
        started.elapsed() < Duration::from_millis(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn duration_max_waits_without_overflowing() {
    let (a, b) = Channel::pair().unwrap();
    a.send_timeout(b"x", &[], Some(Duration::MAX)).unwrap();
    assert_eq!(b.recv(Some(Duration::MAX)).unwrap().bytes, b"x");
    assert_eq!(deadline_after(Duration::MAX), Deadline::Never);
}

#[test]
fn a_full_socket_times_out_instead_of_blocking() {
    let (a, _b) = Channel::pair().unwrap();
    let mut sent = 0;
    while a
        .send_timeout(&[0; 1024], &[], Some(Duration::ZERO))
        .is_ok()
    {
        sent += 1;
        assert!(sent < 1_000_000, "the socket never filled");
    }
    let started = Instant::now();
    let err = a
        .send_timeout(b"one more", &[], Some(Duration::from_millis(50)))
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert!(sent > 0);
}

#[test]
fn a_message_over_the_maximum_is_refused_by_the_sender() {
    let (a, _b) = Channel::pair().unwrap();
    let big = vec![0u8; MAX_MESSAGE + 1];
    let err = a.send(&big, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::TooLarge { message, .. } if message.contains("MAX_MESSAGE")),
        "{err:?}"
    );
}
