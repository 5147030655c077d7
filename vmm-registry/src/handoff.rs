//! What importer and exporter say to each other on the mutual-TLS stream, after the handshake
//! (each side has checked the other's certificate name by then):
//!
//! 1. the importer asks for one object at one generation, saying which version of this
//!    exchange it speaks ([`Request`], a `DATA` message);
//! 2. the exporter answers with the descriptor (a `CUDA_FABRIC` message), or with a
//!    [`Refusal`] (`DATA`) when it no longer serves that object at that generation, or with
//!    [`Unsupported`] (`DATA`) when it does not speak the importer's version;
//! 3. from version 2, after the descriptor: the object's metadata, opaque bytes, as a
//!    [`MetadataHeader`] (`DATA`: how many bytes, in how many pages) and then that many
//!    pages (`DATA`, see [`crate::handoff_metadata`]); none announced is `{"bytes":0,"pages":0}`.
//!    The request said how much the importer takes (`max_metadata`): past that the exporter
//!    sends the header alone, and the importer refuses it;
//! 4. the importer says whether it imported ([`Ack`], `DATA`), so the exporter knows when its
//!    memory is in use elsewhere (a fabric handle does not keep the memory alive).
//!
//! Versions: a request without `version` is version 1 (no metadata, step 3 skipped), so an
//! importer of before the metadata is served as it was. A version 1 exporter refuses a
//! version 2 request (an unknown field) and closes the stream without an answer: the
//! importer reports that as [`FetchError::Unanswered`](crate::FetchError::Unanswered), at
//! once, not by a deadline.
//!
//! Every JSON message has unknown fields refused, and is at most [`MAX_HANDOFF_MESSAGE`]
//! bytes, checked before it is parsed: each side treats the other's words as hostile even
//! after the handshake (a certificate proves a name, not good behaviour).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::locator::ExportedObject;

/// The largest hand-off message (request, refusal, acknowledgement), in bytes.
pub const MAX_HANDOFF_MESSAGE: usize = 1024;

/// The version of the hand-off this crate speaks: 2, the descriptor followed by metadata.
pub const HANDOFF_VERSION: u32 = 2;

/// The importer's question: this object, at this generation, in this version of the
/// exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Request {
    pub(crate) object: ExportedObject,
    pub(crate) generation: u64,
    /// Absent in a version 1 request (before metadata).
    #[serde(default = "version_1")]
    pub(crate) version: u32,
    /// The most metadata the importer takes (version 2): an exporter with more announces it
    /// and sends no page of it, so the refusal costs neither side the transfer. The importer
    /// checks the announcement all the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) max_metadata: Option<u64>,
}

fn version_1() -> u32 {
    1
}

/// The exporter's answer to a version it does not speak: the highest it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Unsupported {
    pub(crate) speaks: u32,
}

/// A `DATA` answer to a request: a refusal of the object, or of the version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum Answer {
    Stale(Refusal),
    Unsupported(Unsupported),
}

/// What follows the descriptor from version 2: the metadata's length, and how many pages
/// carry it (each checked against it: see [`crate::handoff_metadata`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MetadataHeader {
    pub(crate) bytes: u64,
    pub(crate) pages: u64,
}

/// The exporter's "no": what it serves of that object now, if anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Refusal {
    pub(crate) serving: Option<u64>,
}

/// The importer's last word: whether the import succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Ack {
    pub(crate) imported: bool,
}

/// Why a hand-off message was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// Over [`MAX_HANDOFF_MESSAGE`]: refused before parsing.
    #[error("{len} bytes, over the cap of {max}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// Not the message expected.
    #[error("not the message expected")]
    Malformed(#[source] serde_json::Error),
}

/// `value` as the bytes of a `DATA` message.
pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Only this module's small, plain structs are encoded: serde_json cannot fail on them.
    serde_json::to_vec(value).unwrap_or_default()
}

/// A message read from the peer: its size first, then its form.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, MessageError> {
    if bytes.len() > MAX_HANDOFF_MESSAGE {
        return Err(MessageError::TooLarge {
            len: bytes.len(),
            max: MAX_HANDOFF_MESSAGE,
        });
    }
    serde_json::from_slice(bytes).map_err(MessageError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let request = Request {
            object: ExportedObject::Region("kv".into()),
            generation: 3,
            version: HANDOFF_VERSION,
            max_metadata: Some(1 << 20),
        };
        assert_eq!(decode::<Request>(&encode(&request)).unwrap(), request);
        assert!(matches!(
            decode::<Request>(&vec![b' '; MAX_HANDOFF_MESSAGE + 1]),
            Err(MessageError::TooLarge { .. })
        ));
        assert!(matches!(
            decode::<Ack>(br#"{"imported":true,"extra":1}"#),
            Err(MessageError::Malformed(_))
        ));
        assert!(matches!(
            decode::<Refusal>(br#"{"imported":true}"#),
            Err(MessageError::Malformed(_))
        ));
        // A request of before the metadata is version 1.
        let old: Request =
            decode(br#"{"object":{"region":"kv"},"generation":1}"#).expect("a version 1 request");
        assert_eq!(old.version, 1);
        assert_eq!(
            decode::<Answer>(br#"{"serving":2}"#).unwrap(),
            Answer::Stale(Refusal { serving: Some(2) })
        );
        assert_eq!(
            decode::<Answer>(br#"{"speaks":2}"#).unwrap(),
            Answer::Unsupported(Unsupported { speaks: 2 })
        );
        assert!(decode::<Answer>(br#"{"serving":2,"speaks":2}"#).is_err());
    }
}
