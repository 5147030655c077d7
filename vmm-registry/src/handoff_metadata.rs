//! An offer's metadata on the hand-off stream (version 2, after the descriptor): opaque bytes,
//! announced by a [`MetadataHeader`] and carried by `DATA` pages, because vmm-core's `DATA`
//! messages are at most [`MAX_DATA`] bytes.
//!
//! A page is [`PAGE_TAG`] (4 bytes), its index (`u32`, little-endian, from 0), then its
//! payload: [`PAGE_PAYLOAD`] bytes for every page but the last, which carries the rest. The
//! header's page count is exactly what the length needs (no empty pages; none for no
//! metadata). The importer chooses how much it takes ([`DEFAULT_MAX_METADATA`] unless its
//! `Fetcher` says otherwise), checks the announced length against that before it allocates,
//! and checks every page's length, tag and index before it keeps a byte of it.

use vmm_core::peer::MAX_DATA;

use crate::handoff::{MessageError, MetadataHeader, decode};

/// The first bytes of every metadata page.
pub const PAGE_TAG: [u8; 4] = *b"VMD2";

/// The bytes before a page's payload: its tag and index.
const PAGE_HEADER: usize = PAGE_TAG.len() + 4;

/// The payload of every metadata page but the last.
pub const PAGE_PAYLOAD: usize = MAX_DATA - PAGE_HEADER;

/// How much metadata an importer takes unless told otherwise: 4 MiB.
pub const DEFAULT_MAX_METADATA: usize = 4 << 20;

/// Why the metadata that followed a descriptor was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// The header was not a metadata header.
    #[error("the metadata header was refused")]
    Header(#[source] MessageError),
    /// A descriptor came where the metadata's header or a page was expected.
    #[error("a descriptor came where metadata was expected")]
    NotData,
    /// More metadata announced than the importer takes: refused before anything was
    /// allocated for it.
    #[error("{announced} bytes of metadata announced, over the importer's cap of {max}")]
    TooLarge {
        /// What the exporter announced.
        announced: u64,
        /// The importer's cap.
        max: usize,
    },
    /// The page count is not what the length needs.
    #[error("{bytes} bytes of metadata announced in {pages} pages, not {expected}")]
    PageCount {
        /// The length announced.
        bytes: u64,
        /// The pages announced.
        pages: u64,
        /// The pages that length takes.
        expected: u64,
    },
    /// A page was not the page expected.
    #[error("metadata page {index}: {rule:?}")]
    Page {
        /// Which page (from 0).
        index: u64,
        /// What it broke.
        rule: PageRule,
    },
}

/// What a metadata page broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageRule {
    /// Shorter than a page's tag and index.
    TooShort,
    /// Not [`PAGE_TAG`].
    Tag,
    /// Another page's index (what it said).
    Index(u32),
    /// Not the payload length its place needs (what it carried).
    Length(usize),
}

/// The header that announces `metadata`.
pub(crate) fn header(metadata: &[u8]) -> MetadataHeader {
    let bytes = metadata.len() as u64;
    MetadataHeader {
        bytes,
        pages: pages_for(bytes),
    }
}

/// The pages that carry `metadata`, each the bytes of one `DATA` message, made as they are
/// sent.
pub(crate) fn pages(metadata: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    metadata
        .chunks(PAGE_PAYLOAD)
        .enumerate()
        .map(|(index, payload)| {
            let mut page = Vec::with_capacity(PAGE_HEADER + payload.len());
            page.extend_from_slice(&PAGE_TAG);
            // At most u32::MAX pages of 16 KiB: no offer comes near (the importer's cap
            // would refuse it long before).
            page.extend_from_slice(&(index as u32).to_le_bytes());
            page.extend_from_slice(payload);
            page
        })
}

/// The pages `bytes` of metadata take.
fn pages_for(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE_PAYLOAD as u64)
}

/// The header read from the exporter, checked: its form, the importer's cap `max`, and its
/// page count. Only then may the caller allocate `bytes`.
pub(crate) fn check_header(message: &[u8], max: usize) -> Result<MetadataHeader, MetadataError> {
    let header: MetadataHeader = decode(message).map_err(MetadataError::Header)?;
    if header.bytes > max as u64 {
        return Err(MetadataError::TooLarge {
            announced: header.bytes,
            max,
        });
    }
    let expected = pages_for(header.bytes);
    if header.pages != expected {
        return Err(MetadataError::PageCount {
            bytes: header.bytes,
            pages: header.pages,
            expected,
        });
    }
    Ok(header)
}

