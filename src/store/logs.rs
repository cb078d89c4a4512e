//! How a build's log is kept at rest: zstd-compressed chunks of whole lines
//! (`LOG_CHUNKS`, keyed by build and chunk number). The engine cuts the
//! chunks; this module is the one place that knows their compression, so
//! the HTTP log route and the SSE replay read them back the same way.

use super::compress::{compress, decompress};
use super::StoreResult;

/// Compresses the raw text of one chunk.
pub fn compress_chunk(raw: &[u8]) -> StoreResult<Vec<u8>> {
    compress(raw)
}

/// Decompresses one stored chunk (its header already removed).
pub fn decompress_chunk(compressed: &[u8]) -> StoreResult<Vec<u8>> {
    decompress(compressed)
}

/// Decompresses a build's stored chunks into its log text.
pub fn decompress_chunks(chunks: &[(u64, Vec<u8>)]) -> StoreResult<Vec<u8>> {
    let mut out = Vec::new();
    for (_, c) in chunks {
        out.extend_from_slice(&decompress_chunk(c)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_round_trip_and_garbage_is_an_error() {
        let raw = b"line one\nline two\n".repeat(100);
        let c = compress_chunk(&raw).unwrap();
        assert!(c.len() < raw.len());
        assert_eq!(
            decompress_chunks(&[(0, c.clone()), (200, c)])
                .unwrap()
                .len(),
            raw.len() * 2
        );
        assert!(decompress_chunk(b"not zstd").is_err());
    }
}
