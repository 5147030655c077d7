//! Export and import: [`IpcDescriptor`], the only thing that carries a buffer across processes.
//!
//! A descriptor is data from another process: [`VirtualMemoryResource::import`] validates every
//! field before the first driver call, and undoes everything if a later step fails.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::buffer::VirtualMemoryBuffer;
use super::device::Device;
use super::driver;
use super::handle::{Allocation, Reservation, Segment};
use super::resource::{HandleType, Location, VirtualMemoryResource};
use crate::share::IMPORTED_CANNOT_EXPORT;
use crate::wire::{FdIn, FdOut, FdOwner, deserialize_error, serialize_error};
use crate::{Error, Result};

/// Which device exported a descriptor: the ordinal in the exporter (for messages) and the UUID
/// (what an importer matches, since processes may number devices differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceIdentity {
    /// The exporter's ordinal for the device.
    pub ordinal: usize,
    /// The device's UUID.
    pub uuid: [u8; 16],
}

/// An exported buffer: exactly one fd per chunk, the chunk sizes and the buffer's size.
///
/// It alone owns the fds; dropping it closes them. Send it with `vmm_core::wire` (the fds go
/// out of band), or take the fds and sizes apart for a transport of your own and rebuild it
/// on the other side with [`IpcDescriptor::from_fds`].
#[derive(Debug)]
pub struct IpcDescriptor {
    fds: Vec<OwnedFd>,
    chunk_sizes: Vec<usize>,
    handle_type: HandleType,
    size: usize,
    device: Option<DeviceIdentity>,
    location: Location,
}

