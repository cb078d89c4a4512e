//! The small records the store keeps beside deployments and builds: a
//! stored idempotent response, a pending destroy callback, a stored event.

use serde::{Deserialize, Serialize};

use crate::model::Millis;

/// A stored response to a mutation, replayed for the same idempotency key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub fingerprint: Vec<u8>,
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub expires_at: Millis,
}

/// A destroy callback waiting to be sent (or retried).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PendingCallback {
    pub url: String,
    pub deployment: String,
    /// False until the destroy succeeds.
    pub armed: bool,
    pub attempts: u32,
    pub next_at: Millis,
    pub first_at: Millis,
}

/// One stored event of a channel (events.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredEvent {
    pub event: String,
    pub data: String,
    pub at: Millis,
}

/// Where one log chunk sits in its build's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlace {
    pub number: u32,
    /// Index of its first line in the build's log.
    pub first_line: u64,
    /// Offset of its first byte in the build's log text.
    pub first_byte: u64,
    /// Its length, uncompressed.
    pub raw_len: u64,
}

impl ChunkPlace {
    pub(super) fn encode(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.first_line.to_le_bytes());
        out[8..16].copy_from_slice(&self.first_byte.to_le_bytes());
        out[16..].copy_from_slice(&self.raw_len.to_le_bytes());
        out
    }

    pub(super) fn decode(number: u32, bytes: &[u8]) -> Option<ChunkPlace> {
        let word = |i: usize| Some(u64::from_le_bytes(bytes.get(i..i + 8)?.try_into().ok()?));
        (bytes.len() == 24).then_some(())?;
        Some(ChunkPlace {
            number,
            first_line: word(0)?,
            first_byte: word(8)?,
            raw_len: word(16)?,
        })
    }
}
