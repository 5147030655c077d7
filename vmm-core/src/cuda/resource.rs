//! [`VirtualMemoryResource`]: where and how buffers are allocated, how they grow, and how a
//! descriptor from another process is imported (validated, then mapped, or rolled back).

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::buffer::{AddressRange, VirtualMemoryBuffer};
use super::device::{Device, format_uuid};
use super::driver::{self, CUmemAccessDesc, CUmemLocation};
use super::fabric::FabricDescriptor;
use super::fabric_support;
use super::ipc_descriptor::{IpcDescriptor, validate_chunks, validate_layout};
use super::objects::{Allocation, Reservation, Segment};
use super::resource_options::{Access, Granularity, HandleType, Location, ResourceOptions};
use crate::error::{Chunk, DescriptorRule, GrowRule, IpcOp, IpcStep, OptionRule};
use crate::trace;
use crate::{Error, Result};

/// `size` rounded up to a multiple of `granularity`, or an error naming what overflowed.
pub(crate) fn round_up(size: usize, granularity: usize) -> Result<usize> {
    debug_assert!(granularity > 0);
    size.div_ceil(granularity)
        .checked_mul(granularity)
        .ok_or_else(|| {
            Error::option(
                "size",
                OptionRule::Range,
                format!(
                    "size {size} overflows when rounded up to the allocation granularity \
                     ({granularity})"
                ),
            )
        })
}

/// Allocates [`VirtualMemoryBuffer`]s on one device with fixed options, grows them, and imports
/// buffers exported by other processes (see [`VirtualMemoryResource::import`]).
///
/// The options apply to every buffer the resource makes, imported ones included: the peers'
/// access is granted on each mapping, and `alignment` and `address_hint` shape each
/// reservation. To choose the resource that buffers arriving over [`wire`](crate::wire) (or
/// through [`VirtualMemoryBuffer::import`]) are imported into, see
/// [`set_importer`](super::set_importer).
///
/// Cheap to clone; buffers do not borrow it.
#[derive(Debug, Clone)]
pub struct VirtualMemoryResource {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    device: Device,
    options: ResourceOptions,
    location: CUmemLocation,
    /// The granularity sizes round up to (per `options.granularity`).
    granularity: usize,
    /// What the driver can map at all: imported chunk sizes must be multiples of it.
    min_granularity: usize,
    access: Vec<CUmemAccessDesc>,
}

