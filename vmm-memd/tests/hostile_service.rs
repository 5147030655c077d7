//! A hostile service against the Rust client: a thread of this test plays the service on
//! its own socket (the real session, the real protocol types, forged answers) and sends a GPU
//! region's chunk as a `CUDA_VMM` descriptor that does not name the device its reply
//! announced: another device's UUID, or none. The client must refuse it as `BadReply` before
//! anything is imported (a driver would otherwise map another device's memory, or memory of
//! unknown origin, as the region's), and must not keep the fd it was sent. The same forged
//! service naming the announced device is answered with the chunk: the refusal is the
//! device check's, not a flaw of the forgery. No GPU is needed: `attach_unmapped` hands the
//! fds on without importing them.

use std::os::fd::AsFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::Duration;

use vmm_core::cuda::{DeviceIdentity, HandleType, IpcDescriptor};
use vmm_core::peer::Session;
use vmm_core::wire::endpoint::{Listener, Name};
use vmm_memd::protocol::{Request, Response};
use vmm_memd::{Client, MemdError};

const ANNOUNCED: [u8; 16] = [0xa1; 16];
const OTHER: [u8; 16] = [0xb2; 16];
const CHUNK: u64 = 2 << 20;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The tests count this process's fds: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// What the forged service's descriptor names as its device.
#[derive(Debug, Clone, Copy)]
enum Named {
    Device([u8; 16]),
    Nothing,
}

/// A forged service on a fresh socket that answers one `Attach` with a one-chunk GPU region
/// on [`ANNOUNCED`] and sends the chunk (a memfd standing in for the exported chunk) with
/// `named` in its descriptor; returns the socket's name and the thread.
fn forged_service(named: Named) -> (Name, thread::JoinHandle<()>) {
    let name = Name::from(
        format!(
            "@vmm-memd-hostile-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
        .as_str(),
    );
    let listener = Listener::bind(&name).expect("bind the forged service's socket");
    let serve = thread::spawn(move || {
        let session =
            Session::accept(&listener, Some(Duration::from_secs(30))).expect("accept the client");
        let request: Request = postcard::from_bytes(&session.recv_data().expect("a request"))
            .expect("a request the service would read");
        assert!(
            matches!(request, Request::Attach { .. }),
            "the client sent {request:?}"
        );
        let reply = Response::AttachedGpu {
            lease: 1,
            generation: 1,
            chunks: vec![CHUNK],
            meta_pages: 0,
            ttl_ms: 30_000,
            device: ANNOUNCED,
            fabric: false,
        };
        session
            .send_data(&postcard::to_allocvec(&reply).unwrap())
            .expect("send the reply");
        let memfd =
            nix::sys::memfd::memfd_create(c"forged-chunk", nix::sys::memfd::MFdFlags::empty())
                .expect("memfd_create");
        nix::unistd::ftruncate(&memfd, CHUNK as i64).expect("ftruncate");
        let len = CHUNK as usize;
        let mut descriptor =
            IpcDescriptor::from_fds(&[memfd.as_fd()], &[len], HandleType::PosixFd, len)
                .expect("a descriptor of one fd");
        if let Named::Device(uuid) = named {
            descriptor = descriptor.with_device(DeviceIdentity { ordinal: 0, uuid });
        }
        // The client may hang up once it has refused the descriptor: not this thread's
        // failure.
        let _ = session.send_descriptor(&descriptor);
        // Hold the connection until the client is done with it.
        let _ = session.recv_data();
    });
    (name, serve)
}

/// This process's open fds.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Attach through a forged service naming `named`; the client's answer, and how many more
/// fds this process holds after the client (and its answer) are gone.
fn attach_through(named: Named) -> (Result<usize, MemdError>, usize) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let before = fds();
    let (name, serve) = forged_service(named);
    let answer = {
        let client = Client::connect(&name).expect("connect to the forged service");
        let answer = client
            .attach_unmapped("weights", None)
            .map(|u| u.chunks.len());
        drop(client);
        answer
    };
    serve.join().expect("the forged service's thread");
    (answer, fds().saturating_sub(before))
}

#[test]
fn a_gpu_chunk_naming_another_device_is_refused_and_its_fd_closed() {
    let (answer, kept) = attach_through(Named::Device(OTHER));
    assert!(matches!(answer, Err(MemdError::BadReply(_))), "{answer:?}");
    assert_eq!(kept, 0, "the refused chunk's fd was kept");
}

#[test]
fn a_gpu_chunk_naming_no_device_is_refused_and_its_fd_closed() {
    let (answer, kept) = attach_through(Named::Nothing);
    assert!(matches!(answer, Err(MemdError::BadReply(_))), "{answer:?}");
    assert_eq!(kept, 0, "the refused chunk's fd was kept");
}

#[test]
fn the_same_forgery_naming_the_announced_device_is_answered_with_the_chunk() {
    let (answer, kept) = attach_through(Named::Device(ANNOUNCED));
    assert_eq!(answer.expect("the chunk"), 1);
    assert_eq!(kept, 0, "the chunk's fd outlived the answer");
}
