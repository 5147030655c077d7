//! The fd fields of serialisable types: [`Fd`] for users, [`FdOut`]/[`FdIn`] for the crate's
//! own descriptors, buffers and queues (one wrapper for all of them).

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::oob;
use crate::Error;
use crate::error::ProtocolRule;

/// A type that carries fds on the wire; its name appears in transport errors.
pub(crate) trait FdOwner {
    /// The public path of the type, e.g. `vmm_core::wire::Queue`.
    const WHAT: &'static str;
}

/// How one fd of an `O` leaves in a message. The message owns each: a duplicate (`dup`), a share
/// of a reference-counted owner (`kept`), or the fd itself (`given`, e.g. a fresh export).
pub(crate) struct FdOut<'a, O> {
    fd: Out<'a>,
    _owner: PhantomData<fn() -> O>,
}

enum Out<'a> {
    /// Duplicated when serialised.
    Dup(BorrowedFd<'a>),
    /// Owned by the keeper, which the message holds a reference to.
    Kept(Arc<dyn Any + Send + Sync>, BorrowedFd<'a>),
    /// A `Cell` because `Serialize` takes `&self`; taken on the one serialisation.
    Given(Cell<Option<OwnedFd>>),
}

impl<'a, O: FdOwner> FdOut<'a, O> {
    /// Send a duplicate of `fd`, made when this serialises (one syscall).
    pub(crate) fn dup(fd: BorrowedFd<'a>) -> Self {
        FdOut {
            fd: Out::Dup(fd),
            _owner: PhantomData,
        }
    }

    /// Send `fd` without a duplicate; the message keeps a reference to `keep`, which owns it.
    ///
    /// # Safety
    /// `keep` must own `fd` as [`oob::serialize_kept_fd`] requires: open, and the same file,
    /// for as long as any reference to `keep` lives.
    pub(crate) unsafe fn kept(keep: Arc<dyn Any + Send + Sync>, fd: BorrowedFd<'a>) -> Self {
        FdOut {
            fd: Out::Kept(keep, fd),
            _owner: PhantomData,
        }
    }

    /// Give `fd` to the message.
    pub(crate) fn given(fd: OwnedFd) -> Self {
        FdOut {
            fd: Out::Given(Cell::new(Some(fd))),
            _owner: PhantomData,
        }
    }
}

impl<O: FdOwner> Serialize for FdOut<'_, O> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.fd {
            Out::Dup(fd) => oob::serialize_fd(*fd, O::WHAT, serializer),
            // SAFETY: `FdOut::kept`'s caller promised that `keep` owns the fd as required.
            Out::Kept(keep, fd) => unsafe {
                oob::serialize_kept_fd(Arc::clone(keep), *fd, O::WHAT, serializer)
            },
            Out::Given(cell) => match cell.take() {
                Some(fd) => oob::serialize_owned_fd(fd, O::WHAT, serializer),
                None => Err(oob::serialize_error::<S>(Error::protocol(
                    ProtocolRule::Fds,
                    format!("{}: an fd given to a message was serialised twice", O::WHAT),
                ))),
            },
        }
    }
}

/// One fd of an `O` taken from a message, owned from the moment it is taken.
pub(crate) struct FdIn<O> {
    fd: OwnedFd,
    _owner: PhantomData<fn() -> O>,
}

impl<O> FdIn<O> {
    pub(crate) fn into_inner(self) -> OwnedFd {
        self.fd
    }
}

impl<'de, O: FdOwner> Deserialize<'de> for FdIn<O> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        oob::deserialize_fd(O::WHAT, deserializer).map(|fd| FdIn {
            fd,
            _owner: PhantomData,
        })
    }
}

/// An owned file descriptor that can be sent: a Process argument or a Queue item.
///
/// The receiver gets its own `OwnedFd` for the same open file description. The message carries
/// a duplicate made when it is encoded (one `dup`), so it stays right even if the `Fd` is
/// replaced or dropped before the message is sent (the field is public, so nothing else could
/// keep the fd open for the message).
///
/// ```
/// use vmm_core::wire::{decode, encode, Fd};
/// let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
/// let fd = Fd::from(std::os::fd::OwnedFd::from(a));
/// let encoded = encode(&fd).unwrap();
/// assert_eq!(encoded.fd_count(), 1);
/// // Outside the transport the value refuses to serialise.
/// assert!(serde_json::to_string(&fd).is_err());
/// ```
pub struct Fd(pub OwnedFd);

