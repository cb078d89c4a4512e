//! zstd for records kept compressed at rest (log chunks, SBOM skeletons and
//! components): one level, one place.

use super::{StoreError, StoreResult};

/// zstd level: fast, ratio ~5 on build logs.
const ZSTD_LEVEL: i32 = 3;

/// In-memory zstd does not fail on valid input; if it ever did, that is an
/// error, not a default.
pub fn compress(raw: &[u8]) -> StoreResult<Vec<u8>> {
    zstd::bulk::compress(raw, ZSTD_LEVEL)
        .map_err(|e| StoreError::corrupt(format!("cannot compress: {e}")))
}

pub fn decompress(compressed: &[u8]) -> StoreResult<Vec<u8>> {
    zstd::stream::decode_all(compressed)
        .map_err(|e| StoreError::corrupt(format!("stored bytes do not decompress: {e}")))
}
