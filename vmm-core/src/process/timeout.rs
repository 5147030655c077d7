//! Timeouts: the default a child's join and an `#[ipc_test]` use, from `VMM_CHILD_TIMEOUT`.

use std::time::Duration;

use crate::error::{EnvRule, MAX_ENV_LEN, shown_env_value};
use crate::{Error, Result};

/// The variable that sets the [default timeout](default_timeout), in seconds.
pub const TIMEOUT_VAR: &str = "VMM_CHILD_TIMEOUT";

/// The timeout when [`TIMEOUT_VAR`] is not set (or, for [`default_timeout`], is invalid).
pub const FALLBACK_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest finite timeout [`TIMEOUT_VAR`] gives: a year (31 536 000 s). A join or a test
/// that should wait longer than that should never time out, so a larger number means no
/// timeout (`Duration::MAX`, which every wait in vmm-core treats as "forever"), as `inf` does;
/// [`try_default_timeout`] says so in one line on stderr, since such a number is as likely a
/// slip (milliseconds for seconds) as a wish. Nothing is refused for being large: a timeout
/// bounds no resource.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Parse a timeout in seconds, as [`TIMEOUT_VAR`] gives it: a positive decimal number
/// (`30`, `0.5`, `1e3`) up to [`MAX_TIMEOUT`]; `inf`, or a larger number, is `Duration::MAX`
/// (no timeout). Zero or a negative number is [`Error::InvalidEnv`] with
/// [`EnvRule::TooSmall`]; NaN or anything that is not a number with [`EnvRule::Syntax`]; a
/// value longer than [`MAX_ENV_LEN`] bytes with
/// [`EnvRule::TooLong`].
pub fn parse_timeout(value: &str) -> Result<Duration> {
    parse(value).map(|parsed| parsed.duration)
}

/// A parsed timeout, and whether it was a finite number above [`MAX_TIMEOUT`] taken as none.
struct Parsed {
    duration: Duration,
    above_max: bool,
}

fn parse(value: &str) -> Result<Parsed> {
    let refuse = |rule: EnvRule, why: &str| {
        Err(Error::env(
            TIMEOUT_VAR,
            value,
            rule,
            why,
            "give a positive number of seconds (such as 30, 0.5 or inf)",
        ))
    };
    if value.len() > MAX_ENV_LEN {
        let why = format!("longer than {MAX_ENV_LEN} bytes");
        let rule = EnvRule::TooLong {
            max: MAX_ENV_LEN as u64,
        };
        return refuse(rule, &why);
    }
    let Ok(secs) = value.trim().parse::<f64>() else {
        return refuse(EnvRule::Syntax, "not a number of seconds");
    };
    if secs.is_nan() {
        return refuse(EnvRule::Syntax, "not a number of seconds (NaN)");
    }
    if secs <= 0.0 {
        return refuse(EnvRule::TooSmall, "a timeout must be positive");
    }
    let duration = Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX);
    if duration <= MAX_TIMEOUT {
        return Ok(Parsed {
            duration,
            above_max: false,
        });
    }
    // `inf` says "no timeout" plainly; a number this large (even one too long for an f64,
    // which parses as infinite) is taken to mean it.
    let unsigned = value.trim().trim_start_matches('+').to_ascii_lowercase();
    Ok(Parsed {
        duration: Duration::MAX,
        above_max: !matches!(unsigned.as_str(), "inf" | "infinity"),
    })
}

