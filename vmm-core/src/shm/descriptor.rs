//! The exported form of a host buffer.

use std::cell::Cell;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use crate::wire;
use crate::{Error, Result};

const WHAT: &str = "vmm_core::shm::HostDescriptor";

/// What [`HostBuffer::export`](super::HostBuffer::export) returns: the size and the one fd
/// (none for an empty buffer) that it alone owns. Dropping it closes the fd.
#[derive(Debug)]
pub struct HostDescriptor {
    pub(crate) size: usize,
    pub(crate) fd: Option<OwnedFd>,
}

impl HostDescriptor {
    /// Wrap an fd from another transport: a duplicate is taken; `fd` stays the caller's.
    /// The fd must be a memfd of at least `size` bytes sealed against resizing (checked at import).
    pub fn from_fd(fd: BorrowedFd<'_>, size: usize) -> Result<Self> {
        let fd = fd.try_clone_to_owned().map_err(|e| Error::Os {
            op: "dup(descriptor fd)".into(),
            source: e,
        })?;
        Ok(HostDescriptor { size, fd: Some(fd) })
    }

    /// The buffer's size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The fd, if the buffer is not empty.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(AsFd::as_fd)
    }
}

impl HostDescriptor {
    /// Serialise with the fd handed to the message (closed once sent): for a buffer, whose
    /// export exists only to be sent.
    pub(crate) fn serialize_owned<S: Serializer>(self, serializer: S) -> Result<S::Ok, S::Error> {
        let fd = self.fd.map(|fd| GiveFd(Cell::new(Some(fd))));
        Fields {
            size: self.size as u64,
            fd,
        }
        .serialize(serializer)
    }
}

struct GiveFd(Cell<Option<OwnedFd>>);

impl Serialize for GiveFd {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.take() {
            Some(fd) => wire::serialize_owned_fd(fd, WHAT, serializer),
            None => Err(wire::serialize_error::<S>("descriptor fd serialised twice")),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Fields<F> {
    size: u64,
    fd: Option<F>,
}

struct SendFd<'a>(BorrowedFd<'a>);

impl Serialize for SendFd<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        wire::serialize_fd(self.0, WHAT, serializer)
    }
}

struct RecvFd(OwnedFd);

impl<'de> Deserialize<'de> for RecvFd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        wire::deserialize_fd(WHAT, deserializer).map(RecvFd)
    }
}

impl Serialize for HostDescriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Fields {
            size: self.size as u64,
            fd: self.fd().map(SendFd),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for HostDescriptor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let fields = Fields::<RecvFd>::deserialize(deserializer)?;
        let size = usize::try_from(fields.size)
            .map_err(|_| wire::deserialize_error::<D>("size overflows usize"))?;
        Ok(HostDescriptor {
            size,
            fd: fields.fd.map(|fd| fd.0),
        })
    }
}
