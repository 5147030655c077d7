//! The typed parts of CUDA failures: the driver's error code, what a fabric refusal rests on,
//! how a driver broke its own contract, and which device was asked for.
//!
//! Plain data, so that an [`Error`](super::Error) that carries them serialises and exists in a
//! process (or a build) without the driver.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A CUDA driver error code (`CUresult`) as a number: the driver's own, kept whole (a driver
/// newer than this crate may answer a code it does not name). The constants name the codes
/// vmm-core acts on; match on them (`CudaCode::NOT_PERMITTED`), and print the name that
/// [`Error::Cuda`](super::Error::Cuda) carries beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CudaCode(pub u32);

impl CudaCode {
    /// `CUDA_ERROR_INVALID_VALUE`: a bad argument, or an attribute the driver does not know.
    pub const INVALID_VALUE: CudaCode = CudaCode(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: CudaCode = CudaCode(2);
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: CudaCode = CudaCode(3);
    /// `CUDA_ERROR_NO_DEVICE`: `cuInit` found no device.
    pub const NO_DEVICE: CudaCode = CudaCode(100);
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const INVALID_DEVICE: CudaCode = CudaCode(101);
    /// `CUDA_ERROR_NOT_PERMITTED`: what fabric calls answer in a process without an IMEX
    /// channel.
    pub const NOT_PERMITTED: CudaCode = CudaCode(800);
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: CudaCode = CudaCode(801);
}

impl fmt::Display for CudaCode {
    /// The number, as `cuGetErrorName`'s name is printed beside it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A driver call's refusal, as the fabric errors carry it: the call, and the error's name and
/// code (the fields of [`Error::Cuda`](super::Error::Cuda)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverRefusal {
    /// The driver call, e.g. `cuMemCreate`.
    pub call: Cow<'static, str>,
    /// The CUDA error's name, e.g. `CUDA_ERROR_NOT_PERMITTED`.
    pub name: String,
    /// The CUDA error's code.
    pub code: CudaCode,
}

/// What says a device does not support fabric handles
/// ([`Error::FabricUnsupported`](super::Error::FabricUnsupported)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FabricEvidence {
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` is 0.
    AttributeZero,
    /// The driver does not know the attribute (it answered `name`, `code`): it predates fabric
    /// handles (CUDA 12.3).
    AttributeUnknown {
        /// The error's name.
        name: String,
        /// The error's code.
        code: CudaCode,
    },
    /// A call with `CU_MEM_HANDLE_TYPE_FABRIC` was refused as not supported.
    Refused(DriverRefusal),
}

impl fmt::Display for FabricEvidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricEvidence::AttributeZero => {
                f.write_str("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0")
            }
            FabricEvidence::AttributeUnknown { name, .. } => write!(
                f,
                "the driver does not know CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED \
                 ({name}): it predates fabric handles (CUDA 12.3)"
            ),
            FabricEvidence::Refused(refusal) => fabric_call(f, refusal),
        }
    }
}

/// `cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC returned CUDA_ERROR_NOT_PERMITTED`.
pub(super) fn fabric_call(f: &mut fmt::Formatter<'_>, refusal: &DriverRefusal) -> fmt::Result {
    write!(
        f,
        "{} with CU_MEM_HANDLE_TYPE_FABRIC returned {}",
        refusal.call, refusal.name
    )
}

/// How a driver call that reported success broke its contract
/// ([`Error::CudaContract`](super::Error::CudaContract)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ContractBreach {
    /// It handed back a negative fd.
    NegativeFd {
        /// The fd it gave.
        fd: i32,
    },
}

impl fmt::Display for ContractBreach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ContractBreach::NegativeFd { fd } => write!(f, "gave fd {fd}"),
        }
    }
}

/// Which device was asked for ([`Error::NoSuchDevice`](super::Error::NoSuchDevice)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceWanted {
    /// By ordinal, as this process numbers its devices.
    Ordinal(usize),
    /// By UUID (as a descriptor from another process names it).
    Uuid([u8; 16]),
}
