//! A region's metadata as the publisher offers it with the descriptor, and as an importer
//! reads it back: the tensors' names and where each lies (`vmm_memd::protocol::TensorMeta`).
//!
//! The form, stable: JSON, an array of `[key, tensor]` pairs in strictly ascending byte order
//! of the keys (so no key twice), each tensor an object of exactly `chunk`, `offset`, `len`,
//! `dtype` (vmm-memd's `Dtype` name: `"BF16"`, `"F32"`, ...) and `shape`:
//!
//! ```text
//! [["layer0.bias",{"chunk":0,"offset":4096,"len":512,"dtype":"F32","shape":[128]}],
//!  ["layer0.weight",{"chunk":0,"offset":0,"len":4096,"dtype":"BF16","shape":[32,64]}]]
//! ```
//!
//! JSON rather than postcard: an engine in another language reads it without vmm-memd's
//! types, and a hostile count cannot make the decoder reserve room ahead of the entries.
//! [`region_metadata`] trusts none of it: every entry is checked as vmm-memd checks a
//! `PutMeta` (a key of 1 to `MAX_KEY_LEN` bytes, at most `MAX_META_ENTRIES` entries, a tensor
//! inside its chunk), against the chunk sizes of the descriptor that was fetched with it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use vmm_memd::protocol::{Dtype, MAX_KEY_LEN, MAX_META_ENTRIES, TensorMeta};

use crate::fetch::Fetched;

/// One tensor as the form carries it (vmm-memd's `TensorMeta`, unknown fields refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tensor {
    chunk: u32,
    offset: u64,
    len: u64,
    dtype: Dtype,
    shape: Vec<u64>,
}

/// Why a fetched region's metadata was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionMetadataError {
    /// The exporter offered no metadata (not a vmm-memd publisher, or one of before it
    /// offered metadata).
    #[error("the exporter offered no metadata")]
    Missing,
    /// Not the documented form.
    #[error("the metadata is not the documented form")]
    Form(#[source] serde_json::Error),
    /// More entries than a generation holds.
    #[error("{entries} metadata entries, over {max}")]
    TooMany {
        /// How many.
        entries: usize,
        /// The most a generation holds (`MAX_META_ENTRIES`).
        max: usize,
    },
    /// A key empty or longer than `MAX_KEY_LEN` bytes (the entry's place).
    #[error("metadata entry {index}: a key of {len} bytes")]
    Key {
        /// The entry's place.
        index: usize,
        /// The key's length.
        len: usize,
    },
    /// A key not after the one before it (out of order, or twice).
    #[error("metadata key {key:?} is not after the one before it")]
    Order {
        /// The key.
        key: String,
    },
    /// A tensor in a chunk the region does not have.
    #[error("tensor {key:?}: no chunk {chunk} (the region has {chunks})")]
    NoSuchChunk {
        /// The key.
        key: String,
        /// The chunk it names.
        chunk: u32,
        /// The chunks the descriptor has.
        chunks: usize,
    },
    /// A tensor that passes the end of its chunk.
    #[error("tensor {key:?}: {len} bytes at {offset} pass the end of its chunk ({chunk_size})")]
    OutsideChunk {
        /// The key.
        key: String,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The chunk's size, as the descriptor announces it.
        chunk_size: u64,
    },
}

/// `meta` in the documented form (what the publisher offers with a region's descriptor).
pub(crate) fn encode(meta: &BTreeMap<String, TensorMeta>) -> Vec<u8> {
    let entries: Vec<(&str, Tensor)> = meta
        .iter()
        .map(|(key, m)| {
            let tensor = Tensor {
                chunk: m.chunk,
                offset: m.offset,
                len: m.len,
                dtype: m.dtype,
                shape: m.shape.clone(),
            };
            (key.as_str(), tensor)
        })
        .collect();
    // Strings, numbers and unit variants: serde_json cannot fail on them.
    serde_json::to_vec(&entries).unwrap_or_default()
}

/// The tensors of a fetched vmm-memd region, each checked against the chunks of the
/// descriptor fetched with them. Read a tensor at its chunk's start plus `offset`.
pub fn region_metadata(
    fetched: &Fetched,
) -> Result<BTreeMap<String, TensorMeta>, RegionMetadataError> {
    let chunk_sizes: Vec<u64> = fetched
        .descriptor()
        .chunk_sizes()
        .iter()
        .map(|&size| size as u64)
        .collect();
    decode(fetched.metadata(), &chunk_sizes)
}

