//! CUDA devices: identity, the capabilities VMM IPC needs, and the primary context.
//!
//! Users never manage a current context: each [`Device`] retains its primary context once (on
//! first use) and makes it current on the calling thread for each call that needs one, then
//! restores whatever the thread had current before.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

use super::driver::{self, CUdevice_attribute};
use crate::error::{DeviceWanted, Unavailable};
use crate::{Error, Result};

/// A CUDA device of this process, by ordinal (as numbered under this process's
/// `CUDA_VISIBLE_DEVICES`). Cheap to clone; all clones share one primary context.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: i32,
    raw: driver::CUdevice,
    name: String,
    uuid: [u8; 16],
    /// Retained on first use, never released: the primary context lives as long as the process.
    ctx: OnceLock<driver::Context>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("uuid", &self.uuid_string())
            .finish()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.inner.ordinal == other.inner.ordinal
    }
}

impl Eq for Device {}

impl Device {
    /// How many CUDA devices this process sees; `Err` when libcuda does not load or `cuInit`
    /// fails, so callers can tell "no driver" from "no device".
    pub fn count() -> Result<usize> {
        Ok(driver::device_count()?.max(0) as usize)
    }

    /// The device with this ordinal. Every call for one ordinal returns the same device.
    pub fn new(ordinal: usize) -> Result<Device> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
        let count = Self::count()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice {
                wanted: DeviceWanted::Ordinal(ordinal),
                visible: count,
                message: format!(
                    "device ordinal {ordinal} does not exist: this process sees {count} CUDA \
                     device(s)"
                ),
            });
        }
        let mut devices = DEVICES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(device) = devices.get(&ordinal) {
            return Ok(device.clone());
        }
        let raw = driver::device_get(ordinal as i32)?;
        let device = Device {
            inner: Arc::new(Inner {
                ordinal: ordinal as i32,
                raw,
                name: driver::device_name(raw)?,
                uuid: driver::device_uuid(raw)?,
                ctx: OnceLock::new(),
            }),
        };
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The device whose UUID is `uuid`: how a descriptor from another process (which may number
    /// devices differently) finds its device here.
    pub fn by_uuid(uuid: &[u8; 16]) -> Result<Device> {
        let count = Self::count()?;
        for ordinal in 0..count {
            let device = Self::new(ordinal)?;
            if device.uuid() == uuid {
                return Ok(device);
            }
        }
        Err(Error::NoSuchDevice {
            wanted: DeviceWanted::Uuid(*uuid),
            visible: count,
            message: format!(
                "no CUDA device in this process has UUID {}; check CUDA_VISIBLE_DEVICES",
                format_uuid(uuid)
            ),
        })
    }

    /// The ordinal in this process.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal as usize
    }

    pub(crate) fn ordinal_i32(&self) -> i32 {
        self.inner.ordinal
    }

    /// The device's marketing name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's UUID (stable across processes and `CUDA_VISIBLE_DEVICES`).
    pub fn uuid(&self) -> &[u8; 16] {
        &self.inner.uuid
    }

    /// The UUID in the `GPU-xxxxxxxx-xxxx-...` form that `nvidia-smi -L` prints.
    pub fn uuid_string(&self) -> String {
        format_uuid(&self.inner.uuid)
    }

    /// A raw `cuDeviceGetAttribute` value (crate-internal: the public API names the capabilities
    /// it needs, `supports_*`, and exposes no driver type).
    pub(crate) fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32> {
        driver::device_attribute(self.inner.raw, attribute)
    }

    /// Whether the device supports the VMM API (`cuMemCreate`, `cuMemMap`, ...).
    pub fn supports_vmm(&self) -> Result<bool> {
        Ok(self.attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0)
    }

    /// Whether VMM allocations can be exported as POSIX fds (needed for IPC on Linux).
    pub fn supports_posix_fd(&self) -> Result<bool> {
        Ok(self.attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )? != 0)
    }

    /// Whether the device offers fabric handles
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`). Using them also needs an IMEX
    /// channel in this process, which this attribute does not say:
    /// [`check_fabric`](Self::check_fabric) checks both.
    pub fn supports_fabric(&self) -> Result<bool> {
        Ok(
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)?
                != 0,
        )
    }

    /// Whether VMM allocations may live in host NUMA memory for this device.
    pub fn supports_host_numa_vmm(&self) -> Result<bool> {
        Ok(self.attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0)
    }

    /// Make this device's primary context current on the calling thread (retaining it the
    /// first time) until the returned guard drops, so the driver calls in between act on this
    /// device. The guard restores whatever was current before (another device's context, the
    /// user's own, or none): vmm-core never leaves a thread's CUDA state changed.
    pub(crate) fn make_current(&self) -> Result<CurrentContext> {
        let ctx = match self.inner.ctx.get() {
            Some(ctx) => *ctx,
            None => {
                let ctx = driver::primary_ctx_retain(self.inner.raw)?;
                // A racing thread may have retained too: the primary context is one per device,
                // so both got the same handle; the extra retain count is harmless.
                *self.inner.ctx.get_or_init(|| ctx)
            }
        };
        let previous = driver::ctx_get_current()?;
        if previous.is(&ctx) {
            return Ok(CurrentContext {
                restore: None,
                _thread: PhantomData,
            });
        }
        // SAFETY: `ctx` is this device's primary context, retained above (or by an earlier call)
        // and never released, so it is alive for the whole process.
        unsafe { driver::ctx_set_current(ctx) }?;
        Ok(CurrentContext {
            restore: Some(previous),
            _thread: PhantomData,
        })
    }
}

/// While alive, a device's primary context is current on this thread; dropping it restores the
/// thread's previous context. Not `Send`: the current context is per thread.
///
/// Guards live only inside one vmm-core call (they are crate-internal and never handed to user
/// code), and they nest: an inner guard restores what the outer one made current.
#[derive(Debug)]
#[must_use = "the context is current only while the guard lives"]
pub(crate) struct CurrentContext {
    restore: Option<driver::Context>,
    _thread: PhantomData<*const ()>,
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if let Some(previous) = self.restore.take() {
            // SAFETY: `previous` was current on this thread when the guard was made (null if
            // none was), and is alive still: the guard lives only inside the vmm-core call that
            // made it, and no vmm-core code destroys or releases a context. A context could
            // only go away meanwhile if another thread destroyed (or released the last retain
            // of) a context that this thread is using, which the driver forbids already
            // (`cuCtxDestroy`: no API call may use the context while it is destroyed).
            let _ = unsafe { driver::ctx_set_current(previous) };
        }
    }
}

/// A device UUID as `nvidia-smi -L` (and vmm-core's messages) print it:
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Whether this process can share CUDA VMM buffers by fd: libcuda loads, a device exists, and
/// device 0 supports VMM and POSIX-fd handles. `Err` is the [`Unavailable`] reason: the check
/// that failed, whose text is what skip messages (`SKIP <test>: <reason>`) print.
pub fn availability() -> std::result::Result<(), Unavailable> {
    let count = Device::count().map_err(Unavailable::from_error)?;
    if count == 0 {
        return Err(Unavailable::NoDevice);
    }
    let device = Device::new(0).map_err(Unavailable::from_error)?;
    if !device.supports_vmm().map_err(Unavailable::from_error)? {
        return Err(Unavailable::NoVmm {
            device: device.name().to_owned(),
        });
    }
    if !device
        .supports_posix_fd()
        .map_err(Unavailable::from_error)?
    {
        return Err(Unavailable::NoPosixFd {
            device: device.name().to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_formats_like_nvidia_smi() {
        let uuid = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(
            format_uuid(&uuid),
            "GPU-12345678-9abc-def0-0123-456789abcdef"
        );
    }

    #[test]
    fn without_a_gpu_availability_and_constructors_are_errors() {
        let Err(reason) = availability() else {
            return;
        };
        assert!(!reason.to_string().is_empty());
        match Device::count() {
            // No driver (or cuInit failed): every constructor says so, with the same reason.
            Err(err) => {
                assert!(
                    matches!(
                        (&err, &reason),
                        (
                            Error::CudaUnavailable(Unavailable::NoDriver),
                            Unavailable::NoDriver
                        ) | (
                            Error::CudaUnavailable(Unavailable::Driver { .. }),
                            Unavailable::Driver { .. }
                        )
                    ),
                    "{err:?} / {reason:?}"
                );
                assert!(matches!(Device::new(0), Err(Error::CudaUnavailable(_))));
            }
            Ok(0) => {
                assert!(matches!(reason, Unavailable::NoDevice), "{reason:?}");
                assert!(
                    matches!(
                        Device::new(0),
                        Err(Error::NoSuchDevice {
                            wanted: DeviceWanted::Ordinal(0),
                            visible: 0,
                            ..
                        })
                    ),
                    "{reason}"
                );
            }
            // A device without VMM or POSIX-fd support: it exists, it just cannot share.
            Ok(_) => assert!(
                matches!(
                    reason,
                    Unavailable::NoVmm { .. } | Unavailable::NoPosixFd { .. }
                ),
                "{reason:?}"
            ),
        }
    }
}
