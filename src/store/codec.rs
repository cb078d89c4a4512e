//! How records become bytes: one version byte, then bincode 2 (standard config).
//!
//! The version byte lets a later schema read an older record instead of
//! silently misreading it.

use serde::{de::DeserializeOwned, Serialize};

/// Bumped when any record's layout changes; `decode` refuses other versions.
pub const RECORD_VERSION: u8 = 1;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = vec![RECORD_VERSION];
    // Encoding plain structs into a Vec cannot fail.
    bincode::serde::encode_into_std_write(value, &mut out, bincode::config::standard())
        .expect("bincode encoding into a Vec");
    out
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match bytes.split_first() {
        Some((&RECORD_VERSION, rest)) => {
            bincode::serde::decode_from_slice(rest, bincode::config::standard())
                .map(|(v, _)| v)
                .map_err(|e| format!("corrupt record: {e}"))
        }
        Some((v, _)) => Err(format!("record version {v} is not supported by this berth")),
        None => Err("empty record".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_version_check() {
        let bytes = encode(&("alice".to_string(), 7u64));
        let back: (String, u64) = decode(&bytes).unwrap();
        assert_eq!(back, ("alice".to_string(), 7));
        let mut other = bytes.clone();
        other[0] = 9;
        assert!(decode::<(String, u64)>(&other)
            .unwrap_err()
            .contains("version 9"));
    }
}
