//! Timeouts: the default a child's join and an `#[ipc_test]` use, from `VMM_CHILD_TIMEOUT`.

use std::time::Duration;

use crate::{Error, Result};

/// The variable that sets the [default timeout](default_timeout), in seconds.
pub const TIMEOUT_VAR: &str = "VMM_CHILD_TIMEOUT";

/// The timeout when [`TIMEOUT_VAR`] is not set (or, for [`default_timeout`], is invalid).
pub const FALLBACK_TIMEOUT: Duration = Duration::from_secs(60);

/// Parse a timeout in seconds, as [`TIMEOUT_VAR`] gives it: a positive decimal number
/// (`30`, `0.5`, `1e3`). A number too large for a [`Duration`] (`1e30`, `inf`) saturates to
/// `Duration::MAX`, which every wait in vmm-core treats as "forever". Zero, a negative number,
/// NaN or anything that is not a number is [`Error::InvalidEnv`], naming the rule.
pub fn parse_timeout(value: &str) -> Result<Duration> {
    let refuse = |why: &str| {
        Err(Error::InvalidEnv {
            variable: TIMEOUT_VAR.into(),
            message: format!(
                "{TIMEOUT_VAR}={value:?}: {why}; give a positive number of seconds (such as 30, \
                 0.5 or inf)"
            ),
        })
    };
    let Ok(secs) = value.trim().parse::<f64>() else {
        return refuse("not a number of seconds");
    };
    if secs.is_nan() {
        return refuse("not a number of seconds (NaN)");
    }
    if secs <= 0.0 {
        return refuse("a timeout must be positive");
    }
    // Finite and too large, or infinite: forever.
    Ok(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// The default child timeout from the environment: [`TIMEOUT_VAR`] parsed by
/// [`parse_timeout`] if it is set, else [`FALLBACK_TIMEOUT`] (60 s). An invalid value is
/// [`Error::InvalidEnv`]; `#[ipc_test]` fails a test with it rather than guess.
pub fn try_default_timeout() -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Ok(value) => parse_timeout(&value),
        Err(std::env::VarError::NotPresent) => Ok(FALLBACK_TIMEOUT),
        Err(std::env::VarError::NotUnicode(value)) => Err(Error::InvalidEnv {
            variable: TIMEOUT_VAR.into(),
            message: format!("{TIMEOUT_VAR}={value:?}: not a number of seconds (not even UTF-8)"),
        }),
    }
}

/// The default child timeout: [`try_default_timeout`], or for an invalid `VMM_CHILD_TIMEOUT`
/// 60 s, after one line on stderr that says so (`vmm-ipc: ignoring VMM_CHILD_TIMEOUT=...`).
/// `inf` and values too large for a [`Duration`] mean `Duration::MAX`: forever.
pub fn default_timeout() -> Duration {
    try_default_timeout().unwrap_or_else(|error| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            let why = match &error {
                Error::InvalidEnv { message, .. } => message.clone(),
                other => other.to_string(),
            };
            eprintln!(
                "vmm-ipc: ignoring {why}; using {} s",
                FALLBACK_TIMEOUT.as_secs()
            )
        });
        FALLBACK_TIMEOUT
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(value: &str) -> String {
        match parse_timeout(value) {
            Err(Error::InvalidEnv { variable, message }) => {
                assert_eq!(variable, TIMEOUT_VAR);
                message
            }
            other => panic!("{value:?}: expected InvalidEnv, got {other:?}"),
        }
    }

    #[test]
    fn ordinary_timeouts_parse_as_seconds() {
        assert_eq!(parse_timeout("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_timeout(" 0.5 ").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_timeout("1e3").unwrap(), Duration::from_secs(1000));
    }

    #[test]
    fn huge_and_infinite_timeouts_saturate_to_forever() {
        for value in [
            "1e30",
            "18446744073709551616", // 2^64
            "1.8446744073709552e19",
            "1e308",
            "inf",
            "+inf",
            "infinity",
            "Infinity",
        ] {
            assert_eq!(parse_timeout(value).unwrap(), Duration::MAX, "{value}");
        }
        // Large but representable: kept as it is.
        assert_eq!(
            parse_timeout("1e9").unwrap(),
            Duration::from_secs(1_000_000_000)
        );
    }

    #[test]
    fn timeouts_that_make_no_sense_are_refused_naming_the_rule() {
        for (value, rule) in [
            ("2^64", "not a number of seconds"),
            ("abc", "not a number of seconds"),
            ("", "not a number of seconds"),
            ("30s", "not a number of seconds"),
            ("NaN", "NaN"),
            ("-1", "must be positive"),
            ("-inf", "must be positive"),
            ("0", "must be positive"),
            ("-0", "must be positive"),
        ] {
            let message = refusal(value);
            assert!(message.contains(rule), "{value:?}: {message}");
            assert!(
                message.contains(&format!("{TIMEOUT_VAR}={value:?}")),
                "{value:?}: {message}"
            );
        }
    }
}
