//! What a [`VirtualMemoryResource`](super::VirtualMemoryResource) is configured with: where
//! memory lives, how it is shared, who else may access it, and how addresses are reserved.
//!
//! Plain data, checked before any driver call; the one bridge to the driver is
//! [`Location::to_driver`], the translation the driver layer itself does not know.

use serde::{Deserialize, Serialize};

use super::driver::{self, CUmemLocation};
use crate::error::{DescriptorRule, OptionRule};
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

impl Location {
    /// The driver's form of this location for a resource on device `ordinal` (which
    /// [`Location::Device`] means).
    pub(crate) fn to_driver(self, ordinal: i32) -> CUmemLocation {
        match self {
            Location::Device => driver::device_location(ordinal),
            Location::HostNuma(node) => driver::host_numa_location(node),
        }
    }
}

/// How chunks can be shared with other processes: the handle types requested at `cuMemCreate`
/// (a chunk can only be exported as a type it was created for).
///
/// - [`PosixFd`](Self::PosixFd): one fd per chunk, passed over a Unix socket (`SCM_RIGHTS`).
///   An fd is a capability: only a process that was sent it can use it, and it keeps the memory
///   alive while it is open. Same machine only.
/// - [`Fabric`](Self::Fabric): one 64-byte fabric handle per chunk
///   ([`FabricDescriptor`](super::FabricDescriptor)), plain data that crosses any transport.
///   It needs an IMEX channel in every process that allocates, exports or imports (see
///   [`Device::check_fabric`](super::Device::check_fabric)), it is a bearer token (anyone
///   holding the bytes and a channel can map the memory), and it does not keep the memory
///   alive.
/// - [`PosixFdAndFabric`](Self::PosixFdAndFabric): both; [`export`] gives fds,
///   [`export_fabric`] fabric handles, and a buffer sent as a value travels by fd.
///
/// [`export`]: super::VirtualMemoryBuffer::export
/// [`export_fabric`]: super::VirtualMemoryBuffer::export_fabric
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandleType {
    /// Not shareable: the driver may then use cheaper allocations. `export` is refused.
    None,
    /// Shareable as a POSIX file descriptor per chunk (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    #[default]
    PosixFd,
    /// Shareable as a fabric handle per chunk (`CU_MEM_HANDLE_TYPE_FABRIC`).
    Fabric,
    /// Both: `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC`.
    PosixFdAndFabric,
}

impl HandleType {
    /// Whether chunks of this type can be exported as POSIX fds
    /// ([`VirtualMemoryBuffer::export`](super::VirtualMemoryBuffer::export)).
    pub fn exports_posix_fd(self) -> bool {
        matches!(self, HandleType::PosixFd | HandleType::PosixFdAndFabric)
    }

    /// Whether chunks of this type can be exported as fabric handles
    /// ([`VirtualMemoryBuffer::export_fabric`](super::VirtualMemoryBuffer::export_fabric)).
    pub fn exports_fabric(self) -> bool {
        matches!(self, HandleType::Fabric | HandleType::PosixFdAndFabric)
    }

    /// The driver's `CUmemAllocationHandleType` value (a bit mask): what `cuMemCreate` is asked
    /// for, and how a descriptor's handle type travels (crate-internal; the public API names
    /// handle types only by this enum).
    pub(crate) fn to_raw(self) -> u32 {
        match self {
            HandleType::None => 0,
            HandleType::PosixFd => 1,
            HandleType::Fabric => 8,
            HandleType::PosixFdAndFabric => 1 | 8,
        }
    }

