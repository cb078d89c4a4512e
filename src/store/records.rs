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
