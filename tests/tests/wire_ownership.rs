//! A message owns every fd it carries (issue 16, item 4).
//!
//! `wire::encode` borrows the value it serialises, but through a `RefCell` or a `Mutex` safe code
//! can replace the fd's owner (and so close the fd) while the [`Encoded`] message still exists.
//! Had the message kept only the fd's number, it would then carry whatever file took that number
//! next. Each test here encodes a value inside a cell, replaces the owner, puts a decoy file on
//! the freed number (`dup3` onto it, so the race does not depend on "lowest free fd"), sends the
//! message over a real socketpair and checks that the receiver got the original file.
//!
//! The tests take one lock, because each closes an fd number and reuses it on purpose: no other
//! test of this binary may open an fd meanwhile.

use std::cell::RefCell;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::memfd::{MFdFlags, memfd_create};
use vmm_core::cuda::{HandleType, IpcDescriptor};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::{Channel, Encoded, Fd, Queue, decode, encode};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const WAIT: Option<Duration> = Some(Duration::from_secs(10));

/// (st_dev, st_ino): which file an fd names.
fn identity(fd: BorrowedFd<'_>) -> (u64, u64) {
    let stat = nix::sys::stat::fstat(fd).expect("fstat");
    (stat.st_dev, stat.st_ino)
}

fn memfd(name: &std::ffi::CStr) -> OwnedFd {
    memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).expect("memfd")
}

/// Put a fresh decoy file on fd number `raw`, which the caller has just seen closed: the file a
/// stale number would now name. Returns the decoy's identity; the caller closes it.
fn decoy_on(raw: RawFd) -> (OwnedFd, (u64, u64)) {
    let decoy = memfd(c"decoy");
    let id = identity(decoy.as_fd());
    if decoy.as_raw_fd() == raw {
        // The lowest free number was the freed one: the decoy took it by itself.
        return (decoy, id);
    }
    // SAFETY: `raw` was just closed by the test (its owner was replaced and dropped), and the
    // lock keeps every other test of this binary from opening fds meanwhile, so nothing in this
    // process owns that number; dup3 makes the decoy's copy own it.
    let placed = unsafe { libc::dup3(decoy.as_raw_fd(), raw, libc::O_CLOEXEC) };
    assert_eq!(placed, raw, "dup3 onto the freed number");
    // SAFETY: dup3 returned `raw`, a fresh fd that nothing else owns.
    let on_number = unsafe { OwnedFd::from_raw_fd(raw) };
    drop(decoy);
    (on_number, id)
}

/// Whether fd number `raw` is open in this process.
fn is_open(raw: RawFd) -> bool {
    // SAFETY: F_GETFD reads the fd's flags and changes nothing.
    unsafe { libc::fcntl(raw, libc::F_GETFD) != -1 }
}

/// Send `encoded` over a fresh socketpair and return what arrived.
fn send_and_receive(encoded: &Encoded<'_>) -> vmm_core::wire::Message {
    let (a, b) = Channel::pair().expect("pair");
    let fds: Vec<BorrowedFd<'_>> = encoded.fds().collect();
    a.send(encoded.bytes(), &fds).expect("send");
    b.recv(WAIT).expect("recv")
}

#[test]
fn an_fd_replaced_through_a_refcell_after_encode_is_still_sent_as_the_original() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let original = memfd(c"original");
    let original_id = identity(original.as_fd());
    let cell = RefCell::new(Fd::from(original));
    let encoded = encode(&cell).expect("encode");
    // Safe code, while the message exists: replace the owner and drop the old one.
    let raw = cell.borrow().as_raw_fd();
    let old = cell.replace(Fd::from(memfd(c"replacement")));
    drop(old);
    let (_decoy, decoy_id) = decoy_on(raw);
    let message = send_and_receive(&encoded);
    drop(encoded);
    let received: Fd = decode(&message.bytes, message.fds).expect("decode");
    let got = identity(received.as_fd());
    assert_ne!(
        got, decoy_id,
        "the message carried the file that took the stale number"
    );
    assert_eq!(
        got, original_id,
        "the message must carry the file that was serialised"
    );
}