impl IpcDescriptor {
    /// A descriptor from fds received by other means: each fd is duplicated (close-on-exec),
    /// so the caller keeps its own. The layout is checked as far as it can be without a device;
    /// `import` checks the rest.
    pub fn from_fds(
        fds: &[BorrowedFd<'_>],
        chunk_sizes: &[usize],
        handle_type: HandleType,
        size: usize,
    ) -> Result<IpcDescriptor> {
        validate_layout(handle_type, fds.len(), chunk_sizes, size, 1)?;
        let count = fds.len();
        let fds = fds
            .iter()
            .enumerate()
            .map(|(index, fd)| {
                fd.try_clone_to_owned().map_err(|source| {
                    Error::io(
                        format!(
                            "duplicating fd {} of chunk {} of {count}",
                            fd.as_raw_fd(),
                            index + 1
                        ),
                        source,
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(IpcDescriptor {
            fds,
            chunk_sizes: chunk_sizes.to_vec(),
            handle_type,
            size,
            device: None,
            location: Location::Device,
        })
    }

    /// The fds, one per chunk, in chunk order.
    pub fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.fds.iter().map(|fd| fd.as_fd())
    }

    /// Give up the fds (to send them another way); the caller then owns and closes them.
    pub fn into_fds(self) -> Vec<OwnedFd> {
        self.fds
    }

    /// The chunk sizes, in address order.
    pub fn chunk_sizes(&self) -> &[usize] {
        &self.chunk_sizes
    }

    /// The buffer's size (at most the sum of the chunk sizes).
    pub fn size(&self) -> usize {
        self.size
    }

    /// How the chunks were exported.
    pub fn handle_type(&self) -> HandleType {
        self.handle_type
    }

    /// The exporting device, when the descriptor came from [`VirtualMemoryBuffer::export`].
    pub fn device(&self) -> Option<DeviceIdentity> {
        self.device
    }

    /// Where the exporter's memory lives.
    pub fn location(&self) -> Location {
        self.location
    }
}

/// Check a descriptor's layout (everything but the fds themselves); returns the sum of the
/// chunk sizes. Errors name the chunk ("chunk 2 of 3") and the rule.
pub(crate) fn validate_layout(
    handle_type: HandleType,
    fd_count: usize,
    chunk_sizes: &[usize],
    size: usize,
    granularity: usize,
) -> Result<usize> {
    let bad = |message: String| {
        Err(Error::InvalidArgument(format!(
            "invalid IpcDescriptor: {message}"
        )))
    };
    if handle_type != HandleType::PosixFd {
        return bad(format!(
            "handle type {handle_type:?}: only PosixFd descriptors can be imported"
        ));
    }
    let count = chunk_sizes.len();
    if fd_count != count {
        return bad(format!(
            "{fd_count} fd(s) for {count} chunk(s): a descriptor carries exactly one fd per chunk"
        ));
    }
    let mut total = 0usize;
    for (index, &chunk) in chunk_sizes.iter().enumerate() {
        let which = format!("chunk {} of {count}", index + 1);
        if chunk == 0 {
            return bad(format!("{which} has size 0: chunks are never empty"));
        }
        if chunk % granularity != 0 {
            return bad(format!(
                "{which} has size {chunk}, not a multiple of the allocation granularity \
                 {granularity}"
            ));
        }
        total = match total.checked_add(chunk) {
            Some(total) => total,
            None => return bad(format!("{which}: the sum of chunk sizes overflows")),
        };
    }
    if size > total {
        return bad(format!(
            "size {size} exceeds the {total} bytes that its {count} chunk(s) hold"
        ));
    }
    Ok(total)
}

/// `chunk i of n (size bytes)`, the way every import and export error names a chunk.
fn chunk_name(index: usize, count: usize, size: usize) -> String {
    format!("chunk {} of {count} ({size} bytes)", index + 1)
}

fn ipc_error(op: &'static str, step: String, source: Error) -> Error {
    Error::Ipc {
        op: op.into(),
        step,
        source: Box::new(source),
    }
}

/// The error for a failed export of one chunk: [`Error::FdLimit`] when the process ran out of
/// fds (the driver reports that as an ordinary failure; `errno` tells it apart).
fn export_failure(source: Error, errno: std::io::Error) -> Error {
    let at_limit = |e: &std::io::Error| e.raw_os_error() == Some(libc::EMFILE);
    // The driver may not leave errno behind; a failed count of /proc/self/fd says it too.
    if at_limit(&errno) || crate::limits::open_fds().is_err_and(|e| at_limit(&e)) {
        return crate::limits::fd_limit_error(format!(
            "exporting needs one fresh fd per chunk ({source})"
        ));
    }
    source
}

impl VirtualMemoryBuffer {
    /// Export for another process: one fresh fd per chunk, owned by the returned descriptor.
    /// The buffer keeps nothing; each call makes new fds.
    pub fn export(&self) -> Result<IpcDescriptor> {
        if self.is_imported() {
            return Err(Error::InvalidArgument(format!(
                "export: {IMPORTED_CANNOT_EXPORT}"
            )));
        }
        if self.handle_type() != HandleType::PosixFd {
            return Err(Error::InvalidArgument(format!(
                "export: the buffer was allocated with handle type {:?}; create its \
                 VirtualMemoryResource with HandleType::PosixFd to share it",
                self.handle_type()
            )));
        }
        let chunks: Vec<&Arc<Allocation>> = self.chunks().collect();
        let count = chunks.len();
        let mut fds = Vec::with_capacity(count);
        let _current = if count > 0 {
            Some(self.device().make_current()?)
        } else {
            None
        };
        for (index, chunk) in chunks.iter().enumerate() {
            // Fds taken so far are closed by `fds`' drop if this returns early.
            let fd = driver::export_posix_fd(chunk.handle()).map_err(|(e, errno)| {
                ipc_error(
                    "export",
                    format!("while exporting {}", chunk_name(index, count, chunk.size())),
                    export_failure(e, errno),
                )
            })?;
            fds.push(fd);
        }
        Ok(IpcDescriptor {
            fds,
            chunk_sizes: chunks.iter().map(|c| c.size()).collect(),
            handle_type: self.handle_type(),
            size: self.size(),
            device: Some(DeviceIdentity {
                ordinal: self.device().ordinal(),
                uuid: *self.device().uuid(),
            }),
            location: self.location(),
        })
    }
}

impl VirtualMemoryResource {
    /// Map a buffer exported by another process (or this one: that gives an alias at a new
    /// address). Every field of `descriptor` is checked before the first driver call; a failure
    /// later undoes all steps and names the chunk and step. The result holds no fd: drop
    /// `descriptor` once imported.
    pub fn import(&self, descriptor: &IpcDescriptor) -> Result<VirtualMemoryBuffer> {
        let count = descriptor.chunk_sizes.len();
        let total = validate_layout(
            descriptor.handle_type,
            descriptor.fds.len(),
            &descriptor.chunk_sizes,
            descriptor.size,
            self.min_granularity(),
        )?;
        for (index, fd) in descriptor.fds.iter().enumerate() {
            if let Err(e) = driver::fd_flags(fd.as_raw_fd()) {
                return Err(Error::InvalidArgument(format!(
                    "invalid IpcDescriptor: chunk {} of {count}: fd {} is not open ({e})",
                    index + 1,
                    fd.as_raw_fd()
                )));
            }
        }
        self.check_origin(descriptor)?;
        if count == 0 {
            return Ok(VirtualMemoryBuffer::empty(self, true));
        }
        let device = self.device();
        // Every check above ran before this, the first driver call.
        let _current = device
            .make_current()
            .map_err(|e| ipc_error("import", "while making the device current".into(), e))?;
        let mut chunks = Vec::with_capacity(count);
        for (index, (fd, &size)) in descriptor
            .fds
            .iter()
            .zip(&descriptor.chunk_sizes)
            .enumerate()
        {
            let step = |verb: &str| format!("while {verb} {}", chunk_name(index, count, size));
            let chunk = Allocation::import(device, fd.as_fd(), size)
                .map_err(|e| ipc_error("import", step("importing"), e))?;
            let prop = driver::allocation_properties(chunk.handle())
                .map_err(|e| ipc_error("import", step("checking the location of"), e))?;
            let here = self.sys_location();
            if prop.location.type_ != here.type_ || prop.location.id != here.id {
                return Err(ipc_error(
                    "import",
                    step("checking the location of"),
                    Error::InvalidArgument(format!(
                        "the chunk lives on {}, but this resource maps {} ({}); import with a \
                         VirtualMemoryResource for the chunk's device",
                        driver::describe_location(&prop.location),
                        driver::describe_location(here),
                        device.name()
                    )),
                ));
            }
            chunks.push(Arc::new(chunk));
        }
        let reservation = Reservation::new(device, total, 0, 0).map_err(|e| {
            ipc_error(
                "import",
                format!("while reserving {total} bytes for {count} chunk(s)"),
                e,
            )
        })?;
        let segment = Segment::map(reservation, chunks, self.access()).map_err(|(index, e)| {
            ipc_error(
                "import",
                format!(
                    "while mapping {}",
                    chunk_name(index, count, descriptor.chunk_sizes[index])
                ),
                e,
            )
        })?;
        Ok(VirtualMemoryBuffer::from_segments(
            self,
            vec![Arc::new(segment)],
            descriptor.size,
            true,
        ))
    }

    /// Refuse, before any driver call, a descriptor from another device or location.
    fn check_origin(&self, descriptor: &IpcDescriptor) -> Result<()> {
        let here = self.device();
        if let Some(from) = descriptor.device
            && descriptor.location == Location::Device
            && &from.uuid != here.uuid()
        {
            return Err(Error::InvalidArgument(format!(
                "invalid IpcDescriptor: its chunks live on the exporter's device {} ({}), but \
                 this resource is on device {} ({}, {}); import with a VirtualMemoryResource \
                 for that device",
                from.ordinal,
                super::device::format_uuid(&from.uuid),
                here.ordinal(),
                here.name(),
                here.uuid_string()
            )));
        }
        if descriptor.location != self.options().location {
            return Err(Error::InvalidArgument(format!(
                "invalid IpcDescriptor: its location is {:?}, this resource's option `location` \
                 is {:?}",
                descriptor.location,
                self.options().location
            )));
        }
        Ok(())
    }
}

/// The descriptor's serde form: plain fields, then the fds (out of band, by index).
#[derive(Serialize, Deserialize)]
#[serde(rename = "IpcDescriptor")]
struct Wire<F> {
    handle_type: u32,
    size: u64,
    chunk_sizes: Vec<u64>,
    device: Option<DeviceIdentity>,
    location: Location,
    fds: Vec<F>,
}

const DESCRIPTOR: &str = "vmm_core::cuda::IpcDescriptor";
const BUFFER: &str = "vmm_core::cuda::VirtualMemoryBuffer";

impl FdOwner for IpcDescriptor {
    const WHAT: &'static str = DESCRIPTOR;
}

impl FdOwner for VirtualMemoryBuffer {
    const WHAT: &'static str = BUFFER;
}

fn to_u64(values: &[usize]) -> Vec<u64> {
    values.iter().map(|&v| v as u64).collect()
}

impl<F> Wire<F> {
    fn new(descriptor: &IpcDescriptor, fds: Vec<F>) -> Self {
        Wire {
            handle_type: descriptor.handle_type.to_raw(),
            size: descriptor.size as u64,
            chunk_sizes: to_u64(&descriptor.chunk_sizes),
            device: descriptor.device,
            location: descriptor.location,
            fds,
        }
    }
}

impl Wire<FdIn<IpcDescriptor>> {
    fn into_descriptor(self) -> Result<IpcDescriptor> {
        let size = |v: u64| {
            usize::try_from(v).map_err(|_| {
                Error::InvalidArgument(format!(
                    "invalid IpcDescriptor: size {v} does not fit this platform's usize"
                ))
            })
        };
        Ok(IpcDescriptor {
            fds: self.fds.into_iter().map(FdIn::into_inner).collect(),
            chunk_sizes: self
                .chunk_sizes
                .into_iter()
                .map(size)
                .collect::<Result<_>>()?,
            handle_type: HandleType::from_raw(self.handle_type)?,
            size: size(self.size)?,
            device: self.device,
            location: self.location,
        })
    }
}

impl Serialize for IpcDescriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // SAFETY: the descriptor owns its fds, and `encode` borrows it for as long as the
        // message lives.
        let fds = self
            .fds()
            .map(|fd| unsafe { FdOut::<IpcDescriptor>::lent(fd) })
            .collect();
        Wire::new(self, fds).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for IpcDescriptor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Wire::<FdIn<IpcDescriptor>>::deserialize(deserializer)?
            .into_descriptor()
            .map_err(deserialize_error::<D>)
    }
}

impl VirtualMemoryBuffer {
    /// Import `descriptor` into the process-wide default resource for its device (found by
    /// UUID, so device renumbering between processes does not matter), initialising CUDA here
    /// if needed. For other options, use [`VirtualMemoryResource::import`].
    pub fn import(descriptor: &IpcDescriptor) -> Result<VirtualMemoryBuffer> {
        let device = match descriptor.device {
            Some(identity) => Device::by_uuid(&identity.uuid)?,
            None => Device::new(0)?,
        };
        VirtualMemoryResource::default_for(&device, descriptor.location)?.import(descriptor)
    }
}

/// Sending a buffer exports it on the way: the message takes the fresh fds, the buffer keeps
/// none. Imported buffers are refused (forward their descriptor instead).
impl Serialize for VirtualMemoryBuffer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.is_imported() {
            return Err(serialize_error::<S>(Error::InvalidArgument(format!(
                "{BUFFER}: {IMPORTED_CANNOT_EXPORT}"
            ))));
        }
        let mut descriptor = self.export().map_err(serialize_error::<S>)?;
        let fds = std::mem::take(&mut descriptor.fds)
            .into_iter()
            .map(FdOut::<VirtualMemoryBuffer>::given)
            .collect();
        Wire::new(&descriptor, fds).serialize(serializer)
    }
}

/// Receiving a buffer imports it into the process-wide default resource for its device
/// (found by UUID), initialising CUDA here if needed. The received fds are closed once mapped.
impl<'de> Deserialize<'de> for VirtualMemoryBuffer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let descriptor = IpcDescriptor::deserialize(deserializer)?;
        VirtualMemoryBuffer::import(&descriptor).map_err(deserialize_error::<D>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;

    fn err(result: Result<usize>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn a_well_formed_layout_passes() {
        assert_eq!(
            validate_layout(HandleType::PosixFd, 2, &[G, 2 * G], 3 * G - 1, G).unwrap(),
            3 * G
        );
        assert_eq!(
            validate_layout(HandleType::PosixFd, 0, &[], 0, G).unwrap(),
            0
        );
    }

    #[test]
    fn handle_type_none_is_refused() {
        let m = err(validate_layout(HandleType::None, 1, &[G], G, G));
        assert!(
            m.contains("handle type None") && m.contains("PosixFd"),
            "{m}"
        );
    }

    #[test]
    fn fd_and_chunk_counts_must_match() {
        let m = err(validate_layout(HandleType::PosixFd, 1, &[G, G], G, G));
        assert!(
            m.contains("1 fd(s) for 2 chunk(s)") && m.contains("one fd per chunk"),
            "{m}"
        );
    }

    #[test]
    fn empty_chunk_is_refused_by_number() {
        let m = err(validate_layout(HandleType::PosixFd, 3, &[G, 0, G], G, G));
        assert!(m.contains("chunk 2 of 3 has size 0"), "{m}");
    }

    #[test]
    fn unaligned_chunk_is_refused_by_number() {
        let m = err(validate_layout(HandleType::PosixFd, 2, &[G, G + 1], G, G));
        assert!(
            m.contains("chunk 2 of 2 has size 2097153") && m.contains("granularity 2097152"),
            "{m}"
        );
    }

    #[test]
    fn overflowing_sum_is_refused_by_number() {
        let big = usize::MAX / G * G;
        let m = err(validate_layout(HandleType::PosixFd, 2, &[big, big], G, G));
        assert!(m.contains("chunk 2 of 2") && m.contains("overflows"), "{m}");
    }

    #[test]
    fn size_beyond_chunks_is_refused() {
        let m = err(validate_layout(HandleType::PosixFd, 1, &[G], G + 1, G));
        assert!(m.contains("size 2097153 exceeds the 2097152 bytes"), "{m}");
        let m = err(validate_layout(HandleType::PosixFd, 0, &[], 1, G));
        assert!(m.contains("size 1 exceeds the 0 bytes"), "{m}");
    }

    #[test]
    fn from_fds_duplicates_and_validates() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let d = IpcDescriptor::from_fds(&[file.as_fd()], &[G], HandleType::PosixFd, G).unwrap();
        let dup = d.fds().next().unwrap().as_raw_fd();
        assert_ne!(dup, file.as_raw_fd());
        assert!(driver::fd_flags(dup).is_ok());
        assert_eq!((d.chunk_sizes(), d.size(), d.device()), (&[G][..], G, None));
        let m = IpcDescriptor::from_fds(&[file.as_fd()], &[G, G], HandleType::PosixFd, G)
            .unwrap_err()
            .to_string();
        assert!(m.contains("1 fd(s) for 2 chunk(s)"), "{m}");
    }

    #[test]
    fn descriptor_round_trips_over_wire_and_refuses_other_formats() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let d = IpcDescriptor::from_fds(&[file.as_fd()], &[G], HandleType::PosixFd, 5).unwrap();
        let encoded = crate::wire::encode(&d).unwrap();
        assert_eq!(encoded.fd_count(), 1);
        let fds = encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect();
        let back: IpcDescriptor = crate::wire::decode(encoded.bytes(), fds).unwrap();
        assert_eq!((back.chunk_sizes(), back.size()), (&[G][..], 5));
        assert_eq!(back.handle_type(), HandleType::PosixFd);
        assert!(serde_json::to_string(&d).is_err());
    }

    #[test]
    fn unknown_handle_type_is_refused_on_arrival() {
        let wire: Wire<u32> = Wire {
            handle_type: 2,
            size: 0,
            chunk_sizes: vec![],
            device: None,
            location: Location::Device,
            fds: vec![],
        };
        let bytes = postcard::to_stdvec(&wire).unwrap();
        let m = crate::wire::decode::<IpcDescriptor>(&bytes, Vec::new())
            .unwrap_err()
            .to_string();
        assert!(m.contains("handle type 2"), "{m}");
    }
}
