//! Rule 5 of docs/protocol.md: each kind's own rules. The header's part ([`Header::check_kind`])
//! runs before anything is allocated; the chunk sizes' part ([`Frame::check_chunks`]) checks a
//! descriptor's layout by the rule every descriptor meets (`validate_chunks`, shared with
//! [`cuda`](crate::cuda)), and a handle type is [`HandleType`]'s driver number: neither is
//! stated here again.

use super::header::{Header, refuse};
use super::{FABRIC_HANDLE_BYTES, Frame, FrameLocation, Kind};
use crate::cuda::{HandleType, validate_chunks};
use crate::error::ProtocolRule;
use crate::{Error, Result};

impl Header {
    /// Rule 5, as far as the header decides it: which fields the kind uses (the others must be
    /// zero) and how its counts relate. The chunk sizes' rules are [`Frame::check_chunks`].
    pub(super) fn check_kind(&self) -> Result<()> {
        let name = self.kind.name();
        let refuse = |rule: ProtocolRule, why: String| refuse(rule, format!("{name}: {why}"));
        let (count, payload) = (self.chunk_count, self.payload_len);
        let descriptor_fields = self.handle_type != 0
            || self.size != 0
            || self.device.is_some()
            || self.location != FrameLocation::Device
            || count != 0;
        match self.kind {
            Kind::Hello => {
                if descriptor_fields || payload != 0 {
                    return refuse(
                        ProtocolRule::Reserved,
                        "every field after the header's length must be zero".into(),
                    );
                }
            }
            Kind::Refused | Kind::Data => {
                if descriptor_fields {
                    return refuse(
                        ProtocolRule::Reserved,
                        "carries descriptor fields or chunks; only a payload is allowed".into(),
                    );
                }
            }
            Kind::Cuda => {
                if payload != 0 {
                    return refuse(
                        ProtocolRule::Counts,
                        format!("{payload} payload bytes: a descriptor has none"),
                    );
                }
                if self.handle_type != HandleType::PosixFd.to_raw() {
                    return refuse(
                        ProtocolRule::Descriptor,
                        format!(
                            "handle type {} is not carried by CUDA_VMM: only 1 \
                         (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) is{}",
                            self.handle_type,
                            if self.handle_type == HandleType::Fabric.to_raw() {
                                "; fabric handles (8) travel as CUDA_FABRIC (kind 6, version 2)"
                            } else {
                                ""
                            }
                        ),
                    );
                }
            }
            Kind::Fabric => {
                if self.handle_type != HandleType::Fabric.to_raw() {
                    return refuse(
                        ProtocolRule::Descriptor,
                        format!(
                            "handle type {} is not carried by CUDA_FABRIC: only 8 \
                         (CU_MEM_HandleType::Fabric.to_raw()) is",
                            self.handle_type
                        ),
                    );
                }
                if self.device.is_none() {
                    return refuse(
                        ProtocolRule::Descriptor,
                        "the device flag (0x0001) is not set: a CUDA_FABRIC message names the \
                         device that owns the memory"
                            .into(),
                    );
                }
                if count == 0 {
                    return refuse(
                        ProtocolRule::Counts,
                        "0 chunks: a CUDA_FABRIC message carries at least one".into(),
                    );
                }
                if payload != FABRIC_HANDLE_BYTES * count {
                    return refuse(
                        ProtocolRule::Counts,
                        format!(
                            "{payload} payload bytes for {count} chunk(s): the payload is exactly \
                         one {FABRIC_HANDLE_BYTES}-byte fabric handle per chunk ({} bytes)",
                            FABRIC_HANDLE_BYTES * count
                        ),
                    );
                }
            }
            Kind::Host => {
                if payload != 0 {
                    return refuse(
                        ProtocolRule::Counts,
                        format!("{payload} payload bytes: a descriptor has none"),
                    );
                }
                if self.handle_type != 0
                    || self.device.is_some()
                    || self.location != FrameLocation::Device
                {
                    return refuse(
                        ProtocolRule::Reserved,
                        "handle type, device and location must be zero for a memfd".into(),
                    );
                }
                if usize::try_from(self.size).is_err() {
                    return refuse(
                        ProtocolRule::Descriptor,
                        format!("size {} is more than this platform's usize", self.size),
                    );
                }
                match count {
                    0 if self.size != 0 => {
                        return refuse(
                            ProtocolRule::Counts,
                            format!(
                                "size {} with no fd: only an empty buffer has none",
                                self.size
                            ),
                        );
                    }
                    0 | 1 => {}
                    _ => {
                        return refuse(
                            ProtocolRule::Counts,
                            format!("{count} fds: a memfd descriptor has at most 1"),
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

impl Frame {
    /// Rule 5, the chunk sizes: a CUDA descriptor's layout by the descriptors' own rule
    /// (non-empty chunks whose sum fits this platform, `size` within it), a memfd's one chunk
    /// equal to its size.
    pub(super) fn check_chunks(&self) -> Result<()> {
        let name = self.kind.name();
        match self.kind {
            Kind::Hello | Kind::Refused | Kind::Data => Ok(()),
            Kind::Cuda | Kind::Fabric => {
                let count = self.chunk_sizes.len();
                let mut sizes = Vec::new();
                if sizes.try_reserve_exact(count).is_err() {
                    return refuse(
                        ProtocolRule::TooLarge,
                        format!("{name}: no memory for {count} chunk sizes"),
                    );
                }
                for (index, &chunk) in self.chunk_sizes.iter().enumerate() {
                    match usize::try_from(chunk) {
                        Ok(chunk) => sizes.push(chunk),
                        Err(_) => {
                            return refuse(
                                ProtocolRule::Descriptor,
                                format!(
                                    "{name}: chunk {} of {count} has size {chunk}, more than this \
                                 platform's usize",
                                    index + 1
                                ),
                            );
                        }
                    }
                }
                let Ok(size) = usize::try_from(self.size) else {
                    return refuse(
                        ProtocolRule::Descriptor,
                        format!(
                            "{name}: size {} is more than this platform's usize",
                            self.size
                        ),
                    );
                };
                match validate_chunks(name, &sizes, size, 1) {
                    Ok(_) => Ok(()),
                    // "invalid CUDA_VMM: chunk 2 of 3 has size 0: ...": the rule, by name.
                    Err(Error::InvalidDescriptor { message, .. }) => {
                        refuse(ProtocolRule::Descriptor, message)
                    }
                    Err(other) => Err(other),
                }
            }
            Kind::Host => match self.chunk_sizes.first() {
                None => Ok(()),
                Some(&chunk) if chunk == self.size && chunk != 0 => Ok(()),
                Some(&chunk) => refuse(
                    ProtocolRule::Descriptor,
                    format!(
                        "{name}: its one chunk has size {chunk} but the buffer's size is {}: they \
                     must be equal and non-zero",
                        self.size
                    ),
                ),
            },
        }
    }
}
