//! [`WarmOptions`]: how many children a warm pool keeps waiting, and which CUDA devices each
//! initialises; from code or from the environment.

use crate::error::{EnvRule, MAX_ENV_LEN, parse_env_uint, shown_env_value};
use crate::process::protocol::{MAX_DEVICE_ORDINAL, MAX_DEVICES};
use crate::{Error, Result};

/// The variable that sets the pool's [depth](WarmOptions::depth): how many children wait.
pub const DEPTH_VAR: &str = "VMM_WARM_DEPTH";

/// The variable that sets the [devices](WarmOptions::devices) a warm child initialises: CUDA
/// ordinals, comma-separated (`0`, `0,1`), or `none`.
pub const DEVICES_VAR: &str = "VMM_WARM_DEVICES";

/// The depth when [`DEPTH_VAR`] is not set.
pub const DEFAULT_DEPTH: usize = 2;

/// The largest depth [`DEPTH_VAR`] may ask for: 128, a warm child for each test thread of a
/// 128-core host (`VMM_WARM_DEPTH=$(nproc)`). Each waiting child is a process that holds a
/// CUDA context on each of its devices (a few hundred MiB of device memory on an H200) for as
/// long as it waits, so more is a typo (`300` for `30`) or a hostile launcher, not a wish. A
/// larger value is refused ([`EnvRule::TooLarge`]), not clamped: a depth is a deliberate
/// request for resources, and neither 128 nor the default is surely what was meant; the
/// process-wide pool keeps its default (see [`WarmPool::global`](super::WarmPool::global)).
/// Code that wants more asks for it ([`WarmOptions::with_depth`] has no maximum).
pub const MAX_DEPTH: usize = 128;

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
    /// value that is not a count from 0 to [`MAX_DEPTH`] (depth) or a list of at most
    /// [`MAX_DEVICES`] ordinals up to [`MAX_DEVICE_ORDINAL`] (devices) is
    /// [`Error::InvalidEnv`], naming the variable, the value and the [`EnvRule`] it broke.
    pub fn from_env() -> Result<WarmOptions> {
        let mut options = WarmOptions::default();
        if let Some(value) = std::env::var_os(DEPTH_VAR) {
            options.depth = parse_depth(&value.to_string_lossy())?;
        }
        if let Some(value) = std::env::var_os(DEVICES_VAR) {
            options.devices = parse_devices(&value.to_string_lossy())?;
        }
        Ok(options)
    }

    /// Keep `depth` children waiting (0: none). Not bounded by [`MAX_DEPTH`], which is the
    /// environment's maximum: the program asks for what it means to pay for.
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

/// [`DEPTH_VAR`]'s value: a count from 0 to [`MAX_DEPTH`].
fn parse_depth(value: &str) -> Result<usize> {
    let depth = parse_env_uint(value, MAX_DEPTH as u64).map_err(|rule| {
        let why = match rule {
            EnvRule::TooLarge { max } => format!("more than the maximum of {max} children"),
            EnvRule::TooSmall => "a negative number of children".to_owned(),
            EnvRule::TooLong { max } => format!("longer than {max} bytes"),
            _ => "not a number of children".to_owned(),
        };
        Error::env(
            DEPTH_VAR,
            value,
            rule,
            why,
            &format!("give a number of children from 0 (none) to {MAX_DEPTH}, such as 2"),
        )
    })?;
    Ok(depth as usize)
}

