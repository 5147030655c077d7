//! File descriptors carried out of band while a value is (de)serialised.
//!
//! A value's bytes travel as postcard; each fd it contains is replaced by an index into the
//! message's SCM_RIGHTS array. [`encode`] installs a per-thread sink that fd-backed values push
//! into while they serialise; [`decode`] installs a per-thread source they take from. Outside these
//! two calls there is no sink or source, so serialising an fd-backed value (with serde_json, say)
//! fails with an error that says why instead of producing a number that means nothing elsewhere.

use std::cell::RefCell;
use std::fmt::Display;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use serde::de::{DeserializeOwned, Deserializer, Error as _};
use serde::ser::{Error as _, Serializer};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One fd collected while serialising: borrowed from the value, or created for the message
/// (an export makes a fresh fd that only the message owns).
#[derive(Debug)]
pub(crate) enum OutFd {
    Borrowed(RawFd),
    Owned(OwnedFd),
}

impl OutFd {
    pub(crate) fn raw(&self) -> RawFd {
        match self {
            OutFd::Borrowed(fd) => *fd,
            OutFd::Owned(fd) => fd.as_raw_fd(),
        }
    }
}

/// A value's bytes and the fds it carries, borrowed from the value for `'a`.
#[derive(Debug)]
pub struct Encoded<'a> {
    pub(crate) bytes: Vec<u8>,
    pub(crate) fds: Vec<OutFd>,
    _value: PhantomData<&'a ()>,
}

impl Encoded<'_> {
    /// The serialised bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// How many fds the value carries.
    pub fn fd_count(&self) -> usize {
        self.fds.len()
    }

    /// The fds, in index order, as the message will carry them.
    pub fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        // SAFETY: each raw fd is either owned by `self.fds` or borrowed from the value that `self`
        // borrows for its lifetime, so it stays open while the returned borrow lives.
        self.fds
            .iter()
            .map(|fd| unsafe { BorrowedFd::borrow_raw(fd.raw()) })
    }
}

struct Sink {
    fds: Vec<OutFd>,
    /// The first error an fd-backed value raised; postcard's own error loses the message.
    error: Option<String>,
}

struct Source {
    fds: Vec<Option<OwnedFd>>,
    error: Option<String>,
}

thread_local! {
    static SINK: RefCell<Option<Sink>> = const { RefCell::new(None) };
    static SOURCE: RefCell<Option<Source>> = const { RefCell::new(None) };
}

/// Restores the previous per-thread slot when dropped, so nested or panicking calls stay sound.
struct Installed<T: 'static> {
    key: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    previous: Option<T>,
}

impl<T: 'static> Installed<T> {
    fn new(key: &'static std::thread::LocalKey<RefCell<Option<T>>>, value: T) -> Self {
        let previous = key.with(|slot| slot.borrow_mut().replace(value));
        Installed { key, previous }
    }

    fn take(mut self) -> T {
        let previous = self.previous.take();
        let current = self
            .key
            .with(|slot| std::mem::replace(&mut *slot.borrow_mut(), previous));
        std::mem::forget(self);
        current.expect("installed slot is present until taken")
    }
}

impl<T: 'static> Drop for Installed<T> {
    fn drop(&mut self) {
        let previous = self.previous.take();
        self.key.with(|slot| *slot.borrow_mut() = previous);
    }
}

/// Serialise `value` with postcard, collecting the fds it carries.
///
/// The result borrows `value`: borrowed fds stay valid as long as the value does.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded<'_>> {
    let installed = Installed::new(
        &SINK,
        Sink {
            fds: Vec::new(),
            error: None,
        },
    );
    let result = postcard::to_stdvec(value);
    let sink = installed.take();
    match (result, sink.error) {
        (Ok(bytes), None) => Ok(Encoded {
            bytes,
            fds: sink.fds,
            _value: PhantomData,
        }),
        (_, Some(message)) => Err(Error::Serde(message)),
        (Err(e), None) => Err(Error::Serde(e.to_string())),
    }
}

/// Deserialise a value from postcard `bytes`, handing it the message's `fds` by index.
///
/// Every fd the value does not take is closed when this returns.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<T> {
    let installed = Installed::new(
        &SOURCE,
        Source {
            fds: fds.into_iter().map(Some).collect(),
            error: None,
        },
    );
    let result = postcard::from_bytes(bytes);
    let source = installed.take();
    match (result, source.error) {
        (Ok(value), None) => Ok(value),
        (_, Some(message)) => Err(Error::Serde(message)),
        (Err(e), None) => Err(Error::Serde(e.to_string())),
    }
}

