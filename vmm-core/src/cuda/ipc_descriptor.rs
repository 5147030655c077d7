//! [`IpcDescriptor`]: the only thing that carries a buffer across processes, and its rules.
//!
//! A descriptor is data from another process. [`validate_layout`] checks everything but the
//! fds themselves, before any driver call; errors name the chunk and the rule. On the wire a
//! descriptor is a few plain fields and its fds out of band, one per chunk; its handle type
//! travels as the driver's number, and an unknown one is refused on arrival.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::resource_options::{HandleType, Location};
use crate::error::DescriptorRule;
use crate::wire::{FdIn, FdOut, FdOwner, deserialize_error};
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
/// on the other side with [`IpcDescriptor::from_fds`]. Import it with
/// [`VirtualMemoryResource::import`](super::VirtualMemoryResource::import), or with
/// [`VirtualMemoryBuffer::import`](super::VirtualMemoryBuffer::import) into this process's
/// importer for its device.
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

    /// This descriptor naming the device its memory lives on, as an export's does: a holder
    /// of exported fds (a service that keeps memory for others) rebuilt the descriptor with
    /// [`from_fds`](Self::from_fds) and knows the device, and an importer in another language
    /// needs its UUID to pick the device (the peer protocol's device fields travel only when
    /// a descriptor names one).
    pub fn with_device(mut self, device: DeviceIdentity) -> IpcDescriptor {
        self.device = Some(device);
        self
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

    /// The exporting device, when the descriptor came from
    /// [`VirtualMemoryBuffer::export`](super::VirtualMemoryBuffer::export).
    pub fn device(&self) -> Option<DeviceIdentity> {
        self.device
    }

    /// Where the exporter's memory lives.
    pub fn location(&self) -> Location {
        self.location
    }

    /// The descriptor of a fresh export: `fds` (one per chunk, in chunk order) are the
    /// exporter's new fds, which the descriptor now owns.
    pub(crate) fn exported(
        fds: Vec<OwnedFd>,
        chunk_sizes: Vec<usize>,
        handle_type: HandleType,
        size: usize,
        device: DeviceIdentity,
        location: Location,
    ) -> IpcDescriptor {
        debug_assert_eq!(fds.len(), chunk_sizes.len());
        IpcDescriptor {
            fds,
            chunk_sizes,
            handle_type,
            size,
            device: Some(device),
            location,
        }
    }

    /// Serialise in the descriptor's form, giving its fds to the message (which closes them
    /// once sent): how a buffer travels, as a fresh export that nobody else keeps. `O` names the
    /// type being sent, for errors.
    pub(crate) fn serialize_given<O: FdOwner, S: Serializer>(
        mut self,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let fds = std::mem::take(&mut self.fds)
            .into_iter()
            .map(FdOut::<O>::given)
            .collect();
        Wire::new(&self, fds).serialize(serializer)
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
    let bad = |rule, message: String| refuse("IpcDescriptor", rule, message);
    if handle_type != HandleType::PosixFd {
        return bad(
            DescriptorRule::HandleType,
            format!("handle type {handle_type:?}: only PosixFd descriptors can be imported"),
        );
    }
    let count = chunk_sizes.len();
    if fd_count != count {
        return bad(
            DescriptorRule::Fds,
            format!(
                "{fd_count} fd(s) for {count} chunk(s): a descriptor carries exactly one fd per \
                 chunk"
            ),
        );
    }
    validate_chunks("IpcDescriptor", chunk_sizes, size, granularity)
}

/// An [`Error::InvalidDescriptor`] for `rule`: `invalid {what}: {message}`.
fn refuse<T>(what: &str, rule: DescriptorRule, message: String) -> Result<T> {
    Err(Error::descriptor(
        rule,
        format!("invalid {what}: {message}"),
    ))
}

/// The layout rules every descriptor (`what`: its type, for errors) meets: no empty chunk,
/// each a multiple of `granularity`, a sum that does not overflow and is at least `size`.
/// Returns the sum of the chunk sizes.
pub(crate) fn validate_chunks(
    what: &str,
    chunk_sizes: &[usize],
    size: usize,
    granularity: usize,
) -> Result<usize> {
    let bad = |rule, message: String| refuse(what, rule, message);
    let count = chunk_sizes.len();
    let mut total = 0usize;
    for (index, &chunk) in chunk_sizes.iter().enumerate() {
        let which = format!("chunk {} of {count}", index + 1);
        if chunk == 0 {
            return bad(
                DescriptorRule::ChunkSize,
                format!("{which} has size 0: chunks are never empty"),
            );
        }
        if chunk % granularity != 0 {
            return bad(
                DescriptorRule::ChunkSize,
                format!(
                    "{which} has size {chunk}, not a multiple of the allocation granularity \
                     {granularity}"
                ),
            );
        }
        total = match total.checked_add(chunk) {
            Some(total) => total,
            None => {
                return bad(
                    DescriptorRule::Size,
                    format!("{which}: the sum of chunk sizes overflows"),
                );
            }
        };
    }
    if size > total {
        return bad(
            DescriptorRule::Size,
            format!("size {size} exceeds the {total} bytes that its {count} chunk(s) hold"),
        );
    }
    Ok(total)
}

/// The descriptor's serde form: plain fields, then the fds (out of band, by index).
#[derive(Serialize, Deserialize)]
#[cfg_attr(test, derive(Clone))]
#[serde(rename = "IpcDescriptor")]
struct Wire<F> {
    handle_type: u32,
    size: u64,
    chunk_sizes: Vec<u64>,
    device: Option<DeviceIdentity>,
    location: Location,
    fds: Vec<F>,
}

/// The descriptor's serde form after its first field (the handle type): how a buffer's
/// `Deserialize` continues once that field said "POSIX fds" (a buffer's form begins with the
/// handle type, and a fabric buffer's continues differently). Postcard writes a struct as its
/// fields back to back, so `(handle_type, PosixRest)` is the same bytes as a [`Wire`].
#[derive(Deserialize)]
#[serde(rename = "IpcDescriptor")]
pub(crate) struct PosixRest {
    size: u64,
    chunk_sizes: Vec<u64>,
    device: Option<DeviceIdentity>,
    location: Location,
    fds: Vec<FdIn<IpcDescriptor>>,
}

impl PosixRest {
    /// The descriptor whose form began with `handle_type` and went on with `self`.
    pub(crate) fn into_descriptor(self, handle_type: u32) -> Result<IpcDescriptor> {
        Wire {
            handle_type,
            size: self.size,
            chunk_sizes: self.chunk_sizes,
            device: self.device,
            location: self.location,
            fds: self.fds,
        }
        .into_descriptor()
    }
}

impl FdOwner for IpcDescriptor {
    const WHAT: &'static str = "vmm_core::cuda::IpcDescriptor";
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
                Error::descriptor(
                    DescriptorRule::Size,
                    format!("invalid IpcDescriptor: size {v} does not fit this platform's usize"),
                )
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

/// Sending a descriptor sends duplicates of its fds, made when the message is encoded (one
/// `dup` per chunk): the message stays right whatever happens to the descriptor before it is
/// sent.
impl Serialize for IpcDescriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Duplicates (one dup per chunk, next to the tens of microseconds of an import): the
        // descriptor's fds are plain `OwnedFd`s that `into_fds` gives away, so only copies of
        // its own keep the message right if the descriptor is replaced before the send.
        let fds = self.fds().map(FdOut::<IpcDescriptor>::dup).collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;

    /// The text of an `InvalidDescriptor` for `rule` (any other outcome fails the test).
    fn err(rule: DescriptorRule, result: Result<usize>) -> String {
        match result {
            Err(Error::InvalidDescriptor {
                rule: broke,
                message,
            }) => {
                assert_eq!(broke, rule, "{message}");
                assert!(message.starts_with("invalid IpcDescriptor: "), "{message}");
                message
            }
            other => panic!("expected InvalidDescriptor({rule:?}), got {other:?}"),
        }
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

    /// `validate_layout(handle_type, fds, sizes, size, G)` is refused for `rule`, with a message
    /// that contains every one of `needles`.
    #[track_caller]
    fn refused(
        rule: DescriptorRule,
        (handle_type, fds, sizes, size): (HandleType, usize, &[usize], usize),
        needles: &[&str],
    ) {
        let m = err(rule, validate_layout(handle_type, fds, sizes, size, G));
        for needle in needles {
            assert!(m.contains(needle), "{needle:?} missing from {m}");
        }
    }

    #[test]
    fn handle_type_none_is_refused() {
        let layout = (HandleType::None, 1, &[G][..], G);
        refused(
            DescriptorRule::HandleType,
            layout,
            &["handle type None", "PosixFd"],
        );
    }

    #[test]
    fn fd_and_chunk_counts_must_match() {
        let layout = (HandleType::PosixFd, 1, &[G, G][..], G);
        let needles = ["1 fd(s) for 2 chunk(s)", "one fd per chunk"];
        refused(DescriptorRule::Fds, layout, &needles);
    }

    #[test]
    fn empty_chunk_is_refused_by_number() {
        let layout = (HandleType::PosixFd, 3, &[G, 0, G][..], G);
        refused(
            DescriptorRule::ChunkSize,
            layout,
            &["chunk 2 of 3 has size 0"],
        );
    }

    #[test]
    fn unaligned_chunk_is_refused_by_number() {
        let layout = (HandleType::PosixFd, 2, &[G, G + 1][..], G);
        let needles = ["chunk 2 of 2 has size 2097153", "granularity 2097152"];
        refused(DescriptorRule::ChunkSize, layout, &needles);
    }

    #[test]
    fn overflowing_sum_is_refused_by_number() {
        let big = usize::MAX / G * G;
        let layout = (HandleType::PosixFd, 2, &[big, big][..], G);
        refused(DescriptorRule::Size, layout, &["chunk 2 of 2", "overflows"]);
    }

    #[test]
    fn size_beyond_chunks_is_refused() {
        let layout = (HandleType::PosixFd, 1, &[G][..], G + 1);
        refused(
            DescriptorRule::Size,
            layout,
            &["size 2097153 exceeds the 2097152 bytes"],
        );
        let layout = (HandleType::PosixFd, 0, &[][..], 1);
        refused(
            DescriptorRule::Size,
            layout,
            &["size 1 exceeds the 0 bytes"],
        );
    }

    #[test]
    fn from_fds_duplicates_and_validates() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let d = IpcDescriptor::from_fds(&[file.as_fd()], &[G], HandleType::PosixFd, G).unwrap();
        let dup = d.fds().next().unwrap().as_raw_fd();
        assert_ne!(dup, file.as_raw_fd());
        assert!(super::super::driver::fd_flags(dup).is_ok());
        assert_eq!((d.chunk_sizes(), d.size(), d.device()), (&[G][..], G, None));
        let named = DeviceIdentity {
            ordinal: 3,
            uuid: [7; 16],
        };
        let d = d.with_device(named);
        assert_eq!(d.device(), Some(named));
        let m = err(
            DescriptorRule::Fds,
            IpcDescriptor::from_fds(&[file.as_fd()], &[G, G], HandleType::PosixFd, G).map(|_| 0),
        );
        assert!(m.contains("1 fd(s) for 2 chunk(s)"), "{m}");
    }

    #[test]
    fn descriptor_round_trips_over_wire_and_refuses_other_formats() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let named = DeviceIdentity {
            ordinal: 1,
            uuid: [9; 16],
        };
        let d = IpcDescriptor::from_fds(&[file.as_fd()], &[G], HandleType::PosixFd, 5)
            .unwrap()
            .with_device(named);
        let encoded = crate::wire::encode(&d).unwrap();
        assert_eq!(encoded.fd_count(), 1);
        let fds = encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect();
        let back: IpcDescriptor = crate::wire::decode(encoded.bytes(), fds).unwrap();
        assert_eq!((back.chunk_sizes(), back.size()), (&[G][..], 5));
        assert_eq!(back.device(), Some(named));
        assert_eq!(back.handle_type(), HandleType::PosixFd);
        // Any other serde format is refused: an fd number means nothing in another process.
        let m = serde_json::to_string(&d).unwrap_err().to_string();
        assert!(
            m.contains("vmm_core::cuda::IpcDescriptor carries a file descriptor"),
            "{m}"
        );
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
        let err = crate::wire::decode::<IpcDescriptor>(&bytes, Vec::new()).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidDescriptor { rule: DescriptorRule::HandleType, message: m }
                if m.contains("handle type 2 is not supported")
                    && m.contains("only None (0), PosixFd (1), Fabric (8)")),
            "{err:?}"
        );
        // The two known values arrive as the handle types they name.
        for handle_type in [HandleType::None, HandleType::PosixFd] {
            let wire: Wire<u32> = Wire {
                handle_type: handle_type.to_raw(),
                ..wire.clone()
            };
            let bytes = postcard::to_stdvec(&wire).unwrap();
            let back = crate::wire::decode::<IpcDescriptor>(&bytes, Vec::new()).unwrap();
            assert_eq!(back.handle_type(), handle_type);
        }
    }
}