/// [`DEVICES_VAR`]'s value: `none` (or nothing), or at most [`MAX_DEVICES`] comma-separated
/// ordinals up to [`MAX_DEVICE_ORDINAL`]; sorted, without repeats.
fn parse_devices(value: &str) -> Result<Vec<usize>> {
    let refuse = |rule: EnvRule, why: String| {
        Error::env(
            DEVICES_VAR,
            value,
            rule,
            why,
            &format!(
                "give CUDA device ordinals from 0 to {MAX_DEVICE_ORDINAL}, comma-separated \
                 (such as 0 or 0,1), or none"
            ),
        )
    };
    if value.len() > MAX_ENV_LEN {
        let rule = EnvRule::TooLong {
            max: MAX_ENV_LEN as u64,
        };
        return Err(refuse(rule, format!("longer than {MAX_ENV_LEN} bytes")));
    }
    let trimmed = value.trim();
    if trimmed.is_empty() || trimmed.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    let entries = trimmed.split(',').count();
    if entries > MAX_DEVICES {
        let rule = EnvRule::TooMany {
            max: MAX_DEVICES as u64,
        };
        return Err(refuse(
            rule,
            format!("{entries} devices, more than the maximum of {MAX_DEVICES}"),
        ));
    }
    let devices = trimmed
        .split(',')
        .map(|entry| {
            parse_env_uint(entry, MAX_DEVICE_ORDINAL as u64)
                .map(|d| d as usize)
                .map_err(|rule| {
                    let why = match rule {
                        EnvRule::TooLarge { max } => {
                            format!(
                                "device {} is above the largest ordinal, {max}",
                                shown_env_value(entry.trim())
                            )
                        }
                        EnvRule::TooSmall => {
                            format!("device {} is negative", shown_env_value(entry.trim()))
                        }
                        _ => format!(
                            "{} is not a CUDA device ordinal",
                            shown_env_value(entry.trim())
                        ),
                    };
                    refuse(rule, why)
                })
        })
        .collect::<Result<Vec<_>>>()?;
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
        let all: Vec<String> = (0..=MAX_DEVICE_ORDINAL).map(|d| d.to_string()).collect();
        assert_eq!(parse_devices(&all.join(",")).unwrap().len(), MAX_DEVICES);
    }

    fn refusal(result: Result<impl std::fmt::Debug>) -> (EnvRule, String) {
        match result {
            Err(Error::InvalidEnv {
                rule,
                message,
                variable,
            }) => {
                assert!(message.contains(&*variable), "{message}");
                (rule, message)
            }
            other => panic!("expected InvalidEnv, got {other:?}"),
        }
    }

    #[test]
    fn device_lists_past_their_maxima_are_refused_by_rule() {
        let too_many: Vec<String> = (0..=MAX_DEVICES).map(|d| (d % 8).to_string()).collect();
        let ordinal = EnvRule::TooLarge {
            max: MAX_DEVICE_ORDINAL as u64,
        };
        for (value, rule) in [
            ("gpu0", EnvRule::Syntax),
            ("0,,1", EnvRule::Syntax),
            ("64", ordinal),
            ("0,300", ordinal),
            ("18446744073709551615", ordinal),
            ("-1", EnvRule::TooSmall),
            (
                &too_many.join(","),
                EnvRule::TooMany {
                    max: MAX_DEVICES as u64,
                },
            ),
            (
                &"0,".repeat(MAX_ENV_LEN),
                EnvRule::TooLong {
                    max: MAX_ENV_LEN as u64,
                },
            ),
        ] {
            let (got, message) = refusal(parse_devices(value));
            assert_eq!(got, rule, "{value:?}: {message}");
            assert!(message.len() < 300, "{message}");
        }
    }

    #[test]
    fn depths_past_the_maximum_are_refused_by_rule() {
        assert_eq!(parse_depth("0").unwrap(), 0);
        assert_eq!(parse_depth(&MAX_DEPTH.to_string()).unwrap(), MAX_DEPTH);
        let large = EnvRule::TooLarge {
            max: MAX_DEPTH as u64,
        };
        assert_eq!(MAX_DEPTH, 128, "the cases below are written for 128");
        for (value, rule) in [
            ("129", large),
            ("300", large),
            ("18446744073709551615", large),
            ("-1", EnvRule::TooSmall),
            ("two", EnvRule::Syntax),
            (
                &"9".repeat(1 << 20),
                EnvRule::TooLong {
                    max: MAX_ENV_LEN as u64,
                },
            ),
        ] {
            let (got, message) = refusal(parse_depth(value));
            assert_eq!(got, rule, "{value:?}: {message}");
            assert!(message.len() < 300, "{message}");
        }
    }
}
