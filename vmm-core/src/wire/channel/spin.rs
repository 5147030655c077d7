//! How long a receive keeps trying before it sleeps: [`SPIN_VAR`], its default and its
//! maximum.
//!
//! The window is read deep inside every receive, where nothing can be refused, so a value
//! this process cannot use is never an error: one past [`MAX_SPIN_US`] is clamped to it, and
//! one that is not a number of microseconds is ignored (the default is used), each with one
//! line on stderr, once per process.

use std::time::Duration;

use crate::Error;
use crate::error::{EnvRule, parse_env_uint};

/// The environment variable that sets how long a receive keeps trying before it sleeps, in
/// microseconds (`0` turns it off; at most [`MAX_SPIN_US`]). Read once per process.
pub const SPIN_VAR: &str = "VMM_IPC_SPIN_US";

/// The longest spin [`SPIN_VAR`] may set, in microseconds (10 ms): spinning only pays while a
/// reply is a few system calls away, and a thread that spins longer burns a core for nothing
/// (every waiter of a pool spins too). A larger value is clamped to it, with a warning.
pub const MAX_SPIN_US: u64 = 10_000;

/// The window when [`SPIN_VAR`] is not set (or unusable): 20 us on a machine with more than
/// one CPU, else zero (on one CPU the sender cannot run while we spin).
fn default_micros() -> u64 {
    if cpus_allowed() > 1 { 20 } else { 0 }
}

/// How many CPUs this process may run on (its affinity mask; 1 if it cannot be read). Not
/// `std::thread::available_parallelism`, which also reads cgroup files: 21-27 us against
/// 0.3 us for the mask alone, paid by every child on its first receive.
fn cpus_allowed() -> usize {
    nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_or(1, |set| {
        (0..nix::sched::CpuSet::count())
            .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
            .count()
    })
}

/// [`SPIN_VAR`], read once: the window, after the one warning line a value that had to be
/// clamped or ignored gives. The pool's waiters spin for the same window.
pub(crate) fn spin_window() -> Duration {
    static WINDOW: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| {
        let value = std::env::var_os(SPIN_VAR).map(|v| v.to_string_lossy().into_owned());
        let (micros, warning) = window_micros(value.as_deref(), default_micros());
        if let Some(warning) = warning {
            eprintln!("vmm-ipc: {warning}");
        }
        Duration::from_micros(micros)
    })
}

/// The window in microseconds for [`SPIN_VAR`]'s `value` (`None`: unset), and the refusal to
/// warn of where the value was clamped ([`EnvRule::TooLarge`]: to [`MAX_SPIN_US`]) or ignored
/// (any other rule: `default`).
fn window_micros(value: Option<&str>, default: u64) -> (u64, Option<Error>) {
    let Some(value) = value else {
        return (default, None);
    };
    match parse_env_uint(value, MAX_SPIN_US) {
        Ok(micros) => (micros, None),
        Err(rule) => {
            let (micros, why) = match rule {
                EnvRule::TooLarge { max } => (
                    max,
                    format!("more than the maximum of {max} us; clamped to {max} us"),
                ),
                _ => (
                    default,
                    format!("not a number of microseconds; using the default, {default} us"),
                ),
            };
            let expected = format!("give 0 (off) to {MAX_SPIN_US} microseconds");
            let refusal = Error::env(SPIN_VAR, value, rule, why, &expected);
            (micros, Some(refusal))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_of(warning: Option<Error>) -> Option<EnvRule> {
        warning.map(|warning| match warning {
            Error::InvalidEnv { variable, rule, .. } => {
                assert_eq!(variable, SPIN_VAR);
                rule
            }
            other => panic!("expected InvalidEnv, got {other:?}"),
        })
    }

    #[test]
    fn values_up_to_the_maximum_are_kept_without_a_warning() {
        assert_eq!(window_micros(None, 20).0, 20);
        for (value, micros) in [("0", 0), ("20", 20), ("10000", MAX_SPIN_US)] {
            let (got, warning) = window_micros(Some(value), 20);
            assert_eq!((got, rule_of(warning)), (micros, None), "{value}");
        }
    }

    #[test]
    fn larger_values_are_clamped_and_the_rest_ignored_each_with_its_rule() {
        let large = Some(EnvRule::TooLarge { max: MAX_SPIN_US });
        let huge = "9".repeat(1 << 16);
        for (value, micros, rule) in [
            ("10001", MAX_SPIN_US, large),
            ("300000000", MAX_SPIN_US, large),
            ("18446744073709551615", MAX_SPIN_US, large),
            ("18446744073709551616", MAX_SPIN_US, large),
            ("-1", 20, Some(EnvRule::TooSmall)),
            ("20us", 20, Some(EnvRule::Syntax)),
            (
                &huge,
                20,
                Some(EnvRule::TooLong {
                    max: crate::error::MAX_ENV_LEN as u64,
                }),
            ),
        ] {
            let (got, warning) = window_micros(Some(value), 20);
            let message = warning
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default();
            assert!(message.len() < 300, "{message}");
            assert_eq!((got, rule_of(warning)), (micros, rule), "{message}");
        }
    }
}
