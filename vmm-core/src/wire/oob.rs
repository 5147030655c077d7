//! File descriptors carried out of band while a value is (de)serialised.
//!
//! A value's bytes travel as postcard; each fd it contains is replaced by an index into the
//! message's SCM_RIGHTS array. [`encode`] installs a per-thread sink that fd-backed values push
//! into while they serialise; [`decode`] installs a per-thread source they take from. Outside these
//! two calls there is no sink or source, so serialising an fd-backed value (with serde_json, say)
//! fails with an error that says why instead of producing a number that means nothing elsewhere.
//!
//! The sink owns or borrows every fd it collects, so an [`Encoded`] message never names a
//! closed fd: the public entry points hand the sink an fd it owns ([`serialize_fd`] takes a
//! duplicate, [`serialize_owned_fd`] takes the fd), and only the crate's own types, which own
//! their fds for at least as long as [`encode`] borrows them, may lend one
//! ([`serialize_lent_fd`], an `unsafe fn`).
//!
//! Errors raised inside an fd-backed value's serde impl ([`serialize_error`],
//! [`deserialize_error`]) come out of [`encode`]/[`decode`] as the same [`Error`] variant: serde
//! formats keep only a message, so the typed error waits in the per-thread slot.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use serde::de::{DeserializeOwned, Deserializer, Error as _};
use serde::ser::{Error as _, Serializer};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One fd collected while serialising.
#[derive(Debug)]
enum OutFd {
    /// Lent by a crate type that keeps it open while the [`Encoded`] lives.
    Lent(RawFd),
    /// Owned by the message: a duplicate, or a fresh fd (an export) handed over.
    Owned(OwnedFd),
}

/// A value's bytes and the fds it carries; borrows the value for `'a`, so that fds the value
/// lent stay open while the message exists.
#[derive(Debug)]
pub struct Encoded<'a> {
    bytes: Vec<u8>,
    fds: Vec<OutFd>,
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
        self.fds.iter().map(|fd| match fd {
            OutFd::Owned(fd) => fd.as_fd(),
            // SAFETY: a lent fd was pushed by `serialize_lent_fd`, whose caller promised that
            // it stays open until this `Encoded` is dropped; the borrow ends before that.
            OutFd::Lent(raw) => unsafe { BorrowedFd::borrow_raw(*raw) },
        })
    }
}

struct Sink {
    fds: Vec<OutFd>,
    /// The first error an fd-backed value raised, typed; postcard's own error loses it.
    error: Option<Error>,
}

struct Source {
    fds: Vec<Option<OwnedFd>>,
    error: Option<Error>,
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
/// The result borrows `value`: fds the value lent stay valid as long as the value does.
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
        (_, Some(error)) => Err(error),
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
        (_, Some(error)) => Err(error),
        (Err(e), None) => Err(Error::Serde(e.to_string())),
    }
}

/// The refusal of an fd-backed value outside [`encode`]/[`decode`].
fn outside_transport(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "{what} carries a file descriptor and can only be (de)serialised by vmm_core::wire \
         (a Queue, a Process argument or wire::encode/decode), which moves the fd out of band; \
         another serde format would produce a number that means nothing in another process"
    ))
}

/// Record an fd-backed value's error so that [`encode`] returns it as it is.
fn fail_ser<S: Serializer>(error: Error) -> S::Error {
    let message = error.to_string();
    SINK.with(|slot| {
        if let Some(sink) = slot.borrow_mut().as_mut() {
            sink.error.get_or_insert(error);
        }
    });
    S::Error::custom(message)
}

/// Push `fd` into the sink and serialise its index; refused outside [`encode`].
fn push<S: Serializer>(fd: OutFd, what: &str, serializer: S) -> Result<S::Ok, S::Error> {
    let index = SINK.with(|slot| {
        slot.borrow_mut().as_mut().map(|sink| {
            sink.fds.push(fd);
            sink.fds.len() - 1
        })
    });
    match index {
        Some(index) => serializer.serialize_u32(index as u32),
        None => Err(fail_ser::<S>(outside_transport(what))),
    }
}

/// Serialise an fd: the message carries a duplicate of it (made now, close-on-exec), so the
/// caller's fd may be closed at once. For `Serialize` impls of fd-backed types; `what` names the
/// type in errors.
pub fn serialize_fd<S: Serializer>(
    fd: BorrowedFd<'_>,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    if SINK.with(|slot| slot.borrow().is_none()) {
        return Err(fail_ser::<S>(outside_transport(what)));
    }
    match fd.try_clone_to_owned() {
        Ok(owned) => push(OutFd::Owned(owned), what, serializer),
        Err(e) => Err(fail_ser::<S>(Error::io(
            format!("dup of fd {} for a message ({what})", fd.as_raw_fd()),
            e,
        ))),
    }
}

/// Serialise an fd that the message takes over (closed once the message is dropped).
pub fn serialize_owned_fd<S: Serializer>(
    fd: OwnedFd,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    push(OutFd::Owned(fd), what, serializer)
}

/// Serialise an fd by reference, without a duplicate: the message carries the same number.
///
/// # Safety
/// `fd` must stay open, and refer to the same file, until every [`Encoded`] produced by the
/// [`encode`] call now running on this thread is dropped. The crate's own types meet this by
/// lending only fds they own: [`encode`] borrows the value for as long as the `Encoded` lives.
pub(crate) unsafe fn serialize_lent_fd<S: Serializer>(
    fd: BorrowedFd<'_>,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    push(OutFd::Lent(fd.as_raw_fd()), what, serializer)
}

/// Report an error from inside an fd-backed `Serialize` impl (an export that failed, say):
/// [`encode`] returns it unchanged.
pub fn serialize_error<S: Serializer>(error: Error) -> S::Error {
    fail_ser::<S>(error)
}

/// Report an error from inside an fd-backed `Deserialize` impl (an import that failed, say):
/// [`decode`] returns it unchanged.
pub fn deserialize_error<'de, D: Deserializer<'de>>(error: Error) -> D::Error {
    let message = error.to_string();
    SOURCE.with(|slot| {
        if let Some(source) = slot.borrow_mut().as_mut() {
            source.error.get_or_insert(error);
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
        Some(None) => Err(deserialize_error::<D>(Error::Protocol(format!(
            "{what} refers to fd #{index}, which the message does not carry or another value took"
        )))),
        None => Err(deserialize_error::<D>(outside_transport(what))),
    }
}