#[test]
fn a_host_descriptor_replaced_through_a_mutex_after_encode_is_still_sent_as_the_original() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let buf = HostBuffer::new(4096).expect("buffer");
    buf.write_at(0, b"original").expect("write");
    let descriptor = buf.export().expect("export");
    let original_id = identity(descriptor.fd().expect("fd"));
    let raw = descriptor.fd().expect("fd").as_raw_fd();
    let cell = Mutex::new(descriptor);
    let encoded = encode(&cell).expect("encode");
    let replacement = HostBuffer::new(4096).expect("buffer");
    replacement.write_at(0, b"replaced").expect("write");
    let old = std::mem::replace(
        &mut *cell.lock().unwrap(),
        replacement.export().expect("export"),
    );
    drop(old);
    let (_decoy, decoy_id) = decoy_on(raw);
    let message = send_and_receive(&encoded);
    drop(encoded);
    let received: HostDescriptor = decode(&message.bytes, message.fds).expect("decode");
    let got = identity(received.fd().expect("fd"));
    assert_ne!(
        got, decoy_id,
        "the message carried the file that took the stale number"
    );
    assert_eq!(got, original_id);
    let alias = HostBuffer::import(&received).expect("import");
    let mut head = [0u8; 8];
    alias.read_at(0, &mut head).expect("read");
    assert_eq!(&head, b"original");
}

#[test]
fn an_ipc_descriptor_replaced_through_a_refcell_after_encode_is_still_sent_as_the_original() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // No GPU needed: a descriptor built from fds received by other means is only data until
    // it is imported, and decoding one imports nothing.
    let chunks = [memfd(c"chunk-a"), memfd(c"chunk-b")];
    let ids: Vec<_> = chunks.iter().map(|fd| identity(fd.as_fd())).collect();
    let borrowed: Vec<_> = chunks.iter().map(AsFd::as_fd).collect();
    let descriptor =
        IpcDescriptor::from_fds(&borrowed, &[4096, 4096], HandleType::PosixFd, 8192).expect("fds");
    drop(chunks);
    let raws: Vec<RawFd> = descriptor.fds().map(|fd| fd.as_raw_fd()).collect();
    let cell = RefCell::new(Some(descriptor));
    let encoded = encode(&cell).expect("encode");
    drop(cell.replace(None));
    let decoys: Vec<_> = raws.iter().map(|&raw| decoy_on(raw)).collect();
    let message = send_and_receive(&encoded);
    drop(encoded);
    let received: Option<IpcDescriptor> = decode(&message.bytes, message.fds).expect("decode");
    let got: Vec<_> = received
        .expect("a descriptor")
        .fds()
        .map(identity)
        .collect();
    for (index, (_, decoy_id)) in decoys.iter().enumerate() {
        assert_ne!(
            got[index], *decoy_id,
            "chunk {index}: the stale number's file"
        );
    }
    assert_eq!(got, ids);
}

#[test]
fn a_queue_replaced_through_a_refcell_after_encode_is_still_sent_as_the_original() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cell = RefCell::new(Queue::<u32>::new().expect("queue"));
    let encoded = encode(&cell).expect("encode");
    let raws: Vec<RawFd> = encoded.fds().map(|fd| fd.as_raw_fd()).collect();
    // The cell held the only handle: replacing it drops the queue's sockets unless the message
    // keeps them.
    drop(cell.replace(Queue::new().expect("queue")));
    let mut decoys = Vec::new();
    for &raw in &raws {
        if !is_open(raw) {
            decoys.push(decoy_on(raw));
        }
    }
    let message = send_and_receive(&encoded);
    drop(encoded);
    let received: Queue<u32> = decode(&message.bytes, message.fds).expect("decode");
    // A queue whose ends were decoys (memfds) cannot carry an item.
    received.put(&7).expect("put on the received queue");
    assert_eq!(received.get(Duration::from_secs(5)).expect("get"), 7);
    assert!(
        decoys.is_empty(),
        "the queue's sockets were closed while a message named them"
    );
}

/// A user type that keeps its fd in an `Arc` and serialises it with `serialize_shared_fd`: no
/// duplicate is made, and the message still owns (a share of) what it sends.
struct SharedFile(std::sync::Arc<OwnedFd>);

impl serde::Serialize for SharedFile {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        vmm_core::wire::serialize_shared_fd(&self.0, "SharedFile", serializer)
    }
}

#[test]
fn a_shared_fd_replaced_through_a_refcell_after_encode_is_still_sent_as_the_original() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let original = memfd(c"shared");
    let original_id = identity(original.as_fd());
    let raw = original.as_raw_fd();
    let cell = RefCell::new(SharedFile(std::sync::Arc::new(original)));
    let encoded = encode(&cell).expect("encode");
    assert_eq!(
        encoded.fds().map(|fd| fd.as_raw_fd()).collect::<Vec<_>>(),
        [raw],
        "shared, not duplicated"
    );
    drop(cell.replace(SharedFile(std::sync::Arc::new(memfd(c"replacement")))));
    assert!(is_open(raw), "the message keeps the shared fd open");
    let message = send_and_receive(&encoded);
    drop(encoded);
    assert!(!is_open(raw), "the last share closed it");
    let received: Fd = decode(&message.bytes, message.fds).expect("decode");
    assert_eq!(identity(received.as_fd()), original_id);
}
