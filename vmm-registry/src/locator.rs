//! What a registry entry says: where an export can be fetched and what it is, never the
//! handle bytes (those travel only over the mutual-TLS descriptor stream, after the exporter
//! has checked the importer's name).
//!
//! A value read from etcd is hostile until checked: its length is capped before it is parsed,
//! unknown fields are refused, and its owner must be the owner its key names.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::error::{NameRule, ValueError};
use crate::keys::{check_name, split_key};

/// The largest value the registry writes or reads, in bytes.
pub const MAX_LOCATOR_BYTES: usize = 4096;

/// What the exported object is, on the exporter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ExportedObject {
    /// A vmm-memd region (its name).
    Region(String),
    /// A buffer, by the exporter's own id.
    Buffer(u64),
}

/// How the memory is shared, which says what an importer needs to map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandleKind {
    /// A CUDA POSIX file descriptor (one host only).
    PosixFd,
    /// A CUDA fabric handle (across the hosts of an NVLink domain, with IMEX).
    Fabric,
    /// Host shared memory (memfd).
    HostMemfd,
}

/// Where and what an export is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Locator {
    /// The owner (the key's owner segment, and the name the exporter's certificate is
    /// checked against by an importer).
    pub owner: String,
    /// Where the exporter's mutual-TLS descriptor stream listens.
    pub exporter_addr: SocketAddr,
    /// The name the exporter's certificate carries (an importer admits only it).
    pub exporter_name: String,
    /// The region or buffer.
    pub object: ExportedObject,
    /// Its size in bytes.
    pub size: u64,
    /// The device's UUID (`GPU-…`), none for host memory.
    pub device_uuid: Option<String>,
    /// The handle type.
    pub handle: HandleKind,
    /// Which generation of the object this is.
    pub generation: u64,
}

impl Locator {
    /// The locator as stored: JSON, at most [`MAX_LOCATOR_BYTES`].
    pub(crate) fn encode(&self) -> Result<Vec<u8>, crate::RegistryError> {
        let bytes = serde_json::to_vec(self).map_err(crate::RegistryError::Encode)?;
        if bytes.len() > MAX_LOCATOR_BYTES {
            return Err(crate::RegistryError::LocatorTooLarge {
                len: bytes.len(),
                max: MAX_LOCATOR_BYTES,
            });
        }
        Ok(bytes)
    }

    /// Check the fields a peer could abuse: the names follow the key rule.
    fn check_fields(&self) -> Result<(), ValueError> {
        let field =
            |field, r: Result<(), NameRule>| r.map_err(|rule| ValueError::Field { field, rule });
        field("owner", check_name(&self.owner))?;
        if self.exporter_name.is_empty() || self.exporter_name.len() > 253 {
            return Err(ValueError::Field {
                field: "exporter_name",
                rule: NameRule::TooLong,
            });
        }
        if let ExportedObject::Region(name) = &self.object {
            field("object", check_name(name))?;
        }
        if self
            .device_uuid
            .as_ref()
            .is_some_and(|uuid| uuid.len() > 64)
        {
            return Err(ValueError::Field {
                field: "device_uuid",
                rule: NameRule::TooLong,
            });
        }
        Ok(())
    }
}

/// One locator found in etcd, checked against its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The owner (the key's, equal to the locator's).
    pub owner: String,
    /// The export's name.
    pub name: String,
    /// The locator.
    pub locator: Locator,
    /// The revision that wrote it.
    pub revision: i64,
}

/// Check a key and value read under `domain`: the key's layout, the value's size before
/// parsing it, its form, and that its owner is the key's.
pub(crate) fn decode(
    domain: &str,
    key: &[u8],
    value: &[u8],
    revision: i64,
) -> Result<Entry, ValueError> {
    let (owner, name) = split_key(domain, key).ok_or(ValueError::Key)?;
    if value.len() > MAX_LOCATOR_BYTES {
        return Err(ValueError::TooLarge {
            len: value.len(),
            max: MAX_LOCATOR_BYTES,
        });
    }
    let locator: Locator = serde_json::from_slice(value).map_err(ValueError::Malformed)?;
    locator.check_fields()?;
    if locator.owner != owner {
        return Err(ValueError::OwnerMismatch {
            in_key: owner.to_owned(),
            in_value: locator.owner,
        });
    }
    Ok(Entry {
        owner: owner.to_owned(),
        name: name.to_owned(),
        locator,
        revision,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locator(owner: &str) -> Locator {
        Locator {
            owner: owner.into(),
            exporter_addr: "127.0.0.1:7000".parse().unwrap(),
            exporter_name: "alice.vmm.test".into(),
            object: ExportedObject::Region("kv".into()),
            size: 1 << 21,
            device_uuid: None,
            handle: HandleKind::HostMemfd,
            generation: 3,
        }
    }

    #[test]
    fn round_trip() {
        let bytes = locator("alice").encode().unwrap();
        let entry = decode("d", b"/vmm/v1/d/exports/alice/kv", &bytes, 7).unwrap();
        assert_eq!(entry.locator, locator("alice"));
        assert_eq!(
            (entry.owner.as_str(), entry.name.as_str(), entry.revision),
            ("alice", "kv", 7)
        );
    }

    #[test]
    fn refusals() {
        let bytes = locator("mallory").encode().unwrap();
        let key = b"/vmm/v1/d/exports/alice/kv";
        assert!(matches!(
            decode("d", key, &bytes, 1),
            Err(ValueError::OwnerMismatch { .. })
        ));
        assert!(matches!(
            decode("d", key, b"{", 1),
            Err(ValueError::Malformed(_))
        ));
        let big = vec![b' '; MAX_LOCATOR_BYTES + 1];
        assert!(matches!(
            decode("d", key, &big, 1),
            Err(ValueError::TooLarge { .. })
        ));
        assert!(matches!(
            decode("d", b"/vmm/v1/d/x", &bytes, 1),
            Err(ValueError::Key)
        ));
        let mut extra: serde_json::Value =
            serde_json::from_slice(&locator("alice").encode().unwrap()).unwrap();
        extra["handle_bytes"] = serde_json::json!("00ff");
        let extra = serde_json::to_vec(&extra).unwrap();
        assert!(matches!(
            decode("d", key, &extra, 1),
            Err(ValueError::Malformed(_))
        ));
    }
}
