//! The small records the store keeps beside deployments and builds: a
//! stored idempotent response, a pending destroy callback, a stored event.

use serde::{Deserialize, Serialize};

use crate::model::Millis;

/// A stored response to a mutation, replayed for the same idempotency key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    /// Bytes as one run (`serde_bytes`): the same encoding as a sequence of
    /// `u8` in bincode (a length, then the bytes), written and read without
    /// a call per byte; a submit's answer is ~600 bytes, on the writer
    /// thread (`codec` tests the two encodings are equal).
    #[serde(with = "serde_bytes")]
    pub fingerprint: Vec<u8>,
    pub status: u16,
    pub content_type: String,
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    pub expires_at: Millis,
    /// Whose key it is, part by part (the table's key joins them; the
    /// export needs them apart, and no part may hold the separator).
    pub identity: IdempotencyIdentity,
}

/// Who sent an idempotency key, on which route.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyIdentity {
    pub principal: Principal,
    /// The actor's subject and issuer (none for the service acting as itself).
    pub subject: Option<String>,
    pub issuer: Option<String>,
    /// The route template.
    pub route: String,
    pub key: String,
}

/// The kind of caller a principal is (`api::auth::Caller::identity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Principal {
    /// The service token acting as itself.
    Service,
    /// The service token naming an actor.
    Backend,
    /// A token the authorization callback knows.
    Callback,
}

impl Principal {
    pub fn as_str(self) -> &'static str {
        match self {
            Principal::Service => "service",
            Principal::Backend => "backend",
            Principal::Callback => "callback",
        }
    }

    pub fn named(name: &str) -> Option<Principal> {
        [Principal::Service, Principal::Backend, Principal::Callback]
            .into_iter()
            .find(|p| p.as_str() == name)
    }
}

impl IdempotencyIdentity {
    /// The table's key: the parts joined by U+0000, as layouts before 6
    /// stored them, so a key is the same across the migration.
    pub fn store_key(&self) -> String {
        match self.principal {
            Principal::Service => format!("service\u{0}{}\u{0}{}", self.route, self.key),
            Principal::Backend | Principal::Callback => format!(
                "{}\u{0}{}\u{0}{}\u{0}{}\u{0}{}",
                self.principal.as_str(),
                self.subject.as_deref().unwrap_or(""),
                self.issuer.as_deref().unwrap_or(""),
                self.route,
                self.key
            ),
        }
    }

    /// The parts of a joined key (the migration to layout 6). The route and
    /// the key never hold U+0000, so they are the last two parts.
    pub fn parse(joined: &str) -> Option<IdempotencyIdentity> {
        let mut from_right = joined.rsplitn(3, '\u{0}');
        let key = from_right.next()?.to_string();
        let route = from_right.next()?.to_string();
        let principal = from_right.next()?;
        let (principal, subject, issuer) = match principal.split('\u{0}').collect::<Vec<_>>()[..] {
            ["service"] => (Principal::Service, None, None),
            [kind, subject, issuer] => (
                Principal::named(kind).filter(|p| *p != Principal::Service)?,
                Some(subject.to_string()),
                (!issuer.is_empty()).then(|| issuer.to_string()),
            ),
            _ => return None,
        };
        Some(IdempotencyIdentity {
            principal,
            subject,
            issuer,
            route,
            key,
        })
    }
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

/// A webhook subscription (notifications.md): where berth tells what
/// happened, signed with its secret (Standard Webhooks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookRecord {
    pub url: String,
    /// Event types (`build.failed`, ...), or `["*"]` for all.
    pub events: Vec<String>,
    /// Only these deployments' events; `None`: every deployment's.
    pub deployments: Option<Vec<String>>,
    pub description: Option<String>,
    /// `whsec_` and the base64 of 32 random bytes.
    pub secret: String,
    pub created_at: Millis,
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    Pending,
    Delivered,
    Failed,
}

/// One event for one subscription, written in the transaction of the
/// change it reports (the outbox); its body and `webhook-id` never change
/// across retries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryRecord {
    pub event_type: String,
    /// The `webhook-id` header.
    pub message_id: String,
    /// The JSON body, exactly as sent on every attempt.
    pub body: String,
    pub created_at: Millis,
    pub status: DeliveryStatus,
    pub attempts: u32,
    pub last_attempt_at: Option<Millis>,
    pub last_status_code: Option<u16>,
    /// A code (`timeout`, `connect`, `tls`, `redirect`, `status`), never the
    /// receiver's words.
    pub last_error: Option<String>,
    /// When the next attempt is due; `None` once delivered or failed.
    pub next_attempt_at: Option<Millis>,
}
