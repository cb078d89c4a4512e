//! How a build's log is kept at rest: zstd-compressed chunks of whole lines
//! (`LOG_CHUNKS`, keyed by build and chunk number). The engine cuts the
//! chunks; this module is the one place that knows their compression, so
//! the HTTP log route and the SSE replay read them back the same way.

use super::compress::{compress, decompress};
use super::{StoreError, StoreResult};

/// Compresses the raw text of one chunk.
pub fn compress_chunk(raw: &[u8]) -> StoreResult<Vec<u8>> {
    compress(raw)
}

/// Decompresses one stored chunk (its header already removed).
pub fn decompress_chunk(compressed: &[u8]) -> StoreResult<Vec<u8>> {
    decompress(compressed)
}

/// Decompresses a chunk whose text the index says is `raw_len` bytes, in
/// one pass into a buffer of exactly that size (the streaming decoder grows
/// its buffer by doubling: five copies of a 1 MiB chunk). A chunk that
/// holds more than its index says is corrupt.
pub fn decompress_chunk_sized(compressed: &[u8], raw_len: u64) -> StoreResult<Vec<u8>> {
    let capacity = usize::try_from(raw_len)
        .map_err(|_| StoreError::corrupt("a log chunk larger than memory"))?;
    let raw = zstd::bulk::decompress(compressed, capacity)
        .map_err(|e| StoreError::corrupt(format!("a log chunk does not decompress: {e}")))?;
    if raw.len() != capacity {
        return Err(StoreError::corrupt(
            "a log chunk shorter than its index says",
        ));
    }
    Ok(raw)
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
    fn a_sized_chunk_must_be_exactly_its_indexed_size() {
        let raw = b"line one\nline two\n".repeat(1000);
        let c = compress_chunk(&raw).unwrap();
        assert_eq!(decompress_chunk_sized(&c, raw.len() as u64).unwrap(), raw);
        assert!(decompress_chunk_sized(&c, raw.len() as u64 - 1).is_err());
        assert!(decompress_chunk_sized(&c, raw.len() as u64 + 1).is_err());
        assert!(decompress_chunk_sized(b"not zstd", 10).is_err());
    }

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