impl fmt::Debug for Fd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Fd").field(&self.0.as_raw_fd()).finish()
    }
}

impl FdOwner for Fd {
    const WHAT: &'static str = "vmm_core::wire::Fd";
}

impl From<OwnedFd> for Fd {
    fn from(fd: OwnedFd) -> Self {
        Fd(fd)
    }
}

impl From<Fd> for OwnedFd {
    fn from(fd: Fd) -> Self {
        fd.0
    }
}

impl AsFd for Fd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl Serialize for Fd {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        FdOut::<Fd>::dup(self.0.as_fd()).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Fd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        FdIn::<Fd>::deserialize(deserializer).map(|fd| Fd(fd.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode, encode};
    use std::io::{Read, Seek, Write};

    fn owned(encoded: &super::super::Encoded<'_>) -> Vec<OwnedFd> {
        encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect()
    }

    #[test]
    fn fds_travel_out_of_band_and_untaken_ones_close() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let value = (Fd::from(OwnedFd::from(a)), 7u32, Fd::from(OwnedFd::from(b)));
        let encoded = encode(&value).unwrap();
        assert_eq!(encoded.fd_count(), 2);
        let (x, n, y): (Fd, u32, Fd) = decode(encoded.bytes(), owned(&encoded)).unwrap();
        assert_eq!(n, 7);
        assert_ne!(x.as_raw_fd(), y.as_raw_fd());
    }

    #[test]
    fn a_missing_fd_is_a_protocol_error_naming_it() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = Fd::from(OwnedFd::from(a));
        let encoded = encode(&fd).unwrap();
        let err = decode::<Fd>(encoded.bytes(), Vec::new()).unwrap_err();
        assert!(
            matches!(&err, Error::Protocol { rule: ProtocolRule::Fds, message: m }
                if m.contains("fd #0") && m.contains("wire::Fd")),
            "{err:?}"
        );
    }

    #[test]
    fn other_formats_refuse_fd_backed_values_and_say_why() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = serde_json::to_string(&Fd::from(OwnedFd::from(a)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("vmm_core::wire") && err.contains("out of band"),
            "{err}"
        );
        let err = serde_json::from_str::<Fd>("3").unwrap_err().to_string();
        assert!(err.contains("vmm_core::wire"), "{err}");
    }

    /// A user type that serialises an fd it does not keep: the file is opened, serialised and
    /// closed inside `serialize`. The message must still carry *that* file.
    struct TemporaryFile(&'static [u8]);

    impl Serialize for TemporaryFile {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let fd =
                nix::sys::memfd::memfd_create(c"temporary", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                    .unwrap();
            let mut file = std::fs::File::from(fd);
            file.write_all(self.0).unwrap();
            let result = oob::serialize_fd(file.as_fd(), "TemporaryFile", serializer);
            drop(file); // closed before the message is sent
            result
        }
    }

    #[test]
    fn a_temporary_fd_is_sent_as_the_file_it_was() {
        let encoded = encode(&TemporaryFile(b"the right file")).unwrap();
        // The temporary's number is free again: the next open takes it (lowest free fd). Had
        // the message kept only the number, it would now name this decoy.
        let decoy = std::fs::File::open("/proc/self/stat").unwrap();
        let bytes = encoded.bytes().to_vec();
        let fds = owned(&encoded);
        drop(encoded);
        let received: Fd = decode(&bytes, fds).unwrap();
        let mut file = std::fs::File::from(received.0);
        file.rewind().unwrap();
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "the right file");
        drop(decoy);
    }

    #[test]
    fn errors_raised_inside_serde_impls_stay_typed() {
        struct Refuses;
        impl Serialize for Refuses {
            fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(oob::serialize_error::<S>(Error::TooManyFds {
                    count: 9,
                    max: 1,
                }))
            }
        }
        assert!(matches!(
            encode(&Refuses),
            Err(Error::TooManyFds { count: 9, max: 1 })
        ));
    }
}
