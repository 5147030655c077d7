//! [`WarmOptions`]: how many children a warm pool keeps waiting, and which CUDA devices each
//! initialises; from code or from the environment.

use crate::{Error, Result};

/// The variable that sets the pool's [depth](WarmOptions::depth): how many children wait.
pub const DEPTH_VAR: &str = "VMM_WARM_DEPTH";

/// The variable that sets the [devices](WarmOptions::devices) a warm child initialises: CUDA
/// ordinals, comma-separated (`0`, `0,1`), or `none`.
pub const DEVICES_VAR: &str = "VMM_WARM_DEVICES";

/// The depth when [`DEPTH_VAR`] is not set.
pub const DEFAULT_DEPTH: usize = 2;

/// How the warm pool is kept: how many children wait, and which CUDA devices each initialises.
///
/// The default (and what the [process-wide pool](super::WarmPool::global) starts from) is [`DEFAULT_DEPTH`] (2) children that
/// each retain the primary context of device 0, or what [`DEPTH_VAR`] and [`DEVICES_VAR`] say.
/// The depth is small because every waiting child holds a CUDA context on each of its devices
/// (a few hundred MiB of device memory each, on an H200) for as long as it waits, and because
/// a pool refills in the background anyway: two cover a test or a program that starts children
/// one after another. Raise it for a suite that runs many tests in parallel
/// (`VMM_WARM_DEPTH` = the number of test threads keeps each test's child warm); 0 turns the
/// pool off (every warm child is then started on demand, as a spawned one).
///
/// ```
/// use vmm_core::process::{WarmOptions, WarmPool};
/// WarmPool::global().set_options(WarmOptions::new().with_depth(4).with_devices([0, 1]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmOptions {
    depth: usize,
    devices: Vec<usize>,
}

impl Default for WarmOptions {
    fn default() -> Self {
        WarmOptions {
            depth: DEFAULT_DEPTH,
            devices: vec![0],
        }
    }
}

impl WarmOptions {
    /// The defaults: depth [`DEFAULT_DEPTH`], device 0; the environment is not read.
    pub fn new() -> WarmOptions {
        WarmOptions::default()
    }

    /// The defaults, overridden by [`DEPTH_VAR`] and [`DEVICES_VAR`] where they are set. A
    /// value that is not a count (depth) or a list of ordinals (devices) is
    /// [`Error::InvalidEnv`], naming the variable and the value.
    pub fn from_env() -> Result<WarmOptions> {
        let mut options = WarmOptions::default();
        if let Some(value) = std::env::var_os(DEPTH_VAR) {
            let value = value.to_string_lossy();
            options.depth = value.trim().parse().map_err(|_| Error::InvalidEnv {
                variable: DEPTH_VAR.into(),
                message: format!(
                    "{DEPTH_VAR}={value:?}: not a number of children (such as 2, or 0 for \
                         none)"
                ),
            })?;
        }
        if let Some(value) = std::env::var_os(DEVICES_VAR) {
            options.devices = parse_devices(&value.to_string_lossy())?;
        }
        Ok(options)
    }

    /// Keep `depth` children waiting (0: none).
    pub fn with_depth(mut self, depth: usize) -> WarmOptions {
        self.depth = depth;
        self
    }

    /// Initialise these CUDA devices (ordinals, as the child numbers them) in each child; none
    /// for a pool that only hides the exec. A device the child does not see is skipped.
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = usize>) -> WarmOptions {
        self.devices = devices.into_iter().collect();
        self.devices.sort_unstable();
        self.devices.dedup();
        self
    }

    /// How many children wait.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The CUDA devices each child initialises while it waits.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }
}

fn parse_devices(value: &str) -> Result<Vec<usize>> {
    let trimmed = value.trim();
    if trimmed.is_empty() || trimmed.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    let devices = trimmed
        .split(',')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| Error::InvalidEnv {
            variable: DEVICES_VAR.into(),
            message: format!(
                "{DEVICES_VAR}={value:?}: not a list of CUDA device ordinals (such as 0 or \
                     0,1, or none)"
            ),
        })?;
    Ok(WarmOptions::new().with_devices(devices).devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_parse() {
        assert_eq!(parse_devices("0").unwrap(), [0]);
        assert_eq!(parse_devices(" 1, 0 ,1").unwrap(), [0, 1]);
        assert!(parse_devices("none").unwrap().is_empty());
        assert!(parse_devices("").unwrap().is_empty());
        let Err(Error::InvalidEnv { message, .. }) = parse_devices("gpu0") else {
            panic!("gpu0 must be refused");
        };
        assert!(message.contains(DEVICES_VAR), "{message}");
    }
}
