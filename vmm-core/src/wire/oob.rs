//! File descriptors carried out of band while a value is (de)serialised.
//!
//! A value's bytes travel as postcard; each fd it contains is replaced by an index into the
//! message's SCM_RIGHTS array. [`encode`] installs a per-thread sink that fd-backed values push
//! into while they serialise; [`decode`] installs a per-thread source they take from. Outside these
//! two calls there is no sink or source, so serialising an fd-backed value (with serde_json, say)
//! fails with an error that says why instead of producing a number that means nothing elsewhere.
//!
//! The message owns every fd it carries, so an [`Encoded`] never names a closed fd, nor a file
//! that took a closed fd's number: safe code can replace a value's fd owner through a `RefCell`
//! or a `Mutex` between [`encode`] and the send, and the message still carries the file that
//! was serialised. Each fd reaches the sink in one of three ways:
//! - [`serialize_fd`]: a duplicate, made while the value serialises (one `fcntl(F_DUPFD_CLOEXEC)`,
//!   a fraction of a microsecond). What [`Fd`](super::Fd),
//!   `shm::HostDescriptor` and
//!   `cuda::IpcDescriptor` use: their fds are plain `OwnedFd`s that a
//!   caller can take out of them (`into_fds`, the public field of `Fd`).
//! - [`serialize_shared_fd`]: no syscall; the message holds a clone of an `Arc<OwnedFd>`, so the
//!   fd stays open while either side holds it. A [`Queue`](super::Queue) shares its sockets this
//!   way (the message holds the queue's reference-counted ends).
//! - [`serialize_owned_fd`]: the fd is handed over (a fresh export: buffers export on the way).
//!
//! No path hands the message a bare fd number.
//!
//! Errors raised inside an fd-backed value's serde impl ([`serialize_error`],
//! [`deserialize_error`]) come out of [`encode`]/[`decode`] as the same [`Error`] variant: serde
//! formats keep only a message, so the typed error waits in the per-thread slot.

use std::any::Any;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;

use serde::de::{DeserializeOwned, Deserializer, Error as _};
use serde::ser::{Error as _, Serializer};
use serde::{Deserialize, Serialize};

use crate::error::{FdlessTransport, ProtocolRule, SerdeStep};
use crate::{Error, Result};

/// What keeps a shared fd open: any reference-counted owner of it.
type Keeper = Arc<dyn Any + Send + Sync>;

/// One fd collected while serialising. Either way the message keeps the fd open.
#[derive(Debug)]
enum OutFd {
    /// Owned by the message: a duplicate, or a fresh fd (an export) handed over.
    Owned(OwnedFd),
    /// Owned by `keep`, of which the message holds a reference.
    Shared {
        /// Owns `fd`, and never closes it while any reference to it lives; held, never read.
        _keep: Keeper,
        fd: RawFd,
    },
}

/// A value's bytes and the fds it carries.
///
/// The message owns every fd (a duplicate, an fd handed over, or a share of a
/// reference-counted owner), so it does not depend on the value it came from: [`encode`]
/// returns an `Encoded<'static>`. The lifetime parameter remains for source compatibility.
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
            // SAFETY: `keep` owns the fd and keeps it open while any reference to it lives
            // (`serialize_kept_fd`'s contract); `self` holds one for longer than this borrow.
            OutFd::Shared { fd, .. } => unsafe { BorrowedFd::borrow_raw(*fd) },
        })
    }

    /// The bytes and fds of their own, for a message kept apart from anything it came from
    /// (a queued pool task, a task's result): owned fds move out, a shared one is duplicated.
    pub(crate) fn into_owned(self) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
        let fds = self
            .fds
            .into_iter()
            .map(|fd| match fd {
                OutFd::Owned(fd) => Ok(fd),
                // SAFETY: as in `fds`: `_keep` keeps the fd open for this borrow.
                OutFd::Shared { fd, _keep } => unsafe { BorrowedFd::borrow_raw(fd) }
                    .try_clone_to_owned()
                    .map_err(|e| Error::io("dup(a shared fd of a message)", e)),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((self.bytes, fds))
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
/// The message owns every fd it carries, so replacing or dropping `value`, or an fd owner
/// inside it (through a `RefCell` or a `Mutex`, say), afterwards changes nothing the message
/// sends; no path hands it a bare fd number. Each fd arrives by one of:
/// - [`serialize_fd`]: a duplicate made while the value serialises (one `dup`, a fraction of a
///   microsecond): how [`Fd`](super::Fd), `shm::HostDescriptor` and
///   `cuda::IpcDescriptor` send theirs (plain `OwnedFd`s that a caller
///   can take out of them);
/// - [`serialize_shared_fd`]: no syscall, the message holds a clone of an `Arc<OwnedFd>` (a
///   [`Queue`](super::Queue) shares its reference-counted sockets the same way);
/// - [`serialize_owned_fd`]: the fd is handed over (buffers export on the way).
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded<'static>> {
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
        (Err(e), None) => Err(Error::serde(SerdeStep::Encode, e)),
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
        (Err(e), None) => Err(Error::serde(SerdeStep::Decode, e)),
    }
}

/// The refusal of an fd-backed value outside [`encode`]/[`decode`].
fn outside_transport(what: &str) -> Error {
    Error::FdsCannotTravel {
        transport: FdlessTransport::OtherSerdeFormat,
        message: format!(
            "{what} carries a file descriptor and can only be (de)serialised by vmm_core::wire \
             (a Queue, a Process argument or wire::encode/decode), which moves the fd out of \
             band; another serde format would produce a number that means nothing in another \
             process"
        ),
    }
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
/// caller's fd may be closed, or its owner replaced, at once. For `Serialize` impls of fd-backed
/// types; `what` names the type in errors. Costs one `dup` per fd; a type that keeps its fd in an
/// `Arc<OwnedFd>` avoids it with [`serialize_shared_fd`].
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

/// Serialise an fd held in an `Arc`, without a syscall: the message keeps a clone of the `Arc`,
/// so the fd stays open (and names the same file) for as long as the message lives, whatever
/// happens to the value meanwhile.
pub fn serialize_shared_fd<S: Serializer>(
    fd: &Arc<OwnedFd>,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let keep: Keeper = fd.clone();
    // SAFETY: an `OwnedFd` closes its fd only when dropped, and nothing can drop it (or move
    // it out) while the `Arc` clone handed over as `keep` lives.
    unsafe { serialize_kept_fd(keep, fd.as_fd(), what, serializer) }
}

/// Serialise an fd owned by `keep`, without a syscall: the message holds `keep`.
///
/// # Safety
/// `keep` must own `fd` such that it stays open, and refers to the same file, for as long as
/// any reference to `keep` lives: nothing reachable through a shared reference to `keep` may
/// close, replace or move out the fd (e.g. `keep` is an `Arc` of a struct whose `OwnedFd`
/// fields are never mutated through `&self`).
pub(crate) unsafe fn serialize_kept_fd<S: Serializer>(
    keep: Keeper,
    fd: BorrowedFd<'_>,
    what: &str,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    push(
        OutFd::Shared {
            _keep: keep,
            fd: fd.as_raw_fd(),
        },
        what,
        serializer,
    )
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
        Some(None) => Err(deserialize_error::<D>(Error::protocol(
            ProtocolRule::Fds,
            format!(
                "{what} refers to fd #{index}, which the message does not carry or another value took"
            ),
        ))),
        None => Err(deserialize_error::<D>(outside_transport(what))),
    }
}
