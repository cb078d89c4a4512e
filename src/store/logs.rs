//! How a build's log is kept at rest: zstd-compressed chunks of whole lines
//! (`LOG_CHUNKS`, keyed by build and chunk number). The engine cuts the
//! chunks; this module is the one place that knows their compression, so
//! the HTTP log route and the SSE replay read them back the same way.

use super::{StoreError, StoreResult};

/// zstd level for log chunks (fast, ratio ~5 on build logs).
const LOG_ZSTD_LEVEL: i32 = 3;

/// Compresses the raw text of one chunk. zstd at level 3 does not fail on
/// in-memory input; if it ever did, the raw text is an error, not a default.
pub fn compress_chunk(raw: &[u8]) -> StoreResult<Vec<u8>> {
    zstd::bulk::compress(raw, LOG_ZSTD_LEVEL)
        .map_err(|e| StoreError::corrupt(format!("a log chunk does not compress: {e}")))
}

/// Decompresses one stored chunk (its header already removed).
pub fn decompress_chunk(compressed: &[u8]) -> StoreResult<Vec<u8>> {
    zstd::stream::decode_all(compressed)
        .map_err(|e| StoreError::corrupt(format!("a stored log chunk does not decompress: {e}")))
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
