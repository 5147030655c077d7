//! Whether this process can use fabric handles, and what the driver's refusals of a fabric
//! call mean: no fabric support on the device ([`Error::FabricUnsupported`]), no IMEX channel
//! for this process ([`Error::NoImexChannel`]), or no path to the memory's owner
//! ([`Error::FabricUnreachable`]).

use super::device::{Device, availability, format_uuid};
use super::driver;
use super::fabric::IMEX_CHANNEL_DIR;
use super::objects::Allocation;
use super::resource_options::{HandleType, Location};
use crate::error::{CudaCode, DriverRefusal, FabricEvidence, Unavailable};
use crate::{Error, Result};

impl Device {
    /// Whether this process can share this device's memory by fabric handle: the device offers
    /// them (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`), and a trial allocation of one
    /// chunk with `CU_MEM_HANDLE_TYPE_FABRIC` and its export succeed (which needs an IMEX
    /// channel: the attribute alone does not say that). The trial chunk is released at once;
    /// the whole check takes tens of microseconds.
    ///
    /// [`Error::FabricUnsupported`] when the device does not offer fabric handles;
    /// [`Error::NoImexChannel`] when this process has no IMEX channel (its message says how to
    /// create one); another error when the driver fails otherwise.
    pub fn check_fabric(&self) -> Result<()> {
        check(self)
    }
}

/// [`Device::check_fabric`]: the attribute, then a trial allocation and export of one chunk.
pub(crate) fn check(device: &Device) -> Result<()> {
    let unsupported = |evidence: FabricEvidence| Error::FabricUnsupported {
        device: describe(device),
        evidence,
    };
    match device.supports_fabric() {
        Ok(true) => {}
        Ok(false) => {
            return Err(unsupported(FabricEvidence::AttributeZero));
        }
        // Drivers older than CUDA 12.3 do not know the attribute.
        Err(Error::Cuda { name, code, .. }) if code == CudaCode::INVALID_VALUE => {
            return Err(unsupported(FabricEvidence::AttributeUnknown { name, code }));
        }
        Err(e) => return Err(e),
    }
    let _current = device.make_current()?;
    let prop = driver::allocation_prop(
        Location::Device.to_driver(device.ordinal_i32()),
        HandleType::Fabric.to_raw(),
    );
    let granularity =
        driver::allocation_granularity(&prop, false).map_err(|e| classify(e, device))?;
    let chunk = Allocation::create(device, granularity, &prop).map_err(|e| classify(e, device))?;
    chunk.export_fabric().map_err(|e| classify(e, device))?;
    Ok(())
}
/// `device 0 (NVIDIA H200)`.
fn describe(device: &Device) -> String {
    format!("device {} ({})", device.ordinal(), device.name())
}

/// A driver error of a fabric call, as what it means: `CUDA_ERROR_NOT_PERMITTED` is
/// [`Error::NoImexChannel`], `CUDA_ERROR_NOT_SUPPORTED` is [`Error::FabricUnsupported`], and
/// anything else stays the driver's error.
fn classify(error: Error, device: &Device) -> Error {
    let Error::Cuda { call, name, code } = &error else {
        return error;
    };
    let refused = DriverRefusal {
        call: call.clone(),
        name: name.clone(),
        code: *code,
    };
    match *code {
        CudaCode::NOT_PERMITTED => Error::NoImexChannel {
            device: describe(device),
            refused,
            channel_dir_missing: !std::path::Path::new(IMEX_CHANNEL_DIR).exists(),
        },
        CudaCode::NOT_SUPPORTED => Error::FabricUnsupported {
            device: describe(device),
            evidence: FabricEvidence::Refused(refused),
        },
        _ => error,
    }
}

/// A failed fabric allocation or import, explained: when the driver refused it as not
/// permitted or not supported, [`Device::check_fabric`] says whether the process lacks an IMEX
/// channel or the device fabric support, and that is the error; otherwise (a forged handle,
/// released memory) the driver's own error stays.
pub(crate) fn explain_refusal(error: Error, device: &Device) -> Error {
    let refused = matches!(
        &error,
        Error::Cuda { code, .. }
            if *code == CudaCode::NOT_PERMITTED || *code == CudaCode::NOT_SUPPORTED
    );
    if !refused {
        return error;
    }
    match device.check_fabric() {
        Err(cause @ (Error::NoImexChannel { .. } | Error::FabricUnsupported { .. })) => cause,
        _ => error,
    }
}

/// A failed import of memory that another device owns (`owner`, by UUID), explained: where the
/// driver refused a step (importing a chunk, mapping it, setting access), the cause is most
/// likely that `device` cannot reach the owner over the fabric, and [`Error::FabricUnreachable`]
/// says so and what to do. A refusal already explained (no IMEX channel, no fabric support) and
/// vmm-core's own checks stay as they are.
pub(crate) fn unreachable(error: Error, owner: &[u8; 16], device: &Device) -> Error {
    unreachable_from(error, owner, &describe(device))
}

