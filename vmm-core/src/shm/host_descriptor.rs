//! The exported form of a host buffer.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use crate::error::DescriptorRule;
use crate::wire::{self, FdIn, FdOut, FdOwner};
use crate::{Error, Result};

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
        let fd = fd
            .try_clone_to_owned()
            .map_err(|e| Error::io("dup(descriptor fd)", e))?;
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
        Fields {
            size: self.size as u64,
            fd: self.fd.map(FdOut::<HostDescriptor>::given),
        }
        .serialize(serializer)
    }
}

impl FdOwner for HostDescriptor {
    const WHAT: &'static str = "vmm_core::shm::HostDescriptor";
}

/// The serde form: the size, then the fd (out of band, by index; none for an empty buffer).
#[derive(Serialize, Deserialize)]
struct Fields<F> {
    size: u64,
    fd: Option<F>,
}

/// Sending a descriptor sends a duplicate of its fd, made when the message is encoded (one
/// `dup`): the message stays right whatever happens to the descriptor before it is sent.
impl Serialize for HostDescriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        Fields {
            size: self.size as u64,
            // A duplicate: `fd` is a plain `OwnedFd` that the crate can take out of the
            // descriptor, so only a copy of its own can keep the message right.
            fd: self.fd().map(FdOut::<HostDescriptor>::dup),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for HostDescriptor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let fields = Fields::<FdIn<HostDescriptor>>::deserialize(deserializer)?;
        let size = usize::try_from(fields.size).map_err(|_| {
            wire::deserialize_error::<D>(Error::descriptor(
                DescriptorRule::Size,
                format!(
                    "host descriptor of {} bytes: the size does not fit this platform's usize",
                    fields.size
                ),
            ))
        })?;
        Ok(HostDescriptor {
            size,
            fd: fields.fd.map(FdIn::into_inner),
        })
    }
}
