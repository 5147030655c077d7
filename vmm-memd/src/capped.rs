//! Decoding a metadata list without trusting its announced length: postcard hands serde the
//! count a peer wrote (when it is at most the bytes left), and serde's `Vec` reserves that many
//! elements at once, up to 1 MiB: a `PutMeta` of 8 KiB announcing 8,000 entries of 72 bytes
//! reserved 590 KB before its first entry failed to decode. [`metadata_list`] reserves at most
//! [`PREALLOC`] entries and grows as entries actually decode (each takes at least 6 bytes
//! of input: an empty key, five one-byte fields, an empty shape), so the heap stays within a
//! small multiple of the input.

use std::fmt;

use serde::Deserializer;
use serde::de::{Error, SeqAccess, Visitor};

use crate::protocol::{MAX_META_ENTRIES, TensorMeta};

/// The most entries reserved before any has decoded.
pub(crate) const PREALLOC: usize = 16;

/// A metadata list (`Request::PutMeta`, `Response::MetaPage`): at most [`MAX_META_ENTRIES`]
/// entries, room reserved for at most [`PREALLOC`] before they decode.
pub(crate) fn metadata_list<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<(String, TensorMeta)>, D::Error> {
    deserializer.deserialize_seq(MetadataList)
}

struct MetadataList;

impl<'de> Visitor<'de> for MetadataList {
    type Value = Vec<(String, TensorMeta)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at most {MAX_META_ENTRIES} metadata entries")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let announced = seq.size_hint().unwrap_or(0);
        if announced > MAX_META_ENTRIES {
            return Err(A::Error::invalid_length(announced, &self));
        }
        let mut entries = Vec::with_capacity(announced.min(PREALLOC));
        while let Some(entry) = seq.next_element()? {
            if entries.len() == MAX_META_ENTRIES {
                return Err(A::Error::invalid_length(entries.len() + 1, &self));
            }
            entries.push(entry);
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Dtype, Request, decode_request};

    /// The fewest bytes one entry takes on the wire: what bounds the entries, and so the
    /// heap, per input byte (`tests/fuzz_requests.rs` relies on it).
    const MIN_ENTRY_BYTES: usize = 6;

    #[test]
    fn the_smallest_entry_takes_min_entry_bytes() {
        let meta = TensorMeta {
            chunk: 0,
            offset: 0,
            len: 0,
            dtype: Dtype::U8,
            shape: vec![],
        };
        let entry = postcard::to_allocvec(&(String::new(), meta)).unwrap();
        assert_eq!(entry.len(), MIN_ENTRY_BYTES);
    }

    #[test]
    fn lists_decode_as_serde_decodes_them() {
        let meta = |i| TensorMeta {
            chunk: i,
            offset: 1,
            len: 2,
            dtype: Dtype::F32,
            shape: vec![3, 4],
        };
        for n in [0, 1, PREALLOC, PREALLOC + 1, 200] {
            let entries: Vec<_> = (0..n as u32).map(|i| (format!("k{i}"), meta(i))).collect();
            let request = Request::PutMeta(entries);
            let bytes = postcard::to_allocvec(&request).unwrap();
            assert_eq!(decode_request(&bytes), Ok(request));
        }
    }
}
