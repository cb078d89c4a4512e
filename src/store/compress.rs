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

/// Decompresses many small records with one zstd context and one scratch
/// buffer: a fresh context per record (as `decompress` makes) costs more
/// than a 300-byte record.
pub struct Unpacker {
    context: zstd::bulk::Decompressor<'static>,
    scratch: Vec<u8>,
}

impl Unpacker {
    pub fn new() -> StoreResult<Unpacker> {
        let context = zstd::bulk::Decompressor::new()
            .map_err(|e| StoreError::other(format!("cannot make a zstd context: {e}")))?;
        Ok(Unpacker {
            context,
            scratch: Vec::new(),
        })
    }

    /// Appends the record's bytes to `out`: at most `max` bytes.
    pub fn unpack_into(
        &mut self,
        compressed: &[u8],
        max: usize,
        out: &mut Vec<u8>,
    ) -> StoreResult<()> {
        let corrupt =
            |what: &str| StoreError::corrupt(format!("stored bytes do not decompress: {what}"));
        let size = zstd::bulk::Decompressor::upper_bound(compressed)
            .ok_or_else(|| corrupt("no size recorded"))?;
        if size > max {
            return Err(corrupt("larger than allowed"));
        }
        self.scratch.clear();
        self.scratch.reserve(size);
        self.context
            .decompress_to_buffer(compressed, &mut self.scratch)
            .map_err(|e| corrupt(&e.to_string()))?;
        out.extend_from_slice(&self.scratch);
        Ok(())
    }
}
