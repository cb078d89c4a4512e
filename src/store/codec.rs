//! How records become bytes: one version byte, then bincode 2 (standard config).
//!
//! The version byte lets a later schema read an older record instead of
//! silently misreading it.

use serde::{de::DeserializeOwned, Serialize};

/// Bumped when any record's layout changes; `decode` refuses other versions.
pub const RECORD_VERSION: u8 = 1;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(value, &mut out);
    out
}

/// Writes `value`'s record bytes (version byte, then bincode) at the end of
/// `out`.
fn encode_into<T: Serialize>(value: &T, out: &mut Vec<u8>) {
    out.push(RECORD_VERSION);
    // Encoding plain structs into a Vec cannot fail.
    bincode::serde::encode_into_std_write(value, out, bincode::config::standard())
        .expect("bincode encoding into a Vec");
}

/// A scratch buffer that grew past this (a large record) is given back
/// rather than kept by the thread.
const KEPT_SCRATCH_BYTES: usize = 64 << 10;

/// Encodes `value` as `encode` does, into a buffer the thread keeps, and
/// hands the bytes to `use_bytes`. Why: the writer encodes every record it
/// stores (five or so per submit, each copied at once into redb and the
/// redo log), and a fresh `Vec` grown from one byte reallocated about ten
/// times per record.
pub fn with_encoded<T: Serialize, R>(value: &T, use_bytes: impl FnOnce(&[u8]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut buffer) => {
            buffer.clear();
            encode_into(value, &mut buffer);
            let result = use_bytes(&buffer);
            if buffer.capacity() > KEPT_SCRATCH_BYTES {
                *buffer = Vec::new();
            }
            result
        }
        // Called again from inside `use_bytes`: this call gets its own.
        Err(_) => use_bytes(&encode(value)),
    })
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

    /// A byte field as one run (`serde_bytes`, as `IdempotencyRecord`'s)
    /// is encoded exactly as the sequence of `u8` that records stored
    /// before it held, so both read the other's bytes: no record changes.
    #[test]
    fn bytes_as_one_run_encode_as_a_sequence_of_bytes_did() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct AsSequence {
            body: Vec<u8>,
            after: u16,
        }
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct AsRun {
            #[serde(with = "serde_bytes")]
            body: Vec<u8>,
            after: u16,
        }
        for len in [0usize, 1, 250, 251, 600, 70_000] {
            let body: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            let old = encode(&AsSequence {
                body: body.clone(),
                after: 513,
            });
            let new = encode(&AsRun {
                body: body.clone(),
                after: 513,
            });
            assert_eq!(old, new, "{len} bytes");
            assert_eq!(
                decode::<AsRun>(&old).unwrap(),
                AsRun {
                    body: body.clone(),
                    after: 513
                }
            );
            assert_eq!(
                decode::<AsSequence>(&new).unwrap(),
                AsSequence { body, after: 513 }
            );
        }
    }

    /// The kept buffer gives the same bytes as `encode`, also when called
    /// again from inside itself, and after a record larger than it keeps.
    #[test]
    fn encoding_with_the_kept_buffer_equals_encode() {
        let small = ("alice".to_string(), 7u64);
        let large = ("x".repeat(KEPT_SCRATCH_BYTES + 1), 8u64);
        with_encoded(&small, |outer| {
            assert_eq!(outer, encode(&small).as_slice());
            with_encoded(&large, |inner| assert_eq!(inner, encode(&large).as_slice()));
        });
        with_encoded(&large, |b| assert_eq!(b, encode(&large).as_slice()));
        with_encoded(&small, |b| assert_eq!(b, encode(&small).as_slice()));
    }

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