impl VirtualMemoryResource {
    /// A resource on `device`. Refuses contradictory options and options the device or driver
    /// cannot honour, naming the option.
    pub fn new(device: &Device, options: ResourceOptions) -> Result<Self> {
        options.check(device.ordinal(), Device::count()?)?;
        let refuse = |option: &'static str, what: String| {
            Err(Error::option(
                option,
                OptionRule::Unsupported,
                format!(
                    "option `{option}`: {what} on device {} ({})",
                    device.ordinal(),
                    device.name()
                ),
            ))
        };
        if !device.supports_vmm()? {
            return refuse(
                "location",
                "virtual memory management is not supported".to_owned(),
            );
        }
        if options.handle_type.exports_posix_fd() && !device.supports_posix_fd()? {
            return refuse(
                "handle_type",
                "PosixFd handles are not supported; use HandleType::None".to_owned(),
            );
        }
        if options.handle_type.exports_fabric() {
            // A trial allocation: says which is missing, the device's support or this
            // process's IMEX channel (Error::FabricUnsupported, Error::NoImexChannel).
            device.check_fabric()?;
        }
        if let Location::HostNuma(node) = options.location {
            match device.supports_host_numa_vmm() {
                Ok(true) => {}
                Ok(false) => {
                    return refuse(
                        "location",
                        format!("host NUMA node {node} is not offered by the driver"),
                    );
                }
                Err(e) => {
                    return refuse(
                        "location",
                        format!("host NUMA node {node} cannot be used ({e})"),
                    );
                }
            }
        }
        let _current = device.make_current()?;
        let location = options.location.to_driver(device.ordinal_i32());
        let prop = driver::allocation_prop(location, options.handle_type.to_raw());
        let min_granularity = driver::allocation_granularity(&prop, false)?;
        let granularity = match options.granularity {
            Granularity::Minimum => min_granularity,
            Granularity::Recommended => driver::allocation_granularity(&prop, true)?,
        };
        options.check_granularity(granularity)?;
        let mut access = vec![driver::access_desc(
            device.ordinal_i32(),
            !options.read_only,
        )];
        for peer in &options.peers {
            match peer.access {
                Access::ReadWrite => access.push(driver::access_desc(peer.device as i32, true)),
                Access::Read => access.push(driver::access_desc(peer.device as i32, false)),
                Access::None => {}
            }
        }
        Ok(VirtualMemoryResource {
            inner: Arc::new(Inner {
                device: device.clone(),
                options,
                location,
                granularity,
                min_granularity,
                access,
            }),
        })
    }

    /// The device this resource allocates on (and imports for).
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The options it was created with.
    pub fn options(&self) -> &ResourceOptions {
        &self.inner.options
    }

    /// The granularity that allocation sizes round up to.
    pub fn granularity(&self) -> usize {
        self.inner.granularity
    }

    /// The driver's minimum granularity for this location (chunk sizes must be multiples).
    pub fn min_granularity(&self) -> usize {
        self.inner.min_granularity
    }

    fn alignment(&self) -> usize {
        self.inner.options.alignment.unwrap_or(0)
    }

    /// A fresh reservation of `size` bytes with this resource's alignment and address hint.
    fn reserve(&self, size: usize) -> Result<Reservation> {
        let options = &self.inner.options;
        Reservation::new(
            &self.inner.device,
            size,
            self.alignment(),
            options.address_hint.unwrap_or(0),
        )
    }

    /// A buffer of this resource made of `segments`.
    fn buffer(&self, segments: Vec<Arc<Segment>>, size: usize) -> VirtualMemoryBuffer {
        let options = &self.inner.options;
        VirtualMemoryBuffer::from_segments(
            &self.inner.device,
            options.location,
            options.handle_type,
            segments,
            size,
            false,
        )
    }

    fn new_chunk(&self, size: usize) -> Result<Arc<Allocation>> {
        let handle_type = self.inner.options.handle_type;
        let prop = driver::allocation_prop(self.inner.location, handle_type.to_raw());
        let chunk = Allocation::create(&self.inner.device, size, &prop);
        match chunk {
            Ok(chunk) => Ok(Arc::new(chunk)),
            Err(e) if handle_type.exports_fabric() => {
                Err(fabric_support::explain_refusal(e, &self.inner.device))
            }
            Err(e) => Err(e),
        }
    }

    /// A buffer of at least `size` bytes (rounded up to [`Self::granularity`]), one chunk mapped
    /// at a fresh reservation. `allocate(0)` gives an empty buffer without driver calls.
    pub fn allocate(&self, size: usize) -> Result<VirtualMemoryBuffer> {
        let inner = &self.inner;
        if size == 0 {
            return Ok(self.buffer(Vec::new(), 0));
        }
        let rounded = round_up(size, inner.granularity)?;
        let chunk = self.new_chunk(rounded)?;
        let reservation = self.reserve(rounded)?;
        let segment = Segment::map(reservation, [chunk], &inner.access).map_err(|(_, e)| e)?;
        Ok(self.buffer(vec![Arc::new(segment)], size))
    }

    /// A new buffer of `new_size` bytes whose first `buf.size()` bytes are `buf`'s memory.
    ///
    /// In place (same address, one more chunk) when the range right after `buf` can be
    /// reserved, else relocated (every chunk mapped again at a new range). `buf` stays valid
    /// either way: the chunks are shared. Grow never shrinks, and the handle type cannot change.
    pub fn grow(&self, buf: &VirtualMemoryBuffer, new_size: usize) -> Result<VirtualMemoryBuffer> {
        let inner = &self.inner;
        let refuse = |rule: GrowRule, message: String| Err(Error::GrowRefused { rule, message });
        if buf.device() != &inner.device {
            return refuse(
                GrowRule::Device,
                format!(
                    "the buffer is on device {}, this resource allocates on device {}",
                    buf.device().ordinal(),
                    inner.device.ordinal()
                ),
            );
        }
        if buf.location() != inner.options.location {
            return refuse(
                GrowRule::Location,
                format!(
                    "the buffer's location is {:?}, this resource's option `location` is {:?}",
                    buf.location(),
                    inner.options.location
                ),
            );
        }
        if buf.handle_type() != inner.options.handle_type {
            return refuse(
                GrowRule::HandleType,
                format!(
                    "the buffer's handle type is {:?}, this resource's option `handle_type` is {:?}; \
                 the handle type cannot change across a grow",
                    buf.handle_type(),
                    inner.options.handle_type
                ),
            );
        }
        if buf.is_imported() {
            return refuse(
                GrowRule::Imported,
                "an imported buffer cannot be grown: its chunks belong to the exporter; grow \
                 it there and send the new buffer"
                    .to_owned(),
            );
        }
        if new_size < buf.size() {
            return refuse(
                GrowRule::Shrink,
                format!(
                    "new size {new_size} is smaller than the buffer's size {}; grow never shrinks",
                    buf.size()
                ),
            );
        }
        let capacity = buf.capacity();
        if new_size <= capacity {
            return Ok(buf.with_size(new_size));
        }
        if capacity == 0 {
            return self.allocate(new_size);
        }
        let extra = round_up(new_size - capacity, inner.granularity)?;
        capacity
            .checked_add(extra)
            .ok_or_else(|| Error::GrowRefused {
                rule: GrowRule::Overflow,
                message: format!("new size {new_size} overflows"),
            })?;
        let chunk = self.new_chunk(extra)?;
        let end = buf.end();
        if let Ok(reservation) = Reservation::new(&inner.device, extra, 0, end) {
            if reservation.ptr() == end {
                let segment = Segment::map(reservation, [chunk.clone()], &inner.access)
                    .map_err(|(_, e)| e)?;
                let mut segments = buf.segments().to_vec();
                segments.push(Arc::new(segment));
                return Ok(self.buffer(segments, new_size));
            }
            // Elsewhere: not adjacent, so give it back and relocate.
            drop(reservation);
        }
        let reservation = self.reserve(capacity + extra)?;
        let chunks: Vec<Arc<Allocation>> = buf.chunks().cloned().chain([chunk]).collect();
        let segment = Segment::map(reservation, chunks, &inner.access).map_err(|(_, e)| e)?;
        Ok(self.buffer(vec![Arc::new(segment)], new_size))
    }

    /// Map a buffer exported by another process (or by this one: that gives an alias at a new
    /// address) into this resource: on its device, with its peers' access, in a reservation
    /// with its `alignment` and `address_hint`.
    ///
    /// Every field of `descriptor` is checked before the first driver call (the layout against
    /// this resource's minimum granularity, each fd, and the exporter's device and location
    /// against this resource's); a failure later undoes all steps and is an [`Error::Ipc`]
    /// naming the chunk and step. The result holds no fd: drop `descriptor` once imported.
    ///
    /// A resource created with [`HandleType::None`] imports nothing ([`Error::InvalidOption`]):
    /// its buffers are not shareable, and an import is shared memory.
    pub fn import(&self, descriptor: &IpcDescriptor) -> Result<VirtualMemoryBuffer> {
        self.import_placed(descriptor, None).map_err(|(e, _)| e)
    }

    /// [`import`](Self::import) at the addresses of `range` (kept by
    /// [`VirtualMemoryBuffer::into_address_range`]): the chunks are mapped back to back from
    /// its start, so the buffer's [`device_ptr`](VirtualMemoryBuffer::device_ptr) is
    /// `range.device_ptr()`. The range must be on this resource's device and exactly as
    /// long as the descriptor's chunks together ([`Error::InvalidDescriptor`] with rule
    /// `Size` or `Location` otherwise, before any driver call). On any failure the range
    /// comes back with the error, nothing mapped in it, to try again; on success the buffer
    /// owns it (dropping the buffer frees it).
    pub fn import_at(
        &self,
        descriptor: &IpcDescriptor,
        range: AddressRange,
    ) -> std::result::Result<VirtualMemoryBuffer, Box<(Error, AddressRange)>> {
        let total: usize = descriptor.chunk_sizes().iter().sum();
        let refused = if range.device() != &self.inner.device {
            Some(Error::descriptor(
                DescriptorRule::Location,
                format!(
                    "import_at: the address range is on device {}, this resource maps device {}",
                    range.device().ordinal(),
                    self.inner.device.ordinal()
                ),
            ))
        } else if range.size() != total {
            Some(Error::descriptor(
                DescriptorRule::Size,
                format!(
                    "import_at: the address range is {} bytes, the descriptor's chunks {total}",
                    range.size()
                ),
            ))
        } else {
            None
        };
        if let Some(e) = refused {
            return Err(Box::new((e, range)));
        }
        self.import_placed(descriptor, Some(range.into_reservation()))
            .map_err(|(e, kept)| {
                let kept = kept.expect("import_placed gives a given reservation back");
                Box::new((e, AddressRange::from_reservation(kept)))
            })
    }

    /// `import`, in `place` if given (which comes back with any error).
    fn import_placed(
        &self,
        descriptor: &IpcDescriptor,
        place: Option<Reservation>,
    ) -> std::result::Result<VirtualMemoryBuffer, (Error, Option<Reservation>)> {
        let _span = trace::span!(
            DEBUG,
            "cuda.import",
            bytes = descriptor.size(),
            chunks = descriptor.chunk_sizes().len(),
            handle_type = "posix_fd"
        );
        let checked = self.check_import(descriptor);
        if let Err(e) = checked {
            return Err((e, place));
        }
        let sizes = descriptor.chunk_sizes();
        let total = sizes.iter().sum();
        let fds: Vec<_> = descriptor.fds().collect();
        self.import_chunks(
            (sizes, total, descriptor.size()),
            (descriptor.location(), HandleType::PosixFd),
            |device, index, size| Allocation::import(device, fds[index], size),
            place,
        )
    }

    /// Every check of a POSIX-fd import, before the first driver call.
    fn check_import(&self, descriptor: &IpcDescriptor) -> Result<()> {
        if self.inner.options.handle_type == HandleType::None {
            return Err(Error::option(
                "handle_type",
                OptionRule::Conflict,
                format!(
                    "import: this resource's option `handle_type` is {:?}, so its buffers are \
                     not shareable; import with a VirtualMemoryResource created with \
                     HandleType::PosixFd",
                    self.inner.options.handle_type
                ),
            ));
        }
        let sizes = descriptor.chunk_sizes();
        let count = sizes.len();
        validate_layout(
            descriptor.handle_type(),
            descriptor.fds().count(),
            sizes,
            descriptor.size(),
            self.min_granularity(),
        )?;
        for (index, fd) in descriptor.fds().enumerate() {
            if let Err(e) = driver::fd_flags(fd.as_raw_fd()) {
                return Err(Error::descriptor(
                    DescriptorRule::Fds,
                    format!(
                        "invalid IpcDescriptor: chunk {} of {count}: fd {} is not open ({e})",
                        index + 1,
                        fd.as_raw_fd()
                    ),
                ));
            }
        }
        self.check_origin(
            "IpcDescriptor",
            descriptor.device().map(|d| (Some(d.ordinal), d.uuid)),
            descriptor.location(),
        )
    }

    /// Map a buffer exported as fabric handles (by another process, on this machine, or by
    /// this one) into this resource, as [`import`](Self::import) does a POSIX-fd one: every
    /// field is checked before the first driver call, and a failure later undoes all steps
    /// and is an [`Error::Ipc`] naming the chunk and step.
    ///
    /// This process needs an IMEX channel (see [`Device::check_fabric`]): a refused import for
    /// that reason has [`Error::NoImexChannel`] as its source. The exporter must keep the
    /// memory until this returns: a fabric handle does not keep memory alive, and once the
    /// exporter has released it the import fails (with the driver's error, as an
    /// [`Error::Ipc`] while importing the chunk). A buffer imported already stays valid after the
    /// exporter releases its own.
    ///
    /// A resource created with [`HandleType::None`] imports nothing, as for [`Self::import`].
    pub fn import_fabric(&self, descriptor: &FabricDescriptor) -> Result<VirtualMemoryBuffer> {
        // Sizes and counts only: a fabric handle is a bearer token, never traced.
        let _span = trace::span!(
            DEBUG,
            "cuda.import",
            bytes = descriptor.size(),
            chunks = descriptor.chunk_sizes().len(),
            handle_type = "fabric"
        );
        if self.inner.options.handle_type == HandleType::None {
            return Err(Error::option(
                "handle_type",
                OptionRule::Conflict,
                "import_fabric: this resource's option `handle_type` is None, so its buffers \
                 are not shareable; import with a VirtualMemoryResource created with \
                 HandleType::Fabric",
            ));
        }
        let sizes = descriptor.chunk_sizes();
        let total = validate_chunks(
            "FabricDescriptor",
            sizes,
            descriptor.size(),
            self.min_granularity(),
        )?;
        let handles = descriptor.handles();
        if handles.len() != sizes.len() {
            // Unreachable through the public API (every constructor checks it); kept so that
            // indexing below can never go out of bounds.
            return Err(Error::descriptor(
                DescriptorRule::ChunkCount,
                format!(
                    "invalid FabricDescriptor: {} handle(s) for {} chunk(s)",
                    handles.len(),
                    sizes.len()
                ),
            ));
        }
        // The owner may be any GPU of the fabric, one this process cannot see included: only
        // the kind of location must match; the driver decides whether it can reach the memory.
        self.check_origin("FabricDescriptor", None, descriptor.location())?;
        let owner = *descriptor.owner_uuid();
        let remote = &owner != self.device().uuid();
        self.import_chunks(
            (sizes, total, descriptor.size()),
            (descriptor.location(), HandleType::Fabric),
            |device, index, size| {
                Allocation::import_fabric(device, handles[index].as_bytes(), size)
                    .map_err(|e| fabric_support::explain_refusal(e, device))
            },
            None,
        )
        .map_err(|(e, _)| match remote {
            true => fabric_support::unreachable(e, &owner, self.device()),
            false => e,
        })
        .map(|buffer| buffer.owned_by(owner))
    }

    /// The driver steps of an import, after every check: import each chunk with `import_one`
    /// (device, chunk index, chunk size), check where it lives, reserve `total` bytes (or use
    /// `place`, exactly `total` bytes on this device), map the chunks back to back with this
    /// resource's access. Any failure undoes all of it and gives `place` back.
    fn import_chunks(
        &self,
        (sizes, total, size): (&[usize], usize, usize),
        (location, handle_type): (Location, HandleType),
        import_one: impl FnMut(&Device, usize, usize) -> Result<Allocation>,
        place: Option<Reservation>,
    ) -> std::result::Result<VirtualMemoryBuffer, (Error, Option<Reservation>)> {
        let mut place = place;
        let given = place.is_some();
        let chunks = self.import_each(sizes, handle_type, import_one);
        let chunks = match chunks {
            Ok(chunks) => chunks,
            Err(e) => return Err((e, place)),
        };
        let count = sizes.len();
        let imported = |segments, size| {
            VirtualMemoryBuffer::from_segments(
                self.device(),
                location,
                handle_type,
                segments,
                size,
                true,
            )
        };
        if count == 0 {
            return Ok(imported(Vec::new(), 0));
        }
        let reservation = match place.take() {
            Some(reservation) => reservation,
            None => self.reserve(total).map_err(|e| {
                let step = IpcStep::Reserve {
                    bytes: total,
                    chunks: count,
                };
                (Error::ipc(IpcOp::Import, step, e), None)
            })?,
        };
        let segment =
            Segment::map_keeping(reservation, chunks, &self.inner.access).map_err(|failed| {
                let (index, e, reservation) = *failed;
                let size = sizes[index];
                let e = Error::ipc(IpcOp::Import, IpcStep::Map(Chunk { index, count, size }), e);
                (e, given.then_some(reservation))
            })?;
        Ok(imported(vec![Arc::new(segment)], size))
    }

    /// Import each chunk with `import_one` and check where it lives: the allocations, in
    /// order, or the first failure (what was imported is released).
    fn import_each(
        &self,
        sizes: &[usize],
        handle_type: HandleType,
        mut import_one: impl FnMut(&Device, usize, usize) -> Result<Allocation>,
    ) -> Result<Vec<Arc<Allocation>>> {
        let count = sizes.len();
        if count == 0 {
            return Ok(Vec::new());
        }
        // Every check ran before this, the first driver call.
        let device = self.device();
        let _current = device
            .make_current()
            .map_err(|e| Error::ipc(IpcOp::Import, IpcStep::MakeCurrent, e))?;
        let mut chunks = Vec::with_capacity(count);
        for (index, &size) in sizes.iter().enumerate() {
            let chunk_ref = Chunk { index, count, size };
            let chunk = import_one(device, index, size)
                .map_err(|e| Error::ipc(IpcOp::Import, IpcStep::Import(chunk_ref), e))?;
            let there = chunk
                .location()
                .map_err(|e| Error::ipc(IpcOp::Import, IpcStep::CheckLocation(chunk_ref), e))?;
            let here = &self.inner.location;
            // A fabric chunk may live on a GPU this process does not see (another node's):
            // there the kind of location must match, not the device.
            let matches = match handle_type {
                HandleType::Fabric => there.type_ == here.type_,
                _ => driver::same_location(&there, here),
            };
            if !matches {
                return Err(Error::ipc(
                    IpcOp::Import,
                    IpcStep::CheckLocation(chunk_ref),
                    Error::descriptor(
                        DescriptorRule::Location,
                        format!(
                            "the chunk lives on {}, but this resource maps {} ({}); import with \
                             a VirtualMemoryResource for the chunk's device",
                            driver::describe_location(&there),
                            driver::describe_location(here),
                            device.name()
                        ),
                    ),
                ));
            }
            chunks.push(Arc::new(chunk));
        }
        Ok(chunks)
    }

    /// Refuse, before any driver call, a descriptor (`what`: its type, for errors) from another
    /// device or location. `origin` is the exporter's device, where the descriptor names one:
    /// its ordinal there (if known) and its UUID.
    fn check_origin(
        &self,
        what: &str,
        origin: Option<(Option<usize>, [u8; 16])>,
        location: Location,
    ) -> Result<()> {
        let here = self.device();
        if let Some((ordinal, uuid)) = origin
            && location == Location::Device
            && &uuid != here.uuid()
        {
            let ordinal = ordinal.map_or_else(String::new, |o| format!("{o} "));
            return Err(Error::descriptor(
                DescriptorRule::Location,
                format!(
                    "invalid {what}: its chunks live on the exporter's device {ordinal}({}), \
                     but this resource is on device {} ({}, {}); import with a \
                     VirtualMemoryResource for that device",
                    format_uuid(&uuid),
                    here.ordinal(),
                    here.name(),
                    here.uuid_string()
                ),
            ));
        }
        if location != self.options().location {
            return Err(Error::descriptor(
                DescriptorRule::Location,
                format!(
                    "invalid {what}: its location is {location:?}, this resource's option \
                     `location` is {:?}",
                    self.options().location
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding() {
        const G: usize = 2 << 20;
        assert_eq!(round_up(1, G).unwrap(), G);
        assert_eq!(round_up(G, G).unwrap(), G);
        assert_eq!(round_up(G + 1, G).unwrap(), 2 * G);
        assert_eq!(round_up(0, G).unwrap(), 0);
        assert!(
            matches!(round_up(usize::MAX - 5, G), Err(Error::InvalidOption {
                rule: OptionRule::Range,
                option,
                ..
            }) if option == "size"),
        );
    }

    #[test]
    fn without_a_driver_devices_are_an_error_not_a_panic() {
        let Err(err) = Device::count() else {
            return;
        };
        assert!(matches!(err, Error::CudaUnavailable(_)), "{err:?}");
        assert!(matches!(Device::new(0), Err(Error::CudaUnavailable(_))));
    }
}