    /// From the driver's value, as a descriptor arrives; Win32 and other handle types are
    /// refused. (Which type a descriptor may carry is the descriptor's own check.)
    pub(crate) fn from_raw(raw: u32) -> Result<Self> {
        match raw {
            0 => Ok(HandleType::None),
            1 => Ok(HandleType::PosixFd),
            8 => Ok(HandleType::Fabric),
            9 => Ok(HandleType::PosixFdAndFabric),
            other => Err(Error::descriptor(
                DescriptorRule::HandleType,
                format!(
                    "handle type {other} is not supported: only None (0), PosixFd (1), \
                     Fabric (8) and PosixFdAndFabric (9) are"
                ),
            )),
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

/// How a [`VirtualMemoryResource`](super::VirtualMemoryResource) allocates, imports and
/// reserves addresses. `Default` gives device memory shareable by fd.
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
    /// Where to ask the driver to reserve addresses, for allocations and imports alike (a hint;
    /// it may reserve elsewhere).
    pub address_hint: Option<u64>,
    /// The alignment of reserved address ranges, for allocations and imports alike (a power of
    /// two).
    pub alignment: Option<usize>,
    /// Map the resource's own device read-only (`CU_MEM_ACCESS_FLAGS_PROT_READ`) instead of
    /// read-write: for a reader that must not write what it imports. Advisory between
    /// processes (each importer sets its own access); in this process the buffer's `fill` and
    /// `write_at` are refused, so no write faults on the device.
    pub read_only: bool,
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

    /// Set [`ResourceOptions::read_only`].
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Set [`ResourceOptions::alignment`].
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = Some(alignment);
        self
    }

    /// Refuse contradictory options before any driver call; errors name the option.
    pub(crate) fn check(&self, own_device: usize, device_count: usize) -> Result<()> {
        let bad = |option: &'static str, rule: OptionRule, message: String| {
            Err(Error::option(option, rule, message))
        };
        if let Location::HostNuma(node) = self.location
            && node < 0
        {
            return bad(
                "location",
                OptionRule::Range,
                format!("option `location`: host NUMA node {node} is invalid (must be >= 0)"),
            );
        }
        for (index, peer) in self.peers.iter().enumerate() {
            if peer.device == own_device {
                return bad(
                    "peers",
                    OptionRule::Conflict,
                    format!(
                        "option `peers`: device {own_device} is the resource's own device, which \
                     always has read-write access; list only other devices"
                    ),
                );
            }
            if peer.device >= device_count {
                return bad(
                    "peers",
                    OptionRule::Unknown,
                    format!(
                        "option `peers`: device {} does not exist (this process sees {device_count} \
                     device(s))",
                        peer.device
                    ),
                );
            }
            if self.peers[..index].iter().any(|p| p.device == peer.device) {
                return bad(
                    "peers",
                    OptionRule::Conflict,
                    format!(
                        "option `peers`: device {} is listed more than once",
                        peer.device
                    ),
                );
            }
        }
        if let Some(alignment) = self.alignment
            && !alignment.is_power_of_two()
        {
            return bad(
                "alignment",
                OptionRule::Alignment,
                format!("option `alignment`: {alignment} is not a power of two"),
            );
        }
        if let (Some(hint), Some(alignment)) = (self.address_hint, self.alignment)
            && hint % alignment as u64 != 0
        {
            return bad(
                "address_hint",
                OptionRule::Alignment,
                format!(
                    "option `address_hint`: {hint:#x} is not a multiple of option `alignment` \
                 ({alignment:#x})"
                ),
            );
        }
        Ok(())
    }

