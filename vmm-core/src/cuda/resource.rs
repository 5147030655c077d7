//! [`VirtualMemoryResource`]: where and how buffers are allocated, and how they grow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use super::buffer::VirtualMemoryBuffer;
use super::device::Device;
use super::driver::{self, CUmemAccessDesc, CUmemLocation};
use super::handle::{Allocation, Reservation, Segment};
use crate::{Error, Result};

/// Where the physical memory of a resource's chunks lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Location {
    /// In the resource's device memory.
    #[default]
    Device,
    /// In host memory on this NUMA node, mapped for the device (needs driver support:
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`).
    HostNuma(i32),
}

/// How chunks can be shared with other processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandleType {
    /// Not shareable: the driver may then use cheaper allocations. `export` is refused.
    None,
    /// Shareable as a POSIX file descriptor per chunk (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    #[default]
    PosixFd,
}

impl HandleType {
    /// The driver's `CUmemAllocationHandleType` value.
    pub fn to_raw(self) -> u32 {
        match self {
            HandleType::None => 0,
            HandleType::PosixFd => 1,
        }
    }

    /// From the driver's value; Win32, fabric and other handle types are refused, since this
    /// crate moves handles only as POSIX fds.
    pub fn from_raw(raw: u32) -> Result<Self> {
        match raw {
            0 => Ok(HandleType::None),
            1 => Ok(HandleType::PosixFd),
            other => Err(Error::InvalidArgument(format!(
                "handle type {other} is not supported: only None (0) and PosixFd (1) are"
            ))),
        }
    }
}

/// What a peer device may do with a resource's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Read and write.
    ReadWrite,
    /// Read only.
    Read,
    /// No access (the same as not listing the peer).
    None,
}

/// Access for one peer device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAccess {
    /// The peer's ordinal in this process.
    pub device: usize,
    /// What it may do.
    pub access: Access,
}

/// Which allocation granularity rounds sizes: the driver's minimum, or its recommended one
/// (which may be larger and faster).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
    Minimum,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
    #[default]
    Recommended,
}

/// How a [`VirtualMemoryResource`] allocates. `Default` gives device memory shareable by fd.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceOptions {
    /// Where the memory lives.
    pub location: Location,
    /// How chunks are shared ([`HandleType::PosixFd`] to export).
    pub handle_type: HandleType,
    /// Other devices that get access to every mapping (the resource's device always has
    /// read-write access).
    pub peers: Vec<PeerAccess>,
    /// Which granularity sizes round up to.
    pub granularity: Granularity,
    /// Where to ask the driver to reserve addresses (a hint; it may reserve elsewhere).
    pub address_hint: Option<u64>,
    /// The alignment of reserved address ranges (a power of two).
    pub alignment: Option<usize>,
}

impl ResourceOptions {
    /// Set [`ResourceOptions::location`].
    pub fn location(mut self, location: Location) -> Self {
        self.location = location;
        self
    }

    /// Set [`ResourceOptions::handle_type`].
    pub fn handle_type(mut self, handle_type: HandleType) -> Self {
        self.handle_type = handle_type;
        self
    }

    /// Add a peer device and its access.
    pub fn peer(mut self, device: usize, access: Access) -> Self {
        self.peers.push(PeerAccess { device, access });
        self
    }

    /// Set [`ResourceOptions::granularity`].
    pub fn granularity(mut self, granularity: Granularity) -> Self {
        self.granularity = granularity;
        self
    }

    /// Set [`ResourceOptions::address_hint`].
    pub fn address_hint(mut self, hint: u64) -> Self {
        self.address_hint = Some(hint);
        self
    }

    /// Set [`ResourceOptions::alignment`].
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = Some(alignment);
        self
    }

    /// Refuse contradictory options before any driver call; errors name the option.
    pub(crate) fn check(&self, own_device: usize, device_count: usize) -> Result<()> {
        let bad = |message: String| Err(Error::InvalidArgument(message));
        if let Location::HostNuma(node) = self.location
            && node < 0
        {
            return bad(format!(
                "option `location`: host NUMA node {node} is invalid (must be >= 0)"
            ));
        }
        for (index, peer) in self.peers.iter().enumerate() {
            if peer.device == own_device {
                return bad(format!(
                    "option `peers`: device {own_device} is the resource's own device, which \
                     always has read-write access; list only other devices"
                ));
            }
            if peer.device >= device_count {
                return bad(format!(
                    "option `peers`: device {} does not exist (this process sees {device_count} \
                     device(s))",
                    peer.device
                ));
            }
            if self.peers[..index].iter().any(|p| p.device == peer.device) {
                return bad(format!(
                    "option `peers`: device {} is listed more than once",
                    peer.device
                ));
            }
        }
        if let Some(alignment) = self.alignment
            && !alignment.is_power_of_two()
        {
            return bad(format!(
                "option `alignment`: {alignment} is not a power of two"
            ));
        }
        if let (Some(hint), Some(alignment)) = (self.address_hint, self.alignment)
            && hint % alignment as u64 != 0
        {
            return bad(format!(
                "option `address_hint`: {hint:#x} is not a multiple of option `alignment` \
                 ({alignment:#x})"
            ));
        }
        Ok(())
    }

    /// Checks that need the granularity (known once the driver answered).
    pub(crate) fn check_granularity(&self, granularity: usize) -> Result<()> {
        if let Some(hint) = self.address_hint
            && hint % granularity as u64 != 0
        {
            return Err(Error::InvalidArgument(format!(
                "option `address_hint`: {hint:#x} is not a multiple of the allocation \
                 granularity ({granularity:#x})"
            )));
        }
        Ok(())
    }
}

/// `size` rounded up to a multiple of `granularity`, or an error naming what overflowed.
pub(crate) fn round_up(size: usize, granularity: usize) -> Result<usize> {
    debug_assert!(granularity > 0);
    size.div_ceil(granularity)
        .checked_mul(granularity)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "size {size} overflows when rounded up to the allocation granularity \
                 ({granularity})"
            ))
        })
}

/// Allocates [`VirtualMemoryBuffer`]s on one device with fixed options, grows them, and imports
/// buffers exported by other processes (see [`VirtualMemoryResource::import`]).
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
        let refuse = |option: &str, what: String| {
            Err(Error::InvalidArgument(format!(
                "option `{option}`: {what} on device {} ({})",
                device.ordinal(),
                device.name()
            )))
        };
        if !device.supports_vmm()? {
            return refuse(
                "location",
                "virtual memory management is not supported".to_owned(),
            );
        }
        if options.handle_type == HandleType::PosixFd && !device.supports_posix_fd()? {
            return refuse(
                "handle_type",
                "PosixFd handles are not supported; use HandleType::None".to_owned(),
            );
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
        let location = driver::to_sys_location(options.location, device.ordinal_i32());
        let prop = driver::allocation_prop(location, options.handle_type == HandleType::PosixFd);
        let min_granularity = driver::allocation_granularity(&prop, false)?;
        let granularity = match options.granularity {
            Granularity::Minimum => min_granularity,
            Granularity::Recommended => driver::allocation_granularity(&prop, true)?,
        };
        options.check_granularity(granularity)?;
        let mut access = vec![driver::access_desc(device.ordinal_i32(), true)];
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

    /// The process-wide resource with default options (and `location`) for `device`, created on
    /// first use: what buffers arriving over `wire` are imported into.
    pub fn default_for(device: &Device, location: Location) -> Result<Self> {
        static CACHE: OnceLock<Mutex<HashMap<(usize, Location), VirtualMemoryResource>>> =
            OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let key = (device.ordinal(), location);
        if let Some(resource) = cache.get(&key) {
            return Ok(resource.clone());
        }
        let resource = Self::new(device, ResourceOptions::default().location(location))?;
        cache.insert(key, resource.clone());
        Ok(resource)
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

    pub(crate) fn sys_location(&self) -> &CUmemLocation {
        &self.inner.location
    }

    pub(crate) fn access(&self) -> &[CUmemAccessDesc] {
        &self.inner.access
    }

    fn alignment(&self) -> usize {
        self.inner.options.alignment.unwrap_or(0)
    }

    fn new_chunk(&self, size: usize) -> Result<Arc<Allocation>> {
        let prop = driver::allocation_prop(
            self.inner.location,
            self.inner.options.handle_type == HandleType::PosixFd,
        );
        Ok(Arc::new(Allocation::create(
            &self.inner.device,
            size,
            &prop,
        )?))
    }

    /// A buffer of at least `size` bytes (rounded up to [`Self::granularity`]), one chunk mapped
    /// at a fresh reservation. `allocate(0)` gives an empty buffer without driver calls.
    pub fn allocate(&self, size: usize) -> Result<VirtualMemoryBuffer> {
        let inner = &self.inner;
        if size == 0 {
            return Ok(VirtualMemoryBuffer::empty(self, false));
        }
        let rounded = round_up(size, inner.granularity)?;
        let chunk = self.new_chunk(rounded)?;
        let reservation = Reservation::new(
            &inner.device,
            rounded,
            self.alignment(),
            inner.options.address_hint.unwrap_or(0),
        )?;
        let segment = Segment::map(reservation, [chunk], &inner.access).map_err(|(_, e)| e)?;
        Ok(VirtualMemoryBuffer::from_segments(
            self,
            vec![Arc::new(segment)],
            size,
            false,
        ))
    }

    /// A new buffer of `new_size` bytes whose first `buf.size()` bytes are `buf`'s memory.
    ///
    /// In place (same address, one more chunk) when the range right after `buf` can be
    /// reserved, else relocated (every chunk mapped again at a new range). `buf` stays valid
    /// either way: the chunks are shared. Grow never shrinks, and the handle type cannot change.
    pub fn grow(&self, buf: &VirtualMemoryBuffer, new_size: usize) -> Result<VirtualMemoryBuffer> {
        let inner = &self.inner;
        let refuse = |message: String| Err(Error::InvalidArgument(format!("grow: {message}")));
        if buf.device() != &inner.device {
            return refuse(format!(
                "the buffer is on device {}, this resource allocates on device {}",
                buf.device().ordinal(),
                inner.device.ordinal()
            ));
        }
        if buf.location() != inner.options.location {
            return refuse(format!(
                "the buffer's location is {:?}, this resource's option `location` is {:?}",
                buf.location(),
                inner.options.location
            ));
        }
        if buf.handle_type() != inner.options.handle_type {
            return refuse(format!(
                "the buffer's handle type is {:?}, this resource's option `handle_type` is {:?}; \
                 the handle type cannot change across a grow",
                buf.handle_type(),
                inner.options.handle_type
            ));
        }
        if buf.is_imported() {
            return refuse(
                "an imported buffer cannot be grown: its chunks belong to the exporter; grow \
                 it there and send the new buffer"
                    .to_owned(),
            );
        }
        if new_size < buf.size() {
            return refuse(format!(
                "new size {new_size} is smaller than the buffer's size {}; grow never shrinks",
                buf.size()
            ));
        }
        let capacity = buf.capacity();
        if new_size <= capacity {
            return Ok(buf.with_size(new_size));
        }
        if capacity == 0 {
            return self.allocate(new_size);
        }
        let extra = round_up(new_size - capacity, inner.granularity)?;
        capacity.checked_add(extra).ok_or_else(|| {
            Error::InvalidArgument(format!("grow: new size {new_size} overflows"))
        })?;
        let chunk = self.new_chunk(extra)?;
        let end = buf.end();
        if let Ok(reservation) = Reservation::new(&inner.device, extra, 0, end) {
            if reservation.ptr() == end {
                let segment = Segment::map(reservation, [chunk.clone()], &inner.access)
                    .map_err(|(_, e)| e)?;
                let mut segments = buf.segments().to_vec();
                segments.push(Arc::new(segment));
                return Ok(VirtualMemoryBuffer::from_segments(
                    self, segments, new_size, false,
                ));
            }
            // Elsewhere: not adjacent, so give it back and relocate.
            drop(reservation);
        }
        let reservation = Reservation::new(
            &inner.device,
            capacity + extra,
            self.alignment(),
            inner.options.address_hint.unwrap_or(0),
        )?;
        let chunks: Vec<Arc<Allocation>> = buf.chunks().cloned().chain([chunk]).collect();
        let segment = Segment::map(reservation, chunks, &inner.access).map_err(|(_, e)| e)?;
        Ok(VirtualMemoryBuffer::from_segments(
            self,
            vec![Arc::new(segment)],
            new_size,
            false,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(result: Result<()>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn default_options_are_consistent() {
        ResourceOptions::default().check(0, 1).unwrap();
        ResourceOptions::default()
            .peer(1, Access::Read)
            .alignment(1 << 21)
            .address_hint(1 << 30)
            .check(0, 2)
            .unwrap();
    }

    #[test]
    fn own_device_as_peer_is_refused() {
        let m = message(ResourceOptions::default().peer(0, Access::Read).check(0, 2));
        assert!(
            m.contains("option `peers`") && m.contains("own device"),
            "{m}"
        );
    }

    #[test]
    fn missing_peer_is_refused() {
        let m = message(ResourceOptions::default().peer(3, Access::Read).check(0, 2));
        assert!(
            m.contains("option `peers`") && m.contains("device 3 does not exist"),
            "{m}"
        );
    }

    #[test]
    fn duplicate_peer_is_refused() {
        let m = message(
            ResourceOptions::default()
                .peer(1, Access::Read)
                .peer(1, Access::ReadWrite)
                .check(0, 2),
        );
        assert!(
            m.contains("option `peers`") && m.contains("more than once"),
            "{m}"
        );
    }

    #[test]
    fn alignment_must_be_a_power_of_two() {
        let m = message(ResourceOptions::default().alignment(3).check(0, 1));
        assert!(m.contains("option `alignment`"), "{m}");
        let m = message(ResourceOptions::default().alignment(0).check(0, 1));
        assert!(m.contains("option `alignment`"), "{m}");
    }

    #[test]
    fn hint_must_match_alignment_and_granularity() {
        let m = message(
            ResourceOptions::default()
                .alignment(1 << 21)
                .address_hint(4096)
                .check(0, 1),
        );
        assert!(
            m.contains("option `address_hint`") && m.contains("`alignment`"),
            "{m}"
        );
        let m = message(
            ResourceOptions::default()
                .address_hint(4096)
                .check_granularity(1 << 21),
        );
        assert!(
            m.contains("option `address_hint`") && m.contains("granularity"),
            "{m}"
        );
    }

    #[test]
    fn negative_numa_node_is_refused() {
        let m = message(
            ResourceOptions::default()
                .location(Location::HostNuma(-1))
                .check(0, 1),
        );
        assert!(m.contains("option `location`"), "{m}");
    }

    #[test]
    fn rounding() {
        const G: usize = 2 << 20;
        assert_eq!(round_up(1, G).unwrap(), G);
        assert_eq!(round_up(G, G).unwrap(), G);
        assert_eq!(round_up(G + 1, G).unwrap(), 2 * G);
        assert_eq!(round_up(0, G).unwrap(), 0);
        let m = round_up(usize::MAX - 5, G).unwrap_err().to_string();
        assert!(m.contains("overflows"), "{m}");
    }

    #[test]
    fn handle_types_other_than_none_and_posix_fd_are_refused() {
        assert_eq!(HandleType::from_raw(1).unwrap(), HandleType::PosixFd);
        assert_eq!(HandleType::from_raw(0).unwrap(), HandleType::None);
        let m = HandleType::from_raw(8).unwrap_err().to_string();
        assert!(m.contains("handle type 8"), "{m}");
    }

    #[test]
    fn without_a_gpu_resource_construction_is_an_error() {
        if super::super::availability().is_ok() {
            return;
        }
        assert!(Device::new(0).is_err());
    }
}