/// The default child timeout from the environment: [`TIMEOUT_VAR`] parsed by
/// [`parse_timeout`] if it is set, else [`FALLBACK_TIMEOUT`] (60 s). An invalid value is
/// [`Error::InvalidEnv`]; `#[ipc_test]` fails a test with it rather than guess. A finite
/// number above [`MAX_TIMEOUT`] is no timeout, after one line on stderr (once per process).
pub fn try_default_timeout() -> Result<Duration> {
    let value = match std::env::var(TIMEOUT_VAR) {
        Ok(value) => value,
        Err(std::env::VarError::NotPresent) => return Ok(FALLBACK_TIMEOUT),
        Err(std::env::VarError::NotUnicode(value)) => {
            return Err(Error::env(
                TIMEOUT_VAR,
                &value.to_string_lossy(),
                EnvRule::Syntax,
                "not a number of seconds (not even UTF-8)",
                "give a positive number of seconds (such as 30, 0.5 or inf)",
            ));
        }
    };
    let parsed = parse(&value)?;
    if parsed.above_max {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "vmm-ipc: {TIMEOUT_VAR}={}: above the longest finite timeout ({} s): no \
                 timeout (write inf to say so)",
                shown_env_value(&value),
                MAX_TIMEOUT.as_secs()
            )
        });
    }
    Ok(parsed.duration)
}

/// The default child timeout: [`try_default_timeout`], or for an invalid `VMM_CHILD_TIMEOUT`
/// 60 s, after one line on stderr that says so (`vmm-ipc: ignoring VMM_CHILD_TIMEOUT=...`).
/// `inf` and values above [`MAX_TIMEOUT`] mean `Duration::MAX`: forever.
pub fn default_timeout() -> Duration {
    try_default_timeout().unwrap_or_else(|error| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "vmm-ipc: ignoring {error}; using {} s",
                FALLBACK_TIMEOUT.as_secs()
            )
        });
        FALLBACK_TIMEOUT
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(value: &str) -> (EnvRule, String) {
        match parse_timeout(value) {
            Err(Error::InvalidEnv {
                variable,
                rule,
                message,
            }) => {
                assert_eq!(variable, TIMEOUT_VAR);
                (rule, message)
            }
            other => panic!("{value:?}: expected InvalidEnv, got {other:?}"),
        }
    }

    fn above_max(value: &str) -> bool {
        parse(value).unwrap().above_max
    }

    #[test]
    fn ordinary_timeouts_parse_as_seconds() {
        assert_eq!(parse_timeout("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_timeout(" 0.5 ").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_timeout("1e3").unwrap(), Duration::from_secs(1000));
        // The maximum itself is kept as it is.
        let max = MAX_TIMEOUT.as_secs().to_string();
        assert_eq!(parse_timeout(&max).unwrap(), MAX_TIMEOUT);
        assert!(!above_max(&max));
    }

    #[test]
    fn infinite_timeouts_are_forever_and_larger_numbers_too_with_a_warning() {
        for value in ["inf", "+inf", "infinity", "Infinity"] {
            assert_eq!(parse_timeout(value).unwrap(), Duration::MAX, "{value}");
            assert!(!above_max(value), "{value}: inf is no slip");
        }
        for value in [
            "31536001", // the maximum + 1 s
            "1e9",
            "1e30",
            "18446744073709551615", // u64::MAX
            "18446744073709551616", // 2^64
            "1e308",
            &"9".repeat(MAX_ENV_LEN),
        ] {
            assert_eq!(parse_timeout(value).unwrap(), Duration::MAX);
            assert!(above_max(value), "{}", shown_env_value(value));
        }
    }

    #[test]
    fn timeouts_that_make_no_sense_are_refused_by_rule() {
        for (value, rule) in [
            ("2^64", EnvRule::Syntax),
            ("abc", EnvRule::Syntax),
            ("", EnvRule::Syntax),
            ("30s", EnvRule::Syntax),
            ("NaN", EnvRule::Syntax),
            ("-1", EnvRule::TooSmall),
            ("-18446744073709551615", EnvRule::TooSmall),
            ("-inf", EnvRule::TooSmall),
            ("0", EnvRule::TooSmall),
            ("-0", EnvRule::TooSmall),
            (
                &"9".repeat(MAX_ENV_LEN + 1),
                EnvRule::TooLong {
                    max: MAX_ENV_LEN as u64,
                },
            ),
        ] {
            let (got, message) = refusal(value);
            assert_eq!(got, rule, "{value:?}: {message}");
            assert!(message.starts_with(&format!("{TIMEOUT_VAR}=")), "{message}");
            assert!(message.len() < 300, "{message}");
        }
    }
}