/// Page `index` of the metadata `header` announced, checked (its size first, then its tag,
/// its index and its payload's length); its payload.
pub(crate) fn check_page<'p>(
    page: &'p [u8],
    index: u64,
    header: &MetadataHeader,
) -> Result<&'p [u8], MetadataError> {
    let refuse = |rule| MetadataError::Page { index, rule };
    if page.len() < PAGE_HEADER {
        return Err(refuse(PageRule::TooShort));
    }
    let (head, payload) = page.split_at(PAGE_HEADER);
    if head[..PAGE_TAG.len()] != PAGE_TAG {
        return Err(refuse(PageRule::Tag));
    }
    let mut said = [0u8; 4];
    said.copy_from_slice(&head[PAGE_TAG.len()..]);
    let said = u32::from_le_bytes(said);
    if u64::from(said) != index {
        return Err(refuse(PageRule::Index(said)));
    }
    let before = index.saturating_mul(PAGE_PAYLOAD as u64);
    let expected = header.bytes.saturating_sub(before).min(PAGE_PAYLOAD as u64);
    if payload.len() as u64 != expected {
        return Err(refuse(PageRule::Length(payload.len())));
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::encode as encode_message;

    fn round_trip(metadata: &[u8]) -> Vec<u8> {
        let pages: Vec<Vec<u8>> = pages(metadata).collect();
        let header =
            check_header(&encode_message(&header(metadata)), usize::MAX).expect("the header");
        assert_eq!(header.pages, pages.len() as u64);
        let mut out = Vec::new();
        for (index, page) in pages.iter().enumerate() {
            assert!(page.len() <= MAX_DATA);
            out.extend_from_slice(check_page(page, index as u64, &header).expect("a page"));
        }
        out
    }

    #[test]
    fn metadata_of_any_length_crosses_in_pages() {
        for len in [
            0,
            1,
            PAGE_PAYLOAD - 1,
            PAGE_PAYLOAD,
            PAGE_PAYLOAD + 1,
            3 * PAGE_PAYLOAD,
        ] {
            let metadata: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            assert_eq!(round_trip(&metadata), metadata, "{len} bytes");
        }
    }

    #[test]
    fn a_header_past_the_cap_or_with_the_wrong_count_is_refused() {
        let announce = |bytes, pages| encode_message(&MetadataHeader { bytes, pages });
        assert!(matches!(
            check_header(&announce(u64::MAX, pages_for(u64::MAX)), 1 << 20),
            Err(MetadataError::TooLarge {
                announced: u64::MAX,
                ..
            })
        ));
        assert!(matches!(
            check_header(&announce(10, 2), 1 << 20),
            Err(MetadataError::PageCount { expected: 1, .. })
        ));
        assert!(matches!(
            check_header(&announce(0, 1), 1 << 20),
            Err(MetadataError::PageCount { expected: 0, .. })
        ));
        assert!(matches!(
            check_header(br#"{"bytes":1,"pages":1,"more":1}"#, 1 << 20),
            Err(MetadataError::Header(MessageError::Malformed(_)))
        ));
    }

    #[test]
    fn a_page_out_of_its_place_is_refused() {
        let metadata = vec![7u8; PAGE_PAYLOAD + 10];
        let (header, pages) = (header(&metadata), pages(&metadata).collect::<Vec<_>>());
        let rule = |page: &[u8], index| match check_page(page, index, &header) {
            Err(MetadataError::Page { rule, .. }) => rule,
            other => panic!("expected a refused page, got {other:?}"),
        };
        assert_eq!(rule(&pages[0][..5], 0), PageRule::TooShort);
        let mut tagged = pages[0].clone();
        tagged[0] = b'X';
        assert_eq!(rule(&tagged, 0), PageRule::Tag);
        assert_eq!(rule(&pages[1], 0), PageRule::Index(1));
        assert_eq!(rule(&pages[0][..100], 0), PageRule::Length(92));
        let mut long = pages[1].clone();
        long.push(0);
        assert_eq!(rule(&long, 1), PageRule::Length(11));
    }
}
