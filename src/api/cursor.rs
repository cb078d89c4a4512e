//! Opaque pagination cursors: `<hex payload>.<hex HMAC>`, the MAC over the
//! caller's subject, the filter and the payload, with a key kept in the data
//! dir. An altered, foreign or cross-filter cursor does not verify.

use hmac::{KeyInit, Mac};
use sha2::Sha256;

use super::errors::ApiError;

fn mac(key: &[u8], subject: &str, filter: &str, payload: &[u8]) -> Vec<u8> {
    let mut m = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    for part in [subject.as_bytes(), b"\0", filter.as_bytes(), b"\0", payload] {
        m.update(part);
    }
    m.finalize().into_bytes().to_vec()
}

pub fn encode(key: &[u8], subject: &str, filter: &str, position: &str) -> String {
    let payload = position.as_bytes();
    format!(
        "{}.{}",
        crate::hex::encode(payload),
        crate::hex::encode(&mac(key, subject, filter, payload))
    )
}

/// The position inside a cursor, or `invalid_request` / `cursor_invalid`.
pub fn decode(key: &[u8], subject: &str, filter: &str, cursor: &str) -> Result<String, ApiError> {
    let invalid = || {
        ApiError::bad_request("the cursor is not valid for this list")
            .field("/query/cursor", "cursor_invalid")
    };
    let (payload, tag) = cursor.split_once('.').ok_or_else(invalid)?;
    let payload = crate::hex::decode(payload).ok_or_else(invalid)?;
    let tag = crate::hex::decode(tag).ok_or_else(invalid)?;
    if !super::auth::constant_time_eq(&tag, &mac(key, subject, filter, &payload)) {
        return Err(invalid());
    }
    String::from_utf8(payload).map_err(|_| invalid())
}

/// Page size bounds and default.
pub const MAX_PAGE: usize = 200;
pub const DEFAULT_PAGE: usize = 50;

/// The `limit` query of every paged list (deployments, builds, audit
/// events, deliveries): one rule, one message.
pub fn page_limit(req: &super::Request) -> Result<usize, ApiError> {
    match req.query_one("limit") {
        None => Ok(DEFAULT_PAGE),
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_PAGE).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("limit must be a whole number from 1 to 200")
                    .field("/query/limit", "range")
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_to_key_subject_and_filter() {
        let c = encode(b"k", "alice", "ids=a,b", "b");
        assert_eq!(decode(b"k", "alice", "ids=a,b", &c).unwrap(), "b");
        assert!(decode(b"k", "bob", "ids=a,b", &c).is_err());
        assert!(decode(b"k", "alice", "", &c).is_err());
        assert!(decode(b"other", "alice", "ids=a,b", &c).is_err());
        let mut tampered = c.clone();
        tampered.replace_range(0..2, "63");
        assert!(decode(b"k", "alice", "ids=a,b", &tampered).is_err());
        assert!(decode(b"k", "alice", "ids=a,b", "garbage").is_err());
    }
}