fn outside_transport(what: &str) -> String {
    format!(
        "{what} carries a file descriptor and can only be (de)serialised by vmm_core::wire \
         (a Queue, a Process argument or wire::encode/decode), which moves the fd out of band; \
         another serde format would produce a number that means nothing in another process"
    )
}

/// Record an fd-backed value's error so that [`encode`] reports it (postcard drops custom messages).
fn fail_ser<S: Serializer>(message: String) -> S::Error {
    SINK.with(|slot| {
        if let Some(sink) = slot.borrow_mut().as_mut() {
            sink.error.get_or_insert_with(|| message.clone());
        }
    });
    S::Error::custom(message)
}

/// Serialise `fd` by reference: the message carries the same open file, the value keeps its fd.
///
/// For use in `Serialize` impls of fd-backed types; `what` names the type in errors.
pub fn serialize_fd<S: Serializer>(
    fd: BorrowedFd<'_>,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let index = SINK.with(|slot| {
        slot.borrow_mut().as_mut().map(|sink| {
            sink.fds.push(OutFd::Borrowed(fd.as_raw_fd()));
            sink.fds.len() - 1
        })
    });
    match index {
        Some(index) => serializer.serialize_u32(index as u32),
        None => Err(fail_ser::<S>(outside_transport(what))),
    }
}

/// Serialise an fd that the message takes over (closed once the message is sent or dropped).
pub fn serialize_owned_fd<S: Serializer>(
    fd: OwnedFd,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let index = SINK.with(|slot| {
        slot.borrow_mut().as_mut().map(|sink| {
            sink.fds.push(OutFd::Owned(fd));
            sink.fds.len() - 1
        })
    });
    match index {
        Some(index) => serializer.serialize_u32(index as u32),
        None => Err(fail_ser::<S>(outside_transport(what))),
    }
}

/// Report an error from inside an fd-backed `Serialize` impl (an export that failed, say) so that
/// the transport's error carries this message.
pub fn serialize_error<S: Serializer>(error: impl Display) -> S::Error {
    fail_ser::<S>(error.to_string())
}

/// Report an error from inside an fd-backed `Deserialize` impl (an import that failed, say).
pub fn deserialize_error<'de, D: Deserializer<'de>>(error: impl Display) -> D::Error {
    let message = error.to_string();
    SOURCE.with(|slot| {
        if let Some(source) = slot.borrow_mut().as_mut() {
            source.error.get_or_insert_with(|| message.clone());
        }
    });
    D::Error::custom(message)
}

/// Take the fd a serialised index refers to. For use in `Deserialize` impls of fd-backed types.
pub fn deserialize_fd<'de, D: Deserializer<'de>>(
    what: &str,
    deserializer: D,
) -> Result<OwnedFd, D::Error> {
    let index = u32::deserialize(deserializer)? as usize;
    let taken = SOURCE.with(|slot| {
        slot.borrow_mut()
            .as_mut()
            .map(|source| source.fds.get_mut(index).and_then(Option::take))
    });
    match taken {
        Some(Some(fd)) => Ok(fd),
        Some(None) => Err(deserialize_error::<D>(format!(
            "{what} refers to fd #{index}, which the message does not carry or another value took"
        ))),
        None => Err(deserialize_error::<D>(outside_transport(what))),
    }
}

/// An owned file descriptor that can be sent: a Process argument or a Queue item.
///
/// The receiver gets its own `OwnedFd` for the same open file description.
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
#[derive(Debug)]
pub struct Fd(pub OwnedFd);

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
        serialize_fd(self.0.as_fd(), "vmm_core::wire::Fd", serializer)
    }
}

impl<'de> Deserialize<'de> for Fd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_fd("vmm_core::wire::Fd", deserializer).map(Fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fds_travel_out_of_band_and_untaken_ones_close() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let value = (Fd::from(OwnedFd::from(a)), 7u32, Fd::from(OwnedFd::from(b)));
        let encoded = encode(&value).unwrap();
        assert_eq!(encoded.fd_count(), 2);
        let fds: Vec<OwnedFd> = encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect();
        let (x, n, y): (Fd, u32, Fd) = decode(encoded.bytes(), fds).unwrap();
        assert_eq!(n, 7);
        assert_ne!(x.as_raw_fd(), y.as_raw_fd());
    }

    #[test]
    fn a_missing_fd_is_an_error_naming_it() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = Fd::from(OwnedFd::from(a));
        let encoded = encode(&fd).unwrap();
        let err = decode::<Fd>(encoded.bytes(), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("fd #0"), "{err}");
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
}
