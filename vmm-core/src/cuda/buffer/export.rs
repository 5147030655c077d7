//! How a buffer leaves this process: [`VirtualMemoryBuffer::export`] (fresh fds),
//! [`VirtualMemoryBuffer::export_fabric`] (fabric handles), and its `Serialize` (a send is a
//! fresh export; a fabric send is kept alive until the receiver has imported).

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::ser::{SerializeTuple, Serializer};

use super::VirtualMemoryBuffer;
use crate::cuda::fabric::{FabricDescriptor, FabricHandle};
use crate::cuda::ipc_descriptor::{DeviceIdentity, IpcDescriptor};
use crate::cuda::keeper;
use crate::cuda::objects::Allocation;
use crate::cuda::resource_options::HandleType;
use crate::error::{Chunk, ExportRule, IpcOp, IpcStep};
use crate::share::imported_cannot_export;
use crate::trace;
use crate::wire::{FdOut, FdOwner, serialize_error};
use crate::{Error, Result};

impl VirtualMemoryBuffer {
    /// Export for another process: one fresh fd per chunk, owned by the returned descriptor.
    /// The buffer keeps nothing; each call makes new fds.
    ///
    /// Refused ([`Error::NotExportable`]) for an imported buffer and for one allocated with
    /// [`HandleType::None`]. A chunk that cannot be exported fails the whole export with an
    /// [`Error::Ipc`] naming the chunk, whose source is [`Error::FdLimit`] when the process is
    /// at its fd limit; the fds taken so far are closed.
    pub fn export(&self) -> Result<IpcDescriptor> {
        let _span = trace::span!(
            DEBUG,
            "cuda.export",
            bytes = self.size(),
            chunks = self.chunks().count(),
            handle_type = "posix_fd"
        );
        if self.is_imported() {
            return Err(imported_cannot_export("export"));
        }
        if !self.handle_type().exports_posix_fd() {
            let fabric = if self.handle_type().exports_fabric() {
                " (or share it by fabric handle: export_fabric)"
            } else {
                ""
            };
            return Err(Error::NotExportable {
                op: "export".into(),
                rule: ExportRule::HandleType,
                message: format!(
                    "the buffer was allocated with handle type {:?}; create its \
                     VirtualMemoryResource with HandleType::PosixFd to share it{fabric}",
                    self.handle_type()
                ),
            });
        }
        let chunks: Vec<&Arc<Allocation>> = self.chunks().collect();
        let count = chunks.len();
        let _current = if count > 0 {
            Some(self.device().make_current()?)
        } else {
            None
        };
        // Fds taken so far are closed by the partial `Vec`'s drop if one fails.
        let fds = chunks
            .iter()
            .enumerate()
            .map(|(index, chunk)| {
                chunk.export_posix_fd().map_err(|e| {
                    let size = chunk.size();
                    Error::ipc(
                        IpcOp::Export,
                        IpcStep::Export(Chunk { index, count, size }),
                        e,
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(IpcDescriptor::exported(
            fds,
            chunks.iter().map(|c| c.size()).collect(),
            HandleType::PosixFd,
            self.size(),
            DeviceIdentity {
                ordinal: self.device().ordinal(),
                uuid: *self.device().uuid(),
            },
            self.location(),
        ))
    }

    /// Export for another process as fabric handles: one 64-byte handle per chunk, plain data
    /// that any transport can carry (see [`FabricDescriptor`], and its module's notes on
    /// bearer tokens and lifetime: the handles do not keep the memory alive, so keep this
    /// buffer until every importer has imported). Takes about a microsecond per chunk, where a
    /// POSIX-fd export takes hundreds.
    ///
    /// Refused ([`Error::NotExportable`]) for an imported buffer and for one allocated
    /// without [`HandleType::Fabric`] or [`HandleType::PosixFdAndFabric`]. A chunk that cannot
    /// be exported fails the whole export with an [`Error::Ipc`] naming the chunk.
    pub fn export_fabric(&self) -> Result<FabricDescriptor> {
        // The handles are bearer tokens: the span names sizes and counts, never a handle byte.
        let _span = trace::span!(
            DEBUG,
            "cuda.export",
            bytes = self.size(),
            chunks = self.chunks().count(),
            handle_type = "fabric"
        );
        if self.is_imported() {
            return Err(imported_cannot_export("export_fabric"));
        }
        if !self.handle_type().exports_fabric() {
            return Err(Error::NotExportable {
                op: "export_fabric".into(),
                rule: ExportRule::HandleType,
                message: format!(
                    "the buffer was allocated with handle type {:?}; create its \
                     VirtualMemoryResource with HandleType::Fabric (or PosixFdAndFabric) to \
                     share it by fabric handle",
                    self.handle_type()
                ),
            });
        }
        let count = self.chunks().count();
        let mut handles = Vec::with_capacity(count);
        let mut sizes = Vec::with_capacity(count);
        if count > 0 {
            // Once for all chunks: a fabric export is about a microsecond.
            let _current = self.device().make_current()?;
            for (index, chunk) in self.chunks().enumerate() {
                let handle = chunk.export_fabric().map_err(|e| {
                    let size = chunk.size();
                    Error::ipc(
                        IpcOp::Export,
                        IpcStep::Export(Chunk { index, count, size }),
                        e,
                    )
                })?;
                handles.push(FabricHandle::from_bytes(handle));
                sizes.push(chunk.size());
            }
        }
        Ok(FabricDescriptor::exported(
            handles,
            sizes,
            self.size(),
            DeviceIdentity {
                ordinal: self.device().ordinal(),
                uuid: *self.device().uuid(),
            },
            self.location(),
        ))
    }

    /// Wait until every receiver this buffer (or a clone of it) was sent to as a fabric buffer
    /// (a process argument or a [`Queue`](crate::wire::Queue) item, with
    /// [`HandleType::Fabric`]) is done with it: it has imported the buffer, or failed to, or
    /// the message was dropped unread. Waits at most `timeout` (`Duration::MAX`: no limit);
    /// [`Error::Timeout`] says how many are left.
    ///
    /// Not needed for the memory's sake: until then the sending process keeps the buffer
    /// alive by itself (see the buffer's `Serialize` impl), so the
    /// sender may drop its handles at once. It tells the sender *when*: e.g. before it exits,
    /// which would free the memory under a receiver that has not imported yet. Returns at once
    /// for buffers sent by POSIX fd (an fd in flight keeps the memory alive by itself) and for
    /// buffers never sent.
    pub fn wait_imported(&self, timeout: Duration) -> Result<()> {
        keeper::wait_released(self.keeper_key(), timeout)
    }

    /// How many receivers this buffer (or a clone) was sent to as a fabric buffer and are not
    /// done with it yet (see [`wait_imported`](Self::wait_imported)).
    pub fn pending_imports(&self) -> usize {
        keeper::pending(self.keeper_key())
    }

    /// What the keeper counts this buffer's sends under: its shared state, which clones share
    /// and which stays allocated while the keeper holds a clone.
    fn keeper_key(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Serialise as a fabric buffer: the handle type, the acknowledgement pipe's write end (out
    /// of band), then the [`FabricDescriptor`] (in band). The pipe's read end and a clone of
    /// this buffer go to the keeper, which drops the clone once the receiver has closed the
    /// write end. The fd goes first, so that outside a transport nothing of the descriptor is
    /// written before the refusal.
    fn serialize_fabric<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (reader, writer) = std::io::pipe().map_err(|e| {
            serialize_error::<S>(Error::io("pipe for a fabric buffer's acknowledgement", e))
        })?;
        let mut form = serializer.serialize_tuple(3)?;
        form.serialize_element(&HandleType::Fabric.to_raw())?;
        form.serialize_element(&FdOut::<VirtualMemoryBuffer>::given(OwnedFd::from(writer)))?;
        let descriptor = self.export_fabric().map_err(serialize_error::<S>)?;
        form.serialize_element(&descriptor)?;
        let done = form.end()?;
        keeper::keep_until_closed(self.keeper_key(), Box::new(self.clone()), reader.into())
            .map_err(serialize_error::<S>)?;
        Ok(done)
    }
}

impl FdOwner for VirtualMemoryBuffer {
    const WHAT: &'static str = "vmm_core::cuda::VirtualMemoryBuffer";
}

/// Sending a buffer exports it on the way, as its handle type says:
/// - [`HandleType::PosixFd`] and [`HandleType::PosixFdAndFabric`]: the message takes fresh fds
///   (in the [`IpcDescriptor`]'s form), the buffer keeps none; the fds in flight keep the
///   memory alive until the receiver has imported it.
/// - [`HandleType::Fabric`]: the message carries the fabric handles in band (in the
///   [`FabricDescriptor`]'s form) and one acknowledgement fd (whatever the chunk count). The
///   sending process keeps a clone of the buffer until the receiver has imported it (or failed
///   to, or the message was dropped unread) and closed that fd, so the sender may drop its own
///   handles at once, as with fds; [`wait_imported`](Self::wait_imported) waits for it.
///
/// Imported buffers are refused ([`Error::NotExportable`]; forward their descriptor
/// instead), as is serialising outside a [`wire`](crate::wire) transport. The receiving side is
/// described on the `Deserialize` impl.
impl Serialize for VirtualMemoryBuffer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.is_imported() {
            return Err(serialize_error::<S>(imported_cannot_export(Self::WHAT)));
        }
        if self.handle_type() == HandleType::Fabric {
            return self.serialize_fabric(serializer);
        }
        self.export()
            .map_err(serialize_error::<S>)?
            .serialize_given::<VirtualMemoryBuffer, S>(serializer)
    }
}
