//! Payloads too large for one packet: written to a sealed memfd that rides along as the
//! message's last fd ([`spill_to_memfd`]), and read back only after every number the sender
//! chose is checked against the memfd itself ([`read_spill`]).

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

use crate::error::ProtocolRule;
use crate::{Error, Result};

/// The largest payload one message may carry (1 GiB): a sender refuses more, and a receiver
/// refuses a spilled payload whose header (or memfd) claims more before allocating anything.
pub const MAX_MESSAGE: usize = 1 << 30;

/// Write `bytes` to a new memfd sealed against writing, resizing and further seals.
pub(crate) fn spill_to_memfd(bytes: &[u8]) -> Result<OwnedFd> {
    let fd = memfd_create(
        c"vmm-ipc-message",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| Error::errno("memfd_create(message)", e))?;
    let mut file = File::from(fd);
    file.write_all(bytes)
        .map_err(|e| Error::io("write(message memfd)", e))?;
    let fd = OwnedFd::from(file);
    let seals = SealFlag::F_SEAL_WRITE
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))
        .map_err(|e| Error::errno("fcntl(F_ADD_SEALS, message)", e))?;
    Ok(fd)
}

/// Read a spilled payload. The header's size is a number the peer chose: it is checked against
/// [`MAX_MESSAGE`] and against the memfd's real size, and the memfd must be sealed against
/// writing and resizing (so the bytes cannot change while read), before anything is allocated;
/// the allocation itself is fallible.
pub(crate) fn read_spill(fd: OwnedFd, size: u64) -> Result<Vec<u8>> {
    let refuse = |rule: ProtocolRule, why: String| {
        Err(Error::protocol(rule, format!("large message: {why}")))
    };
    let len = match usize::try_from(size) {
        Ok(len) if len <= MAX_MESSAGE => len,
        _ => {
            return refuse(
                ProtocolRule::TooLarge,
                format!(
                    "its header says {size} bytes, more than wire::MAX_MESSAGE ({MAX_MESSAGE})"
                ),
            );
        }
    };
    let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(|e| {
        Error::protocol(
            ProtocolRule::Fds,
            format!("its payload fd is not a sealed memfd (F_GET_SEALS: {e})"),
        )
    })?;
    let needed = SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK;
    if !SealFlag::from_bits_truncate(seals).contains(needed) {
        return refuse(
            ProtocolRule::Fds,
            "its memfd is not sealed against writing and resizing".into(),
        );
    }
    let actual = nix::sys::stat::fstat(&fd)
        .map_err(|e| Error::errno("fstat(message memfd)", e))?
        .st_size as u64;
    if actual != size {
        return refuse(
            ProtocolRule::Fds,
            format!("its memfd holds {actual} bytes, its header says {size}"),
        );
    }
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len).map_err(|_| Error::Os {
        op: format!("allocating {len} bytes for a large message"),
        source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
    })?;
    bytes.resize(len, 0);
    // At offset 0: the file description (and its offset, left at the end by the sender's
    // write) is shared with the sender.
    File::from(fd)
        .read_exact_at(&mut bytes, 0)
        .map_err(|e| Error::io("pread(message memfd)", e))?;
    Ok(bytes)
}
