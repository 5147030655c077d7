//! What every numeric environment setting shares: the longest value read, how a refused value
//! is shown, and the parse of an unsigned number against a maximum, each refusal an
//! [`EnvRule`].

use super::EnvRule;

/// The longest value of a vmm-core environment variable that is parsed at all, in bytes:
/// every valid value is far shorter (64 device ordinals with spaces fit), and a longer one is
/// refused as [`EnvRule::TooLong`] before any work is done on it.
pub const MAX_ENV_LEN: usize = 1024;

/// How many characters of a refused value an error message shows: enough to recognise it,
/// never a megabyte of it.
const SHOWN: usize = 40;

/// `value` as an error message shows it: quoted, and if long, its start and its length.
pub(crate) fn shown_env_value(value: &str) -> String {
    if value.chars().count() <= SHOWN {
        return format!("{value:?}");
    }
    let start: String = value.chars().take(SHOWN).collect();
    format!("{start:?}... ({} bytes)", value.len())
}

/// `value` (surrounding whitespace ignored) as an unsigned decimal number of at most `max`:
/// [`EnvRule::TooLong`] past [`MAX_ENV_LEN`] bytes, [`EnvRule::TooSmall`] for a negative
/// number, [`EnvRule::TooLarge`] above `max` (a number too large for `u64` included),
/// [`EnvRule::Syntax`] for anything else that is not digits.
pub(crate) fn parse_env_uint(value: &str, max: u64) -> Result<u64, EnvRule> {
    if value.len() > MAX_ENV_LEN {
        return Err(EnvRule::TooLong {
            max: MAX_ENV_LEN as u64,
        });
    }
    let trimmed = value.trim();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(magnitude) = trimmed.strip_prefix('-') {
        return match (digits(magnitude), magnitude.bytes().all(|b| b == b'0')) {
            (false, _) => Err(EnvRule::Syntax),
            // "-0" is zero.
            (true, true) => check_max(0, max),
            (true, false) => Err(EnvRule::TooSmall),
        };
    }
    let unsigned = trimmed.strip_prefix('+').unwrap_or(trimmed);
    if !digits(unsigned) {
        return Err(EnvRule::Syntax);
    }
    // Digits only: the one way to fail is overflow, which is above any maximum.
    let n = unsigned
        .parse::<u64>()
        .map_err(|_| EnvRule::TooLarge { max })?;
    check_max(n, max)
}

fn check_max(n: u64, max: u64) -> Result<u64, EnvRule> {
    if n > max {
        Err(EnvRule::TooLarge { max })
    } else {
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_parse_up_to_the_maximum() {
        assert_eq!(parse_env_uint("0", 64), Ok(0));
        assert_eq!(parse_env_uint(" 64 ", 64), Ok(64));
        assert_eq!(parse_env_uint("+7", 64), Ok(7));
        assert_eq!(parse_env_uint("-0", 64), Ok(0));
        assert_eq!(parse_env_uint("0064", 64), Ok(64));
    }

    #[test]
    fn each_way_of_being_wrong_has_its_rule() {
        let large = EnvRule::TooLarge { max: 64 };
        for (value, rule) in [
            ("65", large),
            ("300", large),
            ("18446744073709551615", large),
            ("18446744073709551616", large),
            ("99999999999999999999999999999", large),
            ("-1", EnvRule::TooSmall),
            ("-18446744073709551616", EnvRule::TooSmall),
            ("", EnvRule::Syntax),
            ("-", EnvRule::Syntax),
            ("two", EnvRule::Syntax),
            ("1.5", EnvRule::Syntax),
            ("1e3", EnvRule::Syntax),
            ("0x10", EnvRule::Syntax),
            ("１", EnvRule::Syntax),
        ] {
            assert_eq!(parse_env_uint(value, 64), Err(rule), "{value:?}");
        }
        let huge = "1".repeat(MAX_ENV_LEN + 1);
        assert_eq!(
            parse_env_uint(&huge, 64),
            Err(EnvRule::TooLong {
                max: MAX_ENV_LEN as u64
            })
        );
    }

    #[test]
    fn a_long_value_is_shown_by_its_start_and_length() {
        assert_eq!(shown_env_value("300"), "\"300\"");
        let shown = shown_env_value(&"9".repeat(1 << 20));
        assert!(shown.len() < 80, "{shown}");
        assert!(shown.ends_with("... (1048576 bytes)"), "{shown}");
    }
}