    /// Checks that need the granularity (known once the driver answered).
    pub(crate) fn check_granularity(&self, granularity: usize) -> Result<()> {
        if let Some(hint) = self.address_hint
            && hint % granularity as u64 != 0
        {
            return Err(Error::option(
                "address_hint",
                OptionRule::Alignment,
                format!(
                    "option `address_hint`: {hint:#x} is not a multiple of the allocation \
                     granularity ({granularity:#x})"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option, the rule and the text of an `InvalidOption`, whose text names its option
    /// first (any other outcome fails the test).
    fn refusal(result: Result<()>) -> (String, OptionRule, String) {
        match result {
            Err(Error::InvalidOption {
                option,
                rule,
                message,
            }) => {
                assert!(
                    message.starts_with(&format!("option `{option}`: ")),
                    "{message}"
                );
                (option.into_owned(), rule, message)
            }
            other => panic!("expected InvalidOption, got {other:?}"),
        }
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
        let (option, rule, m) =
            refusal(ResourceOptions::default().peer(0, Access::Read).check(0, 2));
        assert_eq!((option.as_str(), rule), ("peers", OptionRule::Conflict));
        assert!(m.contains("own device"), "{m}");
    }

    #[test]
    fn missing_peer_is_refused() {
        let (option, rule, m) =
            refusal(ResourceOptions::default().peer(3, Access::Read).check(0, 2));
        assert_eq!((option.as_str(), rule), ("peers", OptionRule::Unknown));
        assert!(m.contains("device 3 does not exist"), "{m}");
    }

    #[test]
    fn duplicate_peer_is_refused() {
        let (option, rule, m) = refusal(
            ResourceOptions::default()
                .peer(1, Access::Read)
                .peer(1, Access::ReadWrite)
                .check(0, 2),
        );
        assert_eq!((option.as_str(), rule), ("peers", OptionRule::Conflict));
        assert!(m.contains("more than once"), "{m}");
    }

    #[test]
    fn alignment_must_be_a_power_of_two() {
        let (option, rule, _) = refusal(ResourceOptions::default().alignment(3).check(0, 1));
        assert_eq!(
            (option.as_str(), rule),
            ("alignment", OptionRule::Alignment)
        );
        // The text as people read it.
        let (_, _, m) = refusal(ResourceOptions::default().alignment(0).check(0, 1));
        assert_eq!(m, "option `alignment`: 0 is not a power of two");
    }

    #[test]
    fn hint_must_match_alignment_and_granularity() {
        let (option, rule, m) = refusal(
            ResourceOptions::default()
                .alignment(1 << 21)
                .address_hint(4096)
                .check(0, 1),
        );
        assert_eq!(
            (option.as_str(), rule),
            ("address_hint", OptionRule::Alignment)
        );
        assert!(m.contains("`alignment`"), "{m}");
        let (option, rule, m) = refusal(
            ResourceOptions::default()
                .address_hint(4096)
                .check_granularity(1 << 21),
        );
        assert_eq!(
            (option.as_str(), rule),
            ("address_hint", OptionRule::Alignment)
        );
        assert!(m.contains("granularity"), "{m}");
    }

    #[test]
    fn negative_numa_node_is_refused() {
        let (option, rule, _) = refusal(
            ResourceOptions::default()
                .location(Location::HostNuma(-1))
                .check(0, 1),
        );
        assert_eq!((option.as_str(), rule), ("location", OptionRule::Range));
    }

    #[test]
    fn unknown_handle_types_are_refused() {
        assert_eq!(HandleType::from_raw(1).unwrap(), HandleType::PosixFd);
        assert_eq!(HandleType::from_raw(0).unwrap(), HandleType::None);
        for unknown in [2, 4, 16] {
            let m = match HandleType::from_raw(unknown) {
                Err(Error::InvalidDescriptor {
                    rule: DescriptorRule::HandleType,
                    message,
                }) => message,
                other => panic!("expected InvalidDescriptor(HandleType), got {other:?}"),
            };
            assert_eq!(
                m,
                format!(
                    "handle type {unknown} is not supported: only None (0), PosixFd (1), \
                     Fabric (8) and PosixFdAndFabric (9) are"
                )
            );
        }
        for handle_type in [
            HandleType::None,
            HandleType::PosixFd,
            HandleType::Fabric,
            HandleType::PosixFdAndFabric,
        ] {
            assert_eq!(
                HandleType::from_raw(handle_type.to_raw()).unwrap(),
                handle_type
            );
        }
    }

    #[test]
    fn handle_types_say_what_they_export() {
        let exports = |h: HandleType| (h.exports_posix_fd(), h.exports_fabric());
        assert_eq!(exports(HandleType::None), (false, false));
        assert_eq!(exports(HandleType::PosixFd), (true, false));
        assert_eq!(exports(HandleType::Fabric), (false, true));
        assert_eq!(exports(HandleType::PosixFdAndFabric), (true, true));
        // The combined type is the driver's bit mask of the two.
        assert_eq!(
            HandleType::PosixFdAndFabric.to_raw(),
            HandleType::PosixFd.to_raw() | HandleType::Fabric.to_raw()
        );
    }
}
