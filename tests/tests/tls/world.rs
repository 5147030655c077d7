//! The test's world: certificates and options, the memfd stand-in for a fabric handle, and an
//! exporter's and importer's side of the stream.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_core::cuda::{FabricDescriptor, FabricHandle};
use vmm_core::error::ProtocolRule;
use vmm_core::peer::PeerMessage;
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::shm::HostBuffer;
use vmm_core::wire::tls::{
    PeerCheck, TlsConnector, TlsIdentity, TlsListener, TlsOptions, TlsStream,
};
use vmm_core::{Error, Result};
use vmm_tests::pattern;
use vmm_tests::pki::{Leaf, LeafSpec, Pki, dns_name};

pub(crate) const SIZE: usize = 1 << 20;
pub(crate) const WAIT: Duration = Duration::from_secs(20);

/// One side's options: `leaf`'s identity, `pki`'s root, admitting `peer`.
pub(crate) fn options(pki: &Pki, leaf: &Leaf, peer: PeerCheck) -> TlsOptions {
    let identity = TlsIdentity::from_pem(leaf.chain_pem.as_bytes(), leaf.key_pem.as_bytes())
        .expect("a test identity");
    TlsOptions::new(identity, vec![pki.ca_der()], peer)
        .expect("test options")
        .handshake_timeout(Duration::from_secs(5))
}

pub(crate) fn names(name: &str) -> PeerCheck {
    PeerCheck::names([dns_name(name)]).unwrap()
}

/// The world of one test: a CA, an exporter and an importer it issued, each admitting the
/// other by name.
pub(crate) struct World {
    pub(crate) pki: Pki,
    pub(crate) exporter: Leaf,
    pub(crate) importer: Leaf,
}

impl World {
    pub(crate) fn new() -> World {
        let pki = Pki::new("tls");
        let exporter = pki.issue(&LeafSpec::new("exporter"));
        let importer = pki.issue(&LeafSpec::new("importer"));
        World {
            pki,
            exporter,
            importer,
        }
    }

    pub(crate) fn exporter_options(&self) -> TlsOptions {
        options(&self.pki, &self.exporter, names("importer"))
    }

    pub(crate) fn importer_options(&self) -> TlsOptions {
        options(&self.pki, &self.importer, names("exporter"))
    }

    /// What a child importer is given: the exporter's address, its identity, the root.
    pub(crate) fn child_args(&self, addr: SocketAddr) -> ImporterArgs {
        (
            addr.to_string(),
            self.importer.cert_pem.clone(),
            self.importer.key_pem.clone(),
            self.pki.ca_pem(),
        )
    }

    pub(crate) fn listener(&self) -> TlsListener {
        TlsListener::bind("127.0.0.1:0", &self.exporter_options()).unwrap()
    }
}

/// A descriptor whose one "handle" names `buf`'s memfd in this process: the stand-in for a
/// fabric handle (whoever reads the 64 bytes, being of this uid, maps the memory).
pub(crate) fn stand_in(buf: &HostBuffer) -> (FabricDescriptor, OwnedFd) {
    let descriptor = buf.export().unwrap();
    let fd = descriptor
        .fd()
        .expect("an exported descriptor holds its fd")
        .try_clone_to_owned()
        .unwrap();
    let path = format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd());
    let mut bytes = [0u8; 64];
    bytes[..path.len()].copy_from_slice(path.as_bytes());
    let fabric =
        FabricDescriptor::from_handles(&[FabricHandle::from_bytes(bytes)], &[SIZE], SIZE, [7; 16])
            .unwrap();
    (fabric, fd)
}

/// Map the memory a stand-in descriptor names, read-write: what an importer does.
pub(crate) fn map_stand_in(descriptor: &FabricDescriptor) -> std::io::Result<memmap::Mapping> {
    let bytes = descriptor.handles()[0].as_bytes();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let path = std::str::from_utf8(&bytes[..end]).expect("a path");
    memmap::Mapping::open(path, descriptor.size())
}

/// A shared read-write mapping of a file by path, unmapped on drop.
pub(crate) mod memmap {
    use std::fs::OpenOptions;
    use std::os::fd::AsRawFd;

    pub struct Mapping {
        ptr: *mut u8,
        len: usize,
    }

    impl Mapping {
        pub fn open(path: &str, len: usize) -> std::io::Result<Mapping> {
            let file = OpenOptions::new().read(true).write(true).open(path)?;
            // SAFETY: a fresh shared mapping of `len` bytes of an open file; the kernel checks
            // the file's size and access, and nothing else aliases the new range.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            Ok(Mapping {
                ptr: ptr.cast(),
                len,
            })
        }

        pub fn bytes(&mut self) -> &mut [u8] {
            // SAFETY: `ptr` maps `len` bytes for as long as `self` lives.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the mapping this value made, unmapped once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

/// The exporter's side of one hand-off on an accepted stream: the descriptor, then the
/// importer's `DATA` reply.
pub(crate) fn export_on(stream: &mut TlsStream, descriptor: &FabricDescriptor) -> Result<Vec<u8>> {
    StreamWriter::new(&mut *stream).write_descriptor(descriptor)?;
    match StreamReader::new(&mut *stream).read_message()? {
        PeerMessage::Data(reply) => Ok(reply),
        PeerMessage::Descriptor(_) => Err(Error::Protocol {
            rule: ProtocolRule::UnexpectedKind,
            message: "a descriptor, not a reply".into(),
        }),
    }
}

/// The importer's side: connect, read the descriptor, map it, check the pattern, write its
/// own, reply.
pub(crate) fn import_from(addr: SocketAddr, options: &TlsOptions) -> Result<()> {
    let mut stream = TlsConnector::new(options)?.connect(addr)?;
    let descriptor = match StreamReader::new(&mut stream).read_message()? {
        PeerMessage::Descriptor(d) => d.into_fabric()?,
        PeerMessage::Data(_) => {
            return Err(Error::Protocol {
                rule: ProtocolRule::UnexpectedKind,
                message: "DATA, not a descriptor".into(),
            });
        }
    };
    let mut mapping = map_stand_in(&descriptor).map_err(|e| Error::Os {
        op: "mapping the stand-in".into(),
        source: e,
    })?;
    let matched = mapping.bytes()[..] == pattern(1, SIZE)[..];
    mapping.bytes().copy_from_slice(&pattern(2, SIZE));
    let reply: &[u8] = if matched { b"matched" } else { b"NOT matched" };
    StreamWriter::new(&mut stream).write_data(reply)?;
    Ok(())
}

/// What a client that is to be refused does: connect with `options` and try to read a
/// message. Its result, and how many application bytes it read (always 0 when refused).
pub(crate) fn try_as_importer(
    addr: SocketAddr,
    options: TlsOptions,
) -> JoinHandle<Result<PeerMessage>> {
    std::thread::spawn(move || {
        let mut stream = TlsConnector::new(&options)?.connect(addr)?;
        StreamReader::new(&mut stream).read_message()
    })
}

/// The arguments of the child importer: the address and its PEM identity and root.
pub(crate) type ImporterArgs = (String, String, String, String);

/// A child importer's options from its arguments: its identity, the root, the exporter's name.
pub(crate) fn child_options(cert: &str, key: &str, ca: &str) -> TlsOptions {
    let identity = TlsIdentity::from_pem(cert.as_bytes(), key.as_bytes()).unwrap();
    let ca = vmm_tests::pki::pem_to_der(ca);
    TlsOptions::new(identity, vec![ca], names("exporter")).unwrap()
}
