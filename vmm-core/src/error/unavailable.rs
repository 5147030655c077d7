//! Why CUDA (or a CUDA capability) cannot be used in this process: the typed reason that
//! [`cuda::availability`](crate::cuda::availability), the skip requirements and
//! [`Error::CudaUnavailable`] carry.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{CudaCode, DriverRefusal, Error, FabricEvidence};

/// Why CUDA VMM sharing (or the part of it asked for) cannot be used in this process.
///
/// Returned by [`cuda::availability`](crate::cuda::availability),
/// [`cuda::fabric_availability`](crate::cuda::fabric_availability) and the CUDA requirements of
/// [`testing`](crate::testing), and carried by
/// [`Error::CudaUnavailable`]. Match on the variant; the text
/// (which `SKIP <test>: <reason>` lines print) is for people.
#[derive(Debug, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Unavailable {
    /// libcuda could not be loaded: no NVIDIA driver on this machine, or `libcuda.so.1` is not
    /// on the loader path.
    NoDriver,
    /// The driver loaded, but this process sees no CUDA device (`cuDeviceGetCount` is 0).
    NoDevice,
    /// Fewer CUDA devices than needed are visible.
    TooFewDevices {
        /// How many are needed.
        needed: usize,
        /// How many this process sees.
        found: usize,
    },
    /// Device 0 does not support virtual memory management
    /// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` is 0).
    NoVmm {
        /// The device's name, e.g. `NVIDIA H200`.
        device: String,
    },
    /// Device 0 does not export VMM memory as POSIX fds
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED` is 0).
    NoPosixFd {
        /// The device's name.
        device: String,
    },
    /// The device does not support fabric handles (as
    /// [`Error::FabricUnsupported`]).
    NoFabric {
        /// The device, e.g. `device 0 (NVIDIA H200)`.
        device: String,
        /// What said so (the attribute, or the refused call and its error code).
        evidence: FabricEvidence,
    },
    /// The device supports fabric handles but this process has no IMEX channel (as
    /// [`Error::NoImexChannel`]).
    NoImexChannel {
        /// The device, e.g. `device 0 (NVIDIA H200)`.
        device: String,
        /// The refused call and its error code.
        refused: DriverRefusal,
        /// Whether the IMEX channel directory did not exist.
        channel_dir_missing: bool,
    },
    /// A driver call failed while checking (`cuInit`, say), with the driver's error code.
    Driver {
        /// The driver call, e.g. `cuInit`.
        call: Cow<'static, str>,
        /// The CUDA error's name, e.g. `CUDA_ERROR_NO_DEVICE`.
        name: String,
        /// The CUDA error's code.
        code: CudaCode,
    },
    /// Another error stopped the check (rare: not a driver call's error code).
    Other(Box<Error>),
}

impl Unavailable {
    /// The reason for an error met while checking availability: an
    /// [`Error::CudaUnavailable`] is its reason, an [`Error::Cuda`] is
    /// [`Unavailable::Driver`], fabric refusals are [`Unavailable::NoFabric`] and
    /// [`Unavailable::NoImexChannel`], and anything else is [`Unavailable::Other`].
    pub(crate) fn from_error(error: Error) -> Self {
        match error {
            Error::CudaUnavailable(reason) => reason,
            Error::Cuda { call, name, code } => Unavailable::Driver { call, name, code },
            Error::FabricUnsupported { device, evidence } => {
                Unavailable::NoFabric { device, evidence }
            }
            Error::NoImexChannel {
                device,
                refused,
                channel_dir_missing,
            } => Unavailable::NoImexChannel {
                device,
                refused,
                channel_dir_missing,
            },
            other => Unavailable::Other(Box::new(other)),
        }
    }
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lacks = |f: &mut fmt::Formatter<'_>, device: &str, what: &str, attribute: &str| {
            write!(
                f,
                "device 0 ({device}) does not support {what} ({attribute} = 0)"
            )
        };
        match self {
            Unavailable::NoDriver => f.write_str(
                "libcuda could not be loaded (no NVIDIA driver on this machine, or \
                 libcuda.so.1 is not on the loader path)",
            ),
            Unavailable::NoDevice => {
                f.write_str("no CUDA device is visible (cuDeviceGetCount returned 0)")
            }
            Unavailable::TooFewDevices { needed, found } => {
                write!(f, "needs {needed} CUDA devices, found {found}")
            }
            Unavailable::NoVmm { device } => lacks(
                f,
                device,
                "virtual memory management",
                "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
            ),
            Unavailable::NoPosixFd { device } => lacks(
                f,
                device,
                "POSIX file descriptor handles",
                "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
            ),
            Unavailable::NoFabric { device, evidence } => Error::FabricUnsupported {
                device: device.clone(),
                evidence: evidence.clone(),
            }
            .fmt(f),
            Unavailable::NoImexChannel {
                device,
                refused,
                channel_dir_missing,
            } => Error::NoImexChannel {
                device: device.clone(),
                refused: refused.clone(),
                channel_dir_missing: *channel_dir_missing,
            }
            .fmt(f),
            Unavailable::Driver { call, name, code } => {
                write!(f, "{call} failed: {name} ({code})")
            }
            Unavailable::Other(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for Unavailable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Unavailable::Other(error) => Some(error.as_ref()),
            _ => None,
        }
    }
}

/// The reason as text, for code whose requirements are `Result<(), String>` (a skip check
/// that combines CUDA with other requirements: `cuda_vmm_ipc()?` in a function that returns
/// `Result<(), String>`).
impl From<Unavailable> for String {
    fn from(reason: Unavailable) -> String {
        reason.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_read_as_before_and_cross_serde() {
        assert_eq!(
            Unavailable::NoVmm { device: "X".into() }.to_string(),
            "device 0 (X) does not support virtual memory management \
             (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)"
        );
        assert_eq!(
            Unavailable::Driver {
                call: "cuInit".into(),
                name: "CUDA_ERROR_NO_DEVICE".into(),
                code: CudaCode::NO_DEVICE
            }
            .to_string(),
            "cuInit failed: CUDA_ERROR_NO_DEVICE (100)"
        );
        let fabric = Unavailable::from_error(Error::FabricUnsupported {
            device: "device 0 (X)".into(),
            evidence: FabricEvidence::AttributeZero,
        });
        assert!(
            fabric
                .to_string()
                .starts_with("device 0 (X) does not support fabric handles"),
            "{fabric}"
        );
        let error = Error::CudaUnavailable(Unavailable::TooFewDevices {
            needed: 2,
            found: 1,
        });
        assert_eq!(
            error.to_string(),
            "CUDA is not available: needs 2 CUDA devices, found 1"
        );
        let back: Error = postcard::from_bytes(&postcard::to_stdvec(&error).unwrap()).unwrap();
        assert!(
            matches!(
                back,
                Error::CudaUnavailable(Unavailable::TooFewDevices {
                    needed: 2,
                    found: 1
                })
            ),
            "{back:?}"
        );
    }
}