/// [`unreachable()`], with the importing device already described.
fn unreachable_from(error: Error, owner: &[u8; 16], device: &str) -> Error {
    let wrap = |source: Error| match source {
        Error::Cuda { .. } => Error::FabricUnreachable {
            owner: format_uuid(owner),
            device: device.to_owned(),
            source: Box::new(source),
        },
        other => other,
    };
    match error {
        Error::Ipc { op, step, source } => Error::Ipc {
            op,
            step,
            source: Box::new(wrap(*source)),
        },
        other => wrap(other),
    }
}

/// Whether this process can share CUDA VMM buffers by fabric handle: [`availability`] holds,
/// and [`Device::check_fabric`] passes for device 0. `Err` is the [`Unavailable`] reason
/// (typically [`Unavailable::NoFabric`] or [`Unavailable::NoImexChannel`]), for skip
/// messages (`SKIP <test>: <reason>`). Never panics, with or without a GPU.
pub fn fabric_availability() -> std::result::Result<(), Unavailable> {
    availability()?;
    let device = Device::new(0).map_err(Unavailable::from_error)?;
    device.check_fabric().map_err(Unavailable::from_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::DescriptorRule;

    #[test]
    fn not_permitted_is_no_imex_channel_and_names_the_recipe() {
        let error = Error::NoImexChannel {
            device: "device 0 (NVIDIA H200)".to_owned(),
            refused: DriverRefusal {
                call: "cuMemCreate".into(),
                name: "CUDA_ERROR_NOT_PERMITTED".to_owned(),
                code: CudaCode::NOT_PERMITTED,
            },
            channel_dir_missing: true,
        };
        let m = error.to_string();
        for needed in [
            "device 0 (NVIDIA H200)",
            "need an IMEX channel",
            "(cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC returned CUDA_ERROR_NOT_PERMITTED; \
             /dev/nvidia-caps-imex-channels does not exist)",
            "/dev/nvidia-caps-imex-channels",
            "mknod /dev/nvidia-caps-imex-channels/channel0 c \"$maj\" 0",
            "/proc/devices",
            "IMEX service (nvidia-imex)",
        ] {
            assert!(m.contains(needed), "{needed:?} missing from: {m}");
        }
        let m = Error::FabricUnsupported {
            device: "device 1 (X)".to_owned(),
            evidence: FabricEvidence::AttributeZero,
        }
        .to_string();
        assert!(
            m.starts_with("device 1 (X) does not support fabric handles")
                && m.contains("HandleType::PosixFd"),
            "{m}"
        );
    }

    #[test]
    fn a_driver_refusal_of_a_remote_owners_memory_says_what_to_do() {
        let refused = Error::Cuda {
            call: "cuMemSetAccess".into(),
            name: "CUDA_ERROR_INVALID_DEVICE".into(),
            code: CudaCode::INVALID_DEVICE,
        };
        let failed = Error::Ipc {
            op: crate::error::IpcOp::Import,
            step: crate::error::IpcStep::Map(crate::error::Chunk {
                index: 0,
                count: 1,
                size: 2 << 20,
            }),
            source: Box::new(refused),
        };
        let explained = unreachable_from(failed, &[0xAB; 16], "device 0 (NVIDIA H200)");
        let Error::Ipc { source, step, .. } = &explained else {
            panic!("the step is kept: {explained:?}");
        };
        assert!(step.to_string().starts_with("while mapping chunk 1"));
        assert!(
            matches!(source.as_ref(), Error::FabricUnreachable { owner, .. }
                if owner == "GPU-abababab-abab-abab-abab-abababababab"),
            "{source:?}"
        );
        let shown = explained.to_string();
        for needle in [
            "cannot be reached from device 0",
            "IMEX service",
            "CUDA_ERROR_INVALID_DEVICE",
        ] {
            assert!(shown.contains(needle), "{needle:?} missing: {shown}");
        }
        // A refusal that is already explained, and vmm-core's own checks, stay as they are.
        let no_channel = Error::NoImexChannel {
            device: "device 0".into(),
            refused: DriverRefusal {
                call: "cuMemCreate".into(),
                name: "x".into(),
                code: CudaCode::NOT_PERMITTED,
            },
            channel_dir_missing: false,
        };
        assert!(matches!(
            unreachable_from(no_channel, &[0xAB; 16], "device 0"),
            Error::NoImexChannel { .. }
        ));
        assert!(matches!(
            unreachable_from(
                Error::descriptor(DescriptorRule::Location, "x"),
                &[0xAB; 16],
                "device 0"
            ),
            Error::InvalidDescriptor { .. }
        ));
    }
}
