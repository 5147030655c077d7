//! The key layout, `/vmm/v1/<domain>/exports/<owner>/<name>`, and the rule every segment
//! follows, so that a key splits back into exactly the names that made it.

use crate::error::NameRule;

/// The longest domain, owner or export name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Check one key segment: 1 to [`MAX_NAME_LEN`] bytes of ASCII letters, digits, `.`, `_`, `-`,
/// not made of dots only (so no segment reads as a path step).
pub fn check_name(name: &str) -> Result<(), NameRule> {
    if name.is_empty() {
        return Err(NameRule::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameRule::TooLong);
    }
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
    if !name.bytes().all(allowed) || name.bytes().all(|b| b == b'.') {
        return Err(NameRule::Character);
    }
    Ok(())
}

/// The prefix under which every locator of `domain` lives: `/vmm/v1/<domain>/exports/`.
pub fn domain_prefix(domain: &str) -> String {
    format!("/vmm/v1/{domain}/exports/")
}

/// The key of `owner`'s export `name` in `domain`.
pub fn export_key(domain: &str, owner: &str, name: &str) -> String {
    format!("{}{owner}/{name}", domain_prefix(domain))
}

/// Split a key found under `domain`'s prefix into its owner and name; `None` when it is not
/// exactly `<prefix><owner>/<name>` with valid segments.
pub fn split_key<'k>(domain: &str, key: &'k [u8]) -> Option<(&'k str, &'k str)> {
    let key = std::str::from_utf8(key).ok()?;
    let rest = key.strip_prefix(domain_prefix(domain).as_str())?;
    let (owner, name) = rest.split_once('/')?;
    check_name(owner).ok()?;
    check_name(name).ok()?;
    Some((owner, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_rule() {
        assert_eq!(check_name("node-1.gpu_0"), Ok(()));
        assert_eq!(check_name(""), Err(NameRule::Empty));
        assert_eq!(check_name(".."), Err(NameRule::Character));
        assert_eq!(check_name("a/b"), Err(NameRule::Character));
        assert_eq!(check_name(&"x".repeat(129)), Err(NameRule::TooLong));
    }

    #[test]
    fn keys_split_back() {
        let key = export_key("d", "alice", "kv0");
        assert_eq!(key, "/vmm/v1/d/exports/alice/kv0");
        assert_eq!(split_key("d", key.as_bytes()), Some(("alice", "kv0")));
        assert_eq!(split_key("d", b"/vmm/v1/d/exports/alice/kv0/x"), None);
        assert_eq!(split_key("e", key.as_bytes()), None);
        assert_eq!(split_key("d", b"/vmm/v1/d/exports/alice"), None);
    }
}