/// The tensors in `bytes` (the documented form), checked against chunks of `chunk_sizes`.
pub fn decode(
    bytes: &[u8],
    chunk_sizes: &[u64],
) -> Result<BTreeMap<String, TensorMeta>, RegionMetadataError> {
    if bytes.is_empty() {
        return Err(RegionMetadataError::Missing);
    }
    let entries: Vec<(String, Tensor)> =
        serde_json::from_slice(bytes).map_err(RegionMetadataError::Form)?;
    if entries.len() > MAX_META_ENTRIES {
        return Err(RegionMetadataError::TooMany {
            entries: entries.len(),
            max: MAX_META_ENTRIES,
        });
    }
    let mut meta = BTreeMap::new();
    let mut previous: Option<&str> = None;
    for (index, (key, tensor)) in entries.iter().enumerate() {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(RegionMetadataError::Key {
                index,
                len: key.len(),
            });
        }
        if previous.is_some_and(|before| before >= key.as_str()) {
            return Err(RegionMetadataError::Order { key: key.clone() });
        }
        previous = Some(key);
        check_inside(key, tensor, chunk_sizes)?;
        let m = TensorMeta {
            chunk: tensor.chunk,
            offset: tensor.offset,
            len: tensor.len,
            dtype: tensor.dtype,
            shape: tensor.shape.clone(),
        };
        meta.insert(key.clone(), m);
    }
    Ok(meta)
}

/// The tensor lies inside its chunk, as vmm-memd checks it.
fn check_inside(
    key: &str,
    tensor: &Tensor,
    chunk_sizes: &[u64],
) -> Result<(), RegionMetadataError> {
    let chunk_size = *chunk_sizes.get(tensor.chunk as usize).ok_or_else(|| {
        RegionMetadataError::NoSuchChunk {
            key: key.to_owned(),
            chunk: tensor.chunk,
            chunks: chunk_sizes.len(),
        }
    })?;
    if tensor
        .offset
        .checked_add(tensor.len)
        .is_none_or(|end| end > chunk_size)
    {
        return Err(RegionMetadataError::OutsideChunk {
            key: key.to_owned(),
            offset: tensor.offset,
            len: tensor.len,
            chunk_size,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(chunk: u32, offset: u64, len: u64) -> TensorMeta {
        TensorMeta {
            chunk,
            offset,
            len,
            dtype: Dtype::BF16,
            shape: vec![len / 2],
        }
    }

    #[test]
    fn the_form_round_trips_in_key_order() {
        let meta = BTreeMap::from([
            ("b".to_owned(), tensor(1, 0, 8)),
            ("a".to_owned(), tensor(0, 4088, 8)),
        ]);
        let bytes = encode(&meta);
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"[["a",{"chunk":0,"offset":4088,"len":8,"dtype":"BF16","shape":[4]}],["b",{"chunk":1,"offset":0,"len":8,"dtype":"BF16","shape":[4]}]]"#
        );
        assert_eq!(decode(&bytes, &[4096, 8]).unwrap(), meta);
    }

    #[test]
    fn hostile_entries_are_refused() {
        let one = |key: &str, t: TensorMeta| encode(&BTreeMap::from([(key.to_owned(), t)]));
        let refuse = |bytes: &[u8]| decode(bytes, &[4096]).expect_err("refused");
        assert!(matches!(refuse(b""), RegionMetadataError::Missing));
        assert!(matches!(
            refuse(&one("t", tensor(1, 0, 8))),
            RegionMetadataError::NoSuchChunk {
                chunk: 1,
                chunks: 1,
                ..
            }
        ));
        assert!(matches!(
            refuse(&one("t", tensor(0, 4090, 8))),
            RegionMetadataError::OutsideChunk {
                chunk_size: 4096,
                ..
            }
        ));
        assert!(matches!(
            refuse(&one("t", tensor(0, u64::MAX, 2))),
            RegionMetadataError::OutsideChunk { .. }
        ));
        assert!(matches!(
            refuse(&one(&"k".repeat(MAX_KEY_LEN + 1), tensor(0, 0, 8))),
            RegionMetadataError::Key { index: 0, .. }
        ));
        assert!(matches!(
            refuse(&one("", tensor(0, 0, 8))),
            RegionMetadataError::Key { len: 0, .. }
        ));
        let t = r#"{"chunk":0,"offset":0,"len":8,"dtype":"U8","shape":[8]}"#;
        assert!(matches!(
            refuse(format!(r#"[["b",{t}],["a",{t}]]"#).as_bytes()),
            RegionMetadataError::Order { .. }
        ));
        assert!(matches!(
            refuse(format!(r#"[["a",{t}],["a",{t}]]"#).as_bytes()),
            RegionMetadataError::Order { .. }
        ));
        assert!(matches!(
            refuse(br#"[["a",{"chunk":0,"offset":0,"len":8,"dtype":"U8","shape":[8],"x":1}]]"#),
            RegionMetadataError::Form(_)
        ));
        assert!(matches!(
            refuse(br#"{"a":{"chunk":0}}"#),
            RegionMetadataError::Form(_)
        ));
    }
}
