//! What importer and exporter say to each other on the mutual-TLS stream, after the handshake
//! (each side has checked the other's certificate name by then):
//!
//! 1. the importer asks for one object at one generation ([`Request`], a `DATA` message);
//! 2. the exporter answers with the descriptor (a `CUDA_FABRIC` message), or with a
//!    [`Refusal`] (`DATA`) when it no longer serves that object at that generation;
//! 3. the importer says whether it imported ([`Ack`], `DATA`), so the exporter knows when its
//!    memory is in use elsewhere (a fabric handle does not keep the memory alive).
//!
//! Every message is JSON with unknown fields refused, and at most [`MAX_HANDOFF_MESSAGE`]
//! bytes, checked before it is parsed: each side treats the other's words as hostile even
//! after the handshake (a certificate proves a name, not good behaviour).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::locator::ExportedObject;

/// The largest hand-off message (request, refusal, acknowledgement), in bytes.
pub const MAX_HANDOFF_MESSAGE: usize = 1024;

/// The importer's question: this object, at this generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Request {
    pub(crate) object: ExportedObject,
    pub(crate) generation: u64,
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
    }
}
